"""How long an emergency save would take: the state's size and this root's write rate.

:class:`CommitClock` keeps what the emergency-save decision needs - the training time since
the newest capture, the time blocking saves took, the write throughput measured on every
committed save (seeded after a requeue from the restored checkpoint's manifest) and the
save still in flight - and builds the :class:`SaveEstimate` that
:meth:`~resumekit.runtime.preemption.PreemptionHandler.should_skip_emergency_save` weighs
against the grace period left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from resumekit.store.manifest import Manifest, SaveStalls, SaveThroughput

__all__ = ["CommitClock", "SaveEstimate", "SaveTiming", "smoothed", "state_bytes"]

_SMOOTHING = 0.2  # weight of the newest sample in a running time


def smoothed(previous: float | None, sample: float) -> float:
    """A running time: the previous value moved ``_SMOOTHING`` of the way to ``sample``."""
    return sample if previous is None else previous + _SMOOTHING * (sample - previous)


def _amount(nbytes: float) -> str:
    """Bytes in decimal units (as storage vendors count), for messages."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"

@dataclass(frozen=True)
class SaveEstimate:
    """What an emergency save would write, and how fast this root writes.

    :class:`CommitClock` builds it (:meth:`CommitClock.estimate`) from the state's size
    and the write throughput it measured; it is the ``estimate`` input of
    :meth:`PreemptionHandler.should_skip_emergency_save`.

    Attributes:
        bytes: Bytes the save would write: the tensor state's size (all ranks together,
            each tensor once, at its global size).
        bytes_per_second: The root's measured write throughput, or None before any save
            was measured (in this process or, after a restore, in the manifest).
        measured_from: Where the rate comes from, for messages (e.g. ``"the blocking save
            of step 40"``).
        in_flight_step: The step of an asynchronous save still writing, or None.
        in_flight_seconds: Seconds that save still needs at the measured rate (0 when it
            should be done by now; None when the rate is unknown).
    """

    bytes: int
    bytes_per_second: float | None
    measured_from: str = "not measured"
    in_flight_step: int | None = None
    in_flight_seconds: float | None = None

    @property
    def seconds(self) -> float | None:
        """Seconds the save's writes take at the measured rate, or None if it is unknown."""
        if not self.bytes_per_second:
            return None
        return self.bytes / self.bytes_per_second

    def describe(self) -> str:
        """The numbers in words: bytes, rate, expected seconds (and the save in flight)."""
        seconds = self.seconds
        if seconds is None or self.bytes_per_second is None:
            said = f"{_amount(self.bytes)} at an unmeasured rate"
        else:
            said = (f"{_amount(self.bytes)} at the measured "
                    f"{_amount(self.bytes_per_second)}/s ({self.measured_from}) "
                    f"= {seconds:.2f} s")
        if self.in_flight_step is not None:
            more = ("an unknown time" if self.in_flight_seconds is None
                    else f"about {self.in_flight_seconds:.1f} s")
            said += f", after the in-flight save of step {self.in_flight_step} ({more} more)"
        return said


