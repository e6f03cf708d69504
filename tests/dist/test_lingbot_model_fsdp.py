"""One step of the LingBot-VA example on two FSDP2 ranks (gloo, CPU) against one process.

Multi-process, so it lives in the dist layer; the one-process tests of the same model,
losses and schedule are tests/unit/test_lingbot_model.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from examples.lingbot.model import shard_model
from examples.lingbot.recipe import (
    FlowNoise,
    build_optimizer,
    build_scheduler,
    flow_matching_loss,
    sample_flow_noise,
)
from tests.distributed_harness import run_ranks
from tests.unit.test_lingbot_model import TINY, _batch, _tiny_model

NOISE_SEED = 100


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_one_step(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    noise: FlowNoise) -> dict[str, Any]:
    """Loss, backward, clip, AdamW + scheduler step, loss again on the same draws."""
    optimizer = build_optimizer(model, TINY.optim)
    scheduler = build_scheduler(optimizer, TINY.optim)
    before = flow_matching_loss(model, batch, noise)
    before.loss.backward()
    grads = {name: _full(p.grad).clone() for name, p in model.named_parameters()}
    norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), TINY.optim.grad_clip))
    optimizer.step()
    scheduler.step()
    after = flow_matching_loss(model, batch, noise)
    return {
        "before": torch.stack(list(before)).detach(),
        "after": torch.stack(list(after)).detach(),
        "grad_norm": norm.detach(),
        "grads": grads,
        "params": {name: _full(p.detach()).clone() for name, p in model.named_parameters()},
    }


def _rank_noise(rank: int) -> tuple[dict[str, torch.Tensor], FlowNoise]:
    per_rank = TINY.train.micro_batch_size
    batch = _batch(range(rank * per_rank, (rank + 1) * per_rank))
    return batch, sample_flow_noise(batch, torch.Generator().manual_seed(NOISE_SEED + rank))


def _fsdp_rank(rank: int, world_size: int) -> dict[str, Any]:
    batch, noise = _rank_noise(rank)
    model = shard_model(_tiny_model(), mixed_precision=False)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    result = _train_one_step(model, batch, noise)
    for key in ("before", "after"):  # the loss of the global batch: the mean over ranks
        dist.all_reduce(result[key])
        result[key] /= world_size

    # bf16 compute with fp32 reduction runs too (gloo on CPU) and lands near fp32.
    mixed = shard_model(_tiny_model(), mixed_precision=True)
    sharded_dtype = next(mixed.parameters()).dtype
    inputs = {"latents": batch["latents"], "timesteps": noise.timesteps, "text": batch["text"],
              "actions": batch["actions"], "action_timesteps": noise.action_timesteps}
    result["mixed_dtypes"] = (mixed(inputs)[0].dtype, sharded_dtype)
    mixed_loss = flow_matching_loss(mixed, batch, noise).loss
    mixed_loss.backward()
    dist.all_reduce(mixed_loss.detach_())
    result["mixed_loss"] = mixed_loss / world_size
    result["mixed_grads_finite"] = all(bool(torch.isfinite(_full(p.grad)).all())
                                       for p in mixed.parameters())
    return result


def test_one_fsdp2_step_on_two_ranks_matches_one_process_on_the_global_batch() -> None:
    ranks = run_ranks(_fsdp_rank, world_size=2)

    parts = [_rank_noise(rank) for rank in range(2)]
    batch = _batch(range(4))
    single = _train_one_step(_tiny_model(), batch, FlowNoise.cat([noise for _, noise in parts]))

    assert single["grad_norm"] > TINY.optim.grad_clip, "clipping must be exercised"
    for result in ranks:
        torch.testing.assert_close(result["before"], single["before"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["grad_norm"], single["grad_norm"], rtol=1e-5,
                                   atol=1e-6)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
        # The first AdamW step moves each weight by about lr / warmup = 2e-4.
        for name, param in single["params"].items():
            torch.testing.assert_close(result["params"][name], param, rtol=0, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} after the step: {m}")
        torch.testing.assert_close(result["after"], single["after"], rtol=1e-5, atol=1e-6)
        assert result["after"][0] < result["before"][0]

        assert result["mixed_dtypes"] == (torch.bfloat16, torch.float32)
        torch.testing.assert_close(result["mixed_loss"], single["before"][0], rtol=1e-2, atol=0)
        assert result["mixed_grads_finite"]
