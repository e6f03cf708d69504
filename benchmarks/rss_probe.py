"""``python -m benchmarks.rss_probe``: the peak RSS of one save, in a fresh process.

Builds the bench's model + AdamW state (one training step), then measures the resident
memory above what the process held just before: around a sync ``save`` (the manager
already built), or around building an async manager (its staging copy is allocated then)
through its first ``save`` and ``wait``. Prints one JSON object.

A fresh process, started by the bench with ``MALLOC_MMAP_THRESHOLD_=65536``: in a process
that has allocated and freed much already, glibc serves new buffers from freed memory
that is still resident, and the peak would miss them.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import warnings
from pathlib import Path

from benchmarks.timing import PeakRss
from benchmarks.workload import (
    build_model,
    build_optimizer,
    shape_for,
    tensor_bytes,
    train_step,
)
from resumekit.manager import CheckpointManager
from resumekit.store.retention import keep_all

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rss_probe")
    parser.add_argument("--state-mb", type=float, required=True)
    parser.add_argument("--mode", choices=["sync", "async"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    model = build_model(shape_for(int(args.state_mb * 1_000_000)))
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    root = Path(tempfile.mkdtemp(prefix="rss-probe-", dir=args.dir))
    gc.collect()
    if args.mode == "sync":
        manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                    retention=keep_all())
        gc.collect()
        with PeakRss() as peak:
            manager.save(1)
    else:
        with PeakRss() as peak:
            manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                        retention=keep_all(), async_save=True)
            manager.save(1)
            manager.wait()
    manager.close()
    result: dict[str, object] = {"mode": args.mode, "extra": peak.extra,
                                 "before": peak.before, "peak": peak.peak,
                                 "exact": peak.exact,
                                 "state_bytes": tensor_bytes(model, optimizer)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
