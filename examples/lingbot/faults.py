"""Test-only fault injection for the trainer, switched on by environment variables only.

``LINGBOT_TEST_SLOW_READS="host2=15"`` (comma-separated ``HOST=SECONDS`` pairs): on a host
whose name (``socket.gethostname()``) is listed, the first storage read of the process
(``resumekit.store.storage.Storage.open`` in a read mode, outside a save's staging dir: the
start of a restore) is delayed by
that many seconds. It plays a NAS that is slow for one host's ranks: the load skew of the
incident, across hosts. The multi-node drill (``tests/multinode``) sets it beyond the
training timeout to prove the checkpoint group's meeting absorbs it.

Nothing happens when the variable is unset; the trainer calls :func:`install` once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["SLOW_READS_VARIABLE", "install", "read_delay"]

SLOW_READS_VARIABLE = "LINGBOT_TEST_SLOW_READS"

logger = logging.getLogger("lingbot.faults")


def read_delay(spec: str, host: str) -> float:
    """Seconds of delay ``spec`` (``"host2=15,host3=4"``) gives ``host``; 0.0 if none.

    Raises:
        ValueError: ``spec`` is not ``HOST=SECONDS`` pairs (the message quotes it).
    """
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, seconds = item.partition("=")
        if not sep:
            raise ValueError(f"{SLOW_READS_VARIABLE}={spec!r}: {item!r} is not HOST=SECONDS")
        if name.strip() == host:
            return float(seconds)
    return 0.0


def install() -> float:
    """Apply the faults the environment asks for on this host; return the read delay."""
    spec = os.environ.get(SLOW_READS_VARIABLE)
    if not spec:
        return 0.0
    host = socket.gethostname()
    delay = read_delay(spec, host)
    if delay <= 0:
        return 0.0
    from resumekit.store.storage import Storage  # noqa: PLC0415 - only when the fault is on

    original = Storage.open
    pending = [delay]

    @contextlib.contextmanager
    def slow_open(self: Storage, relative: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        # Reads of a save in progress (its staging dir, ".tmp-") are not slowed: the
        # fault plays a slow restore.
        if "r" in mode and pending and ".tmp-" not in relative:
            seconds = pending.pop()
            logger.warning("%s: delaying the first storage read on %s (%s) by %.1f s",
                           SLOW_READS_VARIABLE, host, relative, seconds)
            time.sleep(seconds)
            logger.warning("%s: read of %s on %s resumes after %.1f s", SLOW_READS_VARIABLE,
                           relative, host, seconds)
        with original(self, relative, mode) as handle:
            yield handle

    patched: Any = slow_open
    Storage.open = patched  # type: ignore[method-assign]
    return delay
