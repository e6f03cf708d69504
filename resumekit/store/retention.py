"""Which committed checkpoints to keep: small policies combined with ``|`` and ``&``.

    >>> policy = keep_last(2) | keep_every(1000)
    >>> sorted(policy.keep([500, 1000, 1500, 2000, 2500]))
    [1000, 2000, 2500]

``a | b`` keeps what either keeps; ``a & b`` keeps what both keep. :func:`keep_best` ranks
checkpoints by a metric recorded in their manifests at save time (``Manifest.metrics``).
:func:`prune` applies a
policy after a publish and never deletes the newest committed checkpoint, the one the run
resumed from (``protect``), or anything being written. It also sweeps staging directories
abandoned by dead writers (each with a warning naming it and why): at once what a cut
operation provably left (a manifest write or a deletion cut part-way), otherwise only
what has not changed for ``sweep_after`` seconds on the storage's own clock (the mtimes
the storage recorded, against a probe file's) and whose writer is not a live process of
this host; no host's clock is trusted. Entries that vanish under it are skipped with a
note; a deletion that fails is reported and the rest goes on (:class:`PruneReport`). A
symbolic link is never a checkpoint (:mod:`resumekit.store.catalog`): it is never deleted nor
swept, and nothing is deleted through one (:class:`~resumekit.store.storage.Storage` refuses it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from resumekit.errors import CheckpointNotFoundError, ConfigurationError, StorageError
from resumekit.store.catalog import (
    CheckpointEntry,
    Listing,
    classify_step,
    hidden_entries,
    list_checkpoints,
    list_root,
    step_directories,
)
from resumekit.store.layout import GENERATIONS_DIR, MANIFEST_NAME, NameFormat
from resumekit.store.newest import forget_newest_hint
from resumekit.store.recovery import (
    cut_short_reason,
    pid_gone,
    read_writer,
    recover_interrupted,
    staging_areas,
    writer_of,
)
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "PruneReport",
    "RetentionPolicy",
    "RollingSweep",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_steps",
    "prune",
]

logger = logging.getLogger("resumekit")


Scores = Mapping[int, Mapping[str, float]]
"""Metrics recorded per committed step (``Manifest.metrics``), as policies read them."""

_NO_SCORES: Scores = {}


class RetentionPolicy:
    """A rule choosing, from the committed steps, those to keep.

    Args:
        select: Given the committed steps in ascending order, the steps to keep.
        description: How the policy prints.
    """

    def __init__(self, select: Callable[[Sequence[int]], set[int]], description: str) -> None:
        self._select: Callable[[Sequence[int], Scores], set[int]] = (
            lambda steps, _scores: select(steps))
        self.description = description
        self.metrics: frozenset[str] = frozenset()
        """Names of the metrics the policy reads (empty: it decides on steps alone)."""

    @classmethod
    def _ranked(cls, select: Callable[[Sequence[int], Scores], set[int]], description: str,
                metrics: frozenset[str]) -> RetentionPolicy:
        policy = cls(set, description)
        policy._select = select
        policy.metrics = metrics
        return policy

    def keep(self, steps: Iterable[int], scores: Scores | None = None) -> set[int]:
        """Return the subset of ``steps`` this policy keeps.

        Args:
            steps: Committed steps.
            scores: Metrics recorded per step (read by :func:`keep_best`); a step missing
                here has none.
        """
        ordered = sorted(set(steps))
        return self._select(ordered, scores or _NO_SCORES) & set(ordered)

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return RetentionPolicy._ranked(
            lambda s, m: self._select(s, m) | other._select(s, m),
            f"({self.description} | {other.description})", self.metrics | other.metrics)

    def __and__(self, other: RetentionPolicy) -> RetentionPolicy:
        return RetentionPolicy._ranked(
            lambda s, m: self._select(s, m) & other._select(s, m),
            f"({self.description} & {other.description})", self.metrics | other.metrics)

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


def keep_best(count: int, *, metric: str, mode: Literal["min", "max"] = "min"
              ) -> RetentionPolicy:
    """Keep the ``count`` checkpoints with the best ``metric`` (lowest for ``"min"``).

    The metric is the one recorded in each checkpoint's manifest at save time
    (``Manifest.metrics``; the Lightning integration records the score ``ModelCheckpoint``
    gave the checkpoint under its ``monitor`` name). Checkpoints without it (saved before
    it was logged, or by a writer that records none) are not ranked, so this policy alone
    does not keep them: combine it with :func:`keep_last` or :func:`keep_every` for those.
    Of equal scores the newer step ranks first.

    Raises:
        ConfigurationError: ``count`` below 1, an empty ``metric`` or an unknown ``mode``.
    """
    if count < 1:
        raise ConfigurationError(f"keep_best needs count >= 1, got {count}", name="count",
                                 value=count)
    if not metric:
        raise ConfigurationError("keep_best needs a metric name", name="metric", value=metric)
    if mode not in ("min", "max"):
        raise ConfigurationError(f"keep_best mode must be 'min' or 'max', got {mode!r}",
                                 name="mode", value=mode)
    sign = 1.0 if mode == "min" else -1.0

    def best(steps: Sequence[int], scores: Scores) -> set[int]:
        ranked = [(sign * float(scores[step][metric]), -step) for step in steps
                  if metric in scores.get(step, {})
                  and not math.isnan(float(scores[step][metric]))]
        return {-negated for _, negated in sorted(ranked)[:count]}

    return RetentionPolicy._ranked(best, f"keep_best({count}, metric={metric!r}, "
                                         f"mode={mode!r})", frozenset({metric}))


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
        notes: Entries skipped because they vanished (or were renamed back) under the
            prune: another process removed or restored them; with ``scope="all"`` also
            every symbolic link in a checkpoint's place, left alone. One line each.
        failures: Deletions or sweeps that failed (e.g. ``EBUSY`` from NFS ``.nfsXXXX``
            files), one line each naming the directory and the error; the prune went on
            with the other entries.
        unreadable: With ``scope="all"``, every step directory whose manifest could not
            be read as a committed checkpoint (garbled, nested too deep, unsafe, naming
            another step, written by a newer resumekit), one line each naming it and
            why. Prune neither counts nor deletes them; the policy ran on the others.
    """

    kept: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """Notes, unreadable entries and failures together, in that order."""
        return [*self.notes, *self.unreadable, *self.failures]


