"""A 2-rank FSDP2 checkpoint written before the layout move (8e7662e) restores today.

On the two ranks that wrote it (each rank gets its own shards, random streams and the
global sampler position back) and on one rank (resharding: the full tensors are the same,
rank 0's streams are restored, the change of world size is said). Every value is compared
with ``tests/fixtures/format_0_2/expected.json``, then the run commits the next step.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from resumekit import CheckpointManager, ResumableDistributedSampler
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks
from tests.fixtures.format_0_2 import fixture_state as fs

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format_0_2"


def _manager(root: str) -> tuple[CheckpointManager, tuple[Any, ...]]:
    model, optimizer, scheduler, noise = fs.sharded_objects()
    sampler = ResumableDistributedSampler(len(fs.FEATURES), seed=3)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=scheduler,
                                data=sampler, generators={"noise": noise}, config=fs.CONFIG,
                                retention=None)
    return manager, (model, optimizer, scheduler, sampler, noise)


def _restore_and_go_on(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager, (model, optimizer, scheduler, sampler, noise) = _manager(root)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resume = manager.restore()
    got = {"resume_step": resume, **fs.tensor_values(model, optimizer),
           "scheduler": fs.scheduler_values(scheduler), "sampler": sampler.state_dict(),
           "draws": fs.next_draws(noise)}
    fs.sharded_step(model, optimizer, scheduler, sampler, noise,
                    iter(sampler))
    manager.save(resume + 1)
    after = fs.tensor_values(model, optimizer)
    manager.close()
    fresh, again = _manager(root)
    resumed = fresh.restore()
    fresh.close()
    return {"got": json.loads(json.dumps(got)),
            "said": [str(w.message) for w in said if issubclass(w.category, ResumekitWarning)],
            "committed": [(e.step, e.status) for e in manager.checkpoints()],
            "next": resumed, "same_after": fs.tensor_values(again[0], again[1]) == after}


@pytest.mark.parametrize("world_size", [2, 1], ids=["two_ranks", "one_rank"])
def test_an_fsdp2_root_of_0_2_restores_every_value_on_two_ranks_and_resharded_on_one(
        tmp_path: Path, world_size: int) -> None:
    root = shutil.copytree(FIXTURE / "fsdp2", tmp_path / "fsdp2")
    expected = json.loads((FIXTURE / "expected.json").read_text())["fsdp2"]["steps"]["3"]
    results = run_ranks(_restore_and_go_on, world_size=world_size, args=(str(root),))
    for rank, result in enumerate(results):
        got = result["got"]
        assert got["resume_step"] == expected["resume_step"] == 3
        for key in ("model", "optimizer", "param_groups", "scheduler"):
            assert got[key] == expected[key], (rank, key)
        assert got["sampler"] == {**expected["sampler"], "num_replicas": world_size}
        assert got["draws"] == expected["draws"][rank]  # each rank's own streams
        assert result["committed"] == [(3, "committed"), (4, "committed")]
        assert result["next"] == 4 and result["same_after"], rank
        if world_size == 2:
            assert result["said"] == [], rank
        else:  # a world-size change is never silent
            assert any("written by 2 rank(s)" in message and "resharded" in message
                       for message in result["said"]), result["said"]
