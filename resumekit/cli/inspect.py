"""``resumekit inspect``: what a checkpoint root, or one checkpoint, holds.

On a local tier's directory (``LocalTier.root``): a table of its sub-roots
(:mod:`resumekit.cli.inspect_local`). On a root: one row per checkpoint (committed,
partial, corrupt, legacy, foreign) with size, world size, time, reason, lineage and the
torch that wrote it; the checkpoint the next run resumes from; the requeue chain
(which job and restart wrote which steps); and the launches, with each one's restart gap,
steps trained again and save stalls, and the run's goodput
(:mod:`resumekit.store.launches`).
On one checkpoint: its manifest, the state it holds, its files and, with ``--tensors``,
every tensor from the metadata alone. Another tool's checkpoint (``foreign``, with its
format) is never taken for an empty root: a root holding only such entries, or a
directory that is one, exits 1 with the ``resumekit import`` command that converts it. A
root is never taken for a local tier's directory because one lies in it: its checkpoints
are listed, and the local tier's directory is named as a problem (exit 1).
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.table import Table
from rich.text import Text

from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    UsageError,
    add_common_options,
    console,
    emit_json,
    format_bytes,
    format_seconds,
    format_time,
    or_dash,
    plain,
    status_text,
    storage_options,
    table,
)
from resumekit.cli.inspect_local import is_local_root, misplaced_sub_roots, run_local_root
from resumekit.errors import (
    CorruptCheckpointError,
    ForeignCheckpointError,
    ResumekitError,
    StorageError,
    UnsafeCheckpointError,
)
from resumekit.store import generations
from resumekit.store.catalog import CheckpointEntry, refuse_links
from resumekit.store.foreign import ForeignCheckpoint, detect_foreign, import_command
from resumekit.store.launches import GOODPUT_METHOD, goodput_of, launches_of
from resumekit.store.layout import TRAIN_STATE_FILE, NameFormat, parse_rank_state_file
from resumekit.store.manifest import (
    PARTS_ALGORITHM,
    Lineage,
    Manifest,
    describe,
    parse_parts_checksum,
)
from resumekit.store.storage import Storage, parse_json
from resumekit.store.targets import CheckpointTarget, open_target, tensors_url

__all__ = ["SCHEMA", "add_parser", "chain_of", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.inspect/1"
_MAX_RANKS_SHOWN = 16
_SAFETENSORS_HEADER_LIMIT = 100 << 20


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``inspect`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "inspect",
        help=summary,
        description="On a local tier's directory: its sub-roots (rank_XXXXX, "
        "replica_of_rank_XXXXX), each a root. On a root: every checkpoint with status, "
        "size, world size, time, reason and lineage, the one the next run resumes from "
        "(*), the requeue chain, and the launches (restart gap, steps trained again, save "
        "stalls) with the run's goodput. On one checkpoint directory: its manifest and "
        "state; --tensors adds every tensor (from metadata, no tensor data read). Exit 1 "
        "when a root holds a corrupt checkpoint, holds only another tool's checkpoints "
        "(status foreign) or is one, holds a local tier's directory (rank_XXXXX) among its "
        "checkpoints, or the directory is not a committed checkpoint.",
    )
    parser.add_argument("path", help="checkpoint root or one checkpoint directory "
                        "(path or fsspec URL)")
    parser.add_argument("--tensors", action="store_true",
                        help="list every tensor (one checkpoint directory only)")
    add_common_options(parser, json_help="print one JSON document (schema "
                       f"{SCHEMA}, see docs/cli.md)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``inspect``; return the exit code."""
    options = storage_options(args.storage_option)
    local = Storage(args.path, options)
    if not args.tensors and is_local_root(
            local, NameFormat(args.name_format) if args.name_format else None):
        return run_local_root(local, args, SCHEMA)
    target = open_target(args.path, storage_options=options, name_format=args.name_format)
    if target.is_root:
        if args.tensors:
            raise UsageError(
                    f"--tensors needs one checkpoint directory, not the root "
                f"{target.storage.path()} (add /<step directory>)",
                name="--tensors", value=target.storage.path(),
            )
        return _inspect_root(target, args)
    return _inspect_one(target, args, options)


