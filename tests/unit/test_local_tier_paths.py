"""Node-local paths stay inside their roots (issue 37, findings 2 and 3).

A local root or sub-root that is a link (to the durable root, or to another run's
directory), or that lies inside the durable root, is refused when the manager is built,
naming both paths; a sub-root made a link afterwards is never read, written or deleted
through; the directory it points to is left exactly as it was.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import resumekit
from resumekit.errors import ConfigurationError, StorageError
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning


def _objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _manager(durable: Path, local: Path | None, *, save_every: int = 4
             ) -> resumekit.CheckpointManager:
    model, opt = _objects()
    tier = None if local is None else resumekit.LocalTier(local, save_every=2, replicas=False)
    return resumekit.CheckpointManager(durable, model=model, optimizer=opt,
                                       save_every=save_every, local=tier)


def _train(manager: resumekit.CheckpointManager, steps: int) -> None:
    for step in range(manager.restore(), steps):
        manager.step_end(step + 1)


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (not following links) and its bytes."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def _other_run(tmp_path: Path) -> Path:
    """Another run's durable root, with steps 6 and 8 committed (and what it kept below)."""
    other = tmp_path / "other_run"
    with _manager(other, None, save_every=2) as manager:
        _train(manager, 8)
    assert {"step_000000006", "step_000000008"} <= set(os.listdir(other))
    return other


# -- refused at construction --------------------------------------------------------------


def test_a_local_root_that_is_the_durable_root_through_a_link_is_refused_naming_both(
        tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "alias").symlink_to(durable)
    with pytest.raises(ConfigurationError) as raised:
        _manager(durable, tmp_path / "alias")
    said = str(raised.value)
    assert str(tmp_path / "alias") in said and str(durable) in said
    assert raised.value.fields["name"] == "local.root"
    assert sorted(os.listdir(durable)) in ([], [".resumekit-generations"])


@pytest.mark.parametrize(("spelt", "said"), [("inside", "not the durable root"),
                                             ("inside-through-a-link", "is a symbolic link"),
                                             ("parent-link", "not the durable root")])
def test_a_local_root_inside_the_durable_root_is_refused_naming_both(
        tmp_path: Path, spelt: str, said: str) -> None:
    durable = tmp_path / "durable"
    (durable / "node").mkdir(parents=True)
    if spelt == "inside":
        local = durable / "local"
    elif spelt == "inside-through-a-link":
        (tmp_path / "scratch").symlink_to(durable / "node")
        local = tmp_path / "scratch"
    else:  # a link above the local root leads into the durable root
        (tmp_path / "scratch").symlink_to(durable)
        local = tmp_path / "scratch" / "local"
    with pytest.raises(ConfigurationError, match=said) as raised:
        _manager(durable, local)
    assert str(local) in str(raised.value) and str(durable) in str(raised.value)


def test_a_sub_root_that_is_a_link_to_another_run_is_refused_and_that_run_left_as_it_is(
        tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    before = _tree(other)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "rank_00000").symlink_to(other)
    with pytest.raises(ConfigurationError) as raised:
        _manager(tmp_path / "durable", tmp_path / "local")
    said = str(raised.value)
    assert str(tmp_path / "local" / "rank_00000") in said and str(other) in said
    assert _tree(other) == before


def test_a_local_root_that_is_a_link_is_refused_and_links_above_it_are_followed(
        tmp_path: Path) -> None:
    (tmp_path / "nvme" / "local").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "nvme" / "local")
    with pytest.raises(ConfigurationError, match="is a symbolic link") as raised:
        _manager(tmp_path / "durable", tmp_path / "link")
    assert str(tmp_path / "nvme" / "local") in str(raised.value)
    (tmp_path / "scratch").symlink_to(tmp_path / "nvme")  # /scratch -> /mnt/nvme0
    with _manager(tmp_path / "durable", tmp_path / "scratch" / "local") as manager:
        _train(manager, 2)
    assert (tmp_path / "nvme" / "local" / "rank_00000" / "step_000000002").is_dir()


# -- a link made after construction --------------------------------------------------------


