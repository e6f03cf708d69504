"""Whether a state fits a checkpoint: DCP's flattening, and every key, shape and dtype compared."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resumekit.store.tree import flatten

__all__ = ["check_against_metadata", "compare_flat", "derived", "describe", "flatten_state"]

#: The optimizer group entry a restore never reads: torch records the names of a group's
#: parameters there when the optimizer was built with ``(name, parameter)`` pairs
#: (torchtitan's are), and the live optimizer's own names are the right ones whether the
#: checkpoint has them or not (``Optimizer.load_state_dict`` keeps them when the loaded
#: group has none).
PARAM_NAMES = "param_names"


def derived(key: str) -> bool:
    """Whether a flattened key is a group's ``param_names`` (never compared nor read)."""
    parts = key.split(".")
    return (len(parts) == 4 and parts[0] == "optimizer" and parts[1] == "param_groups"
            and parts[3] == PARAM_NAMES)


def describe(value: Any) -> str:
    """What ``value`` is, in an error message (``tensor (2, 3) torch.float32``)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return f"non-tensor {type(value).__name__}"


def check_against_metadata(
    flat: Mapping[str, Any], metadata: Metadata, *, scope: set[str] | None
) -> list[str]:
    """Every way the flattened ``flat`` differs from ``metadata``.

    ``scope``: the top-level keys under which an item ``flat`` lacks is a difference.
    """
    stored = metadata.state_dict_metadata
    differences = [f"missing from checkpoint: {key}" for key in flat if key not in stored]
    if scope is not None:
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        for key in stored:
            path = paths.get(key)
            top = str(path[0]) if isinstance(path, tuple) and path else key.split(".", 1)[0]
            if key not in flat and top in scope and not derived(key):
                differences.append(f"unexpected in checkpoint: {key}")
    for key, value in flat.items():
        entry = stored.get(key)
        if entry is None:
            continue
        if isinstance(entry, TensorStorageMetadata):
            want = f"tensor {tuple(entry.size)} {entry.properties.dtype}"
            if not isinstance(value, torch.Tensor) or (
                tuple(value.shape) != tuple(entry.size) or value.dtype != entry.properties.dtype
            ):
                differences.append(f"{key}: checkpoint has {want}, state has {describe(value)}")
        elif isinstance(value, torch.Tensor):
            differences.append(f"{key}: checkpoint has a non-tensor, state has {describe(value)}")
    return differences


def _holds_state(items: Sequence[Any]) -> bool:
    return any(isinstance(item, (torch.Tensor, Mapping)) for item in items)


def flatten_state(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a state dict to dotted keys as DCP does.

    Lists holding tensors or dicts (an optimizer's ``param_groups``) are containers; any
    other list is a value.
    """
    return flatten(tree, prefix, expand=_holds_state)


def compare_flat(given: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Every way the flattened ``given`` differs from ``expected``."""
    differences = [f"missing: {key}" for key in expected
                   if key not in given and not derived(key)]
    differences += [f"unexpected: {key}" for key in given
                    if key not in expected and not derived(key)]
    for key, want in expected.items():
        if key not in given:
            continue
        have = given[key]
        if isinstance(want, torch.Tensor) != isinstance(have, torch.Tensor) or (
            isinstance(want, torch.Tensor)
            and isinstance(have, torch.Tensor)
            and (want.shape != have.shape or want.dtype != have.dtype)
        ):
            differences.append(f"{key}: expected {describe(want)}, got {describe(have)}")
    return differences