# --------------------------------------------------------------------------- root


def _lineage_json(lineage: Lineage | None) -> dict[str, Any] | None:
    return None if lineage is None else lineage.model_dump(mode="json")


def entry_json(
    storage: Storage, entry: CheckpointEntry, *, resume: CheckpointEntry | None,
    since_previous: float | None = None,
) -> dict[str, Any]:
    """The JSON object of one checkpoint entry (the ``checkpoints`` items)."""
    manifest = entry.manifest
    walked = None if manifest is not None or entry.defect == "symlink" else sum(
        size for _, size in storage.walk_files(entry.name)
    )  # (a link is never walked: what it points to is not the root's)
    return {
        "step": entry.step,
        "name": entry.name,
        "status": entry.status,
        "path": entry.path,
        "bytes": manifest.total_bytes if manifest is not None else walked,
        "files": len(manifest.files) if manifest is not None else None,
        "world_size": None if manifest is None else manifest.world_size,
        "created_at": None if manifest is None else manifest.created_at.isoformat(),
        "reason": None if manifest is None else manifest.reason.value,
        "lineage": _lineage_json(None if manifest is None else manifest.lineage),
        # The writer's versions (restore refuses a format another version wrote that
        # this one cannot read); None where the manifest records none.
        "torch_version": None if manifest is None else manifest.versions.get("torch"),
        "resumekit_version": None if manifest is None
        else manifest.versions.get("resumekit"),
        "problem": entry.problem,
        "resume_from": resume is not None and entry.name == resume.name,
        "seconds_since_previous": since_previous,
        "format": entry.format,
        # The save interval in force when it was written (save_every="auto": its inputs).
        "save_interval": None if manifest is None or manifest.save_interval is None
        else manifest.save_interval.model_dump(mode="json"),
    }


@dataclass
class _Run:
    """Consecutive committed checkpoints written by one job restart (or one process)."""

    lineage: Lineage
    manifests: list[Manifest] = field(default_factory=list)
    gap_before: float | None = None

    def to_json(self) -> dict[str, Any]:
        created = [m.created_at for m in self.manifests]
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(created)]
        return {
            "slurm_job_id": self.lineage.slurm_job_id,
            "slurm_restart_count": self.lineage.slurm_restart_count,
            "hostname": self.lineage.hostname,
            "pid": self.lineage.pid,
            "launcher": self.lineage.launcher,
            "resumed_from_step": self.lineage.resumed_from_step,
            "steps": [m.step for m in self.manifests],
            "first_step": self.manifests[0].step,
            "last_step": self.manifests[-1].step,
            "saves": len(self.manifests),
            "first_created_at": created[0].isoformat(),
            "last_created_at": created[-1].isoformat(),
            "mean_seconds_between_saves": sum(gaps) / len(gaps) if gaps else None,
            "seconds_since_previous_run": self.gap_before,
        }


def _run_key(lineage: Lineage) -> tuple[object, ...]:
    if lineage.slurm_job_id is not None:
        return ("slurm", lineage.slurm_job_id, lineage.slurm_restart_count)
    return ("process", lineage.hostname, lineage.pid)


def chain_of(manifests: list[Manifest]) -> list[dict[str, Any]]:
    """Group committed checkpoints (in step order) into runs: one per job restart.

    A run is a maximal sequence of consecutive checkpoints with the same SLURM job id and
    restart count (or, outside SLURM, the same host and process id).

    Returns:
        One JSON object per run (the ``chain`` items of ``inspect --json``).
    """
    runs: list[_Run] = []
    for manifest in manifests:
        if runs and _run_key(runs[-1].lineage) == _run_key(manifest.lineage):
            runs[-1].manifests.append(manifest)
            continue
        gap = None
        if runs:
            gap = (manifest.created_at - runs[-1].manifests[-1].created_at).total_seconds()
        runs.append(_Run(manifest.lineage, [manifest], gap))
    return [item.to_json() for item in runs]


