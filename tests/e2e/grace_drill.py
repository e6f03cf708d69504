"""A trainer preempted by SIGTERM on a bandwidth-bounded store, with a real kill at the deadline.

One process, one root, a list of launches in a row (each a fresh manager and handler that
restores from the root, as a requeued job does). Every tensor write goes through
``tests.bandwidth.ThrottledWrites``: a save of ``n`` bytes takes at least ``n /
bandwidth`` seconds, as on a slow network filesystem. Each launch trains, sends itself
``SIGTERM`` after its number of steps, and arms a watchdog that ``SIGKILL``s the process
when the grace period ends: a save that does not fit the window is cut, exactly as a
scheduler would cut it (the drill then dies with -9 and prints nothing).

    python -m tests.e2e.grace_drill ROOT --bandwidth 4.2e6 --grace 5.5 --signal-after 11 \\
        --signal-after 0

``--signal-after 0`` restores and stops without training (the root's newest checkpoint must
load). Prints one JSON object: per launch the restored step, the signalled and stopped
steps, the newest committed step, the skip warnings and the resumekit log lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import EmergencySaveSkippedWarning, PreemptionHandler
from resumekit.store.layout import NameFormat
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from tests.bandwidth import ThrottledWrites

SAVE_EVERY = 5


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                generator: torch.Generator) -> None:
    loss = model(torch.randn(64, 512, generator=generator)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _launch(root: Path, *, grace: float, steps_to_signal: int) -> dict[str, Any]:
    torch.manual_seed(0)
    # About 12.6 MB of state: 1.05 M fp32 parameters, AdamW's two moments.
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    handler = PreemptionHandler(signals=(signal.SIGTERM,), grace_period=grace)
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                generators={"data": generator}, save_every=SAVE_EVERY,
                                async_save=True, preemption=handler)
    lines = _Lines()
    logging.getLogger("resumekit").addHandler(lines)
    logging.getLogger("resumekit").setLevel(logging.INFO)
    start = manager.restore()
    stopped: int | None = None
    signalled: int | None = None
    kill = threading.Timer(grace, os.kill, (os.getpid(), signal.SIGKILL))
    kill.daemon = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, start + steps_to_signal + 2):
            if steps_to_signal == 0:
                break
            _train_step(model, optimizer, generator)
            if step + 1 == start + steps_to_signal:
                signalled = step + 1
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice ...
                kill.start()  # ... and its kill when the grace period ends
            if manager.step_end(step + 1):
                stopped = step + 1
                break
        manager.close()
    kill.cancel()
    logging.getLogger("resumekit").removeHandler(lines)
    if steps_to_signal and stopped is None:
        raise RuntimeError(f"the launch from step {start} never stopped after its SIGTERM")
    newest = latest_committed(Storage(root), NameFormat())
    return {"restored": start, "signalled_after": signalled, "stopped_at": stopped,
            "newest_committed": None if newest is None else newest.step,
            "skipped": [str(w.message) for w in caught
                        if w.category is EmergencySaveSkippedWarning],
            "log": [line for line in lines.lines if "emergency save" in line],
            "staging_left": sorted(p.name for p in root.glob(".*.tmp-*"))}


def main(argv: list[str] | None = None) -> None:
    """Run the launches and print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--bandwidth", type=float, required=True, help="bytes per second")
    parser.add_argument("--grace", type=float, required=True, help="seconds")
    parser.add_argument("--signal-after", type=int, action="append", required=True,
                        help="steps each launch trains before its SIGTERM (0: restore only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ThrottledWrites(args.bandwidth)
    records = [_launch(args.root, grace=args.grace, steps_to_signal=steps)
               for steps in args.signal_after]
    print(json.dumps({"bandwidth": args.bandwidth, "grace": args.grace,
                      "records": records}))


if __name__ == "__main__":
    main()