class _StorageClock:
    """The storage's own "now": the mtime it gives a probe file written when first asked.

    Ages of staging areas are differences of two times the storage itself recorded (the
    mtimes of their entries, and this probe's), so neither the writer's host clock nor
    this host's counts: a writer whose clock runs behind is not taken for an old one.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._now: float | None = None
        self._asked = False
        self.problem: str | None = None

    def now(self) -> float | None:
        """The storage's time now (read once), None when it cannot be read."""
        if self._asked:
            return self._now
        self._asked = True
        probe = f"{GENERATIONS_DIR}/clock-probe-{os.urandom(6).hex()}"
        try:
            self.storage.write_bytes(probe, b"")
            self._now = self.storage.mtime(probe)
        except OSError as error:
            self.problem = f"cannot read the storage's clock (writing {probe}): {error}"
        else:
            if self._now is None:
                self.problem = f"{self.storage.url} reports no modification times"
        finally:
            # (left behind, it is an empty file in .resumekit-generations/, never read)
            with contextlib.suppress(OSError):
                self.storage.remove_file(probe)
        return self._now


def _last_change(storage: Storage, name: str) -> float | None:
    """The newest modification time the storage recorded for ``name`` or anything below.

    Raises:
        FileNotFoundError: ``name`` vanished meanwhile.
    """
    newest = storage.mtime(name)
    folders = [name]
    while folders:
        folder = folders.pop()
        for info in storage.list_dir(folder):
            if info.mtime is not None:
                newest = info.mtime if newest is None else max(newest, info.mtime)
            if info.is_dir:
                folders.append(f"{folder}/{info.name}")
    return newest


