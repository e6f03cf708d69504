"""torchtitan's own llama3 model (stock fused QKV, and unfused) saved and restored in one process.

Needs torchtitan's model classes (tests/torchtitan_models.py says how they are installed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from resumekit.manager import CheckpointManager
from tests.torchtitan_models import fake_steps, llama3, optimizers_container


def _moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state["exp_avg"] for state in optimizer.state.values()]


def test_torchtitans_fused_llama3_saves_split_keys_and_restores_exactly(tmp_path: Path) -> None:
    model = llama3()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fake_steps(model, optimizer, 2)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    ckpt.save(2)  # raised AttributeError: 'FusedQKVLinear' object has no attribute 'wq'
    ckpt.close()

    fresh = llama3(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer).restore() == 2
    for (name, want), (_, have) in zip(model.named_parameters(), fresh.named_parameters(),
                                       strict=True):
        assert torch.equal(want, have), name
    for want, have in zip(_moments(optimizer), _moments(fresh_optimizer), strict=True):
        assert torch.equal(want, have)


def test_torchtitans_unfused_llama3_takes_the_weights_of_the_fused_ones(tmp_path: Path) -> None:
    fused = llama3()
    optimizer = torch.optim.AdamW(fused.parameters(), lr=1e-3)
    fake_steps(fused, optimizer, 1)
    CheckpointManager(tmp_path / "fused", model=fused, optimizer=optimizer).save(1)

    unfused = llama3(fuse_qkv=False, seed=3)
    assert CheckpointManager(tmp_path / "unfused", model=unfused).load_weights(
        tmp_path / "fused") == 1
    reference = fused.state_dict()
    for key, value in unfused.state_dict().items():
        assert torch.equal(value, reference[key]), key


def test_torchtitans_optimizers_container_is_saved_and_restored_exactly(tmp_path: Path) -> None:
    model = llama3()
    container = optimizers_container(model)
    assert len(container.optimizers) == 2
    fake_steps(model, container, 2)
    ckpt = CheckpointManager(tmp_path, model=[model], optimizer=container)  # model_parts
    ckpt.save(2)  # raised a bare KeyError: 'state'
    ckpt.close()

    fresh = llama3(seed=1)
    fresh_container = optimizers_container(fresh)
    assert CheckpointManager(tmp_path, model=[fresh], optimizer=fresh_container).restore() == 2
    for want, have in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(want, have)
    for part, fresh_part in zip(container.optimizers, fresh_container.optimizers, strict=True):
        assert fresh_part.param_groups[0]["param_names"] == part.param_groups[0]["param_names"]
        for want, have in zip(_moments(part), _moments(fresh_part), strict=True):
            assert torch.equal(want, have)
