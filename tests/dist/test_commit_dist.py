"""The commit protocol on two gloo ranks: one manifest for both, collisions on both.

Multi-process, so it lives in the dist layer; the one-process protocol tests are
tests/unit/test_commit.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from resumekit.errors import StepCollisionError
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.coordination import ProcessGroupCoordinator
from resumekit.store.layout import GENERATIONS_DIR
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage
from tests.distributed_harness import run_ranks


def _entries(root: Path) -> list[str]:
    """The root's entries besides the writer-generation records the first begin claims."""
    return sorted(name for name in os.listdir(root) if name != GENERATIONS_DIR)


def _two_rank_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    store = Storage(root)
    protocol = CommitProtocol(store, coordinator=ProcessGroupCoordinator())
    pending = protocol.begin(10)
    store.write_bytes(f"{pending.staging}/shards/rank{rank}.bin",
                      f"shard of rank {rank} ".encode() * (rank + 1))
    committed = protocol.publish(pending, Manifest(step=10, world_size=world_size))
    outcome: dict[str, Any] = {"staging": pending.staging,
                               "manifest": committed.model_dump_json()}
    for step in (10, 9):
        try:
            protocol.begin(step)
        except StepCollisionError as error:
            outcome[f"collision_{step}"] = (type(error).__name__, error.step, error.newest)
        else:
            outcome[f"collision_{step}"] = None
    return outcome


@pytest.fixture(scope="module")
def two_rank_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("two-ranks")
    results = run_ranks(_two_rank_save, world_size=2, args=(str(root),))
    return root, results


def test_two_ranks_write_their_own_files_and_see_the_same_manifest(
    two_rank_save: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, (rank0, rank1) = two_rank_save
    assert rank0["staging"] == rank1["staging"]
    assert rank0["manifest"] == rank1["manifest"]
    store = Storage(root)
    manifest = verify_checkpoint(store, "step_000000010")
    assert manifest.model_dump_json() == rank0["manifest"]
    assert manifest.world_size == 2
    assert [(f.path, f.size) for f in manifest.files] == [
        ("shards/rank0.bin", len("shard of rank 0 ")),
        ("shards/rank1.bin", 2 * len("shard of rank 1 ")),
    ]
    assert _entries(root) == ["step_000000010"]


def test_a_collision_raises_on_both_ranks_instead_of_hanging(
    two_rank_save: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = two_rank_save
    for outcome in results:
        assert outcome["collision_10"] == ("StepCollisionError", 10, 10)
        assert outcome["collision_9"] == ("StepCollisionError", 9, 10)
    assert [entry.status for entry in list_checkpoints(Storage(root))] == ["committed"]
