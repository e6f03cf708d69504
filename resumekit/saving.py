"""A captured save (``SaveJob``), and what a failed one raises and leaves behind.

The manager captures a save on the calling thread into a :class:`SaveJob` and writes it
there or on the background thread (:mod:`resumekit.background`). When writing fails,
:func:`abort_after` removes the staging area and :func:`save_failure` turns an ``OSError``
into the :class:`~resumekit.errors.StorageError` that names the step, the root and the
file. Imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from resumekit.errors import StorageError
from resumekit.store.commit import CommitProtocol, PendingCheckpoint
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage

__all__ = ["SaveJob", "abort_after", "save_failure"]

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
