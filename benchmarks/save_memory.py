"""``python -m benchmarks.save_memory``: where a scale-bench trainer's resident memory goes.

A small copy of the scale bench's trainer (:mod:`benchmarks.scale_worker`: the linear
stack ``fully_shard``-ed with FSDP2 over 2 gloo ranks, AdamW, glibc's
:data:`benchmarks.scale.MALLOC_KEEP` or glibc's defaults) that trains ``--steps`` steps and
saves at ``--save-at`` steps by one method: ``none`` (no save), ``resumekit_sync``
(``CheckpointManager.save``, blocking, raw tensor files) or ``torch_save`` (the scale
bench's per-rank ``torch.save`` of the local shards, then fsync).

Every rank cuts its run into contiguous segments (each step, and each phase of a save:
for resumekit the capture, DCP's planning, the raw writer's ``write_data`` with its
bounce-buffer copies, hashing, ``O_DIRECT`` writes and fsync, ``.metadata``, the small
files, the manifest's publication and commit, retention) and for each records the
process's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` at every
cut, so the launch's own peak is the highest segment's) and its ``VmRSS`` at the end.
Nothing is sampled: a peak between two cuts is counted exactly.

Prints, per method and malloc setting: the scale bench's figure computed its way (the
high-water mark from the end of step 1 to the end, above that at the end of step 2, per
state byte), each step's peak, and the save's own rise (its phases' peak above the RSS
the save began with) with the phase it came from. ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.scale import MALLOC_KEEP
from benchmarks.scale_worker import malloc_live, rss_status

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = ("none", "resumekit_sync", "torch_save")
#: glibc's settings of the scale bench (:data:`benchmarks.scale.MALLOC_KEEP`) or none.
MALLOC = {"keep": dict(MALLOC_KEEP), "default": {}}


class Segments:
    """Contiguous segments of one process's life, each with its peak and end RSS."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.label = "start"
        self._reset()

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def cut(self, label: str) -> None:
        """End the current segment (recording its peak and end RSS); start ``label``."""
        peak, rss = rss_status("VmHWM"), rss_status("VmRSS")
        self.records.append({"label": self.label, "peak": peak, "rss_end": rss,
                             "live_end": malloc_live()})
        self._reset()
        self.label = label

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """``label`` for the ``with`` block; the segment outside it resumes after."""
        outer = self.label
        self.cut(label)
        try:
            yield
        finally:
            self.cut(outer)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Make every call of ``owner.name`` a phase ``label``."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.phase(label):
                return original(*args, **kwargs)

        setattr(owner, name, wrapper)


