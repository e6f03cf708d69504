"""``resumekit inspect`` on roots, single checkpoints, and everything that is not one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from resumekit.cli import main
from resumekit.errors import CheckpointNotFoundError
from resumekit.manager import CheckpointManager
from tests.unit.test_cli_support import (
    Trainer,
    assert_one_error_line,
    run_cli,
    run_json,
    slurm_env,
    write_checkpoints,
)

ENTRY_KEYS = {"step", "name", "status", "path", "bytes", "files", "world_size", "created_at",
              "reason", "lineage", "problem", "resume_from", "seconds_since_previous"}


@pytest.fixture(scope="module")
def requeued_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 10, 20 by job 111322; preempted; 30 by job 111606 after resuming from 20.

    Also a staging directory left by a killed save (partial) and a legacy weights-only
    ``checkpoint_step_5`` directory.
    """
    root = tmp_path_factory.mktemp("requeued") / "run"
    with slurm_env("111322", 0):
        trainer = Trainer(root)
        trainer.save(10)
        trainer.save(20, reason="preemption")
        trainer.close()
    with slurm_env("111606", 1):
        resumed = Trainer(root)
        assert resumed.manager.restore() == 20
        resumed.save(30, reason="interval")
        resumed.close()
    staging = root / ".step_000000040.tmp-deadbeef"
    (staging / "tensors").mkdir(parents=True)
    (staging / "tensors" / "__0_0.distcp").write_bytes(b"half a shard")
    legacy = root / "checkpoint_step_5" / "transformer"
    legacy.mkdir(parents=True)
    save_file({"w": torch.zeros(2, 3)}, str(legacy / "diffusion_pytorch_model.safetensors"))
    return root


def test_inspect_on_a_root_lists_every_entry_and_marks_the_one_the_next_run_resumes_from(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "inspect", str(requeued_root))
    assert code == 0, err
    rows = {line.split()[0] if not line.startswith("*") else line.split()[1]: line
            for line in out.splitlines() if line.strip()[:1].isdigit() or line.startswith("*")}
    assert rows["30"].startswith("*") and "committed" in rows["30"]
    assert "111606" in rows["30"] and "interval" in rows["30"]
    assert "preemption" in rows["20"] and "111322" in rows["20"]
    assert "partial" in rows["40"] and "legacy" in rows["5"]
    assert "the next run resumes from step 30" in out
    assert "Requeue chain" in out
    assert err == ""


