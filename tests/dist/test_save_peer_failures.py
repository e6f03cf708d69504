"""A peer that dies or hangs in the middle of a save: the survivor's error says what happened.

Two real gloo ranks. Rank 1 enters the save of step 5 and then either leaves the process
(``os._exit``: a crash, an OOM kill) or stops answering past a short ``checkpoint_timeout``.
Rank 0 must get a ``CoordinationError`` naming the save, the step, the ranks and the
timeout - not gloo's raw ``Connection closed by peer`` / ``Application timeout caused pair
closure`` - and nothing may be committed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resumekit import tensors
from resumekit.errors import CoordinationError
from resumekit.manager import CheckpointManager
from resumekit.runtime.distributed import init_distributed
from tests.distributed_harness import run_ranks
from tests.limits import COLLECTIVE_HANG_S, HANG_S

# Short, so that the hung peer is given up on quickly; the ranks meet on the training group
# (a hang detector's timeout) before each checkpoint-group step, so a rank slowed by machine
# load never runs into it.
CHECKPOINT_TIMEOUT_S = 10
RELEASE_LIMIT_S = HANG_S  # a hang detector
FAILING_RANK = 1


def _save_with_a_failing_peer(rank: int, world_size: int, root: str, how: str
                              ) -> dict[str, Any] | None:
    init_distributed(timeout=COLLECTIVE_HANG_S, checkpoint_timeout=CHECKPOINT_TIMEOUT_S)
    torch.manual_seed(0)
    dist.barrier()
    model = nn.Linear(8, 8)
    manager = CheckpointManager(root, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    release = Path(root).parent / "release"
    if rank == FAILING_RANK:
        def fail(*args: Any, **kwargs: Any) -> Any:
            if how == "dies":
                os._exit(0)
            deadline = time.monotonic() + RELEASE_LIMIT_S  # hung until the survivor is done
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)

        tensors.save = fail  # rank 1 enters the save of step 5, then fails inside it
    dist.barrier()
    try:
        manager.save(5)
    except CoordinationError as error:
        release.write_text("done")
        return {"type": type(error).__name__, "message": str(error),
                "fields": {key: value for key, value in error.fields.items()
                           if isinstance(value, (int, float, str, list))},
                "cause": repr(error.__cause__)}
    finally:
        release.write_text("done")
    return {"type": "none", "message": "the save succeeded", "fields": {}, "cause": ""}


def _survivor(tmp_path: Path, how: str) -> dict[str, Any]:
    root = tmp_path / "root"
    results = run_ranks(_save_with_a_failing_peer, world_size=2, args=(str(root), how),
                        init_group=False, may_exit={FAILING_RANK})
    survivor = results[0]
    assert survivor is not None
    assert not list(root.glob("*5/manifest.json")), "nothing may be committed"
    return survivor


def test_a_peer_that_dies_mid_save_is_a_coordination_error_naming_the_save_step_and_ranks(
    tmp_path: Path,
) -> None:
    error = _survivor(tmp_path, "dies")
    assert error["type"] == "CoordinationError", error
    message = error["message"]
    assert message.startswith("save of step 5 failed on rank 0 of 2"), message
    assert "rank(s) [1] closed its connection (it died" in message
    assert f"checkpoint_timeout={CHECKPOINT_TIMEOUT_S} s" in message
    assert error["fields"]["step"] == 5
    assert (error["fields"]["rank"], error["fields"]["peers"]) == (0, [1])


def test_a_peer_that_hangs_mid_save_past_the_checkpoint_timeout_is_a_coordination_error(
    tmp_path: Path,
) -> None:
    error = _survivor(tmp_path, "hangs")
    assert error["type"] == "CoordinationError", error
    message = error["message"]
    assert message.startswith("save of step 5 failed on rank 0 of 2"), message
    assert (f"rank(s) [1] did not answer within checkpoint_timeout={CHECKPOINT_TIMEOUT_S} s"
            in message)
    assert error["fields"]["checkpoint_timeout"] == CHECKPOINT_TIMEOUT_S
