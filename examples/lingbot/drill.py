"""The preemption drill behind ``make demo``: interrupt a run every way, prove nothing changed.

``python -m examples.lingbot.drill [--out demo-output]`` trains the ``tiny`` config on two
CPU ranks (torchrun, gloo) three times, always with the same command::

    torchrun --nproc_per_node=2 -m examples.lingbot.train --config tiny --save-root DIR

* **A - uninterrupted**: one launch, all steps.
* **B - preempted and crashed**: SIGTERM to the torchrun agent once step ``--term-at`` is
  in ``metrics.jsonl`` (the ranks wait there for it, a test-only hold, so it lands after
  that step on any machine; the agent forwards it; the ranks agree on a step, save a
  ``preemption`` checkpoint and exit with status 75); relaunch; SIGKILL to the whole
  process tree (agent and both workers) once step ``--kill-at`` is logged by the relaunch
  (a later step when the SIGTERM launch already got that far) - a crash with no save;
  relaunch until done. The steps since the last checkpoint are replayed.
* **C - resumed on one rank**: a copy of B's run directory right after the SIGTERM,
  resumed with ``--nproc_per_node=1`` (the accumulation doubles so the effective batch
  stays 8); the sampler re-deals the rest of the epoch and the state is resharded.

The verdict follows what was committed, not what the timing was: after the SIGTERM the
ranks agree on some step and either commit a ``preemption`` checkpoint of it or - when
resumekit's rule skips the emergency save (the newest checkpoint is younger than a save
takes, or the grace period is too short) - keep the newest one, and the trainer says so.
Either way each relaunch resumes from the newest committed step, and that step (C's switch
from two ranks to one) is what the comparison with A is cut at.

Every wait is on a real event - a step appearing in ``metrics.jsonl``, a process exiting -
never on a sleep. Then the drill prints a table comparing B and C with A (per-step
metrics, steps replayed, final loss, the largest difference of any final weight), the
checkpoint chain of B, and writes ``loss.png`` with the three loss curves (matplotlib:
``pip install 'resumekit[plot]'``; without it one line says so and the drill goes on). It
exits with status 1 when B differs from A in any bit (metrics of any step, any tensor of
the final checkpoint), when C's history up to the step it resumed from differs from A's, or
when C's metrics do not switch from two ranks to one exactly there.

Outputs under ``--out``: ``A/``, ``B/``, ``C/`` run directories (checkpoints, metrics,
one log per launch), ``loss.png``, ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from examples.lingbot.faults import HOLD_FOR_SIGNAL_VARIABLE
from examples.lingbot.train import (
    CHECKPOINT_DIR,
    CHECKPOINT_NAME_FORMAT,
    METRIC_KEYS,
    METRICS_FILE,
    read_metrics,
)
from resumekit import EXIT_CODE_PREEMPTED, ResumekitError, _compat
from resumekit._optional import require
from resumekit.errors import MissingDependencyError
from resumekit.store.catalog import CheckpointEntry, list_checkpoints
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage

__all__ = [
    "DrillError",
    "Launch",
    "RunComparison",
    "Segment",
    "compare_runs",
    "diff_checkpoints",
    "kill_tree",
    "main",
    "process_tree",
    "run_segment",
    "switch_step",
    "wait_for_step",
    "world_size_problems",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
POLL_SECONDS = 0.05
"""How often a waiter re-reads the metrics file (it reacts to the line, not to a delay)."""


class DrillError(ResumekitError, RuntimeError):
    """The drill could not run (a launch failed, an event never came): ``segment``."""


# --------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class Launch:
    """How to start the trainer: the same command every time, except ``nproc``.

    Attributes:
        save_root: ``--save-root``.
        nproc: ``--nproc_per_node`` of torchrun.
        train_args: Extra trainer flags, identical for every launch of a run.
        shutdown_timeout: Seconds torchrun's agent waits for workers after forwarding a
            signal, before it kills them (the grace period).
    """

    save_root: Path
    nproc: int = 2
    train_args: tuple[str, ...] = ()
    shutdown_timeout: int = 120

    def command(self) -> list[str]:
        """The command line (without the torchrun options this torch's torchrun lacks)."""
        kept, _ = torchrun_options(self.shutdown_timeout)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={self.nproc}", *kept,
                "-m", "examples.lingbot.train", "--config", "tiny",
                "--save-root", str(self.save_root), *self.train_args]


