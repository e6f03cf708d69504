"""A reader of several data files reads their checksum trailers a few at once (issue 40).

Rank 0 of a restore reads the small items every rank asks for whole, from up to one data
file per rank: each file's trailer (its items' checksums) is a few small reads at its end,
on a NAS round trips. They are read by the reader's threads, and a damaged one still
fails the read naming its file (the first in file name order, as one after another).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from resumekit import CheckpointManager
from resumekit import tensors as tensor_io
from resumekit.errors import CorruptCheckpointError
from resumekit.tensors.raw import reader as raw_reader
from tests.dist.tiny_fsdp2 import stepped_tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(rank: int, world_size: int, root: str) -> None:
    model, optimizer = stepped_tiny_fsdp2_adamw()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()


def _tensors(tmp_path: Path) -> Path:
    run_ranks(_save, world_size=2, args=(str(tmp_path),))
    return tmp_path / "step_000000001" / "tensors"


def _read_all(directory: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Read every tensor whole (both ranks' files); return (file, thread) of each trailer."""
    read: list[tuple[str, str]] = []
    original = raw_reader.RawTensorReading._read_trailer

    def recorded(self: Any, name: str, where: str) -> Any:
        read.append((name, threading.current_thread().name))
        return original(self, name, where)

    monkeypatch.setattr(raw_reader.RawTensorReading, "_read_trailer", recorded)
    monkeypatch.setattr(raw_reader.RawTensorReading, "read_threads", 2)
    for _ in tensor_io.iter_full_tensors(directory):
        pass
    return read


def _damage_trailer(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-raw_reader.TRAILER.size - 8] ^= 0xFF  # in the trailer, before its footer
    path.write_bytes(bytes(data))


def test_the_trailers_of_two_data_files_are_read_once_each_by_the_readers_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read = _read_all(_tensors(tmp_path), monkeypatch)
    assert sorted(name for name, _ in read) == ["__0_0.distcp", "__1_0.distcp"], read
    assert all(thread.startswith("resumekit-reader") for _, thread in read), read


@pytest.mark.parametrize("damaged", [["__1_0.distcp"], ["__0_0.distcp", "__1_0.distcp"]])
def test_a_damaged_trailer_read_beside_another_fails_naming_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: list[str]) -> None:
    directory = _tensors(tmp_path)
    for name in damaged:
        _damage_trailer(directory / name)
    with pytest.raises(CorruptCheckpointError) as caught:
        _read_all(directory, monkeypatch)
    assert str(directory / damaged[0]) in str(caught.value), caught.value
    assert caught.value.fields.get("file") == str(directory / damaged[0]), caught.value.fields
