"""``python -m benchmarks.emergency_latency``: from the signal to the emergency write's start.

Issue 38's target: "an emergency save's write starts within one staging copy of the signal
on every rank". Two gloo ranks (real processes, ``benchmarks.ranks.spawn_ranks``) train
the bench model ``fully_shard``-ed with FSDP2 under a ``CheckpointManager`` with a
``PreemptionHandler`` (the capture at the signal is on by default). Each round, after two
steps, each rank times a staging copy of its state the way the capture makes it
(``CpuStager.stage`` of the manager's tensor state: into held buffers, and a first copy
that allocates them), then both ranks signal themselves (SIGUSR1) at the start of a step;
the step's ``optimizer.step()`` waits for the capture's copy; the rank's round reports
the seconds from the signal to its write's start (the figure of the emergency save's log
line) and the copy's own seconds. The figures: signal-to-write over the capture's own copy
(1.0: nothing but the copy stood between the signal and the write), over a held copy and
over a first copy timed alone, the worst rank of each round, per configuration (blocking
saves: the buffers are allocated at the signal; ``async_save=True``: held since the
constructor). Wall-clock figures of a shared machine: read them as ratios, not speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.ranks import fsdp_model, spawn_ranks
from benchmarks.workload import Shape, build_optimizer, train_step
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.tensors.staging import CpuStager

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"blocking_saves": {}, "async_save": {"async_save": True}}
#: What the seconds from the signal to the write's start are divided by: the capture's own
#: copy (as it ran, beside the step in progress), a copy into held buffers and a first
#: copy that allocates them (each timed alone on the training thread before the signal).
OVER = ("capture", "held", "first")


def _timed_copy(tensors: dict[str, Any], stager: CpuStager) -> float:
    begin = time.perf_counter()
    stager.stage(tensors)
    return time.perf_counter() - begin


def _rank(rank: int, world_size: int, root: str, shape: Shape, config: str,
          rounds: int) -> list[dict[str, Any]]:
    figures = []
    for number in range(rounds):
        model = fsdp_model(shape)
        optimizer = build_optimizer(model)
        handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600, poll_every=1,
                                    overlap=False)
        ckpt = CheckpointManager(f"{root}/{config}-{number}", model=model,
                                 optimizer=optimizer, save_every=10**6, preemption=handler,
                                 capture_at_signal=True,
                                 **CONFIGS[config])
        ckpt.restore()
        for step in (1, 2):
            train_step(model, optimizer, seed=step)
            ckpt.step_end(step)
        tensors = ckpt.state.tensor_state()
        stager = CpuStager()
        first_copy = _timed_copy(tensors, stager)  # allocates the buffers
        held_copy = statistics.median(_timed_copy(tensors, stager) for _ in range(3))
        del stager
        dist.barrier()
        os.kill(os.getpid(), signal.SIGUSR1)  # at the start of step 3
        train_step(model, optimizer, seed=3)  # its optimizer.step() waits for the copy
        assert ckpt._emergency is not None
        outcome = ckpt._emergency.settle()  # every rank, the same settle point
        stop = ckpt.step_end(3)
        ckpt.close()
        handler.uninstall()
        if outcome is None or outcome.committed != 2 or not stop:
            raise RuntimeError(f"rank {rank} round {number}: the emergency save of step 2 "
                               f"was not committed ({outcome})")
        figures.append({"rank": rank, "round": number, "held_copy_s": held_copy,
                        "first_copy_s": first_copy, "capture_copy_s": outcome.copied_in,
                        "signal_to_write_s": outcome.write_from})
    return figures


def run(shape: Shape, rounds: int) -> dict[str, Any]:
    """Every configuration's rounds on two ranks; the figures and their summary."""
    results: dict[str, Any] = {"shape": {"layers": shape.layers, "width": shape.width},
                               "configs": {}}
    with tempfile.TemporaryDirectory(prefix="resumekit-emergency-latency-") as root:
        for config in CONFIGS:
            per_rank = spawn_ranks(_rank, 2, (root, shape, config, rounds))
            rows = [row for rank_rows in per_rank for row in rank_rows]
            summary: dict[str, Any] = {"rows": rows}
            for over in OVER:
                worst = [max(row["signal_to_write_s"] / row[f"{over}_copy_s"]
                             for row in rows if row["round"] == number)
                         for number in range(rounds)]
                summary[f"signal_to_write_over_{over}_copy_worst_rank"] = worst
                summary[f"median_over_{over}_copy"] = statistics.median(worst)
            results["configs"][config] = summary
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.emergency_latency")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "emergency_latency.json")
    args = parser.parse_args(argv)
    results = run(Shape(args.layers, args.width), args.rounds)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for config, figures in results["configs"].items():
        for over in OVER:
            values = figures[f"signal_to_write_over_{over}_copy_worst_rank"]
            print(f"{config}: signal to write start / {over} staging copy, worst rank per "
                  f"round: {', '.join(f'{value:.2f}' for value in values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
