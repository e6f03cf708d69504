"""A trainer that SIGTERMs itself at random steps and counts the steps each preemption lost.

One process, one root, ``--preemptions`` launches in a row. Each launch builds the model,
optimizer and a fresh ``CheckpointManager`` (with a ``PreemptionHandler`` it installs),
restores the newest committed checkpoint - exactly what a relaunch with the same command
does - trains, and sends itself ``SIGTERM`` after a seeded random number of steps.
``step_end`` then saves (or skips) the emergency checkpoint and says stop; the launch closes
the manager and reads the root's newest committed step from disk::

    steps lost = (steps done when the signal arrived) - (newest committed step)

The launches run in one process (so torch is imported once); the manager, the handler and
the signal handler are new each time, so nothing but the checkpoint root carries over.
Prints one JSON object: the mode, the per-preemption records and the lost steps.

    python -m tests.e2e.emergency_drill ROOT --mode async --preemptions 10 --seed 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.store.layout import NameFormat
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage

SAVE_EVERY = 5
MAX_STEPS_TO_SIGNAL = 12
GRACE_PERIOD_S = 120.0  # the save (tens of ms here) always fits


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                generator: torch.Generator) -> None:
    inputs = torch.randn(64, 32, generator=generator)
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _launch(root: Path, *, async_save: bool, steps_to_signal: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    handler = PreemptionHandler(signals=(signal.SIGTERM,), grace_period=GRACE_PERIOD_S)
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                generators={"data": generator}, save_every=SAVE_EVERY,
                                async_save=async_save, preemption=handler)
    start = manager.restore()
    signal_after = start + steps_to_signal
    stopped: int | None = None
    skipped: list[str] = []
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, start + 10 * MAX_STEPS_TO_SIGNAL):
            _train_step(model, optimizer, generator)
            if step + 1 == signal_after:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            if manager.step_end(step + 1):
                stopped = step + 1
                break
        manager.close()
    skipped = [str(w.message) for w in caught if "skipping the emergency save" in str(w.message)]
    if stopped is None:
        raise RuntimeError(f"the launch from step {start} never stopped after its SIGTERM")
    newest = latest_committed(Storage(root), NameFormat())
    newest_step = 0 if newest is None else newest.step
    return {"restored": start, "signalled_after": signal_after, "stopped_at": stopped,
            "newest_committed": newest_step, "lost": signal_after - newest_step,
            "skipped": skipped, "seconds": round(time.monotonic() - started, 3)}


def main(argv: list[str] | None = None) -> None:
    """Run the drill and print its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--mode", choices=("sync", "async"), required=True)
    parser.add_argument("--preemptions", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    records = [_launch(args.root, async_save=args.mode == "async",
                       steps_to_signal=rng.randint(1, MAX_STEPS_TO_SIGNAL))
               for _ in range(args.preemptions)]
    print(json.dumps({"mode": args.mode, "seed": args.seed, "records": records,
                      "lost": [record["lost"] for record in records]}))


if __name__ == "__main__":
    main()
