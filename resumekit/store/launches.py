"""A run's launches and its goodput, from the checkpoints its root keeps (``resumekit inspect``).

A **launch** is one checkpoint manager of one process: the consecutive checkpoints (in step
order) that record the same writer (SLURM job and restart count, or host and process id),
the same start (``Lineage.started_at``) and the same resumed step. Per launch,
:func:`launches_of` says where it resumed from, which steps it saved, how it ended (a
``preemption`` save at its end: preempted; a ``final`` one: finished; else unknown - a
crash, a preemption that saved nothing, or still running), the **restart gap** before it
(from the previous launch's newest checkpoint to its start), the **steps it trained again**
(those the previous launch had trained past the step it resumed from) and its **save
stalls** (``Manifest.save_stalls``: seconds its saves held training). :func:`goodput_of`
adds them up: the share of the wall time that was useful training.

Everything comes from the manifests; nothing is measured here. Figures a manifest written
before resumekit recorded them lacks (``started_at``, ``save_stalls``) are None, and so is
the goodput then, with the reason in words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from resumekit.store.manifest import Lineage, Manifest, SaveReason

__all__ = ["GOODPUT_METHOD", "Goodput", "Launch", "goodput_of", "launches_of"]

GOODPUT_METHOD = (
    "useful training time / wall time. Wall time runs from the first launch's start to "
    "the newest checkpoint. A launch's step time is (its time from its start to its "
    "newest checkpoint - its save stalls) / the steps it trained (from the step it "
    "resumed from, else 0); its useful time is the steps it did not train again times "
    "that step time. The rest is lost: restart gaps (from a launch's newest checkpoint to "
    "the next launch's start: they hold the work a crash lost after that checkpoint), "
    "save stalls and steps trained again. Only the checkpoints the root keeps count, a "
    "launch that committed nothing is part of the next restart gap, and the hosts' "
    "clocks are taken to agree."
)
"""How :func:`goodput_of` estimates the goodput, in words (``inspect`` prints it)."""

Ended = Literal["preempted", "finished", "unknown"]


def _utc(moment: datetime) -> datetime:
    """A recorded time, timezone-aware (a naive one is taken as UTC)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _writer(lineage: Lineage) -> tuple[object, ...]:
    if lineage.slurm_job_id is not None:
        return ("slurm", lineage.slurm_job_id, lineage.slurm_restart_count)
    return ("process", lineage.hostname, lineage.pid)


def _key(manifest: Manifest) -> tuple[object, ...]:
    lineage = manifest.lineage
    started = None if lineage.started_at is None else _utc(lineage.started_at)
    return (*_writer(lineage), started, lineage.resumed_from_step)


