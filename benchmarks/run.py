"""``python -m benchmarks.run``: resumekit against its peers and the machine's limits.

Writes ``benchmarks/results/latest.json`` (summary ratios, every sample, machine facts)
and ``latest.png`` (throughput per method, with the raw-write and raw-read lines), and
prints a markdown table. Every figure is a ratio of two methods measured side by side,
interleaved round by round, median of ``--rounds`` rounds; see ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import disk, peers, report, rss_probe
from benchmarks.per_tensor import bench_per_tensor
from benchmarks.ranks import spawn_ranks, two_rank_work
from benchmarks.root_cost import bench_roots
from benchmarks.timing import (
    FreshDirs,
    clock,
    evict,
    interleave,
    machine_facts,
    remove,
    resident_fraction,
    rss_bytes,
)
from benchmarks.workload import (
    Shape,
    build_model,
    build_optimizer,
    shape_for,
    state_tensors,
    tensor_bytes,
    train_step,
)
from resumekit.manager import CheckpointManager
from resumekit.store.retention import keep_all, keep_last

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MB = 1_000_000
PARTS = ["saves", "overlap", "loads", "rss", "ranks", "roots", "per_tensor", "first_async",
         "goodput"]


_STARTED = time.monotonic()


def _log(message: str) -> None:
    print(f"[bench {time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


class Steps:
    """Step numbers for managers (they only ever increase)."""

    def __init__(self) -> None:
        self.value = 0

    def next(self) -> int:
        self.value += 1
        return self.value


def _run_probe(module: str, args: Sequence[str],
               extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module *args`` in a fresh process; return the JSON it printed last.

    The child imports this tree's ``benchmarks`` and ``resumekit`` (``PYTHONPATH``); a
    non-zero exit raises with the end of its stderr.
    """
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------ saves


