"""Load skew reaches the checkpoint group, never a training collective.

The incident: ranks finished loading a checkpoint from NAS minutes apart and the first one
to finish timed out in the first training all-gather. Here rank 1's "load" takes three
times the training timeout. With ``meet`` at the end of the load, the training all-reduce
that follows succeeds; without it (the negative control), rank 0's all-reduce times out.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from resumekit.runtime.distributed import before_meet, init_distributed, meet, shutdown
from tests.distributed_harness import run_ranks
from tests.limits import COLLECTIVE_HANG_S, HANG_S

TRAINING_TIMEOUT_S = 3.0
SLOW_LOAD_S = 3 * TRAINING_TIMEOUT_S
HANDSHAKE_LIMIT_S = HANG_S  # a hang detector


def _wait_for(path: Path, what: str) -> str:
    """Block until another rank writes ``path`` (a real event), or fail after a long limit."""
    deadline = time.monotonic() + HANDSHAKE_LIMIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"never saw {what} ({path})")
        time.sleep(0.01)
    return path.read_text()


def _publish(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.rename(path)


def _restore_then_train(rank: int, world_size: int, shared: str) -> int:
    context = init_distributed(timeout=TRAINING_TIMEOUT_S, checkpoint_timeout=COLLECTIVE_HANG_S)
    rank0_waiting = Path(shared) / "rank0-in-meet"

    def slow_nas_load(reason: str) -> None:
        if rank == 0:
            _publish(rank0_waiting, reason)
        else:
            # Rank 0 is already waiting: keep it waiting 3x the training timeout.
            _wait_for(rank0_waiting, "rank 0 entering meet")
            time.sleep(SLOW_LOAD_S)

    with before_meet(slow_nas_load):
        meet(reason="end of restore")
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    assert context.timeout.total_seconds() == TRAINING_TIMEOUT_S
    shutdown()
    return int(total.item())


def _train_without_meeting(rank: int, world_size: int, shared: str) -> str:
    init_distributed(timeout=TRAINING_TIMEOUT_S, checkpoint_timeout=COLLECTIVE_HANG_S)
    outcome = Path(shared) / "rank0-outcome"
    if rank == 0:
        try:
            dist.all_reduce(torch.tensor([1]))
            message = "all_reduce succeeded"
        except RuntimeError as error:
            message = f"{type(error).__name__}: {error}"
        _publish(outcome, message)
    else:
        # Rank 1 is still loading until rank 0's all-reduce has given up.
        message = _wait_for(outcome, "rank 0's all-reduce outcome")
    shutdown()
    return message


def test_a_rank_loading_three_timeouts_late_does_not_break_the_first_training_collective(
    tmp_path: Path,
) -> None:
    results = run_ranks(_restore_then_train, world_size=2, args=(str(tmp_path),), init_group=False)
    assert results == [3, 3]


def test_without_meeting_the_fastest_loader_times_out_in_its_first_training_collective(
    tmp_path: Path,
) -> None:
    results = run_ranks(
        _train_without_meeting, world_size=2, args=(str(tmp_path),), init_group=False
    )
    assert results[0] == results[1]
    assert "timed out" in results[0].lower(), results[0]
