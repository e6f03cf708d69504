"""A model with state-dict hooks (a fused QKV split on save), FSDP2-sharded on 2 gloo ranks.

Its hook gathers the sharded fused parameter to a replicated ``DTensor`` inside
``state_dict()`` (as torchtitan's does); the checkpoint holds the split keys, resumes
bit-identically, and reshards into one unsharded process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from resumekit.manager import CheckpointManager
from resumekit.tools.testing import Probe, check_resume_equivalence, crash_after, stop_after
from tests.distributed_harness import run_ranks
from tests.hooked_models import HookedNet, train_steps


def _sharded(seed: int = 0) -> tuple[HookedNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = HookedNet()
    if dist.is_initialized():
        for layer in (model.attn, model.mix):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(root: str, num_steps: int, probe: Probe) -> dict[str, Any]:
    model, optimizer = _sharded()
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, save_every=2)
    start = ckpt.restore()
    data = torch.Generator().manual_seed(9)
    batches = [torch.randn(6, 4, generator=data) for _ in range(num_steps)]
    for step in range(start, num_steps):
        loss = model(batches[step]).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.step_end(step + 1)
        probe.after_step(step + 1, loss, ckpt)
    ckpt.close()
    return {"model": model, "optimizer": optimizer}


def _equivalence(rank: int, world: int, workdir: str) -> str | None:
    report = check_resume_equivalence(_train, num_steps=7,
                                      interruptions=[stop_after(3), crash_after(5)],
                                      workdir=workdir)
    return None if report.equivalent else report.describe()


def test_a_sharded_hooked_model_resumes_bit_identically_on_two_ranks(tmp_path: Path) -> None:
    assert run_ranks(_equivalence, 2, args=(str(tmp_path),)) == [None, None]


def _save_sharded(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, optimizer = _sharded()
    train_steps(model, optimizer, 3)
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer)
    ckpt.save(3)
    ckpt.close()
    state = model.state_dict()  # the split keys, gathered by the hook
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
            for key, value in state.items()}


def test_a_sharded_hooked_models_checkpoint_reshards_to_one_process_and_back(
        tmp_path: Path) -> None:
    saved = run_ranks(_save_sharded, 2, args=(str(tmp_path / "two"),))[0]
    assert "attn.wq.weight" in saved and "attn.wqkv.weight" not in saved

    plain, optimizer = _sharded(seed=4)  # no process group here: unsharded
    assert CheckpointManager(tmp_path / "two", model=plain, optimizer=optimizer).restore() == 3
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved[key]), key
    train_steps(plain, optimizer, 1, seed=5)  # the restored optimizer state steps on
    CheckpointManager(tmp_path / "one", model=plain, optimizer=optimizer).save(4)

    back = run_ranks(_restore_sharded_at_4, 2, args=(str(tmp_path / "one"),))
    for result in back:
        assert torch.equal(result["wqkv"], plain.attn.wqkv.weight)
        assert torch.equal(result["exp_avg"],
                           optimizer.state[plain.attn.wqkv.weight]["exp_avg"])


def _restore_sharded_at_4(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, optimizer = _sharded(seed=6)
    assert CheckpointManager(root, model=model, optimizer=optimizer).restore() == 4
    return {"wqkv": model.attn.wqkv.weight.full_tensor().clone(),
            "exp_avg": optimizer.state[model.attn.wqkv.weight]["exp_avg"]
            .full_tensor().clone()}