def _abandoned(storage: Storage, name: str, clock: _StorageClock, sweep_after: float,
               active_tokens: Iterable[str], *, retiring: bool) -> str | None:
    """Why the staging area ``name`` may be swept, else None.

    At once when it is provably left by a cut operation
    (:func:`~resumekit.store.recovery.cut_short_reason`). Otherwise never while its writer (its
    record, else its manifest's lineage) is a live process of this host or a save of
    this process (``active_tokens``); else once nothing in it changed for
    ``sweep_after`` seconds, measured on the storage's own clock (:class:`_StorageClock`):
    the writer record's start time, taken on the writer's host, is not trusted.

    Raises:
        FileNotFoundError: ``name`` vanished meanwhile.
    """
    writer = read_writer(storage, name)
    if writer is not None and writer.get("token") in set(active_tokens):
        return None  # a save of this process, in flight
    reason = cut_short_reason(storage, name, retiring=retiring)
    if reason is not None:
        return reason
    if not retiring:
        writer = writer_of(storage, name, writer)
    if writer is None:
        who = "it has no writer record"
    elif writer.get("host") != socket.gethostname():
        who = f"its writer is on another host ({writer.get('host')}), unknowable from here"
    elif pid_gone(writer.get("pid", -1)):
        who = f"its writer, pid {writer.get('pid')} on this host, is gone"
    else:
        return None  # a live writer of this host
    if sweep_after <= 0:
        return who
    changed, now = _last_change(storage, name), clock.now()
    if changed is None or now is None or now - changed < sweep_after:
        return None
    return f"unchanged for {now - changed:.0f}s by the storage's clock and {who}"


_LISTING_ATTEMPTS = 3


@dataclass
class RollingSweep:
    """Where a ``scope="top"`` prune goes on reading older step directories from.

    Staging a crashed writer left under an older step directory on an object store (a
    crashed ``replace``, a crash before its writer record) is below the top of the root,
    where begin's sweep and a top prune look. Each top prune therefore also reads a few
    step directories below what it read anyway, going down one prune after the other and
    starting over at the top: every directory is looked into once every
    ``len(root) / per_prune`` prunes, at a constant cost per prune.

    Attributes:
        per_prune: Step directories read per prune, besides the ones that decide.
        below: The next prune reads the step directories below this step (None: from
            the top again).
    """

    per_prune: int = 2
    below: int | None = None

    def next_entries(self, storage: Storage, name_format: NameFormat, listing: Listing,
                     classified: Sequence[CheckpointEntry]) -> list[CheckpointEntry]:
        """Classify the next ``per_prune`` step directories (not in ``classified``)."""
        seen = {entry.step for entry in classified}
        lowest = min(seen, default=None)
        start = self.below if self.below is not None else lowest
        names = [(step, name) for step, name in step_directories(listing, name_format)
                 if step not in seen and (start is None or step < start)]
        chosen = names[:self.per_prune]
        self.below = chosen[-1][0] if len(names) > self.per_prune else None
        return [classify_step(storage, step, name_format) for step, _ in chosen]


