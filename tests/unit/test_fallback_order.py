"""After an unusable checkpoint, restore falls back to the next-newest one, never further.

Issue 37, finding 1: the step directories below the top of a root came highest first
and the fallback reversed them, so a restore that could not use step 50 of 10..50
resumed step 10 and passed over 20, 30 and 40 without a word.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resumekit.manager import CheckpointManager
from resumekit.warnings import ResumekitWarning

STEPS = (10, 20, 30, 40, 50)


def _manager(root: Path, seed: int = 0, **kwargs: Any) -> CheckpointManager:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return CheckpointManager(root, model=model, optimizer=optimizer, retention=None, **kwargs)


def _save(root: Path, steps: tuple[int, ...]) -> dict[int, torch.Tensor]:
    manager = _manager(root)
    weights = {}
    for step in steps:
        with torch.no_grad():
            manager.state.model.weight.add_(1.0)  # type: ignore[union-attr]
        weights[step] = manager.state.model.weight.detach().clone()  # type: ignore[union-attr]
        manager.save(step)
    manager.close()
    return weights


def _flip_a_byte(victim: Path) -> None:
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def _restored(root: Path) -> tuple[int | None, list[str], CheckpointManager]:
    manager = _manager(root, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = manager.restore()
    said = [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]
    return step, said, manager


def test_a_flipped_byte_in_the_newest_of_five_resumes_the_one_before_and_names_it(
    tmp_path: Path,
) -> None:
    weights = _save(tmp_path, STEPS)
    _flip_a_byte(tmp_path / "step_000000050" / "train_state.pt")
    step, said, manager = _restored(tmp_path)
    assert step == 40
    assert torch.equal(manager.state.model.weight, weights[40])  # type: ignore[union-attr]
    assert [m for m in said if "step_000000050" in m and "unusable" in m]
    latest = manager.latest()
    assert latest is not None and latest.step == 40
    manager.save(50)  # the step set aside is free again; the next save collides with nothing
    manager.close()


def test_two_unusable_newest_checkpoints_resume_the_third_and_name_both(tmp_path: Path) -> None:
    weights = _save(tmp_path, STEPS)
    _flip_a_byte(tmp_path / "step_000000050" / "train_state.pt")
    _flip_a_byte(tmp_path / "step_000000040" / "train_state.pt")
    step, said, manager = _restored(tmp_path)
    assert step == 30
    assert torch.equal(manager.state.model.weight, weights[30])  # type: ignore[union-attr]
    for name in ("step_000000050", "step_000000040"):
        assert [m for m in said if name in m], (name, said)
    manager.close()