def bench_saves(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path,
                rounds: int, dcp_threads: Sequence[int], with_peers: bool = True
                ) -> dict[str, Any]:
    """Every writer of the same state, interleaved; async block/total and memcpy too."""
    steps = Steps()
    notes: dict[str, str] = {}
    dirs = FreshDirs(work)
    fresh, timed_write = dirs.path, dirs.timed_write

    def resumekit_sync() -> float:
        root = fresh("resumekit")
        manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                    retention=keep_all())
        try:
            return clock(lambda: manager.save(steps.next()))
        finally:
            manager.close()
            remove(root)

    async_root = fresh("resumekit-async")
    # Retention keeps everything and the bench deletes each checkpoint outside the clock,
    # as for the sync save: both pay for exactly one checkpoint's writing.
    async_manager = CheckpointManager(async_root, model=model, optimizer=optimizer,
                                      retention=keep_all(), async_save=True)
    async_manager.save(steps.next())  # allocates the staging buffers (not measured)
    async_manager.wait()
    remove(async_root / async_manager.name_format.build(steps.value))
    blocked: list[float] = []

    def resumekit_async() -> float:
        step = steps.next()
        begin = time.perf_counter()
        async_manager.save(step)
        blocked.append(time.perf_counter() - begin)
        async_manager.wait()
        total = time.perf_counter() - begin
        remove(async_root / async_manager.name_format.build(step))
        return total

    sources = state_tensors(model, optimizer)
    buffers = [torch.zeros_like(t) for t in sources]  # touched: no page faults in rounds

    def memcpy() -> float:
        def copy() -> None:
            for target, source in zip(buffers, sources, strict=True):
                target.copy_(source)
        return clock(copy)

    methods: dict[str, Callable[[], float]] = {
        "raw_write": timed_write("raw", lambda t: _raw_file(model, optimizer, t)),
        "resumekit": resumekit_sync,
        "resumekit_async": resumekit_async,
        "memcpy": memcpy,
    }
    if with_peers:
        methods["torch_save"] = timed_write(
            "torch", lambda t: peers.torch_save(model, optimizer, t))
        methods["dcp_default"] = timed_write(
            "dcp", lambda t: peers.dcp_save(model, optimizer, t))
    why_no_fio = disk.missing()
    if why_no_fio is None:
        state_bytes = tensor_bytes(model, optimizer)
        for jobs in (1, 4):
            def fio_write(jobs: int = jobs) -> float:
                target = fresh(f"fio-write-{jobs}")
                try:
                    return float(disk.fio(target, "write", jobs, state_bytes)["seconds"])
                finally:
                    remove(target)
            methods[f"fio_write_{jobs}"] = fio_write
    else:
        notes["fio"] = why_no_fio
        _log(f"disk figures skipped: {why_no_fio}")
    if not with_peers:
        notes["peers"] = "--skip-peers: torch.save, DCP and the trainers' savers not run"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = interleave(methods, rounds, progress=_log)
        async_manager.close()
        remove(async_root)
        samples["resumekit_async_blocked"] = blocked
        return {"samples": samples, "notes": notes}
    for threads in dcp_threads:
        methods[f"dcp_threads_{threads}"] = timed_write(
            f"dcp{threads}",
            lambda t, n=threads: peers.dcp_save(model, optimizer, t, thread_count=n))
    for name, module, saver in (("accelerate", "accelerate", peers.AccelerateSaver),
                                ("lightning", "lightning", peers.LightningSaver)):
        why = peers.missing(module)
        if why is not None:
            notes[name] = why
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            methods[name] = timed_write(name, saver(model, optimizer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = interleave(methods, rounds, progress=_log)
    async_manager.close()
    remove(async_root)
    samples["resumekit_async_blocked"] = blocked
    return {"samples": samples, "notes": notes}


def _raw_file(model: torch.nn.Module, optimizer: torch.optim.Optimizer, target: Path) -> None:
    target.mkdir()
    peers.raw_write(model, optimizer, target / "raw.bin")


# ------------------------------------------------------------------------------ overlap


def bench_overlap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path,
                  rounds: int) -> dict[str, Any]:
    """A training step alone against the same step while an async save is in flight."""
    steps = Steps()
    root = work / "overlap"
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                retention=keep_all(), async_save=True)
    manager.save(steps.next())  # staging buffers
    manager.wait()
    remove(root / manager.name_format.build(steps.value))
    train_step(model, optimizer)
    save_left: list[float] = []

    def alone() -> float:
        return clock(lambda: train_step(model, optimizer))

    def overlapped() -> float:
        step = steps.next()
        manager.save(step)
        seconds = clock(lambda: train_step(model, optimizer))
        begin = time.perf_counter()
        manager.wait()
        save_left.append(time.perf_counter() - begin)
        remove(root / manager.name_format.build(step))
        return seconds

    samples = interleave({"step_alone": alone, "step_during_async_save": overlapped},
                         rounds, progress=_log)
    manager.close()
    remove(root)
    return {"samples": samples, "save_still_running_after_step_s": save_left}


# ------------------------------------------------------------------------------ loads


