"""The raw writer writes a bounced piece behind while it copies the next (issue 40, item 4).

``AlignedFile`` copies unaligned bytes through two bounce buffers: from the second piece
on, each piece's ``pwrite`` runs on the file's write-behind thread while the writer copies
and hashes the next piece into the other buffer. The bytes, digests and checksums are
those of the synchronous writer; a write's error (a full disk, an I/O error) surfaces as
before, as the ``StorageError`` naming the file; a failure on either side leaves no thread
running.

The overlap is shown without timing: a piece's write is held until the next piece's copy
has been hashed, which only a writer that overlaps them can do.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from torch import nn

from resumekit import tensors as tensor_io
from resumekit.errors import StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.manifest import Checksum, checksum_chunks
from resumekit.tensors.raw import files as files_module
from resumekit.tensors.raw.files import AlignedFile
from resumekit.tensors.raw.format import ALIGNMENT, CHUNK_BYTES
from tests.conftest import unavailable
from tests.unaligned import unaligned_bytes

HELD_S = 60.0
"""How long a held write waits for the event it is held for: only a writer without the
overlap (or a bug) lets it run out, and then the test fails."""

BEHIND = "resumekit-write-behind"


class _WatchedChecksum:
    """A file's running checksum that calls ``at_threshold`` once past ``threshold`` bytes."""

    def __init__(self, inner: Checksum, threshold: int, at_threshold: Any) -> None:
        self.inner, self.threshold, self.at_threshold = inner, threshold, at_threshold
        self.count = 0

    def update(self, chunk: Any) -> None:
        self.inner.update(chunk)
        before, self.count = self.count, self.count + len(memoryview(chunk).cast("B"))
        if before <= self.threshold < self.count:
            self.at_threshold()

    def value(self) -> str:
        return self.inner.value()


def _behind_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(BEHIND)]


def _direct_file(path: Path) -> AlignedFile:
    handle = AlignedFile(str(path))
    if not handle.direct:
        handle.__exit__(None, None, None)
        unavailable(f"{path.parent}'s filesystem refuses O_DIRECT: no bounce buffer")
    return handle


def _write_chunks(handle: AlignedFile, data: torch.Tensor) -> list[str]:
    view = memoryview(data.numpy()).cast("B")
    digests: list[str] = []
    for start in range(0, len(view), CHUNK_BYTES):
        digests += handle.write(view[start:start + CHUNK_BYTES], data.data_ptr() + start,
                                block=1 << 20)
    handle.pad()
    return digests


def test_a_pieces_write_is_in_flight_while_the_next_piece_is_copied_and_hashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = unaligned_bytes(4 * CHUNK_BYTES + 1000, seed=7)
    path = tmp_path / "__0_0.distcp"
    third_piece_hashed = threading.Event()
    held: list[tuple[str, bool]] = []  # (thread, whether the next piece was hashed)
    real_write = os.pwrite

    def held_write(fd: int, buffer: Any, offset: int) -> int:
        if offset == CHUNK_BYTES:  # the second piece: held until the third is copied
            held.append((threading.current_thread().name,
                         third_piece_hashed.wait(HELD_S)))
        return real_write(fd, buffer, offset)

    monkeypatch.setattr(files_module.os, "pwrite", held_write)
    with _direct_file(path) as handle:
        handle.checksum = _WatchedChecksum(  # type: ignore[assignment]
            handle.checksum, 2 * CHUNK_BYTES, third_piece_hashed.set)
        digests = _write_chunks(handle, data)
        checksum, size = handle.checksum.value(), handle.offset
    monkeypatch.undo()

    assert len(held) == 1 and held[0][1], "the second piece's write never saw the third copied"
    assert held[0][0].startswith(BEHIND)
    assert _behind_threads() == []
    stored = path.read_bytes()
    assert size == len(stored) and stored[:len(data)] == data.numpy().tobytes()
    assert set(stored[len(data):]) <= {0}
    assert checksum == checksum_chunks([stored])
    assert digests == [xxhash.xxh3_128_hexdigest(stored[at:min(at + (1 << 20), len(data))])
                       for at in range(0, len(data), 1 << 20)]


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
def test_a_failed_write_behind_is_raised_by_the_file_and_nothing_after_it_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    data = unaligned_bytes(6 * CHUNK_BYTES, seed=8)
    failing_at = 2 * CHUNK_BYTES  # the third piece: written behind
    offsets: list[tuple[int, str]] = []
    real_write = os.pwrite

    def failing(fd: int, buffer: Any, offset: int) -> int:
        offsets.append((offset, threading.current_thread().name))
        if offset == failing_at:
            raise OSError(code, os.strerror(code))
        return real_write(fd, buffer, offset)

    monkeypatch.setattr(files_module.os, "pwrite", failing)
    with pytest.raises(OSError) as caught, _direct_file(tmp_path / "file") as handle:
        _write_chunks(handle, data)
    monkeypatch.undo()

    assert caught.value.errno == code
    assert [offset for offset, _ in offsets] == [0, CHUNK_BYTES, failing_at]
    assert offsets[-1][1].startswith(BEHIND)
    assert _behind_threads() == []


