"""A manager's restore on 2 real FSDP2 ranks: each rank plans its own reads, all agree.

DCP's load plans need no coordination, so the manager loads with ``plan_locally``: no
plan gather or scatter, one all-gather of the outcome instead. A rank that fails its part
must still fail the checkpoint on every rank, and every rank falls back together.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from resumekit import CheckpointManager, tensors
from resumekit.tensors import state_dicts
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.tensors.reader import make_reader
from tests.dist.test_save_planner_dist import counting_calls
from tests.dist.test_tensors_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
            for name, value in model.state_dict().items()}


def _one_rank_reads_a_damaged_shard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    train_step(model, optimizer, "transformer", seed=0)
    manager.save(1)
    saved = _weights(model)
    train_step(model, optimizer, "transformer", seed=1)
    manager.save(2)
    manager.close()
    if rank == 0:  # rank 1's own shard file of step 2: only rank 1 reads it
        (shard,) = (Path(root) / "step_000000002" / "tensors").glob("__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    scatters = counting_calls(dist, "scatter_object_list")
    model, optimizer = build("transformer", seed=9, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=9)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.restore()
    manager.close()
    got = _weights(model)
    return {"restored": restored, "scatters": scatters[0],
            "same": all(torch.equal(got[key], saved[key]) for key in saved),
            "said": [str(warning.message) for warning in caught]}


def test_a_shard_damaged_for_one_rank_fails_the_checkpoint_on_every_rank_which_fall_back(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_one_rank_reads_a_damaged_shard, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["restored"] == 1, (rank, result)  # both ranks fell back to step 1
        assert result["same"], rank
        assert result["scatters"] == 0, (rank, result)  # no DCP plan scatter
        assert any("step_000000002" in said and "__1_0.distcp" in said
                   for said in result["said"]), (rank, result["said"])


def _local_plan_against_dcps(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    tensors.save(state_dicts.model_and_optimizer_state(model, optimizer), root)
    metadata = make_reader(root, None).read_metadata()
    plans = []
    for planner in (_CheckedLoadPlanner(root, reject_unexpected=True),
                    DefaultLoadPlanner(flatten_state_dict=True, allow_partial_load=False)):
        planner.set_up_planner(state_dicts.model_and_optimizer_state(model, optimizer), metadata,
                               is_coordinator=rank == 0)
        plans.append(planner.create_local_plan().items)
    ours, dcps = plans
    return {"same": ours == dcps, "items": len(ours),
            "dtensors": sum(isinstance(value, torch.distributed.tensor.DTensor)
                            for value in tensors.flatten_state(
                                state_dicts.model_and_optimizer_state(model, optimizer)).values())}


def test_a_restores_local_plan_is_exactly_dcps_default_local_load_plan(tmp_path: Path) -> None:
    for result in run_ranks(_local_plan_against_dcps, world_size=2, args=(str(tmp_path),)):
        assert result["same"], result
        assert result["dtensors"] > 20, result  # the memoized chunks were used, many times
