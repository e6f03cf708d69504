"""``python -m benchmarks.scale`` (``make bench-scale``): gigabytes per rank on a shared NAS.

Issue 27's scale model: 2 gloo CPU ranks, each holding ``--state-gb`` of training state
(the bench's linear stack ``fully_shard``-ed with FSDP2 over both ranks, fp32, with AdamW:
each rank's shard of the weights and both moments), a real training step, written to the
NAS stand-in of :mod:`benchmarks.nas` (a loop-device ext4 under a cgroup bandwidth bound
that every reader and writer shares, buffered and direct), under a preemption schedule:
for each method, launch 1 starts fresh and is sent SIGTERM at one step (the trainer saves
within ``--grace-s`` or is SIGKILLed when it runs out), launch 2 resumes and is SIGKILLed
at another (a crash: the steps since the newest complete checkpoint are redone), launch 3
resumes and runs to the end. The methods run one after the other in one invocation, on
the same stand-in, each from an empty root (:data:`benchmarks.scale_worker.METHODS`).

Figures (per method in ``details``; the summary takes resumekit's async save with the
process writer where the option exists, else with its thread, as "resumekit async"):

* ``scale_async_block_vs_memcpy``: median time an interval save blocks training / a
  memcpy of a state of the rank's size (the slower rank's, preallocated buffers);
* ``scale_step_slowdown_during_save``: median training step while a background save is
  still being written / median step with no save in flight;
* ``scale_save_vs_bandwidth``: resumekit sync, (checkpoint bytes / bandwidth) / the
  save's time: the fraction of the stand-in's bandwidth a save achieves;
* ``scale_restore_vs_bandwidth``: the same for resumekit sync's restores (cold: the
  checkpoint's pages are evicted before each launch);
* ``scale_sigterm_steps_lost``: steps trained but in no checkpoint after each SIGTERM,
  the most over resumekit's methods;
* ``scale_sigterm_steps_lost_tight_grace`` (issue 38): after the schedule, each resumekit
  method's tight-grace launch (:func:`run_tight_grace`): steps of at least 3x the
  method's measured save time (a larger batch: real compute), SIGTERM half a measured
  step into a step, a grace window of 1.3x the save time, then SIGKILL; completed steps
  in no checkpoint (the last step completed at the signal minus the newest committed),
  the most over resumekit's methods (``--no-tight-grace`` leaves it out);
* ``scale_goodput``: :func:`benchmarks.goodput.analyse` over the schedule, resumekit async;
* ``scale_goodput_vs_dcp_async``: that / the better of DCP's two ``async_save`` executors;
* ``scale_step_slowdown_local_every_step``: a step with a local tier saving every step
  (written in the background) / a step with no checkpointing, side by side in one launch
  (:mod:`benchmarks.scale_local`; ``--local-rounds 0`` leaves it out);
* ``scale_peak_rss_async_vs_state``, ``scale_peak_rss_sync_vs_state``: the host memory
  the method itself needs at its most, per rank (:func:`checkpoint_memory`: what its
  calls leave allocated and the most one of them raises the resident set above that,
  plus the private memory of processes it started, sampled), / the rank's state;
  resumekit async and sync, the larger rank. ``details`` keeps beside it the launch's
  high-water mark above that of a step without a save (``peak_extra_launch``), which
  under :data:`MALLOC_KEEP` also counts the heap's growth over the steps.

Writes ``benchmarks/results/scale.json`` and ``scale.png``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import goodput, nas, scale_local
from benchmarks.scale_worker import (
    DCP_DONE,
    DUMP_SIGNAL,
    KEEP,
    METHODS,
    TORCH_DONE,
    process_writer_available,
)
from benchmarks.timing import evict, files_under, machine_facts, median, remove
from benchmarks.workload import Shape, shape_for
from examples.lingbot.drill import kill_tree, process_tree
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import DEFAULT_NAME_FORMAT, NameFormat
from resumekit.store.storage import Storage

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
GB = 1_000_000_000
MB = 1_000_000
RANKS = 2
#: ``details`` key of the local tier at ``save_every=1`` (:mod:`benchmarks.scale_local`).
LOCAL_EVERY_STEP = "local_every_step"

#: Summary key -> goal (issue 27). "higher"/"lower" is better; ``target`` None: no goal.
TARGETS: dict[str, dict[str, Any]] = {
    "scale_async_block_vs_memcpy": {"better": "lower", "target": 1.5,
                                    "what": "time an async save blocks / memcpy of the "
                                            "rank's state"},
    "scale_step_slowdown_during_save": {"better": "lower", "target": 1.05,
                                        "what": "training step while a background save "
                                                "writes / step alone"},
    "scale_save_vs_bandwidth": {"better": "higher", "target": 0.9,
                                "what": "sync save: (bytes / stand-in bandwidth) / time"},
    "scale_restore_vs_bandwidth": {"better": "higher", "target": 0.9,
                                   "what": "restore: (bytes / stand-in bandwidth) / time"},
    "scale_sigterm_steps_lost": {"better": "lower", "target": 0,
                                 "what": "steps in no checkpoint after a SIGTERM "
                                         "(state fits the grace window)"},
    "scale_sigterm_steps_lost_tight_grace": {
        "better": "lower", "target": 0,
        "what": "completed steps in no checkpoint after a SIGTERM mid-step, grace 1.3x "
                "the save, step >= 3x it"},
    "scale_goodput": {"better": "higher", "target": 0.98,
                      "what": "useful step time / wall time over the schedule"},
    "scale_goodput_vs_dcp_async": {"better": "higher", "target": 1.0,
                                   "what": "goodput / DCP async_save's (better executor)"},
    "scale_peak_rss_async_vs_state": {"better": "lower", "target": 1.25,
                                      "what": "host memory checkpointing holds + raises "
                                              "at its most / state, async"},
    "scale_peak_rss_sync_vs_state": {"better": "lower", "target": 0.25,
                                     "what": "host memory checkpointing holds + raises "
                                             "at its most / state, sync"},
    "scale_async_total_vs_sync": {"better": "lower", "target": 1.1,
                                  "what": "async save, call to committed / sync save"},
    "scale_emergency_save_vs_grace": {"better": "lower", "target": 1.0,
                                      "what": "SIGTERM to committed / grace window"},
    "scale_step_slowdown_local_every_step": {"better": "lower", "target": 1.05,
                                             "what": "step with a local save every step / "
                                                     "step with no checkpointing"},
}

_STARTED = time.monotonic()

#: The tight-grace SIGTERM (issue 38, ``scale_sigterm_steps_lost_tight_grace``): the grace
#: window is this many times the method's measured save time ...
TIGHT_GRACE_FACTOR = 1.3
#: ... a step takes at least this many times it ...
TIGHT_STEP_FACTOR = 3.0
#: ... (the worker aims this far above, so load's noise keeps a step over it) ...
TIGHT_STEP_AIM = 1.2
#: ... the launch saves every this many steps, and trains at most this many.
TIGHT_SAVE_EVERY = 2
TIGHT_MAX_STEPS = 12
#: ``details[method]`` key of the tight-grace launch.
TIGHT_GRACE = "tight_grace"

#: glibc malloc in every trainer: no ``mmap`` for large blocks and no trimming, so a
#: step's freed buffers (FSDP2's all-gathered weights and gradients, AdamW's temporaries:
#: gigabytes each step) stay in the process for the next step. Otherwise each step gives
#: them back to the kernel and faults them in again, and on a VM whose balloon reports
#: free pages to the host (as here) that refault costs the host's page faults too:
#: steps took 17-47 s instead of 7-10 s at 2 GB per rank. The same for every method.
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}

#: Per-method figures :func:`combine` takes the median of (a path into ``details``).
METHOD_FIGURES: dict[str, tuple[str, ...]] = {
    "goodput": ("goodput", "goodput"),
    "save_blocked_s_median": ("save_blocked_s_median",),
    "save_total_s_median": ("save_total_s_median",),
    "save_vs_bandwidth": ("save_vs_bandwidth",),
    "block_vs_memcpy": ("block_vs_memcpy",),
    "step_s_alone_median": ("step_s_alone_median",),
    "step_slowdown_during_save": ("step_slowdown_during_save",),
    "restore_vs_bandwidth": ("restore_vs_bandwidth",),
    "sigterm_steps_lost": ("sigterm_steps_lost",),
    "sigterm_steps_lost_tight_grace": ("sigterm_steps_lost_tight_grace",),
    "emergency_save_vs_grace": ("emergency_save_vs_grace",),
    "peak_extra_vs_state": ("peak_extra", "vs_state"),
    "peak_extra_launch_vs_state": ("peak_extra_launch", "vs_state"),
}


def _log(message: str) -> None:
    print(f"[scale {time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr,
          flush=True)


# ------------------------------------------------------------------------ watching a run


def committed_steps(method: str, root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` the way ``method`` marks them."""
    if not root.exists():
        return []
    if method.startswith("resumekit"):
        try:
            entries = list_checkpoints(Storage(str(root)), NameFormat(DEFAULT_NAME_FORMAT))
        except Exception:  # noqa: BLE001 - a listing racing a write: look again
            return []
        return [(entry.step, Path(entry.path)) for entry in entries
                if entry.status == "committed"]
    marker = TORCH_DONE if method == "torch_save" else DCP_DONE
    found = []
    for path in root.glob("step-*"):
        if (path / marker).exists():
            found.append((int(path.name.split("-")[1]), path))
    return sorted(found)