def bench_loads(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path,
                rounds: int, shape: Shape) -> dict[str, Any]:
    """Restore against a single-stream raw read of the same bytes, cold and warm cache.

    ``restore_cold`` restores again and again in this long-lived process;
    ``restore_cold_fresh_process`` is the same cold, verified restore in a new process each
    round (:mod:`benchmarks.restore_probe`, which builds the model of ``shape`` itself) of
    a second checkpoint of the same state (its claim of the root would fence the managers
    here), as a restore after a preemption always is and as fio is each sample:
    ``load_vs_disk_best`` compares fio with the latter.
    """
    raw = work / "load-raw"
    _raw_file(model, optimizer, raw)
    root = work / "load-resumekit"
    CheckpointManager(root, model=model, optimizer=optimizer).save(1)
    verified = CheckpointManager(root, model=model, optimizer=optimizer)
    unverified = CheckpointManager(root, model=model, optimizer=optimizer,
                                   verify_on_restore=False)
    residency: dict[str, list[float | None]] = {"raw": [], "resumekit": [],
                                                "resumekit_fresh_process": []}
    # Its own copy of the same checkpoint: each restore claims its root, and a fresh
    # process's claim would fence ``verified`` and ``unverified`` (a newer run took over).
    fresh_root = work / "load-resumekit-fresh-process"
    CheckpointManager(fresh_root, model=model, optimizer=optimizer).save(1)
    probe_args = ["--layers", str(shape.layers), "--width", str(shape.width),
                  "--root", str(fresh_root)]

    def fresh_process() -> float:
        result = _run_probe("benchmarks.restore_probe", probe_args)
        residency["resumekit_fresh_process"].append(result["resident_fraction_before"])
        return float(result["seconds"])

    def cold(path: Path, key: str, action: Callable[[], Any]) -> Callable[[], float]:
        def method() -> float:
            evict(path)
            residency[key].append(resident_fraction(path))
            return clock(action)
        return method

    def warm(action: Callable[[], Any]) -> Callable[[], float]:
        def method() -> float:
            action()  # brings every byte into the page cache
            return clock(action)
        return method

    read_raw = lambda: peers.raw_read(model, optimizer, raw / "raw.bin")  # noqa: E731
    methods: dict[str, Callable[[], float]] = {
        "raw_read_cold": cold(raw, "raw", read_raw),
        "restore_cold": cold(root, "resumekit", verified.restore),
        "restore_cold_fresh_process": fresh_process,
        "restore_cold_no_verify": cold(root, "resumekit", unverified.restore),
        "raw_read_warm": warm(read_raw),
        "restore_warm": warm(verified.restore),
    }
    notes: dict[str, str] = {}
    why_no_fio = disk.missing()
    if why_no_fio is None:  # direct reads of the same bytes: never from the page cache
        state_bytes = tensor_bytes(model, optimizer)
        for jobs in (1, 4):
            files = work / f"fio-read-{jobs}"
            disk.fio(files, "write", jobs, state_bytes)  # lays the files out
            methods[f"fio_read_{jobs}"] = (
                lambda files=files, jobs=jobs:
                float(disk.fio(files, "read", jobs, state_bytes)["seconds"]))
    else:
        notes["fio"] = why_no_fio
    samples = interleave(methods, rounds, progress=_log)
    remove(raw)
    remove(root)
    remove(fresh_root)
    for jobs in (1, 4):
        remove(work / f"fio-read-{jobs}")
    return {"samples": samples, "resident_fraction_before_cold_reads": residency,
            "notes": notes}


# ------------------------------------------------------------------------------ ranks


def bench_two_ranks(shape: Shape, work: Path, rounds: int, poll_steps: int,
                    poll_step_ms: float) -> dict[str, Any]:
    """Resharding loads (1->2, 2->1 against 2->2, 1->1) and the preemption vote's cost."""
    root_w1, root_w2 = work / "reshard-w1", work / "reshard-w2"
    model = build_model(shape)
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    CheckpointManager(root_w1, model=model, optimizer=optimizer).save(1)
    _log("two ranks: preemption vote, then FSDP2 save and loads")
    ranks = spawn_ranks(two_rank_work, 2, ({
        "shape": {"layers": shape.layers, "width": shape.width},
        "root_w1": str(root_w1), "root_w2": str(root_w2), "rounds": rounds,
        "poll_steps": poll_steps, "poll_step_ms": poll_step_ms,
    },))
    managers = {
        "load_1_to_1": CheckpointManager(root_w1, model=model, optimizer=optimizer),
        "load_2_to_1": CheckpointManager(root_w2, model=model, optimizer=optimizer),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size differs on purpose
        for manager in managers.values():
            manager.restore()  # warm cache for both
        samples = interleave(
            {name: (lambda m=m: clock(m.restore)) for name, m in managers.items()},
            rounds, progress=_log)
    remove(root_w1)
    remove(root_w2)
    rank0 = ranks[0]
    samples.update(rank0["reshard"]["samples"])
    return {
        "samples": samples,
        "state_bytes": tensor_bytes(model, optimizer),
        "save_2_ranks_seconds": rank0["reshard"]["save_2_ranks_seconds"],
        "poll": rank0["poll"],
    }


# ------------------------------------------------------------------------------ RSS


def bench_rss(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path,
              saves: int, state_mb: float, peak_rounds: int) -> dict[str, Any]:
    """RSS across ``saves`` async saves after the first; then the peaks of one save."""
    root = work / "rss"
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                retention=keep_last(1), async_save=True)
    gc.collect()
    before_first = rss_bytes()
    manager.save(1)
    manager.wait()
    gc.collect()
    after_first = rss_bytes()
    trace = []
    for step in range(2, saves + 2):
        manager.save(step)
        manager.wait()
        trace.append(rss_bytes())
    gc.collect()
    after_all = rss_bytes()
    manager.close()
    del manager
    remove(root)
    peaks = bench_peak_rss(state_mb, work, rounds=peak_rounds)
    return {"rss_before_first": before_first, "rss_after_first": after_first,
            "rss_after_each": trace, "rss_after_all": after_all, "saves": saves, **peaks}


