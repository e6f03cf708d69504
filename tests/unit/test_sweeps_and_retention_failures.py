"""Staging of dead writers is swept before a save needs the space; retention after a
commit never fails the save (issue 12, items 4 and 5)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from resumekit.errors import StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.commit import WRITER_FILE, CommitProtocol, PendingCheckpoint
from resumekit.store.manifest import Manifest
from resumekit.store.newest import latest_committed
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.storage_backends import save_checkpoint
from tests.unit.test_bad_input import small_disk  # noqa: F401 - a fixture
from tests.unit.test_cli_support import run_cli
from tests.unit.test_retention import untouched_for

HOUR = 3600.0


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _rewrite_writer(store: Storage, pending: PendingCheckpoint, **changes: object) -> None:
    path = f"{pending.staging}/{WRITER_FILE}"
    writer = json.loads(store.read_bytes(path))
    writer.update(changes)
    store.write_bytes(path, json.dumps(writer).encode())


def _committed(store: Storage) -> list[int]:
    return [e.step for e in list_checkpoints(store) if e.status == "committed"]


# -- item 4: sweep a provably dead writer's staging at begin ---------------------------


def test_a_dead_writers_fresh_staging_is_swept_at_begin_with_a_warning(
    tmp_path: Path, dead_pid: int,
) -> None:
    store = Storage(tmp_path)
    writer = CommitProtocol(store)
    save_checkpoint(store, 1)
    crashed = writer.begin(2)
    store.write_bytes(f"{crashed.staging}/model.bin", b"half a checkpoint")
    _rewrite_writer(store, crashed, pid=dead_pid)  # died a second ago: far below an hour
    assert prune(store, keep_last(5), sweep_after=HOUR).swept == []  # the age rule waits
    with pytest.warns(ResumekitWarning, match=f"swept .*{crashed.staging}.*pid {dead_pid}"):
        pending = writer.begin(2)
    assert not store.exists(crashed.staging)
    assert store.exists(pending.staging)


def test_staging_of_a_fenced_generation_is_swept_at_begin_though_its_writer_lives(
    tmp_path: Path, another_process: Any,
) -> None:
    store = Storage(tmp_path)
    zombie = CommitProtocol(store)
    save_checkpoint(store, 1)
    stale = zombie.begin(2)  # this very (live) process wrote it
    another_process(1)  # the newer run's claims come from another process
    newer = CommitProtocol(store)
    claimed, _ = newer.claim()
    assert stale.generation is not None and claimed is not None
    with pytest.warns(ResumekitWarning, match=f"generation {stale.generation.number} is "
                                              f"fenced by generation {claimed.number}"):
        newer.begin(2)
    assert not store.exists(stale.staging)


def test_begin_leaves_other_hosts_and_live_writers_to_the_age_rule(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    writer = CommitProtocol(store)
    elsewhere = writer.begin(1)
    _rewrite_writer(store, elsewhere, host="another-host")
    alive = writer.begin(2)  # this process, same generation: alive
    writer.begin(3)
    assert store.exists(elsewhere.staging) and store.exists(alive.staging)
    untouched_for(store, elsewhere.staging, 2 * HOUR)
    assert prune(store, keep_last(1), sweep_after=HOUR).swept == [elsewhere.staging]


def test_a_full_disk_left_by_a_dead_writer_does_not_fail_the_next_save(
    small_disk: Path, dead_pid: int,  # noqa: F811 - the fixture
) -> None:
    store = Storage(small_disk)
    writer = CommitProtocol(store)
    save_checkpoint(store, 1)
    crashed = writer.begin(2)
    filler = small_disk / crashed.staging / "model.bin"
    with pytest.raises(OSError) as full, open(filler, "wb") as handle:
        while True:
            handle.write(b"\0" * 65536)
            handle.flush()
    assert full.value.errno == errno.ENOSPC
    _rewrite_writer(store, crashed, pid=dead_pid)
    with pytest.warns(ResumekitWarning, match="swept"):
        pending = writer.begin(2)
    store.write_bytes(f"{pending.staging}/model.bin", b"\2" * (256 << 10))
    writer.publish(pending, Manifest(step=2))
    verify_checkpoint(store, "step_000000002")


# -- item 5: retention after a commit ---------------------------------------------------


def _busy_on_retired(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make deleting a retired checkpoint fail as NFS does with an open ``.nfsXXXX``."""
    refused: list[str] = []
    original = Storage.remove_tree

    def remove_tree(self: Storage, relative: str) -> None:
        if ".old-" in relative:
            refused.append(relative)
            error = OSError(errno.EBUSY, os.strerror(errno.EBUSY), self.path(relative))
            raise StorageError(f"cannot delete {self.path(relative)}: {error}",
                               path=self.path(relative), operation="delete") from error
        original(self, relative)

    monkeypatch.setattr(Storage, "remove_tree", remove_tree)
    return refused


