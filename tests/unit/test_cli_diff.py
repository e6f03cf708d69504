"""``resumekit diff``: tensor by tensor, plus training, rank and manifest state."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

from resumekit.cli import main
from resumekit.cli.diff import compare_tensors
from tests.unit.test_cli_support import Trainer, assert_one_error_line, run_cli, run_json

DELTA = 0.5


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Three roots: A, an identical copy, and B = A with one weight element moved by DELTA."""
    base = tmp_path_factory.mktemp("diff")
    trainer = Trainer(base / "a")
    trainer.save(10)
    shutil.copytree(base / "a", base / "copy")
    with torch.no_grad():
        trainer.model[0].weight[2, 1] += DELTA
    other = Trainer(base / "b")
    other.model.load_state_dict(trainer.model.state_dict())
    other.optimizer.load_state_dict(trainer.optimizer.state_dict())
    other.scheduler.load_state_dict(trainer.scheduler.state_dict())
    other.sampler.load_state_dict(trainer.sampler.state_dict())
    other.noise.set_state(trainer.noise.get_state())
    other.manager.save(10)
    trainer.close()
    other.close()
    return base / "a", base / "copy", base / "b"


def test_diff_of_identical_checkpoints_exits_0(
    twins: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, copy, _ = twins
    code, out, err = run_cli(capsys, "diff", str(a), str(copy / "step_000000010"))
    assert code == 0, err
    assert out.startswith("identical (bitwise): 16 tensors")
    code, document, _ = run_json(capsys, "diff", str(a), str(copy))
    assert code == 0 and document["equal"] is True and document["differences"] == []
    assert document["compared"]["tensors"] == 16 and document["compared"]["values"] > 20


def test_diff_finds_a_single_changed_element_and_its_size(
    twins: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, b = twins
    code, out, err = run_cli(capsys, "diff", str(a), str(b))
    assert code == 1
    assert "model.0.weight" in out and "1 differing keys" in out
    assert_one_error_line(err, "differ in 1 keys", "model.0.weight")
    code, document, _ = run_json(capsys, "diff", str(a), str(b))
    assert code == 1 and document["equal"] is False
    [difference] = document["differences"]
    assert difference["key"] == "model.0.weight" and difference["section"] == "tensor"
    assert difference["elements"] == 1
    assert difference["max_abs_diff"] == pytest.approx(DELTA, abs=1e-6)


def test_diff_with_a_tolerance_accepts_small_differences_only(
    twins: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, b = twins
    assert run_cli(capsys, "diff", str(a), str(b), "--atol", str(DELTA * 2))[0] == 0
    assert run_cli(capsys, "diff", str(a), str(b), "--atol", str(DELTA / 2))[0] == 1


def test_diff_compares_training_state_rank_state_and_extras(
    twins: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, _ = twins
    shutil.copytree(a, tmp_path / "later")
    trainer = Trainer(tmp_path / "later")
    assert trainer.manager.restore() == 10
    trainer.manager.extras["wandb_run"] = "zzz"
    trainer.save(11)
    trainer.close()
    code, document, _ = run_json(capsys, "diff", str(a), str(tmp_path / "later"),
                                 "--step-b", "11")
    assert code == 1
    keys = {d["key"]: d for d in document["differences"]}
    assert keys["train_state.step"]["a"] == "10" and keys["train_state.step"]["b"] == "11"
    assert keys["manifest.extras.wandb_run"]["section"] == "manifest.extras"
    assert keys["rank_state/rank_00000.data.consumed"]["section"] == "rank_state"
    assert "rank_state/rank_00000.rng.generators.noise.state" in keys
    assert "model.0.weight" in keys and "optimizer.state.0.weight.exp_avg" in keys


def test_bitwise_comparison_tells_signed_zeros_apart_and_matches_identical_nans() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_tensors(nan, nan.clone(), None) is None
    found = compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]), None)
    assert found is not None and found["max_abs_diff"] == 0.0
    assert compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]), 0.0) is None
    assert compare_tensors(torch.tensor([1, 5]), torch.tensor([1, 2]), None) == {
        "reason": "values differ", "max_abs_diff": 3.0, "elements": 1}


def test_diff_usage_and_missing_checkpoints(
    twins: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, _ = twins
    code, _, err = run_cli(capsys, "diff", str(a))
    assert code == 2
    code, _, err = run_cli(capsys, "diff", str(a), str(tmp_path))
    assert code == 1
    assert_one_error_line(err, "no committed checkpoint")
    code, _, err = run_cli(capsys, "diff", str(a), str(a), "--step-b", "99")
    assert code == 1
    assert_one_error_line(err, "no checkpoint of step 99")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal: where the CLI draws its progress bars."""

    def isatty(self) -> bool:
        return True


def test_diff_draws_a_byte_progress_bar_on_a_terminal_only(
    twins: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A diff of two ~1 GB checkpoints ran minutes with nothing on screen.
    a, copy, _ = twins
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["diff", str(a), str(copy)]) == 0
    drawn = terminal.getvalue()
    # The first frame (drawn at once; later ones at tqdm's pace) names the work and its
    # total: both sides' tensor bytes.
    assert drawn.startswith("\rdiff step 10 vs 10:   0%|")
    assert "/1.60k [" in drawn
    capsys.readouterr()
    for quiet in (["--no-progress"], ["--json"]):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(["diff", str(a), str(copy), *quiet]) == 0
        assert terminal.getvalue() == "", quiet