@pytest.mark.parametrize("write_fails_too", [False, True], ids=["write-ok", "write-fails"])
def test_an_error_while_copying_waits_for_the_write_in_flight_and_is_the_one_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        write_fails_too: bool) -> None:
    data = unaligned_bytes(4 * CHUNK_BYTES, seed=9)
    copying = threading.Event()
    finished: list[int] = []
    real_write = os.pwrite

    def held_write(fd: int, buffer: Any, offset: int) -> int:
        if offset == CHUNK_BYTES:  # in flight when the third piece's hashing fails
            assert copying.wait(HELD_S)
            if write_fails_too:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        count = real_write(fd, buffer, offset)
        finished.append(offset)
        return count

    def fail_while_copying() -> None:
        copying.set()
        raise RuntimeError("the copy of the third piece failed")

    monkeypatch.setattr(files_module.os, "pwrite", held_write)
    path = tmp_path / "file"
    with caplog.at_level(logging.WARNING, logger="resumekit"), pytest.raises(
            RuntimeError, match="third piece"), _direct_file(path) as handle:
        handle.checksum = _WatchedChecksum(  # type: ignore[assignment]
            handle.checksum, 2 * CHUNK_BYTES, fail_while_copying)
        _write_chunks(handle, data)
    monkeypatch.undo()

    assert _behind_threads() == []
    if write_fails_too:
        assert finished == [0]
        assert any(str(path) in record.getMessage() and "failed too" in record.getMessage()
                   for record in caplog.records)
    else:
        assert finished == [0, CHUNK_BYTES]  # waited for before the file was left


def _offset_parameter(numel: int, seed: int) -> nn.Parameter:
    """A float32 parameter of ``numel`` whose data is not ``ALIGNMENT``-aligned."""
    storage = torch.randn(numel + ALIGNMENT, generator=torch.Generator().manual_seed(seed))
    skip = 0 if storage.data_ptr() % ALIGNMENT else 1
    tensor = storage[skip:skip + numel]
    assert tensor.data_ptr() % ALIGNMENT != 0
    return nn.Parameter(tensor, requires_grad=False)


def _big_model(seed: int) -> nn.Module:
    model = nn.Module()
    model.register_parameter("big", _offset_parameter(5 * CHUNK_BYTES // 4 + 333, seed))
    model.register_parameter("small", _offset_parameter(1000, seed + 1))
    return model


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_a_disk_error_in_a_write_behind_fails_the_save_naming_the_file_and_keeps_the_last_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    model = _big_model(seed=1)
    manager = CheckpointManager(tmp_path, model=model, retention=None)
    manager.save(1)
    failed_on: list[str] = []
    real_write = os.pwrite

    def failing(fd: int, buffer: Any, offset: int) -> int:
        # The third and fourth pieces of "big" (the first part): written behind.
        if 2 * CHUNK_BYTES <= offset < 4 * CHUNK_BYTES and os.readlink(
                f"/proc/self/fd/{fd}").endswith(".distcp"):
            failed_on.append(threading.current_thread().name)
            raise OSError(code, os.strerror(code))
        return real_write(fd, buffer, offset)

    monkeypatch.setattr(files_module.os, "pwrite", failing)
    with pytest.raises(StorageError) as caught:
        manager.save(2)
    monkeypatch.undo()
    manager.close()

    if not failed_on:
        unavailable(f"{tmp_path}'s filesystem refuses O_DIRECT: no write behind")
    assert failed_on == [failed_on[0]] and failed_on[0].startswith(BEHIND)
    error = caught.value
    assert error.errno == code and error.step == 2
    assert os.strerror(code) in str(error) and ".distcp" in str(error)
    assert _behind_threads() == []
    restored = _big_model(seed=2)
    assert CheckpointManager(tmp_path, model=restored).restore() == 1
    assert torch.equal(restored.big, model.big) and torch.equal(restored.small, model.small)


def test_a_background_saves_write_behind_thread_runs_at_idle_priority_like_its_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getscheduler"):
        unavailable("no SCHED_IDLE on this platform")
    seen: set[tuple[bool, int]] = set()
    real_write = os.pwrite

    def recording(fd: int, buffer: Any, offset: int) -> int:
        seen.add((threading.current_thread().name.startswith(BEHIND),
                  os.sched_getscheduler(0)))
        return real_write(fd, buffer, offset)

    monkeypatch.setattr(files_module.os, "pwrite", recording)
    state = {"big": _offset_parameter(3 * CHUNK_BYTES // 4 + 5, seed=3).detach()}
    tensor_io.save(state, tmp_path / "background", background=True)
    monkeypatch.undo()

    if not any(behind for behind, _ in seen):
        unavailable(f"{tmp_path}'s filesystem refuses O_DIRECT: no write behind")
    assert {policy for behind, policy in seen if behind} == {os.SCHED_IDLE}
    loaded = {"big": torch.zeros_like(state["big"])}
    tensor_io.load(loaded, tmp_path / "background")
    assert torch.equal(loaded["big"], state["big"])


def test_a_file_written_while_the_interpreter_shuts_down_is_written_on_its_own_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures.thread as pool_module

    data = unaligned_bytes(3 * CHUNK_BYTES + 1000, seed=10)
    path = tmp_path / "file"
    threads: set[str] = set()
    real_write = os.pwrite

    def recording(fd: int, buffer: Any, offset: int) -> int:
        threads.add(threading.current_thread().name)
        return real_write(fd, buffer, offset)

    monkeypatch.setattr(files_module.os, "pwrite", recording)
    monkeypatch.setattr(pool_module, "_shutdown", True)  # as in an atexit handler
    with _direct_file(path) as handle:
        _write_chunks(handle, data)
        checksum, size = handle.checksum.value(), handle.offset
    monkeypatch.undo()

    assert threads == {threading.current_thread().name}
    stored = path.read_bytes()
    assert size == len(stored) and stored[:len(data)] == data.numpy().tobytes()
    assert checksum == checksum_chunks([stored])