@dataclass(frozen=True)
class Launch:
    """One launch of a run, as the checkpoints the root keeps describe it.

    Attributes:
        index: Its position among the launches (1, 2, ...).
        lineage: The lineage its first kept checkpoint records (host, pid, SLURM job
            and restart count, launcher, resumed step, start).
        steps: The steps of its kept checkpoints, in order.
        last_reason: Why its newest checkpoint was written.
        first_saved_at: Publication time of its oldest kept checkpoint.
        last_saved_at: Publication time of its newest checkpoint.
        started_at: When it started (None: not recorded).
        start_source: Where ``started_at`` comes from: ``"recorded"`` (its manager's
            creation, ``Lineage.started_at``), ``"restore's claim"`` (the writer
            generation its restore claimed, for checkpoints that predate
            ``started_at``), or None.
        ended: ``"preempted"`` (its newest checkpoint is a ``preemption`` save),
            ``"finished"`` (a ``final`` save), else ``"unknown"``.
        restart_gap_s: Seconds from the previous launch's newest checkpoint to its start
            (None for the first launch, or when its start is not recorded).
        steps_trained_again: Steps it trained that the previous launch had trained
            already, up to its own newest checkpoint (None for the first launch, or a
            launch that restored nothing).
        trained_again_exact: Whether ``steps_trained_again`` is exact; else a lower
            bound (the previous launch may have trained past its newest checkpoint).
        save_stalls_s: Seconds its saves held training, up to its newest checkpoint
            (None: not recorded).
        save_stall_count: How many saves ``save_stalls_s`` counts.
    """

    index: int
    lineage: Lineage
    steps: tuple[int, ...]
    last_reason: SaveReason
    first_saved_at: datetime
    last_saved_at: datetime
    started_at: datetime | None
    start_source: str | None
    ended: Ended
    restart_gap_s: float | None
    steps_trained_again: int | None
    trained_again_exact: bool
    save_stalls_s: float | None
    save_stall_count: int | None

    @property
    def first_step(self) -> int:
        """The oldest step the root keeps from it."""
        return self.steps[0]

    @property
    def last_step(self) -> int:
        """Its newest checkpoint's step."""
        return self.steps[-1]

    @property
    def trained_steps(self) -> int:
        """Steps it trained up to its newest checkpoint (from its resumed step, else 0)."""
        return max(0, self.last_step - (self.lineage.resumed_from_step or 0))

    @property
    def wall_s(self) -> float | None:
        """Seconds from its start to its newest checkpoint (None: start not recorded)."""
        if self.started_at is None:
            return None
        return (self.last_saved_at - self.started_at).total_seconds()

    @property
    def step_s(self) -> float | None:
        """Its seconds per step, save stalls left out (None: not derivable)."""
        wall = self.wall_s
        if wall is None or self.save_stalls_s is None or self.trained_steps <= 0:
            return None
        return max(0.0, wall - self.save_stalls_s) / self.trained_steps

    def ended_said(self, *, last: bool) -> str:
        """How it ended, in words (``last``: no launch followed it)."""
        if self.ended == "preempted":
            return "preempted (saved)"
        if self.ended == "finished":
            return "finished (final save)"
        return "running or stopped" if last else "crash or unsaved stop"

    def to_json(self, *, last: bool) -> dict[str, Any]:
        """The JSON object of the launch (the ``launches`` items of ``inspect --json``)."""
        lineage = self.lineage
        return {
            "launch": self.index,
            "hostname": lineage.hostname,
            "pid": lineage.pid,
            "slurm_job_id": lineage.slurm_job_id,
            "slurm_restart_count": lineage.slurm_restart_count,
            "launcher": lineage.launcher,
            "resumed_from_step": lineage.resumed_from_step,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "saves": len(self.steps),
            "last_reason": self.last_reason.value,
            "ended": self.ended,
            "ended_said": self.ended_said(last=last),
            "started_at": None if self.started_at is None else self.started_at.isoformat(),
            "start_source": self.start_source,
            "first_saved_at": self.first_saved_at.isoformat(),
            "last_saved_at": self.last_saved_at.isoformat(),
            "restart_gap_seconds": self.restart_gap_s,
            "steps_trained": self.trained_steps,
            "steps_trained_again": self.steps_trained_again,
            "steps_trained_again_exact": self.trained_again_exact,
            "save_stall_seconds": self.save_stalls_s,
            "save_stall_saves": self.save_stall_count,
            "seconds_per_step": self.step_s,
        }


def _start(first: Manifest, previous: Manifest | None) -> tuple[datetime | None, str | None]:
    """A launch's start from its first kept checkpoint, and where it comes from."""
    lineage = first.lineage
    if lineage.started_at is not None:
        return _utc(lineage.started_at), "recorded"
    generation = first.generation
    shared = (previous is not None and previous.generation is not None
              and generation is not None and previous.generation.number == generation.number)
    if lineage.resumed_from_step is not None and generation is not None and not shared:
        return _utc(generation.claimed_at), "restore's claim"  # claimed as it restored
    return None, None


def _ended(reason: SaveReason) -> Ended:
    if reason == SaveReason.PREEMPTION:
        return "preempted"
    return "finished" if reason == SaveReason.FINAL else "unknown"