def bench_peak_rss(state_mb: float, work: Path, rounds: int) -> dict[str, Any]:
    """Peak RSS above the RSS before: a sync save; building an async manager + its save.

    Each measurement runs in a fresh process (:mod:`benchmarks.rss_probe`), sync and async
    alternating. The async figure starts before the manager exists, so it counts the
    staging copy (allocated when the manager is built) and whatever the save adds.
    """
    measured: dict[str, list[int]] = {"sync": [], "async": []}
    exact = True
    for number in range(rounds):
        for mode in ("sync", "async") if number % 2 == 0 else ("async", "sync"):
            result = _run_probe("benchmarks.rss_probe",
                                ["--state-mb", str(state_mb), "--mode", mode,
                                 "--dir", str(work)], extra_env=rss_probe.MALLOC_ENV)
            measured[mode].append(int(result["extra"]))
            exact = exact and bool(result["exact"])
            _log(f"peak RSS round {number + 1}/{rounds} {mode}: "
                 f"+{result['extra'] / result['state_bytes']:.3f} x state")
    return {"peak_rss_sync_extra": measured["sync"], "peak_rss_async_extra": measured["async"],
            "peak_rss_exact": exact}


# ------------------------------------------------------------------------------ first async


def bench_first_async(model: torch.nn.Module, optimizer: torch.optim.Optimizer, work: Path,
                      rounds: int) -> dict[str, Any]:
    """The first async save of a new manager: how long it blocks, against a memcpy.

    ``first_async_blocked``: a manager built with the default ``stage_ahead`` (buffers
    allocated and touched when it is built, off the clock); ``..._lazy``: with
    ``stage_ahead=False`` (allocated by the save, as before). Building, waiting for the
    commit and deleting the checkpoint are off the clock.
    """
    sources = state_tensors(model, optimizer)
    buffers = [torch.zeros_like(t) for t in sources]  # touched: no page faults in rounds
    counter = [0]

    def first_save(stage_ahead: bool) -> Callable[[], float]:
        def method() -> float:
            counter[0] += 1
            root = work / f"first-async-{counter[0]}"
            manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                        retention=keep_all(), async_save=True,
                                        stage_ahead=stage_ahead)
            try:
                begin = time.perf_counter()
                manager.save(1)
                blocked = time.perf_counter() - begin
                manager.wait()
            finally:
                manager.close()
                del manager
                gc.collect()
                remove(root)
            return blocked
        return method

    def memcpy() -> float:
        def copy() -> None:
            for target, source in zip(buffers, sources, strict=True):
                target.copy_(source)
        return clock(copy)

    samples = interleave({"first_async_blocked": first_save(True), "memcpy": memcpy,
                          "first_async_blocked_lazy": first_save(False)},
                         rounds, progress=_log)
    return {"samples": samples}


# ------------------------------------------------------------------------------ per tensor


