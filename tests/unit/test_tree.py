"""The one flattener and its two list rules (``resumekit.store.tree.flatten``)."""

from __future__ import annotations

import torch

from resumekit import tensors
from resumekit.cli._common import flatten as cli_flatten
from resumekit.store import tree as _tree


def test_the_cli_rule_names_every_list_element_and_keeps_empty_containers() -> None:
    state = {"rng": (1, 2), "groups": [{"lr": 0.1}], "extras": {}, "none": [], "x": None}
    assert cli_flatten(state, "s") == {"s.rng.0": 1, "s.rng.1": 2, "s.groups.0.lr": 0.1,
                                       "s.extras": {}, "s.none": [], "s.x": None}


def test_the_state_rule_expands_only_lists_of_tensors_or_dicts_and_drops_empty_ones() -> None:
    weight = torch.zeros(2)
    state = {"model": {"w": weight}, "optimizer": {"param_groups": [{"lr": 0.1}],
                                                   "betas": (0.9, 0.99), "state": {}},
             "buffers": [weight]}
    flat = tensors.flatten_state(state)
    assert list(flat) == ["model.w", "optimizer.param_groups.0.lr", "optimizer.betas",
                          "buffers.0"]
    assert flat["optimizer.betas"] == (0.9, 0.99) and flat["model.w"] is weight


def test_a_leaf_at_the_top_keeps_the_prefix_as_its_key() -> None:
    assert _tree.flatten(3, "step") == {"step": 3}
    assert _tree.flatten({}, "empty") == {}
    assert _tree.flatten({}, "empty", keep_empty=True) == {"empty": {}}
