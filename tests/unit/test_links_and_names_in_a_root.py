"""Nothing outside the root, nothing lost inside it (issue 29, findings 1 and 2).

A symbolic link in a root is never a checkpoint: restore never loads through it,
``inspect`` lists it as what it is, and retention, prune, sweeps and recovery never delete
or rename through it, so another root a link points to stays byte for byte as it was. A
name is no proof of content: a directory that holds a step's name but no checkpoint never
gets the complete copy beside it (set aside or retired) deleted.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit.errors import StorageError, UnsafeCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import run_cli, run_json

STEP_100, STEP_200, STEP_300 = "step_000000100", "step_000000200", "step_000000300"


def _manager(root: str | Path, **kwargs: Any) -> CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    kwargs.setdefault("retention", None)
    return CheckpointManager(root, model=model, optimizer=torch.optim.AdamW(
        model.parameters(), lr=1e-2), **kwargs)


def _saved(root: Path, *steps: int) -> None:
    manager = _manager(root)
    for step in steps:
        with torch.no_grad():
            manager.state.model.weight.add_(1.0)  # type: ignore[union-attr]
        manager.save(step)
    manager.close()


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` (links not followed) and its bytes."""
    found = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            path = Path(parent, name)
            found[str(path.relative_to(directory))] = (
                b"link:" + os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return found


def _restore(root: str | Path, **kwargs: Any) -> tuple[int, list[str]]:
    """Restore a fresh manager of ``root``; return the step and the warnings given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = _manager(root, **kwargs)
        step = manager.restore()
        manager.close()
    return step, [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]


def _url(root: Path, kind: str) -> str:
    return f"file://{root}" if kind == "file-url" else str(root)


# ------------------------------------------------------ finding 1: nothing outside the root


@pytest.mark.parametrize("kind", ["path", "file-url"])
def test_restore_never_follows_a_symlinked_step_out_of_the_root_and_inspect_agrees(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    _saved(root_a, 200)
    _saved(root_b, 100)
    link = root_b / STEP_200
    link.symlink_to(root_a / STEP_200)
    before = _snapshot(root_a)

    step, said = _restore(_url(root_b, kind))

    assert step == 100  # B's own newest, never A's step 200 through the link
    assert any(str(link) in line and "symbolic link" in line for line in said), said
    entries = {e.name: e for e in list_checkpoints(Storage(_url(root_b, kind)))}
    assert entries[STEP_200].status == "corrupt" and entries[STEP_200].defect == "symlink"
    assert entries[STEP_100].status == "committed"
    code, document, _ = run_json(capsys, "inspect", str(root_b))
    assert code != 0  # the link is reported, not "starts fresh" nor resumed from
    assert document["resume_from"] == 100
    row = next(r for r in document["checkpoints"] if r["name"] == STEP_200)
    assert row["status"] == "corrupt" and "symbolic link" in row["problem"]
    assert _snapshot(root_a) == before and link.is_symlink()


@pytest.mark.parametrize("kind", ["path", "file-url"])
def test_retention_and_prune_of_a_root_never_delete_what_a_link_in_it_points_to(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    _saved(root_a, 100)
    root_b.mkdir()
    link = root_b / STEP_100
    link.symlink_to(root_a / STEP_100)
    before = _snapshot(root_a)

    # a run that saves without restoring first: its retention (keep_last(1)) reads the
    # top of the root, where the link's name sorts as step 100
    manager = _manager(_url(root_b, kind), retention=keep_last(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)
        for step in (200, 300, 400):
            manager.save(step)
    manager.close()
    report = prune(Storage(_url(root_b, kind)), keep_last(1), sweep_after=0.0,
                   errors="report")
    code, _, err = run_cli(capsys, "prune", str(root_b), "--keep-last", "1")
    step, said = _restore(_url(root_b, kind))

    assert _snapshot(root_a) == before  # A's bytes, every file
    assert link.is_symlink()
    assert _restore(root_a)[0] == 100
    assert code == 0, err
    assert report.deleted == [] and report.failures == []
    assert any(str(link) in note and "symbolic link" in note for note in report.notes)
    assert step == 400 and any(str(link) in line for line in said), said
    verify_checkpoint(Storage(root_a), STEP_100)  # byte for byte, every file


# --------------------------------------------------- finding 2: nothing lost inside the root


@pytest.mark.parametrize("holder", ["empty", "committed-missing-a-file"])
def test_restore_never_deletes_a_complete_retired_copy_beside_a_directory_of_its_name(
        tmp_path: Path, holder: str) -> None:
    _saved(tmp_path, 100, 200)
    retired = tmp_path / f".{STEP_200}.old-0123456789ab"
    original = _snapshot(tmp_path / STEP_200)
    if holder == "empty":
        (tmp_path / STEP_200).rename(retired)
        (tmp_path / STEP_200).mkdir()  # the name is taken, by no checkpoint
    else:  # its manifest says committed; a file of it is gone
        shutil.copytree(tmp_path / STEP_200, retired)
        (tmp_path / STEP_200 / "train_state.pt").unlink()

    step, said = _restore(tmp_path)

    assert step == 200  # the complete copy was put back and restored
    assert _snapshot(tmp_path / STEP_200) == original
    warned = [line for line in said if str(retired) in line]
    assert warned and str(tmp_path / STEP_200) in warned[0] and "set it aside" in warned[0]
    assert not retired.exists()
    assert len(list(tmp_path.glob(f".{STEP_200}.bad-*"))) == 1  # the other one, kept


def test_a_complete_retired_copy_and_a_link_holding_its_name_are_both_left_alone(
        tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _saved(elsewhere, 200)
    root = tmp_path / "run"
    _saved(root, 100, 200)
    retired = root / f".{STEP_200}.old-0123456789ab"
    (root / STEP_200).rename(retired)
    original, outside = _snapshot(retired), _snapshot(elsewhere)
    (root / STEP_200).symlink_to(elsewhere / STEP_200)

    step, said = _restore(root)

    assert step == 100  # neither the link nor the hidden copy is loaded
    assert _snapshot(retired) == original and _snapshot(elsewhere) == outside
    assert any(str(retired) in line and str(root / STEP_200) in line
               and "left as they are" in line for line in said), said


def test_restore_never_deletes_a_set_aside_copy_beside_an_empty_directory_of_its_name(
        tmp_path: Path) -> None:
    _saved(tmp_path, 100, 200)
    aside = tmp_path / f".{STEP_200}.bad-0123456789ab"
    (tmp_path / STEP_200).rename(aside)
    original = _snapshot(aside)
    (tmp_path / STEP_200).mkdir()

    step, said = _restore(tmp_path)
    report = prune(Storage(tmp_path), keep_last(1), sweep_after=0.0, errors="report")

    assert step == 100  # a set-aside copy is never loaded automatically
    assert _snapshot(aside) == original and report.swept == []
    assert any(str(tmp_path / STEP_200) in line and str(aside) in line for line in said), said


# ------------------------------------------- what a hostile or broken cluster would do next


def test_a_symlinked_file_inside_a_committed_step_is_never_read_and_restore_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    _saved(root, 100, 200)
    state = root / STEP_200 / "train_state.pt"
    outside = tmp_path / "outside.pt"
    shutil.copyfile(state, outside)  # the same bytes: only the link is wrong
    state.unlink()
    state.symlink_to(outside)

    for verify in (True, False):
        with pytest.raises(UnsafeCheckpointError, match="symbolic link") as caught:
            _restore(root, verify_on_restore=verify)
        assert str(state) in str(caught.value)
    for command in ("verify", "inspect"):
        code, _, err = run_cli(capsys, command, str(root / STEP_200))
        assert code != 0 and str(state) in err, (command, err)
    assert state.is_symlink() and outside.read_bytes()


@pytest.mark.parametrize("shape", ["loop", "dangling"])
def test_a_symlink_loop_or_a_dangling_link_at_a_step_name_is_reported_and_left_alone(
        tmp_path: Path, shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    _saved(tmp_path, 100)
    link = tmp_path / STEP_200
    link.symlink_to(link if shape == "loop" else tmp_path / "gone")

    step, said = _restore(tmp_path)
    _, document, _ = run_json(capsys, "inspect", str(tmp_path))
    report = prune(Storage(tmp_path), keep_last(1), sweep_after=0.0, errors="report")

    assert step == 100 and any(str(link) in line for line in said), said
    row = next(r for r in document["checkpoints"] if r["name"] == STEP_200)
    assert row["status"] == "corrupt" and "symbolic link" in row["problem"]
    assert document["resume_from"] == 100 and report.failures == []
    assert link.is_symlink()


def test_a_retired_entry_that_links_to_another_roots_checkpoint_is_never_deleted_through(
        tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    _saved(root_a, 100)
    _saved(root_b, 100)
    link = root_b / f".{STEP_100}.old-0123456789ab"  # looks like an interrupted replacement
    link.symlink_to(root_a / STEP_100)
    before = _snapshot(root_a)

    step, said = _restore(root_b)
    report = prune(Storage(root_b), keep_last(1), sweep_after=0.0, errors="report")

    assert step == 100 and report.failures == []
    assert any(str(link) in line and "symbolic link" in line for line in said), said
    assert link.is_symlink() and _snapshot(root_a) == before


def test_a_staging_entry_that_is_a_symlink_is_never_swept_by_retention(
        tmp_path: Path) -> None:
    root = tmp_path / "run"
    _saved(root, 100)
    data = tmp_path / "someone-elses"
    data.mkdir()
    (data / ".writer.json").write_text('{"host": "elsewhere", "pid": 1, "started": 0}')
    (data / "payload.bin").write_bytes(b"not resumekit's")
    link = root / f".{STEP_200}.tmp-0123456789ab"
    link.symlink_to(data)
    before = _snapshot(data)

    report = prune(Storage(root), keep_last(1), sweep_after=0.0, errors="report")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = _manager(root, retention=keep_last(1))
        manager.restore()
        manager.save(300)
        manager.close()
    said = [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]

    assert report.swept == [] and report.failures == []
    assert any(str(link) in line and "symbolic link" in line for line in said), said
    assert not any("cannot" in line for line in said), said
    assert link.is_symlink() and _snapshot(data) == before


def test_storage_refuses_to_delete_rename_or_write_through_a_link_below_its_root(
        tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_bytes(b"{}")
    real = tmp_path / "real-root"
    real.mkdir()
    (real / "entry").symlink_to(outside)
    via_link = tmp_path / "root"
    via_link.symlink_to(real)  # a root that is itself a link is the user's choice: fine
    store = Storage(via_link)

    for attempt in (lambda: store.remove_tree("entry"),
                    lambda: store.remove_file("entry/manifest.json"),
                    lambda: store.rename_dir("entry", "moved"),
                    lambda: store.write_bytes("entry/new", b"x")):
        with pytest.raises(StorageError, match="symbolic link") as caught:
            attempt()
        assert str(via_link / "entry") in str(caught.value)
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json"]
    store.write_bytes("own/file", b"x")
    store.remove_tree("own")
    assert store.is_link("entry") and not store.exists("own")
    assert Storage("memory://links").link_on_path("a/b") is None
