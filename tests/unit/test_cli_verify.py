"""``resumekit verify``: re-hashing against the manifest, exit codes, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_cli_support import assert_one_error_line, run_cli, run_json, write_checkpoints


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_checkpoints(path, [10, 20])
    return path


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_on_a_root_checks_the_newest_committed_checkpoint(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip_a_byte(root / "step_000000010" / "train_state.pt")  # older: not checked
    files = len(json.loads((root / "step_000000020" / "manifest.json").read_text())["files"])
    code, out, err = run_cli(capsys, "verify", str(root))
    assert code == 0, err
    assert out.startswith("ok") and "step 20" in out and f"{files} files" in out
    code, document, _ = run_json(capsys, "verify", str(root))
    assert code == 0 and document["ok"] is True
    assert [(r["step"], r["ok"], r["files"]) for r in document["results"]] == [(20, True, files)]


def test_verify_names_the_first_bad_file_and_exits_1(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = sorted((root / "step_000000020" / "tensors").glob("*.distcp"))[0]
    _flip_a_byte(shard)
    code, out, err = run_cli(capsys, "verify", str(root / "step_000000020"))
    assert code == 1 and out.startswith("FAILED")
    assert_one_error_line(err, str(shard), "fails its checksum", "step 20")
    code, document, err = run_json(capsys, "verify", str(root), "--step", "20")
    assert code == 1 and document["ok"] is False
    assert document["results"][0]["file"] == f"tensors/{shard.name}"
    assert_one_error_line(err, shard.name)


def test_verify_reports_a_missing_or_truncated_file(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "step_000000020" / "train_state.pt").unlink()
    code, _, err = run_cli(capsys, "verify", str(root))
    assert code == 1
    assert_one_error_line(err, "train_state.pt is missing")
    rank_file = root / "step_000000010" / "rank_state" / "rank_00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-1])
    code, _, err = run_cli(capsys, "verify", str(root), "--step", "10")
    assert code == 1
    assert_one_error_line(err, "rank_00000.pt has", "bytes")


def test_verify_all_checks_every_committed_checkpoint_and_fails_on_any(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, document, _ = run_json(capsys, "verify", str(root), "--all")
    assert code == 0 and [r["step"] for r in document["results"]] == [10, 20]
    _flip_a_byte(root / "step_000000010" / "train_state.pt")
    code, out, err = run_cli(capsys, "verify", str(root), "--all")
    assert code == 1
    assert "FAILED  step 10" in out and "ok      step 20" in out
    assert_one_error_line(err, "step 10", "train_state.pt")


def test_verify_without_a_committed_checkpoint_or_with_a_wrong_step_exits_1(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "run" / ".."))
    assert code == 1
    assert_one_error_line(err, "no committed checkpoint")
    code, _, err = run_cli(capsys, "verify", str(root), "--step", "15")
    assert code == 1
    assert_one_error_line(err, "no checkpoint of step 15")
    code, _, err = run_cli(capsys, "verify", str(root / "step_000000020"), "--step", "10")
    assert code == 1
    assert_one_error_line(err, "is step 20, not step 10")


def test_verify_usage_errors_exit_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "verify", str(root), "--step", "10", "--all")
    assert code == 2 and "not allowed with" in err
    code, _, err = run_cli(capsys, "verify", str(root / "step_000000010"), "--all")
    assert code == 2 and "--all needs a checkpoint root" in err
    code, _, err = run_cli(capsys, "verify", str(root), "--step", "ten")
    assert code == 2
