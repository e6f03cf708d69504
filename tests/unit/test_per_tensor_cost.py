"""The per-tensor shortcuts (issue 16, item 2) take effect only where they change nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.nn.parallel import DistributedDataParallel

from resumekit.manager import CheckpointManager
from resumekit.state.train_state import TrainState
from resumekit.store.manifest import Manifest
from resumekit.tensors import state_dicts


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Sequential(nn.Linear(4, 2), nn.LayerNorm(2))
        self.register_buffer("count", torch.zeros(()))


class _Modified(nn.Module):
    """A module whose canonical names differ from its keys (DCP's ``_fqn_modifiers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}


class _Hooked(nn.Linear):
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)


def test_a_plain_module_state_is_exactly_what_dcp_returns() -> None:
    model = _Net()
    ours = state_dicts.model_state_dict(model)
    theirs = get_model_state_dict(model)
    assert state_dicts.plain_state_dict(model) is not None
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert ours[key].data_ptr() == value.data_ptr()
        assert not ours[key].requires_grad


def test_wrapped_or_modified_modules_are_left_to_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = _Net()
    assert state_dicts.plain_state_dict(ddp) is None
    assert state_dicts.plain_state_dict(_Modified()) is None
    assert state_dicts.plain_state_dict(nn.Module()) is None  # empty: DCP's error stands
    calls: list[nn.Module] = []
    real = state_dicts.get_model_state_dict

    def spy(model: nn.Module, **kwargs: Any) -> dict[str, Any]:
        calls.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(state_dicts, "get_model_state_dict", spy)
    modified = _Modified()
    assert list(state_dicts.model_state_dict(modified)) == ["inner.weight", "inner.bias"]
    assert calls == [modified]


def test_a_compiled_module_is_recognised_as_a_wrapper() -> None:
    compiled = torch.compile(_Net())
    assert state_dicts.plain_state_dict(compiled) is None
    assert list(state_dicts.model_state_dict(compiled)) == list(get_model_state_dict(compiled))


def test_a_save_records_the_fingerprint_of_its_own_capture(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    model = _Net()
    manager = CheckpointManager(tmp_path, model=model)
    captures: list[int] = []
    real = state_dicts.model_state_dict

    def counting(module: nn.Module, **kwargs: Any) -> dict[str, Any]:
        captures.append(1)
        return real(module, **kwargs)

    monkeypatch.setattr(state_dicts, "model_state_dict", counting)
    manager.save(1)
    manager.close()
    assert len(captures) == 1  # the fingerprint reused the capture
    saved = json.loads((tmp_path / "step_000000001" / "manifest.json").read_bytes())
    assert saved["fingerprint"]["params"] == TrainState(model=model).fingerprint_params()
    assert saved["fingerprint"]["params"]["a.weight"] == [[4, 3], "float32"]


def test_a_restore_into_the_models_own_tensors_skips_set_state_dict(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Net()
    state = state_dicts.model_and_optimizer_state(model)
    with torch.no_grad():
        state["model"]["a.weight"].fill_(3.0)  # what a read into the destination does
    calls: list[int] = []
    monkeypatch.setattr(state_dicts, "set_state_dict", lambda *a, **k: calls.append(1))
    state_dicts.apply_model_and_optimizer_state(model, None, state)
    assert calls == []
    assert torch.equal(model.a.weight, torch.full((4, 3), 3.0))


@pytest.mark.parametrize("case", ["copy", "hook", "override", "missing"])
def test_a_state_that_is_not_the_models_own_tensors_is_applied_by_dcp(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Net()
    if case == "override":
        model.a = _Hooked(3, 4)
    state = state_dicts.model_and_optimizer_state(model)
    if case == "copy":
        state["model"]["a.weight"] = state["model"]["a.weight"].clone()
    if case == "hook":
        model.b.register_load_state_dict_post_hook(lambda module, keys: None)
    if case == "missing":
        del state["model"]["count"]
    calls: list[int] = []
    monkeypatch.setattr(state_dicts, "set_state_dict", lambda *a, **k: calls.append(1))
    if case == "missing":
        with pytest.raises(Exception, match=r"missing: model\.count"):
            state_dicts.apply_model_and_optimizer_state(model, None, state)
        return
    state_dicts.apply_model_and_optimizer_state(model, None, state)
    assert calls == [1]


def test_a_fingerprint_built_in_python_is_still_checked_as_json() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        Manifest(step=1, fingerprint={"config": {"x": object()}})
    with pytest.raises(ValueError, match="fingerprint"):
        Manifest.model_validate({"step": 1, "fingerprint": {"config": (1, 2)}})
