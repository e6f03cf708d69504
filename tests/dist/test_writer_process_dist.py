"""async_writer="process" on 2 real gloo ranks: FSDP2 shards written by each rank's writer."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resumekit.errors import AsyncSaveError, WriterProcessError
from resumekit.manager import CheckpointManager
from resumekit.tools.testing import Probe, check_resume_equivalence, crash_after, stop_after
from tests.dist.tiny_fsdp2 import tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

DATA = torch.randn(64, 6, generator=torch.Generator().manual_seed(7))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    rank = dist.get_rank()
    batch = DATA[(step * 4 + rank * 2) % 60:][:2]
    loss = model(batch).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _train(root: str, num_steps: int, probe: Probe) -> dict[str, Any]:
    model, optimizer = tiny_fsdp2_adamw()
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, save_every=2,
                             async_save=True, async_writer="process")
    start = ckpt.restore()
    for step in range(start, num_steps):
        loss = _step(model, optimizer, step)
        ckpt.step_end(step + 1)
        probe.after_step(step + 1, loss, ckpt)
    ckpt.close()
    return {"model": model, "optimizer": optimizer}


def _equivalence(rank: int, world: int, workdir: str) -> tuple[bool, str]:
    report = check_resume_equivalence(_train, num_steps=7,
                                      interruptions=[stop_after(3), crash_after(5)],
                                      workdir=workdir)
    return report.equivalent, report.describe()


def test_fsdp2_shards_written_by_writer_processes_resume_bit_identically(
        tmp_path: Path) -> None:
    for equivalent, description in run_ranks(_equivalence, 2, args=(str(tmp_path),)):
        assert equivalent, description


def _killed_writer(rank: int, world: int, root: str) -> tuple[str, Any, Any, bool]:
    model, optimizer = tiny_fsdp2_adamw()
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, async_save=True,
                             async_writer="process")
    _step(model, optimizer, 0)
    ckpt.save(1)
    ckpt.wait()
    saved = {key: value.full_tensor().clone() for key, value in model.state_dict().items()}
    writer = ckpt._writer
    assert writer is not None
    if rank == 1:  # rank 1's writer dies once it has the request of step 2
        original = writer._receive

        def receive(process: subprocess.Popen[bytes], connection: Any) -> Any:
            os.kill(process.pid, signal.SIGKILL)
            return original(process, connection)

        writer._receive = receive  # type: ignore[method-assign]
    _step(model, optimizer, 1)
    ckpt.save(2)
    try:
        ckpt.wait()
        outcome: tuple[str, Any, Any] = ("committed", None, None)
    except AsyncSaveError as error:
        cause = error.__cause__
        assert isinstance(cause, WriterProcessError), repr(cause)
        outcome = (str(error), cause.pid, cause.signal)
    ckpt.close()
    fresh, fresh_optimizer = tiny_fsdp2_adamw()
    reader = CheckpointManager(root, model=fresh, optimizer=fresh_optimizer)
    restored = reader.restore()
    same = restored == 1 and all(
        torch.equal(value.full_tensor(), saved[key])
        for key, value in fresh.state_dict().items())
    reader.close()
    return (*outcome, same)


def test_a_writer_process_killed_on_one_rank_fails_the_save_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_killed_writer, 2, args=(str(tmp_path),))
    pids = {pid for _, pid, _, _ in results}
    assert len(pids) == 1 and None not in pids  # both name rank 1's writer
    for message, pid, name, same in results:
        assert name == "SIGKILL" and f"pid {pid}" in message and "step 2" in message
        assert same  # step 1 restores, bit-identical, on both ranks
