"""Run the quickstart's FSDP2 block under torchrun with one hook: a pause for the signal.

``python -m torch.distributed.run ... tests/dist/quickstart_runner.py SCRIPT OUT`` runs
SCRIPT (the block of docs/quickstart.md, unchanged) in this process and writes
``OUT/rank_<r>.json``: what ``restore`` returned, the steps ``step_end`` saw, how the script
ended (exit status).

Environment:
    QUICKSTART_PAUSE_AT: after ``step_end`` of this step returned False (no preemption
        yet), write ``OUT/paused_<r>`` and wait until this rank records a preemption
        signal (the test sends SIGTERM to the torchrun agent). The loop then takes more
        batches from its DataLoader - whose worker processes got the signal too - before
        the ranks agree at a later step.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from resumekit.manager import CheckpointManager
from tests.distributed_harness import say_paused, write_record
from tests.limits import HANG_S


def main() -> None:
    script, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    pause_at = int(os.environ.get("QUICKSTART_PAUSE_AT", "0")) or None
    record: dict[str, Any] = {"steps": [], "exit": 0}
    original_restore, original_step_end = CheckpointManager.restore, CheckpointManager.step_end

    def restore(self: CheckpointManager, *args: Any, **kwargs: Any) -> int:
        record["restored"] = original_restore(self, *args, **kwargs)
        return int(record["restored"])

    def step_end(self: CheckpointManager, step: int, *args: Any, **kwargs: Any) -> bool:
        stop = bool(original_step_end(self, step, *args, **kwargs))
        record["steps"].append(step)
        if step == pause_at and not stop:
            say_paused(out, rank, step)
            deadline = time.monotonic() + HANG_S
            while self.preemption is None or not self.preemption.requested:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}: no signal {HANG_S}s after step {step}")
                time.sleep(0.01)
        return stop

    CheckpointManager.restore = restore  # type: ignore[method-assign]
    CheckpointManager.step_end = step_end  # type: ignore[method-assign]
    write_record(out, rank, record, lambda: runpy.run_path(script, run_name="__main__"))


if __name__ == "__main__":
    main()
