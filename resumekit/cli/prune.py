"""``resumekit prune``: apply a retention policy to a checkpoint root.

The same policies and guarantees as :func:`resumekit.store.retention.prune`: committed
checkpoints are de-committed (manifest removed) before their data is deleted, so a crash
never leaves a half-deleted "checkpoint"; the newest committed checkpoint is never
deleted; staging directories are swept only when their writer is gone and they are older
than an hour. Entries that vanish under it (another process removed them) are skipped
with a note; a deletion that fails is printed and makes the exit status 1, after the
other entries were handled; so does every step directory whose manifest cannot be read
(garbled, nested too deep, unsafe, naming another step, a newer schema): each is named on
an ``unreadable:`` line and left as it is. The command line adds one protection: the step the newest
checkpoint's run resumed from (its manifest's ``lineage.resumed_from_step``) is kept,
since that run may still fall back to it; ``--protect`` keeps more.
"""

from __future__ import annotations

import argparse
from typing import Any

from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    UsageError,
    add_common_options,
    console,
    emit_json,
    storage_options,
    table,
)
from resumekit.store.retention import PruneReport, keep_every, keep_last, prune
from resumekit.store.targets import CheckpointTarget, open_target

__all__ = ["SCHEMA", "add_parser", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.prune/1"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``prune`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "prune",
        help=summary,
        description="Keep the K newest committed checkpoints (and, with --keep-every N, "
        "every step divisible by N); delete the rest, never the newest nor the step the "
        "newest run resumed from; sweep abandoned staging directories. --dry-run only "
        "reports.",
    )
    parser.add_argument("path", help="checkpoint root")
    parser.add_argument("--keep-last", dest="keep_last", type=_positive, required=True,
                        metavar="K", help="keep the K newest committed checkpoints")
    parser.add_argument("--keep-every", dest="keep_every", type=_positive, default=None,
                        metavar="N", help="also keep every step divisible by N")
    parser.add_argument("--protect", type=int, action="append", default=[], metavar="STEP",
                        help="never delete this step (repeatable)")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="report what would be deleted, delete nothing")
    add_common_options(parser, json_help=f"print one JSON document (schema {SCHEMA})")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``prune``; return the exit code."""
    options = storage_options(args.storage_option)
    target = open_target(args.path, storage_options=options, name_format=args.name_format)
    if not target.is_root:
        raise UsageError(
            f"prune needs a checkpoint root, not the checkpoint directory "
            f"{target.storage.path()}/{target.entry.name if target.entry else ''}",
            name="path", value=args.path,
        )
    policy = keep_last(args.keep_last)
    if args.keep_every is not None:
        policy = policy | keep_every(args.keep_every)
    protect = _protected(target, args.protect)
    report = prune(target.storage, policy, name_format=target.name_format,
                   protect=protect, dry_run=args.dry_run, errors="report")
    if args.json:
        emit_json({
            "schema": SCHEMA, "root": target.storage.path(), "policy": policy.description,
            "dry_run": report.dry_run, "protected": protect, "kept": report.kept,
            "deleted": report.deleted, "swept": report.swept, "notes": report.notes,
            "failures": report.failures, "unreadable": report.unreadable,
        })
    else:
        _print_report(target.storage.path(), policy.description, protect, report)
    return 1 if report.failures or report.unreadable else 0


def _protected(target: CheckpointTarget, given: list[int]) -> list[int]:
    """The steps never deleted: those given, plus the one the newest run resumed from."""
    committed = [e for e in target.entries() if e.status == "committed"]
    protect = set(given)
    newest = committed[-1].manifest if committed else None
    if newest is not None and newest.lineage.resumed_from_step is not None:
        protect.add(newest.lineage.resumed_from_step)
    return sorted(protect)


def _print_report(root: str, policy: str, protect: list[int], report: PruneReport) -> None:
    out = console()
    verb = "would delete" if report.dry_run else "deleted"
    out.print(f"{root}: policy {policy}"
              + (f", protected {protect}" if protect else "")
              + (" (dry run)" if report.dry_run else ""))
    grid = table("step", "action")
    for step in sorted(report.kept + report.deleted):
        grid.add_row(str(step), verb if step in report.deleted else "keep")
    for name in report.swept:
        grid.add_row(name, "would sweep" if report.dry_run else "swept")
    out.print(grid)
    out.print(f"{len(report.kept)} kept, {len(report.deleted)} {verb}, "
              f"{len(report.swept)} staging directories "
              f"{'would be swept' if report.dry_run else 'swept'}")
    for line in report.notes:
        out.print(f"note: {line}")
    for line in report.unreadable:
        out.print(f"unreadable: {line}")
    for line in report.failures:
        out.print(f"failed: {line}")
