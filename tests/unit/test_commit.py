"""The commit protocol: begin / publish / abort in one process and on two gloo ranks."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from torch import nn

from resumekit.errors import StepCollisionError, StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import read_manifest, verify_checkpoint
from resumekit.store.commit import WRITER_FILE, CommitProtocol
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, Manifest, SaveReason
from resumekit.store.newest import latest_committed
from resumekit.store.recovery import recover_interrupted
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.storage_backends import save_checkpoint

NAME_1 = "step_000000001"


def _entries(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name != GENERATIONS_DIR)


# -- one process ------------------------------------------------------------------------


def test_a_save_runs_the_phases_in_order_and_commits_only_at_publish(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    seen: list[tuple[str, bool]] = []

    def on_phase(phase: str) -> None:
        seen.append((phase, latest_committed(store) is not None))

    protocol = CommitProtocol(store, on_phase=on_phase)
    pending = protocol.begin(1)
    store.write_bytes(f"{pending.staging}/model.bin", b"weights")
    protocol.publish(pending, Manifest(step=1))
    assert seen == [("stage", False), ("hash", False), ("manifest", False),
                    ("publish", False), ("cleanup", True)]
    assert _entries(tmp_path) == [NAME_1]


def test_publish_describes_exactly_the_staged_files(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    protocol = CommitProtocol(store)
    pending = protocol.begin(7)
    assert store.exists(f"{pending.staging}/{WRITER_FILE}")
    store.write_bytes(f"{pending.staging}/a/b/deep.bin", b"12345")
    store.write_bytes(f"{pending.staging}/top.bin", b"")
    committed = protocol.publish(
        pending, Manifest(step=0, reason=SaveReason.FINAL, extras={"run": "r1"})
    )
    assert committed.step == 7
    assert committed.reason == SaveReason.FINAL
    assert committed.extras == {"run": "r1"}
    assert [(f.path, f.size) for f in committed.files] == [("a/b/deep.bin", 5), ("top.bin", 0)]
    assert read_manifest(store, "step_000000007") == committed
    assert sorted(p for p, _ in store.walk_files("step_000000007")) == [
        "a/b/deep.bin", MANIFEST_NAME, "top.bin",
    ]


def test_a_collision_with_the_newest_step_suggests_replace(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    with pytest.raises(StepCollisionError, match="replace=True") as caught:
        CommitProtocol(store).begin(1)
    assert (caught.value.step, caught.value.newest) == (1, 1)
    assert caught.value.path == str(tmp_path)
    assert _entries(tmp_path) == [NAME_1]


def test_a_collision_with_an_older_step_says_steps_only_increase(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 5)
    with pytest.raises(StepCollisionError, match="only ever increase"):
        CommitProtocol(store).begin(4)
    assert _entries(tmp_path) == ["step_000000005"]


def test_a_negative_step_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="-1"):
        CommitProtocol(Storage(tmp_path)).begin(-1)
    assert _entries(tmp_path) == []


def test_a_replacement_leaves_the_old_checkpoint_intact_until_publish(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    old = save_checkpoint(store, 1, {"model.bin": b"old weights"})
    checked: list[str] = []

    def on_phase(phase: str) -> None:
        if phase in ("stage", "hash", "manifest", "publish"):
            assert verify_checkpoint(store, NAME_1) == old
            assert store.read_bytes(f"{NAME_1}/model.bin") == b"old weights"
            checked.append(phase)

    protocol = CommitProtocol(store, on_phase=on_phase)
    pending = protocol.begin(1, replace=True)
    store.write_bytes(f"{pending.staging}/model.bin", b"new weights")
    new = protocol.publish(pending, Manifest(step=1))
    assert checked == ["stage", "hash", "manifest", "publish"]
    assert verify_checkpoint(store, NAME_1) == new
    assert store.read_bytes(f"{NAME_1}/model.bin") == b"new weights"
    assert _entries(tmp_path) == [NAME_1]


def test_a_replacement_without_atomic_exchange_falls_back_to_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1, {"model.bin": b"old"})

    def no_exchange(first: str, second: str) -> None:
        raise StorageError(f"no RENAME_EXCHANGE for {first}", path=first, operation="exchange")

    monkeypatch.setattr(store, "exchange_dirs", no_exchange)
    save_checkpoint(store, 1, {"model.bin": b"new"}, replace=True)
    assert verify_checkpoint(store, NAME_1).files[0].size == 3
    assert store.read_bytes(f"{NAME_1}/model.bin") == b"new"
    assert _entries(tmp_path) == [NAME_1]


def test_an_aborted_replacement_keeps_the_old_and_removes_the_staging(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    old = save_checkpoint(store, 1)
    protocol = CommitProtocol(store)
    pending = protocol.begin(1, replace=True)
    store.write_bytes(f"{pending.staging}/model.bin", b"abandoned")
    assert len(_entries(tmp_path)) == 2
    protocol.abort(pending)
    assert _entries(tmp_path) == [NAME_1]
    assert verify_checkpoint(store, NAME_1) == old


def test_a_crash_between_the_two_renames_of_a_replacement_is_undone(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    old = save_checkpoint(store, 1)
    fmt = NameFormat()
    # The fallback path retires the old directory first; a crash right after that
    # leaves no step_000000001 at all, only the retired copy with its manifest.
    os.rename(tmp_path / NAME_1, tmp_path / fmt.retired_name(1, "deadbeef"))
    assert latest_committed(store) is None
    assert recover_interrupted(store, fmt) == [NAME_1]
    assert _entries(tmp_path) == [NAME_1]
    assert verify_checkpoint(store, NAME_1) == old


def test_a_retired_copy_next_to_its_committed_replacement_is_deleted_with_a_warning(
    tmp_path: Path,
) -> None:
    # A replacement cut after its second rename leaves the old copy, manifest and all.
    # Kept, it would come back as step 1 the day retention deletes the new copy.
    store = Storage(tmp_path)
    new = save_checkpoint(store, 1, {"model.bin": b"new"})
    retired = NameFormat().retired_name(1, "cafe01")
    (tmp_path / retired).mkdir()
    (tmp_path / retired / "model.bin").write_bytes(b"old")
    (tmp_path / retired / MANIFEST_NAME).write_bytes((tmp_path / NAME_1 / MANIFEST_NAME)
                                                      .read_bytes())
    with pytest.warns(ResumekitWarning, match=rf"deleted {tmp_path / retired}: the retired "
                      rf"copy of step 1 .*{tmp_path / NAME_1} is the checkpoint"):
        assert recover_interrupted(store, NameFormat()) == []
    assert _entries(tmp_path) == [NAME_1]
    assert verify_checkpoint(store, NAME_1) == new


def test_a_retired_copy_missing_a_file_is_deleted_not_restored_naming_the_file(
    tmp_path: Path,
) -> None:
    # What a deletion cut part-way leaves when the manifest outlives the files: never a
    # checkpoint again (resumekit removes the manifest first; older writers did not).
    store = Storage(tmp_path)
    save_checkpoint(store, 1, {"model.bin": b"weights", "optim.bin": b"moments"})
    retired = NameFormat().retired_name(1, "cafe02")
    os.rename(tmp_path / NAME_1, tmp_path / retired)
    os.remove(tmp_path / retired / "optim.bin")
    with pytest.warns(ResumekitWarning, match=rf"deleted {tmp_path / retired}: it cannot be "
                      r"restored as step 1: .*optim\.bin is missing"):
        assert recover_interrupted(store, NameFormat()) == []
    assert _entries(tmp_path) == []
    assert latest_committed(store) is None


def test_a_replacement_without_exchange_removes_the_retired_manifest_before_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1, {"model.bin": b"old"})
    calls: list[tuple[str, str]] = []

    def no_exchange(first: str, second: str) -> None:
        raise StorageError(f"no RENAME_EXCHANGE for {first}", path=first, operation="exchange")

    def recording(operation: str):  # type: ignore[no-untyped-def]
        original = getattr(store, operation)

        def call(relative: str = "", *args: object, **kwargs: object) -> object:
            calls.append((operation, relative))
            return original(relative, *args, **kwargs)
        return call

    monkeypatch.setattr(store, "exchange_dirs", no_exchange)
    for operation in ("remove_file", "fsync_dir", "remove_tree"):
        monkeypatch.setattr(store, operation, recording(operation))
    save_checkpoint(store, 1, {"model.bin": b"new"}, replace=True)
    retired = [relative for operation, relative in calls
               if operation == "remove_tree" and ".old-" in relative]
    assert len(retired) == 1
    at = calls.index(("remove_tree", retired[0]))
    assert calls[at - 2:at] == [("remove_file", f"{retired[0]}/{MANIFEST_NAME}"),
                                ("fsync_dir", retired[0])]
    assert _entries(tmp_path) == [NAME_1]


# -- issue 29, finding 7b: a failure after the rename says the step IS committed --------


def _root_fsync_fails_once_renamed(monkeypatch: pytest.MonkeyPatch, root: Path,
                                   name: str) -> list[str]:
    """Make the fsync of the root fail (EIO) once ``name`` is in it: after the rename."""
    failed: list[str] = []
    original = Storage.fsync_dir

    def fsync_dir(self: Storage, relative: str = "") -> None:
        if relative == "" and (root / name).is_dir():
            failed.append(name)
            error = OSError(errno.EIO, os.strerror(errno.EIO), str(root))
            raise StorageError(f"cannot fsync {root}: {error}", path=str(root),
                               operation="fsync") from error
        original(self, relative)

    monkeypatch.setattr(Storage, "fsync_dir", fsync_dir)
    return failed


def test_a_root_fsync_failing_after_the_rename_says_the_step_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2))
    ckpt.save(1)
    failed = _root_fsync_fails_once_renamed(monkeypatch, tmp_path, "step_000000002")
    with pytest.warns(ResumekitWarning) as seen:
        ckpt.save(2)  # returns: the step exists and verifies
    assert failed
    messages = [str(w.message) for w in seen if "durability" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in seen]
    assert f"step 2 IS committed as {tmp_path / 'step_000000002'}" in messages[0]
    assert "Input/output error" in messages[0]
    assert "nothing was committed" not in messages[0]
    monkeypatch.undo()
    verify_checkpoint(Storage(tmp_path), "step_000000002")
    assert ckpt.last_saved_step == 2
    with pytest.raises(StepCollisionError):
        ckpt.save(2)
    ckpt.save(3)


def test_a_root_fsync_failing_after_a_replacement_keeps_the_replaced_copy_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1, {"model.bin": b"old"})
    _root_fsync_fails_once_renamed(monkeypatch, tmp_path, NAME_1)
    with pytest.warns(ResumekitWarning, match=r"step 1 IS committed .*durability could not "
                                              r"be confirmed.*the replaced copy stays in "):
        save_checkpoint(store, 1, {"model.bin": b"new"}, replace=True)
    monkeypatch.undo()
    assert (tmp_path / NAME_1 / "model.bin").read_bytes() == b"new"
    verify_checkpoint(store, NAME_1)