def _resumekit_phases(segments: Segments) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415

    from resumekit import manager, save_job  # noqa: PLC0415
    from resumekit import tensors as tensor_io  # noqa: PLC0415
    from resumekit.store.commit import CommitProtocol  # noqa: PLC0415
    from resumekit.tensors.raw import RawTensorWriter  # noqa: PLC0415

    segments.wrap(manager.CheckpointManager, "_capture", "save:capture")
    segments.wrap(DefaultSavePlanner, "create_local_plan", "save:plan")
    segments.wrap(DefaultSavePlanner, "create_global_plan", "save:plan")
    segments.wrap(DefaultSavePlanner, "finish_plan", "save:plan")
    segments.wrap(RawTensorWriter, "write_data", "save:write_data")
    segments.wrap(RawTensorWriter, "finish", "save:metadata")
    segments.wrap(tensor_io, "step_files", "save:small_files")
    segments.wrap(CommitProtocol, "publish", "save:publish")
    segments.wrap(save_job, "apply_retention", "save:retention")


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save at ``--save-at``, write the segments as JSON."""
    import warnings  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from benchmarks.ranks import fsdp_model  # noqa: PLC0415
    from benchmarks.timing import fsync_tree  # noqa: PLC0415
    from benchmarks.workload import (  # noqa: PLC0415
        build_optimizer,
        shape_for,
        state_tensors,
        tensor_bytes,
        train_step,
    )

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp_model(shape_for(int(args.state_mb * 2e6)))  # the state of both ranks
    optimizer = build_optimizer(model)
    root = Path(args.root)
    segments = Segments()
    save: Callable[[int], None] = lambda step: None  # noqa: E731
    if args.method == "resumekit_sync":
        from resumekit.manager import CheckpointManager  # noqa: PLC0415
        from resumekit.store.retention import keep_last  # noqa: PLC0415

        checkpoints = CheckpointManager(root, model=model, optimizer=optimizer,
                                        retention=keep_last(2))
        _resumekit_phases(segments)
        save = checkpoints.save
    elif args.method == "torch_save":
        def save(step: int) -> None:
            directory = root / f"step-{step:08d}"
            directory.mkdir(parents=True, exist_ok=True)
            with segments.phase("save:capture"):
                tensors = state_tensors(model, optimizer)
            path = directory / f"rank{rank}.pt"
            with segments.phase("save:torch.save"):
                torch.save(tensors, path)
            with segments.phase("save:fsync"):
                fsync_tree(path)
            dist.barrier()

    save_at = {int(step) for step in args.save_at.split(",") if step}
    for step in range(1, args.steps + 1):
        with segments.phase(f"step {step}"):
            train_step(model, optimizer, batch=args.batch, seed=step)
        if step in save_at:
            with segments.phase(f"save {step}"):
                save(step)
    segments.cut("end")
    out = {"rank": rank, "method": args.method, "state_bytes": tensor_bytes(model, optimizer),
           "malloc": {key: os.environ.get(key) for key in MALLOC["keep"]},
           "segments": segments.records}
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def analyse(run: dict[str, Any]) -> dict[str, Any]:
    """The scale bench's figure, each step's peak and the saves' own rise, for one rank."""
    records = run["segments"]
    state = run["state_bytes"]
    labels = [record["label"] for record in records]
    after_step1 = labels.index("step 1") + 1  # the bench resets the mark after step 1
    step2 = labels.index("step 2")
    baseline = max(record["peak"] for record in records[after_step1:step2 + 1])
    launch_peak = max(record["peak"] for record in records[after_step1:])
    steps = {record["label"]: record["peak"] for record in records
             if record["label"].startswith("step ")}
    step_live = {record["label"]: record["live_end"] for record in records
                 if record["label"].startswith("step ")}
    saves = []
    # A save's phases lie between its "save N" cuts: from the segment that begins it to
    # the one that ends it (labels "save N" and "save:*").
    index = 0
    while index < len(records):
        label = records[index]["label"]
        if label.startswith("save ") and ":" not in label:
            begin_rss = records[index - 1]["rss_end"]
            phases: dict[str, int] = {}
            end = index
            while end < len(records) and (records[end]["label"] == label
                                          or records[end]["label"].startswith("save:")):
                phase = records[end]["label"]
                phases[phase] = max(phases.get(phase, 0), records[end]["peak"])
                end += 1
            top = max(phases, key=lambda name: phases[name])
            saves.append({"save": label, "rss_before": begin_rss,
                          "rise": phases[top] - begin_rss, "rise_vs_state":
                          (phases[top] - begin_rss) / state, "top_phase": top,
                          "phases_rise": {name: peak - begin_rss
                                          for name, peak in phases.items()},
                          "rss_after": records[end - 1]["rss_end"]})
            index = end
        else:
            index += 1
    return {"state_bytes": state, "bench_figure": (launch_peak - baseline) / state,
            "bench_extra_bytes": launch_peak - baseline, "baseline_hwm": baseline,
            "step_peaks": steps, "step_live_end": step_live, "saves": saves}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.save_memory")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, default=None)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--malloc", nargs="+", choices=list(MALLOC), default=["keep"])
    parser.add_argument("--state-mb", type=float, default=400.0, help="per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", default="3,5,7")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--root", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dir", default=None, help="where checkpoints go (a temporary dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    results: dict[str, Any] = {}
    for malloc in args.malloc:
        for method in args.methods:
            with tempfile.TemporaryDirectory(dir=args.dir, prefix="save-memory-") as work:
                out = Path(work) / "segments"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "-m", "benchmarks.save_memory", "--worker",
                           "--method", method, "--root", str(Path(work) / "root"),
                           "--out", str(out), "--state-mb", str(args.state_mb),
                           "--steps", str(args.steps), "--save-at",
                           "" if method == "none" else args.save_at,
                           "--batch", str(args.batch)]
                env = {key: value for key, value in os.environ.items()
                       if key not in MALLOC["keep"]}
                env.update(MALLOC[malloc], OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                    [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
                started = time.monotonic()
                subprocess.run(command, cwd=REPO_ROOT, env=env, check=True)
                ranks = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]
            name = f"{method}/{malloc}"
            results[name] = {"seconds": time.monotonic() - started,
                             "ranks": [{**analyse(run), "segments": run["segments"]}
                                       for run in ranks]}
            report(name, results[name])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def report(name: str, result: dict[str, Any]) -> None:
    """Print one method's figures, per rank."""
    mb = 1e6
    for rank, figures in enumerate(result["ranks"]):
        steps = " ".join(f"{peak / mb:.0f}" for peak in figures["step_peaks"].values())
        live = " ".join(f"{(value or 0) / mb:.0f}" for value in figures["step_live_end"].values())
        print(f"{name} rank {rank}: bench figure {figures['bench_figure']:.3f} "
              f"({figures['bench_extra_bytes'] / mb:.0f} MB over the step-2 baseline "
              f"{figures['baseline_hwm'] / mb:.0f} MB; state {figures['state_bytes'] / mb:.0f}"
              f" MB); step peaks MB: {steps}; malloc live after each step MB: {live}", flush=True)
        for save in figures["saves"]:
            phases = ", ".join(f"{phase.removeprefix('save:')} {rise / mb:+.0f}"
                               for phase, rise in save["phases_rise"].items())
            print(f"    {save['save']}: rss before {save['rss_before'] / mb:.0f} MB, rise "
                  f"{save['rise'] / mb:+.1f} MB ({save['rise_vs_state']:.4f} of state; "
                  f"{save['top_phase']}), after {save['rss_after'] / mb:.0f} MB; {phases}",
                  flush=True)


if __name__ == "__main__":
    main()
