"""``resumekit export``: a checkpoint's model as safetensors, or all of it as one .pt file."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    UsageError,
    add_common_options,
    console,
    emit_json,
    format_bytes,
    running_progress,
    storage_options,
)
from resumekit.tools.export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint, export_torch

__all__ = ["SCHEMA", "add_parser", "parse_size", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.export/1"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """Parse a size such as ``5GB``, ``512MiB`` or ``1000000`` into bytes.

    Raises:
        argparse.ArgumentTypeError: Not a positive size.
    """
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 5GB, 512MiB, 1000000)"
        )
    return max(1, int(value * _SIZE_UNITS[unit]))


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``export`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "export",
        help=summary,
        description="Consolidate the model tensors of a sharded checkpoint into "
        "safetensors files, without a process group and with memory bounded by the "
        "largest tensor. Keys lose the checkpoint's 'model.' prefix.",
    )
    parser.add_argument("path", help="checkpoint root, one checkpoint directory, or a plain "
                        "DCP directory (.metadata: dcp.save output, torchtitan step-N)")
    parser.add_argument("--step", type=int, default=None,
                        help="step to export (default: newest committed)")
    parser.add_argument("--out", required=True,
                        help="output directory (path or URL); with --format torch: the "
                        "output file FILE.pt")
    parser.add_argument("--format", choices=["safetensors", "torch"], default="safetensors",
                        help="safetensors: the model's weights; torch: the whole checkpoint "
                        "as one torch.save file, as dcp_to_torch_save writes it")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32", "keep"], default="keep",
                        help="cast floating-point tensors (default: keep stored dtype)")
    parser.add_argument("--layout", choices=["plain", "diffusers"], default="plain",
                        help="plain: OUT/model.safetensors; diffusers: OUT/transformer/"
                        "diffusion_pytorch_model.safetensors + config.json")
    parser.add_argument("--model-config", dest="model_config", metavar="FILE.json",
                        default=None,
                        help="the model's config for config.json (default: the manifest's "
                        "extras.model_config); --layout diffusers needs one")
    parser.add_argument("--max-shard-size", dest="max_shard_size", type=parse_size,
                        default=DEFAULT_MAX_SHARD_BYTES,
                        help="split into files of at most this size, with an index "
                        "(default 5GiB; e.g. 2GB, 500MiB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing export in --out")
    parser.add_argument("--verify", action="store_true",
                        help="re-hash the checkpoint against its manifest first")
    add_common_options(parser, json_help=f"print one JSON document (schema {SCHEMA})")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``export``; return the exit code."""
    options = storage_options(args.storage_option)
    if args.format == "torch":
        for flag, value, default in (("--dtype", args.dtype, "keep"),
                                     ("--layout", args.layout, "plain"),
                                     ("--model-config", args.model_config, None),
                                     ("--max-shard-size", args.max_shard_size,
                                      DEFAULT_MAX_SHARD_BYTES)):
            if value != default:
                raise UsageError(
                    f"{flag} does not apply to --format torch (it writes the checkpoint's "
                    "tensors as stored, in one file)", name=flag, value=value)
        result = export_torch(args.path, args.step, args.out, storage_options=options,
                              name_format=args.name_format, overwrite=args.overwrite,
                              verify=args.verify)
    else:
        with running_progress("export", enabled=not (args.json or args.no_progress)) as bar:
            result = export_checkpoint(
                args.path, args.step, args.out, dtype=args.dtype, layout=args.layout,
                max_shard_bytes=args.max_shard_size, progress=bar, storage_options=options,
                name_format=args.name_format, overwrite=args.overwrite, verify=args.verify,
                model_config=args.model_config,
            )
    if args.json:
        emit_json({"schema": SCHEMA, **asdict(result)})
        return 0
    out = console()
    out.print(f"exported step {result.step} from {result.source}")
    out.print(f"  {result.tensors} tensors, {format_bytes(result.total_bytes)} "
              f"(largest {format_bytes(result.largest_tensor_bytes)}) into {result.out}:")
    for name in result.files:
        out.print(f"    {name}")
    if result.index is not None:
        out.print(f"    {result.index}")
    if result.config is not None:
        out.print(f"    {result.config}  (from {result.config_source})")
    return 0
