"""``save_every="auto"``: the save interval by the Young/Daly rule, from measured costs.

A save costs training its blocking time (the seconds ``save()`` held the loop: the whole
write for a blocking save, the staging copy for an asynchronous one). An interruption that
no emergency save covers (a crash, a preemption whose window is too short) costs the work
since the newest commit: on average half an interval. The sum of the two per unit of time,
``blocking / interval + interval / (2 * MTBI)``, is smallest at

    interval = sqrt(2 * blocking * MTBI)        (Young 1974; Daly 2006)

where MTBI is the mean time between interruptions. :func:`auto_interval` applies it in
whole steps, never shorter than the write allows: an asynchronous save due while the
previous one still writes would wait for it, so the interval holds at least the write's
seconds. The manager feeds it what :class:`~resumekit.runtime.save_clock.CommitClock`
measures and the MTBI from the root's own lineage (:func:`interruptions_every`), or
:data:`INTERRUPTIONS_EVERY_PRIOR` before there is any history, or the user's
``interruptions_every=``. ``benchmarks.goodput_model`` uses the same function for
"resumekit's defaults".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["INTERRUPTIONS_EVERY_PRIOR", "AutoInterval", "auto_interval",
           "interruptions_every"]

INTERRUPTIONS_EVERY_PRIOR: Final = 4 * 3600.0
"""Seconds between interruptions assumed before a root has any history: 4 hours.

The incident's week (docs/performance.md, Goodput) had 4 interruptions in 12.5 hours of
jobs (3 preemptions, 1 crash): one every ~3.1 hours; a preemptible queue is rarely much
calmer. The rule's interval grows with the square root of it, so a prior off by 2x moves
the interval by 1.4x. ``interruptions_every=`` overrides it; a root's lineage replaces it."""


@dataclass(frozen=True)
class AutoInterval:
    """An interval chosen by :func:`auto_interval`, and why.

    Attributes:
        steps: Save every this many steps.
        young_daly_s: The rule's interval in seconds, before rounding to steps.
        floor_steps: The fewest steps the write allows (1 for a blocking save).
        inputs: The inputs in words (for the log line and ``resumekit inspect``).
    """

    steps: int
    young_daly_s: float
    floor_steps: int
    inputs: str


def auto_interval(*, step_s: float, blocking_s: float, write_s: float,
                  interruptions_every_s: float, overlapped: bool) -> AutoInterval:
    """The Young/Daly save interval in steps.

    Args:
        step_s: Seconds of one training step (measured).
        blocking_s: Seconds one save holds training (measured: the whole save when
            blocking; the staging copy, plus any slowdown it causes, when asynchronous).
        write_s: Seconds a save's write takes (measured).
        interruptions_every_s: Mean seconds between interruptions (the root's history,
            the prior, or the user's ``interruptions_every``).
        overlapped: Whether saves write in the background (the interval then holds at
            least ``write_s``, or the next save would wait for this one).

    Returns:
        The interval (at least one step).

    Raises:
        ValueError: A step time or interruption interval that is not positive, or a
            negative cost.
    """
    if not step_s > 0 or not interruptions_every_s > 0:
        raise ValueError(f"step_s={step_s!r} and interruptions_every_s="
                         f"{interruptions_every_s!r} must be positive")
    if not blocking_s >= 0 or not write_s >= 0:
        raise ValueError(f"blocking_s={blocking_s!r} and write_s={write_s!r} must be >= 0")
    rule = math.sqrt(2.0 * blocking_s * interruptions_every_s)
    floor = max(1, math.ceil(write_s / step_s - 1e-9)) if overlapped else 1
    steps = max(floor, round(rule / step_s))
    inputs = (f"step {step_s:.2f} s, a save blocks {blocking_s:.2f} s and writes "
              f"{write_s:.2f} s, an interruption every {interruptions_every_s:.0f} s: "
              f"sqrt(2 x {blocking_s:.2f} x {interruptions_every_s:.0f}) = {rule:.0f} s")
    if floor > 1:
        inputs += f", at least {floor} steps (the write)"
    return AutoInterval(steps=steps, young_daly_s=rule, floor_steps=floor, inputs=inputs)


def interruptions_every(launch_seconds: Sequence[float], interruptions: int) -> float | None:
    """Mean seconds between interruptions from a run's history, or None without one.

    Args:
        launch_seconds: Seconds each launch of the run trained (its lineage).
        interruptions: Launches that ended in an interruption (a preemption or a crash).

    Returns:
        Training seconds over interruptions; None when nothing was interrupted yet (the
        caller keeps the prior or the user's figure).
    """
    if interruptions <= 0:
        return None
    total = float(sum(max(0.0, seconds) for seconds in launch_seconds))
    return total / interruptions if total > 0 else None
