"""The local tier on 2 real gloo ranks with FSDP2, each rank its own "node".

Each rank gets a node-local directory of its own (``<tmp>/node<r>``, the same
``LocalTier.root`` a real node would see) and a node name (``RESUMEKIT_NODE_NAME``), so
that its partner is the other rank: rank 0 keeps rank 1's replicas and rank 1 rank 0's.
A first run trains and saves (durable every 4 steps, local every 2); a second run, new
processes, restores.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import resumekit
from resumekit.local.replicas import NODE_NAME_ENV
from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from tests.dist.tiny_fsdp2 import tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

STEPS = 6


def _manager(tmp: str, rank: int, model: nn.Module, opt: torch.optim.Optimizer
             ) -> resumekit.CheckpointManager:
    os.environ[NODE_NAME_ENV] = f"node{rank}"
    return resumekit.CheckpointManager(
        f"{tmp}/durable", model=model, optimizer=opt, save_every=4,
        local=resumekit.LocalTier(f"{tmp}/node{rank}", save_every=2))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and the optimizer state, copied."""
    def local(value: Any) -> Any:
        if hasattr(value, "to_local"):
            return value.to_local().detach().clone()
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    params = {name: local(value) for name, value in model.state_dict().items()}
    state = {f"{index}.{key}": local(value)
             for index, per_param in enumerate(opt.state.values())
             for key, value in per_param.items()}
    return {"model": params, "optimizer": state}


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    loss = model(torch.randn(4, 6)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _train(rank: int, world: int, tmp: str) -> dict[str, Any]:
    model, opt = tiny_fsdp2_adamw()
    with _manager(tmp, rank, model, opt) as ckpt:
        for step in range(ckpt.restore(), STEPS):
            _step(model, opt, step)
            ckpt.step_end(step + 1)
        return _snapshot(model, opt)


def _restore(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Restore, snapshot, then train to the next local save (it records the tier)."""
    model, opt = tiny_fsdp2_adamw()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _manager(tmp, rank, model, opt) as ckpt:
            step = ckpt.restore()
            tier = ckpt.restored_from_tier
            state = _snapshot(model, opt)
            for later in range(step, step + 2):
                _step(model, opt, later)
                ckpt.step_end(later + 1)
    own = Storage(f"{tmp}/node{rank}/rank_{rank:05d}")
    newest = [entry for entry in list_checkpoints(own) if entry.status == "committed"][-1]
    assert newest.manifest is not None
    return {"step": step, "tier": tier, "state": state,
            "lineage": (newest.step, newest.manifest.lineage.restored_from_tier),
            "warnings": [str(w.message) for w in caught]}


def _equal(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return first.keys() == second.keys() and all(
        torch.equal(first[key], second[key]) if isinstance(first[key], torch.Tensor)
        else first[key] == second[key] for key in first)


def _same_state(first: dict[str, Any], second: dict[str, Any]) -> bool:
    return all(_equal(first[part], second[part]) for part in ("model", "optimizer"))


def _steps_in(path: Path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("step_"))


def test_fsdp2_ranks_restore_bit_identical_from_their_own_node_local_copies(
        tmp_path: Path) -> None:
    saved = run_ranks(_train, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        kept = ["step_000000004", "step_000000006"]  # keep=2
        assert _steps_in(tmp_path / f"node{rank}" / f"rank_{rank:05d}") == kept
        assert _steps_in(tmp_path / f"node{rank}" / f"replica_of_rank_{1 - rank:05d}") == kept
    restored = run_ranks(_restore, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        assert (restored[rank]["step"], restored[rank]["tier"]) == (STEPS, "local")
        assert _same_state(restored[rank]["state"], saved[rank]), f"rank {rank} differs"
        assert restored[rank]["lineage"] == (STEPS + 2, "local")
        assert not [w for w in restored[rank]["warnings"] if "not restoring" in w]


def test_a_rank_whose_node_lost_its_copies_fetches_them_from_its_partners_replica(
        tmp_path: Path) -> None:
    saved = run_ranks(_train, world_size=2, args=(str(tmp_path),))
    shutil.rmtree(tmp_path / "node1" / "rank_00001")  # rank 1's node lost its own copies
    restored = run_ranks(_restore, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        assert (restored[rank]["step"], restored[rank]["tier"]) == (STEPS, "replica")
        assert _same_state(restored[rank]["state"], saved[rank]), f"rank {rank} differs"
        assert restored[rank]["lineage"] == (STEPS + 2, "replica")
    # The fetched copy became rank 1's own again (then its next local save joined it).
    assert _steps_in(tmp_path / "node1" / "rank_00001") == ["step_000000006",
                                                           "step_000000008"]


def test_a_rank_without_its_copy_or_a_replica_makes_every_rank_restore_from_durable(
        tmp_path: Path) -> None:
    saved = run_ranks(_train, world_size=2, args=(str(tmp_path),))
    shutil.rmtree(tmp_path / "node1" / "rank_00001")
    shutil.rmtree(tmp_path / "node0" / "replica_of_rank_00001")
    restored = run_ranks(_restore, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        assert (restored[rank]["step"], restored[rank]["tier"]) == (4, "durable")
        assert not _same_state(restored[rank]["state"], saved[rank])  # step 4, not 6
        assert restored[rank]["lineage"] == (STEPS, "durable")
    # Rank 0's own copy of step 6 was a timeline the run left: deleted, then saved again.
    assert _steps_in(tmp_path / "node0" / "rank_00000") == ["step_000000004",
                                                           "step_000000006"]


def _flip_a_byte(step_dir: Path) -> None:
    """Flip one byte in the middle of a copy's largest tensor file (only checksums tell)."""
    target = max((path for path in (step_dir / "tensors").rglob("*") if path.is_file()),
                 key=lambda path: path.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_a_rank_whose_own_copy_fails_to_verify_reads_its_partners_replica_of_that_step(
        tmp_path: Path) -> None:
    saved = run_ranks(_train, world_size=2, args=(str(tmp_path),))
    _flip_a_byte(tmp_path / "node1" / "rank_00001" / "step_000000006")
    restored = run_ranks(_restore, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        # The same step, not the older one: rank 1 read rank 0's replica of its copy.
        assert (restored[rank]["step"], restored[rank]["tier"]) == (STEPS, "replica")
        assert _same_state(restored[rank]["state"], saved[rank]), f"rank {rank} differs"
        assert restored[rank]["lineage"] == (STEPS + 2, "replica")
        said = [w for w in restored[rank]["warnings"] if "replica of step 6 instead" in w]
        assert len(said) == 1, restored[rank]["warnings"]
        assert "rank 1's copy" in said[0] and "step_000000006" in said[0], said[0]
        assert "rank 1 reads rank 0's replica" in said[0], said[0]
        assert not [w for w in restored[rank]["warnings"] if "not restoring" in w]
    # The bad copy was replaced by the replica (then the next local save joined it).
    assert _steps_in(tmp_path / "node1" / "rank_00001") == ["step_000000006",
                                                           "step_000000008"]


def test_a_copy_and_its_replica_both_failing_give_the_step_up_for_the_next_candidate(
        tmp_path: Path) -> None:
    run_ranks(_train, world_size=2, args=(str(tmp_path),))
    _flip_a_byte(tmp_path / "node1" / "rank_00001" / "step_000000006")
    _flip_a_byte(tmp_path / "node0" / "replica_of_rank_00001" / "step_000000006")
    restored = run_ranks(_restore, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        assert (restored[rank]["step"], restored[rank]["tier"]) == (4, "local")
        said = [w for w in restored[rank]["warnings"] if "not restoring step 6" in w]
        assert len(said) == 1 and "trying step 4 next" in said[0], restored[rank]["warnings"]


def _one_rank_alone(rank: int, world: int, tmp: str) -> list[str]:
    """Rank 1 saves and loads its FSDP2 shards alone while rank 0 waits in a barrier.

    A collective inside either call would pair with rank 0's barrier and fail (or time
    out): the calls take no part in any collective.
    """
    from resumekit import tensors

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 1))  # rank 1 holds empty shards
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    shapes = []
    if rank == 1:
        before = {name: value.to_local().clone() for name, value in model.state_dict().items()}
        state = tensors.model_and_optimizer_state(model, None)
        tensors.save(state, f"{tmp}/alone", alone=True)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        state = tensors.model_and_optimizer_state(model, None)
        tensors.load(state, f"{tmp}/alone", alone=True)
        tensors.apply_model_and_optimizer_state(model, None, state)
        for name, value in model.state_dict().items():
            assert torch.equal(value.to_local(), before[name]), name
            shapes.append(f"{name}{tuple(value.to_local().shape)}")
    torch.distributed.barrier()
    return shapes


def test_one_fsdp2_rank_saves_and_loads_its_own_shards_alone_without_a_collective(
        tmp_path: Path) -> None:
    results = run_ranks(_one_rank_alone, world_size=2, args=(str(tmp_path),))
    assert results[0] == []
    assert "1.weight(0, 7)" in results[1]  # an empty shard round-trips too


def test_a_run_of_another_world_size_restores_from_durable_and_says_why(
        tmp_path: Path) -> None:
    run_ranks(_train, world_size=2, args=(str(tmp_path),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))  # one process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with resumekit.CheckpointManager(
                tmp_path / "durable", model=model, save_every=4, on_mismatch="ignore",
                local=resumekit.LocalTier(tmp_path / "node0", 2)) as ckpt:
            assert ckpt.restore() == 4  # the durable root's newest, not local step 6
            assert ckpt.restored_from_tier == "durable"
    said = [str(w.message) for w in caught if "world size 2; this run has 1" in str(w.message)]
    # Rank 0's own copies of steps 4 and 6, and the replicas of rank 1's its node keeps.
    assert len(said) == 4
    assert _steps_in(tmp_path / "node0" / "rank_00000") == []  # deleted, as said
