"""Checkpoints written by the code before the layout move (8e7662e) restore today, unchanged.

The fixture under ``tests/fixtures/format_0_2`` was written by that commit's own code
(``make_fixture.py`` says how); ``expected.json`` holds what each restore must give back.
Each test restores a copy (the fixture is never written to) and compares every value: a
change to the raw tensor format, the manifest, the per-rank state files or the reading of
DCP's stock format fails here.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from resumekit import CheckpointManager, ResumableDistributedSampler
from resumekit.warnings import ResumekitWarning
from tests.fixtures.format_0_2 import fixture_state as fs

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format_0_2"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())


def _copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURE / name, tmp_path / name))


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _tied_run(root: Path, **kwargs: Any) -> tuple[CheckpointManager, tuple[Any, ...]]:
    model, optimizer, scheduler, noise = fs.tied_objects()
    sampler = ResumableDistributedSampler(len(fs.TOKENS), seed=3)
    extras: dict[str, Any] = {}
    manager = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=scheduler,
                                data=sampler, generators={"noise": noise}, extras=extras,
                                config=fs.CONFIG, retention=None, **kwargs)
    return manager, (model, optimizer, scheduler, sampler, noise, extras)


def _restored_single(manager: CheckpointManager, objects: tuple[Any, ...],
                     step: int | None) -> dict[str, Any]:
    model, optimizer, scheduler, sampler, noise, extras = objects
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # a clean root restores quietly
        resume = manager.restore(step)
    entry = next(e for e in manager.checkpoints() if e.step == resume)
    assert entry.status == "committed" and entry.manifest is not None
    return {"resume_step": resume,
            **fs.tensor_values(model, optimizer),
            "scheduler": fs.scheduler_values(scheduler), "sampler": sampler.state_dict(),
            "extras": dict(extras), "metrics": dict(entry.manifest.metrics),
            "draws": fs.next_draws(noise)}


def test_the_fixture_was_written_by_the_code_before_the_layout_move() -> None:
    assert EXPECTED["written_by"]["commit"] == "8e7662e"
    assert sorted(EXPECTED["single"]["steps"]) == ["2", "4"]
    assert (FIXTURE / "single" / "step_000000004" / "tensors" / "__0_checksums.json").exists()
    assert json.loads((FIXTURE / "dcp" / "step_000000003" / "manifest.json").read_text())[
        "tensor_format"] == "dcp"


@pytest.mark.parametrize("step", [None, 2])
def test_a_raw_root_of_0_2_restores_every_value_it_held(tmp_path: Path,
                                                         step: int | None) -> None:
    # An older step is read with a read-only manager: a writable one would warn, rightly,
    # that it could not save past step 4 (tests/unit/test_roll_back_warning.py).
    manager, objects = _tied_run(_copy(tmp_path, "single"), read_only=step is not None)
    got = _restored_single(manager, objects, step)
    manager.close()
    expected = EXPECTED["single"]["steps"][str(step or 4)]
    assert got["resume_step"] == expected["resume_step"] == (step or 4)
    for key in ("model", "optimizer", "param_groups", "scheduler", "sampler", "extras",
                "metrics", "draws"):
        assert _plain(got[key]) == expected[key], key
    model = objects[0]
    assert model.head.weight is model.embed.weight  # the ties hold after the restore
    assert model.decode.weight is model.encode.weight


def test_a_dcp_root_of_0_2_restores_every_tensor_it_held(tmp_path: Path) -> None:
    model, optimizer, _, _ = fs.tied_objects()
    manager = CheckpointManager(_copy(tmp_path, "dcp"), model=model, optimizer=optimizer,
                                config=fs.CONFIG, retention=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        resume = manager.restore()
    manager.close()
    expected = EXPECTED["dcp"]["steps"]["3"]
    assert resume == expected["resume_step"] == 3
    got = _plain(fs.tensor_values(model, optimizer))
    assert got == {key: expected[key] for key in ("model", "optimizer", "param_groups")}


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_a_raw_root_of_0_2_goes_on_to_commit_the_next_step(tmp_path: Path,
                                                           tensor_format: str) -> None:
    root = _copy(tmp_path, "single")
    manager, objects = _tied_run(root, tensor_format=tensor_format)
    model, optimizer, scheduler, sampler, noise, _extras = objects
    assert manager.restore() == 4
    order = iter(sampler)
    loss = fs.tied_step(model, optimizer, scheduler, sampler, noise, order)
    manager.save(5, metrics={"loss": loss})
    after = fs.tensor_values(model, optimizer)
    manager.close()
    assert [(e.step, e.status) for e in manager.checkpoints()] == [
        (2, "committed"), (4, "committed"), (5, "committed")]
    for step in ("step_000000002", "step_000000004"):  # the old steps are left as they were
        same = filecmp.dircmp(FIXTURE / "single" / step, root / step)
        assert not (same.diff_files or same.left_only or same.right_only), step
    fresh, again = _tied_run(root)
    assert fresh.restore() == 5
    assert fs.tensor_values(again[0], again[1]) == after
    assert again[-1]["last_saved"] == 4  # the extras restored at step 4 were saved again
    fresh.close()


def test_a_dcp_root_of_0_2_goes_on_to_commit_the_next_step(tmp_path: Path) -> None:
    root = _copy(tmp_path, "dcp")
    model, optimizer, _, _ = fs.tied_objects()
    manager = CheckpointManager(root, model=model, optimizer=optimizer, config=fs.CONFIG,
                                retention=None, tensor_format="dcp")
    assert manager.restore() == 3
    manager.save(4)
    after = fs.tensor_values(model, optimizer)
    manager.close()
    latest = manager.latest()
    assert latest is not None and latest.step == 4
    assert latest.manifest.tensor_format == "dcp"
    model, optimizer, _, _ = fs.tied_objects()
    fresh = CheckpointManager(root, model=model, optimizer=optimizer, config=fs.CONFIG,
                              retention=None)
    assert fresh.restore() == 4
    assert fs.tensor_values(model, optimizer) == after
    fresh.close()
