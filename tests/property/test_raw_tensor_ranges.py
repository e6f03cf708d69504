"""Any byte range of a raw item reads back exactly, verified block by block.

The resharding reader reads a slice of a stored tensor: whole blocks straight into the
destination, the partial blocks at its ends through a scratch buffer, each block checked
against its checksum. Budget: 200 examples on items of up to 24 blocks (about 5 s).
"""

from __future__ import annotations

import io
import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo

from resumekit.errors import CorruptCheckpointError
from resumekit.store.manifest import hex_digest
from resumekit.tensors.raw import MIN_BLOCK_BYTES, RawTensorReading
from resumekit.tensors.raw.format import Descriptor
from resumekit.tensors.raw.reader import _Job

BLOCK = MIN_BLOCK_BYTES
HEADER = 1000  # the item starts this far into its file, as items after the first do


def _reader(directory: str) -> RawTensorReading:
    reader = RawTensorReading()
    reader.fs, reader.path, reader.verify = FileSystem(), directory, True
    return reader


def _item(data: bytes) -> _Job:
    blocks = tuple(hex_digest(memoryview(data)[at:at + BLOCK]) for at in range(0, len(data), BLOCK))
    request: Any = SimpleNamespace(storage_index=SimpleNamespace(fqn="model.weight"))
    return _Job(request, _StorageInfo("item.distcp", HEADER, len(data)),
                Descriptor(torch.uint8, (len(data),), BLOCK, blocks), None)


def _read(directory: str, job: _Job, start: int, stop: int) -> bytes:
    destination = bytearray(stop - start)
    with open(os.path.join(directory, "item.distcp"), "rb") as stream:
        _reader(directory)._read_range(stream, job, (start, stop), memoryview(destination))
    return bytes(destination)


@st.composite
def _items_and_ranges(draw: st.DrawFn) -> tuple[bytes, int, int]:
    length = draw(st.integers(min_value=1, max_value=24 * BLOCK))
    seed = draw(st.integers(min_value=0, max_value=2**31))
    data = torch.randint(0, 256, (length,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    edges = st.integers(min_value=0, max_value=length)
    near_block = st.integers(min_value=0, max_value=length // BLOCK).map(
        lambda k: min(k * BLOCK, length))
    a = draw(st.one_of(edges, near_block))
    b = draw(st.one_of(edges, near_block))
    return data, min(a, b), max(a, b)


@settings(max_examples=200, deadline=None)
@given(_items_and_ranges())
def test_any_byte_range_of_an_item_reads_back_exactly(case: tuple[bytes, int, int]) -> None:
    data, start, stop = case
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "item.distcp"), "wb") as handle:
            handle.write(b"\0" * HEADER + data)
        assert _read(directory, _item(data), start, stop) == data[start:stop]


@settings(max_examples=60, deadline=None)
@given(_items_and_ranges(), st.data())
def test_a_flipped_byte_is_caught_exactly_when_its_block_is_read(
    case: tuple[bytes, int, int], draw: st.DataObject
) -> None:
    data, start, stop = case
    flip = draw.draw(st.integers(min_value=0, max_value=len(data) - 1))
    job = _item(data)
    damaged = bytearray(data)
    damaged[flip] ^= 0x01
    touched = stop > start and start // BLOCK <= flip // BLOCK <= (stop - 1) // BLOCK
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "item.distcp"), "wb") as handle:
            handle.write(b"\0" * HEADER + bytes(damaged))
        if touched:
            with pytest.raises(CorruptCheckpointError, match=r"model\.weight"):
                _read(directory, job, start, stop)
        else:
            assert _read(directory, job, start, stop) == data[start:stop]


def test_an_empty_range_reads_nothing_and_checks_nothing() -> None:
    job = _item(b"x" * 10)
    reader = _reader(tempfile.gettempdir())
    reader._read_range(io.BytesIO(b""), job, (5, 5), memoryview(bytearray(0)))
