"""The emergency save at the signal on 2 gloo ranks of an FSDP2 model.

When every rank is signalled, each copies the last completed step at once and the ranks
commit it together while the step in progress runs (the weights of that step, not of the
optimizer step after the signal). When one rank only is signalled, the ranks hold no copy
of one same step: nothing is written at the signal, and the agreed preemption saves the
step it stops at, as before; no rank waits for another.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import resumekit
from tests.distributed_harness import run_ranks


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 32)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.to_local().detach().clone()
            for name, value in model.state_dict().items()}


def _ranks(rank: int, world_size: int, root: str, signalled: list[int]) -> dict[str, Any]:
    model, optimizer = _build()
    handler = resumekit.PreemptionHandler(grace_period=600, poll_every=1, overlap=False)
    ckpt = resumekit.CheckpointManager(root, model=model, optimizer=optimizer,
                                       save_every=100, capture_at_signal=True, preemption=handler)
    ckpt.restore()
    for step in (1, 2):
        _train(model, optimizer)
        assert not ckpt.step_end(step)
    at_two = _local(model)
    if rank in signalled:
        os.kill(os.getpid(), signal.SIGTERM)  # during step 3
    _train(model, optimizer)
    assert ckpt._emergency is not None
    outcome = ckpt._emergency.settle()  # a settle point on both ranks, before step_end(3)
    latest = ckpt.latest()
    before_step_end = None if latest is None else latest.step
    stopped = ckpt.step_end(3)
    ckpt.close()
    model2, optimizer2 = _build()
    reader = resumekit.CheckpointManager(root, model=model2, optimizer=optimizer2,
                                         read_only=True)
    same = None
    if before_step_end == 2:
        reader.restore(2)
        same = all(torch.equal(value, at_two[name]) for name, value in _local(model2).items())
    reader.close()
    return {"committed": None if outcome is None else outcome.committed,
            "before_step_end": before_step_end, "stopped": stopped, "same": same,
            "steps": [entry.step for entry in ckpt.checkpoints()]}


@pytest.mark.parametrize(("signalled", "expected"), [
    ([0, 1], {"committed": 2, "before_step_end": 2, "stopped": True, "same": True,
              "steps": [2, 3]}),
    ([1], {"committed": None, "before_step_end": None, "stopped": True, "same": None,
           "steps": [3]}),
], ids=["every-rank-signalled", "one-rank-signalled"])
def test_a_signal_commits_the_last_completed_step_mid_step_when_every_rank_holds_it(
    tmp_path: Path, signalled: list[int], expected: dict[str, Any],
) -> None:
    results = run_ranks(_ranks, world_size=2, args=(str(tmp_path / "root"), signalled))
    for result in results:
        assert result == expected
