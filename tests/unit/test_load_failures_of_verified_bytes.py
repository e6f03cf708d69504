"""A load that fails on bytes matching their checksums is a bug to report, not damage.

Restore checks every file against the manifest's checksums (``verify_on_restore``, the
default) before it loads them. An exception the load raises after that (an
``AttributeError`` from a bug in resumekit's planner, a ``TypeError`` from the run's own
scheduler) was turned into ``UnreadableFormatError``, a ``CorruptCheckpointError``:
restore set the good checkpoint aside and fell back to an older step, hiding it. Now it
is a ``CheckpointLoadError`` naming the checkpoint, its step, the rank and the original
exception; nothing is renamed and restore does not fall back (nor, for node-local copies,
deletes them and restores an older step). A checkpoint whose bytes
are damaged is still set aside and fallen back from, as before; so is one whose load fails
when nothing checked its bytes (``verify_on_restore=False``: a damaged pickle raises
``AttributeError`` too).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.errors import (
    CheckpointLoadError,
    CorruptCheckpointError,
    IncompatibleVersionError,
    ResumekitError,
    UnreadableFormatError,
)
from resumekit.manager import CheckpointManager
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import rewrite_manifest
from tests.unit.test_local_tier import _restore as _restore_local
from tests.unit.test_local_tier import _steps as _local_steps
from tests.unit.test_local_tier import _train

BUG = "'_Plan' object has no attribute 'items'"


class _Scheduler:
    """A run's own scheduler-like object whose ``load_state_dict`` has a bug."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.warmup = 3

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": self.warmup}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.broken:
            raise TypeError("load_state_dict() missing 1 required argument: 'strict'")
        self.warmup = int(state["warmup"])


def _manager(root: Path, *, broken_scheduler: bool = False, **kwargs: Any
             ) -> CheckpointManager:
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    return CheckpointManager(root, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), scheduler=_Scheduler(broken_scheduler),
        retention=None, **kwargs)


def _two_steps(root: Path) -> None:
    writer = _manager(root)
    writer.restore()
    writer.save(1)
    writer.save(2)
    writer.close()


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")
                  if ".resumekit-generations" not in path.parts)