def _root_rows(storage: Storage, entries: list[CheckpointEntry],
               committed: list[CheckpointEntry]
               ) -> tuple[list[dict[str, Any]], CheckpointEntry | None, list[CheckpointEntry]]:
    """The rows of a root's entries, the checkpoint resumed from, the ones restorable.

    The third list holds the committed checkpoints a restore may use, in step order.

    A commit a fenced writer made in the commit's race window is never restored: its row
    says so, and the resume mark goes to the newest checkpoint below it.
    """
    current = generations.newest_generation(storage) if storage.is_dir() else None
    fenced = generations.zombie_commits(committed, current)
    restorable = [entry for entry in committed if entry.name not in fenced]
    resume = restorable[-1] if restorable else None
    previous: datetime | None = None
    rows = []
    for entry in entries:
        since = None
        if entry.manifest is not None and entry.status == "committed":
            created = entry.manifest.created_at
            since = None if previous is None else (created - previous).total_seconds()
            previous = created
        row = entry_json(storage, entry, resume=resume, since_previous=since)
        if entry.name in fenced:
            row["problem"] = f"{fenced[entry.name]}; restore never resumes from it"
        rows.append(row)
    return rows, resume, restorable


def _inspect_root(target: CheckpointTarget, args: argparse.Namespace) -> int:
    storage = target.storage
    unreadable: list[tuple[str, str]] = []  # listed beside the readable steps, not instead
    entries = target.entries(unreadable=unreadable)
    committed = [entry for entry in entries if entry.status == "committed"]
    rows, resume, restorable = _root_rows(storage, entries, committed)
    chain = chain_of([entry.manifest for entry in committed if entry.manifest is not None])
    launches = launches_of([entry.manifest for entry in restorable
                            if entry.manifest is not None])
    launch_rows = [launch.to_json(last=number == len(launches))
                   for number, launch in enumerate(launches, start=1)]
    goodput = goodput_of(launches).to_json()
    corrupt = [entry for entry in entries if entry.status == "corrupt"]
    itself = detect_foreign(storage) if not entries else None
    refused = _foreign_refusal(storage, entries, itself)
    problems = misplaced_sub_roots(storage) if itself is None else []
    if args.json:
        emit_json({
            "schema": SCHEMA,
            "kind": "root",
            "root": storage.path(),
            "name_format": target.name_format.template,
            "resume_from": None if resume is None else resume.step,
            "checkpoints": rows,
            "chain": chain,
            "launches": launch_rows,
            "goodput": goodput,
            "foreign": None if itself is None else {
                "path": itself.path, "format": itself.format, "step": itself.step,
                "marker": itself.marker, "command": getattr(refused, "command", None),
            },
            "problems": problems,
            "unreadable": [{"name": name, "path": storage.path(name), "error": error}
                           for name, error in unreadable],
        })
    else:
        _print_root(storage, target, rows, chain, resume, itself=itself, refused=refused)
        if itself is None and launch_rows:
            _print_launches(launch_rows, goodput)
        for problem in problems:
            console().print(f"problem: {problem['path']} is {problem['problem']}")
        for name, error in unreadable:
            console().print(f"unreadable: {storage.path(name)}: {error}")
    if refused is not None:
        raise refused
    if unreadable:
        raise StorageError(
            f"{len(unreadable)} entr{'y' if len(unreadable) == 1 else 'ies'} of "
            f"{storage.path()} could not be read (listed above, the others with them): "
            + "; ".join(f"{name}: {error}" for name, error in unreadable),
            path=storage.path(unreadable[0][0]))
    if corrupt:
        first = corrupt[0]
        raise CorruptCheckpointError(
            f"{len(corrupt)} corrupt checkpoint(s) under {storage.path()}; first: "
            f"{first.name}: {first.problem}", path=first.path, step=first.step,
        )
    if problems:
        raise ResumekitError(
            f"{storage.path()} holds {len(problems)} local tier director"
            f"{'y' if len(problems) == 1 else 'ies'} among its checkpoints: "
            + ", ".join(problem["name"] for problem in problems)
            + " (node-local copies do not belong in a checkpoint root; move them out)",
            path=problems[0]["path"])
    return 0