def test_a_retention_failure_after_the_commit_is_a_warning_and_the_save_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2), retention=keep_last(1))
    ckpt.save(1)
    refused = _busy_on_retired(monkeypatch)
    with pytest.warns(ResumekitWarning) as seen:
        ckpt.save(2)  # returns: step 2 is committed
    assert refused
    messages = [str(w.message) for w in seen if "retention" in str(w.message)]
    assert len(messages) == 1
    assert "step 2 is committed" in messages[0]
    assert str(tmp_path / refused[0]) in messages[0]
    assert "Device or resource busy" in messages[0]
    assert _committed(Storage(tmp_path)) == [2]
    assert ckpt.last_saved_step == 2
    monkeypatch.undo()
    ckpt.save(3)  # the next save is unaffected
    assert _committed(Storage(tmp_path)) == [3]


def test_a_failing_listing_during_retention_is_a_warning_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2), retention=keep_last(1))
    ckpt.save(1)

    def broken(*args: object, **kwargs: object) -> None:
        raise StorageError("cannot list the root: [Errno 5] Input/output error",
                           path=str(tmp_path), operation="list")

    monkeypatch.setattr("resumekit.store.retention.recover_interrupted", broken)
    with pytest.warns(ResumekitWarning, match="step 2 is committed.*Input/output error"):
        ckpt.save(2)
    assert latest_committed(Storage(tmp_path)).step == 2  # type: ignore[union-attr]


def test_prune_skips_a_checkpoint_that_vanishes_under_it_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(store, step)
    original = Storage.rename_dir

    def rename_dir(self: Storage, source: str, target: str) -> None:
        if source == "step_000000001":
            shutil.rmtree(self.path(source))  # another process's retention got there first
        original(self, source, target)

    monkeypatch.setattr(Storage, "rename_dir", rename_dir)
    report = prune(store, keep_last(1))
    assert report.deleted == [2]
    assert report.failures == []
    assert len(report.notes) == 1 and "step_000000001 vanished" in report.notes[0]
    assert _committed(store) == [3]


def test_prune_notes_a_checkpoint_a_concurrent_reader_renamed_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2):
        save_checkpoint(store, step)
    original = Storage.remove_file

    def remove_file(self: Storage, relative: str) -> None:
        if ".old-" in relative:  # recover_interrupted() in another process, just now
            retired = relative.split("/", maxsplit=1)[0]
            os.rename(self.path(retired), self.path("step_000000001"))
        original(self, relative)

    monkeypatch.setattr(Storage, "remove_file", remove_file)
    report = prune(store, keep_last(1))
    assert report.deleted == []
    assert any("renamed back" in note for note in report.notes)
    assert _committed(store) == [1, 2]
    verify_checkpoint(store, "step_000000001")


