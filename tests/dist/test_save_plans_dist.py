"""Remembered save plans on 2 real FSDP2 ranks (gloo, CPU; issue 40).

A collective save whose every rank's layout is unchanged writes each rank's remembered
final plan and rank 0's remembered metadata (its ``.metadata`` bytes too, where the write
results are the same); a dtype, a shape or a key changed on one rank only plans that save
in full on every rank; every save reloads exactly what was saved, in its own layout.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from resumekit import tensors
from resumekit.tensors.plans import SavePlans
from tests.dist.test_save_planner_dist import _flat, _reload_matches, _state
from tests.dist.test_tensors_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def _counts(plans: SavePlans) -> tuple[int, ...]:
    return (plans.misses, plans.hits, plans.global_misses, plans.global_hits, plans.replans,
            plans.metadata_reused)


def _saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    counts, snapshots = [], []
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("resumekit").addHandler(handler)
    logging.getLogger("resumekit").setLevel(logging.INFO)
    for number in range(8):
        train_step(model, optimizer, "transformer", seed=number)
        more: dict[str, Any] = {f"counter{rank}": torch.tensor([number, rank])}
        if number >= 2 and rank == 1:  # a key added on rank 1 only (kept after)
            more["only_on_rank_1"] = torch.arange(3.0) + number
        if number >= 4 and rank == 1:  # a dtype changed on rank 1 only, at the same shape
            more[f"counter{rank}"] = torch.tensor([number, rank], dtype=torch.int32)
        if number >= 6 and rank == 0:  # a shape changed on rank 0 only
            more[f"counter{rank}"] = torch.tensor([number, rank, 7])
        state = _state(model, optimizer, **more)
        tensors.save(state, Path(root) / f"save{number}", plans=plans)
        counts.append(_counts(plans))
        snapshots.append((_flat(state), more))
    return {"counts": counts,
            "replanned": sorted(int(m.split("save")[-1].split(":")[0]) for m in said
                                if "planned again in full" in m),
            "reloads": [_reload_matches(Path(root) / f"save{number}", want, more)
                        for number, (want, more) in enumerate(snapshots)]}


def test_a_collective_save_reuses_plans_only_while_no_rank_changed_its_layout(
        tmp_path: Path) -> None:
    results = run_ranks(_saves, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert result["reloads"] == [True] * 8, result
    # (misses, hits) on each rank after each save: a change on one rank plans in full on both
    misses_hits = [(1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (4, 3), (4, 4)]
    for result in results:
        assert [count[:2] for count in result["counts"]] == misses_hits, result["counts"]
    coordinator = [count[2:] for count in results[0]["counts"]]
    # (global misses, global hits, saves planned again, .metadata bytes reused) on rank 0:
    # each change came as one rank's plan beside the other's marker, so planned again
    assert coordinator == [(1, 0, 0, 0), (1, 1, 0, 1), (2, 1, 1, 1), (2, 2, 1, 2),
                           (3, 2, 2, 2), (3, 3, 2, 3), (4, 3, 3, 3), (4, 4, 3, 4)], coordinator
    assert [count[2:] for count in results[1]["counts"]] == [(0, 0, 0, 0)] * 8
    for result in results:  # each save planned again is said, naming its directory
        assert result["replanned"] == [2, 4, 6], result["replanned"]


def _manager_saves(rank: int, world_size: int, root: str, async_save: bool
                   ) -> dict[str, Any]:
    from resumekit.manager import CheckpointManager  # noqa: PLC0415 - in the rank's process

    model, optimizer = build("transformer", seed=0, world_size=world_size)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                                async_save=async_save)
    for step in range(1, 4):
        train_step(model, optimizer, "transformer", seed=step)
        manager.save(step)
        manager.wait()
    channel = manager._saver if async_save else manager._main
    counts = _counts(manager._save_plans.of(channel))
    want = _flat(_state(model, optimizer))
    manager.close()
    fresh, fresh_optimizer = build("transformer", seed=5, world_size=world_size)
    train_step(fresh, fresh_optimizer, "transformer", seed=5)
    restorer = CheckpointManager(root, model=fresh, optimizer=fresh_optimizer)
    restored = restorer.restore()
    got = _flat(_state(fresh, fresh_optimizer))
    restorer.close()
    return {"counts": counts, "restored": restored, "same": got.keys() == want.keys()
            and all(torch.equal(got[key], value) if isinstance(value, torch.Tensor)
                    else got[key] == value for key, value in want.items())}


def test_a_managers_periodic_saves_of_an_fsdp2_model_reuse_plans_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_manager_saves, world_size=2, args=(str(tmp_path / "sync"), False))
    for result in results:
        assert result["restored"] == 3 and result["same"], result
    assert results[0]["counts"] == (1, 2, 1, 2, 0, 2), results[0]
    assert results[1]["counts"] == (1, 2, 0, 0, 0, 0), results[1]


def test_background_saves_of_an_fsdp2_model_reuse_plans_on_their_own_channel(
        tmp_path: Path) -> None:
    results = run_ranks(_manager_saves, world_size=2, args=(str(tmp_path / "async"), True))
    for result in results:
        assert result["restored"] == 3 and result["same"], result
    assert results[0]["counts"] == (1, 2, 1, 2, 0, 2), results[0]
    assert results[1]["counts"] == (1, 2, 0, 0, 0, 0), results[1]