def _foreign_refusal(storage: Storage, entries: list[CheckpointEntry],
                     itself: ForeignCheckpoint | None) -> ForeignCheckpointError | None:
    """The error of a root the next run refuses to start in, if it is one.

    That is a root holding only foreign checkpoints (nothing committed, nothing legacy to
    import), or one that is itself a foreign checkpoint.
    """
    if itself is not None:
        into = f"{storage.url_of().rstrip('/')}-resumekit"
        command = import_command(itself, storage, into=into)
        return ForeignCheckpointError(
            f"{itself.path} is not a resumekit root but a {itself.format} checkpoint "
            f"({itself.marker}); convert it with: {command} (then use {into} as the root)",
            path=itself.path, format=itself.format, step=itself.step, command=command)
    if any(e.status in ("committed", "legacy") for e in entries):
        return None
    foreign = [e for e in entries if e.status == "foreign"]
    if not foreign:
        return None
    newest = foreign[-1]
    command = import_command(newest, storage)
    more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
    return ForeignCheckpointError(
        f"{storage.path()} holds no resumekit checkpoint, only another tool's: "
        f"{newest.name} ({newest.format}){more}; the next run refuses to start from step "
        f"0 - convert it with: {command}",
        path=newest.path, format=newest.format, step=None if newest.step < 0 else newest.step,
        command=command)


def _print_root(storage: Storage, target: CheckpointTarget, rows: list[dict[str, Any]],
                chain: list[dict[str, Any]], resume: CheckpointEntry | None, *,
                itself: ForeignCheckpoint | None = None,
                refused: ForeignCheckpointError | None = None) -> None:
    out = console()
    if itself is not None:
        step = "no step recorded" if itself.step is None else f"step {itself.step}"
        out.print(Text(f"{storage.path()} is a ").append_text(status_text("foreign"))
                  .append(f" checkpoint: {itself.format} ({step}; found {itself.marker}), "
                          "not a resumekit root"))
        out.print(f"Convert it with: {getattr(refused, 'command', '')}")
        return
    out.print(f"Checkpoint root {storage.path()} (names: {target.name_format.template})")
    if not rows:
        out.print("No checkpoints: the next run starts fresh.")
        return
    grid = table("", "step", "status", "size", "world", "created (UTC)", "reason",
                 "slurm job", "restart", "resumed from", "since prev", "torch", "note")
    for row in rows:
        lineage = row["lineage"] or {}
        created = row["created_at"]
        grid.add_row(
            "*" if row["resume_from"] else "",
            "-" if row["step"] < 0 else str(row["step"]),
            status_text(row["status"]).append(f" {row['format']}" if row["format"] else ""),
            format_bytes(row["bytes"]),
            or_dash(row["world_size"]),
            "-" if created is None else format_time(datetime.fromisoformat(created)),
            or_dash(row["reason"]),
            or_dash(lineage.get("slurm_job_id")),
            or_dash(lineage.get("slurm_restart_count")),
            or_dash(lineage.get("resumed_from_step")),
            format_seconds(row["seconds_since_previous"]),
            or_dash(row["torch_version"]),
            row["problem"] or "",
        )
    out.print(grid)
    if refused is not None:
        out.print("No resumekit checkpoint, only another tool's: the next run refuses to "
                  f"start from step 0. Convert it with: {getattr(refused, 'command', '')}")
    elif resume is None:
        out.print("No committed checkpoint: the next run starts fresh"
                  + (" (or imports the newest legacy weights)." if any(
                      row["status"] == "legacy" for row in rows) else "."))
    else:
        out.print(f"* the next run resumes from step {resume.step} ({resume.path})")
    if not chain:
        return
    runs = table("run", "slurm job", "restart", "host", "resumed from", "steps", "saves",
                 "first save (UTC)", "last save (UTC)", "mean between saves",
                 "gap before", title="Requeue chain")
    for number, item in enumerate(chain, start=1):
        runs.add_row(
            str(number),
            or_dash(item["slurm_job_id"]),
            or_dash(item["slurm_restart_count"]),
            f"{item['hostname']}:{item['pid']}",
            or_dash(item["resumed_from_step"]),
            f"{item['first_step']}-{item['last_step']}" if item["saves"] > 1
            else str(item["first_step"]),
            str(item["saves"]),
            format_time(datetime.fromisoformat(item["first_created_at"])),
            format_time(datetime.fromisoformat(item["last_created_at"])),
            format_seconds(item["mean_seconds_between_saves"]),
            format_seconds(item["seconds_since_previous_run"]),
        )
    out.print()
    out.print(runs)


