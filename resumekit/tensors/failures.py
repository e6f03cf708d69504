"""DCP's failures of a save or load, told as resumekit's errors (what broke, where, whose)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch.distributed.checkpoint.api import CheckpointException

from resumekit.errors import (
    CheckpointLoadError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ResumekitError,
    StorageError,
    UnreadableFormatError,
)
from resumekit.store.retry import is_transient

__all__ = ["first_cause", "from_failures", "incompatible", "load_error"]

_MAX_LISTED = 10


class _RemembersMetadataError(Protocol):
    metadata_error: ResumekitError | None


def incompatible(where: str, differences: Sequence[str]) -> IncompatibleCheckpointError:
    """An error naming the first differences between a state and a checkpoint."""
    shown = "; ".join(differences[:_MAX_LISTED])
    more = len(differences) - _MAX_LISTED
    suffix = f"; and {more} more" if more > 0 else ""
    if any(difference.split(":")[-1].strip().endswith(".initial_lr")
           for difference in differences):
        suffix += (" (a learning-rate scheduler writes initial_lr into the optimizer's "
                   "groups when it is built: build it, and pass it as scheduler=, on the "
                   "side that lacks it, before restore())")
    return IncompatibleCheckpointError(
        f"{where} does not fit the state being restored "
        f"({len(differences)} differences, nothing loaded): {shown}{suffix}",
        path=where,
        differences=list(differences),
    )


def load_error(
    error: BaseException, target: str, reader: _RemembersMetadataError | None, rank: int | None,
    *, verified: bool = False,
) -> ResumekitError:
    """``error`` of a load (on ``rank``), told as the resumekit error it means.

    Args:
        error: What the load raised.
        target: The checkpoint's tensors directory.
        reader: The load's reader (a failure to read ``.metadata`` it remembers wins).
        rank: The rank whose load raised it, when known.
        verified: Every byte of ``target`` was checked against the checksums recorded
            when it was written: an exception of DCP's, torch's or resumekit's code while
            interpreting them is then no damage but a
            :class:`~resumekit.errors.CheckpointLoadError` (never set aside, never fallen
            back past); without it, an :class:`~resumekit.errors.UnreadableFormatError`
            (a damaged pickle raises ``AttributeError`` or ``ModuleNotFoundError`` too).
    """
    if isinstance(error, ResumekitError):
        return error
    if reader is not None and reader.metadata_error is not None:
        return reader.metadata_error
    where = "" if rank is None else f" on rank {rank}"
    if isinstance(error, FileNotFoundError):
        missing = error.filename or str(error)
        return IncompleteCheckpointError(
            f"checkpoint {target} is missing file {missing}{where}",
            path=target,
            file=missing,
        )
    if isinstance(error, OSError) or is_transient(error):
        # the storage failed (an I/O error, a dropped connection), not the bytes: never
        # corruption, never a reason to set the checkpoint aside
        return StorageError(
            f"reading checkpoint {target} failed{where}: {type(error).__name__}: {error} "
            "(a storage error, not corruption: nothing was set aside)",
            path=target,
            operation="load",
        )
    cause = f"{type(error).__name__}: {error}"
    if verified:
        # The bytes are those written (each was checked against its checksum): what
        # failed is the code that interprets them, which damage cannot be.
        return CheckpointLoadError(
            f"loading checkpoint {target} failed{where}: {cause}. Its files match the "
            "checksums recorded when it was written, so this is not damage but a failure "
            "to interpret them (in resumekit, torch, or code of this run the load calls, "
            "such as a state-dict hook); nothing was set aside",
            path=target,
            step=None,
            rank=rank,
            cause=cause,
            file=None,
        )
    # Not a checksum (those raise our own errors): DCP's reading failed on what it was
    # given, which is damage or what another torch version wrote.
    return UnreadableFormatError(
        f"reading checkpoint {target} failed{where}: {cause}",
        path=target,
        file=None,
    )


def from_failures(
    error: CheckpointException, operation: str, target: str, reader: _RemembersMetadataError | None,
    *, verified: bool = False, rank: int | None = None,
) -> ResumekitError:
    """DCP's ``CheckpointException`` of a save or load, told as one resumekit error.

    ``verified`` as for :func:`load_error`. ``rank``: this process's rank, when DCP ran
    without collectives (its failures then all name rank 0).
    """
    failures = sorted(error.failures.items())
    for _rank, (cause, _trace) in failures:
        if isinstance(cause, ResumekitError):
            return cause
    if reader is not None and reader.metadata_error is not None:
        return reader.metadata_error
    first, (cause, _trace) = failures[0]
    if operation == "load":
        return load_error(cause, target, None, first if rank is None else rank,
                          verified=verified)
    ranks = ", ".join(str(r) for r, _ in failures)
    return StorageError(
        f"writing checkpoint {target} failed on rank(s) {ranks}: "
        f"{type(cause).__name__}: {cause}",
        path=target,
        operation=operation,
    )




def first_cause(error: CheckpointException) -> BaseException | None:
    """The exception of the lowest failing rank of ``error`` (what :func:`from_failures` tells)."""
    failures = sorted(error.failures.items())
    return failures[0][1][0] if failures else None
