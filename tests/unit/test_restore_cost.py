"""What a relaunch's ``restore()`` does, and does not do, before the first training step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.tensors import state_dicts


class CountingAdamW(torch.optim.AdamW):
    """AdamW that counts its steps (DCP's state initialisation runs one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.steps += 1
        return super().step(closure)


class ShapedStateSGD(torch.optim.SGD):
    """SGD that keeps a per-parameter state tensor of a shape no parameter has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.steps += 1
        result = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                history = self.state[param].setdefault("history", torch.zeros(3))
                history.add_(1.0)
        return result


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(100)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for index, values in left["state"].items():
        assert values.keys() == right["state"][index].keys()
        for name, value in values.items():
            assert torch.equal(value, right["state"][index][name]), (index, name)


def test_restoring_into_an_optimizer_that_never_stepped_runs_no_optimizer_step(
        tmp_path: Path) -> None:
    model = _model(0)
    optimizer = CountingAdamW(model.parameters(), lr=0.01)
    _train(model, optimizer, 3)
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(3)

    fresh_model = _model(1)
    fresh = CountingAdamW(fresh_model.parameters(), lr=0.01)
    assert CheckpointManager(tmp_path, model=fresh_model, optimizer=fresh).restore() == 3

    assert fresh.steps == 0  # DCP's own initialisation would have run a (zero-lr) step
    _same_state(optimizer, fresh)
    for kept, restored in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(kept, restored)
    _train(model, optimizer, 2)
    _train(fresh_model, fresh, 2)
    for kept, restored in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(kept, restored)


def test_optimizer_state_of_another_shape_still_restores_through_dcps_initialisation(
        tmp_path: Path) -> None:
    model = _model(0)
    optimizer = ShapedStateSGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optimizer, 2)
    saver = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    saver.save(2)
    latest = saver.latest()
    assert latest is not None

    fresh_model = _model(1)
    fresh = ShapedStateSGD(fresh_model.parameters(), lr=0.1, momentum=0.9)
    assert not state_dicts.preallocate_optimizer_state(
        fresh_model, fresh, Path(latest.path) / "tensors")
    assert not fresh.state  # refused as a whole: nothing half-prepared
    CheckpointManager(tmp_path, model=fresh_model, optimizer=fresh).restore()
    _same_state(optimizer, fresh)


def test_preallocated_optimizer_state_takes_the_stored_layout_and_dtype(
        tmp_path: Path) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, 1)
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    tensors.save(state, tmp_path)

    fresh_model = _model(1)
    fresh = torch.optim.AdamW(fresh_model.parameters())
    assert state_dicts.preallocate_optimizer_state(fresh_model, fresh, tmp_path)
    for param in fresh_model.parameters():
        entry = fresh.state[param]
        assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]
        assert entry["step"].shape == () and entry["step"].dtype == torch.float32
        assert entry["exp_avg"].shape == param.shape
        assert not entry["exp_avg"].any() and not entry["exp_avg_sq"].any()
    assert not state_dicts.preallocate_optimizer_state(fresh_model, fresh, tmp_path)  # has state


# --------------------------------------------------------------------------- applying


def test_a_restore_that_loaded_into_the_model_in_place_copies_nothing_onto_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, optimizer, 2)
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(2)

    fresh_model = _model(1)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    copies: list[str] = []
    load_state_dict = nn.Module.load_state_dict

    def recording(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        copies.append(type(self).__name__)
        return load_state_dict(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "load_state_dict", recording)
    CheckpointManager(tmp_path, model=fresh_model, optimizer=fresh).restore()
    assert copies == []  # the bytes were read straight into the parameters
    for kept, restored in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(kept, restored)
    _same_state(optimizer, fresh)


def test_a_state_held_elsewhere_is_still_copied_into_the_model(tmp_path: Path) -> None:
    source = _model(0)
    target = _model(1)
    state = {"model": {key: value.clone() for key, value in source.state_dict().items()}}
    state_dicts.apply_model_and_optimizer_state(target, None, state)
    for kept, restored in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(kept, restored)