def test_prune_goes_on_after_a_busy_entry_and_raises_listing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(store, step)
    _busy_on_retired(monkeypatch)
    with pytest.raises(StorageError, match="failed for 2 entries") as caught:
        prune(store, keep_last(1))
    assert "Device or resource busy" in str(caught.value)
    assert _committed(store) == [3]  # both were de-committed; their files wait
    report = prune(store, keep_last(1), errors="report")
    assert report.deleted == []  # nothing committed is deleted twice
    assert len(report.failures) == 2  # the sweep finishes the deletions; still busy
    assert all("cannot sweep" in line and ".old-" in line for line in report.failures)
    monkeypatch.undo()
    report = prune(store, keep_last(1), errors="report")
    assert report.failures == [] and report.deleted == [] and len(report.swept) == 2
    assert [e.name for e in list_checkpoints(store)] == ["step_000000003"]


def test_the_prune_command_prints_vanished_entries_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2):
        save_checkpoint(store, step)
    original = Storage.rename_dir

    def rename_dir(self: Storage, source: str, target: str) -> None:
        if source == "step_000000001":
            shutil.rmtree(self.path(source))
        original(self, source, target)

    monkeypatch.setattr(Storage, "rename_dir", rename_dir)
    code, out, _ = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert code == 0
    assert "note:" in out and "step_000000001 vanished" in out


# -- issue 29, finding 6: others' in-flight work, and what cut operations leave ----------