def _broken(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise AttributeError(BUG)


@pytest.fixture(params=["create_local_plan", "commit_tensor"])
def planner_bug(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[str]:
    """A planner method that raises: before any byte is read, or after each tensor is."""
    monkeypatch.setattr(_CheckedLoadPlanner, request.param, _broken)
    yield request.param


def test_a_planner_bug_on_a_good_checkpoint_is_raised_and_nothing_is_set_aside(
        tmp_path: Path, planner_bug: str) -> None:
    root = tmp_path / "run"
    _two_steps(root)
    before = _tree(root)
    manager = _manager(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # no "set aside" warning either
        with pytest.raises(CheckpointLoadError) as raised:
            manager.restore()
    error = raised.value
    assert not isinstance(error, CorruptCheckpointError)
    message = str(error)
    assert f"{root / 'step_000000002'} (step 2) failed to load" in message
    assert f"AttributeError: {BUG}" in message
    assert "match the checksums" in message and "nothing was set aside" in message
    assert "without falling back" in message
    assert error.step == 2 and error.path == str(root / "step_000000002")
    assert error.cause == f"AttributeError: {BUG}"
    original = error.__cause__
    while original is not None and not isinstance(original, AttributeError):
        original = original.__cause__
    assert isinstance(original, AttributeError) and str(original) == BUG  # chained
    assert manager.resumed_from is None  # no fallback to step 1
    assert _tree(root) == before  # both checkpoints as they were: nothing renamed
    manager.close()


def test_a_planner_bug_on_an_explicit_step_is_raised_the_same_way(
        tmp_path: Path, planner_bug: str) -> None:
    root = tmp_path / "run"
    _two_steps(root)
    before = _tree(root)
    manager = _manager(root)
    with pytest.raises(CheckpointLoadError, match=r"\(step 1\) failed to load"):
        manager.restore(step=1)
    assert _tree(root) == before
    manager.close()


def test_the_checkpoint_restores_once_the_bug_is_gone(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _two_steps(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_CheckedLoadPlanner, "create_local_plan", _broken)
        failing = _manager(root)
        with pytest.raises(CheckpointLoadError):
            failing.restore()
        failing.close()
    fixed = _manager(root)
    assert fixed.restore() == 2
    fixed.close()


def test_a_scheduler_whose_load_state_dict_fails_leaves_the_checkpoint_in_place(
        tmp_path: Path) -> None:
    """The run's own code: its scheduler's ``load_state_dict`` raising a ``TypeError``."""
    root = tmp_path / "run"
    _two_steps(root)
    before = _tree(root)
    manager = _manager(root, broken_scheduler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        with pytest.raises(CheckpointLoadError) as raised:
            manager.restore()
    message = str(raised.value)
    assert "(step 2) failed to load" in message and "train_state.pt" in message
    assert "TypeError: load_state_dict() missing 1 required argument" in message
    assert "_Scheduler.load_state_dict" in message
    assert isinstance(raised.value.__cause__, CheckpointLoadError)
    assert isinstance(raised.value.__cause__.__cause__, TypeError)
    assert manager.resumed_from is None
    assert _tree(root) == before
    manager.close()


def test_a_failing_load_of_what_another_torch_wrote_is_still_version_skew(
        tmp_path: Path, planner_bug: str) -> None:
    """Its manifest records another torch: refused as before, naming both versions."""
    root = tmp_path / "run"
    _two_steps(root)
    step = root / "step_000000002"
    versions = json.loads((step / "manifest.json").read_text())["versions"]
    rewrite_manifest(step, {"versions": {**versions, "torch": "2.99.0+cu200"}})
    before = _tree(root)
    manager = _manager(root)
    with pytest.raises(IncompatibleVersionError, match=r"written by torch 2\.99\.0\+cu200"
                       ) as raised:
        manager.restore()
    assert f"AttributeError: {BUG}" in str(raised.value)
    assert _tree(root) == before
    manager.close()


def test_a_damaged_tensor_file_is_still_set_aside_and_fallen_back_from(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _two_steps(root)
    data = max((root / "step_000000002" / "tensors").glob("*.distcp"),
               key=lambda path: path.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    manager = _manager(root)
    with pytest.warns(ResumekitWarning, match=r"step 2 .* is unusable .*set aside as "
                      r"\.step_000000002\.bad-"):
        assert manager.restore() == 1
    assert not (root / "step_000000002").exists()
    assert any(path.name.startswith(".step_000000002.bad-") for path in root.iterdir())
    manager.close()


def test_without_verify_on_restore_a_failing_load_is_still_taken_for_damage(
        tmp_path: Path) -> None:
    """Nothing checked the bytes: a damaged pickle raises ``AttributeError`` too (as before)."""
    root = tmp_path / "run"
    _two_steps(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_CheckedLoadPlanner, "create_local_plan", _broken)
        manager = _manager(root, verify_on_restore=False)
        with pytest.warns(ResumekitWarning, match=r"step [12] .* is unusable .*set aside"), \
                pytest.raises(ResumekitError, match="could be restored") as raised:
            manager.restore()
        manager.close()
    assert not isinstance(raised.value, CheckpointLoadError)
    assert not (root / "step_000000002").exists()


def test_tensors_load_tells_a_verified_load_failure_from_an_unreadable_one(
        tmp_path: Path, planner_bug: str) -> None:
    model = nn.Linear(4, 3)
    target = tmp_path / "tensors"
    tensors.save({"model": model.state_dict()}, target)
    with pytest.raises(CheckpointLoadError) as verified:
        tensors.load({"model": nn.Linear(4, 3).state_dict()}, target, verified=True)
    assert verified.value.path == str(target) and verified.value.step is None
    assert f"AttributeError: {BUG}" in str(verified.value)
    assert isinstance(verified.value.__cause__, AttributeError)
    with pytest.raises(UnreadableFormatError, match=f"AttributeError: {BUG}"):
        tensors.load({"model": nn.Linear(4, 3).state_dict()}, target)


def test_a_planner_bug_on_good_node_local_copies_keeps_them_and_restores_nothing_older(
        tmp_path: Path, planner_bug: str) -> None:
    """Before, each copy was skipped, the run started at step 0 and both were deleted."""
    _train(tmp_path, 7, save_every=100)  # local copies of steps 4 and 6, nothing durable
    local = tmp_path / "local" / "rank_00000"
    assert _local_steps(local) == ["step_000000004", "step_000000006"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # no "deleted", no "not restoring"
        with pytest.raises(CheckpointLoadError) as raised:
            _restore_local(tmp_path, save_every=100)
    message = str(raised.value)
    assert f"node-local copy {local / 'step_000000006'} (step 6) failed to load on rank 0" \
        in message
    assert f"AttributeError: {BUG}" in message and "no copy was deleted" in message
    assert raised.value.step == 6 and raised.value.rank == 0
    assert _local_steps(local) == ["step_000000004", "step_000000006"]


def test_load_weights_tells_a_failure_on_checked_bytes_from_one_on_unchecked_bytes(
        tmp_path: Path, planner_bug: str) -> None:
    source = tmp_path / "pretrained"
    _two_steps(source)
    before = _tree(source)
    with pytest.raises(CheckpointLoadError) as checked:
        _manager(tmp_path / "finetune").load_weights(source)
    assert f"AttributeError: {BUG}" in str(checked.value)
    assert isinstance(checked.value.__cause__, AttributeError)
    with pytest.raises(UnreadableFormatError, match=f"AttributeError: {BUG}"):
        _manager(tmp_path / "unchecked", verify_on_restore=False).load_weights(source)
    assert _tree(source) == before  # the weights' checkpoint is read, never touched
