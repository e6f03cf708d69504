"""User data for the manifest (``extras``): as it will read back from JSON, checked early.

A training loop naturally stores ``loss.detach()`` (a 0-dim tensor) or ``np.float32``
values; JSON holds neither. :func:`plain_extras` turns 0-dim tensors and numpy scalars
into the Python numbers they hold (``tensor(0.5)`` reads back as ``0.5``) and refuses
anything else that JSON cannot hold, naming the key, so the manager can refuse it when it
is constructed rather than at the first save.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from resumekit.errors import ConfigurationError
from resumekit.store.storage import JSON_DEPTH_LIMIT, json_depth

__all__ = [
    "USER_JSON_DEPTH", "check_depth", "finite_metrics", "live_extras", "plain_extras",
    "plain_json",
]

logger = logging.getLogger("resumekit")

#: The deepest nesting of user data (extras, config) a manifest holds: it sits a few levels
#: down in the manifest, whose reader refuses documents deeper than
#: :data:`~resumekit.store.storage.JSON_DEPTH_LIMIT`.
USER_JSON_DEPTH = JSON_DEPTH_LIMIT - 8


def plain_extras(value: Mapping[str, Any], *, what: str = "extras") -> dict[str, Any]:
    """Return ``value`` as it will read back from JSON.

    Tuples become lists, 0-dim tensors and numpy scalars (and 0-dim arrays) become
    Python numbers; nested mappings and lists are converted the same way.

    Args:
        value: The mapping to save.
        what: Its name, for the error.

    Raises:
        TypeError: A value JSON cannot hold (a tensor of several elements, an object),
            named by its key path.
        ConfigurationError: Nested deeper than :data:`USER_JSON_DEPTH`.
    """
    check_depth(value, what=what)
    converted = _convert(dict(value), what)
    try:
        plain: dict[str, Any] = json.loads(json.dumps(converted, allow_nan=True))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable: {error}") from error
    return plain


def check_depth(value: Any, *, what: str) -> None:
    """Refuse user data nested deeper than a manifest can be read back with.

    Raises:
        ConfigurationError: Naming ``what`` and the limit.
    """
    depth = json_depth(value, stop=USER_JSON_DEPTH)
    if depth > USER_JSON_DEPTH:
        raise ConfigurationError(
            f"{what} is nested more than {USER_JSON_DEPTH} levels deep, the most a "
            "checkpoint holds (its manifest could not be read back)", name=what, value=depth)


def plain_json(value: Mapping[str, Any], *, what: str) -> dict[str, Any]:
    """Return ``value`` as it will read back from JSON (tuples become lists).

    Unlike :func:`plain_extras`, nothing is converted: a tensor or numpy value is refused.

    Raises:
        TypeError: ``value`` is not JSON-serialisable.
        ConfigurationError: Nested deeper than :data:`USER_JSON_DEPTH`.
    """
    check_depth(value, what=what)
    try:
        plain: dict[str, Any] = json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable: {error}") from error
    return plain


def live_extras(extras: Mapping[str, Any] | None) -> MutableMapping[str, Any]:
    """The caller's own mapping (read at every save), checked now: a bad value fails here.

    Raises:
        TypeError: A value JSON cannot hold (see :func:`plain_extras`).
    """
    live: MutableMapping[str, Any] = extras if isinstance(extras, MutableMapping) \
        else dict(extras or {})
    plain_extras(live)
    return live


def finite_metrics(metrics: Mapping[str, float] | None, step: int) -> dict[str, float]:
    """``metrics`` as the manifest records them; a name or value it cannot is refused.

    Raises:
        ConfigurationError: A value that is not a finite number, or a name not a string.
    """
    recorded: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        number = float(value) if isinstance(value, (int, float)) and \
            not isinstance(value, bool) else math.nan
        if not isinstance(name, str) or not math.isfinite(number):
            raise ConfigurationError(
                f"metrics of step {step}: {name!r} = {value!r} is not a finite number "
                "under a string name (a manifest records only those)",
                name="metrics", value=value)
        recorded[name] = number
    return recorded


def _convert(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise TypeError(
                f"{where} is a tensor of shape {list(value.shape)}: extras hold JSON values "
                "only (a 0-dim tensor is saved as its number; use .tolist() for more)")
        logger.debug("resumekit: %s is a 0-dim tensor: saved as its number", where)
        return value.item()
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            raise TypeError(
                f"{where} is a numpy array of shape {list(value.shape)}: extras hold JSON "
                "values only (use .tolist())")
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {key: _convert(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_convert(item, f"{where}[{index}]") for index, item in enumerate(value)]
    return value