def test_prune_never_sweeps_a_live_writers_fresh_staging_though_its_hosts_clock_runs_behind(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    live = CommitProtocol(store).begin(2)
    store.write_bytes(f"{live.staging}/model.bin", b"being written right now")
    # Its host's clock runs ten hours behind: the start time it recorded looks old.
    _rewrite_writer(store, live, host="slow-clock-host", started=time.time() - 10 * HOUR)
    report = prune(store, keep_last(1), sweep_after=HOUR)
    assert report.swept == []
    assert store.exists(f"{live.staging}/model.bin")


def test_staging_unchanged_for_longer_than_sweep_after_on_the_storages_clock_is_swept(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    gone = CommitProtocol(store).begin(2)
    store.write_bytes(f"{gone.staging}/model.bin", b"left behind")
    # Its host's clock ran ten hours ahead: its start time lies in the future.
    _rewrite_writer(store, gone, host="fast-clock-host", started=time.time() + 10 * HOUR)
    untouched_for(store, gone.staging, 2 * HOUR)
    with pytest.warns(ResumekitWarning, match=f"swept .*{gone.staging}: unchanged for "
                                              r"\d+s by the storage's clock.*fast-clock-host"):
        report = prune(store, keep_last(1), sweep_after=HOUR)
    assert report.swept == [gone.staging]
    assert not store.exists(gone.staging)


class _Killed(BaseException):
    """Stands for SIGKILL: nothing of the writer runs after it (no abort, no cleanup)."""


def test_a_writer_killed_while_writing_its_manifest_leaves_staging_the_next_start_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, another_process: Any,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    writer = CommitProtocol(store)
    pending = writer.begin(2)
    store.write_bytes(f"{pending.staging}/model.bin", b"\1" * 4096)
    original = Storage.write_bytes

    def killed_halfway(self: Storage, relative: str, data: bytes, **kwargs: Any) -> None:
        if relative == f"{pending.staging}/manifest.json":
            original(self, relative, data[: len(data) // 2])
            raise _Killed
        original(self, relative, data, **kwargs)

    monkeypatch.setattr(Storage, "write_bytes", killed_halfway)
    with pytest.raises(_Killed):
        writer.publish(pending, Manifest(step=2))
    monkeypatch.setattr(Storage, "write_bytes", original)
    assert store.exists(f"{pending.staging}/manifest.json")  # cut short
    another_process(1)  # the requeued run
    restarted = CommitProtocol(store)
    restarted.claim()
    with pytest.warns(ResumekitWarning, match=f"swept the abandoned staging area .*"
                                              f"{pending.staging}"):
        again = restarted.begin(2)
    assert not store.exists(pending.staging)
    store.write_bytes(f"{again.staging}/model.bin", b"\2" * 4096)
    restarted.publish(again, Manifest(step=2))
    verify_checkpoint(store, "step_000000002")


def _cut_manifest_write(store: Storage, step: int) -> str:
    """What an earlier version's writer killed while writing its manifest left.

    Data and half a manifest, and no writer record (it was removed before the manifest).
    """
    pending = CommitProtocol(store).begin(step)
    store.write_bytes(f"{pending.staging}/model.bin", b"\1" * 4096)
    store.remove_file(f"{pending.staging}/{WRITER_FILE}")
    whole = Manifest(step=step).to_json()
    store.write_bytes(f"{pending.staging}/manifest.json", whole[: len(whole) // 2])
    return pending.staging


def test_staging_with_a_cut_manifest_and_no_writer_record_is_swept_at_the_next_begin(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    staging = _cut_manifest_write(store, 2)
    with pytest.warns(ResumekitWarning, match=f"swept the abandoned staging area .*"
                                              f"{staging}: it holds files but neither a "
                                              "writer record nor a valid manifest"):
        CommitProtocol(store).begin(2)
    assert not store.exists(staging)


def test_staging_with_a_cut_manifest_and_no_writer_record_is_swept_by_prune_at_once(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    staging = _cut_manifest_write(store, 2)  # fresh: far younger than sweep_after
    with pytest.warns(ResumekitWarning, match=f"swept the abandoned staging area .*"
                                              f"{staging}: it holds files but neither"):
        report = prune(store, keep_last(1), sweep_after=HOUR)
    assert report.swept == [staging]
    assert not store.exists(staging)


def _half_deleted_retired_copy(tmp_path: Path, step: int) -> str:
    """A prune killed inside the recursive delete of a retired copy of ``step``."""
    retired = f".step_{step:09d}.old-feed01"
    os.rename(tmp_path / f"step_{step:09d}", tmp_path / retired)
    os.remove(tmp_path / retired / "manifest.json")  # de-committed first
    files = sorted(path for path in (tmp_path / retired).rglob("*") if path.is_file())
    for path in files[: len(files) // 2 + 1]:
        path.unlink()
    assert (tmp_path / retired).exists()
    return retired


def test_a_retired_copy_a_killed_prune_half_deleted_is_removed_at_the_next_start(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    with CheckpointManager(tmp_path, model=nn.Linear(2, 2)) as first:
        first.save(1)
        first.save(2)
    retired = _half_deleted_retired_copy(tmp_path, 1)
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2))  # the next start
    assert ckpt.restore() == 2
    with pytest.warns(ResumekitWarning, match=f"swept the abandoned staging area .*"
                                              f"{retired}: a retired copy without a valid "
                                              "manifest.*a deletion cut part-way"):
        ckpt.save(3)
    assert not (tmp_path / retired).exists()
    assert _committed(store) == [2, 3]


def test_a_retired_copy_two_prunes_race_to_delete_is_gone_when_either_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2):
        save_checkpoint(store, step, {"a.bin": b"a", "b.bin": b"b", "c.bin": b"c"})
    retired = _half_deleted_retired_copy(tmp_path, 1)
    real_unlink = os.unlink
    raced: list[str] = []

    def the_other_prune_got_there_first(path: Any, *, dir_fd: Any = None) -> None:
        if not raced:  # the other prune deletes this very file, then is killed
            raced.append(str(path))
            real_unlink(path, dir_fd=dir_fd)
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", the_other_prune_got_there_first)
    report = prune(store, keep_last(5), sweep_after=0)
    monkeypatch.undo()
    assert raced and report.swept == [retired]
    assert not (tmp_path / retired).exists()


def test_an_empty_staging_area_without_writer_record_waits_for_the_age_rule(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    pending = CommitProtocol(store).begin(2)
    store.remove_file(f"{pending.staging}/{WRITER_FILE}")  # as if cut before its record
    CommitProtocol(store).begin(3)  # a writer may have only just created it: kept
    assert prune(store, keep_last(1), sweep_after=HOUR).swept == []
    assert store.exists(pending.staging)
    untouched_for(store, pending.staging, 2 * HOUR)
    with pytest.warns(ResumekitWarning, match=f"{pending.staging}: unchanged for .* it has "
                                              "no writer record"):
        assert prune(store, keep_last(1), sweep_after=HOUR).swept == [pending.staging]