def torchrun_options(shutdown_timeout: int) -> tuple[list[str], list[str]]:
    """torchrun's options for a launch: those this torch's torchrun takes, and those dropped.

    ``--shutdown-timeout`` exists from torch 2.12 (resumekit._compat knows from which torch
    each option exists); an older agent waits its own default after forwarding a signal.
    """
    version = _compat.torch_version() or "0.0"
    wanted = [f"--shutdown-timeout={shutdown_timeout}"]
    kept = [option for option in wanted if _compat.torchrun_takes(option, version)]
    return kept, [option for option in wanted if option not in kept]


@dataclass
class Segment:
    """One launch of a run and how it ended.

    Attributes:
        run: The run's name (A, B, C).
        index: Launch number within the run (1-based).
        nproc: Ranks.
        interruption: ``"sigterm"``, ``"sigkill"`` or ``None`` (ran to its end).
        signal_at: The logged step that triggered the signal.
        resumed_from: Step the launch started from (newest committed checkpoint).
        last_step: Newest step in the metrics when the launch ended.
        newest_checkpoint: Newest committed checkpoint after the launch.
        newest_reason: Why that checkpoint was written.
        returncode: Exit status of torchrun (negative: killed by that signal).
        seconds: Wall time of the launch.
        log: The launch's output file.
    """

    run: str
    index: int
    nproc: int
    interruption: str | None
    signal_at: int | None
    resumed_from: int
    last_step: int = 0
    newest_checkpoint: int | None = None
    newest_reason: str | None = None
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from ``/proc``), parents before children."""
    tree = [pid]
    for parent in tree:
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            tree.extend(int(child) for child in children if int(child) not in tree)
    return tree


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every descendant - a crash that leaves no one to save.

    torchrun starts each worker in a session of its own, so killing the agent's process
    group would orphan the workers; the tree is collected first, then killed.

    Returns:
        The pids signalled.
    """
    tree = process_tree(pid)
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    return tree


def _newest_step(metrics: Path) -> int:
    records = read_metrics(metrics)
    return max((record["step"] for record in records), default=0)


