"""Thread or process writer: the training step while a background save writes, side by side.

``python -m benchmarks.writer_process [--state-mb 300] [--rounds 5] [--out FILE]``

One model + AdamW state of ``--state-mb`` and a training step that is half Python (a
collate-like loop over Python objects, what a data pipeline or a logging hook does on the
training thread) and half torch compute. Two managers, ``async_writer="thread"`` and
``async_writer="process"``, each staging ahead, save the same state into two roots on the
same disk. Every round, interleaved (A B C, C B A, ...): a step alone; then, for each
writer, a save (its blocking time: the call) followed by steps until the save is
committed (their mean time). Per round and writer, ``slowdown`` is the mean step time
during the save over the round's step alone; the JSON holds every sample and the medians
(``docs/performance.md``, "Thread or process writer").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import clock, interleave, remove
from benchmarks.workload import build_model, build_optimizer, shape_for, train_step
from resumekit.manager import CheckpointManager
from resumekit.store.retention import keep_all

WRITERS = ("thread", "process")


def python_work(items: int = 60_000) -> int:
    """A step's pure-Python part: build, sort and reduce small Python objects."""
    rows = [{"id": i, "text": f"sample-{i % 977}", "len": (i * 7919) % 512} for i in range(items)]
    rows.sort(key=lambda row: (row["len"], row["text"]))
    return sum(len(row["text"]) + row["len"] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python-items", type=int, default=60_000)
    parser.add_argument("--work", default=None, help="directory on the disk to write to")
    parser.add_argument("--out", default="benchmarks/results/writer_process.json")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="rk-writer-"))
    shape = shape_for(args.state_mb << 20)
    model = build_model(shape)
    optimizer = build_optimizer(model)
    train_step(model, optimizer)

    def step() -> None:
        python_work(args.python_items)
        train_step(model, optimizer)

    managers = {writer: CheckpointManager(work / writer, model=model, optimizer=optimizer,
                                          retention=keep_all(), async_save=True,
                                          async_writer=writer)
                for writer in WRITERS}
    counter = [0]
    for manager in managers.values():  # warm: buffers touched, the writer process up
        counter[0] += 1
        manager.save(counter[0])
        manager.wait()
    blocking: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    committed: dict[str, list[float]] = {writer: [] for writer in WRITERS}
    steps_during: dict[str, list[int]] = {writer: [] for writer in WRITERS}

    def during(writer: str) -> Any:
        manager = managers[writer]

        def run() -> float:
            counter[0] += 1
            begin = time.perf_counter()
            manager.save(counter[0])
            blocking[writer].append(time.perf_counter() - begin)
            times = []
            thread = manager._background._thread
            while True:
                times.append(clock(step))
                if thread is None or not thread.is_alive():
                    break
            manager.wait()
            committed[writer].append(time.perf_counter() - begin)
            steps_during[writer].append(len(times))
            remove(work / writer / manager.name_format.build(counter[0]))
            return statistics.fmean(times)

        return run

    samples = interleave({"step_alone": lambda: clock(step),
                          **{f"step_during_{w}_save": during(w) for w in WRITERS}},
                         args.rounds, progress=print)
    for manager in managers.values():
        manager.close()
    remove(work)
    slowdown = {w: [during_ / alone for during_, alone in
                    zip(samples[f"step_during_{w}_save"], samples["step_alone"], strict=True)]
                for w in WRITERS}
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor))
    result = {
        "state_bytes": state_bytes, "rounds": args.rounds, "cpus": os.cpu_count(),
        "python_items": args.python_items, "samples": samples, "blocking_s": blocking,
        "save_committed_s": committed, "steps_during_save": steps_during,
        "slowdown": slowdown,
        "summary": {
            "step_alone_s": statistics.median(samples["step_alone"]),
            **{f"{w}_step_slowdown": statistics.median(slowdown[w]) for w in WRITERS},
            **{f"{w}_blocking_s": statistics.median(blocking[w]) for w in WRITERS},
            **{f"{w}_save_committed_s": statistics.median(committed[w]) for w in WRITERS},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
