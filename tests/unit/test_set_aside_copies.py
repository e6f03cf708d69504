"""Copies set aside by another resumekit version are put back; a fresh start beside set-aside
copies is refused (issue 37: the release before ``schema_version`` 2 set aside every
checkpoint of today's roots, and the next run started at step 0 beside them)."""

from __future__ import annotations

import re
import shlex
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from resumekit import CheckpointManager
from resumekit.errors import ResumekitError
from resumekit.store import generations
from resumekit.store.aside import aside_token, set_aside_by
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.manifest import SCHEMA_VERSION, Lineage
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMES = NameFormat()


def _run(root: Path, *, read_only: bool = False
         ) -> tuple[CheckpointManager, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                             read_only=read_only), model, optimizer


def _train(root: Path, steps: tuple[int, ...] = (5, 10)) -> dict[str, torch.Tensor]:
    """Save ``steps``; return the weights of the last."""
    manager, model, optimizer = _run(root)
    assert manager.restore() == 0
    for step in range(1, max(steps) + 1):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        if step in steps:
            manager.save(step)
    manager.close()
    return {key: value.clone() for key, value in model.state_dict().items()}


def _aside(root: Path, step: int, token: str) -> Path:
    """Rename a committed step as a restore sets it aside, with ``token``."""
    hidden = root / f".{NAMES.build(step)}.bad-{token}"
    (root / NAMES.build(step)).rename(hidden)
    return hidden


def _claims(root: Path) -> list[str]:
    return sorted(path.name for path in (root / GENERATIONS_DIR).glob("0*.json"))


def _restore(root: Path, **kwargs: bool) -> tuple[int, nn.Module, list[str]]:
    manager, model, _ = _run(root, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = manager.restore()
    manager.close()
    return step, model, [str(w.message) for w in caught
                         if issubclass(w.category, ResumekitWarning)]


def test_a_copy_is_set_aside_under_a_name_that_says_this_schema_version_did_it(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _train(root, (5,))
    (root / NAMES.build(5) / "train_state.pt").write_bytes(b"torn")
    manager, _, _ = _run(root)
    with warnings.catch_warnings(), pytest.raises(ResumekitError, match="could be restored"):
        warnings.simplefilter("ignore")
        manager.restore()
    [hidden] = [path.name for path in root.iterdir() if ".bad-" in path.name]
    token = hidden.split(".bad-")[1]
    assert set_aside_by(token) == SCHEMA_VERSION
    assert re.fullmatch(rf"s{SCHEMA_VERSION}_[0-9a-f]{{12}}", token)
    assert set_aside_by("0123456789ab") is None  # an older release's name
    assert set_aside_by(aside_token("ff")) == SCHEMA_VERSION


def test_copies_an_older_release_set_aside_are_put_back_with_a_warning_and_restored(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    weights = _train(root)
    tenth = _aside(root, 10, "d8af152f93ca")  # as the release before the mark names them
    fifth = _aside(root, 5, "aff3d20c2753")
    step, model, said = _restore(root)
    assert step == 10
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    assert (root / NAMES.build(10)).is_dir() and (root / NAMES.build(5)).is_dir()
    assert not tenth.exists() and not fifth.exists()
    put_back = [m for m in said if m.startswith("put ")]
    assert len(put_back) == 2
    assert any(str(tenth) in m and str(root / NAMES.build(10)) in m and "step 10" in m
               and "an older resumekit" in m for m in put_back)


def test_a_read_only_restore_puts_nothing_back_and_refuses_to_start_fresh(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _train(root, (5,))
    hidden = _aside(root, 5, "aff3d20c2753")
    manager, _, _ = _run(root, read_only=True)
    with pytest.raises(ResumekitError, match="refusing to start fresh at step 0"):
        manager.restore()
    assert hidden.is_dir() and not (root / NAMES.build(5)).exists()


def test_a_fresh_start_beside_a_copy_this_version_set_aside_is_refused_naming_the_command(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _train(root)
    tenth = _aside(root, 10, aside_token("0123456789ab"))  # as this version sets one aside
    fifth = _aside(root, 5, aside_token("ba9876543210"))
    claims = _claims(root)
    manager, _, _ = _run(root)
    with pytest.raises(ResumekitError) as caught:
        manager.restore()
    message = str(caught.value)
    assert message.startswith("refusing to start fresh at step 0")
    assert str(tenth) in message and str(fifth) in message
    assert caught.value.steps == [10, 5]  # type: ignore[attr-defined]
    put_back = caught.value.commands[0]  # type: ignore[attr-defined]
    assert put_back == f"mv {shlex.quote(str(tenth))} {shlex.quote(str(root / NAMES.build(10)))}"
    assert put_back in message
    assert tenth.is_dir() and fifth.is_dir()  # nothing put back, renamed or deleted
    assert _claims(root) == claims  # nor a claim recorded that saw an empty root
    subprocess.run(put_back, shell=True, check=True)  # the command given puts it back
    step, _, _ = _restore(root)
    assert step == 10


def test_a_copy_whose_step_name_is_taken_again_stays_aside(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _train(root, (5,))
    hidden = _aside(root, 5, "aff3d20c2753")
    manager, model, _ = _run(root)  # a run that started fresh beside it (an older release)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    manager.save(5)
    manager.close()
    again = {key: value.clone() for key, value in model.state_dict().items()}
    step, model, said = _restore(root)
    assert step == 5 and hidden.is_dir()
    assert not [m for m in said if m.startswith("put ")]
    for key, value in model.state_dict().items():
        assert torch.equal(value, again[key]), key


def test_a_copy_missing_a_file_is_not_put_back_and_a_fresh_start_beside_it_is_refused(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _train(root, (5,))
    hidden = _aside(root, 5, "aff3d20c2753")
    (hidden / "train_state.pt").unlink()
    manager, _, _ = _run(root)
    with pytest.raises(ResumekitError, match="cannot read it") as caught:
        manager.restore()
    assert str(hidden) in str(caught.value)
    assert hidden.is_dir() and not (root / NAMES.build(5)).exists()


def test_a_copy_a_later_claim_would_fence_is_left_and_the_refusal_gives_a_new_root(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    weights = _train(root)
    tenth = _aside(root, 10, "d8af152f93ca")
    _aside(root, 5, "aff3d20c2753")
    # a run claimed the root after the copies were set aside, and saw no step
    generations.claim(Storage(root), newest_step=None,
                      identity=Lineage(hostname="elsewhere", pid=1))
    manager, _, _ = _run(root)
    with pytest.raises(ResumekitError, match="fenced writer") as caught:
        manager.restore()
    assert tenth.is_dir() and not (root / NAMES.build(10)).exists()
    command = caught.value.commands[0]  # type: ignore[attr-defined]
    new_root = tmp_path / "run-step-10"
    assert str(new_root) in str(caught.value)
    subprocess.run(command, shell=True, check=True)
    step, model, _ = _restore(new_root)
    assert step == 10
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
