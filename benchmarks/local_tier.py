"""A local-tier save next to a durable save of the same state, side by side.

Two managers over one model, in one process: one saves to a durable root (``--durable``,
on the disk) every step, the other only to its local tier (``--local``, ``/dev/shm`` by
default; a second local directory on the durable root's disk separates what the
directory buys from what the protocol does). Rounds alternate the order of the saves;
each save is timed around the ``step_end`` that makes it (blocking, committed when it
returns). Reported: each median, the ratios of medians, and the median of the ratios
within a round (the saves of a round run back to back, so a load spike from outside
hits both).

    python -m benchmarks.local_tier --mb 512 --rounds 7 --out benchmarks/results/local_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import resumekit


def _model(megabytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    rows = max(1, (megabytes << 20) // (4 * width))
    model = nn.Linear(width, rows, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def measure(megabytes: int, rounds: int, durable: Path, locals_: dict[str, Path]
            ) -> dict[str, Any]:
    """Median seconds of a durable save and of a local save per local directory."""
    model, optimizer = _model(megabytes)
    managers = {"durable": resumekit.CheckpointManager(
        durable / "durable", model=model, optimizer=optimizer, save_every=1,
        retention=resumekit.keep_last(2))}
    for name, directory in locals_.items():
        managers[name] = resumekit.CheckpointManager(
            directory / f"durable-of-{name}", model=model, optimizer=optimizer,
            local=resumekit.LocalTier(directory / f"local-{name}", save_every=1,
                                      replicas=False))
    seconds: dict[str, list[float]] = {name: [] for name in managers}
    order = list(managers)
    for step in range(1, rounds + 2):
        for name in order if step % 2 else reversed(order):
            started = time.perf_counter()
            managers[name].step_end(step)
            if step > 1:  # the first round warms up (allocation, claims, page cache)
                seconds[name].append(time.perf_counter() - started)
    for manager in managers.values():
        manager.close()
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "state_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "rounds": rounds,
        "median_seconds": medians,
        "all_seconds": seconds,
        "durable_over_local": {name: medians["durable"] / medians[name]
                               for name in medians if name != "durable"},
        # the ratio within each round (the saves of one round ran back to back), median
        "paired_durable_over_local": {
            name: statistics.median(d / v for d, v in zip(seconds["durable"], values,
                                                          strict=True))
            for name, values in seconds.items() if name != "durable"},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=128, help="state size (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--durable", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--local", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    work = {"durable": Path(tempfile.mkdtemp(dir=args.durable, prefix="rk-tier-")),
            "local": Path(tempfile.mkdtemp(dir=args.local, prefix="rk-tier-"))}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = measure(args.mb, args.rounds, work["durable"],
                             {f"local on {args.local}": work["local"],
                              f"local on {args.durable}": work["durable"]})
        result["cpus"] = os.cpu_count()
        result["load_average"] = os.getloadavg()
        text = json.dumps(result, indent=2)
        print(text)
        if args.out is not None:
            args.out.write_text(text + "\n")
    finally:
        for directory in work.values():
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
