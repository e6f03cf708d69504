"""The grace-window decision on 2 gloo ranks of an FSDP2 model: global bytes, one outcome.

The rate a save records counts each tensor once at its global size (a DTensor shard is
half of it on each of 2 ranks), and a requeued pair of ranks seeds its estimate from it.
When a signal reaches one rank and the save does not fit the window at that rate, both
ranks skip it at the same step, each with the numbers, and the checkpoint they restored
stays the newest, with no staging directory left.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import resumekit
from resumekit.runtime.preemption import EmergencySaveSkippedWarning
from resumekit.runtime.save_clock import state_bytes
from tests.distributed_harness import run_ranks

SIGNALLED_RANK = 1


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 32)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = _build()
    first = resumekit.CheckpointManager(root, model=model, optimizer=optimizer)
    _train(model, optimizer)
    first.save(5, blocking=True)
    first.close()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    counted = state_bytes({"model": model.state_dict(),
                           "optimizer": list(optimizer.state.values())})
    [path] = Path(root).glob("*5/manifest.json")
    recorded = json.loads(path.read_text())["save_throughput"]
    dist.barrier()
    if rank == 0:  # the pair's save took 1000 s for its bytes: no save fits a minute
        document = json.loads(path.read_text())
        document["save_throughput"]["seconds"] = 1000.0
        path.write_text(json.dumps(document))
    dist.barrier()

    model, optimizer = _build()
    handler = resumekit.PreemptionHandler(grace_period=60, poll_every=1, overlap=False)
    ckpt = resumekit.CheckpointManager(root, model=model, optimizer=optimizer,
                                       async_save=True, save_every=100, preemption=handler)
    start = ckpt.restore()
    stopped = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start + 1, start + 10):
            _train(model, optimizer)
            if rank == SIGNALLED_RANK and step == start + 2:
                os.kill(os.getpid(), signal.SIGTERM)
            if ckpt.step_end(step):
                stopped = step
                break
    latest = ckpt.latest()
    ckpt.close()
    return {"local_parameter_bytes": local, "counted": counted, "recorded": recorded,
            "start": start, "stopped": stopped,
            "newest": None if latest is None else latest.step,
            "skipped": [str(w.message) for w in caught
                        if w.category is EmergencySaveSkippedWarning],
            "staging": sorted(p.name for p in Path(root).glob(".*.tmp-*"))}


def test_both_ranks_skip_a_save_the_recorded_rate_says_would_be_cut(tmp_path: Path) -> None:
    results = run_ranks(_ranks, world_size=2, args=(str(tmp_path / "root"),))
    parameters = sum(p.numel() * 4 for p in nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).parameters())
    for result in results:
        # Weights and AdamW's two moments at their global size (plus the step counters),
        # not this rank's half.
        assert result["recorded"]["bytes"] == result["counted"] >= 3 * parameters
        assert result["local_parameter_bytes"] < parameters
        assert result["recorded"]["blocking"] is True
        assert (result["start"], result["stopped"], result["newest"]) == (5, 7, 5), result
        [message] = result["skipped"]
        assert "the blocking save of step 5, recorded before this restart" in message
        assert "step 5 stays the newest checkpoint" in message
        assert result["staging"] == []
