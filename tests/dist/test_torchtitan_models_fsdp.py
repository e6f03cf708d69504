"""torchtitan's stock llama3 (fused QKV) FSDP2-sharded on 2 gloo ranks: save, restore, reshard.

Needs torchtitan's model classes (tests/torchtitan_models.py says how they are installed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from resumekit.manager import CheckpointManager
from tests.distributed_harness import run_ranks
from tests.torchtitan_models import fake_steps, llama3


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = llama3(seed=seed)
    if dist.is_initialized():
        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, optimizer = _sharded(seed=0)
    fake_steps(model, optimizer, 2)
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer)
    ckpt.save(2)
    ckpt.close()
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    return {"params": {name: _full(p) for name, p in model.named_parameters()},
            "exp_avg": _full(optimizer.state[wqkv]["exp_avg"])}


def _restore(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, optimizer = _sharded(seed=1)
    assert CheckpointManager(root, model=model, optimizer=optimizer).restore() == 2
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    return {"params": {name: _full(p) for name, p in model.named_parameters()},
            "exp_avg": _full(optimizer.state[wqkv]["exp_avg"])}


def test_torchtitans_sharded_fused_llama3_restores_on_two_ranks_and_reshards_to_one(
        tmp_path: Path) -> None:
    saved = run_ranks(_save, 2, args=(str(tmp_path),))[0]
    restored_on_two = run_ranks(_restore, 2, args=(str(tmp_path),))
    for restored in [*restored_on_two, _restore(0, 1, str(tmp_path))]:
        assert restored["params"].keys() == saved["params"].keys()
        for name, value in saved["params"].items():
            assert torch.equal(restored["params"][name], value), name
        assert torch.equal(restored["exp_avg"], saved["exp_avg"])
