"""state.dump_plain: plain state is written with torch.save, what cannot load safely is refused."""

from __future__ import annotations

import collections
import io
from typing import Any

import pytest
import torch

from resumekit.state import train_state as state


class Opaque:
    """An object of the trainer's own: ``weights_only`` loading refuses it."""


def _refusing_load(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("read back although the value is surely safe")


def test_a_value_of_plain_types_is_written_without_reading_it_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    value = {"step": 3, "lr": [3e-5, None], "name": "warmup", "flags": (True, b"\x00"),
             "rng": torch.arange(4, dtype=torch.uint8), 7: {"nested": [torch.zeros(2, 2)]}}
    monkeypatch.setattr(state.torch, "load", _refusing_load)
    data = state.dump_plain(value, what="scheduler state")
    monkeypatch.undo()
    back = torch.load(io.BytesIO(data), weights_only=True)
    assert back.keys() == value.keys() and back["lr"] == [3e-5, None]
    assert torch.equal(back["rng"], value["rng"]) and back["flags"] == (True, b"\x00")


def test_a_value_of_other_types_is_read_back_once_and_kept_when_it_loads_safely(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    load = torch.load

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(state.torch, "load", counting_load)
    value = collections.OrderedDict(a=1, b=torch.float32)
    data = state.dump_plain(value, what="data position")
    assert calls == [True]
    assert torch.load(io.BytesIO(data), weights_only=True) == value


@pytest.mark.parametrize("make", [
    lambda: {"sampler": Opaque()},
    lambda: [1, (2, {"deep": Opaque()})],
    lambda: {"generator": _tensor_with(Opaque())},
], ids=["an object of the trainer", "one nested deep", "a tensor's own attribute"])
def test_a_value_that_cannot_load_safely_is_refused_naming_what_holds_it(make: Any) -> None:
    with pytest.raises(TypeError, match="data position holds objects that cannot be restored"):
        state.dump_plain(make(), what="data position")


def _tensor_with(attribute: object) -> torch.Tensor:
    tensor = torch.zeros(3)
    tensor.note = attribute  # type: ignore[attr-defined]
    return tensor
