"""A captured save (``SaveJob``), what it records, and what follows its commit or failure.

The manager captures a save on the calling thread into a :class:`SaveJob` (its manifest
records the run's :func:`lineage`) and writes it there or on the background thread
(:mod:`resumekit.background`; its tensor bytes, with ``async_writer="process"``, in the
writer process). Once it is committed, :func:`apply_retention` prunes; when
writing fails, :func:`abort_after` removes the staging area and :func:`save_failure` turns
an ``OSError`` into the :class:`~resumekit.errors.StorageError` that names the step, the
root and the file.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from resumekit.errors import StorageError
from resumekit.runtime import distributed
from resumekit.store.commit import CommitProtocol, PendingCheckpoint
from resumekit.store.coordination import Coordinator, run_on_leader
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Lineage, Manifest
from resumekit.store.retention import RetentionPolicy, RollingSweep, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

if TYPE_CHECKING:
    from datetime import datetime

    from resumekit.tensors.remote import RemoteWrites

__all__ = ["SaveJob", "abort_after", "apply_retention", "lineage", "save_failure"]

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
