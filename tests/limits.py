"""How long a test may wait before it calls a wait hung: a hang detector, never a timing.

Every wait of the suites is on an event - a process exiting, a line or a file appearing, a
collective completing. The limit on such a wait only turns a hang into a failure instead
of a stuck run; it must sit far above anything load can cause (``make test`` at a load
of 8 and more on two cores made a 120 s ``pytest --collect-only`` fail). Tests whose
subject *is* a timeout (a peer that stops answering, a hanging ``scontrol``) keep their
own short limits: there the timeout firing is the expected outcome, not a deadline for
the machine.
"""

from __future__ import annotations

from typing import Final

HANG_S: Final = 3600.0
"""Seconds a subprocess, a launch or a collective may take before the test calls it hung."""

COLLECTIVE_HANG_S: Final = 900.0
"""The process-group timeout of ``run_ranks`` (a collective no rank is late to by more).

Lower than :data:`HANG_S`: a rank that fails skips the harness's last barrier, and its
peer's barrier then waits until this timeout at worst."""

TEST_HANG_S: Final = 7200
"""Seconds one test may take (pytest-timeout) before it is called hung."""
