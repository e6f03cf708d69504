"""Warnings resumekit emits when a resume works but is not an exact replay.

A warning (not an error) is used where training can correctly go on but the resumed run
will not be bit-identical to an uninterrupted one: random streams derived for a rank the
checkpoint did not have, CUDA generator states for a different number of devices.
Filter them as a group with ``warnings.simplefilter("error", ResumekitWarning)``.

Every warning resumekit gives goes through :func:`warn`: it is a Python warning, printed
once per process (rank), not a warning plus a log line with the same text. Route them into
your logging with ``logging.captureWarnings(True)``.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["DirectIoRefusedWarning", "LocalTierMissWarning", "MovedNameWarning",
           "ResumekitWarning", "UnsupportedTorchWarning", "warn"]

logger = logging.getLogger("resumekit")


class ResumekitWarning(UserWarning):
    """A resume that goes on, but differs from an uninterrupted run in the way it names."""


class UnsupportedTorchWarning(ResumekitWarning):
    """``import resumekit`` found a torch outside the releases it supports (and goes on)."""


class MovedNameWarning(ResumekitWarning, FutureWarning):
    """A name read as ``resumekit.<name>`` that now lives only in its own module.

    ``resumekit`` exports what a trainer calls; the names it exported up to 0.3.0 besides
    those still resolve there, each with this warning naming the module to import it from
    (``from resumekit.store.catalog import list_checkpoints``). A ``FutureWarning`` as well,
    so Python shows it by default, as it would not a ``DeprecationWarning`` raised in a
    library's code; filter it with the other warnings as a ``ResumekitWarning``.
    """


class DirectIoRefusedWarning(ResumekitWarning):
    """The filesystem refused direct I/O (``O_DIRECT``): a save's files go through the page cache.

    Given once per directory and save by the raw tensor format's writer, naming the
    directory, the file and the error (``EINVAL``: tmpfs before Linux 6.6, some FUSE and
    network filesystems, refused when the file is opened or at its first write). The
    bytes, offsets and checksums are the same; the writes cost a kernel copy and leave
    dirty pages for writeback while training runs. Filter it to accept the page cache.
    """


class LocalTierMissWarning(ResumekitWarning):
    """An in-job restart found no usable node-local copy: it read the durable root instead.

    Given on every rank by a restore with a local tier when torchrun has restarted the
    worker group (``TORCHELASTIC_RESTART_COUNT`` above 0 on any node) and no step of the
    local tier restored; the message says why and which step the durable root gave.
    Escalate it with ``warnings.simplefilter("error", LocalTierMissWarning)`` to stop a
    job whose in-job restarts keep missing their local copies.
    """


def warn(message: str, category: type[Warning] = ResumekitWarning, *,
         stacklevel: int = 1) -> None:
    """Give ``message`` as one warning of ``category`` (and a DEBUG record, for traces).

    Args:
        message: What happened, naming the directory, file or step and the reason.
        category: :class:`ResumekitWarning` or a subclass.
        stacklevel: As for :func:`warnings.warn`, counted from the caller of this function.
    """
    logger.debug("resumekit: %s", message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
