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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Final

from resumekit.errors import ResumekitError
from resumekit.store.catalog import classify_step
from resumekit.store.generations import claims
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage

__all__ = [
    "INTERRUPTIONS_EVERY_PRIOR",
    "AutoInterval",
    "AutoSaveEvery",
    "auto_interval",
    "history_interruptions",
    "interruptions_every",
]

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

    Only interruptions that cost the work since the last interval save count: a crash,
    or a preemption that committed no step at its end. A preemption whose emergency save
    committed cost at most the step in progress, whatever the interval.

    Args:
        launch_seconds: Seconds each launch of the run trained (its lineage).
        interruptions: Launches that ended in such an interruption.

    Returns:
        Training seconds over interruptions; None when nothing was interrupted yet (the
        caller keeps the prior or the user's figure).
    """
    if interruptions <= 0:
        return None
    total = float(sum(max(0.0, seconds) for seconds in launch_seconds))
    return total / interruptions if total > 0 else None


class AutoSaveEvery:
    """The live state of ``save_every="auto"`` in one manager (the same on every rank).

    The manager calls :meth:`step_ended` at each ``step_end`` and :meth:`saved` after
    each interval save, with what that save cost; :meth:`due` says whether a step saves.
    Until a step was timed, no save is due; the first interval save comes at the first
    step whose predecessor was timed (it measures what a save costs); after each interval
    save the rule picks the next interval (:meth:`propose`), which the ranks agree on
    (the largest) before :meth:`adopt`.

    Args:
        interruptions_every_s: Mean seconds between interruptions that cost work (the
            user's override, the root's history, or the prior).
        source: Where that figure comes from, in words.
        clock: The monotonic clock (``time.monotonic``; a test's fake).
    """

    def __init__(self, interruptions_every_s: float, source: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interruptions_every_s = interruptions_every_s
        self.source = source
        self.clock = clock
        self.steps: int | None = None
        """The interval in force (None before the first interval save)."""
        self.chosen: AutoInterval | None = None
        self._next_due: int | None = None
        self._last_end: tuple[int, float] | None = None
        self._step_s: float | None = None

    @property
    def step_seconds(self) -> float | None:
        """The measured seconds of a step (smoothed), or None before one was timed."""
        return self._step_s

    def step_ended(self, step: int) -> None:
        """``step_end(step)`` was entered: time the step since the previous one."""
        now = self.clock()
        last = self._last_end
        if last is not None and step == last[0] + 1:
            sample = now - last[1]
            self._step_s = sample if self._step_s is None else (
                self._step_s + 0.2 * (sample - self._step_s))
        self._last_end = (step, now)

    def step_returned(self, step: int) -> None:
        """``step_end(step)`` returns (a save inside it is not a step's time)."""
        self._last_end = (step, self.clock())

    def due(self, step: int) -> bool:
        """Whether ``step`` is an interval save."""
        if self._next_due is None:
            return self._step_s is not None
        return step >= self._next_due

    def restart(self) -> None:
        """A restore: the interval in force stays; the next save is due as it was."""
        self._last_end = None

    def propose(self, *, blocking_s: float, write_s: float, overlapped: bool) -> AutoInterval:
        """This rank's interval after a save that held training ``blocking_s``."""
        assert self._step_s is not None
        return auto_interval(step_s=self._step_s, blocking_s=blocking_s, write_s=write_s,
                             interruptions_every_s=self.interruptions_every_s,
                             overlapped=overlapped)

    def adopt(self, step: int, steps: int, proposal: AutoInterval) -> bool:
        """Take the agreed interval after the save of ``step``; whether it changed."""
        changed = steps != self.steps
        self.steps, self.chosen = steps, proposal
        self._next_due = step + steps
        return changed


def history_interruptions(storage: Storage, name_format: NameFormat, *,
                          now: datetime | None = None) -> tuple[float | None, str]:
    """The MTBI of lost work from the root's own generation records, and in words.

    Each claim after the first is a relaunch; it followed an interruption that cost work
    unless the step it found newest was committed by a ``preemption`` or ``final`` save
    (read from that step's manifest; a step no longer in the root counts as lost). The
    run's span is from the oldest kept claim to ``now``.

    Returns:
        ``(seconds, said)``; seconds is None when the root has no relaunch yet. With
        relaunches that all lost nothing, the span itself (one interruption at most).
    """
    records = claims(storage)
    if len(records) < 2:
        return None, "no relaunch in the root's history"
    now = now or datetime.now(timezone.utc)
    span = max(0.0, (now - records[0].claimed_at).total_seconds())
    lost = 0
    for record in records[1:]:
        step = record.newest_step
        reason = None
        if step is not None:
            try:
                manifest = classify_step(storage, step, name_format).manifest
            except ResumekitError:  # an unreadable step counts as a lost one here
                manifest = None
            reason = None if manifest is None else str(manifest.reason.value)
        if reason not in ("preemption", "final"):
            lost += 1
    seconds = interruptions_every([span], max(1, lost))
    relaunches = len(records) - 1
    return seconds, (f"{lost} of {relaunches} relaunches in {span:.0f} s lost the work "
                     "since an interval save (the root's generation records)")