def wait_for_step(metrics: Path, step: int, process: subprocess.Popen[bytes],
                  timeout: float) -> int:
    """Block until ``metrics`` holds a record of ``step`` (or later); return the newest.

    Raises:
        DrillError: The process ended first, or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        newest = _newest_step(metrics)
        if newest >= step:
            return newest
        if process.poll() is not None:
            raise DrillError(f"the trainer exited with status {process.returncode} before "
                             f"step {step} appeared in {metrics}", segment=str(metrics))
        if time.monotonic() > deadline:
            raise DrillError(f"step {step} did not appear in {metrics} within {timeout} s "
                             f"(newest: {newest})", segment=str(metrics))
        time.sleep(POLL_SECONDS)


def _committed(save_root: Path) -> list[CheckpointEntry]:
    root = save_root / CHECKPOINT_DIR
    if not root.exists():
        return []
    entries = list_checkpoints(Storage(root), NameFormat(CHECKPOINT_NAME_FORMAT))
    return [entry for entry in entries if entry.status == "committed"]


def run_segment(run: str, index: int, launch: Launch, *, interruption: str | None = None,
                signal_at: int | None = None, log_dir: Path, timeout: float = 600.0,
                hold_for_signal: bool = False) -> Segment:
    """Launch the trainer once; optionally signal it once ``signal_at`` is logged.

    Args:
        run: Run name.
        index: Launch number.
        launch: The command.
        interruption: ``"sigterm"`` (to the torchrun agent, which forwards it to the
            workers), ``"sigkill"`` (the whole process tree), or None.
        signal_at: The step to wait for before signalling.
        log_dir: Where the launch's output goes.
        timeout: Seconds any wait may take.
        hold_for_signal: With a SIGTERM, the ranks wait after ``signal_at`` until it reaches
            them (``examples/lingbot/faults.py``), so it lands there however fast this
            machine trains; off, it lands wherever training has got to.

    Raises:
        DrillError: The launch failed or an awaited event did not happen.
    """
    committed = _committed(launch.save_root)
    segment = Segment(run, index, launch.nproc, interruption, signal_at,
                      resumed_from=committed[-1].step if committed else 0)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"launch-{index}-{interruption or 'complete'}.log"
    segment.log = str(log_path)
    metrics = launch.save_root / METRICS_FILE
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if hold_for_signal and interruption == "sigterm" and signal_at is not None:
        env[HOLD_FOR_SIGNAL_VARIABLE] = str(signal_at)
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(launch.command(), cwd=REPO_ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            if interruption is not None:
                if signal_at is None:
                    raise DrillError(f"{run} launch {index}: {interruption} needs a step",
                                     segment=f"{run}{index}")
                wait_for_step(metrics, signal_at, process, timeout)
                if interruption == "sigterm":
                    os.kill(process.pid, signal.SIGTERM)
                else:
                    kill_tree(process.pid)
            process.wait(timeout=timeout)
        except BaseException:
            kill_tree(process.pid)
            process.wait()
            raise
    segment.seconds = time.monotonic() - started
    segment.returncode = process.returncode
    segment.last_step = _newest_step(metrics)
    committed = _committed(launch.save_root)
    if committed:
        newest = committed[-1]
        assert newest.manifest is not None
        segment.newest_checkpoint = newest.step
        segment.newest_reason = str(newest.manifest.reason.value)
    if interruption is None and process.returncode != 0:
        raise DrillError(f"{run} launch {index} failed with status {process.returncode}; "
                         f"see {log_path}", segment=f"{run}{index}")
    return segment


# --------------------------------------------------------------------------- comparing


@dataclass
class RunComparison:
    """A run compared with the uninterrupted reference.

    Attributes:
        steps: Steps in the run's metrics (one record each).
        first_metric_difference: First step whose metrics differ in any bit, or None.
        max_loss_difference: Largest ``|loss - loss_ref|`` over the steps.
        final_loss: Loss of the last step.
        tensors_compared: Tensors of the final checkpoints compared (model and optimizer).
        tensors_different: How many differ in any bit.
        max_weight_difference: Largest absolute difference of any final model weight.
    """

    steps: int
    first_metric_difference: int | None
    max_loss_difference: float
    final_loss: float
    tensors_compared: int
    tensors_different: int
    max_weight_difference: float
    different_tensors: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """Whether metrics and final checkpoint match bit for bit."""
        return self.first_metric_difference is None and self.tensors_different == 0


def _resumekit(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``resumekit`` command line on checkpoints of the LingBot name format."""
    return subprocess.run(
        [sys.executable, "-m", "resumekit", *args, "--name-format", CHECKPOINT_NAME_FORMAT,
         "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, check=False,
        timeout=600)


def diff_checkpoints(reference: Path, other: Path) -> dict[str, Any]:
    """``resumekit diff --json`` of two runs' newest checkpoints (bitwise).

    Raises:
        DrillError: The command failed (not for differences: they are its answer).
    """
    roots = [str(run / CHECKPOINT_DIR) for run in (reference, other)]
    completed = _resumekit("diff", *roots, "--json")
    try:
        document: dict[str, Any] = json.loads(completed.stdout)
    except json.JSONDecodeError:
        raise DrillError(f"resumekit diff {' '.join(roots)} failed with status "
                         f"{completed.returncode}: {completed.stderr.strip()}",
                         segment=str(other)) from None
    return document


def compare_runs(reference: Path, other: Path, *, steps: range | None = None
                 ) -> RunComparison:
    """Compare ``other``'s metrics and newest checkpoint with ``reference``'s, bitwise.

    The metrics are compared here; the checkpoints by ``resumekit diff`` (every tensor of
    the model and optimizer, consolidated one at a time).

    Args:
        reference: Run directory of the uninterrupted run.
        other: Run directory of the interrupted run.
        steps: Only these steps' metrics count for ``first_metric_difference`` (all by
            default); the loss difference is measured over all common steps.

    Returns:
        The comparison.
    """
    ref_records = {r["step"]: r for r in read_metrics(reference / METRICS_FILE)}
    records = {r["step"]: r for r in read_metrics(other / METRICS_FILE)}
    first: int | None = None
    if sorted(records) != sorted(ref_records):
        missing = sorted(set(ref_records) ^ set(records))
        first = missing[0]
    for step in sorted(set(ref_records) & set(records)):
        if steps is not None and step not in steps:
            continue
        if any(records[step][key] != ref_records[step][key] for key in METRIC_KEYS):
            first = step if first is None else min(first, step)
            break
    loss_diff = max((abs(records[s]["loss"] - ref_records[s]["loss"])
                     for s in set(ref_records) & set(records)), default=math.inf)
    final_loss = records[max(records)]["loss"] if records else math.nan

    diff = diff_checkpoints(reference, other)
    tensors = [d for d in diff["differences"] if d["section"] == "tensor"]
    weights = [float(d["max_abs_diff"]) for d in tensors
               if d["key"].startswith("model.") and d["max_abs_diff"] is not None]
    return RunComparison(
        steps=len(records), first_metric_difference=first, max_loss_difference=loss_diff,
        final_loss=final_loss, tensors_compared=diff["compared"]["tensors"],
        tensors_different=len(tensors), max_weight_difference=max(weights, default=0.0),
        different_tensors=[d["key"] for d in tensors][:10],
    )


# --------------------------------------------------------------------------- plotting


def plot_losses(runs: dict[str, Path], out: Path, *, marks: dict[str, list[int]]) -> Path:
    """Write the loss curves of the runs to ``out`` (PNG, matplotlib's Agg backend).

    Raises:
        MissingDependencyError: matplotlib is not installed (``resumekit[plot]``); the
            drill's verdict does not depend on the picture, so it goes on without one.
    """
    matplotlib = require("matplotlib", extra="plot", feature="the drill's loss.png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    styles: dict[str, dict[str, Any]] = {"A": {"lw": 3.0, "alpha": 0.35, "color": "tab:blue"},
              "B": {"lw": 0.0, "marker": "o", "ms": 4, "color": "tab:orange"},
              "C": {"lw": 1.2, "ls": "--", "color": "tab:green"}}
    labels = {"A": "A uninterrupted (2 ranks)", "B": "B SIGTERM + SIGKILL (2 ranks)",
              "C": "C resumed on 1 rank after the SIGTERM"}
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, root in runs.items():
        records = read_metrics(root / METRICS_FILE)
        axis.plot([r["step"] for r in records], [r["loss"] for r in records],
                  label=labels.get(name, name), **styles.get(name, {}))
    for name, steps in marks.items():
        for step in steps:
            axis.axvline(step, color="grey", lw=0.8, ls=":")
            axis.text(step, axis.get_ylim()[1], f" {name}", va="top", fontsize=8,
                      color="grey")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss (flow matching, latents + actions)")
    axis.set_title("LingBot-VA tiny: uninterrupted vs preempted runs")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


# --------------------------------------------------------------------------- the drill


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.lingbot.drill",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("demo-output"),
                        help="output directory (replaced)")
    parser.add_argument("--term-at", type=int, default=2,
                        help="SIGTERM once this step is logged (run B)")
    parser.add_argument("--kill-at", type=int, default=13,
                        help="SIGKILL once this step is logged (run B)")
    parser.add_argument("--no-world-size-change", action="store_true",
                        help="skip run C (resume on one rank)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds any single wait may take (a hang detector)")
    parser.add_argument("--grace-period", type=float, default=None,
                        help="the trainer's --grace-period (every launch): seconds between "
                             "the signal and the kill; a tiny one (1e-9) makes resumekit "
                             "skip the emergency save, the path the verdict must also pass")
    return parser