def _duration(seconds: float) -> str:
    """Seconds for the launches: ``'4.20 s'`` under a minute, else ``'1:02:05'``."""
    return f"{seconds:.2f} s" if abs(seconds) < 60 else format_seconds(seconds)


def _print_launches(launches: list[dict[str, Any]], goodput: dict[str, Any]) -> None:
    """The ``Launches`` table and the goodput line under it."""
    grid = table("launch", "slurm job", "restart", "host", "resumed from", "steps",
                 "ended", "restart gap", "trained again", "save stalls",
                 title="Launches (goodput)")
    for item in launches:
        first = item["launch"] == 1
        again = item["steps_trained_again"]
        stalls = item["save_stall_seconds"]
        grid.add_row(
            str(item["launch"]),
            or_dash(item["slurm_job_id"]),
            or_dash(item["slurm_restart_count"]),
            f"{item['hostname']}:{item['pid']}",
            or_dash(item["resumed_from_step"]),
            f"{item['first_step']}-{item['last_step']}" if item["saves"] > 1
            else str(item["first_step"]),
            item["ended_said"],
            ("-" if first else "unknown") if item["restart_gap_seconds"] is None
            else _duration(item["restart_gap_seconds"]),
            ("-" if first else "unknown") if again is None
            else f"{'' if item['steps_trained_again_exact'] else '>= '}{again}",
            "unknown" if stalls is None else f"{_duration(stalls)} in "
            f"{item['save_stall_saves']} save{'' if item['save_stall_saves'] == 1 else 's'}",
        )
    out = console()
    out.print()
    out.print(grid)
    fraction = goodput["goodput"]
    if fraction is None:
        out.print(f"Goodput: unknown ({goodput['missing']})")
        return
    bound = "at most " if goodput["upper_bound"] else ""
    out.print(
        f"Goodput: {bound}{100 * fraction:.1f}% - {_duration(goodput['useful_seconds'])} "
        f"of useful training in {_duration(goodput['wall_seconds'])}; lost: restart "
        f"gaps {_duration(goodput['restart_gap_seconds'])}, save stalls "
        f"{_duration(goodput['save_stall_seconds'])}, steps trained again "
        f"{_duration(goodput['trained_again_seconds'])}")
    out.print(f"(method: {GOODPUT_METHOD})")


# --------------------------------------------------------------------------- one checkpoint


def _rng_streams(rng: Any) -> list[str]:
    if not isinstance(rng, dict):
        return []
    streams = [key for key in ("python", "numpy", "torch") if rng.get(key) is not None]
    cuda = rng.get("cuda")
    if isinstance(cuda, list) and cuda:
        streams.append(f"cuda x{len(cuda)}")
    generators = rng.get("generators")
    if isinstance(generators, dict):
        streams.extend(f"generator:{name}" for name in generators)
    return streams


