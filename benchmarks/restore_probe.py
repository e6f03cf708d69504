"""``python -m benchmarks.restore_probe``: one cold ``restore()``, in a fresh process.

A restore after a preemption always runs in a fresh process, and fio, its baseline, is a
fresh process each sample too; the bench's own process has by then allocated, freed and
run much else. This probe builds the bench's model + AdamW state (one training step, as
the bench does, so only the process differs), drops the checkpoint's files from the page
cache, and times only ``CheckpointManager(root, model=..., optimizer=...).restore()``
(verification on, as the bench's ``restore_cold``); the checkpoint must hold step 1, as
the bench's does, or the probe fails saying what it found. Prints one JSON object:
``{"seconds": ..., "resident_fraction_before": ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings

from benchmarks.timing import clock, evict, resident_fraction
from benchmarks.workload import Shape, build_model, build_optimizer, train_step
from resumekit.manager import CheckpointManager


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run one cold restore of ``--root`` and print (and return) its figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restore_probe")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--root", required=True, help="the checkpoint root to restore")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    model = build_model(Shape(args.layers, args.width))
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    manager = CheckpointManager(args.root, model=model, optimizer=optimizer)
    gc.collect()
    evict(args.root)
    before = resident_fraction(args.root)
    restored: list[int] = []
    seconds = clock(lambda: restored.append(manager.restore()))
    manager.close()
    if restored != [1]:  # a fresh start (0) would time nothing worth comparing
        raise SystemExit(f"restore_probe: expected to restore step 1 of {args.root}, "
                         f"restore() returned {restored}")
    result: dict[str, object] = {"seconds": seconds, "resident_fraction_before": before}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
