"""Goodput under preemption: the LingBot tiny trainer interrupted on a fixed schedule.

The trainer (``examples.lingbot.train --config tiny`` on 2 gloo CPU ranks, through
:mod:`benchmarks.goodput_worker`, which timestamps its events) runs ``steps`` steps, with
the same command every launch, interrupted at fixed random steps (seeded): ``sigterms``
SIGTERMs to the torchrun agent (the ranks agree, write a preemption checkpoint, exit 75)
and one SIGKILL of the whole process tree (a crash: the steps since the last checkpoint
are replayed), each at a random place in the schedule. Then

    goodput = useful step time / total wall time

where the total is, per launch, from the start of ``restore()`` (process start-up before it
is torch's and the launcher's, excluded) to the trainer's exit (for the killed launch, its
last event); and the useful time is, for each step number, its last execution's duration
minus the time it waited on checkpointing. What is lost is split into replayed steps,
restore, time blocked by saves, and the rest (the preemption vote, the partial step a kill
cut short). ``relaunch_first_step_excess_s`` reports, beside them, how much longer than the
median step each relaunch's first step took (torch's one-time work in a fresh process,
counted as useful time by the definition above).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.goodput_worker import EVENTS_ENV
from examples.lingbot.drill import Launch, run_segment


@dataclass(frozen=True)
class TimedLaunch(Launch):
    """The drill's launch, through the timing wrapper."""

    def command(self) -> list[str]:
        """torchrun ... -m benchmarks.goodput_worker <the trainer's arguments>."""
        command = super().command()
        at = command.index("examples.lingbot.train")
        return [*command[:at], "benchmarks.goodput_worker", *command[at + 1:]]


def schedule(steps: int, sigterms: int, seed: int, min_gap: int = 20
             ) -> list[tuple[int, str]]:
    """``(step, "sigterm" | "sigkill")`` interruptions, sorted, at least ``min_gap`` apart."""
    count = sigterms + 1
    if steps < (count + 1) * min_gap:
        raise ValueError(f"{steps} steps cannot hold {count} interruptions {min_gap} apart")
    rng = random.Random(seed)
    while True:
        picked = sorted(rng.sample(range(min_gap, steps - min_gap), count))
        if all(b - a >= min_gap for a, b in itertools.pairwise(picked)):
            break
    kill = rng.randrange(count)
    return [(step, "sigkill" if number == kill else "sigterm")
            for number, step in enumerate(picked)]