def tree_bytes(path: Path) -> int:
    """Bytes of every file below ``path``."""
    total = 0
    for file in files_under(path):
        with contextlib.suppress(OSError):  # removed by retention meanwhile
            total += file.stat().st_size
    return total


def _private_bytes(pid: int) -> int:
    """Private memory of ``pid`` (``smaps_rollup``: what no other process maps)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            return sum(int(line.split()[1]) * 1024 for line in handle
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except (OSError, ValueError):
        return 0


class Watcher:
    """A driver-side thread: when each checkpoint completes; the ranks' children's memory.

    Every ``period`` seconds it lists the method's complete checkpoints (recording the
    first time each step is seen and its bytes) and, for each rank's worker process (its
    pid from the rank's ``launch`` event), sums the private memory of the processes it
    started (a writer process, DCP's checkpointing process) and keeps the peak.
    """

    def __init__(self, method: str, root: Path, events: Path, period: float = 0.1) -> None:
        self.method, self.root, self.events, self.period = method, root, events, period
        self.commits: dict[int, dict[str, Any]] = {}
        self.child_peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._look()

    def reset_memory(self) -> None:
        self.child_peak = {}

    def _pids(self) -> dict[int, int]:
        pids = {}
        for rank in range(RANKS):
            path = self.events if rank == 0 else Path(f"{self.events}.rank{rank}")
            try:
                lines = path.read_text().splitlines()
            except OSError:
                continue
            launches = [json.loads(line) for line in lines if '"launch"' in line]
            if launches:
                pids[rank] = int(launches[-1]["pid"])
        return pids

    def _look(self) -> None:
        now = time.time()
        for step, path in committed_steps(self.method, self.root):
            if step not in self.commits:
                self.commits[step] = {"t": now, "bytes": tree_bytes(path)}
        for rank, pid in self._pids().items():
            children = [p for p in process_tree(pid) if p != pid]
            held = sum(_private_bytes(child) for child in children)
            self.child_peak[rank] = max(self.child_peak.get(rank, 0), held)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._look()


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------ one method


def run_method(method: str, *, work: Path, logs: Path, shape: Shape,
               config: Mapping[str, Any]) -> dict[str, Any]:
    """The schedule for one method (its root under ``work``); launches, events, figures."""
    root = work / method
    logs.mkdir(parents=True, exist_ok=True)
    events = logs / f"events-{method}.jsonl"
    remove(events)
    for extra in logs.glob(f"events-{method}.jsonl.rank*"):
        remove(extra)
    grace = float(config["grace_s"])
    plan: list[tuple[int | None, str | None]] = [*config["schedule"], (None, None)]
    watcher = Watcher(method, root, events).start()
    launches = []
    try:
        for index, (at, kind) in enumerate(plan, start=1):
            before = committed_steps(method, root)
            restored_bytes = tree_bytes(before[-1][1]) if before else 0
            if before:  # a cold restore: nothing of the checkpoint in the page cache
                os.sync()
                evict(root)
            watcher.reset_memory()
            command = _worker_command(method, root, events, shape, batch=int(config["batch"]),
                                      steps=int(config["steps"]),
                                      save_every=int(config["save_every"]), grace=grace,
                                      poll_every=str(config.get("poll_every", "auto")),
                                      extra=["--memcpy"] if index == 1 else [])
            env = _worker_env()
            record: dict[str, Any] = {"index": index, "interruption": kind, "signal_at": at,
                                      "resumed_from": before[-1][0] if before else 0,
                                      "restored_bytes": restored_bytes}
            started = time.time()
            seen = len([e for e in _read_events(events) if e["kind"] == "launch"])
            log_path = logs / f"{method}-{index}.log"
            rank_dir = fresh_rank_dir(logs / f"ranks-{method}-{index}")
            command = with_rank_logs(command, rank_dir)
            with log_path.open("wb") as log:
                process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                           stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
                with _launch_watched(process, f"{method} launch {index}", log_path, rank_dir):
                    if kind is not None and at is not None:
                        _wait_launch_step(events, seen, at, process, config["timeout_s"])
                        record["signal_t"] = time.time()
                        if kind == "sigterm":
                            os.kill(process.pid, signal.SIGTERM)
                            try:
                                process.wait(timeout=grace)
                            except subprocess.TimeoutExpired:
                                record["cut_by_grace"] = True
                                kill_tree(process.pid)
                        else:
                            kill_tree(process.pid)
                    process.wait(timeout=config["timeout_s"])
            record["returncode"] = process.returncode
            record["seconds"] = time.time() - started
            record["child_private_peak"] = dict(watcher.child_peak)
            after = committed_steps(method, root)
            record["newest_committed"] = after[-1][0] if after else 0
            if kind is None and process.returncode != 0:
                raise LaunchFailed(f"{method} launch {index} failed ({process.returncode})",
                                   log_path, rank_dir)
            launches.append(record)
            _log(f"{method} launch {index}: {kind or 'to the end'} at {at}, from step "
                 f"{record['resumed_from']}, newest complete {record['newest_committed']}, "
                 f"{record['seconds']:.1f} s, exit {process.returncode}")
    finally:
        watcher.stop()
    rank_events = [_read_events(events), _read_events(Path(f"{events}.rank1"))]
    result = {"launches": launches, "commits": watcher.commits,
              **analyse_method(method, rank_events, launches, watcher.commits, config)}
    remove(root)
    if method.startswith("resumekit") and config.get("tight_grace"):
        try:
            tight = run_tight_grace(method, work=work, logs=logs, shape=shape, config=config,
                                    save_s=result["save_total_s_median"],
                                    step_s=result["step_s_alone_median"])
        except TightScenarioNotMet as error:  # the machine's timing, not a fault: no figure
            tight = {"not_held": str(error), "why": str(error), "steps_lost_figure": None}
            remove(work / f"{method}-{TIGHT_GRACE}")
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            tight = failure(error)
            remove(work / f"{method}-{TIGHT_GRACE}")
        result[TIGHT_GRACE] = tight
        result["sigterm_steps_lost_tight_grace"] = tight.get("steps_lost_figure")
        _log(f"{method} {TIGHT_GRACE}: steps lost {tight.get('steps_lost')} (figure "
             f"{tight.get('steps_lost_figure')}; {tight.get('failed') or tight.get('why')})")
    return result


#: Characters kept of each rank's stdout and stderr when a launch fails (its end).
RANK_LOG_TAIL = 6000
#: Characters kept of a failure's text (its first line and its end: the ranks' stderr).
FAILED_TEXT = 6000


def fresh_rank_dir(path: Path) -> Path:
    """An empty directory for one launch's per-rank logs (torchrun ``--log-dir``)."""
    remove(path)
    path.mkdir(parents=True)
    return path


def with_rank_logs(command: Sequence[str], rank_dir: Path) -> list[str]:
    """``command`` (a torchrun) writing each rank's stdout and stderr under ``rank_dir``.

    ``--redirects 3 --tee 3``: the files get everything a rank writes to its descriptors
    (a C++ abort message, :mod:`faulthandler`'s stacks of every thread at a SIGABRT), and
    the launch log still gets it all, each line prefixed with the rank.
    """
    at = list(command).index("--standalone")
    return [*command[:at], "--log-dir", str(rank_dir), "--redirects", "3", "--tee", "3",
            *command[at:]]


def rank_log_tails(rank_dir: Path | None, limit: int = RANK_LOG_TAIL) -> dict[str, str]:
    """``{"rank R attempt A stderr": its last `limit` characters}`` of every rank log there.

    torchrun writes ``<log_dir>/<run_id>/attempt_<A>/<R>/{stdout,stderr}.log`` (and
    ``error.json`` for a rank that raised): each non-empty one is kept, by rank.
    """
    tails: dict[str, str] = {}
    if rank_dir is None or not rank_dir.is_dir():
        return tails
    for path in sorted(rank_dir.glob("*/attempt_*/*/*")):
        if not path.is_file() or path.suffix not in (".log", ".json"):
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if text.strip():
            attempt, rank = path.parent.parent.name, path.parent.name
            tails[f"rank {rank} {attempt.replace('_', ' ')} {path.name}"] = text[-limit:]
    return tails


def dump_worker_stacks(pid: int, rank_dir: Path, timeout: float = 5.0) -> list[int]:
    """Have each worker of the torchrun ``pid`` print its threads' stacks; return their pids.

    Sends :data:`~benchmarks.scale_worker.DUMP_SIGNAL` to torchrun's children (never to
    torchrun, which it would end) and waits, up to ``timeout`` seconds, until each has
    written a stack dump to its stderr under ``rank_dir``: before a hung launch is killed.
    """
    workers = sorted(_children(pid))
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, DUMP_SIGNAL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dumps = sum(text.count("most recent call first")
                    for name, text in rank_log_tails(rank_dir, limit=1 << 20).items()
                    if "stderr" in name)
        if dumps >= sum(map(_running, workers)):  # one that ended meanwhile prints none
            break
        time.sleep(0.1)
    return workers


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not ended, not a zombie awaiting its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> set[int]:
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            children.update(int(child) for child in (task / "children").read_text().split())
    return children


class LaunchFailed(RuntimeError):
    """A launch that had to run to its end exited non-zero; its per-rank logs' tails kept.

    ``str()`` is the first line, then each rank's stderr tail and the launch log's tail;
    :attr:`rank_logs` has every rank log's tail (:func:`rank_log_tails`), which the run's
    ``details`` keep after the bench directory is removed.
    """

    def __init__(self, what: str, log_path: Path, rank_dir: Path | None) -> None:
        self.rank_logs = rank_log_tails(rank_dir)
        try:
            launch_tail = log_path.read_text(errors="replace")[-3000:]
        except OSError:
            launch_tail = ""
        errors = "".join(f"\n--- {name} ---\n{text[-2000:]}"
                         for name, text in self.rank_logs.items() if "stderr" in name)
        # The ranks' stderr last: a failure's text keeps its end (FAILED_TEXT).
        super().__init__(f"{what}; see {log_path} and {rank_dir}\n--- launch log tail ---\n"
                         f"{launch_tail[-1500:]}{errors}")


def failure(error: BaseException) -> dict[str, Any]:
    """A failed method's (or scenario's) ``details`` entry: the text, the rank logs kept.

    The text's first line and, where the error is a :class:`LaunchFailed`, its per-rank
    log tails: the cause of a rank's abort, which the launch log's tail alone may lose.
    """
    text = str(error)
    entry: dict[str, Any] = {"failed": text.splitlines()[0] + "\n...\n" + text[-FAILED_TEXT:]
                             if len(text) > FAILED_TEXT else text}
    if isinstance(error, LaunchFailed):
        entry["rank_logs"] = error.rank_logs
    return entry


class TightScenarioNotMet(RuntimeError):
    """The tight-grace launch never had a step of 3x the save to signal (load, the steps
    allowed): the scenario did not hold, so there is no figure - said, not failed."""


@contextlib.contextmanager
def _launch_watched(process: subprocess.Popen[bytes], what: str, log_path: Path,
                    rank_dir: Path, *, passes: tuple[type[BaseException], ...] = (),
                    dump_timeout: float = 30.0) -> Iterator[None]:
    """Every way out of a watched launch but its end: the tree killed, and what it left.

    A trainer that died (``RuntimeError`` from the waits) or hung (``TimeoutExpired``:
    each rank's stacks dumped first) becomes a :class:`LaunchFailed` keeping its ranks'
    logs; ``passes`` (and any other exception) go on as they are, the tree killed.
    ``dump_timeout``: how long the stacks may take to appear (a hang detector's bound).
    """
    try:
        yield
    except passes:
        kill_tree(process.pid)
        process.wait()
        raise
    except RuntimeError as error:  # the trainer died: keep its ranks' logs
        kill_tree(process.pid)
        process.wait()
        raise LaunchFailed(f"{what}: {error}", log_path, rank_dir) from error
    except subprocess.TimeoutExpired as error:  # hung: where was each rank?
        dump_worker_stacks(process.pid, rank_dir, timeout=dump_timeout)
        kill_tree(process.pid)
        process.wait()
        raise LaunchFailed(f"{what} hung: {error} (each rank's stacks at the timeout "
                           "below)", log_path, rank_dir) from error
    except BaseException:
        kill_tree(process.pid)
        process.wait()
        raise


def _worker_command(method: str, root: Path, events: Path, shape: Shape, *, batch: int,
                    steps: int, save_every: int, grace: float, poll_every: str = "auto",
                    extra: Sequence[str] = ()) -> list[str]:
    """torchrun of :mod:`benchmarks.scale_worker` on :data:`RANKS` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={RANKS}", f"--shutdown-timeout={int(grace) + 120}",
            "-m", "benchmarks.scale_worker", "--method", method, "--root", str(root),
            "--events", str(events), "--layers", str(shape.layers),
            "--width", str(shape.width), "--batch", str(batch), "--steps", str(steps),
            "--save-every", str(save_every), "--grace", str(grace),
            "--poll-every", poll_every, *extra]


def _worker_env() -> dict[str, str]:
    return {**os.environ, **MALLOC_KEEP, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


# ------------------------------------------------------------------------ tight grace


def run_tight_grace(method: str, *, work: Path, logs: Path, shape: Shape,
                    config: Mapping[str, Any], save_s: float | None,
                    step_s: float | None) -> dict[str, Any]:
    """A SIGTERM mid-step with a grace window of 1.3x the save, steps of 3x it (issue 38).

    ``save_s`` is the method's save time measured by its schedule (the median interval
    save, call to committed) and ``step_s`` its step at the schedule's batch. One launch
    from an empty root trains with a batch that makes a step take at least
    :data:`TIGHT_STEP_FACTOR` x ``save_s`` (started from ``step_s``, grown by the worker
    after any shorter step: real compute, :class:`benchmarks.scale_worker.BatchGrowth`),
    saving every :data:`TIGHT_SAVE_EVERY` steps, with ``grace_period`` =
    :data:`TIGHT_GRACE_FACTOR` x ``save_s``. Once an interval save is committed and a
    step that is not a ``save_every`` step took that long and the next started with the
    same batch, SIGTERM goes to the launch half that measured step after the next one's
    ``step_begin``; the tree is
    SIGKILLed when the grace window runs out. :func:`analyse_tight_grace` gives the
    figure.
    """
    if not save_s:
        return {"failed": "no interval save measured by the schedule: no save time to "
                          "size the grace window and the step from"}
    root = work / f"{method}-{TIGHT_GRACE}"
    logs.mkdir(parents=True, exist_ok=True)
    events = logs / f"events-{method}-{TIGHT_GRACE}.jsonl"
    remove(events)
    for extra in logs.glob(f"events-{method}-{TIGHT_GRACE}.jsonl.rank*"):
        remove(extra)
    grace = TIGHT_GRACE_FACTOR * save_s
    wanted = TIGHT_STEP_FACTOR * save_s
    batch = int(config["batch"])
    if step_s:  # the schedule's step at its batch, scaled (the worker grows it if short)
        batch = max(batch, math.ceil(batch * TIGHT_STEP_AIM * wanted / step_s))
    record: dict[str, Any] = {
        "save_s": save_s, "grace_s": grace, "step_s_wanted": wanted,
        "step_s_at_schedule_batch": step_s, "schedule_batch": config["batch"],
        "batch_start": batch, "save_every": TIGHT_SAVE_EVERY, "max_steps": TIGHT_MAX_STEPS,
        "capture_at_signal": _capture_default()}
    command = _worker_command(method, root, events, shape, batch=batch,
                              steps=TIGHT_MAX_STEPS, save_every=TIGHT_SAVE_EVERY, grace=grace,
                              poll_every=str(config.get("poll_every", "auto")),
                              extra=["--min-step-s", str(TIGHT_STEP_AIM * wanted)])
    timeout = float(config["timeout_s"])
    rank_dir = fresh_rank_dir(logs / f"ranks-{method}-{TIGHT_GRACE}")
    command = with_rank_logs(command, rank_dir)
    watcher = Watcher(method, root, events).start()
    log_path = logs / f"{method}-{TIGHT_GRACE}.log"
    started = time.time()
    try:
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                       stderr=subprocess.STDOUT, env=_worker_env(),
                                       start_new_session=True)
            with _launch_watched(process, f"{method} {TIGHT_GRACE}", log_path, rank_dir,
                                 passes=(TightScenarioNotMet,)):
                measured, measured_s, next_begin = _wait_tight_step(
                    events, process, wanted, timeout,
                    lambda: bool(committed_steps(method, root)))
                record["measured_step"] = measured
                delay = next_begin + 0.5 * measured_s - time.time()
                if delay > 0:
                    time.sleep(delay)  # the signal's moment within the step, not a wait-and-hope
                record["signal_t"] = time.time()
                at_signal = committed_steps(method, root)
                record["newest_committed_at_signal"] = at_signal[-1][0] if at_signal else 0
                os.kill(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    record["cut_by_grace"] = True
                    kill_tree(process.pid)
                process.wait(timeout=timeout)
    finally:
        watcher.stop()
    record["returncode"] = process.returncode
    record["seconds"] = time.time() - started
    record["cut_by_grace"] = bool(record.get("cut_by_grace"))
    after = committed_steps(method, root)
    record["newest_committed"] = after[-1][0] if after else 0
    rank_events = [_read_events(events), _read_events(Path(f"{events}.rank1"))]
    remove(root)
    return {**record, "commits": watcher.commits,
            **analyse_tight_grace(rank_events, record, watcher.commits)}


def _capture_default() -> bool | None:
    """``CheckpointOptions``' default ``capture_at_signal`` (what the worker runs with)."""
    from resumekit.options import CheckpointOptions  # noqa: PLC0415

    field = CheckpointOptions.model_fields.get("capture_at_signal")
    return None if field is None else bool(field.default)


