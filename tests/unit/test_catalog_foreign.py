"""Other tools' checkpoints are recognised by their own markers, never taken for ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from resumekit.errors import ForeignCheckpointError
from resumekit.store.catalog import list_checkpoints
from resumekit.store.foreign import detect_foreign
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage


def _touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def foreign_root(tmp_path: Path) -> Path:
    with pytest.warns(UserWarning):  # DCP: "assuming ... a single process"
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "step-20"))
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain_dcp"))
    _touch(tmp_path / "checkpoint-4" / "trainer_state.json", json.dumps(
        {"global_step": 4}).encode())
    _touch(tmp_path / "checkpoint-4" / "model.safetensors")
    _touch(tmp_path / "checkpoints" / "checkpoint_0" / "optimizer.bin")
    _touch(tmp_path / "accelerate_state" / "random_states_0.pkl")
    _touch(tmp_path / "epoch=0-step=7.ckpt")
    _touch(tmp_path / "data" / "notes.txt")
    return tmp_path


def test_each_foreign_format_is_listed_with_its_format_and_step(foreign_root: Path) -> None:
    found = {e.name: (e.status, e.format, e.step)
             for e in list_checkpoints(Storage(foreign_root))}
    assert found == {
        "step-20": ("foreign", "torchtitan", 20),
        "plain_dcp": ("foreign", "dcp", -1),
        "checkpoint-4": ("foreign", "hf-trainer", 4),
        "accelerate_state": ("foreign", "accelerate", -1),
        "checkpoints/checkpoint_0": ("foreign", "accelerate", -1),
        "epoch=0-step=7.ckpt": ("foreign", "lightning", 7),
    }


def test_a_directory_without_markers_is_not_foreign(foreign_root: Path) -> None:
    assert detect_foreign(Storage(foreign_root), "data") is None
    assert detect_foreign(Storage(foreign_root), "checkpoints") is None  # markers are a level down


def test_the_root_itself_can_be_recognised(foreign_root: Path) -> None:
    found = detect_foreign(Storage(foreign_root / "checkpoint-4"))
    assert found is not None
    assert (found.format, found.step, found.marker) == ("hf-trainer", 4, "trainer_state.json")


def test_a_foreign_directory_named_like_ours_is_foreign_not_partial(tmp_path: Path) -> None:
    _touch(tmp_path / "checkpoint-4" / "trainer_state.json", b"{}")
    (entry,) = list_checkpoints(Storage(tmp_path), NameFormat("checkpoint-{step}"))
    assert (entry.status, entry.format, entry.step) == ("foreign", "hf-trainer", 4)



def test_checkpoints_one_level_down_in_a_checkpoints_folder_are_found(tmp_path: Path) -> None:
    # Accelerate's automatic naming and Lightning's ModelCheckpoint default both save into
    # <project>/checkpoints/: a root pointed at the project must not look empty.
    _touch(tmp_path / "checkpoints" / "checkpoint_3" / "random_states_0.pkl")
    _touch(tmp_path / "checkpoints" / "epoch=1-step=40.ckpt")
    _touch(tmp_path / "checkpoints" / "notes.txt")
    found = {e.name: (e.status, e.format, e.step) for e in list_checkpoints(Storage(tmp_path))}
    assert found == {
        "checkpoints/checkpoint_3": ("foreign", "accelerate", -1),
        "checkpoints/epoch=1-step=40.ckpt": ("foreign", "lightning", 40),
    }


def test_restore_in_an_accelerate_project_folder_refuses_to_start_from_zero(
        tmp_path: Path) -> None:
    import resumekit

    _touch(tmp_path / "checkpoints" / "checkpoint_0" / "optimizer.bin")
    with pytest.raises(ForeignCheckpointError, match=r"checkpoint_0.*--step"):
        resumekit.CheckpointManager(tmp_path).restore()
