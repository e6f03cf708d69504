"""Run a training script under torchrun with the hooks the Accelerate drill needs.

``python -m torch.distributed.run ... tests/dist/accelerate_drill.py SCRIPT OUT`` runs
SCRIPT (the Accelerate example of docs/integrations.md, unchanged) in this process and
writes ``OUT/rank_<r>.pt``: how the script ended (exit status), what ``restore`` and
``load_weights`` returned, the data position at every ``step_end``, and the state the
manager held at ``close`` (model, optimizer, scheduler group, sampler, this process's RNG).

Environment:
    DRILL_PAUSE_AT: before ``step_end`` of this step, wait for the pending background save
        to commit, write ``OUT/paused_<r>`` and wait until a preemption signal is recorded
        (the test sends SIGTERM, or SIGKILLs the whole tree while the ranks wait).
    DRILL_SYNC: "1" makes every save synchronous (the reference run).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch

from resumekit.manager import CheckpointManager
from tests.distributed_harness import say_paused
from tests.limits import HANG_S

WAIT_S = HANG_S  # a hang detector: the test signals at once


def main() -> None:
    script, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    pause_at = int(os.environ.get("DRILL_PAUSE_AT", "0")) or None
    record: dict[str, Any] = {"positions": [], "exit": 0}
    originals = {name: getattr(CheckpointManager, name)
                 for name in ("__init__", "restore", "load_weights", "step_end", "close")}

    def init(self: CheckpointManager, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("DRILL_SYNC") == "1":
            kwargs["async_save"] = False
        originals["__init__"](self, *args, **kwargs)

    def restore(self: CheckpointManager, *args: Any, **kwargs: Any) -> int:
        record["restored"] = originals["restore"](self, *args, **kwargs)
        return int(record["restored"])

    def load_weights(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        record["loaded"] = originals["load_weights"](self, *args, **kwargs)
        record["model_after_load"] = _copy(self.state.model.module.state_dict())
        return record["loaded"]

    def step_end(self: CheckpointManager, step: int, *args: Any, **kwargs: Any) -> bool:
        data = self.state.data
        record["positions"].append((step, data.epoch, data.consumed))
        if step == pause_at:
            self.wait()  # the interval save before this step is committed
            say_paused(out, rank, step)
            deadline = time.monotonic() + WAIT_S
            while self.preemption is None or not self.preemption.requested:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}: no signal {WAIT_S}s after step {step}")
                time.sleep(0.01)
        return bool(originals["step_end"](self, step, *args, **kwargs))

    def close(self: CheckpointManager) -> None:
        originals["close"](self)
        state = self.state
        record["final"] = {
            "model": _copy(state.model.module.state_dict() if hasattr(state.model, "module")
                           else state.model.state_dict()),
            "optimizer": state.optimizer.state_dict(),
            "group": state.scheduler.state_dict(),
            "data": state.data.state_dict(),
            "rng": torch.get_rng_state(),
            "step": state.step,
        }

    for name, replacement in (("__init__", init), ("restore", restore),
                              ("load_weights", load_weights), ("step_end", step_end),
                              ("close", close)):
        setattr(CheckpointManager, name, replacement)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        record["exit"] = stop.code
        raise
    finally:
        torch.save(record, out / f"rank_{rank}.pt")


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


if __name__ == "__main__":
    main()