def prune(
    storage: Storage,
    policy: RetentionPolicy,
    *,
    name_format: NameFormat | None = None,
    protect: Iterable[int] = (),
    active_tokens: Iterable[str] = (),
    sweep_after: float = 3600.0,
    dry_run: bool = False,
    errors: Literal["raise", "warn", "report"] = "raise",
    scope: Literal["all", "top"] = "all",
    rolling: RollingSweep | None = None,
) -> PruneReport:
    """Delete committed checkpoints the policy does not keep, and sweep abandoned staging.

    An entry that vanishes under the prune (another process deleted it, or renamed it
    back) is skipped with a note; a deletion that fails (``EBUSY``, permissions) is
    recorded as a failure and the prune goes on with the other entries. Both are logged.

    Args:
        storage: The checkpoint root.
        policy: Which committed steps to keep.
        name_format: How step directories are named.
        protect: Steps never deleted (e.g. the step this run resumed from).
        active_tokens: Tokens of saves in flight in this process (never swept).
        sweep_after: Seconds a staging directory whose writer is gone (or unknowable,
            on another host) must have stayed unchanged before it is swept, measured on
            the storage's clock (``0``: at once).
        dry_run: Report without deleting.
        errors: What failures do once every entry was handled: ``"raise"`` a
            :class:`~resumekit.errors.StorageError` listing them (notes are warned about),
            ``"warn"`` (a :class:`~resumekit.warnings.ResumekitWarning` per note and
            failure), or ``"report"`` (only in the returned report: the manager and the
            CLI report them themselves).
        scope: ``"all"`` reads every manifest of the root and looks for abandoned
            staging under every step directory (``resumekit prune``). ``"top"`` (the
            manager, after each save) decides from names and reads only the manifests
            that decide (:func:`_decide_from_names`), and on object stores looks for
            staging only in the step directories it read, plus a few more each time
            (``rolling``): its cost does not grow with the checkpoints kept. Its
            ``kept`` counts step directories below the lowest deletion by name.
        rolling: With ``"top"``, where the look at older step directories goes on from
            (kept between prunes by the caller; each prune reads
            :attr:`RollingSweep.per_prune` more, cycling through the root).

    Returns:
        What was (or would be) kept, deleted and swept, and what was skipped or failed.

    Raises:
        StorageError: With ``errors="raise"``, when a deletion or sweep failed.
    """
    name_format = name_format or NameFormat()
    report = PruneReport(dry_run=dry_run)
    if scope == "all":
        if not dry_run:
            recover_interrupted(storage, name_format)
        entries = _listing(storage, name_format, report)
        committed = [e.step for e in entries if e.status == "committed"]
        keep = (policy.keep(committed, _scores(entries)) | set(protect)
                | set(committed[-1:]))
        report.kept = [s for s in committed if s in keep]
        doomed = [e for e in entries if e.status == "committed" and e.step not in keep]
        report.notes.extend(f"left {e.path} alone: {e.problem}" for e in entries
                            if e.defect == "symlink")
        report.unreadable.extend(f"cannot read {e.path} (step {e.step}): {e.problem}"
                                 for e in entries if e.defect in _UNREADABLE)
    else:
        entries, doomed = _decide_from_names(storage, policy, name_format, set(protect),
                                             report, rolling=rolling)
    token = os.urandom(6).hex()
    for entry in doomed:
        if dry_run:
            report.deleted.append(entry.step)
            continue
        if _attempt(storage, report, entry.name, f"delete step {entry.step}",
                    functools.partial(_delete_committed, storage, name_format,
                                      entry.step, entry.name, token)):
            report.deleted.append(entry.step)
    report.deleted.sort()
    _sweep_abandoned(storage, entries, report, sweep_after=sweep_after,
                     active_tokens=active_tokens)
    _report(storage, report, errors)
    return report


