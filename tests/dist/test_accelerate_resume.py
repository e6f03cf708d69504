"""Accelerate on 2 real processes (gloo, CPU): ``CheckpointManager`` takes what
``accelerator.prepare()`` returns, and an interrupted run resumes bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from resumekit.manager import CheckpointManager
from resumekit.sampler import ResumableDistributedSampler
from tests.distributed_harness import run_ranks

DATA = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
BATCH = 4
STEPS = 5


def _objects(accelerator: Any) -> tuple[Any, Any, Any, ResumableDistributedSampler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sampler = ResumableDistributedSampler(len(DATA), seed=3)
    return model, optimizer, scheduler, sampler


def _run(accelerator: Any, root: str | None, stop_at: int | None) -> dict[str, torch.Tensor]:
    model, optimizer, scheduler, sampler = _objects(accelerator)
    ckpt = None if root is None else CheckpointManager(
        root, model=model, optimizer=optimizer, scheduler=scheduler, data=sampler,
        save_every=3)
    start = 0 if ckpt is None else ckpt.restore()
    batches = iter(sampler)
    for step in range(start, STEPS):
        x = DATA[[next(batches) for _ in range(BATCH)]]
        noise = torch.randn(BATCH, 2)  # the global RNG: restored per rank
        loss = (model(x) - noise).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        sampler.advance(BATCH)
        if ckpt is not None:
            ckpt.step_end(step + 1)
        if stop_at is not None and step + 1 == stop_at:
            break  # the job is killed here, after the checkpoint of step 3, before step 5
    if ckpt is not None:
        if stop_at is None:
            ckpt.finish(STEPS)
        ckpt.close()
    unwrapped = accelerator.unwrap_model(model)
    return {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}


def _accelerate(rank: int, world_size: int, root: str) -> dict[str, Any]:
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size
    torch.manual_seed(42 + rank)
    reference = _run(accelerator, None, None)
    torch.manual_seed(42 + rank)
    _run(accelerator, root, stop_at=4)
    torch.manual_seed(1000 + rank)  # a relaunch seeds differently: the restore decides
    resumed = _run(accelerator, root, None)
    return {"reference": reference, "resumed": resumed,
            "distributed": str(accelerator.distributed_type)}


def test_an_accelerate_run_on_two_processes_resumes_bit_for_bit(tmp_path: Path) -> None:
    results = run_ranks(_accelerate, 2, args=(str(tmp_path / "root"),), init_group=False)
    for result in results:
        assert "MULTI_CPU" in result["distributed"]
        assert result["reference"].keys() == result["resumed"].keys()
        for key, tensor in result["reference"].items():
            assert torch.equal(result["resumed"][key], tensor), key
