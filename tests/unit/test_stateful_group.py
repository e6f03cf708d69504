"""``StatefulGroup``: the objects a run registers with Accelerate's
``register_for_checkpointing`` reach resumekit in one call, and come back only whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from resumekit import StatefulGroup
from resumekit.errors import ConfigurationError, IncompatibleCheckpointError
from resumekit.manager import CheckpointManager


class Ema:
    """A user object with state, as Accelerate's register_for_checkpointing takes."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0

    def update(self, model: nn.Module) -> None:
        for key, value in model.state_dict().items():
            self.shadow[key].mul_(0.9).add_(value.detach(), alpha=0.1)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = int(state["updates"])


def _run(root: Path, steps: int) -> tuple[Any, Any, Ema, CheckpointManager]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ema = Ema(accelerator.unwrap_model(model))
    accelerator.register_for_checkpointing(ema)  # what accelerator.save_state would keep
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer,
                             scheduler=StatefulGroup(scheduler=scheduler, ema=ema))
    for _ in range(steps):
        accelerator.backward(model(torch.randn(3, 4)).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.update(accelerator.unwrap_model(model))
    return model, scheduler, ema, ckpt


def test_objects_registered_for_checkpointing_come_back_through_one_stateful_group(
    tmp_path: Path,
) -> None:
    _, scheduler, ema, ckpt = _run(tmp_path / "root", steps=3)
    ckpt.save(3)
    ckpt.close()
    _, fresh_scheduler, fresh_ema, again = _run(tmp_path / "root", steps=0)
    assert fresh_ema.updates == 0
    assert again.restore() == 3
    again.close()
    assert fresh_ema.updates == 3
    for key, tensor in ema.shadow.items():
        assert torch.equal(fresh_ema.shadow[key], tensor), key
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_a_group_checkpoint_restores_only_into_a_group_of_the_same_names(
    tmp_path: Path,
) -> None:
    _, _, _, ckpt = _run(tmp_path / "root", steps=2)
    ckpt.save(2)
    ckpt.close()
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lonely = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    before = lonely.state_dict()
    manager = CheckpointManager(tmp_path / "root", model=model, optimizer=optimizer,
                                scheduler=StatefulGroup(scheduler=lonely), fallback=False)
    with pytest.raises(IncompatibleCheckpointError,
                       match=r"train_state\.pt.*in the checkpoint, not in the group: ema"):
        manager.restore()
    manager.close()
    assert lonely.state_dict() == before  # no member loaded from a checkpoint that misfits


def test_a_group_member_without_state_dict_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match=r"member 'ema' \(object\) has no state_dict"):
        StatefulGroup(scheduler=torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), lambda s: 1.0),
            ema=object())
    with pytest.raises(ConfigurationError, match="at least one named object"):
        StatefulGroup()
