"""``resumekit prune``: the library's retention policies from the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumekit.store.layout import GENERATIONS_DIR
from tests.unit.test_cli_support import Trainer, run_cli, run_json, write_checkpoints


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != GENERATIONS_DIR)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_checkpoints(path, [100, 200, 300, 400, 500])
    return path


def test_a_dry_run_reports_what_would_go_and_deletes_nothing(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _steps(root)
    code, out, err = run_cli(capsys, "prune", str(root), "--keep-last", "2", "--dry-run")
    assert code == 0, err
    assert "would delete" in out and "3 would delete" in out
    assert _steps(root) == before
    code, document, _ = run_json(capsys, "prune", str(root), "--keep-last", "2",
                                 "--keep-every", "200", "--dry-run")
    assert code == 0 and document["dry_run"] is True
    assert document["kept"] == [200, 400, 500] and document["deleted"] == [100, 300]
    assert document["policy"] == "(keep_last(2) | keep_every(200))"


def test_prune_deletes_what_the_policy_does_not_keep(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, document, _ = run_json(capsys, "prune", str(root), "--keep-last", "1",
                                 "--keep-every", "200")
    assert code == 0 and document["deleted"] == [100, 300]
    assert _steps(root) == ["step_000000200", "step_000000400", "step_000000500"]
    code, document, _ = run_json(capsys, "inspect", str(root))
    assert [e["step"] for e in document["checkpoints"]] == [200, 400, 500]


def test_prune_keeps_the_step_the_newest_run_resumed_from_and_protected_steps(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resumed = Trainer(root)
    assert resumed.manager.restore() == 500
    resumed.save(600)
    resumed.close()
    code, document, _ = run_json(capsys, "prune", str(root), "--keep-last", "1",
                                 "--protect", "100")
    assert code == 0
    assert document["protected"] == [100, 500]
    assert document["kept"] == [100, 500, 600] and document["deleted"] == [200, 300, 400]


def test_prune_usage_errors_exit_2(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "prune", str(root))[0] == 2
    assert run_cli(capsys, "prune", str(root), "--keep-last", "0")[0] == 2
    code, _, err = run_cli(capsys, "prune", str(root / "step_000000100"), "--keep-last", "1")
    assert code == 2 and "prune needs a checkpoint root" in err
    assert len(_steps(root)) == 5


@pytest.mark.parametrize("damage", ["garbled", "nested-100k-deep", "other-step"])
def test_prune_names_every_entry_it_cannot_read_and_exits_1(
    root: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    manifest = root / "step_000000500" / "manifest.json"
    if damage == "garbled":
        manifest.write_text('{"schema_version": 1, "step": ')
    elif damage == "nested-100k-deep":
        manifest.write_text("[" * 100_000)
    else:
        manifest.write_text(manifest.read_text().replace('"step": 500', '"step": 7'))
    (root / "step_000000300" / "manifest.json").write_text("not json")
    code, out, _ = run_cli(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert code == 1
    for step in ("step_000000500", "step_000000300"):
        assert [line for line in out.splitlines()
                if line.startswith("unreadable:") and step in line], out
    code, document, _ = run_json(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 1
    assert [line.split(" (step")[0] for line in document["unreadable"]] == [
        f"cannot read {root / 'step_000000300'}", f"cannot read {root / 'step_000000500'}"]
    assert document["kept"] == [400] and document["deleted"] == [100, 200]
    assert _steps(root) == ["step_000000300", "step_000000400", "step_000000500"]  # left as is