def launches_of(manifests: Sequence[Manifest]) -> list[Launch]:
    """Group committed checkpoints (in step order) into launches, with their figures.

    Args:
        manifests: The manifests of the root's committed checkpoints, by step (those a
            fenced writer committed left out).

    Returns:
        One :class:`Launch` per maximal run of consecutive checkpoints of one launch.
    """
    groups: list[list[Manifest]] = []
    for manifest in manifests:
        if groups and _key(groups[-1][-1]) == _key(manifest):
            groups[-1].append(manifest)
        else:
            groups.append([manifest])
    launches: list[Launch] = []
    for number, group in enumerate(groups, start=1):
        first, newest = group[0], group[-1]
        before = launches[-1] if launches else None
        started, source = _start(first, groups[number - 2][-1] if before else None)
        last_saved = _utc(newest.created_at)
        gap = again = None
        exact = before is None
        if before is not None:
            if started is not None:
                gap = (started - before.last_saved_at).total_seconds()
            resumed = first.lineage.resumed_from_step
            if resumed is not None:
                again = max(0, min(before.last_step, newest.step) - resumed)
                # The previous launch trained past its newest checkpoint unless that was
                # its end; up to our own newest checkpoint, the count is exact anyway.
                exact = before.ended != "unknown" or newest.step <= before.last_step
        stalls = newest.save_stalls
        launches.append(Launch(
            index=number, lineage=first.lineage, steps=tuple(m.step for m in group),
            last_reason=newest.reason, first_saved_at=_utc(first.created_at),
            last_saved_at=last_saved, started_at=started, start_source=source,
            ended=_ended(newest.reason), restart_gap_s=gap, steps_trained_again=again,
            trained_again_exact=exact,
            save_stalls_s=None if stalls is None else stalls.seconds,
            save_stall_count=None if stalls is None else stalls.saves))
    return launches


@dataclass(frozen=True)
class Goodput:
    """A run's goodput from its launches (:func:`goodput_of`).

    Attributes:
        fraction: Useful training time over wall time (None: not derivable, see
            ``missing``).
        wall_s: Seconds from the first launch's start to the newest checkpoint.
        useful_s: Seconds of useful training.
        restart_gaps_s: Seconds lost between launches.
        save_stalls_s: Seconds saves held training.
        trained_again_s: Seconds spent training steps again.
        upper_bound: Whether ``fraction`` is an upper bound (some launch's steps trained
            again is a lower bound).
        missing: Why ``fraction`` is None, in words (None when it is derived).
    """

    fraction: float | None
    wall_s: float | None = None
    useful_s: float | None = None
    restart_gaps_s: float | None = None
    save_stalls_s: float | None = None
    trained_again_s: float | None = None
    upper_bound: bool = False
    missing: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object (the ``goodput`` key of ``inspect --json``)."""
        return {
            "goodput": self.fraction,
            "wall_seconds": self.wall_s,
            "useful_seconds": self.useful_s,
            "restart_gap_seconds": self.restart_gaps_s,
            "save_stall_seconds": self.save_stalls_s,
            "trained_again_seconds": self.trained_again_s,
            "upper_bound": self.upper_bound,
            "missing": self.missing,
            "method": GOODPUT_METHOD,
        }


def _not_derivable(launch: Launch) -> str | None:
    """Why ``launch`` lacks a figure the goodput needs, or None."""
    said = f"launch {launch.index} (" + (
        f"steps {launch.first_step}-{launch.last_step})" if len(launch.steps) > 1
        else f"step {launch.first_step})")
    if launch.started_at is None:
        return f"{said} records no start (written before resumekit recorded it)"
    if launch.save_stalls_s is None:
        return f"{said} records no save stalls (written before resumekit recorded them)"
    if launch.index > 1 and launch.steps_trained_again is None:
        return f"{said} restored nothing, so its steps trained again are unknown"
    if launch.step_s is None:
        return f"{said} trained no step past the one it resumed from"
    return None


def goodput_of(launches: Sequence[Launch]) -> Goodput:
    """Useful training time over wall time, from a run's launches (:data:`GOODPUT_METHOD`).

    Returns:
        The estimate and its parts; ``fraction`` None (with ``missing``) when a launch
        lacks a figure it needs.
    """
    if not launches:
        return Goodput(None, missing="the root keeps no committed checkpoint")
    for launch in launches:
        problem = _not_derivable(launch)
        if problem is not None:
            return Goodput(None, missing=problem)
    first_start = launches[0].started_at
    assert first_start is not None
    wall = (launches[-1].last_saved_at - first_start).total_seconds()
    useful = gaps = stalls = again_s = 0.0
    for launch in launches:
        step_s, again = launch.step_s or 0.0, min(launch.steps_trained_again or 0,
                                                  launch.trained_steps)
        useful += (launch.trained_steps - again) * step_s
        again_s += again * step_s
        stalls += launch.save_stalls_s or 0.0
        gaps += launch.restart_gap_s or 0.0
    return Goodput(
        useful / wall if wall > 0 else None, wall_s=wall, useful_s=useful,
        restart_gaps_s=gaps, save_stalls_s=stalls, trained_again_s=again_s,
        upper_bound=not all(launch.trained_again_exact for launch in launches),
        missing=None if wall > 0 else "no time passed between the first start and the "
        "newest checkpoint")