def test_inspect_json_on_a_root_follows_the_documented_schema(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, document, _ = run_json(capsys, "inspect", str(requeued_root))
    assert code == 0
    assert document["schema"] == "resumekit.inspect/1" and document["kind"] == "root"
    assert document["resume_from"] == 30
    entries = document["checkpoints"]
    assert [(e["step"], e["status"]) for e in entries] == [
        (5, "legacy"), (10, "committed"), (20, "committed"), (30, "committed"),
        (40, "partial")]
    for entry in entries:
        assert set(entry) >= ENTRY_KEYS
        assert isinstance(entry["step"], int) and isinstance(entry["bytes"], int)
    committed = {e["step"]: e for e in entries if e["status"] == "committed"}
    assert committed[30]["lineage"]["resumed_from_step"] == 20
    assert committed[30]["lineage"]["slurm_restart_count"] == 1
    assert committed[20]["reason"] == "preemption" and committed[20]["world_size"] == 1
    assert [e["resume_from"] for e in entries] == [False, False, False, True, False]
    assert committed[10]["seconds_since_previous"] is None
    assert committed[20]["seconds_since_previous"] >= 0
    chain = document["chain"]
    assert [(run["slurm_job_id"], run["slurm_restart_count"], run["steps"]) for run in chain] \
        == [("111322", 0, [10, 20]), ("111606", 1, [30])]
    assert chain[1]["resumed_from_step"] == 20
    assert chain[1]["seconds_since_previous_run"] >= 0


def test_inspect_on_one_checkpoint_shows_manifest_and_every_kind_of_state(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_dir = requeued_root / "step_000000030"
    code, out, err = run_cli(capsys, "inspect", str(step_dir))
    assert code == 0, err
    for needle in ("step 30", "committed", "resumed from step 20", "slurm job 111606",
                   "optimizer", "scheduler", "generator:noise", '"consumed": 12',
                   "abc123", "next resume", "(this one)", "train_state.pt"):
        assert needle in out, needle
    code, document, _ = run_json(capsys, "inspect", str(step_dir))
    assert code == 0 and document["kind"] == "checkpoint"
    assert document["checkpoints"][0]["step"] == 30
    assert document["manifest"]["step"] == 30
    state = document["state"]
    assert state["holds"]["optimizer"] and state["holds"]["scheduler"]
    assert state["train_state"]["step"] == 30
    assert state["ranks"][0]["rng"] == ["python", "numpy", "torch", "generator:noise"]
    assert state["ranks"][0]["data"]["consumed"] == 12
    assert state["extras"]["wandb_run"] == "abc123"
    assert state["model"]["tensors"] == 4 and state["model"]["elements"] == 4 * 8 + 8 + 8 * 3 + 3
    assert "tensors" not in document


def test_inspect_tensors_reads_names_shapes_and_dtypes_from_metadata_alone(
    requeued_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "step_000000020"
    shutil.copytree(requeued_root / "step_000000020", copy)
    for shard in (copy / "tensors").glob("*.distcp"):
        shard.unlink()  # no tensor data left: only the metadata can answer
    code, document, err = run_json(capsys, "inspect", str(copy), "--tensors")
    assert code == 0, err
    tensors = {t["name"]: t for t in document["tensors"]}
    assert tensors["model.0.weight"] == {"name": "model.0.weight", "shape": [8, 4],
                                         "dtype": "float32", "bytes": 128}
    assert tensors["optimizer.state.2.bias.exp_avg_sq"]["shape"] == [3]
    assert len(tensors) == 4 + 4 * 3
    code, out, _ = run_cli(capsys, "inspect", str(copy), "--tensors")
    assert code == 0 and "model.2.weight" in out and "3x8" in out and "16 tensors" in out


def test_inspect_on_an_empty_directory_says_the_next_run_starts_fresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 0 and "No checkpoints" in out
    code, document, _ = run_json(capsys, "inspect", str(tmp_path))
    assert code == 0 and document["checkpoints"] == [] and document["resume_from"] is None


def test_inspect_on_a_file_or_a_missing_path_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hello")
    code, out, err = run_cli(capsys, "inspect", str(a_file))
    assert code == 1 and out == ""
    assert_one_error_line(err, str(a_file), "is a file")
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "nowhere"), "--json")
    assert code == 1 and out == ""
    assert_one_error_line(err, "nowhere", "does not exist")


def test_inspect_on_a_partial_directory_lists_its_files_and_exits_1(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    staging = requeued_root / ".step_000000040.tmp-deadbeef"
    code, document, err = run_json(capsys, "inspect", str(staging))
    assert code == 1
    assert document["checkpoints"][0]["status"] == "partial"
    assert document["files"] == [{"path": "tensors/__0_0.distcp", "bytes": 12,
                                  "checksum": None}]
    assert_one_error_line(err, "not a committed checkpoint", "partial")


def test_inspect_on_a_legacy_directory_lists_its_weights_from_the_safetensors_header(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, document, err = run_json(capsys, "inspect", str(requeued_root / "checkpoint_step_5"),
                                   "--tensors")
    assert code == 0, err
    assert document["checkpoints"][0]["status"] == "legacy"
    assert document["tensors"] == [{"name": "w", "shape": [2, 3], "dtype": "F32", "bytes": 24,
                                    "file": "transformer/diffusion_pytorch_model.safetensors"}]


def test_inspect_reports_garbage_manifests_as_corrupt_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    write_checkpoints(root, [10])
    bad = root / "step_000000020"
    bad.mkdir()
    (bad / "manifest.json").write_bytes(b"\x00\x01 not json")
    (root / "random.bin").write_bytes(b"garbage")
    (root / "notes").mkdir()
    code, document, err = run_json(capsys, "inspect", str(root))
    assert code == 1
    statuses = {e["step"]: e["status"] for e in document["checkpoints"]}
    assert statuses == {10: "committed", 20: "corrupt"}
    assert document["resume_from"] == 10
    assert_one_error_line(err, "corrupt", "step_000000020")
    code, _, err = run_cli(capsys, "inspect", str(bad))
    assert code == 1
    assert_one_error_line(err, "not valid JSON")


def test_inspect_detects_the_lingbot_name_format_or_takes_it_as_an_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "lingbot"
    write_checkpoints(root, [200, 1000], name_format="checkpoint_step_{step}")
    code, document, _ = run_json(capsys, "inspect", str(root))
    assert code == 0 and document["name_format"] == "checkpoint_step_{step}"
    assert [(e["step"], e["status"]) for e in document["checkpoints"]] == [
        (200, "committed"), (1000, "committed")]
    code, document, _ = run_json(capsys, "inspect", str(root / "checkpoint_step_1000"))
    assert code == 0 and document["resume_from"] == 1000
    code, document, _ = run_json(capsys, "inspect", str(root), "--name-format",
                                 "step_{step:09d}")
    assert code == 0 and document["checkpoints"] == []


def test_inspect_usage_errors_exit_2(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "inspect", str(requeued_root), "--name-format", "no_field")
    assert code == 2 and "{step}" in err
    code, _, err = run_cli(capsys, "inspect", str(requeued_root), "--tensors")
    assert code == 2 and "resumekit inspect: error: --tensors needs one checkpoint" in err
    code, _, err = run_cli(capsys, "inspect")
    assert code == 2 and "path" in err
    code, _, err = run_cli(capsys, "inspect", str(requeued_root), "--storage-option", "novalue")
    assert code == 2 and "KEY=VALUE" in err


def test_debug_shows_the_traceback_instead_of_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        main(["inspect", str(tmp_path / "missing"), "--debug"])


def test_a_manager_on_the_same_root_agrees_with_inspect_on_the_resume_step(
    requeued_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, document, _ = run_json(capsys, "inspect", str(requeued_root))
    latest = CheckpointManager(str(requeued_root)).latest()
    assert latest is not None and code == 0
    assert document["resume_from"] == latest.step
    assert json.loads(json.dumps(document)) == document
