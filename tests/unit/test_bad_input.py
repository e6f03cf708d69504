"""Hostile filesystems: read-only roots, a full disk mid-save, names taken by files.

Each failure must be a clear error naming the path, and every checkpoint committed before
must still verify afterwards. Content damage (truncated / flipped / missing files, bad
manifests, unsafe paths) is covered on every backend by test_storage_conformance.py.

The tests run as root, where ``chmod`` does not stop writes: an unwritable root is a
read-only bind mount of a real directory, and a full disk is a 1 MiB tmpfs mounted by
the test. Without mount privileges they call ``unavailable`` (a failure under CI=true).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from resumekit.errors import StepCollisionError, StorageError
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import GENERATIONS_DIR
from resumekit.store.manifest import MANIFEST_NAME, Manifest
from resumekit.store.newest import latest_committed
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage
from tests.conftest import unavailable
from tests.storage_backends import save_checkpoint

NAME_1 = "step_000000001"
NAME_2 = "step_000000002"


def _names(root: Path) -> list[str]:
    """The root's entries, without the writer generation records."""
    return sorted(name for name in os.listdir(root) if name != GENERATIONS_DIR)


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        unavailable(f"cannot mount ({' '.join(args)}): {result.stderr.strip()}")


def _umount(target: Path) -> None:
    subprocess.run(["umount", str(target)], capture_output=True, check=True)


@pytest.fixture
def read_only_root(tmp_path: Path) -> Iterator[tuple[Path, Storage]]:
    """A root holding committed step 1, then bind-mounted read-only onto itself."""
    root = tmp_path / "ro"
    root.mkdir()
    save_checkpoint(Storage(root), 1)
    _mount("--bind", str(root), str(root))
    try:
        _mount("-o", "remount,bind,ro", str(root))
        probe = root / "probe"
        with pytest.raises(OSError) as refused:
            probe.write_bytes(b"x")
        assert refused.value.errno == errno.EROFS
        yield root, Storage(root)
    finally:
        _umount(root)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted after the test."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point))
    try:
        yield mount_point
    finally:
        _umount(mount_point)


def _fill(directory: Path) -> Path:
    """Write a filler file until the filesystem refuses another byte (ENOSPC)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (b"\0" * 65536, b"\0" * 4096, b"\0"):
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as error:
                    assert error.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def test_saving_into_a_read_only_root_fails_naming_it_and_keeps_the_old(
    read_only_root: tuple[Path, Storage],
) -> None:
    root, store = read_only_root
    with pytest.raises(StorageError) as caught:
        CommitProtocol(store).begin(2)
    assert str(root) in str(caught.value)
    assert str(root) in caught.value.path
    assert "Read-only file system" in str(caught.value)
    assert _names(root) == [NAME_1]
    verify_checkpoint(store, NAME_1)


def test_pruning_a_read_only_root_fails_naming_the_checkpoint_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ro-prune"
    root.mkdir()
    store = Storage(root)
    save_checkpoint(store, 1)
    save_checkpoint(store, 2)
    _mount("--bind", str(root), str(root))
    try:
        _mount("-o", "remount,bind,ro", str(root))
        with pytest.raises(StorageError, match=NAME_1):
            prune(store, keep_last(1))
        assert [e.step for e in list_checkpoints(store)] == [1, 2]
        verify_checkpoint(store, NAME_1)
        verify_checkpoint(store, NAME_2)
    finally:
        _umount(root)


def test_a_full_disk_while_writing_data_fails_naming_the_file_and_abort_cleans_up(
    small_disk: Path,
) -> None:
    store = Storage(small_disk)
    save_checkpoint(store, 1)
    protocol = CommitProtocol(store)
    pending = protocol.begin(2)
    target = f"{pending.staging}/model.bin"
    with pytest.raises(StorageError) as caught:
        store.write_bytes(target, b"\1" * (2 << 20))
    assert isinstance(caught.value, OSError)
    assert caught.value.path == store.path(target)
    assert "No space left on device" in str(caught.value)
    protocol.abort(pending)
    assert _names(small_disk) == [NAME_1]
    verify_checkpoint(store, NAME_1)
    # The space came back: the next save of the same step succeeds.
    save_checkpoint(store, 2)
    verify_checkpoint(store, NAME_2)


def test_a_full_disk_while_writing_the_manifest_fails_naming_it_and_abort_cleans_up(
    small_disk: Path,
) -> None:
    store = Storage(small_disk)
    save_checkpoint(store, 1)
    filler: list[Path] = []

    def fill_at_manifest(phase: str) -> None:
        if phase == "manifest":
            filler.append(_fill(small_disk))

    protocol = CommitProtocol(store, on_phase=fill_at_manifest)
    pending = protocol.begin(2)
    store.write_bytes(f"{pending.staging}/model.bin", b"\2" * 1000)
    # Larger than the page the removed writer file gives back.
    padded = Manifest(step=2, extras={"padding": "x" * 20000})
    with pytest.raises(StorageError) as caught:
        protocol.publish(pending, padded)
    assert caught.value.path == store.path(f"{pending.staging}/{MANIFEST_NAME}")
    assert "No space left on device" in str(caught.value)
    latest = latest_committed(store)
    assert latest is not None
    assert latest.step == 1
    protocol.abort(pending)
    assert _names(small_disk) == ["filler", NAME_1]
    filler[0].unlink()
    verify_checkpoint(store, NAME_1)
    assert [(e.step, e.status) for e in list_checkpoints(store)] == [(1, "committed")]


def test_a_root_below_a_regular_file_fails_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    store = Storage(blocker / "checkpoints")
    with pytest.raises(StorageError) as caught:
        CommitProtocol(store).begin(1)
    assert str(blocker / "checkpoints") in str(caught.value)
    assert blocker.read_text() == "a file"


def test_a_step_name_taken_by_a_file_is_a_collision_before_anything_is_written(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    (tmp_path / NAME_2).write_text("squatter")
    protocol = CommitProtocol(store)
    with pytest.raises(StepCollisionError, match=NAME_2) as caught:
        protocol.begin(2)
    assert caught.value.path == str(tmp_path / NAME_2)
    assert _names(tmp_path) == [NAME_1, NAME_2]  # no staging directory
    assert (tmp_path / NAME_2).read_text() == "squatter"
    verify_checkpoint(store, NAME_1)


def test_a_manager_save_that_fills_the_disk_names_the_file_and_free_space_and_keeps_the_old(
    small_disk: Path,
) -> None:
    import torch  # noqa: PLC0415 - the rest of this file needs no torch
    from torch import nn  # noqa: PLC0415

    from resumekit.manager import CheckpointManager  # noqa: PLC0415

    root = small_disk / "ckpt"
    torch.manual_seed(0)
    small = nn.Linear(8, 8)
    CheckpointManager(root, model=small).save(1)
    big = nn.Linear(512, 1024)  # 2 MiB of weights on a 1 MiB disk
    with pytest.raises(StorageError) as caught:
        CheckpointManager(root, model=big).save(2)

    error = caught.value
    assert error.errno == errno.ENOSPC and error.step == 2
    assert "No space left on device" in str(error) and " free of " in str(error)
    assert ".distcp" in str(error) and "BufferError" not in str(error)
    assert _names(root) == [NAME_1]
    verify_checkpoint(Storage(root), NAME_1)
    again = nn.Linear(8, 8)
    assert CheckpointManager(root, model=again).restore() == 1
    assert torch.equal(again.weight, small.weight)
