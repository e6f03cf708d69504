"""``resumekit inspect`` names other tools' checkpoints and never calls them "no checkpoints"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.test_cli_inspect import ENTRY_KEYS
from tests.unit.test_cli_support import assert_one_error_line, run_cli, run_json, write_checkpoints


def _touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _hf_trainer(directory: Path, step: int = 4) -> None:
    _touch(directory / "trainer_state.json", json.dumps({"global_step": step}).encode())
    _touch(directory / "model.safetensors")


def _dcp_save(directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... single process"
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(directory))


def test_inspect_on_a_root_of_foreign_checkpoints_lists_them_and_exits_1_with_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _dcp_save(tmp_path / "step-20")
    _touch(tmp_path / "accelerate" / "optimizer.bin")
    code, out, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1
    assert "foreign torchtitan" in out and "foreign accelerate" in out
    command = f"resumekit import {tmp_path / 'step-20'} {tmp_path} --format torchtitan"
    assert f"Convert it with: {command}" in " ".join(out.split())
    assert_one_error_line(err, "no resumekit checkpoint", command)

    code, document, err = run_json(capsys, "inspect", str(tmp_path))
    assert code == 1
    rows = {row["name"]: row for row in document["checkpoints"]}
    assert {name: (row["status"], row["format"], row["step"]) for name, row in rows.items()} \
        == {"accelerate": ("foreign", "accelerate", -1),
            "step-20": ("foreign", "torchtitan", 20)}
    assert all(set(row) >= ENTRY_KEYS for row in rows.values())  # only added to
    assert document["resume_from"] is None and document["foreign"] is None
    assert_one_error_line(err, command)


def test_inspect_on_a_root_with_committed_and_foreign_checkpoints_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    write_checkpoints(tmp_path, [10])
    _hf_trainer(tmp_path / "checkpoint-4")
    code, document, err = run_json(capsys, "inspect", str(tmp_path))
    assert code == 0, err
    statuses = {row["name"]: (row["status"], row["format"]) for row in document["checkpoints"]}
    assert statuses == {"checkpoint-4": ("foreign", "hf-trainer"),
                        "step_000000010": ("committed", None)}
    assert document["resume_from"] == 10


def test_inspect_on_a_directory_that_is_an_hf_trainer_checkpoint_says_so_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    checkpoint = tmp_path / "checkpoint-4"
    _hf_trainer(checkpoint)
    code, out, err = run_cli(capsys, "inspect", str(checkpoint))
    assert code == 1
    assert "No checkpoints" not in out
    flat = " ".join(out.split())
    assert "is a foreign checkpoint: hf-trainer (step 4" in flat
    command = (f"resumekit import {checkpoint} {checkpoint}-resumekit --format hf-trainer")
    assert command in flat
    assert_one_error_line(err, "hf-trainer", command)

    code, document, _ = run_json(capsys, "inspect", str(checkpoint))
    assert code == 1
    assert document["checkpoints"] == []
    assert document["foreign"] == {
        "path": str(checkpoint), "format": "hf-trainer", "step": 4,
        "marker": "trainer_state.json", "command": command}


def test_inspect_on_a_plain_dcp_directory_asks_for_the_step_it_cannot_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _dcp_save(tmp_path / "exported")
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "exported"))
    assert code == 1
    assert "no step recorded" in out
    assert_one_error_line(err, "--format dcp --step N")