def _model_summary(manifest: Manifest) -> dict[str, Any]:
    import torch  # noqa: PLC0415 - one checkpoint's state only: listing a root needs no torch

    params = manifest.fingerprint.get("params")
    if not isinstance(params, dict):
        return {"tensors": None, "bytes": None, "elements": None}
    total_bytes = 0
    elements = 0
    for spec in params.values():
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)):
            continue
        count = 1
        for size in spec[0]:
            count *= int(size) if isinstance(size, int) else 0
        dtype = getattr(torch, str(spec[1]), None)  # a dtype name: float32, bfloat16...
        elements += count
        if isinstance(dtype, torch.dtype):
            total_bytes += count * dtype.itemsize
    return {"tensors": len(params), "bytes": total_bytes, "elements": elements}


def _state_json(storage: Storage, entry: CheckpointEntry) -> dict[str, Any]:
    from resumekit.state.train_state import read_plain  # noqa: PLC0415 - torch.load, one checkpoint only

    manifest = entry.manifest
    assert manifest is not None
    contents = dict(manifest.state)
    listed = {item.path for item in manifest.files}
    train: dict[str, Any] | None = None
    if TRAIN_STATE_FILE in listed:
        loaded = read_plain(storage, entry.name, manifest, TRAIN_STATE_FILE)
        if isinstance(loaded, dict):
            scheduler = loaded.get("scheduler")
            train = {
                "step": plain(loaded.get("step")),
                "micro_step": plain(loaded.get("micro_step")),
                "world_size": plain(loaded.get("world_size")),
                "scheduler": None if scheduler is None else plain(scheduler),
            }
    rank_files = sorted(
        (rank, path) for path in listed
        for rank in [parse_rank_state_file(path)] if rank is not None
    )
    ranks = []
    for rank, path in rank_files[:_MAX_RANKS_SHOWN]:
        loaded = read_plain(storage, entry.name, manifest, path)
        state = loaded if isinstance(loaded, dict) else {}
        ranks.append({"rank": rank, "file": path, "rng": _rng_streams(state.get("rng")),
                      "data": plain(state.get("data"))})
    return {
        "holds": plain(contents),
        "model": _model_summary(manifest),
        "train_state": train,
        "rank_files": len(rank_files),
        "ranks": ranks,
        "ranks_shown": len(ranks),
        "extras": manifest.extras,
        "config": manifest.fingerprint.get("config"),
    }


def _tensors_json(storage: Storage, entry: CheckpointEntry,
                  options: dict[str, Any]) -> list[dict[str, Any]]:
    if entry.status == "legacy":
        return _legacy_tensors(storage, entry)
    from resumekit import tensors as sharded  # noqa: PLC0415 - DCP metadata, --tensors only

    index = sharded.read_tensor_index(tensors_url(storage, entry),
                                      storage_options=options or None)
    return [
        {"name": info.fqn, "shape": list(info.shape),
         "dtype": str(info.dtype).removeprefix("torch."), "bytes": info.nbytes}
        for info in index.values()
    ]