def _decide_from_names(storage: Storage, policy: RetentionPolicy, name_format: NameFormat,
                       protect: set[int], report: PruneReport, *,
                       rolling: RollingSweep | None = None,
                       ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
    """Decide what to delete from one listing, reading only the manifests that matter.

    The policy first runs on the step directories' names. Nothing is deleted on a name:
    the manifests are read from the top down to the lowest step the policy would delete
    (and always down to the newest committed one), and the policy runs again on what they
    say, the steps below that lowest one counted by name (a rule that keeps a step on
    the steps above it, as every built-in policy does, keeps at least as much that way).
    Only entries whose committed manifest was read are deleted. A policy ranking by a
    metric (:func:`keep_best`) keeps nothing on names alone, so the manifests it ranks are
    all read; a step counted by name has no metric and only makes the others rank higher.

    Returns:
        The entries classified (the hidden ones included: the sweep's candidates) and the
        committed entries to delete, highest step first.
    """
    for attempt in range(_LISTING_ATTEMPTS):
        try:
            return _decide_once(storage, policy, name_format, protect, report,
                                rolling=rolling)
        except CheckpointNotFoundError as error:
            if attempt == _LISTING_ATTEMPTS - 1:
                raise
            report.notes.append(f"{error} while listing {storage.path()} (another "
                                "process removed it): listed again")
    raise AssertionError("unreachable")  # pragma: no cover


def _decide_once(storage: Storage, policy: RetentionPolicy, name_format: NameFormat,
                 protect: set[int], report: PruneReport, *, rolling: RollingSweep | None
                 ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
    listing = list_root(storage)
    if not report.dry_run and recover_interrupted(storage, name_format, listing=listing):
        listing = list_root(storage)
    named = [step for step, _ in step_directories(listing, name_format)]  # highest first
    presumed = policy.keep(named) | protect | set(named[:1])
    lowest = min((step for step in named if step not in presumed), default=None)
    classified, newest = _classify_down_to(storage, listing, name_format, lowest)
    if rolling is not None and not storage.atomic_rename:
        # POSIX staging is a hidden entry of the root itself (the listing shows it);
        # only an object store's sits under a step directory.
        classified += rolling.next_entries(storage, name_format, listing, classified)
    read = {entry.step for entry in classified}
    committed = sorted({e.step for e in classified if e.status == "committed"}
                       | {step for step in named if step not in read})
    keep = (policy.keep(committed, _scores(classified)) | protect
            | ({newest} if newest is not None else set()))
    report.kept = [step for step in committed if step in keep]
    doomed = [e for e in classified if e.status == "committed" and e.step not in keep]
    return [*hidden_entries(storage, listing, name_format), *classified], doomed


def _scores(entries: Iterable[CheckpointEntry]) -> Scores:
    """The metrics each committed entry's manifest recorded."""
    return {entry.step: entry.manifest.metrics for entry in entries
            if entry.manifest is not None and entry.status == "committed"}


def _classify_down_to(storage: Storage, listing: list[tuple[str, bool]],
                      name_format: NameFormat, lowest: int | None
                      ) -> tuple[list[CheckpointEntry], int | None]:
    """Read the step directories from the top down to ``lowest``.

    Always reads down to the newest committed one. Returns the entries read, highest
    first, and that newest committed step.
    """
    classified: list[CheckpointEntry] = []
    newest: int | None = None
    for step, _ in step_directories(listing, name_format):
        if newest is not None and (lowest is None or step < lowest):
            break
        entry = classify_step(storage, step, name_format)
        classified.append(entry)
        if newest is None and entry.status == "committed":
            newest = entry.step
    return classified, newest


def _sweep_abandoned(storage: Storage, entries: list[CheckpointEntry], report: PruneReport,
                     *, sweep_after: float, active_tokens: Iterable[str]) -> None:
    """Sweep (or, on a dry run, list) the staging areas abandoned by dead writers.

    Each sweep is logged and warned about, naming the directory and why.
    """
    clock = _StorageClock(storage)
    retiring = {entry.name for entry in entries if entry.defect == "retiring"}
    for name in staging_areas(storage, entries):
        # (set-aside corrupt checkpoints, ".<name>.bad-<token>", are never swept)
        try:
            reason = _abandoned(storage, name, clock, sweep_after, active_tokens,
                                retiring=name in retiring)
        except FileNotFoundError:
            report.notes.append(f"{storage.path(name)} vanished while pruning (another "
                                "process removed it): skipped")
            continue
        if reason is None:
            continue
        if report.dry_run:
            report.swept.append(name)
        elif _attempt(storage, report, name, "sweep the abandoned staging area",
                      functools.partial(storage.remove_tree, name)):
            report.swept.append(name)
            message = f"swept the abandoned staging area {storage.path(name)}: {reason}"
            warn(f"retention: {message}", ResumekitWarning, stacklevel=3)
    if clock.problem is not None:
        report.notes.append(f"{clock.problem}: staging areas of writers that cannot be "
                            "checked from here were kept (their age is unknown)")


#: Defects of a step directory whose manifest is there but cannot be read as a committed
#: checkpoint: :func:`prune` names each (``PruneReport.unreadable``).
_UNREADABLE = frozenset({"bad-manifest", "unsafe-manifest", "wrong-step", "newer-schema"})


def _report(storage: Storage, report: PruneReport,
            errors: Literal["raise", "warn", "report"]) -> None:
    """Log every note and failure; warn or raise as ``errors`` says."""
    warned = [] if errors == "report" else \
        [*report.notes, *report.unreadable] if errors == "raise" else report.problems
    for line in report.problems:
        if line not in warned:  # a line is said once: as a warning, else as a log line
            logger.warning("resumekit: retention: %s", line)
    for line in warned:
        warn(f"retention: {line}", ResumekitWarning, stacklevel=3)
    if errors == "raise" and report.failures:
        raise StorageError(
            f"pruning {storage.path()} failed for {len(report.failures)} entr"
            f"{'y' if len(report.failures) == 1 else 'ies'} (the others were handled): "
            + "; ".join(report.failures),
            path=storage.path(), operation="prune", failures=list(report.failures),
        )


def _listing(storage: Storage, name_format: NameFormat, report: PruneReport
             ) -> list[CheckpointEntry]:
    """List the root, again when an entry vanished while it was being read."""
    for attempt in range(_LISTING_ATTEMPTS):
        try:
            return list_checkpoints(storage, name_format)
        except CheckpointNotFoundError as error:
            if attempt == _LISTING_ATTEMPTS - 1:
                raise
            report.notes.append(f"{error} while listing {storage.path()} (another "
                                "process removed it): listed again")
    raise AssertionError("unreachable")  # pragma: no cover


def _attempt(storage: Storage, report: PruneReport, name: str, what: str,
             action: Callable[[], None]) -> bool:
    """Run one deletion; a vanished entry becomes a note, any other error a failure.

    Returns whether it succeeded.
    """
    try:
        forget_newest_hint(storage)  # before the root changes (see catalog)
        action()
    except _Vanished as vanished:
        report.notes.append(str(vanished))
        return False
    except OSError as error:
        if not isinstance(error, _Renamed) and not storage.exists(name):
            report.notes.append(f"{storage.path(name)} vanished while pruning (another "
                                f"process removed or renamed it): skipped ({what})")
            return False
        report.failures.append(f"cannot {what} {storage.path(name)}: {error}")
        return False
    return True


class _Vanished(Exception):
    """A checkpoint a concurrent process took away (or put back) during its deletion."""


class _Renamed(OSError):
    """Marker: an error after the entry was renamed (its old name is gone on purpose)."""


def _delete_committed(storage: Storage, name_format: NameFormat, step: int, name: str,
                      token: str) -> None:
    """De-commit first (so a crash never leaves a half-deleted 'checkpoint'), then delete."""
    if storage.atomic_rename:
        retired = name_format.retired_name(step, token)
        try:
            storage.rename_dir(name, retired)
        except OSError:
            if not storage.exists(name):
                raise _Vanished(f"{storage.path(name)} vanished before it could be deleted "
                                "(another process removed or renamed it): skipped") from None
            raise
        try:
            storage.remove_file(f"{retired}/{MANIFEST_NAME}")
            storage.fsync_dir(retired)
        except OSError as error:
            if not storage.exists(retired):
                # A concurrent recover_interrupted() renamed it back: still committed.
                raise _Vanished(
                    f"{storage.path(name)} was renamed back by another process while "
                    "being deleted: kept") from error
            raise _Renamed(f"{error} (de-committing {storage.path(retired)})") from error
        try:
            storage.remove_tree(retired)
        except OSError as error:
            raise _Renamed(f"{error}; step {step} is de-committed (no manifest), its files "
                           f"stay in {storage.path(retired)} for the next prune") from error
        return
    storage.remove_file(f"{name}/{MANIFEST_NAME}")
    storage.remove_tree(name)
