"""Nested state as flat ``{dotted key: leaf}`` dicts: the one flattener.

Used by the fit check before a load (:mod:`resumekit.tensors`), the resume-equivalence
harness (:mod:`resumekit.tools.testing`) and ``resumekit diff``. Imports no torch: callers that
treat lists of tensors differently from lists of numbers say so with ``expand``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["every_list", "flatten"]


def every_list(_items: Sequence[Any]) -> bool:
    """Expand every list and tuple (the default of :func:`flatten`)."""
    return True


def flatten(
    tree: Any,
    prefix: str = "",
    *,
    expand: Callable[[Sequence[Any]], bool] = every_list,
    keep_empty: bool = False,
) -> dict[str, Any]:
    """Flatten nested mappings (and the lists ``expand`` accepts) to dotted keys.

    Args:
        tree: The nested value.
        prefix: Key of ``tree`` itself (``""``: keys start at its children).
        expand: Which lists and tuples are containers whose items get keys
            (``name.0``, ``name.1``...); any other list is a leaf.
        keep_empty: Keep an empty mapping or list as a leaf (``{}``/``[]``) instead of
            dropping it, so that ``{"a": {}}`` and ``{}`` differ.

    Returns:
        ``{dotted key: leaf}`` in the tree's order.

    Example:
        >>> flatten({"a": {"b": 1, "c": [2, 3]}})
        {'a.b': 1, 'a.c.0': 2, 'a.c.1': 3}
        >>> flatten({"a": [2, 3], "e": {}}, expand=lambda items: False, keep_empty=True)
        {'a': [2, 3], 'e': {}}
    """
    if isinstance(tree, Mapping):
        items: list[tuple[Any, Any]] = list(tree.items())
        empty: Any = {}
    elif isinstance(tree, (list, tuple)) and expand(tree):
        items = list(enumerate(tree))
        empty = []
    else:
        return {prefix: tree}
    if not items:
        return {prefix: empty} if keep_empty else {}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key),
                            expand=expand, keep_empty=keep_empty))
    return flat