def _legacy_tensors(storage: Storage, entry: CheckpointEntry) -> list[dict[str, Any]]:
    """Read only the JSON headers of a legacy directory's safetensors files."""
    from resumekit.tools import legacy  # noqa: PLC0415 - --tensors of a legacy directory only

    tensors = []
    for relative in legacy.find_weight_files(storage, entry.name):
        with storage.open(relative, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size <= 0 or size > _SAFETENSORS_HEADER_LIMIT:
                raise CorruptCheckpointError(
                    f"{storage.path(relative)}: not a safetensors file (header size {size})",
                    path=entry.path, file=relative,
                )
            try:
                header = parse_json(handle.read(size), source=storage.path(relative))
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except UnsafeCheckpointError:
                raise
            except ValueError as error:
                raise CorruptCheckpointError(
                    f"{storage.path(relative)}: unreadable safetensors header ({error})",
                    path=entry.path, file=relative,
                ) from error
        for name, spec in header.items():
            if name == "__metadata__" or not isinstance(spec, dict):
                continue
            try:
                begin, end = spec.get("data_offsets", [0, 0])
                count = int(end) - int(begin)
            except (TypeError, ValueError) as error:
                raise CorruptCheckpointError(
                    f"{storage.path(relative)}: tensor {name!r} has no readable data_offsets "
                    f"({error})", path=entry.path, file=relative) from error
            tensors.append({"name": name, "shape": spec.get("shape"),
                            "dtype": spec.get("dtype"), "bytes": count,
                            "file": relative.split("/", 1)[1]})
    return tensors


def _inspect_one(target: CheckpointTarget, args: argparse.Namespace,
                 options: dict[str, Any]) -> int:
    storage = target.storage
    entry = target.entry
    assert entry is not None
    try:  # the newest, read from the top down: not every manifest of the root
        resume, _ = generations.newest_restorable(storage, target.name_format)
    except ResumekitError:
        resume = None
    manifest = entry.manifest
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "checkpoint",
        "root": storage.path(),
        "name_format": target.name_format.template,
        "resume_from": None if resume is None else resume.step,
        "checkpoints": [entry_json(storage, entry, resume=resume)],
        "manifest": None if manifest is None else describe(manifest),
        "state": None,
        "files": [
            {"path": item.path, "bytes": item.size, "checksum": item.checksum}
            for item in manifest.files
        ] if manifest is not None else [] if entry.defect == "symlink" else [
            {"path": path, "bytes": size, "checksum": None}
            for path, size in storage.walk_files(entry.name)
        ],
    }
    if entry.status == "committed":
        assert manifest is not None
        refuse_links(storage, entry.name, manifest)  # nothing is read through a link
        document["state"] = _state_json(storage, entry)
    if args.tensors and entry.status in ("committed", "legacy"):
        document["tensors"] = _tensors_json(storage, entry, options)
    if args.json:
        emit_json(document)
    else:
        _print_one(entry, document)
    if entry.status == "foreign":
        command = import_command(entry, storage)
        raise ForeignCheckpointError(
            f"{entry.path} is not a resumekit checkpoint but a {entry.format} one; convert "
            f"it with: {command}", path=entry.path, format=entry.format,
            step=None if entry.step < 0 else entry.step, command=command)
    if entry.status not in ("committed", "legacy"):
        raise CorruptCheckpointError(
            f"{entry.path} is not a committed checkpoint ({entry.status}: {entry.problem})",
            path=entry.path, step=entry.step,
        )
    return 0


