"""state_dicts.named_state: DCP's get_state_dict without its walks, exactly where it is the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)

from resumekit.tensors import state_dicts


class Untied(nn.Module):
    """One name per parameter, a frozen layer among them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 7, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.body(self.embed(tokens))))


class Tied(Untied):
    """Untied's layout with the head tied to the embedding, and buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight  # tied, as nanoGPT's lm_head
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.body(self.embed(tokens)) * self.scale
        return self.head(self.frozen(x))


def _stepped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.tensor([[1, 2, 3]])).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _two_groups(model: Tied) -> torch.optim.Optimizer:
    decay = [model.embed.weight, model.body[0].weight]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not d for d in decay)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0, "lr": 3e-4}], lr=1e-3)


def _same(ours: Any, dcp: Any) -> bool:
    """Same keys in the same order, the same tensor objects, equal everything else."""
    if isinstance(dcp, dict):
        return (isinstance(ours, dict) and list(ours) == list(dcp)
                and all(_same(ours[key], dcp[key]) for key in dcp))
    if isinstance(dcp, list):
        return isinstance(ours, list) and len(ours) == len(dcp) and all(
            _same(a, b) for a, b in zip(ours, dcp, strict=True))
    if isinstance(dcp, torch.Tensor):
        return ours is dcp or (isinstance(ours, torch.Tensor) and torch.equal(ours, dcp))
    return bool(ours == dcp)


#: Each test runs with each of these optimizers.
EVERY_OPTIMIZER = pytest.mark.parametrize("optimizer_of", [
    lambda model: torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3),
    _two_groups,
    lambda model: torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
], ids=["adamw", "two param groups", "sgd momentum"])


@EVERY_OPTIMIZER
def test_named_state_is_exactly_dcps_get_state_dict_for_a_plain_module(
        optimizer_of: Any) -> None:
    torch.manual_seed(0)
    model = Tied()
    optimizer = optimizer_of(model)
    _stepped(model, optimizer)
    found = state_dicts.named_state(model, optimizer)
    assert found is not None
    dcp_model, dcp_optimizer = get_state_dict(model, optimizer)
    assert _same(found[0], dcp_model)
    assert _same(found[1], dcp_optimizer)
    assert state_dicts.model_and_optimizer_state(model, optimizer)["optimizer"]["state"].keys() \
        == dcp_optimizer["state"].keys()


def test_named_state_leaves_to_dcp_what_dcp_renames_or_initialises() -> None:
    torch.manual_seed(0)
    model = Tied()
    fresh = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert state_dicts.named_state(model, fresh) is None  # no state: DCP initialises it

    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 3)))
    optimizer = torch.optim.AdamW(wrapped.parameters())
    wrapped(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert state_dicts.named_state(wrapped, optimizer) is None  # checkpointing's prefix

    model = Tied()
    outside = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.body.parameters(), outside], lr=0.1, momentum=0.9)
    outside.grad = torch.ones(2)
    for param in model.body.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert state_dicts.named_state(model, optimizer) is None  # a parameter not in the model

    model = Tied()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _stepped(model, optimizer)
    model.state_dict = lambda *a, **k: {}  # type: ignore[method-assign, assignment]
    assert state_dicts.named_state(model, optimizer) is None  # an instance's own state_dict


def _trained(optimizer_of: Any, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Untied()
    optimizer = optimizer_of(model)
    torch.manual_seed(seed)
    for _ in range(seed):
        _stepped(model, optimizer)
    return model, optimizer


def test_model_state_dict_is_exactly_dcps_get_model_state_dict_for_a_plain_module() -> None:
    model = Tied()
    assert _same(state_dicts.model_state_dict(model), get_model_state_dict(model))


@EVERY_OPTIMIZER
def test_load_named_optimizer_state_loads_exactly_what_dcps_set_optimizer_state_dict_does(
        optimizer_of: Any) -> None:
    source_model, source = _trained(optimizer_of, seed=3)
    for group in source.param_groups:
        group["lr"] *= 0.5  # a stored group entry the load must bring over
    named = state_dicts.named_state(source_model, source)
    assert named is not None
    ours_model, ours = _trained(optimizer_of, seed=1)
    dcps_model, dcps = _trained(optimizer_of, seed=1)
    assert state_dicts.load_named_optimizer_state(ours_model, ours, named[1])
    set_optimizer_state_dict(dcps_model, dcps, named[1],
                             options=StateDictOptions(strict=True))
    assert _same(ours.state_dict(), dcps.state_dict())
    assert _same(ours.state_dict(), source.state_dict())
    # the loaded tensors are the stored ones (no copy), as DCP's load leaves them
    first = next(iter(ours.state.values()))
    stored = next(iter(named[1]["state"].values()))
    assert all(first[key] is stored[key] for key in first if torch.is_tensor(first[key]))


def test_load_named_optimizer_state_leaves_to_dcp_what_it_does_not_build_the_same() -> None:
    torch.manual_seed(0)
    model = Tied()  # head.weight is embed.weight: two names for one parameter
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _stepped(model, optimizer)
    named = state_dicts.named_state(model, optimizer)
    assert named is not None
    before = optimizer.state_dict()
    assert not state_dicts.load_named_optimizer_state(model, optimizer, named[1])

    model, optimizer = _trained(lambda m: torch.optim.AdamW(
        [p for p in m.parameters() if p.requires_grad]), seed=1)
    named = state_dicts.named_state(model, optimizer)
    assert named is not None
    missing = {"state": dict(named[1]["state"]), "param_groups": named[1]["param_groups"]}
    del missing["state"]["body.0.weight"]  # DCP's strict load names it
    by_index = optimizer.state_dict()  # keyed by parameter number, not by name
    before = optimizer.state_dict()
    for odd in (missing, by_index, {**named[1], "extra": 1}):
        assert not state_dicts.load_named_optimizer_state(model, optimizer, odd)
    assert _same(optimizer.state_dict(), before)  # nothing was loaded