def bench_small_tensors(work: Path, count: int, rounds: int) -> dict[str, Any]:
    """Fixed cost per tensor: ``count`` small tensors, resumekit against plain DCP."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bench_per_tensor(work, count, rounds, progress=_log)


# ------------------------------------------------------------------------------ goodput


def bench_goodput(work: Path, steps: int, save_interval: int, sigterms: int, seed: int,
                  modes: Sequence[str]) -> dict[str, Any]:
    """The LingBot tiny trainer under a fixed preemption schedule, sync and async saves."""
    from benchmarks import goodput  # noqa: PLC0415 - imports the example trainer

    results: dict[str, Any] = {}
    for mode in modes:
        target = work / f"goodput-{mode}"
        target.mkdir()
        try:
            results[mode] = goodput.run(target, steps=steps, save_interval=save_interval,
                                        sigterms=sigterms, seed=seed,
                                        async_save=mode == "async", progress=_log)
        finally:
            remove(target)
    return results


# ------------------------------------------------------------------------------ main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mb", type=float, default=1500,
                        help="model + AdamW state of the one-process runs (MB)")
    parser.add_argument("--dist-state-mb", type=float, default=500,
                        help="model + AdamW state of the two-rank FSDP2 runs (MB, total)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 5)")
    parser.add_argument("--overlap-rounds", type=int, default=11,
                        help="rounds of the overlap figure (a round is one step, ~2 s): its "
                             "per-round ratios spread most, so it gets more")
    parser.add_argument("--load-rounds", type=int, default=9,
                        help="rounds of the load figures (~6 s each): cold reads on this "
                             "disk take 0.8 s or 2-3 s at random, so the median needs more")
    parser.add_argument("--rss-saves", type=int, default=20)
    parser.add_argument("--rss-peak-rounds", type=int, default=3,
                        help="fresh processes per peak-RSS figure (sync, async)")
    parser.add_argument("--poll-steps", type=int, default=100,
                        help="steps per round of the preemption-vote measurement")
    parser.add_argument("--poll-step-ms", type=float, default=10.0)
    parser.add_argument("--dcp-threads", type=int, nargs="*", default=[2, 4],
                        help="DCP writer thread counts tried besides DCP's default (1)")
    parser.add_argument("--bench-dir", default=os.environ.get("RESUMEKIT_BENCH_DIR"),
                        help="where files are written (default: the temp directory)")
    parser.add_argument("--out", default=str(RESULTS_DIR),
                        help="directory for latest.json and latest.png")
    parser.add_argument("--root-counts", type=int, nargs="*", default=[0, 10, 100, 1000],
                        help="checkpoints in the root for the root-cost figures (the "
                             "*_at_1000_vs_10 ratios compare the largest with 10)")
    parser.add_argument("--root-s3", choices=["auto", "off"], default="auto",
                        help="also measure the root cost on a loopback S3 (moto_server)")
    parser.add_argument("--per-tensor-count", type=int, default=10_000,
                        help="small tensors of the per-tensor figures")
    parser.add_argument("--per-tensor-rounds", type=int, default=5)
    parser.add_argument("--first-async-rounds", type=int, default=5)
    parser.add_argument("--goodput-steps", type=int, default=600,
                        help="steps of each goodput run (one interruption per 100 by default)")
    parser.add_argument("--goodput-sigterms", type=int, default=5,
                        help="SIGTERMs per goodput run (plus one SIGKILL)")
    parser.add_argument("--goodput-save-interval", type=int, default=25)
    parser.add_argument("--goodput-seed", type=int, default=16,
                        help="seed of the interruption schedule")
    parser.add_argument("--goodput-modes", nargs="+", default=["sync", "async"],
                        choices=["sync", "async"])
    parser.add_argument("--skip-peers", action="store_true",
                        help="saves: only resumekit, the raw write, memcpy and fio (a "
                             "quicker run; the peer figures are then not measured)")
    parser.add_argument("--only", nargs="*", default=None, choices=PARTS,
                        help="run only these parts (the summary lacks the others)")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmarks; write the JSON and PNG; print the table; return the results."""
    args = _parser().parse_args(argv)
    # resumekit's background saves run DCP off the main thread, where it cannot silence
    # DCP's "assuming single process" notice itself; here single process is the intent.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    parts = set(args.only if args.only is not None else PARTS)
    # A SIGTERM (timeout, Ctrl-C from make) still cleans the bench directory up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = args.bench_dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="resumekit-bench-", dir=base))
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, Any] = {
        "schema": 1,
        "created": started.isoformat(timespec="seconds"),
        "command": ["python", "-m", "benchmarks.run", *(argv or sys.argv[1:])],
        "machine": machine_facts(work),
        "config": {"rounds": args.rounds, "overlap_rounds": max(args.rounds, args.overlap_rounds),
                   "load_rounds": max(args.rounds, args.load_rounds),
                   "state_mb": args.state_mb,
                   "dist_state_mb": args.dist_state_mb, "rss_saves": args.rss_saves,
                   "rss_peak_rounds": args.rss_peak_rounds,
                   "poll_steps": args.poll_steps, "poll_step_ms": args.poll_step_ms,
                   "dcp_threads": [1, *args.dcp_threads], "parts": sorted(parts),
                   "root_counts": list(args.root_counts), "root_s3": args.root_s3,
                   "per_tensor_count": args.per_tensor_count,
                   "per_tensor_rounds": args.per_tensor_rounds,
                   "first_async_rounds": args.first_async_rounds,
                   "goodput": {"steps": args.goodput_steps, "sigterms": args.goodput_sigterms,
                               "sigkills": 1, "save_interval": args.goodput_save_interval,
                               "seed": args.goodput_seed, "modes": args.goodput_modes}},
        "details": {},
    }
    details = results["details"]
    try:
        shape = shape_for(int(args.state_mb * MB))
        model = build_model(shape)
        optimizer = build_optimizer(model)
        train_step(model, optimizer)  # AdamW state exists from here on
        state_bytes = tensor_bytes(model, optimizer)
        results["config"]["shape"] = {"layers": shape.layers, "width": shape.width,
                                      "params": shape.params, "state_bytes": state_bytes}
        _log(f"state: {state_bytes / 1e9:.3f} GB ({shape.layers} x Linear({shape.width})"
             f" + AdamW); work dir {work}")
        if "saves" in parts:
            _log("saves")
            details["saves"] = bench_saves(model, optimizer, work, args.rounds,
                                           args.dcp_threads, with_peers=not args.skip_peers)
        if "overlap" in parts:
            _log("overlap")
            details["overlap"] = bench_overlap(model, optimizer, work,
                                               max(args.rounds, args.overlap_rounds))
        if "loads" in parts:
            _log("loads")
            details["loads"] = bench_loads(model, optimizer, work,
                                           max(args.rounds, args.load_rounds), shape)
        if "rss" in parts:
            _log("rss")
            details["rss"] = bench_rss(model, optimizer, work, args.rss_saves, args.state_mb,
                                     args.rss_peak_rounds)
        if "first_async" in parts:
            _log("first async save")
            details["first_async"] = bench_first_async(model, optimizer, work,
                                                       args.first_async_rounds)
        del model, optimizer
        gc.collect()
        if "ranks" in parts:
            dist_shape = shape_for(int(args.dist_state_mb * MB))
            results["config"]["dist_shape"] = {"layers": dist_shape.layers,
                                               "width": dist_shape.width}
            details["ranks"] = bench_two_ranks(dist_shape, work, args.rounds,
                                               args.poll_steps, args.poll_step_ms)
        if "roots" in parts:
            _log(f"roots: save and latest() at {args.root_counts} checkpoints")
            details["roots"] = bench_roots(work, args.root_counts,
                                           s3=args.root_s3 != "off")
        if "per_tensor" in parts:
            _log(f"per tensor: {args.per_tensor_count} small tensors")
            details["per_tensor"] = bench_small_tensors(work, args.per_tensor_count,
                                                        args.per_tensor_rounds)
        if "goodput" in parts:
            _log("goodput under preemption")
            details["goodput"] = bench_goodput(
                work, args.goodput_steps, args.goodput_save_interval, args.goodput_sigterms,
                args.goodput_seed, args.goodput_modes)
    finally:
        remove(work)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["machine"]["bench_dir_removed"] = not work.exists()
    results["summary"] = report.summarise(details, state_bytes)
    results["targets"] = report.TARGETS
    results["ratios"] = report.ratio_details(details, state_bytes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    report.plot(results, out / "latest.png")
    print(report.markdown(results))
    return results


if __name__ == "__main__":
    main()
