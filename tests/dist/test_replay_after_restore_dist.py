"""The first save after a restore, on 2 real FSDP2 ranks: replayed from the checkpoint read.

A fresh process (a relaunch after a preemption) remembers no planned save; with
``sharded.remember_restored`` its first save replays the restored checkpoint's layout.
It must write exactly what DCP's planned save writes, plan in full (on every rank, saying
why) when the state is not the checkpoint's, and plan in full instead of failing when the
files come out unlike the record.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumekit.tensors import save_planner, sharded
from tests.dist.test_replayed_save_dist import _counting_dcp_saves, _files, _more, _said
from tests.dist.test_save_planner_dist import _flat, _reload_matches, _state, counting_calls
from tests.dist.test_sharded_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def _fresh_process() -> None:
    """Forget every plan and record, and every count: as a relaunched process starts."""
    save_planner.forget_plans()
    save_planner._COMPLETED.clear()


def _restored(root: str, name: str, world_size: int, **more: Any
              ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh process's model and optimizer, restored from ``root/name``, remembered."""
    _fresh_process()
    model, optimizer = build("transformer", seed=7, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=7)  # optimizer state to load into
    target = _state(model, optimizer, **{
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else ""
        for key, value in more.items()})
    sharded.load(target, Path(root) / name)
    sharded.remember_restored(Path(root) / name)
    return model, optimizer


def _first_save_after_restore(rank: int, world_size: int, root: str) -> dict[str, Any]:
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer, **_more(0)), Path(root) / "restored")
    model, optimizer = _restored(root, "restored", world_size, **_more(0))
    train_step(model, optimizer, "transformer", seed=1)
    state = _state(model, optimizer, **_more(1))
    before = dcp_calls[0]
    written = sharded.save(state, Path(root) / "seeded")
    seeded_calls = dcp_calls[0] - before
    second = sharded.save(state, Path(root) / "seeded-again")  # the adopted key replays
    again_calls = dcp_calls[0] - before - seeded_calls
    _fresh_process()  # the same state the long way
    planned = sharded.save(state, Path(root) / "planned")
    dist.barrier()
    return {"dcp_calls": (seeded_calls, again_calls),
            "same_files": _files(Path(root) / "seeded") == _files(Path(root) / "planned"),
            "same_written": written == planned and second == planned,
            "reloads": _reload_matches(Path(root) / "seeded", _flat(state), _more(1))}


def test_the_first_save_after_a_restore_writes_every_byte_dcps_planned_save_writes(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_first_save_after_restore, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["dcp_calls"] == (0, 0), (rank, result)  # no DCP save after restoring
        assert result["same_files"], rank  # data, checksum and .metadata files
        assert result["same_written"], rank
        assert result["reloads"], rank


def _unlike_state(rank: int, world_size: int, root: str) -> dict[str, Any]:
    said = _said()
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer), Path(root) / "restored")
    model, optimizer = _restored(root, "restored", world_size)
    counts, reloads = [], []
    for number in range(2):  # a key the checkpoint lacks, then the same state again
        train_step(model, optimizer, "transformer", seed=number + 1)
        more: dict[str, Any] = {"extra": torch.full((3,), float(number))}
        state = _state(model, optimizer, **more)
        before = dcp_calls[0]
        sharded.save(state, Path(root) / f"save{number}")
        counts.append(dcp_calls[0] - before)
        reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), more))
    return {"dcp_calls": counts, "reloads": reloads, "said": said}


def test_a_state_unlike_the_restored_checkpoint_is_planned_in_full_saying_why(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_unlike_state, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["dcp_calls"] == [1, 0], (rank, result)  # then the plan replays
        assert result["reloads"] == [True, True], (rank, result)
        (said,) = result["said"]
        assert "save0" in said and "planned in full, not replayed" in said, said
        assert "the restored checkpoint" in said, said


def _unlike_layout(rank: int, world_size: int, root: str) -> dict[str, Any]:
    said = _said()
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer, **_more(0)), Path(root) / "restored")
    model, optimizer = _restored(root, "restored", world_size, **_more(0))
    if rank == 1:  # as a checkpoint of an older layout would: one item elsewhere
        slot, = [slot for slot in save_planner._REPLAYS]
        record = save_planner.replay_record(slot)
        index = next(iter(record.stored))
        moved = dataclasses.replace(record.stored[index],
                                    offset=record.stored[index].offset + 4096)
        save_planner._REPLAYS[slot] = dataclasses.replace(
            record, stored={**record.stored, index: moved})
    removed = counting_calls(__import__("os"), "remove")
    train_step(model, optimizer, "transformer", seed=1)
    state = _state(model, optimizer, **_more(1))
    before = dcp_calls[0]
    sharded.save(state, Path(root) / "save")
    return {"dcp_calls": dcp_calls[0] - before, "removed": removed[0], "said": said,
            "reloads": _reload_matches(Path(root) / "save", _flat(state), _more(1))}


def test_files_that_come_out_unlike_the_record_are_removed_and_the_save_planned_in_full(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_unlike_layout, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["dcp_calls"] == 1, (rank, result)  # planned in full, not failed
        assert result["removed"] >= 1, (rank, result)  # each rank its replayed files
        assert result["reloads"], (rank, result)
        (said,) = [line for line in result["said"] if "unlike the record" in line]
        assert "rank 1's item" in said and "planned in full" in said, said


def _manager_relaunch(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from resumekit import CheckpointManager  # noqa: PLC0415 - in this rank's process

    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    first = CheckpointManager(root, model=model, optimizer=optimizer)
    first.save(1)
    first.close()
    _fresh_process()  # the relaunch
    model, optimizer = build("transformer", seed=5, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=5)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    restored = manager.restore()
    train_step(model, optimizer, "transformer", seed=1)
    before = dcp_calls[0]
    manager.save(2)
    manager.close()
    return {"restored": restored, "dcp_calls": dcp_calls[0] - before}


def test_a_relaunched_manager_replays_its_first_save_from_the_checkpoint_it_restored(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_manager_relaunch, world_size=2,
                                            args=(str(tmp_path),))):
        assert result == {"restored": 1, "dcp_calls": 0}, (rank, result)


def _checksum_mismatch(rank: int, world_size: int, root: str) -> dict[str, Any]:
    said = _said("resumekit")
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer), Path(root) / "restored")
    _fresh_process()
    sharded.remember_restored(Path(root) / "restored", metadata_checksum="xxh3_128:00")
    before = dcp_calls[0]
    sharded.save(_state(model, optimizer), Path(root) / "next")
    return {"dcp_calls": dcp_calls[0] - before,
            "said": [line for line in said if "after restoring" in line]}


def test_metadata_unlike_the_manifests_checksum_is_not_replayed_and_says_so(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_checksum_mismatch, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["dcp_calls"] == 1, (rank, result)  # planned in full, on both ranks
        (said,) = result["said"]
        assert "restored" in said and "does not match the manifest's checksum" in said, said
