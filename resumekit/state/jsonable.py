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
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from resumekit.errors import ConfigurationError
from resumekit.store.storage import JSON_DEPTH_LIMIT, json_depth

__all__ = ["USER_JSON_DEPTH", "check_depth", "plain_extras"]

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
