"""A captured save (``SaveJob``) and the one commit sequence every tier writes it by.

The manager captures a save on the calling thread into a :class:`SaveJob` (its manifest
records the run's :func:`lineage`) and writes it there or on the background thread
(:mod:`resumekit.background`; its tensor bytes, with ``async_writer="process"``, in the
writer process). :func:`write_step` is the commit sequence of every save - the durable
root's (blocking, background, emergency) and each rank's local copy
(:mod:`resumekit.local.site`): begin, tensors, step files, publish, abort on error,
retention, record the newest step. The manager's save clock is one context around it
(:meth:`~resumekit.runtime.save_clock.CommitClock.writing`). Once a durable step is
committed, :func:`apply_retention` prunes; when writing fails, :func:`abort_after` removes
the staging area and :func:`save_failure` turns an ``OSError`` into the
:class:`~resumekit.errors.StorageError` that names the step, the root and the file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from resumekit import tensors
from resumekit.errors import ResumekitError, StorageError
from resumekit.runtime import distributed
from resumekit.store.commit import CommitProtocol, PendingCheckpoint
from resumekit.store.coordination import Coordinator, run_on_leader
from resumekit.store.layout import TENSORS_DIR, TRAIN_STATE_FILE, NameFormat, rank_state_file
from resumekit.store.manifest import Lineage, Manifest
from resumekit.store.retention import RetentionPolicy, RollingSweep, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

if TYPE_CHECKING:
    from datetime import datetime

    import torch.distributed as dist

    from resumekit.runtime.save_clock import SaveTiming
    from resumekit.store.manifest import FileEntry
    from resumekit.tensors.plans import SavePlans
    from resumekit.tensors.remote import RemoteWrites

__all__ = ["SaveJob", "StepTarget", "abort_after", "apply_retention", "lineage",
           "save_failure", "write_step"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class SaveJob:
    """One save, captured on the calling thread, written on any thread."""

    step: int
    replace: bool
    tensors: dict[str, Any]
    train: bytes
    ranks: bytes
    manifest: Manifest
    started: float
    background: bool = False  # overlaps training: writer threads at idle CPU priority
    writer: RemoteWrites | None = None  # the writer process that writes its tensor bytes
    # A save training waits for: when its call began (time.monotonic()), what its manifest
    # counts of it as held up to publication (Manifest.save_stalls); None: it holds nothing.
    since: float | None = None


@dataclass(frozen=True)
class StepTarget:
    """Where :func:`write_step` commits a step, and how this process writes its files.

    Attributes:
        protocol: The commit protocol of the root (its storage, names and coordinator).
        rank: The rank whose state file this process writes (``rank_XXXXX.pt``).
        tensor_format: How tensors are written (``"raw"`` or ``"dcp"``).
        group: The process group whose ranks write the tensors together (None: the
            default group if any).
        alone: Each process writes its own whole copy, no collective (the local tier).
        name_failures: Raise an ``OSError`` of the writes as the
            :class:`~resumekit.errors.StorageError` naming the step and the root
            (:func:`save_failure`; the durable root's saves). The local tier names its
            failures itself.
        plans: Where this writer remembers its save plans between saves of an
            unchanged layout (:class:`~resumekit.tensors.plans.SavePlans`: the local
            tier's site's, or the manager's for the channel); None: every save planned
            in full.
    """

    protocol: CommitProtocol
    rank: int
    tensor_format: tensors.TensorFormat
    group: dist.ProcessGroup | None = None
    alone: bool = False
    name_failures: bool = True
    plans: SavePlans | None = None


def write_step(job: SaveJob, target: StepTarget, *, retain: Callable[[], object],
               timing: SaveTiming | None = None,
               describe: Callable[[Manifest], Manifest] | None = None,
               active_tokens: set[str] | None = None) -> PendingCheckpoint:
    """Commit ``job`` under ``target``: the one commit sequence of every tier.

    1. ``begin`` (step check, staging area, writer record);
    2. the tensors and this rank's small files into staging, hashed on their way;
    3. ``publish`` the manifest (``describe``'d, then with the clock's measurements): its
       one gather carries each rank's files and its writes' outcome, so a failure on one
       rank is raised on all before anything is committed;
    4. on any error so far: abort (remove the staging area), the error raised;
    5. ``retain()``: the tier's retention, after the commit only;
    6. record the newest step (after retention: its stamp sees the deletions).

    Args:
        job: The captured save.
        target: Where and how it is written.
        retain: The tier's retention, called once the step is committed.
        timing: The save clock's record of this save (:meth:`CommitClock.writing`).
        describe: Adds what the caller records at publication to the manifest.
        active_tokens: The caller's saves in flight (their staging areas are never swept);
            this save's token is in it while it writes.

    Returns:
        The committed step.
    """
    protocol = target.protocol
    tokens = set() if active_tokens is None else active_tokens
    pending = protocol.begin(job.step, replace=job.replace, active_tokens=set(tokens))
    tokens.add(pending.token)
    try:
        # Each rank's writes' outcome travels with its files in publish's one gather: a
        # failure on any rank is raised on every rank there, before anything is committed.
        failure: Exception | None = None
        described: list[FileEntry] = []
        required: list[str] = []
        try:
            described, required = _write_files(pending, job, target)
        except Exception as error:  # noqa: BLE001 - raised on every rank by publish
            failure = error
        finally:
            if timing is not None:
                timing.files_written()
        manifest = job.manifest
        if failure is None:
            manifest = manifest if describe is None else describe(manifest)
            if timing is not None:
                manifest = timing.describe(manifest)
        protocol.publish(pending, manifest, described=described, required=required,
                         failure=failure)
    except BaseException as error:
        abort_after(protocol, pending, error)
        if target.name_failures and isinstance(error, OSError) and _unnamed(error):
            raise save_failure(job.step, protocol.storage, error) from error
        raise
    finally:
        tokens.discard(pending.token)
    if timing is not None:
        timing.committed()
    retain()
    protocol.record_newest(pending)
    return pending


def _unnamed(error: OSError) -> bool:
    """Whether a save's ``OSError`` is raised as :func:`save_failure` (not one of ours)."""
    return type(error) is StorageError or not isinstance(error, ResumekitError)


def _write_files(pending: PendingCheckpoint, job: SaveJob, target: StepTarget
                 ) -> tuple[list[FileEntry], list[str]]:
    """Write this rank's files; return them, hashed on the way, and what they reference.

    The second list (coordinating rank only) names the files the tensor metadata
    references, which the commit requires some rank to have reported. The coordinating
    rank writes the training state and the tensors' ``.metadata``.
    """
    storage, leader = target.protocol.storage, target.protocol.coordinator.rank == 0
    written: list[tensors.WrittenFile] = []
    if job.tensors:
        written = tensors.save(
            job.tensors, storage.url_of(f"{pending.staging}/{TENSORS_DIR}"),
            process_group=target.group, background=job.background,
            storage_options=storage.storage_options or None,
            tensor_format=target.tensor_format, remote=job.writer, alone=target.alone,
            plans=target.plans)
    small = [(rank_state_file(target.rank), job.ranks)]
    if leader:
        small.insert(0, (TRAIN_STATE_FILE, job.train))
    return tensors.step_files(storage, pending.staging, written, small,
                              coordinating=leader and bool(job.tensors))


def abort_after(protocol: CommitProtocol, pending: PendingCheckpoint,
                error: BaseException) -> None:
    """Remove a failed save's staging area; a failure here is secondary to ``error``.

    It is logged and attached to ``error`` as a note, so the error raised stays the one
    that made the save fail (a cleanup against an unreachable store fails too).
    """
    try:
        protocol.abort(pending)
    except Exception as cleanup:  # noqa: BLE001 - secondary to the save's own error
        note = (f"removing the staging area {protocol.storage.path(pending.staging)} "
                f"failed too: {type(cleanup).__name__}: {cleanup} (the sweep removes it "
                "later)")
        logger.warning("resumekit: save of step %d: %s", pending.step, note)
        error.add_note(note)


def save_failure(step: int, storage: Storage, error: OSError) -> StorageError:
    """The error of a failed save: names the step, the root and the file; errno kept."""
    fields = dict(getattr(error, "fields", {}))
    file = fields.get("file") or getattr(error, "filename", None)
    where = f" writing {file}" if file else ""
    root = storage.url_of()
    fields.update(step=step, root=root, operation=fields.get("operation", "save"))
    fields.setdefault("path", getattr(error, "filename", None) or root)
    fields["errno"] = error.errno
    failure = StorageError(
        f"save of step {step} to {root} failed{where}: {error}; nothing was committed",
        **fields)
    failure.strerror, failure.filename = error.strerror, error.filename
    for note in getattr(error, "__notes__", ()):
        failure.add_note(note)
    return failure


def apply_retention(step: int, storage: Storage, retention: RetentionPolicy, *,
                    name_format: NameFormat, protect: Collection[int],
                    active_tokens: set[str], rolling: RollingSweep,
                    coordinator: Coordinator) -> None:
    """Prune on rank 0 after ``step`` is committed; report problems on every rank.

    The save has succeeded by now: a retention failure (``EBUSY`` from NFS
    ``.nfsXXXX`` files, an entry another process removed) is a warning, the same on
    every rank (rank 0's outcome is broadcast), never an error.

    Args:
        step: The step just committed.
        storage: The root.
        retention: The policy.
        name_format: The root's step directory names.
        protect: Steps never deleted (the one the run resumed from).
        active_tokens: Staging areas of saves in flight (never swept).
        rolling: Where the sweep goes on into older step directories.
        coordinator: The channel the save committed on.
    """

    def run() -> list[str]:
        try:
            report = prune(storage, retention, name_format=name_format, protect=protect,
                           active_tokens=active_tokens, errors="report", scope="top",
                           rolling=rolling)
        except Exception as error:  # noqa: BLE001 - the commit stands; reported below
            return [f"{type(error).__name__}: {error}"]
        return report.problems

    problems: list[str] = run_on_leader(coordinator, run)
    for line in problems:
        warn(f"step {step} is committed, but retention under {storage.path()} did not "
             f"complete: {line}", ResumekitWarning, stacklevel=3)


def lineage(resumed_from: int | None, initialized_from: tuple[str, int] | None, *,
            tier: Literal["local", "replica", "durable"] | None = None,
            started_at: datetime | None = None) -> Lineage:
    """The lineage a save records: this process, and the run's resume or fine-tune source.

    Args:
        resumed_from: The step the run resumed from.
        initialized_from: ``(path, step)`` of the checkpoint ``load_weights`` read.
        tier: The tier the run's restore read (a run with a local tier).
        started_at: When the launch's manager was created (``Lineage.started_at``).
    """
    context = distributed.current_context()
    current = Lineage.current(resumed_from_step=resumed_from,
                              launcher=None if context is None else str(context.launcher))
    if started_at is not None:
        current = current.model_copy(update={"started_at": started_at})
    if tier is not None:
        current = current.model_copy(update={"restored_from_tier": tier})
    if initialized_from is None:
        return current
    path, step = initialized_from
    return current.model_copy(update={"initialized_from": {"path": path, "step": step}})
