"""restore(step=N) below newer committed steps says so at once, not at the first save."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from resumekit.errors import StepCollisionError
from resumekit.manager import CheckpointManager
from resumekit.warnings import ResumekitWarning


def _root_with_steps(root: Path, steps: list[int]) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(root, model=model) as ckpt:
        for step in steps:
            ckpt.save(step)
    return model


def _restored(root: Path, step: int | None, **knobs: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = CheckpointManager(root, model=torch.nn.Linear(2, 2), **knobs)  # type: ignore[arg-type]
        assert ckpt.restore(step) == (step or 12)
        ckpt.close()
    return [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]


def test_restoring_an_older_step_warns_at_once_naming_the_newer_steps_and_the_fix(
        tmp_path: Path) -> None:
    _root_with_steps(tmp_path, [4, 8, 12])
    [message] = [m for m in _restored(tmp_path, 4) if "newer committed" in m]
    assert "restored step 4" in message
    assert "steps 8, 12 (step_000000008, step_000000012)" in message
    assert "StepCollisionError" in message
    assert "move step_000000008, step_000000012 out of the root" in message
    assert "new root" in message


def test_the_warned_save_is_indeed_refused(tmp_path: Path) -> None:
    _root_with_steps(tmp_path, [4, 8])
    ckpt = CheckpointManager(tmp_path, model=torch.nn.Linear(2, 2))
    with pytest.warns(ResumekitWarning, match="newer committed step 8"):
        assert ckpt.restore(4) == 4
    with pytest.raises(StepCollisionError):
        ckpt.save(5)


def test_restoring_the_newest_step_or_read_only_says_nothing_of_newer_steps(
        tmp_path: Path) -> None:
    _root_with_steps(tmp_path, [4, 8, 12])
    assert not any("newer committed" in m for m in _restored(tmp_path, 12))
    assert not any("newer committed" in m for m in _restored(tmp_path, None))
    assert not any("newer committed" in m for m in _restored(tmp_path, 4, read_only=True))
