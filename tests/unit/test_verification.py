"""Each rank's share of the checks before a load: disjoint, and the metadata on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumekit.errors import CorruptCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.restore.verification import verify_share
from resumekit.store.catalog import read_manifest
from resumekit.store.storage import Storage


def _saved(root: Path) -> tuple[Storage, str]:
    model = torch.nn.Linear(3, 2)
    with CheckpointManager(root, model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                         lr=0.1)) as ckpt:
        ckpt.save(1)
        name = ckpt.checkpoints()[-1].name
    return Storage(root), name


def _failing_ranks(storage: Storage, name: str, world_size: int) -> list[int]:
    manifest = read_manifest(storage, name)
    failing = []
    for rank in range(world_size):
        try:
            verify_share(storage, name, manifest, rank=rank, world_size=world_size)
        except CorruptCheckpointError:
            failing.append(rank)
    return failing


def test_a_flipped_small_file_is_found_by_exactly_one_rank(tmp_path: Path) -> None:
    storage, name = _saved(tmp_path)
    state = tmp_path / name / "train_state.pt"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    assert len(_failing_ranks(storage, name, world_size=3)) == 1
    assert _failing_ranks(storage, name, world_size=1) == [0]


def test_the_tensor_metadata_is_checked_on_every_rank(tmp_path: Path) -> None:
    storage, name = _saved(tmp_path)
    metadata = tmp_path / name / "tensors" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0xFF
    metadata.write_bytes(bytes(data))
    assert _failing_ranks(storage, name, world_size=3) == [0, 1, 2]


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_intact_checkpoint_passes_on_every_rank(tmp_path: Path, world_size: int) -> None:
    storage, name = _saved(tmp_path)
    assert _failing_ranks(storage, name, world_size) == []