def run(work: Path, *, steps: int, save_interval: int, sigterms: int, seed: int,
        async_save: bool, timeout: float = 600.0,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One interrupted run; its events, schedule and :func:`analyse` figures."""
    events = work / "events.jsonl"
    train_args = ("--num-steps", str(steps), "--save-interval", str(save_interval),
                  "--no-progress", *(("--async-save",) if async_save else ()))
    launch = TimedLaunch(save_root=work / "run", train_args=train_args)
    plan = schedule(steps, sigterms, seed)
    previous = os.environ.get(EVENTS_ENV)
    os.environ[EVENTS_ENV] = str(events)
    segments = []
    try:
        for index, (step, kind) in enumerate([*plan, (None, None)], start=1):
            segment = run_segment("goodput", index, launch, interruption=kind, signal_at=step,
                                  log_dir=work / "logs", timeout=timeout)
            segments.append({"interruption": kind, "signal_at": step,
                             "resumed_from": segment.resumed_from,
                             "last_step": segment.last_step,
                             "returncode": segment.returncode, "seconds": segment.seconds})
            if progress is not None:
                progress(f"goodput ({'async' if async_save else 'sync'}) launch {index}: "
                         f"{kind or 'to the end'} at {step}, steps {segment.resumed_from}-"
                         f"{segment.last_step}, {segment.seconds:.1f} s")
    finally:
        if previous is None:
            os.environ.pop(EVENTS_ENV, None)
        else:
            os.environ[EVENTS_ENV] = previous
    records = _read_events(events)
    others = [_read_events(path) for path in sorted(work.glob(f"{events.name}.rank*"))]
    return {"schedule": plan, "segments": segments, "steps": steps,
            "save_interval": save_interval, "async_save": async_save,
            **analyse(records, steps, others)}


def _read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launches_of(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A worker's events split by launch (each list starts at its ``launch`` event)."""
    launches: list[list[dict[str, Any]]] = []
    for event in events:
        if event["kind"] == "launch":
            launches.append([])
        if launches:
            launches[-1].append(event)
    return launches


def analyse(events: Sequence[dict[str, Any]], steps: int,
            other_ranks: Sequence[Sequence[dict[str, Any]]] = ()) -> dict[str, Any]:
    """Goodput and where the rest of the time went, from a run's events.

    Args:
        events: Rank 0's events.
        steps: Steps of the run.
        other_ranks: The other ranks' events: a launch's restore starts when the last
            rank enters it (a rank still starting up is start-up, not restore).
    """
    launches = launches_of(events)
    entered = [[next((e["t"] for e in launch if e["kind"] == "restore_begin"), 0.0)
                for launch in launches_of(rank)] for rank in other_ranks]
    total = restore = blocked = 0.0
    executions: list[tuple[int, float]] = []
    first_steps: list[float] = []  # each relaunch's first step (warm-up included)
    for number, launch in enumerate(launches):
        begin = max([next(e["t"] for e in launch if e["kind"] == "restore_begin"),
                     *(rank[number] for rank in entered if number < len(rank))])
        ready = next(e["t"] for e in launch if e["kind"] == "restore_end")
        exits = [e["t"] for e in launch if e["kind"] == "exit"]
        end = exits[0] if exits else launch[-1]["t"]
        total += end - begin
        restore += ready - begin
        spans: list[tuple[float, float]] = []
        depth, opened = 0, 0.0
        for event in launch:
            if event["kind"] == "blocked_begin":
                depth += 1
                opened = event["t"] if depth == 1 else opened
            elif event["kind"] == "blocked_end" and depth:
                depth -= 1
                if depth == 0:
                    spans.append((opened, event["t"]))
        if depth:  # killed while blocked
            spans.append((opened, end))
        blocked += sum(b - a for a, b in spans if a >= ready)
        previous = ready
        for event in launch:
            if event["kind"] != "step":
                continue
            waited = sum(max(0.0, min(b, event["t"]) - max(a, previous)) for a, b in spans)
            if number and previous == ready:
                first_steps.append(event["t"] - previous - waited)
            executions.append((int(event["step"]), event["t"] - previous - waited))
            previous = event["t"]
    last: dict[int, float] = {}
    for step, seconds in executions:
        last[step] = seconds
    useful = sum(last.values())
    replayed = sum(seconds for seconds in (s for _, s in executions)) - useful
    complete = sorted(last) == list(range(1, steps + 1))
    median = sorted(last.values())[len(last) // 2] if last else None
    return {
        "goodput": useful / total if total else None,
        "complete": complete, "launches": len(launches),
        "total_s": total, "useful_s": useful, "replayed_steps": len(executions) - len(last),
        "replayed_s": replayed, "restore_s": restore, "blocked_by_saves_s": blocked,
        "other_s": total - useful - replayed - restore - blocked,
        "step_s_median": median,
        # Counted as useful above, but a cost of the relaunch all the same: a fresh
        # process's first step does torch's one-time work (first dispatch of each op).
        "relaunch_first_step_excess_s": (sum(max(0.0, first - median) for first in first_steps)
                                         if median is not None else None),
    }


if __name__ == "__main__":  # a quick look: python -m benchmarks.goodput WORKDIR [async]
    import tempfile

    base = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    began = time.monotonic()
    result = run(base, steps=int(os.environ.get("STEPS", "600")), save_interval=25,
                 sigterms=5, seed=16, async_save="async" in sys.argv[2:], progress=print)
    print(json.dumps({k: v for k, v in result.items() if k != "segments"}, indent=1))
    print(f"{time.monotonic() - began:.0f} s")