@dataclass
class _Drill:
    """One drill in progress: where its runs live, what they did, what went wrong."""

    out: Path
    console: Console
    timeout: float
    # A vote every step: with the hold for the signal (run_segment) the ranks agree on the
    # step after --term-at, however fast this machine trains.
    train_args: tuple[str, ...] = ("--keep-last", "0", "--no-progress", "--poll-every", "1")
    segments: list[Segment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def root(self, name: str) -> Path:
        """Run ``name``'s directory (A, B or C)."""
        return self.out / name

    def run(self, name: str, index: int, *, nproc: int = 2, interruption: str | None = None,
            signal_at: int | None = None) -> Segment:
        """One launch of run ``name`` with the same command as every other, printed."""
        launch = Launch(self.root(name), nproc=nproc, train_args=self.train_args)
        segment = run_segment(name, index, launch, interruption=interruption,
                              signal_at=signal_at, log_dir=self.root(name) / "logs",
                              timeout=self.timeout, hold_for_signal=True)
        self.segments.append(segment)
        self.console.print(
            f"[bold]{segment.run}{segment.index}[/] nproc={segment.nproc} "
            f"from step {segment.resumed_from}: "
            f"{segment.interruption or 'ran to the end'}"
            f"{'' if segment.signal_at is None else f' at step {segment.signal_at}'} -> "
            f"exit {segment.returncode}, newest step {segment.last_step}, newest checkpoint "
            f"{segment.newest_checkpoint} ({segment.newest_reason}) in {segment.seconds:.1f}s")
        return segment

    def launches(self, name: str) -> list[Segment]:
        """The launches of run ``name``, in order."""
        return [s for s in self.segments if s.run == name]


def preemption_checkpoint_problem(term: Segment) -> str | None:
    """What is wrong with the checkpoint a SIGTERM launch left (``None``: nothing).

    The ranks stop at the step they agreed on (the last logged one). resumekit commits a
    checkpoint of it unless its rule skips the emergency save (the last commit is younger
    than a save takes - the emergency capture of the last completed step may have committed
    it while the stopping step ran - or the grace period is too short); then the newest
    checkpoint stays and the resume replays from there - a decision, not a failure, but
    never a silent one: the trainer's log must say it.
    """
    if term.newest_checkpoint == term.last_step:
        return None
    said = f"emergency save skipped, newest checkpoint is step {term.newest_checkpoint}"
    if said in Path(term.log).read_text():
        return None
    return (f"after SIGTERM the newest checkpoint is {term.newest_checkpoint} "
            f"({term.newest_reason}), not the last logged step {term.last_step}, and the "
            f"trainer did not say the emergency save was skipped (see {term.log})")


def _check_preemption_checkpoint(drill: _Drill, term: Segment) -> None:
    """After the SIGTERM: a checkpoint of the agreed step, or the trainer said why not."""
    problem = preemption_checkpoint_problem(term)
    if problem is not None:
        drill.problems.append(problem)
    elif term.newest_checkpoint != term.last_step:
        drill.console.print(f"note: the emergency save of step {term.last_step} was skipped "
                            f"(resumekit's rule); the newest checkpoint is step "
                            f"{term.newest_checkpoint}, and the resumes replay from there")


def switch_step(drill: _Drill) -> int:
    """The step run C switched from two ranks to one: the step its relaunch resumed from.

    That is the newest checkpoint committed when it launched - the preemption save of the
    agreed step, or an older one when the emergency save was skipped - never the step the
    SIGTERM stopped at.
    """
    return drill.launches("C")[0].resumed_from


def world_size_problems(records: Sequence[dict[str, Any]], switch: int) -> list[str]:
    """What is wrong with run C's metrics around ``switch`` (empty when nothing is).

    Every record up to ``switch`` must come from the two-rank launch, every later one from
    the one-rank resume: one history, cut where the resume actually started.
    """
    problems = []
    steps = [record["step"] for record in records]
    if steps != list(range(1, len(steps) + 1)):
        problems.append(f"run C: its metrics are not one history of steps 1..{len(steps)}: "
                        f"{steps}")
    wrong = [record["step"] for record in records
             if record["world_size"] != (2 if record["step"] <= switch else 1)]
    if wrong:
        problems.append(f"run C: resumed from step {switch} on 1 rank, but the metrics of "
                        f"step(s) {wrong} have world_size "
                        f"{[r['world_size'] for r in records if r['step'] in wrong]}")
    return problems


def _run_all(drill: _Drill, args: argparse.Namespace) -> Segment:
    """Runs A, B (SIGTERM, SIGKILL, to the end) and C (B after the SIGTERM, on 1 rank).

    Returns B's SIGTERM launch.
    """
    drill.console.rule("A: uninterrupted")
    drill.run("A", 1)
    drill.console.rule("B: SIGTERM, SIGKILL, same command each time")
    term = drill.run("B", 1, interruption="sigterm", signal_at=args.term_at)
    _check_preemption_checkpoint(drill, term)
    if not args.no_world_size_change:
        shutil.copytree(drill.root("B"), drill.root("C"),
                        ignore=shutil.ignore_patterns("logs"))
    # The kill waits for a step this launch logged: past every step the SIGTERM launch
    # logged (the ranks may have agreed late, even past --kill-at, and until the relaunch
    # drops them those records are still in metrics.jsonl).
    drill.run("B", 2, interruption="sigkill", signal_at=max(args.kill_at, term.last_step + 1))
    drill.run("B", 3)
    if not args.no_world_size_change:
        drill.console.rule("C: resume B's newest checkpoint after the SIGTERM on 1 rank")
        drill.run("C", 2, nproc=1)
    return term


def _replayed(drill: _Drill, term: Segment) -> dict[str, int]:
    """Steps each interrupted run executed twice."""
    b_runs = drill.launches("B")
    replayed = {"B": sum(max(0, earlier.last_step - later.resumed_from)
                         for earlier, later in itertools.pairwise(b_runs))}
    if drill.launches("C"):
        replayed["C"] = max(0, term.last_step - drill.launches("C")[0].resumed_from)
    return replayed


def _verdict(name: str, comparison: RunComparison, switch: int) -> tuple[bool, str]:
    """Whether run ``name`` matches A as the drill promises, and the table's words."""
    if name == "B":
        if comparison.identical:
            return True, "bit-identical"
        return False, (f"DIFFERS (step {comparison.first_metric_difference}, "
                       f"{comparison.different_tensors[:3]})")
    if comparison.first_metric_difference is None and math.isfinite(comparison.final_loss):
        return True, f"= A to step {switch}, then close"
    return False, f"DIFFERS before the switch (step {comparison.first_metric_difference})"


def _results_table(drill: _Drill, comparisons: dict[str, RunComparison],
                   replayed: dict[str, int], switch: int) -> Table:
    """The table of runs against A; a run that does not match adds a problem."""
    reference = read_metrics(drill.root("A") / METRICS_FILE)
    table = Table(title="LingBot-VA tiny: uninterrupted (A) vs interrupted runs")
    for column in ("run", "launches", "ranks", "steps", "replayed", "final loss",
                   "max |loss-A|", "tensors = A", "max |weight-A|", "verdict"):
        table.add_column(column, justify="right" if column != "run" else "left")
    table.add_row("A", "1", "2", str(len(reference)), "0",
                  f"{reference[-1]['loss']:.10f}", "-", "-", "-", "reference")
    for name, comparison in comparisons.items():
        ok, verdict = _verdict(name, comparison, switch)
        if not ok:
            drill.problems.append(f"run {name}: {verdict}")
        launches = len(drill.launches(name)) + (1 if name == "C" else 0)
        table.add_row(
            f"{name} " + ("TERM+KILL" if name == "B" else "1 rank"),
            str(launches), "2" if name == "B" else f"2, 1 from {switch}",
            str(comparison.steps), str(replayed[name]),
            f"{comparison.final_loss:.10f}", f"{comparison.max_loss_difference:.3g}",
            f"{comparison.tensors_compared - comparison.tensors_different}/"
            f"{comparison.tensors_compared}",
            f"{comparison.max_weight_difference:.3g}", verdict,
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drill; return 0 when the interrupted run is bit-identical, else 1."""
    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the tables
        console = Console(width=150)
    out: Path = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _, dropped = torchrun_options(Launch(out).shutdown_timeout)
    if dropped:
        console.print(f"note: the torchrun of torch {_compat.torch_version()} lacks "
                      f"{', '.join(o.split('=')[0] for o in dropped)}: launching without "
                      f"{', '.join(dropped)} (its agent's default grace period applies)")
    started = time.monotonic()
    drill = _Drill(out, console, args.timeout)
    if args.grace_period is not None:
        drill.train_args += ("--grace-period", repr(args.grace_period))
    term = _run_all(drill, args)

    # C is A's history up to the step its relaunch resumed from (what was committed),
    # whether or not the emergency save was made.
    switch = term.last_step
    comparisons = {"B": compare_runs(drill.root("A"), drill.root("B"))}
    if not args.no_world_size_change:
        switch = switch_step(drill)
        drill.problems.extend(world_size_problems(
            read_metrics(drill.root("C") / METRICS_FILE), switch))
        comparisons["C"] = compare_runs(drill.root("A"), drill.root("C"),
                                        steps=range(0, switch + 1))
    replayed = _replayed(drill, term)
    console.print(_results_table(drill, comparisons, replayed, switch))
    console.rule("checkpoint chain of run B: resumekit inspect")
    listing = _resumekit("inspect", str(drill.root("B") / CHECKPOINT_DIR))
    console.print(listing.stdout + listing.stderr, markup=False, highlight=False)
    kill = next(s for s in drill.launches("B") if s.interruption == "sigkill")
    try:
        picture = str(plot_losses(
            {name: drill.root(name) for name in ("A", *comparisons)}, out / "loss.png",
            marks={"SIGTERM": [term.last_step], "SIGKILL": [kill.last_step]}))
    except MissingDependencyError as error:  # the verdict does not depend on the picture
        picture = f"not drawn ({error})"
    elapsed = time.monotonic() - started
    summary = {
        "seconds": elapsed,
        "segments": [asdict(s) for s in drill.segments],
        "comparisons": {name: asdict(c) for name, c in comparisons.items()},
        "replayed": replayed,
        "switch": None if args.no_world_size_change else switch,
        "problems": drill.problems,
        "exit_code_preempted": EXIT_CODE_PREEMPTED,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    console.print(f"loss curves: {picture}; summary: {out / 'summary.json'}; "
                  f"drill took {elapsed:.0f}s", markup=False, highlight=False, soft_wrap=True)
    if drill.problems:
        for problem in drill.problems:
            console.print(f"[bold red]FAIL[/] {problem}")
        return 1
    console.print("[bold green]OK[/] the preempted and crashed run is bit-identical to the "
                  "uninterrupted one")
    return 0

if __name__ == "__main__":
    sys.exit(main())