def test_a_sub_root_linked_after_construction_is_never_deleted_or_written_through(
        tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    before = _tree(other)
    with _manager(tmp_path / "durable", tmp_path / "local") as first:
        _train(first, 4)  # durable 4, local 2 and 4
    local = tmp_path / "local"
    manager = _manager(tmp_path / "durable", local)
    for child in (local / "rank_00000").iterdir():
        for path in sorted(child.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        child.rmdir()
    (local / "rank_00000").rmdir()
    (local / "rank_00000").symlink_to(other)  # steps 6 and 8 there: "newer" copies
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.restore() == 4
        for step in range(4, 6):
            manager.step_end(step + 1)  # a local save at 6, written in the background
        manager.close()  # waits for it: its warning is said here at the latest
    said = [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]
    assert any("symbolic link" in m and str(local / "rank_00000") in m for m in said), said
    assert any("local save of step 6" in m for m in said), said
    assert _tree(other) == before  # nothing deleted, nothing written


def test_a_confined_storage_refuses_to_delete_or_write_through_a_link_on_its_root(
        tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (target / "step_000000001").mkdir(parents=True)
    (target / "step_000000001" / "manifest.json").write_text("{}")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "rank_00000").symlink_to(target)
    sub = Storage(tmp_path / "local" / "rank_00000", confined_to=str(tmp_path))
    assert sub.root_link() == str(tmp_path / "local" / "rank_00000")
    for attempt in (lambda: sub.remove_tree("step_000000001"),
                    lambda: sub.remove_file("step_000000001/manifest.json"),
                    lambda: sub.write_bytes("x", b"x"),
                    lambda: sub.make_dir_exclusive(".step_000000002.tmp-1"),
                    lambda: sub.rename_dir("step_000000001", "step_000000003")):
        with pytest.raises(StorageError, match="symbolic link"):
            attempt()
    assert sorted(os.listdir(target)) == ["step_000000001"]
    assert (target / "step_000000001" / "manifest.json").read_text() == "{}"
    plain = Storage(tmp_path / "local" / "rank_00000")  # a root the user chose may be a link
    assert plain.root_link() is None


# -- resumekit inspect of a durable root holding a local tier's directory -----------------


@pytest.mark.parametrize("held", ["empty", "copies"])
def test_inspect_of_a_durable_root_lists_its_checkpoints_and_names_a_local_tier_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], held: str) -> None:
    from tests.unit.test_cli_support import run_cli, run_json  # noqa: PLC0415

    durable = tmp_path / "durable"
    with _manager(durable, tmp_path / "local", save_every=10) as manager:
        _train(manager, 20)  # durable 10 and 20; local copies 18 and 20
    if held == "empty":
        (durable / "rank_00000").mkdir()  # made by hand
    else:  # what a local root that was the durable root through a link left there
        (tmp_path / "local" / "rank_00000").rename(durable / "rank_00000")
    code, document, _ = run_json(capsys, "inspect", str(durable))
    assert code == 1
    assert document["kind"] == "root" and document["resume_from"] == 20
    assert [row["step"] for row in document["checkpoints"]] == [10, 20]
    [problem] = document["problems"]
    assert problem["name"] == "rank_00000"
    assert problem["path"] == str(durable / "rank_00000")
    assert "local tier" in problem["problem"]
    code, out, err = run_cli(capsys, "inspect", str(durable))
    assert code == 1
    assert "Checkpoint root" in out and "Local tier directory" not in out
    assert "step_000000020" in out or " 20 " in out
    assert str(durable / "rank_00000") in out and "rank_00000" in err
    # The local tier's own directory is still inspected as one.
    assert run_json(capsys, "inspect", str(tmp_path / "local"))[1]["kind"] == (
        "local_root" if held == "empty" else "root")


def test_a_file_url_local_root_is_checked_as_its_path(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "alias").symlink_to(durable)
    with pytest.raises(ConfigurationError, match="symbolic link") as raised:
        _manager(durable, f"file://{tmp_path / 'alias'}")  # type: ignore[arg-type]
    assert str(durable) in str(raised.value)
    with _manager(durable, f"file://{tmp_path / 'local'}") as manager:  # type: ignore[arg-type]
        _train(manager, 2)
        assert manager._local is not None  # noqa: SLF001
        own = manager._local.own  # noqa: SLF001
    assert own.confined_to == str(tmp_path) and own.root_link() is None
    assert (tmp_path / "local" / "rank_00000" / "step_000000002").is_dir()
