"""The optional dependencies: which extra installs each, and the one error when one is missing.

``pip install resumekit`` brings only what every run needs (torch, fsspec, safetensors, ...).
Features that need more name an extra of ``pyproject.toml``; :data:`EXTRAS` lists them, and
``tests/unit/test_optional_dependencies.py`` checks that the two agree. Every import of an
optional package goes through :func:`require` (or, where the import is a module's own
``import`` statement, through :func:`missing` in its ``except ImportError``), so that a
missing package is one :class:`~resumekit.errors.MissingDependencyError` whose message is
one line naming the feature, the package and the command that installs it::

    an s3:// root needs s3fs, which is not installed: pip install 'resumekit[s3]'

A package that is installed but fails to import (a version too old for a name resumekit
imports, a broken build) is told apart: its message carries the import's own error and
says to upgrade it to the version the extra asks for (never ``--force-reinstall``:
that would reinstall torch too).

This module imports nothing optional and no torch (the store uses it).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from resumekit.errors import MissingDependencyError

__all__ = ["EXTRAS", "Extra", "install_command", "missing", "require"]


@dataclass(frozen=True)
class Extra:
    """One extra of ``pyproject.toml``: what it enables and the requirements it adds.

    Attributes:
        enables: What installing it makes work, for the docs' extras table.
        requirements: Its requirement strings, exactly as ``pyproject.toml`` lists them.
    """

    enables: str
    requirements: tuple[str, ...]


#: Every extra a user may install, keyed by name (``dev``, ``bench`` and ``docs`` are the
#: project's own: they are not features of the library).
EXTRAS: dict[str, Extra] = {
    "s3": Extra("`s3://` roots (checkpoints on S3 or an S3-compatible store)",
                ("s3fs>=2023.6",)),
    "lightning": Extra("`resumekit.integrations.lightning` (the Lightning CheckpointIO and "
                       "callback)", ("lightning>=2.2",)),
    "accelerate": Extra("the Accelerate version resumekit is tested with (resumekit imports "
                        "no Accelerate: `CheckpointManager` takes what `prepare()` returns)",
                        ("accelerate>=0.30",)),
    "hf": Extra("`resumekit import --format hf-trainer` names the optimizer state by the "
                "architecture of `config.json`; the transformers and diffusers versions "
                "that load `resumekit export` output with `from_pretrained`",
                ("transformers>=4.40", "diffusers>=0.32")),
    "plot": Extra("the LingBot drill's loss curves (`loss.png`)", ("matplotlib>=3.7",)),
    "torchtitan": Extra("`resumekit.integrations.torchtitan` (`ResumekitCheckpointer`, "
                        "torchtitan's checkpointer by one config line)", ("torchtitan>=0.3",)),
}


def install_command(extra: str) -> str:
    """The shell command that installs ``extra`` (quoted: the brackets are a glob).

    Args:
        extra: A key of :data:`EXTRAS`.

    Returns:
        ``pip install 'resumekit[EXTRA]'``.

    Raises:
        KeyError: ``extra`` is not a key of :data:`EXTRAS`.
    """
    if extra not in EXTRAS:
        raise KeyError(f"{extra!r} is not an extra of resumekit (one of {sorted(EXTRAS)})")
    return f"pip install 'resumekit[{extra}]'"


def _is_absent(error: BaseException, module: str) -> bool:
    """Whether ``error`` (or an error it was raised from) says ``module`` is not installed.

    Only a ``ModuleNotFoundError`` naming ``module`` itself counts: one naming a submodule
    (``lightning.pytorch.x``) means the package is there, at a version without that module.
    """
    seen: BaseException | None = error
    for _ in range(8):  # fsspec wraps the ModuleNotFoundError once; a cycle cannot loop
        if seen is None:
            return False
        if isinstance(seen, ModuleNotFoundError) and seen.name == module:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def missing(module: str, *, extra: str, feature: str, error: BaseException | None = None,
            package: str | None = None, where: str | None = None, **fields: Any
            ) -> MissingDependencyError:
    """The error for ``feature`` when ``module`` cannot be imported.

    Args:
        module: The top-level module that failed to import (``"s3fs"``).
        extra: The extra of ``pyproject.toml`` that installs it (a key of :data:`EXTRAS`).
        feature: What needs it, the subject of "needs": ``"an s3:// root"``.
        error: The ``ImportError`` raised; None when the module is known to be absent.
            When it shows the package installed but failing, the message says so.
        package: The distribution to name, when it is not called like ``module``.
        where: What was being done, put before the message (``"cannot open s3://b/run"``).
        **fields: More attributes of the error (``value``: the URL or path asked for).

    Returns:
        A :class:`~resumekit.errors.MissingDependencyError` (raise it ``from error``).
    """
    name = package or module
    if error is None or _is_absent(error, module):
        message = f"{feature} needs {name}, which is not installed: {install_command(extra)}"
    else:
        cause = error
        while cause.__cause__ is not None:  # fsspec's "Install s3fs" wraps the real one
            cause = cause.__cause__
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        wanted = next((r for r in EXTRAS[extra].requirements
                       if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] == name), name)
        message = (f"{feature} needs {name}, which is installed but fails to import "
                   f"({reason}): pip install -U '{wanted}'")
    if where:
        message = f"{where}: {message}"
    return MissingDependencyError(message, name=module, extra=extra, feature=feature,
                                  **fields)


def require(module: str, *, extra: str, feature: str, package: str | None = None
            ) -> ModuleType:
    """Import ``module`` for ``feature``, or raise the one-line error naming its extra.

    Args:
        module: The module to import (``"matplotlib"``); its top-level package is the one
            reported missing.
        extra: The extra that installs it (a key of :data:`EXTRAS`).
        feature: What needs it, the subject of "needs".
        package: The distribution to name, when it is not called like the module.

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: ``module`` is not installed, or fails to import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise missing(module.split(".", maxsplit=1)[0], extra=extra, feature=feature, error=error,
                      package=package) from error
