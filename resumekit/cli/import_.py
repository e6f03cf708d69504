"""``resumekit import``: convert another tool's checkpoint into a resumekit checkpoint."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from dataclasses import asdict
from typing import Any

from torch import nn

from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    UsageError,
    console,
    emit_json,
    parse_storage_option,
    storage_options,
)
from resumekit.errors import ConfigurationError
from resumekit.store.layout import DEFAULT_NAME_FORMAT
from resumekit.tools.importers import IMPORT_FORMATS, import_checkpoint
from resumekit.warnings import ResumekitWarning

__all__ = ["SCHEMA", "add_parser", "model_from_spec", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.import/1"


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``import`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "import",
        help=summary,
        description="Write one committed resumekit checkpoint (reason 'imported') under "
        "ROOT from another tool's checkpoint SRC: model weights and optimizer state "
        "(and the LR scheduler where SRC has one), bit for bit. RNG streams and the data "
        "position are not carried over. See docs/migration.md.",
    )
    parser.add_argument("src", help="the foreign checkpoint (directory or Lightning .ckpt)")
    parser.add_argument("root", help="resumekit checkpoint root to write into")
    parser.add_argument("--format", choices=IMPORT_FORMATS, default="auto",
                        help="source format (default: detect from its files)")
    parser.add_argument("--step", type=int, default=None,
                        help="step of the new checkpoint (required when SRC records none: "
                        "Accelerate, plain DCP)")
    parser.add_argument("--model", metavar="MODULE:FACTORY", default=None,
                        help="build the model with FACTORY() from MODULE (imported from the "
                        "current directory too) and take the optimizer's parameter order "
                        "from its named_parameters(), for sources that do not keep it "
                        "(Accelerate safetensors with two parameters of one shape)")
    parser.add_argument("--name-format", dest="name_format", metavar="TEMPLATE",
                        default=DEFAULT_NAME_FORMAT,
                        help=f"step directory names in ROOT (default {DEFAULT_NAME_FORMAT})")
    parser.add_argument("--json", action="store_true",
                        help=f"print one JSON document (schema {SCHEMA})")
    parser.add_argument(
        "--storage-option", dest="storage_option", metavar="KEY=VALUE", action="append",
        type=parse_storage_option, default=[], help="fsspec option (repeatable)")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors")
    parser.set_defaults(run=run)


def model_from_spec(spec: str) -> nn.Module:
    """Build the model ``MODULE:FACTORY`` names: import MODULE, call ``FACTORY()``.

    MODULE is imported as ``python -m`` would, the current directory first on the path;
    FACTORY may be a dotted attribute path (``pkg.models:Net.tiny``).

    Args:
        spec: ``MODULE:FACTORY``, as given to ``--model``.

    Returns:
        The module the factory returned (only its ``named_parameters()`` are used).

    Raises:
        UsageError: The spec is malformed, the module or the factory cannot be found, the
            factory fails, or it returns something that is not a ``torch.nn.Module`` (the
            message names the spec; exit status 2).
    """
    module_name, colon, factory_name = spec.partition(":")
    if not colon or not module_name or not factory_name:
        raise UsageError(f"--model {spec!r} is not MODULE:FACTORY (e.g. mytrain.model:build)",
                         name="model", value=spec)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"--model {spec!r}: cannot import module {module_name!r}: {error}",
                         name="model", value=spec) from error
    for part in factory_name.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--model {spec!r}: module {module_name!r} has no "
                             f"{factory_name!r}", name="model", value=spec)
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--model {spec!r}: {factory_name!r} is not callable",
                         name="model", value=spec)
    try:
        model = target()
    except Exception as error:  # the user's factory: named in one line, not a traceback
        raise UsageError(f"--model {spec!r}: {factory_name}() failed: "
                         f"{type(error).__name__}: {error}", name="model", value=spec) from error
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec!r}: {factory_name}() returned "
                         f"{type(model).__name__}, not a torch.nn.Module",
                         name="model", value=spec)
    return model


def run(args: argparse.Namespace) -> int:
    """Run ``import``; return the exit code (2: no step known, or a bad ``--model``)."""
    model = None if args.model is None else model_from_spec(args.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumekitWarning)
        try:
            result = import_checkpoint(
                args.src, args.root, format=args.format, step=args.step, model=model,
                name_format=args.name_format,
                storage_options=storage_options(args.storage_option) or None,
            )
        except ConfigurationError as error:
            if error.fields.get("name") == "step":
                raise UsageError(str(error), **error.fields) from error
            raise
    notes = [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]
    if args.json:
        emit_json({"schema": SCHEMA, **asdict(result), "warnings": notes})
        return 0
    out = console()
    out.print(f"imported {result.format} checkpoint {result.source} as step {result.step}")
    out.print(f"  committed {result.path} ({result.tensors} tensors, reason imported)")
    out.print(f"  carried over: {', '.join(result.carried)}")
    out.print(f"  NOT carried over: {', '.join(result.not_carried)}")
    for note in notes:
        if not note.startswith("imported "):  # the summary is printed above
            out.print(f"  warning: {note}")
    return 0
