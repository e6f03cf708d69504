"""The manager's restore ends with every rank meeting on the checkpoint group.

The same scenario as ``test_load_skew.py``, through ``CheckpointManager.restore()`` on a
real FSDP2 checkpoint: rank 1's load takes three training timeouts longer than rank 0's,
and the first training collective after restore still succeeds.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from resumekit.manager import CheckpointManager
from resumekit.runtime.distributed import before_meet, init_distributed, shutdown
from tests.dist.test_load_skew import SLOW_LOAD_S, TRAINING_TIMEOUT_S, _publish, _wait_for
from tests.distributed_harness import run_ranks
from tests.limits import COLLECTIVE_HANG_S


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    return model


def _save_restore_then_train(rank: int, world_size: int, shared: str) -> tuple[int, float]:
    context = init_distributed(timeout=TRAINING_TIMEOUT_S, checkpoint_timeout=COLLECTIVE_HANG_S)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    ckpt = CheckpointManager(Path(shared) / "ckpt", model=model, optimizer=opt)
    ckpt.save(7)
    ckpt.close()
    rank0_waiting = Path(shared) / "rank0-in-meet"

    def slow_nas_load(reason: str) -> None:
        if rank == 0:
            _publish(rank0_waiting, reason)
        else:
            _wait_for(rank0_waiting, "rank 0 entering meet")
            time.sleep(SLOW_LOAD_S)  # the slow NAS of the incident, in the test only

    resumed = CheckpointManager(Path(shared) / "ckpt", model=_model(),
                                optimizer=None)
    started = time.monotonic()
    with before_meet(slow_nas_load):
        step = resumed.restore()
    waited = time.monotonic() - started
    loss = model(torch.ones(2, 8)).sum()
    loss.backward()  # FSDP2 all-gathers and reduce-scatters on the short-timeout group
    total = torch.tensor([step])
    dist.all_reduce(total)
    resumed.close()
    assert context.timeout.total_seconds() == TRAINING_TIMEOUT_S
    shutdown()
    return int(total.item()), waited


def test_restore_absorbs_load_skew_of_three_training_timeouts(tmp_path: Path) -> None:
    results = run_ranks(_save_restore_then_train, 2, args=(str(tmp_path),), init_group=False)
    assert [total for total, _ in results] == [14, 14]
    assert results[0][1] >= SLOW_LOAD_S  # rank 0 really waited, inside restore()