def _print_one(entry: CheckpointEntry, document: dict[str, Any]) -> None:
    out = console()
    row = document["checkpoints"][0]
    head = Text(f"Checkpoint {entry.path}\n  step {entry.step}  ")
    head.append_text(status_text(entry.status))
    if entry.format:
        head.append(f" ({entry.format})")
    head.append(f"  {format_bytes(row['bytes'])} in {len(document['files'])} files")
    if entry.problem:
        head.append(f"\n  problem: {entry.problem}")
    out.print(head)
    manifest = entry.manifest
    resume = document["resume_from"]
    if manifest is not None:
        lineage = manifest.lineage
        facts = Table.grid(padding=(0, 2))
        facts.add_column(style="bold")
        facts.add_column()
        facts.add_row("created (UTC)", format_time(manifest.created_at))
        facts.add_row("reason", manifest.reason.value)
        facts.add_row("world size", str(manifest.world_size))
        facts.add_row("lineage", f"host {lineage.hostname}, pid {lineage.pid}, slurm job "
                      f"{or_dash(lineage.slurm_job_id)}, restart "
                      f"{or_dash(lineage.slurm_restart_count)}, resumed from step "
                      f"{or_dash(lineage.resumed_from_step)}, launcher "
                      f"{or_dash(lineage.launcher)}")
        facts.add_row("versions", ", ".join(f"{k} {v}" for k, v in manifest.versions.items())
                      or "- (not recorded)")
        facts.add_row("schema", str(manifest.schema_version))
        if manifest.save_interval is not None:
            interval = manifest.save_interval
            said = "-" if interval.steps is None else f"every {interval.steps} steps"
            if interval.auto:
                said += f" (save_every='auto': {interval.inputs})"
            facts.add_row("save interval", said)
        if manifest.data_dir != ".":
            facts.add_row("data dir", manifest.data_dir)
        facts.add_row("next resume", "-" if resume is None else
                      f"step {resume}" + (" (this one)" if resume == entry.step else ""))
        out.print(facts)
    state = document["state"]
    if state is not None:
        _print_state(state)
    files = table("file", "size", "checksum", title="Files")
    for item in document["files"]:
        files.add_row(item["path"], format_bytes(item["bytes"]),
                      _shown_checksum(item["checksum"]))
    out.print()
    out.print(files)
    if "tensors" in document:
        tensors = table("tensor", "shape", "dtype", "size", title="Tensors (from metadata)")
        for item in document["tensors"]:
            tensors.add_row(item["name"], "x".join(str(s) for s in item["shape"] or [])
                            or "scalar", str(item["dtype"]), format_bytes(item["bytes"]))
        total = sum(int(item["bytes"]) for item in document["tensors"])
        out.print()
        out.print(tensors)
        out.print(f"{len(document['tensors'])} tensors, {format_bytes(total)}")


def _print_state(state: dict[str, Any]) -> None:
    out = console()
    holds = state["holds"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    model = state["model"]
    if holds.get("model"):
        detail = "yes" if model["tensors"] is None else (
            f"{model['tensors']} tensors, {model['elements']:,} elements, "
            f"{format_bytes(model['bytes'])}")
        grid.add_row("model", detail)
    else:
        grid.add_row("model", "no")
    grid.add_row("optimizer", "yes" if holds.get("optimizer") else "no")
    train = state["train_state"]
    scheduler = "no"
    if holds.get("scheduler") and train is not None and train["scheduler"] is not None:
        keys = train["scheduler"]
        scheduler = "yes" + (f" (last_lr {keys.get('_last_lr')}, epoch "
                             f"{keys.get('last_epoch')})" if isinstance(keys, dict) else "")
    grid.add_row("scheduler", scheduler)
    if train is not None:
        grid.add_row("train state", f"step {train['step']}, micro_step {train['micro_step']}, "
                     f"world size {train['world_size']}")
    grid.add_row("data position", "yes" if holds.get("data") else "no")
    for rank in state["ranks"]:
        data = rank["data"]
        grid.add_row(f"  rank {rank['rank']}",
                     f"rng: {', '.join(rank['rng']) or '-'}; data: "
                     f"{'-' if data is None else json.dumps(data)}")
    if state["rank_files"] > state["ranks_shown"]:
        grid.add_row("", f"... and {state['rank_files'] - state['ranks_shown']} more ranks")
    grid.add_row("extras", json.dumps(state["extras"]) if state["extras"] else "-")
    config = state["config"]
    grid.add_row("config", "-" if not config else json.dumps(config))
    out.print()
    out.print(Text("State", style="bold"))
    out.print(grid)


def _shown_checksum(checksum: str | None) -> str:
    """A file's checksum for the table: a checksum of parts by its count (``--json`` has it)."""
    if checksum is None:
        return "-"
    parts = parse_parts_checksum(checksum)
    return checksum if parts is None else f"{PARTS_ALGORITHM}: {len(parts)} parts"
