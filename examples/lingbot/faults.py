"""Test-only fault injection for the trainer, switched on by environment variables only.

``LINGBOT_TEST_SLOW_READS="host2=15"`` (comma-separated ``HOST=SECONDS`` pairs): on a host
whose name (``socket.gethostname()``) is listed, the first storage read of the process
(``resumekit.store.storage.Storage.open`` in a read mode, outside a save's staging dir: the
start of a restore) is delayed by
that many seconds. It plays a NAS that is slow for one host's ranks: the load skew of the
incident, across hosts. The multi-node drill (``tests/multinode``) sets it beyond the
training timeout to prove the checkpoint group's meeting absorbs it.

``LINGBOT_TEST_HOLD_FOR_SIGNAL_AFTER_STEP=N``: once step ``N`` is logged, every rank waits
until its own preemption handler has received a signal (the drill sends its SIGTERM once it
reads step ``N`` in the metrics), so the signal lands between steps ``N`` and ``N + 1`` and
the step the ranks agree on does not depend on how fast the machine trains. A rank that
gets no signal within :data:`HOLD_TIMEOUT_S` fails with an error saying so.

Nothing happens when the variables are unset; the trainer calls :func:`install` once and
:func:`hold_for_signal` after each logged step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["HOLD_FOR_SIGNAL_VARIABLE", "HOLD_TIMEOUT_S", "SLOW_READS_VARIABLE",
           "hold_for_signal", "install", "read_delay"]

SLOW_READS_VARIABLE = "LINGBOT_TEST_SLOW_READS"
HOLD_FOR_SIGNAL_VARIABLE = "LINGBOT_TEST_HOLD_FOR_SIGNAL_AFTER_STEP"
#: How long a held rank waits for the signal before it gives up (a drill that never sent it).
HOLD_TIMEOUT_S = 600.0
#: How often a held rank looks at its handler's flag.
HOLD_POLL_S = 0.01

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


def hold_for_signal(step: int, received: Callable[[], bool]) -> None:
    """After step ``step``: wait until ``received()`` if the hold variable names this step.

    Args:
        step: The step just logged.
        received: Whether this rank's preemption handler has recorded a signal.

    Raises:
        RuntimeError: No signal within :data:`HOLD_TIMEOUT_S` (the message names the step).
    """
    spec = os.environ.get(HOLD_FOR_SIGNAL_VARIABLE)
    if not spec or int(spec) != step or received():
        return
    logger.warning("%s=%s: holding after step %d until this rank's preemption handler "
                   "receives the signal", HOLD_FOR_SIGNAL_VARIABLE, spec, step)
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not received():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{HOLD_FOR_SIGNAL_VARIABLE}={spec}: no preemption signal "
                               f"reached this rank within {HOLD_TIMEOUT_S:.0f} s of step "
                               f"{step}")
        time.sleep(HOLD_POLL_S)
    logger.warning("%s=%s: signal received after step %d, training goes on",
                   HOLD_FOR_SIGNAL_VARIABLE, spec, step)
