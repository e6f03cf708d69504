"""``resumekit verify``: re-hash every file of a checkpoint against its manifest."""

from __future__ import annotations

import argparse
from typing import Any

from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    UsageError,
    add_common_options,
    console,
    emit_json,
    format_bytes,
    progress_bar,
    storage_options,
)
from resumekit.errors import CorruptCheckpointError, ResumekitError
from resumekit.store.catalog import CheckpointEntry, verify_checkpoint
from resumekit.store.storage import Storage
from resumekit.store.targets import CheckpointTarget, open_target, select_committed

__all__ = ["SCHEMA", "add_parser", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.verify/1"


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``verify`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "verify",
        help=summary,
        description="Re-hash every file against the manifest (size and XXH3-128). On a "
        "root: the newest committed checkpoint, --step N, or --all committed ones. Exit "
        "1 naming the first bad file.",
    )
    parser.add_argument("path", help="checkpoint root or one checkpoint directory")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None, help="verify this step")
    which.add_argument("--all", action="store_true",
                       help="verify every committed checkpoint (corrupt ones fail)")
    add_common_options(parser, json_help=f"print one JSON document (schema {SCHEMA})")
    parser.set_defaults(run=run)


def _targets(target: CheckpointTarget, args: argparse.Namespace) -> list[CheckpointEntry]:
    if not args.all:
        return [select_committed(target, args.step)]
    if not target.is_root:
        raise UsageError(
            f"--all needs a checkpoint root, not the checkpoint {target.storage.path()}",
            name="--all", value=True,
        )
    entries = [e for e in target.entries() if e.status in ("committed", "corrupt")]
    if not entries:
        select_committed(target, None)  # raises: nothing committed under the root
    return entries


def _verify_one(storage: Storage, entry: CheckpointEntry, enabled: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "step": entry.step, "name": entry.name, "path": entry.path, "ok": False,
        "files": None, "bytes": None, "error": None, "file": None,
    }
    if entry.status != "committed" or entry.manifest is None:
        result["error"] = f"{entry.path} is {entry.status}: {entry.problem}"
        return result
    manifest = entry.manifest
    result["files"] = len(manifest.files)
    result["bytes"] = manifest.total_bytes
    try:
        with progress_bar(manifest.total_bytes, f"verify step {entry.step}",
                          enabled=enabled) as advance:
            verify_checkpoint(storage, entry.name, manifest=manifest, progress=advance)
    except ResumekitError as error:
        result["error"] = str(error)
        result["file"] = getattr(error, "file", None)
        return result
    result["ok"] = True
    return result


def run(args: argparse.Namespace) -> int:
    """Run ``verify``; return the exit code."""
    options = storage_options(args.storage_option)
    target = open_target(args.path, storage_options=options, name_format=args.name_format)
    show = not (args.json or args.no_progress)
    results = [_verify_one(target.storage, entry, show) for entry in _targets(target, args)]
    failed = [result for result in results if not result["ok"]]
    if args.json:
        emit_json({"schema": SCHEMA, "ok": not failed, "results": results})
    else:
        out = console()
        for result in results:
            if result["ok"]:
                out.print(f"ok      step {result['step']}: {result['files']} files, "
                          f"{format_bytes(result['bytes'])} match the manifest "
                          f"({result['path']})")
            else:
                out.print(f"FAILED  step {result['step']}: {result['error']}")
    if failed:
        first = failed[0]
        raise CorruptCheckpointError(
            f"verification failed for step {first['step']}: {first['error']}"
            + (f" ({len(failed)} checkpoints failed)" if len(failed) > 1 else ""),
            path=first["path"], step=first["step"], file=first["file"],
        )
    return 0