class SaveTiming:
    """One save's writes on the clock: what :meth:`CommitClock.writing` yields.

    The commit sequence (:func:`resumekit.save_job.write_step`) calls it at its phases:
    :meth:`files_written` when every rank's files are written (the write phase ends),
    :meth:`describe` on the manifest it publishes, :meth:`committed` once published.

    Args:
        clock: The clock it reports to.
        step: The step saved.
        nbytes: Bytes of tensor state it writes.
        blocking: Whether training waits for it (the throughput's kind).
        held_from: For a save training waits for, when its call began
            (``Manifest.save_stalls`` counts it up to the publication); else None.
        captured: When the save's capture began (``last_save_seconds`` counts from it).

    Building it starts the clock's record of a save in flight (:meth:`CommitClock.write_started`).
    """

    def __init__(self, clock: CommitClock, step: int, nbytes: int, *, blocking: bool,
                 held_from: float | None, captured: float) -> None:
        self._clock, self.step, self.nbytes = clock, step, nbytes
        self._blocking, self._held_from, self._captured = blocking, held_from, captured
        self.started = clock.write_started(step, nbytes)
        self.seconds: float | None = None
        """Seconds of the write phase, once :meth:`files_written` was called."""

    def files_written(self) -> None:
        """The writes ended (written, or failed): the save is no longer in flight."""
        self._clock.write_ended(self.step)
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started

    def describe(self, manifest: Manifest) -> Manifest:
        """``manifest`` with what the clock measured: the stalls and the write throughput."""
        manifest = manifest.model_copy(update={
            "save_stalls": self._clock.stalls(self._held_from)})
        seconds = self.seconds
        if self.nbytes > 0 and seconds is not None and seconds > 0:
            manifest = manifest.model_copy(update={"save_throughput": SaveThroughput(
                bytes=self.nbytes, seconds=seconds, blocking=self._blocking)})
        return manifest

    def committed(self) -> None:
        """The save is published: record its throughput and its duration."""
        if self.seconds is not None:
            self._clock.wrote(self.step, self.nbytes, self.seconds, blocking=self._blocking)
        self._clock.last_save_seconds = time.monotonic() - self._captured


