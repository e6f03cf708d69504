"""Which committed checkpoints to keep: small policies combined with ``|`` and ``&``.

    >>> policy = keep_last(2) | keep_every(1000)
    >>> sorted(policy.keep([500, 1000, 1500, 2000, 2500]))
    [1000, 2000, 2500]

``a | b`` keeps what either keeps; ``a & b`` keeps what both keep. :func:`prune` applies a
policy after a publish and never deletes the newest committed checkpoint, the one the run
resumed from (``protect``), or anything being written. It also sweeps staging directories
abandoned by dead writers.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from resumekit.catalog import CheckpointEntry, list_checkpoints
from resumekit.commit import WRITER_FILE, recover_interrupted
from resumekit.errors import ConfigurationError
from resumekit.layout import ATTEMPT_PREFIX, NameFormat
from resumekit.manifest import MANIFEST_NAME
from resumekit.storage import Storage

__all__ = [
    "PruneReport",
    "RetentionPolicy",
    "keep_all",
    "keep_every",
    "keep_last",
    "keep_steps",
    "prune",
]


class RetentionPolicy:
    """A rule choosing, from the committed steps, those to keep."""

    def __init__(self, select: Callable[[Sequence[int]], set[int]], description: str) -> None:
        self._select = select
        self.description = description

    def keep(self, steps: Iterable[int]) -> set[int]:
        """Return the subset of ``steps`` this policy keeps."""
        ordered = sorted(set(steps))
        return self._select(ordered) & set(ordered)

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return RetentionPolicy(lambda s: self._select(s) | other._select(s),
                               f"({self.description} | {other.description})")

    def __and__(self, other: RetentionPolicy) -> RetentionPolicy:
        return RetentionPolicy(lambda s: self._select(s) & other._select(s),
                               f"({self.description} & {other.description})")

    def __repr__(self) -> str:
        return self.description


def keep_last(count: int) -> RetentionPolicy:
    """Keep the ``count`` newest checkpoints."""
    if count < 1:
        raise ConfigurationError(f"keep_last needs count >= 1, got {count}", name="count",
                                 value=count)
    return RetentionPolicy(lambda steps: set(steps[-count:]), f"keep_last({count})")


def keep_every(interval: int) -> RetentionPolicy:
    """Keep checkpoints whose step is a multiple of ``interval`` (e.g. milestones)."""
    if interval < 1:
        raise ConfigurationError(f"keep_every needs interval >= 1, got {interval}",
                                 name="interval", value=interval)
    return RetentionPolicy(lambda steps: {s for s in steps if s % interval == 0},
                           f"keep_every({interval})")


def keep_steps(*steps: int) -> RetentionPolicy:
    """Keep exactly the listed steps (when present)."""
    wanted = frozenset(steps)
    return RetentionPolicy(lambda have: set(have) & wanted, f"keep_steps{tuple(sorted(wanted))}")


def keep_all() -> RetentionPolicy:
    """Keep everything (no pruning)."""
    return RetentionPolicy(set, "keep_all()")


@dataclass
class PruneReport:
    """What :func:`prune` did (or would do, on a dry run).

    Attributes:
        kept: Committed steps kept.
        deleted: Committed steps deleted.
        swept: Names of abandoned staging directories removed.
        dry_run: True when nothing was actually deleted.
    """

    kept: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    dry_run: bool = False


def _abandoned(storage: Storage, name: str, now: float, sweep_after: float,
               active_tokens: Iterable[str]) -> bool:
    """Whether the staging area ``name`` may be swept: old enough, and its writer gone.

    The writer record (``.writer.json``: host, pid, token, start time) is read once. A
    writer on another host cannot be checked, so there its age alone decides; a missing or
    unreadable record counts as a dead writer, dated by the directory's mtime.
    """
    try:
        writer = json.loads(storage.read_bytes(f"{name}/{WRITER_FILE}"))
        started = float(writer["started"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, OSError):
        writer, started = None, storage.mtime(name) or now
    if now - started < sweep_after:
        return False
    if writer is not None and writer.get("token") in set(active_tokens):
        return False  # a save of this process, in flight
    if writer is None or writer.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(writer.get("pid", -1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return False


def prune(
    storage: Storage,
    policy: RetentionPolicy,
    *,
    name_format: NameFormat | None = None,
    protect: Iterable[int] = (),
    active_tokens: Iterable[str] = (),
    sweep_after: float = 3600.0,
    dry_run: bool = False,
) -> PruneReport:
    """Delete committed checkpoints the policy does not keep, and sweep abandoned staging.

    Args:
        storage: The checkpoint root.
        policy: Which committed steps to keep.
        name_format: How step directories are named.
        protect: Steps never deleted (e.g. the step this run resumed from).
        active_tokens: Tokens of saves in flight in this process (never swept).
        sweep_after: Seconds after which a staging directory whose writer is gone (or
            unknowable, on another host) is swept.
        dry_run: Report without deleting.

    Returns:
        What was (or would be) kept, deleted and swept.
    """
    name_format = name_format or NameFormat()
    if not dry_run:
        recover_interrupted(storage, name_format)
    entries = list_checkpoints(storage, name_format)
    committed = [e.step for e in entries if e.status == "committed"]
    keep = policy.keep(committed) | set(protect) | set(committed[-1:])
    report = PruneReport(kept=[s for s in committed if s in keep], dry_run=dry_run)
    now = time.time()
    token = os.urandom(6).hex()
    for entry in entries:
        if entry.status == "committed" and entry.step not in keep:
            report.deleted.append(entry.step)
            if not dry_run:
                _delete_committed(storage, name_format, entry.step, entry.name, token)
        elif entry.status == "partial" and entry.name.startswith("."):
            # (set-aside corrupt checkpoints, ".<name>.bad-<token>", are never swept)
            if not _abandoned(storage, entry.name, now, sweep_after, active_tokens):
                continue
            report.swept.append(entry.name)
            if not dry_run:
                storage.remove_tree(entry.name)
    if not storage.atomic_rename:
        report.swept.extend(_sweep_attempts(storage, entries, now, sweep_after=sweep_after,
                                            active_tokens=active_tokens, dry_run=dry_run))
    return report


def _sweep_attempts(storage: Storage, entries: Iterable[CheckpointEntry], now: float, *,
                    sweep_after: float, active_tokens: Iterable[str], dry_run: bool
                    ) -> list[str]:
    """Object stores: sweep ``step_X/attempt-<token>/`` prefixes no manifest points to."""
    swept = []
    for entry in entries:
        if entry.name.startswith(".") or entry.status in ("legacy", "foreign"):
            continue
        published = entry.manifest.data_dir if entry.manifest is not None else None
        for info in storage.list_dir(entry.name):
            if not info.is_dir or not info.name.startswith(ATTEMPT_PREFIX) \
                    or info.name == published:
                continue
            name = f"{entry.name}/{info.name}"
            if not _abandoned(storage, name, now, sweep_after, active_tokens):
                continue
            swept.append(name)
            if not dry_run:
                storage.remove_tree(name)
    return swept


def _delete_committed(storage: Storage, name_format: NameFormat, step: int, name: str,
                      token: str) -> None:
    """De-commit first (so a crash never leaves a half-deleted 'checkpoint'), then delete."""
    if storage.atomic_rename:
        retired = name_format.retired_name(step, token)
        storage.rename_dir(name, retired)
        storage.remove_file(f"{retired}/{MANIFEST_NAME}")
        storage.fsync_dir(retired)
        storage.remove_tree(retired)
        return
    storage.remove_file(f"{name}/{MANIFEST_NAME}")
    storage.remove_tree(name)