def _launch_steps(events: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last launch's steps: ``{step: {"begin", "end" (None if unfinished), "batch"}}``."""
    launches = goodput.launches_of(list(events))
    steps: dict[int, dict[str, Any]] = {}
    for event in launches[-1] if launches else []:
        if event["kind"] == "step_begin":
            steps[int(event["step"])] = {"begin": event["t"], "end": None,
                                         "batch": event.get("batch")}
        elif event["kind"] == "step" and int(event["step"]) in steps:
            steps[int(event["step"])]["end"] = event["t"]
    return steps


def tight_step_to_signal(events: Sequence[dict[str, Any]], wanted: float,
                         every: int = TIGHT_SAVE_EVERY,
                         after: int = 0) -> tuple[int, float, float] | None:
    """``(step, its seconds, the next step's begin)`` to time the SIGTERM by, or None yet.

    The first step after ``after`` (rank 0's events) that is not its launch's first, not
    a ``save_every`` step (the step before the signal then has no interval save of its
    own), took ``wanted`` seconds or more, and whose next step has begun with the same
    batch (so the signalled step is as long).
    """
    steps = _launch_steps(events)
    first = min(steps, default=None)
    for step in sorted(steps):
        span, following = steps[step], steps.get(step + 1)
        if (step <= after or step == first or step % every == 0 or span["end"] is None
                or following is None):
            continue
        seconds = span["end"] - span["begin"]
        if seconds >= wanted and following["batch"] == span["batch"]:
            return step, seconds, following["begin"]
    return None


def _wait_tight_step(events: Path, process: subprocess.Popen[bytes], wanted: float,
                     timeout: float, committed: Callable[[], bool]
                     ) -> tuple[int, float, float]:
    """:func:`tight_step_to_signal` once it finds a step and an interval save is committed
    (else a later step)."""
    deadline = time.monotonic() + timeout
    after = 0
    while True:
        found = tight_step_to_signal(_read_events(events), wanted, after=after)
        if found is not None:
            if committed():
                return found
            after = found[0]
        if process.poll() not in (None, 0):  # a crash is a failure, never "not held"
            raise RuntimeError(
                f"the tight-grace trainer exited ({process.returncode}) before a step of "
                f"{wanted:.2f} s (3x the save) was measured")
        if process.poll() is not None:
            raise TightScenarioNotMet(
                f"the tight-grace trainer exited ({process.returncode}) before a step of "
                f"{wanted:.2f} s (3x the save) was measured in {TIGHT_MAX_STEPS} steps")
        if time.monotonic() > deadline:
            raise TightScenarioNotMet(
                f"no step of {wanted:.2f} s (3x the save) within {timeout:.0f} s")
        time.sleep(0.05)


def analyse_tight_grace(rank_events: Sequence[Sequence[dict[str, Any]]],
                        record: Mapping[str, Any],
                        commits: Mapping[int, Any]) -> dict[str, Any]:
    """The tight-grace launch's figure: completed steps lost, and what it rests on.

    ``steps_lost`` = the last step every rank had completed when the SIGTERM was sent
    minus the newest committed step after the launch (at least 0). ``steps_lost_figure``
    is that number when the scenario held - the measured step (the one the signal was
    timed by) took :data:`TIGHT_STEP_FACTOR` x the save time or more and the signal fell
    inside a step - else None, with ``why``.
    """
    signal_t = float(record["signal_t"])
    save_s = float(record["save_s"])
    per_rank = [_launch_steps(events) for events in rank_events if events]
    completed = [max((step for step, span in steps.items()
                      if span["end"] is not None and span["end"] <= signal_t), default=0)
                 for steps in per_rank]
    last = min(completed, default=0)
    steps0 = per_rank[0] if per_rank else {}
    measured = record.get("measured_step")
    span = steps0.get(measured) if measured is not None else None
    measured_s = span["end"] - span["begin"] if span and span["end"] is not None else None
    begun = [step for step, s in steps0.items() if s["begin"] <= signal_t]
    signalled = max(begun, default=None)
    within = None
    mid_step = False
    signalled_s = None
    if signalled is not None:
        current = steps0[signalled]
        within = signal_t - current["begin"]
        mid_step = current["end"] is None or current["end"] > signal_t
        signalled_s = None if current["end"] is None else current["end"] - current["begin"]
    newest = int(record["newest_committed"])
    lost = max(0, last - newest)
    after_signal = sorted(step for step, seen in commits.items() if seen["t"] >= signal_t)
    step_vs_save = measured_s / save_s if measured_s is not None and save_s else None
    why = []
    if step_vs_save is None or step_vs_save < TIGHT_STEP_FACTOR:
        why.append(f"the measured step was not {TIGHT_STEP_FACTOR:g}x the save "
                   f"({step_vs_save})")
    if not mid_step:
        why.append("the signal fell after the step it was timed for had ended")
    return {
        "last_completed_at_signal": last, "last_completed_per_rank": completed,
        "steps_lost": lost, "steps_lost_figure": None if why else lost,
        "why": "; ".join(why) or "the scenario held: step >= "
                                 f"{TIGHT_STEP_FACTOR:g}x the save, signal mid-step",
        "measured_step_s": measured_s, "step_vs_save": step_vs_save,
        "grace_vs_save": float(record["grace_s"]) / save_s if save_s else None,
        "signalled_step": signalled, "signal_into_step_s": within,
        "signal_into_step_vs_measured": (within / measured_s
                                         if within is not None and measured_s else None),
        "signal_mid_step": mid_step, "signalled_step_s": signalled_s,
        "committed_after_signal": after_signal,
        "first_commit_after_signal_s": (commits[after_signal[0]]["t"] - signal_t
                                        if after_signal else None),
        "batches": {step: s["batch"] for step, s in sorted(steps0.items())},
    }


def _wait_launch_step(events: Path, seen: int, step: int, process: subprocess.Popen[bytes],
                      timeout: float) -> None:
    """Wait until this launch (the ``seen``-th ``launch`` event on) logged ``step``."""
    deadline = time.monotonic() + timeout
    while True:
        records = _read_events(events)
        launch_at = [i for i, e in enumerate(records) if e["kind"] == "launch"]
        if len(launch_at) > seen and any(
                e["kind"] == "step" and e["step"] >= step for e in records[launch_at[seen]:]):
            return
        if process.poll() is not None:
            raise RuntimeError(f"the trainer exited ({process.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"step {step} not reached within {timeout:.0f} s")
        time.sleep(0.05)


# ------------------------------------------------------------------------ analysis


def _spans(launch: Sequence[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """``blocked_begin``/``blocked_end`` pairs of ``what`` (one level: they do not nest
    for a save)."""
    spans, open_at = [], None
    for event in launch:
        if event["kind"] == "blocked_begin" and event.get("what") == what:
            open_at = event
        elif event["kind"] == "blocked_end" and event.get("what") == what and open_at:
            spans.append({"step": open_at.get("step"), "begin": open_at["t"],
                          "end": event["t"]})
            open_at = None
    return spans


def checkpoint_memory(segments: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The memory a rank's checkpointing needs at its most, from its ``memory`` events.

    The worker (:class:`benchmarks.scale_worker.Memory`) cuts each launch into segments:
    ``training`` (a step), ``checkpoint`` (a call into the method: building it, a fresh
    launch's restore, ``step_end`` with the saves it makes, ``close``) and ``restore``.
    What checkpointing *holds* grows by what a checkpoint segment leaves allocated
    (malloc's live bytes, ``mallinfo2``, plus mapped shared memory) and shrinks by what
    a training segment gives back (a background save's buffers freed by its thread); on
    top of it, each checkpoint segment may *raise* the resident set for a while (its peak
    above its starting RSS, less what it left held). The figure is the most of held +
    raised over the segments.

    Why not the launch's high-water mark above a step's: the bench runs with
    :data:`MALLOC_KEEP`, so the process keeps every freed block, its RSS only ever grows,
    and the heap's fragmentation adds to it step after step whether or not anything is
    saved; and memory a save allocates from blocks a step freed adds nothing to the RSS
    while it is still the save's.

    Returns:
        ``extra_bytes`` (the figure), ``held_bytes`` (the most held at once) and
        ``raised_bytes`` (the largest rise above what was held), or None without events.
    """
    if not segments:
        return None
    held = held_most = extra = raised = 0
    for segment in segments:
        if segment.get("live_begin") is None or segment.get("live_end") is None:
            allocated = segment["rss_end"] - segment["rss_begin"]  # no mallinfo2: the RSS
        else:
            allocated = segment["live_end"] - segment["live_begin"]
        allocated += segment.get("shmem_end", 0) - segment.get("shmem_begin", 0)
        if segment["part"] == "checkpoint":
            held = max(0, held + allocated)
            held_most = max(held_most, held)
            rise = max(0, segment["peak"] - segment["rss_begin"] - max(0, allocated))
            raised = max(raised, rise)
            extra = max(extra, held + rise)
        elif segment["part"] == "training" and allocated < 0:
            held = max(0, held + allocated)
    return {"extra_bytes": extra, "held_bytes": held_most, "raised_bytes": raised}


def analyse_method(method: str, rank_events: Sequence[Sequence[dict[str, Any]]],
                   launches: Sequence[Mapping[str, Any]], commits: Mapping[int, Any],
                   config: Mapping[str, Any]) -> dict[str, Any]:
    """Every figure of one method from its events, launches and seen commits."""
    bandwidth = float(config["bandwidth"])
    every = int(config["save_every"])
    rank0 = rank_events[0]
    per_launch = goodput.launches_of(rank0)
    figures: dict[str, Any] = {}
    figures["goodput"] = goodput.analyse(rank0, int(config["steps"]), rank_events[1:])
    memcpy = [e["seconds"] for e in rank0 if e["kind"] == "memcpy"]
    figures["memcpy_s"] = memcpy[0] if memcpy else None
    saves, windows = [], []
    for launch in per_launch:
        for span in _spans(launch, "save"):
            step = span["step"]
            if step is None or step % every:
                continue  # an emergency save: reported with its SIGTERM
            committed = commits.get(step)
            total = committed["t"] - span["begin"] if committed else None
            saves.append({"step": step, "blocked_s": span["end"] - span["begin"],
                          "total_s": total,
                          "bytes": committed["bytes"] if committed else None})
            windows.append((span["begin"], span["end"],
                            committed["t"] if committed else span["end"]))
    figures["interval_saves"] = saves
    blocked = [s["blocked_s"] for s in saves]
    totals = [s["total_s"] for s in saves if s["total_s"] is not None]
    figures["save_blocked_s_median"] = median(blocked) if blocked else None
    figures["save_total_s_median"] = median(totals) if totals else None
    achieved = [(s["bytes"] / bandwidth) / s["total_s"] for s in saves
                if s["total_s"] and s["bytes"]]
    figures["save_vs_bandwidth"] = median(achieved) if achieved else None
    figures["block_vs_memcpy"] = (figures["save_blocked_s_median"] / figures["memcpy_s"]
                                  if blocked and figures["memcpy_s"] else None)
    # Steps: compute only (step_begin -> step), never the first of a launch (warm-up).
    during, alone = [], []
    for launch in per_launch:
        begins = {e["step"]: e["t"] for e in launch if e["kind"] == "step_begin"}
        first = min(begins) if begins else None
        for event in launch:
            if event["kind"] != "step" or event["step"] == first:
                continue
            begin, end = begins.get(event["step"]), event["t"]
            if begin is None:
                continue
            length = end - begin
            overlap_bg = max((max(0.0, min(end, done) - max(begin, returned))
                              for _, returned, done in windows), default=0.0)
            overlap_any = max((max(0.0, min(end, done) - max(begin, called))
                               for called, _, done in windows), default=0.0)
            if overlap_bg >= 0.5 * length:
                during.append(length)
            elif overlap_any == 0.0:
                alone.append(length)
    figures["step_s_alone_median"] = median(alone) if alone else None
    figures["step_s_during_save_median"] = median(during) if during else None
    figures["steps_counted"] = {"alone": len(alone), "during_save": len(during)}
    figures["step_slowdown_during_save"] = (median(during) / median(alone)
                                            if during and alone else None)
    # Restores (cold), slowest rank's entry to the end.
    restores = []
    for number in range(len(per_launch)):
        info = launches[number] if number < len(launches) else {}
        if not info.get("resumed_from"):
            continue
        begins = [next((e["t"] for e in rank_launch if e["kind"] == "restore_begin"), None)
                  for rank_launch in (goodput.launches_of(events)[number] if number < len(
                      goodput.launches_of(events)) else [] for events in rank_events)]
        ends = [next((e["t"] for e in rank_launch if e["kind"] == "restore_end"), None)
                for rank_launch in (goodput.launches_of(events)[number] if number < len(
                    goodput.launches_of(events)) else [] for events in rank_events)]
        if None in begins or None in ends or not begins:
            continue
        seconds = max(ends) - max(begins)
        restores.append({"launch": number + 1, "seconds": seconds,
                         "bytes": info["restored_bytes"],
                         "vs_bandwidth": (info["restored_bytes"] / bandwidth) / seconds})
    figures["restores"] = restores
    figures["restore_vs_bandwidth"] = (median([r["vs_bandwidth"] for r in restores])
                                       if restores else None)
    # Interruptions: what each cost.
    interruptions = []
    for number, info in enumerate(launches):
        if info.get("interruption") is None:
            continue
        launch = per_launch[number] if number < len(per_launch) else []
        last = max((e["step"] for e in launch if e["kind"] == "step"), default=0)
        entry = {"launch": number + 1, "kind": info["interruption"],
                 "signal_at": info["signal_at"], "last_step_trained": last,
                 "newest_complete_after": info["newest_committed"],
                 "steps_lost": max(0, last - info["newest_committed"]),
                 "cut_by_grace": bool(info.get("cut_by_grace"))}
        if info["interruption"] == "sigterm":
            committed = commits.get(info["newest_committed"])
            if committed and committed["t"] >= info["signal_t"]:
                entry["emergency_save_s"] = committed["t"] - info["signal_t"]
                entry["emergency_save_vs_grace"] = entry["emergency_save_s"] / float(
                    config["grace_s"])
                entry["emergency_bytes"] = committed["bytes"]
        interruptions.append(entry)
    figures["interruptions"] = interruptions
    sigterms = [i for i in interruptions if i["kind"] == "sigterm"]
    figures["sigterm_steps_lost"] = max((i["steps_lost"] for i in sigterms), default=None)
    emergency = [i["emergency_save_vs_grace"] for i in sigterms
                 if "emergency_save_vs_grace" in i]
    figures["emergency_save_vs_grace"] = max(emergency) if emergency else None
    # The method's own memory per rank (checkpoint_memory), from the first launch that
    # has it on every rank; beside it the launch's peak above a step's (the figure before).
    figures["peak_extra"] = None
    figures["peak_extra_launch"] = None
    for number, info in enumerate(launches):
        per_rank, whole = [], []
        for rank, events in enumerate(rank_events):
            rank_launches = goodput.launches_of(events)
            if number >= len(rank_launches):
                break
            launch = rank_launches[number]
            base = next((e for e in launch if e["kind"] == "baseline"), None)
            end = next((e for e in launch if e["kind"] == "exit"), None)
            if base is None or end is None:
                break
            children = int(info.get("child_private_peak", {}).get(rank, 0))
            state = base["state_bytes"]
            whole_extra = max(0, end["hwm"] - base["hwm"]) + children
            whole.append({"rank": rank, "extra_bytes": whole_extra,
                          "vs_state": whole_extra / state})
            own = checkpoint_memory([e for e in launch if e["kind"] == "memory"])
            if own is None:
                break
            extra = own["extra_bytes"] + children
            per_rank.append({"rank": rank, **own, "extra_bytes": extra,
                             "children_bytes": children, "state_bytes": state,
                             "exact": base["exact"], "vs_state": extra / state})
        if len(whole) == len(rank_events) and figures["peak_extra_launch"] is None:
            figures["peak_extra_launch"] = {"launch": number + 1, "ranks": whole,
                                            "vs_state": max(r["vs_state"] for r in whole)}
        if len(per_rank) == len(rank_events):
            figures["peak_extra"] = {"launch": number + 1, "ranks": per_rank,
                                     "vs_state": max(r["vs_state"] for r in per_rank)}
            break
    return figures


def _designated_async(details: Mapping[str, Any]) -> str | None:
    for name in ("resumekit_async_process", "resumekit_async_thread"):
        if isinstance(details.get(name), dict) and "goodput" in details[name]:
            return name
    return None


def summarise(details: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The summary figures and, for each, the method(s) it came from."""
    ran = {name: value for name, value in details.items()
           if isinstance(value, dict) and "goodput" in value}
    best_async = _designated_async(details)
    rk_async = ran.get(best_async or "", {})
    rk_sync = ran.get("resumekit_sync", {})

    def get(figures: Mapping[str, Any], *path: str) -> Any:
        value: Any = figures
        for key in path:
            if not isinstance(value, Mapping) or value.get(key) is None:
                return None
            value = value[key]
        return value

    dcp_goodputs = [get(ran[name], "goodput", "goodput")
                    for name in ("dcp_async_thread", "dcp_async_process") if name in ran]
    dcp_best = max((g for g in dcp_goodputs if g is not None), default=None)
    rk_goodput = get(rk_async, "goodput", "goodput")
    lost = [get(ran[name], "sigterm_steps_lost") for name in ran if name.startswith("resumekit")]
    lost = [value for value in lost if value is not None]
    tight = [get(ran[name], "sigterm_steps_lost_tight_grace") for name in ran
             if name.startswith("resumekit")]
    tight = [value for value in tight if value is not None]
    sync_total = get(rk_sync, "save_total_s_median")
    async_total = get(rk_async, "save_total_s_median")
    summary = {
        "scale_async_block_vs_memcpy": get(rk_async, "block_vs_memcpy"),
        "scale_step_slowdown_during_save": get(rk_async, "step_slowdown_during_save"),
        "scale_save_vs_bandwidth": get(rk_sync, "save_vs_bandwidth"),
        "scale_restore_vs_bandwidth": get(rk_sync, "restore_vs_bandwidth"),
        "scale_sigterm_steps_lost": max(lost) if lost else None,
        "scale_sigterm_steps_lost_tight_grace": max(tight) if tight else None,
        "scale_goodput": rk_goodput,
        "scale_goodput_vs_dcp_async": (rk_goodput / dcp_best
                                       if rk_goodput is not None and dcp_best else None),
        "scale_peak_rss_async_vs_state": get(rk_async, "peak_extra", "vs_state"),
        "scale_peak_rss_sync_vs_state": get(rk_sync, "peak_extra", "vs_state"),
        "scale_async_total_vs_sync": (async_total / sync_total
                                      if async_total and sync_total else None),
        "scale_emergency_save_vs_grace": max(
            (v for v in (get(ran[name], "emergency_save_vs_grace") for name in ran
                         if name.startswith("resumekit")) if v is not None), default=None),
        "scale_step_slowdown_local_every_step": get(details.get(LOCAL_EVERY_STEP) or {},
                                                    "ratio"),
    }
    sources = {key: ("resumekit_sync" if key in (
        "scale_save_vs_bandwidth", "scale_restore_vs_bandwidth",
        "scale_peak_rss_sync_vs_state") else best_async) for key in summary}
    sources["scale_sigterm_steps_lost"] = "every resumekit method (the most)"
    sources["scale_emergency_save_vs_grace"] = "every resumekit method (the most)"
    sources["scale_sigterm_steps_lost_tight_grace"] = (
        f"every resumekit method (the most): its {TIGHT_GRACE} launch, SIGTERM half a "
        f"step into a step of >= {TIGHT_STEP_FACTOR:g}x its measured save, grace "
        f"{TIGHT_GRACE_FACTOR:g}x the save")
    sources["scale_goodput_vs_dcp_async"] = f"{best_async} / better of dcp_async_*"
    sources["scale_async_total_vs_sync"] = f"{best_async} / resumekit_sync"
    sources["scale_step_slowdown_local_every_step"] = (
        f"{LOCAL_EVERY_STEP} (benchmarks.scale_local): local tier, save_every=1 / no "
        "checkpointing")
    return summary, sources


def meets(key: str, value: float | None) -> bool | None:
    """Whether ``value`` meets the goal of ``key`` (None: not measured, or no goal)."""
    goal = TARGETS[key]
    if value is None or goal["target"] is None:
        return None
    return bool(value >= goal["target"] if goal["better"] == "higher"
                else value <= goal["target"])


def markdown(results: Mapping[str, Any]) -> str:
    """The summary as a markdown table with each goal and its verdict."""
    lines = ["| figure | value | goal | verdict |", "|---|---|---|---|"]
    for key, value in results["summary"].items():
        goal = TARGETS[key]
        sign = ">=" if goal["better"] == "higher" else "<="
        verdict = {True: "meets", False: "**misses**", None: "not measured"}[meets(key, value)]
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"| `{key}` | {shown} | {sign} {goal['target']} | {verdict} |")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> bool:
    """Per method: goodput, save blocking and total time, restore time, peak memory."""
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    details = {name: value for name, value in results["details"].items()
               if isinstance(value, dict) and "goodput" in value}
    names = list(details)
    colours = ["tab:green" if name.startswith("resumekit") else "tab:gray" for name in names]
    figure, grid = plt.subplots(2, 2, figsize=(12, 8))

    def bars(axis: Any, values: list[float | None], title: str, unit: str) -> None:
        axis.bar(range(len(names)), [v or 0.0 for v in values], color=colours)
        axis.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.set_ylabel(unit)

    bars(grid[0][0], [d["goodput"].get("goodput") for d in details.values()],
         "goodput over the preemption schedule", "useful / wall")
    grid[0][0].axhline(0.98, color="tab:red", linestyle="--", label="goal 0.98")
    grid[0][0].legend(fontsize=8)
    axis = grid[0][1]
    xs = range(len(names))
    axis.bar([x - 0.2 for x in xs], [d.get("save_blocked_s_median") or 0 for d in
                                     details.values()], width=0.4, label="blocks training")
    axis.bar([x + 0.2 for x in xs], [d.get("save_total_s_median") or 0 for d in
                                     details.values()], width=0.4, label="call to complete")
    ideal = results["config"].get("ideal_save_s")
    if ideal:
        axis.axhline(ideal, color="tab:red", linestyle="--", label="bytes / bandwidth")
    axis.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    axis.set_title("interval save (median)", fontsize=10)
    axis.set_ylabel("s")
    axis.legend(fontsize=8)
    bars(grid[1][0], [d.get("restore_vs_bandwidth") for d in details.values()],
         "restore: fraction of the stand-in's bandwidth", "ratio")
    bars(grid[1][1], [(d.get("peak_extra") or {}).get("vs_state") for d in details.values()],
         "host memory the method holds + raises / state (per rank, max)", "ratio")
    config = results["config"]
    figure.suptitle(f"scale: 2 ranks x {config['state_bytes_per_rank'] / GB:.2f} GB (FSDP2, "
                    f"AdamW fp32) on a {config['bandwidth'] / MB:.0f} MB/s NAS stand-in, "
                    f"grace {config['grace_s']:.0f} s", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _median_or_none(values: Sequence[Any]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return median(present) if present else None


def _dig(value: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def combine(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one: each summary figure's and method figure's median.

    The summary keeps the single run's keys (their median over the runs that measured
    them); ``summary_runs`` lists each run's value, ``method_medians`` each method's
    figures (median and per run), ``runs`` each run whole (load averages included).
    """
    if not runs:
        raise ValueError("combine needs at least one run")
    keys = list(runs[0]["summary"])
    summary = {key: _median_or_none([run["summary"].get(key) for run in runs])
               for key in keys}
    methods = [name for name in runs[0]["details"]
               if isinstance(runs[0]["details"][name], dict)
               and "goodput" in runs[0]["details"][name]]
    method_medians: dict[str, Any] = {}
    plotted: dict[str, Any] = {}
    for name in methods:
        figures = {}
        for figure, path in METHOD_FIGURES.items():
            values = [_dig(run["details"].get(name), path) for run in runs]
            figures[figure] = {"median": _median_or_none(values), "runs": values}
        method_medians[name] = figures
        plotted[name] = {
            "goodput": {"goodput": figures["goodput"]["median"]},
            "peak_extra": {"vs_state": figures["peak_extra_vs_state"]["median"]},
            **{figure: figures[figure]["median"] for figure in (
                "save_blocked_s_median", "save_total_s_median", "restore_vs_bandwidth")}}
    return {
        "summary": summary,
        "goals": {key: {**TARGETS[key], "value": value, "meets": meets(key, value)}
                  for key, value in summary.items()},
        "median_of": len(runs),
        "summary_runs": {key: [run["summary"].get(key) for run in runs] for key in keys},
        "summary_sources": runs[0].get("summary_sources"),
        "method_medians": method_medians,
        "config": runs[0]["config"],
        "notes": runs[0].get("notes", {}),
        "details": plotted,
        "runs": [{"when": run.get("when"), "seconds": run.get("seconds"),
                  "load_average_at_start": _dig(run, ("machine", "load_average_at_start")),
                  "load_average_at_end": _dig(run, ("machine", "load_average_at_end")),
                  "stand_in_measured": _dig(run, ("config", "stand_in_measured")),
                  "stand_in_host_reference": _dig(run, ("config",
                                                        "stand_in_host_reference")),
                  "summary": run["summary"], "details": run["details"],
                  "machine": run.get("machine")} for run in runs],
        "when": runs[-1].get("when"),
        "seconds": sum(float(run.get("seconds") or 0.0) for run in runs),
    }


# ------------------------------------------------------------------------ main


def _parse_schedule(text: str) -> list[tuple[int, str]]:
    plan = []
    for item in text.split(","):
        step, kind = item.split(":")
        if kind not in ("sigterm", "sigkill"):
            raise argparse.ArgumentTypeError(f"{kind!r}: sigterm or sigkill")
        plan.append((int(step), kind))
    return plan


def main(argv: Sequence[str] | None = None,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the scale benchmark; return (and write) its results."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--state-gb", type=float, default=2.0,
                        help="training state per rank, GB (model shard + AdamW, fp32)")
    parser.add_argument("--bandwidth-mbs", type=float, default=400.0,
                        help="the stand-in's bandwidth, MB/s, reads and writes, shared")
    parser.add_argument("--grace-s", type=float, default=None,
                        help="grace window after SIGTERM (default: 3x the state's time at "
                             "the bandwidth, + 10 s)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--schedule", type=_parse_schedule,
                        default=_parse_schedule("4:sigterm,5:sigkill"),
                        help="STEP:sigterm|sigkill,... (one launch each, then one to the end)")
    parser.add_argument("--batch", type=int, default=16,
                        help="rows per step (sets the step's compute)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--bench-dir", type=Path, default=None,
                        help="where the stand-in's backing file and mount go (default: a "
                             "temporary directory)")
    parser.add_argument("--no-stand-in", action="store_true",
                        help="write to a plain directory (no root needed); the bandwidth "
                             "figures are then relative to --bandwidth-mbs, not a bound")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep the launches' logs and events here (default: removed "
                             "with the bench directory)")
    parser.add_argument("--local-rounds", type=int, default=3,
                        help="rounds of the local tier at save_every=1 against no "
                             "checkpointing (each: a block of each; 0: not measured)")
    parser.add_argument("--local-block", type=int, default=3, help="steps per such block")
    parser.add_argument("--no-tight-grace", action="store_true",
                        help="leave out each resumekit method's tight-grace SIGTERM launch "
                             "(scale_sigterm_steps_lost_tight_grace)")
    parser.add_argument("--poll-every", default="auto",
                        help="the resumekit methods' PreemptionHandler(poll_every=...): 'auto' "
                             "(resumekit's default; at full size a vote every step) or N; "
                             "the smoke run's millisecond steps vote every step, so a SIGTERM "
                             "launch stops a step or two after the signal, as at full size")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: combine these runs' scale.json into one whose "
                             "summary is each figure's median (written to --out)")
    args = parser.parse_args(argv)
    if args.combine is not None:
        combined = combine([json.loads(path.read_text()) for path in args.combine])
        write_results(combined, args.out)
        return combined
    log = progress or _log
    state_per_rank = int(args.state_gb * GB)
    shape = shape_for(state_per_rank * RANKS)
    bandwidth = args.bandwidth_mbs * MB
    ideal = shape.state_bytes / bandwidth  # both ranks' checkpoint at the shared bandwidth
    grace = args.grace_s if args.grace_s is not None else 3 * ideal + 10
    config: dict[str, Any] = {
        "ranks": RANKS, "parallelism": "FSDP2 fully_shard per layer, gloo, CPU",
        "shape": {"layers": shape.layers, "width": shape.width,
                  "state_bytes": shape.state_bytes},
        "state_bytes_per_rank": shape.state_bytes // RANKS, "bandwidth": bandwidth,
        "grace_s": grace, "steps": args.steps, "save_every": args.save_every,
        "schedule": args.schedule, "batch": args.batch, "methods": args.methods,
        "ideal_save_s": ideal, "timeout_s": args.timeout_s, "stand_in": not args.no_stand_in,
        "local_rounds": args.local_rounds, "local_block": args.local_block,
        "tight_grace": not args.no_tight_grace, "poll_every": args.poll_every,
        "tight_grace_factor": TIGHT_GRACE_FACTOR, "tight_step_factor": TIGHT_STEP_FACTOR,
    }
    notes: dict[str, str] = {}
    methods = list(args.methods)
    if "resumekit_async_process" in methods and not process_writer_available():
        methods.remove("resumekit_async_process")
        notes["resumekit_async_process"] = (
            "not available: this resumekit has no async_writer option (issue 27 part 2)")
    bench_dir = Path(tempfile.mkdtemp(prefix="resumekit-scale-", dir=args.bench_dir))
    details: dict[str, Any] = {name: {"skipped": why} for name, why in notes.items()}
    facts = machine_facts(bench_dir)
    logs = args.logs if args.logs is not None else bench_dir / "logs"
    began = time.monotonic()
    try:
        if args.no_stand_in:
            work = bench_dir / "plain"
            work.mkdir()
            config["stand_in_measured"] = None
            config["stand_in_host_reference"] = None
            notes["stand_in"] = "--no-stand-in: a plain directory, no bandwidth bound"
            details.update(_run_all(methods, work, logs, shape, config, log))
            details.update(_run_local(work, bench_dir, logs, shape, config, log))
        else:
            size = int(shape.state_bytes * (KEEP + 2) * 1.25) + GB
            with nas.NasStandIn(bench_dir, size, bandwidth) as stand_in:
                measured = stand_in.verify(min(512 * MB, max(64 * MB, shape.state_bytes // 4)))
                config["stand_in_measured"] = measured
                config["stand_in_host_reference"] = stand_in.host_reference
                config["stand_in"] = {"kind": f"loop-device ext4, cgroup {stand_in.kind} "
                                              "throttle", "size_bytes": size,
                                      "device": stand_in.majmin}
                log("stand-in: " + ", ".join(f"{k} {v / MB:.0f} MB/s"
                                             for k, v in measured.items())
                    + "; outside it: " + ", ".join(
                        f"{k} {v / MB:.0f} MB/s" for k, v in stand_in.host_reference.items()))
                details.update(_run_all(methods, stand_in.mount, logs, shape,
                                        config, log))
                details.update(_run_local(stand_in.mount, bench_dir, logs, shape, config,
                                          log))
    finally:
        remove(bench_dir)
    summary, sources = summarise(details)
    results = {
        "summary": summary,
        "goals": {key: {**TARGETS[key], "value": value, "meets": meets(key, value)}
                  for key, value in summary.items()},
        "summary_sources": sources,
        "config": config, "notes": notes, "details": details,
        "machine": {**facts, "load_average_at_end": list(os.getloadavg()),
                    "bench_dir_removed": not bench_dir.exists()},
        "seconds": time.monotonic() - began,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_results(results, args.out)
    return results


def write_results(results: Mapping[str, Any], out: Path) -> None:
    """``scale.json`` and ``scale.png`` under ``out``; the summary table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot(results, out / "scale.png")
    print(markdown(results))


def _run_all(methods: Sequence[str], work: Path, logs: Path, shape: Shape,
             config: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    details = {}
    for method in methods:
        log(f"{method}: schedule {config['schedule']}, {config['steps']} steps")
        try:
            details[method] = run_method(method, work=work, logs=logs, shape=shape,
                                         config=config)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            # One method's failure (a trainer killed by the OOM killer, a timeout) is that
            # method's result: the others still run, and the run still writes its JSON.
            details[method] = failure(error)
            log(f"{method} failed: {str(error).splitlines()[0]}")
            remove(work / method)
    return details


def _run_local(work: Path, bench_dir: Path, logs: Path, shape: Shape,
               config: Mapping[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The local tier at ``save_every=1`` against no checkpointing (``details`` entry)."""
    rounds = int(config["local_rounds"])
    if rounds <= 0:
        return {}
    local_root = scale_local.node_local_root(bench_dir, shape.state_bytes)
    log(f"{LOCAL_EVERY_STEP}: {rounds} rounds of {config['local_block']} steps each way, "
        f"local root {local_root}")
    try:
        figures = scale_local.run(
            work=work, local_root=local_root, logs=logs, layers=shape.layers,
            width=shape.width, batch=int(config["batch"]), rounds=rounds,
            block=int(config["local_block"]), timeout_s=float(config["timeout_s"]),
            env=MALLOC_KEEP)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        log(f"{LOCAL_EVERY_STEP} failed: {str(error).splitlines()[0]}")
        return {LOCAL_EVERY_STEP: {"failed": str(error)[-2000:]}}
    log(f"{LOCAL_EVERY_STEP}: step with a local save every step / without: "
        f"{figures['ratio']} (rounds {figures['rounds']}; first round "
        f"{figures['first_round_ratio']})")
    return {LOCAL_EVERY_STEP: figures}


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