class CommitClock:
    """The inputs of the emergency-save decision, measured by a checkpoint manager.

    :meth:`PreemptionHandler.should_skip_emergency_save` needs the training time since
    the newest commit's state was captured, how long a save takes, and whether a save is
    still writing. The manager tells this clock when each step ends, each save's writes
    start and end, and each save returns or commits; everything is on this process's
    monotonic clock, never a wall-clock difference (a checkpoint written on a host whose
    clock runs ahead would look like it came from the future).

    How long a save takes is measured as the root's **write throughput**: the bytes of
    tensor state a save wrote over the seconds of its write phase, from every committed
    save, kept per kind - the newest blocking save's and the newest background save's. An
    emergency save is blocking (training has stopped), so it is estimated at the blocking
    rate; a background save's rate, measured while training competed for the CPU and the
    store, is a lower bound, used only until a blocking save was measured (and said so in
    the estimate's words). A save still in flight is estimated at the background rate. A
    fresh process (a requeued job) has saved nothing yet: :meth:`seed_throughput` takes
    the record of the checkpoint it restored (``Manifest.save_throughput``, which says
    its kind; after a preemption that is the emergency save's blocking rate).
    """

    def __init__(self) -> None:
        # (newest step committed by this process, when training after its capture began)
        self._committed_capture: tuple[int, float] | None = None
        # The last step_end: (step, when it returned).
        self._step_clock: tuple[int, float] | None = None
        self._step_seconds: float | None = None  # smoothed duration of one step
        self._blocking_save_seconds: float | None = None  # the last blocking save
        # The newest write rate per kind (True: blocking): (bytes, seconds, where measured).
        self._throughput: dict[bool, tuple[int, float, str]] = {}
        # A save whose writes are under way: (step, bytes, when they started).
        self._writing: tuple[int, int, float] | None = None
        self.last_save_seconds = 0.0
        """Duration of the last save that committed (any kind), in seconds."""
        self.started_at = datetime.now(timezone.utc)
        """When the manager that owns the clock was created: its launch (``Lineage.started_at``)."""
        self.held_seconds = 0.0
        """Seconds this manager's saves held training so far (``Manifest.save_stalls``)."""
        self.saves_held = 0
        """How many saves :attr:`held_seconds` counts."""

    def held(self, seconds: float) -> None:
        """A save held training ``seconds`` (from its call until training could go on)."""
        if math.isfinite(seconds):
            self.held_seconds += max(0.0, seconds)
            self.saves_held += 1

    def stalls(self, held_from: float | None) -> SaveStalls:
        """What this manager's saves held training, for the manifest published now.

        Args:
            held_from: For a blocking save, when its call began (``time.monotonic()``):
                it is counted up to now, since :meth:`held` hears of it only when it
                returns. None for a save that holds nothing now (asynchronous: counted
                at its staging; an emergency save overlaps the step in progress).
        """
        seconds, saves = self.held_seconds, self.saves_held
        if held_from is not None:
            seconds, saves = seconds + max(0.0, time.monotonic() - held_from), saves + 1
        return SaveStalls(seconds=seconds, saves=saves)

    def step_started(self, step: int) -> None:
        """Call on entering ``step_end(step)``: times the step that just ended.

        Only a step right after the previous ``step_end`` counts (one step of training,
        no save inside).
        """
        clock = self._step_clock
        if clock is not None and step == clock[0] + 1:
            self._step_seconds = smoothed(self._step_seconds, time.monotonic() - clock[1])

    def step_returned(self, step: int) -> None:
        """Call when ``step_end(step)`` returns (training resumes now)."""
        self._step_clock = (step, time.monotonic())

    def captured(self, step: int, training_resumed: float) -> None:
        """Step ``step`` committed; training after its capture resumed at ``training_resumed``.

        For an asynchronous save that is right after staging, not when the background
        commit finished.
        """
        self._committed_capture = (step, training_resumed)

    def blocking_save_took(self, seconds: float, *, held_since: float | None = None) -> None:
        """A blocking save (capture to commit) took ``seconds``.

        Args:
            seconds: Its duration.
            held_since: When its call began (``time.monotonic()``): training was held
                from then to now (:meth:`held`).
        """
        self._blocking_save_seconds = seconds
        if held_since is not None:
            self.held(time.monotonic() - held_since)

    def resumes(self, held_since: float) -> float:
        """Training resumes now after a save that held it since ``held_since``; return now."""
        now = time.monotonic()
        self.held(now - held_since)
        return now

    def hold(self, save: Callable[[], None]) -> None:
        """Run ``save`` (one that training waits for); count its time as held."""
        began = time.monotonic()
        try:
            save()
        finally:
            self.held(time.monotonic() - began)

    @contextmanager
    def writing(self, step: int, nbytes: int, *, blocking: bool, held_from: float | None,
                captured: float) -> Iterator[SaveTiming]:
        """The clock around one save's commit sequence; its writes are in flight inside.

        Until the sequence calls :meth:`SaveTiming.files_written` (or the block ends,
        however it ends), :meth:`estimate` counts the save as in flight.

        Args:
            step: The step saved.
            nbytes: Bytes of tensor state it writes.
            blocking: Whether training waits for it.
            held_from: For a save training waits for, when its call began; else None.
            captured: When its capture began (``time.monotonic()``).
        """
        timing = SaveTiming(self, step, nbytes, blocking=blocking, held_from=held_from,
                            captured=captured)
        try:
            yield timing
        finally:
            self.write_ended(step)

    def write_started(self, step: int, nbytes: int) -> float:
        """The writes of the save of ``step`` (``nbytes`` of tensor state) start now.

        Until :meth:`write_ended`, :meth:`estimate` counts it as a save in flight.

        Returns:
            The start time (``time.monotonic()``).
        """
        started = time.monotonic()
        self._writing = (step, nbytes, started)
        return started

    def write_ended(self, step: int) -> None:
        """The writes of the save of ``step`` ended (written, or failed)."""
        writing = self._writing
        if writing is not None and writing[0] == step:
            self._writing = None

    def wrote(self, step: int, nbytes: int, seconds: float, *, blocking: bool) -> None:
        """The save of ``step`` wrote ``nbytes`` of tensor state in ``seconds``.

        Records the root's newest write throughput of that kind; a save of no bytes, or
        one timed at zero seconds (or at no finite rate), measures nothing and is ignored.
        """
        if not _measures(nbytes, seconds):
            return
        kind = "blocking" if blocking else "background"
        self._throughput[blocking] = (nbytes, seconds, f"the {kind} save of step {step}")

    def seed_throughput(self, step: int, nbytes: int, seconds: float, *,
                        blocking: bool = True) -> None:
        """Take the write throughput the checkpoint of ``step`` recorded, until a save here.

        Called at restore with ``Manifest.save_throughput`` of the restored checkpoint: a
        requeued process knows its root's rate before it saved anything. A save this
        process makes replaces it.

        Args:
            step: The restored checkpoint's step.
            nbytes: The bytes its save wrote.
            seconds: The seconds of its write phase.
            blocking: Whether that save was blocking (``SaveThroughput.blocking``).
        """
        if not _measures(nbytes, seconds):
            return
        kind = "blocking" if blocking else "background"
        self._throughput[blocking] = (
            nbytes, seconds,
            f"the {kind} save of step {step}, recorded before this restart")

    def _rate(self, *, blocking: bool) -> tuple[float, str] | None:
        """The rate for a save of that kind: its own kind's, else the other kind's."""
        record = self._throughput.get(blocking) or self._throughput.get(not blocking)
        if record is None:
            return None
        nbytes, seconds, source = record
        if blocking and blocking not in self._throughput:
            source += (", which overlapped training: a lower bound for a blocking save's "
                       "rate")
        return nbytes / seconds, source

    def write_seconds(self, nbytes: int, *, blocking: bool) -> float | None:
        """Seconds a write of ``nbytes`` of that kind takes at the measured rate, or None."""
        rate = self._rate(blocking=blocking)
        return None if rate is None else nbytes / rate[0]

    @property
    def bytes_per_second(self) -> float | None:
        """The root's write throughput for a blocking save, or None before any measurement.

        The newest blocking save's rate; before one was measured, the newest background
        save's (a lower bound).
        """
        rate = self._rate(blocking=True)
        return None if rate is None else rate[0]

    def estimate(self, nbytes: int) -> SaveEstimate:
        """What a save of ``nbytes`` would take now, and the save in flight (if any).

        Args:
            nbytes: Bytes of tensor state the save would write (its size, all ranks
                together, each tensor once).
        """
        found = self._rate(blocking=True)
        rate, source = (None, "not measured") if found is None else found
        writing = self._writing
        if writing is None:
            return SaveEstimate(nbytes, rate, source)
        step, flying, started = writing
        background = self._rate(blocking=False)  # the save in flight writes in the background
        more = None if background is None else max(
            0.0, started + flying / background[0] - time.monotonic())
        return SaveEstimate(nbytes, rate, source, in_flight_step=step, in_flight_seconds=more)

    def training_seconds_since_commit(self, step: int, newest: int | None) -> float | None:
        """Seconds of training since the newest commit's state was captured, or None.

        Args:
            step: The step now (the one an emergency save would write).
            newest: The newest committed step (None: none).

        After a restore, before this process committed anything: the steps since the
        restored step times the measured step time (unknown before one step was timed).
        """
        if newest is None:
            return None
        committed = self._committed_capture
        if committed is not None and committed[0] == newest:
            return time.monotonic() - committed[1]
        if self._step_seconds is None or step < newest:
            return None
        return (step - newest) * self._step_seconds

    def expected_save_seconds(self, nbytes: int | None = None) -> float:
        """How long a blocking save takes.

        Args:
            nbytes: The save's bytes: with a measured throughput, the answer is
                ``nbytes`` at that rate.

        Returns:
            ``nbytes`` at the measured rate; else the last blocking save's duration,
            else the last save's.
        """
        rate = self.bytes_per_second
        if nbytes is not None and rate:
            return nbytes / rate
        if self._blocking_save_seconds is not None:
            return self._blocking_save_seconds
        return self.last_save_seconds


def _measures(nbytes: int, seconds: float) -> bool:
    """Whether ``nbytes`` written in ``seconds`` is a rate: both positive, the rate finite."""
    if nbytes <= 0 or not math.isfinite(seconds) or not seconds > 0:
        return False
    rate = nbytes / seconds
    return math.isfinite(rate) and rate > 0


def state_bytes(tree: Any) -> int:
    """Bytes of every tensor in a (nested) state dict, each at its global size.

    A ``DTensor`` counts its global size once (what the ranks write together); so does a
    plain tensor, which every rank of a replicated (DDP) model holds alike.
    """
    if isinstance(tree, torch.Tensor):
        return int(tree.numel()) * int(tree.element_size())
    if isinstance(tree, dict):
        return sum(state_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(value) for value in tree)
    return 0
