"""resumekit.tensors.raw in one process: raw bytes on disk, checksums, verified reads."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from resumekit import CorruptCheckpointError
from resumekit import tensors as tensor_io
from resumekit.errors import (
    ConfigurationError,
    IncompleteCheckpointError,
    ResumekitError,
    StorageError,
)
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import DCP_METADATA_FILE, GENERATIONS_DIR
from resumekit.store.manifest import FileEntry, Manifest, checksum_chunks, hex_digest
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors.raw import (
    ALIGNMENT,
    CHUNK_BYTES,
    FORMAT_NAME,
    MEMBER_DESCRIPTORS,
    PACK_BYTES,
    PACK_ITEM_BYTES,
    RawTensorWriter,
    aligned_empty,
    block_bytes_for,
)
from resumekit.tensors.raw import reader as raw_reader
from resumekit.tensors.raw import writer as raw_writer
from resumekit.tensors.raw.files import DirectIoNotices
from resumekit.tensors.raw.format import (
    TRAILER_ALONE_DESCRIPTORS,
    TRAILER_PACK_PREFIX,
    ChecksumFile,
    Descriptor,
    decode_file_trailer,
)
from resumekit.tensors.reader import make_reader, read_metadata_bytes
from resumekit.warnings import DirectIoRefusedWarning
from tests.conftest import unavailable


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are single-process"


def mixed_state() -> dict[str, Any]:
    """One of each kind of value a state dict holds, with known contents."""
    generator = torch.Generator().manual_seed(0)
    buffer = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "f32": torch.randn(5, 3, generator=generator),
        "bf16": torch.randn(6, generator=generator).to(torch.bfloat16),
        "i64": torch.arange(-3, 4, dtype=torch.int64) * (1 << 40),
        "flags": torch.tensor([True, False, True, True]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": buffer.t(),  # a non-contiguous source
        "extras": {"lr": 0.125, "name": "run-1", "milestones": [3, 7]},
        "count": 7,
    }


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A destination of the same layout holding other values."""
    blank: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            blank[key] = torch.zeros(value.shape, dtype=value.dtype)
        elif isinstance(value, dict):
            blank[key] = {name: type(item)() for name, item in value.items()}
        else:
            blank[key] = type(value)()
    return blank


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def storage_info(directory: Path) -> dict[str, Any]:
    """``{fqn: _StorageInfo}`` from the checkpoint's DCP metadata."""
    metadata = make_reader(str(directory), None).read_metadata()
    return {index.fqn: info for index, info in metadata.storage_data.items()}


def as_format_1(directory: Path) -> None:
    """Rewrite a one-rank checkpoint's items stored alone as written up to schema_version 2.

    Their dtype, shape and block checksums go into their descriptors (format 1), from the
    trailer of their data file (which stays: a reader of format 1 reads none).
    """
    metadata = read_metadata_bytes((directory / DCP_METADATA_FILE).read_bytes(), "test")
    for index, info in metadata.storage_data.items():
        descriptors = info.transform_descriptors
        if not (descriptors and tuple(descriptors) == TRAILER_ALONE_DESCRIPTORS):
            continue
        listed = trailer_of(directory / info.relative_path)
        _, block, blocks = listed.items[(info.relative_path, info.offset)]
        entry = metadata.state_dict_metadata[index.fqn]
        dtype, shape = None, ()
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            shape = next(tuple(chunk.sizes) for chunk in entry.chunks
                         if tuple(chunk.offsets) == tuple(index.offset or ()))
        info.transform_descriptors = [Descriptor(dtype, shape, block, blocks).encode()]
    (directory / DCP_METADATA_FILE).write_bytes(pickle.dumps(metadata))


def trailer_of(path: Path) -> ChecksumFile:
    """The checksums in the trailer that ends data file ``path``."""
    return decode_file_trailer(path.read_bytes(), where=str(path))


def leads(info: Any) -> bool:
    """Whether a stored item carries content in its descriptor: stored alone, or the first
    member of a packed region (the others carry ``MEMBER_DESCRIPTORS``)."""
    return bool(info.transform_descriptors) and \
        tuple(info.transform_descriptors) != MEMBER_DESCRIPTORS


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def _build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


# --------------------------------------------------------------------------- round trips


def test_every_kind_of_value_survives_a_round_trip_bit_identically_with_its_dtype(
    tmp_path: Path,
) -> None:
    state = mixed_state()
    tensor_io.save(state, tmp_path / "ckpt")
    loaded = blank_like(state)
    in_place = {key: value for key, value in loaded.items() if isinstance(value, torch.Tensor)}
    pointers = {key: value.data_ptr() for key, value in in_place.items()}

    tensor_io.load(loaded, tmp_path / "ckpt")

    for key, expected in state.items():
        if isinstance(expected, torch.Tensor):
            assert loaded[key].dtype == expected.dtype, key
            assert loaded[key].shape == expected.shape, key
            assert torch.equal(loaded[key], expected), key
            assert tensor_bytes(loaded[key]) == tensor_bytes(expected), key
            assert loaded[key] is in_place[key], f"{key} was replaced, not filled"
            assert loaded[key].data_ptr() == pointers[key], key
        else:
            assert loaded[key] == expected, key


def test_loading_into_a_non_contiguous_destination_fills_the_underlying_buffer(
    tmp_path: Path,
) -> None:
    saved = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 1.5
    tensor_io.save({"weight": saved, "other": torch.ones(2)}, tmp_path / "ckpt")
    buffer = torch.zeros(4, 3)
    destination = buffer.t()
    assert not destination.is_contiguous()

    tensor_io.load({"weight": destination, "other": torch.zeros(2)}, tmp_path / "ckpt")

    assert torch.equal(destination, saved)
    assert torch.equal(buffer, saved.t())


# --------------------------------------------------------------------------- on-disk format


def test_data_files_hold_each_tensor_as_its_raw_bytes_at_the_recorded_offset(
    tmp_path: Path,
) -> None:
    state = {**mixed_state(), "large": torch.randn(PACK_ITEM_BYTES // 4 + 3)}
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory)
    infos = storage_info(directory)

    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        info = infos[key]
        data = (directory / info.relative_path).read_bytes()
        assert info.length == tensor.numel() * tensor.element_size(), key
        assert data[info.offset:info.offset + info.length] == tensor_bytes(tensor), key
        descriptor = (info.transform_descriptors or [None])[0]
        if key == "large":  # stored alone: its blocks in its data file's trailer
            assert tuple(info.transform_descriptors) == TRAILER_ALONE_DESCRIPTORS
            listed = trailer_of(directory / info.relative_path)
            length, block, blocks = listed.items[(info.relative_path, info.offset)]
            assert length == info.length and block == block_bytes_for(info.length)
            assert list(blocks) == [
                hex_digest(data[at:min(at + block, info.offset + info.length)])
                for at in range(info.offset, info.offset + info.length, block)]
            continue
        # a small item lies in a packed region whose one checksum covers its bytes; the
        # region's first member names it, the others record only that they are members
        assert (tuple(info.transform_descriptors) == MEMBER_DESCRIPTORS
                or descriptor.startswith(TRAILER_PACK_PREFIX)), key
    regions = [(info.relative_path, info.offset, int(info.transform_descriptors[0].split(";")[1]))
               for info in infos.values() if info.transform_descriptors and
               info.transform_descriptors[0].startswith(TRAILER_PACK_PREFIX)]
    assert regions
    packed = [info for key, info in infos.items() if key != "large"]
    for info in packed:
        data = (directory / info.relative_path).read_bytes()
        holding = []
        for name, start, length in regions:
            if name != info.relative_path:
                continue
            if start <= info.offset and info.offset + info.length <= start + length:
                holding.append(start)
                # the region's checksum is in its file's trailer, not in .metadata
                listed = trailer_of(directory / name).regions
                assert listed[(name, start)] == (
                    length, checksum_chunks([data[start:start + length]]).split(":")[1])
        assert len(holding) == 1


def test_packed_items_cost_dcps_metadata_plus_a_shared_member_descriptor(tmp_path: Path) -> None:
    state = {f"t{number}": torch.full((50,), float(number)) for number in range(300)}
    tensor_io.save(state, tmp_path / "ours", thread_count=1)
    tensor_io.save(state, tmp_path / "dcp", thread_count=1, tensor_format="dcp")
    infos = storage_info(tmp_path / "ours")

    described = [info for info in infos.values() if leads(info)]
    assert len(described) == 1  # 300 x 200 bytes fit in one region, named once
    ours, theirs = ((tmp_path / name / ".metadata").stat().st_size for name in ("ours", "dcp"))
    # the one region descriptor, and per item its descriptor field: the key and a reference
    # (pickle's LONG_BINGET, 5 bytes each) to the one shared member descriptor that makes
    # DCP's stock reader refuse the item by name
    assert ours <= theirs + 200 + 10 * len(state)
    (data_file,) = {info.relative_path for info in infos.values()}
    assert (tmp_path / "ours" / data_file).stat().st_size <= PACK_BYTES
    _round_trips(state, tmp_path / "ours")


def test_a_flipped_byte_in_a_packs_table_of_members_names_the_region_and_its_file(
    tmp_path: Path,
) -> None:
    state = {f"t{number}": torch.full((30,), float(number)) for number in range(20)}
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory, thread_count=1)
    (leader,) = [info for info in storage_info(directory).values()
                 if leads(info)]
    _, length = leader.transform_descriptors[0].split(";")
    flip_byte(directory / leader.relative_path, leader.offset + int(length) - 20)

    with pytest.raises(CorruptCheckpointError, match="region of packed small items") as caught:
        tensor_io.load(blank_like(state), directory)
    assert Path(caught.value.file).name == leader.relative_path
    assert caught.value.key in state


def test_every_byte_of_a_packed_file_is_covered_so_a_flip_anywhere_is_found(
    tmp_path: Path,
) -> None:
    state = {f"t{number}": torch.full((30,), float(number)) for number in range(20)}
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory, thread_count=1)
    (leader,) = [info for info in storage_info(directory).values()
                 if leads(info)]
    path = directory / leader.relative_path
    assert path.stat().st_size % ALIGNMENT == 0
    for offset in range(0, path.stat().st_size, 97):  # members, padding, table, footer
        flip_byte(path, offset)
        with pytest.raises(CorruptCheckpointError):
            tensor_io.load(blank_like(state), directory)
        flip_byte(path, offset)  # undone
    _round_trips(state, directory)


def test_small_items_fill_packs_no_larger_than_the_limit_and_each_pack_is_checked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {f"t{number}": torch.randn(8000) for number in range(400)}  # 32 KB each
    tensor_io.save(state, tmp_path / "ckpt", thread_count=2)
    infos = storage_info(tmp_path / "ckpt")
    regions = {(info.relative_path, info.offset): info.transform_descriptors[0]
               for info in infos.values() if leads(info)}
    assert len(regions) >= 400 * 32000 // PACK_BYTES
    assert all(int(text.split(";")[1]) <= PACK_BYTES for text in regions.values())

    checked: list[int] = []
    original = raw_reader.hex_digest

    def count(view: memoryview) -> str:
        checked.append(len(view))
        return original(view)

    for module in (raw_tensor_files, raw_reader):  # the reader, and sharded's laid-out reads
        monkeypatch.setattr(module, "hex_digest", count)
    _round_trips(state, tmp_path / "ckpt")
    assert len(checked) == len(regions)  # every region hashed once, not once per member


def test_a_checkpoint_with_every_item_stored_alone_as_before_packing_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Checkpoints written before packing hold every item alone, small ones included, in
    # format 1; the reader keeps reading them (and verifying them block by block).
    for module in (raw_tensor_files, raw_writer):  # the writer, and sharded's replayed saves
        monkeypatch.setattr(module, "PACK_ITEM_BYTES", 0)
    state = mixed_state()
    tensor_io.save(state, tmp_path / "ckpt")
    monkeypatch.undo()
    as_format_1(tmp_path / "ckpt")
    infos = storage_info(tmp_path / "ckpt")
    assert all(info.transform_descriptors[0].startswith(f"{FORMAT_NAME}/1;")
               for info in infos.values())
    _round_trips(state, tmp_path / "ckpt")

    info = infos["f32"]
    flip_byte(tmp_path / "ckpt" / info.relative_path, info.offset + 5)
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load(blank_like(state), tmp_path / "ckpt")
    assert caught.value.key == "f32"


def test_a_flipped_byte_in_a_packed_item_names_that_item_and_its_file(tmp_path: Path) -> None:
    state = {f"t{number}": torch.full((30,), float(number)) for number in range(20)}
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory, thread_count=1)
    info = storage_info(directory)["t7"]
    flip_byte(directory / info.relative_path, info.offset + 3)

    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load(blank_like(state), directory)
    assert caught.value.key == "t7"
    assert Path(caught.value.file).name == info.relative_path
    assert "packed" in str(caught.value)
    # Only t7 asked for: the region is still checked whole, so the flip is still found.
    with pytest.raises(CorruptCheckpointError, match="t7"):
        tensor_io.load({"t7": torch.zeros(30)}, directory)
    tensor_io.load({"t3": torch.zeros(30)}, directory, verify=False)  # unchecked reads go on


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchs_stock_reader_refuses_a_raw_checkpoint_naming_the_format(tmp_path: Path) -> None:
    state = mixed_state()
    tensor_io.save(state, tmp_path / "ckpt")
    with pytest.raises((CheckpointException, ValueError), match=FORMAT_NAME):
        dcp.load(blank_like(state), storage_reader=FileSystemReader(str(tmp_path / "ckpt")),
                 no_dist=True)


def test_save_returns_every_file_with_the_size_and_checksum_of_its_bytes_on_disk(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    written = tensor_io.save(mixed_state(), directory)

    on_disk = sorted(path.name for path in directory.iterdir())
    assert sorted(file.name for file in written) == on_disk
    assert on_disk == [".metadata", "__0_0.distcp"]  # one data file, its checksums inside
    for file in written:
        data = (directory / file.name).read_bytes()
        assert file.size == len(data), file.name
        assert file.checksum == checksum_chunks([data], like=file.checksum), file.name
    (metadata,) = [file for file in written if file.name == ".metadata"]
    assert sorted(metadata.references) == [name for name in on_disk if name != ".metadata"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_of_torchs_stock_writer_still_loads_and_is_not_verified_on_read(
    tmp_path: Path,
) -> None:
    state = {"f32": torch.randn(4, 3), "i64": torch.arange(5), "count": 3}
    stock = tmp_path / "stock"
    dcp.save(state, storage_writer=FileSystemWriter(str(stock)), no_dist=True)
    ours = tmp_path / "ours"
    written = tensor_io.save(state, ours)

    loaded = {"f32": torch.zeros(4, 3), "i64": torch.zeros(5, dtype=torch.int64), "count": 0}
    tensor_io.load(loaded, stock)

    assert torch.equal(loaded["f32"], state["f32"])
    assert torch.equal(loaded["i64"], state["i64"])
    assert loaded["count"] == 3
    assert tensor_io.files_verified_on_read(stock) == set()
    assert tensor_io.files_verified_on_read(ours) == {
        file.name for file in written if file.name.endswith(".distcp")}


# --------------------------------------------------------------------------- damage


def test_a_flipped_byte_in_a_tensor_is_corrupt_naming_the_file_and_key(tmp_path: Path) -> None:
    state = mixed_state()
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory)
    info = storage_info(directory)["f32"]
    flip_byte(directory / info.relative_path, info.offset + 5)

    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load(blank_like(state), directory)
    assert caught.value.key == "f32"
    assert Path(caught.value.file).name == info.relative_path
    assert info.relative_path in str(caught.value) and "f32" in str(caught.value)

    unverified = blank_like(state)
    tensor_io.load(unverified, directory, verify=False)
    assert not torch.equal(unverified["f32"], state["f32"])  # the flip did land in f32
    assert torch.equal(unverified["i64"], state["i64"])


def test_a_flipped_byte_in_a_non_tensor_value_is_corrupt_too(tmp_path: Path) -> None:
    state = mixed_state()
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory)
    info = storage_info(directory)["count"]
    flip_byte(directory / info.relative_path, info.offset + info.length // 2)

    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load(blank_like(state), directory)
    assert caught.value.key == "count"
    assert Path(caught.value.file).name == info.relative_path


def test_a_tensor_larger_than_a_chunk_round_trips_and_a_flip_in_its_last_chunk_is_caught(
    tmp_path: Path,
) -> None:
    big = torch.arange((CHUNK_BYTES + 4096) // 4, dtype=torch.float32)
    directory = tmp_path / "ckpt"
    tensor_io.save({"big": big}, directory)
    loaded = {"big": torch.zeros_like(big)}
    tensor_io.load(loaded, directory)
    assert torch.equal(loaded["big"], big)

    info = storage_info(directory)["big"]
    flip_byte(directory / info.relative_path, info.offset + info.length - 3)
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load({"big": torch.zeros_like(big)}, directory)
    assert caught.value.key == "big"


def test_a_truncated_data_file_is_incomplete_naming_the_file_and_key(tmp_path: Path) -> None:
    state = mixed_state()
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory)
    info = storage_info(directory)["f32"]
    truncate(directory / info.relative_path, info.offset + info.length - 1)

    with pytest.raises(IncompleteCheckpointError) as caught:
        tensor_io.load(blank_like(state), directory, verify=False)
    assert Path(caught.value.file).name == info.relative_path
    assert caught.value.key == "f32"
    assert info.relative_path in str(caught.value)
    # A verified load reads the file's checksum trailer first: cut off with the end.
    with pytest.raises(CorruptCheckpointError, match="cut short") as corrupt:
        tensor_io.load(blank_like(state), directory, verify=True)
    assert Path(corrupt.value.file).name == info.relative_path


# --------------------------------------------------------------------------- manager


def _record_described_files(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every file the commit reads back to hash (``CommitProtocol._describe_file``)."""
    described: list[str] = []
    original = CommitProtocol._describe_file

    def recording(self: CommitProtocol, pending: Any, path: str) -> FileEntry:
        described.append(path)
        return original(self, pending, path)

    monkeypatch.setattr(CommitProtocol, "_describe_file", recording)
    return described


def test_a_manager_save_takes_every_checksum_from_the_writers_without_reading_a_file_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    described = _record_described_files(monkeypatch)
    model, optimizer = _build()
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()

    assert described == []
    info = manager.latest()
    assert info is not None
    tensors = Path(info.path) / info.manifest.data_path("tensors")
    listed = {entry.path: entry for entry in info.manifest.files}
    data_files = sorted(tensors.iterdir())
    assert len(data_files) > 1
    for path in data_files:
        entry = listed[f"tensors/{path.name}"]
        data = path.read_bytes()
        assert (entry.size, entry.checksum) == (
            len(data), checksum_chunks([data], like=entry.checksum)), path.name


def _saved_manager(root: Path) -> tuple[CheckpointManager, Path]:
    model, optimizer = _build()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()
    info = manager.latest()
    assert info is not None
    return manager, Path(info.path) / info.manifest.data_path("tensors")


def _failed_restore(root: Path, error: type[ResumekitError]) -> tuple[Any, bool]:
    """Restore into a fresh model without fallback: the error, and whether nothing loaded."""
    model, optimizer = _build(seed=99)
    before = _weights(model)
    with pytest.raises(error) as caught:
        CheckpointManager(root, model=model, optimizer=optimizer, fallback=False).restore()
    untouched = all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    return caught.value, untouched


def test_restore_refuses_a_flipped_byte_in_the_tensor_metadata_naming_it(tmp_path: Path) -> None:
    _, tensors = _saved_manager(tmp_path)
    metadata = tensors / ".metadata"
    flip_byte(metadata, metadata.stat().st_size // 2)

    caught, untouched = _failed_restore(tmp_path, CorruptCheckpointError)
    assert caught.file == "tensors/.metadata"
    assert ".metadata" in str(caught)
    assert untouched  # nothing was loaded


def test_restore_refuses_a_truncated_raw_file_by_its_size_before_loading_anything(
    tmp_path: Path,
) -> None:
    _, tensors = _saved_manager(tmp_path)
    victim = max((path for path in tensors.iterdir() if path.name != ".metadata"),
                 key=lambda path: path.stat().st_size)
    truncate(victim, victim.stat().st_size - 1)

    caught, untouched = _failed_restore(tmp_path, IncompleteCheckpointError)
    assert caught.file == f"tensors/{victim.name}"
    assert "bytes, the manifest" in str(caught)  # the size check, not the reader
    assert untouched  # nothing was loaded


def test_restore_leaves_a_flipped_byte_in_a_raw_file_to_the_reader_which_names_the_tensor(
    tmp_path: Path,
) -> None:
    _, tensors = _saved_manager(tmp_path)
    infos = storage_info(tensors)
    key = next(key for key in infos if key.endswith("0.weight") and key.startswith("model"))
    flip_byte(tensors / infos[key].relative_path, infos[key].offset + 1)

    caught, _ = _failed_restore(tmp_path, CorruptCheckpointError)  # found mid-load
    assert caught.key == key  # found while reading it, not by hashing the file first
    assert Path(caught.file) == tensors / infos[key].relative_path


def test_restore_still_hashes_the_small_files_before_loading(tmp_path: Path) -> None:
    _, tensors = _saved_manager(tmp_path)
    train_state = tensors.parent / "train_state.pt"
    flip_byte(train_state, train_state.stat().st_size // 2)

    caught, untouched = _failed_restore(tmp_path, CorruptCheckpointError)
    assert caught.file == "train_state.pt"
    assert untouched  # nothing was loaded


# --------------------------------------------------------------------------- catalog, commit


def _committed(root: Path, files: dict[str, bytes]) -> tuple[Storage, str]:
    store = Storage(root)
    protocol = CommitProtocol(store)
    pending = protocol.begin(1)
    for path, data in files.items():
        store.write_bytes(f"{pending.staging}/{path}", data)
    protocol.publish(pending, Manifest(step=1))
    return store, pending.name


def test_verify_with_sizes_only_checks_the_size_of_a_listed_file_but_not_its_bytes(
    tmp_path: Path,
) -> None:
    store, name = _committed(tmp_path, {"tensors/a.distcp": b"a" * 64, "other.pt": b"o" * 32})
    flip_byte(tmp_path / name / "tensors/a.distcp", 10)

    verify_checkpoint(store, name, sizes_only={"tensors/a.distcp"})
    with pytest.raises(CorruptCheckpointError) as caught:
        verify_checkpoint(store, name)
    assert caught.value.file == "tensors/a.distcp"

    truncate(tmp_path / name / "tensors/a.distcp", 63)
    with pytest.raises(IncompleteCheckpointError) as short:
        verify_checkpoint(store, name, sizes_only={"tensors/a.distcp"})
    assert short.value.file == "tensors/a.distcp"


def test_verify_with_sizes_only_still_hashes_the_files_it_does_not_list(tmp_path: Path) -> None:
    store, name = _committed(tmp_path, {"tensors/a.distcp": b"a" * 64, "other.pt": b"o" * 32})
    flip_byte(tmp_path / name / "other.pt", 3)
    with pytest.raises(CorruptCheckpointError) as caught:
        verify_checkpoint(store, name, sizes_only={"tensors/a.distcp"})
    assert caught.value.file == "other.pt"


def test_publish_refuses_a_described_file_whose_size_differs_in_the_store(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    protocol = CommitProtocol(store)
    pending = protocol.begin(1)
    data = b"0123456789" * 10
    store.write_bytes(f"{pending.staging}/tensors/a.distcp", data)
    wrong = FileEntry(path="tensors/a.distcp", size=len(data) - 1,
                      checksum=checksum_chunks([data[:-1]]))

    with pytest.raises(IncompleteCheckpointError) as caught:
        protocol.publish(pending, Manifest(step=1), described=[wrong])

    assert caught.value.step == 1 and caught.value.file == "tensors/a.distcp"
    assert "wrote 99 bytes but the store holds 100" in str(caught.value)
    protocol.abort(pending)
    assert latest_committed(store) is None


def test_publish_trusts_a_described_file_whose_size_matches_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    described = _record_described_files(monkeypatch)
    store = Storage(tmp_path)
    protocol = CommitProtocol(store)
    pending = protocol.begin(1)
    store.write_bytes(f"{pending.staging}/tensors/a.distcp", b"x" * 40)
    store.write_bytes(f"{pending.staging}/other.pt", b"y" * 8)
    known = FileEntry(path="tensors/a.distcp", size=40, checksum=checksum_chunks([b"x" * 40]))

    committed = protocol.publish(pending, Manifest(step=1), described=[known])

    assert described == ["other.pt"]
    assert {entry.path: entry for entry in committed.files}["tensors/a.distcp"] == known


# --------------------------------------------------------------------------- priority


def _record_writer_policies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    original = RawTensorWriter._write_part

    def recording(self: RawTensorWriter, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        seen.append((threading.current_thread().name, os.sched_getscheduler(0)))
        return result

    monkeypatch.setattr(RawTensorWriter, "_write_part", recording)
    return seen


def test_a_background_saves_writer_threads_run_at_idle_priority_and_a_foreground_one_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getscheduler"):
        unavailable("no SCHED_IDLE on this platform")
    seen = _record_writer_policies(monkeypatch)
    caller = os.sched_getscheduler(0)
    assert caller == os.SCHED_OTHER

    tensor_io.save(mixed_state(), tmp_path / "background", background=True)
    background, seen[:] = list(seen), []
    tensor_io.save(mixed_state(), tmp_path / "foreground")
    foreground = list(seen)

    assert len(background) > 1 and len(foreground) > 1
    assert all(thread != threading.main_thread().name for thread, _ in background)
    assert {policy for _, policy in background} == {os.SCHED_IDLE}
    assert {policy for _, policy in foreground} == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == caller  # the calling thread keeps its priority


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("priority", "policy"), [("idle", "SCHED_IDLE"),
                                                  ("normal", "SCHED_OTHER")])
def test_an_async_manager_save_writes_at_the_asked_priority_and_a_blocking_one_at_normal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, priority: str, policy: str,
) -> None:
    if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getscheduler"):
        unavailable("no SCHED_IDLE on this platform")
    seen = _record_writer_policies(monkeypatch)
    model, optimizer = _build()
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer, async_save=True,
                                background_priority=priority)  # type: ignore[arg-type]
    manager.save(1)
    for thread in threading.enumerate():  # the save finishes on its own, at the asked
        if thread.name == "resumekit-save-1":  # priority: wait() would raise its writers
            thread.join()
    manager.wait()
    in_background, seen[:] = list(seen), []
    manager.save(2, blocking=True)
    blocking = list(seen)
    manager.close()

    assert in_background and blocking
    assert {used for _, used in in_background} == {getattr(os, policy)}
    assert {used for _, used in blocking} == {os.SCHED_OTHER}


def test_an_unknown_background_priority_is_refused_naming_the_argument(tmp_path: Path) -> None:
    model, optimizer = _build()
    with pytest.raises(ConfigurationError, match="background_priority") as caught:
        CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                          background_priority="low")  # type: ignore[arg-type]
    assert caught.value.name == "background_priority"


# --------------------------------------------------------------------------- direct I/O


def _big_state() -> dict[str, Any]:
    """Tensors whose sizes are not multiples of ALIGNMENT, one bigger than a write chunk."""
    generator = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(CHUNK_BYTES // 4 + 777, generator=generator),
        "odd": torch.randn(1001, generator=generator),
        "tail": torch.arange(3, dtype=torch.int16),
        "extras": {"step": 12},
    }


def _round_trips(state: dict[str, Any], directory: Path) -> None:
    target = blank_like(state)
    tensor_io.load(target, directory)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key], value), key
        else:
            assert target[key] == value


def test_every_item_and_pack_starts_on_an_alignment_boundary_and_the_checksum_covers_padding(
    tmp_path: Path,
) -> None:
    state = _big_state()
    written = tensor_io.save(state, tmp_path / "ckpt", thread_count=1)
    infos = storage_info(tmp_path / "ckpt")
    starts = [info.offset for info in infos.values() if leads(info)]
    assert len(infos) == 4 and len(starts) == 2  # "big" alone, the rest in one pack
    assert all(start % ALIGNMENT == 0 for start in starts)
    (file,) = [file for file in written if file.name.endswith(".distcp")]
    on_disk = (tmp_path / "ckpt" / file.name).read_bytes()
    assert len(on_disk) % ALIGNMENT == 0 and file.size == len(on_disk)
    assert file.checksum == checksum_chunks([on_disk], like=file.checksum)
    _round_trips(state, tmp_path / "ckpt")


def test_page_aligned_tensors_are_aligned_and_hold_their_shape_and_dtype() -> None:
    for shape, dtype in [((3, 5), torch.float32), ((), torch.bfloat16), ((0, 2), torch.int64),
                         ((7,), torch.bool)]:
        tensor = aligned_empty(shape, dtype)
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype
        assert tensor.is_contiguous()
        if tensor.numel():
            assert tensor.data_ptr() % ALIGNMENT == 0


def test_async_staging_buffers_are_page_aligned_so_direct_io_needs_no_copy() -> None:
    staged = tensor_io.CpuStager().stage(_big_state())
    assert all(staged[key].data_ptr() % ALIGNMENT == 0 for key in ("big", "odd", "tail"))


def test_a_filesystem_that_refuses_o_direct_at_open_gets_the_same_bytes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not getattr(os, "O_DIRECT", 0):
        unavailable("this platform has no O_DIRECT")
    direct = tensor_io.save(_big_state(), tmp_path / "direct", thread_count=4)
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.warns(DirectIoRefusedWarning) as said:
        buffered = tensor_io.save(_big_state(), tmp_path / "buffered", thread_count=4)
    monkeypatch.undo()
    assert [(f.size, f.checksum) for f in buffered if f.name != ".metadata"] == [
        (f.size, f.checksum) for f in direct if f.name != ".metadata"]
    _round_trips(_big_state(), tmp_path / "buffered")
    # Said once for the directory (four writer threads, one file), naming it and errno.
    (warning,) = [w for w in said if w.category is DirectIoRefusedWarning]
    message = str(warning.message)
    assert f"refused in {tmp_path / 'buffered'} (the open of " in message
    assert "EINVAL" in message and "page cache" in message


def test_a_direct_write_refused_midway_continues_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not getattr(os, "O_DIRECT", 0):
        unavailable("this platform has no O_DIRECT")
    import resumekit.tensors.raw.files as module

    real_write = os.pwrite
    refused: list[int] = []

    def refusing_write(fd: int, data: Any, offset: int) -> int:
        if not refused and os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data, offset)

    monkeypatch.setattr(module.os, "pwrite", refusing_write)
    with pytest.warns(DirectIoRefusedWarning) as said:
        written = tensor_io.save(_big_state(), tmp_path / "ckpt", thread_count=1)
    monkeypatch.undo()
    assert refused, "the first direct write should have been refused"
    (warning,) = [w for w in said if w.category is DirectIoRefusedWarning]
    assert f"refused in {tmp_path / 'ckpt'} (a write of " in str(warning.message)
    assert "EINVAL" in str(warning.message)
    (file,) = [file for file in written if file.name.endswith(".distcp")]
    assert file.checksum == checksum_chunks([(tmp_path / "ckpt" / file.name).read_bytes()],
                                            like=file.checksum)
    _round_trips(_big_state(), tmp_path / "ckpt")


def test_direct_io_refusals_are_said_once_per_directory_of_their_owner(
    tmp_path: Path,
) -> None:
    notices = DirectIoNotices()
    refusal = OSError(errno.EINVAL, "Invalid argument")
    with pytest.warns(DirectIoRefusedWarning) as said:
        notices.refused(str(tmp_path / "a" / "0.distcp"), refusal, "the open")
        notices.refused(str(tmp_path / "a" / "1.distcp"), refusal, "a write")
        notices.refused(str(tmp_path / "b" / "0.distcp"), refusal, "the open")
    assert [str(w.message).partition(" refused in ")[2].split(" (")[0] for w in said] == [
        str(tmp_path / "a"), str(tmp_path / "b")]
    assert notices.directories == {str(tmp_path / "a"), str(tmp_path / "b")}
    # Another owner (the next save's writer) says it again.
    with pytest.warns(DirectIoRefusedWarning):
        DirectIoNotices().refused(str(tmp_path / "a" / "0.distcp"), refusal, "the open")


def test_a_stager_for_an_object_store_allocates_plain_buffers_that_dcp_writes_without_a_copy(
) -> None:
    staged = tensor_io.CpuStager(page_aligned=False).stage(_big_state())
    for key in ("big", "odd", "tail"):
        tensor = staged[key]
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_a_rank_reads_with_at_most_one_thread_per_usable_cpu_and_at_most_four() -> None:
    import resumekit.tensors.raw as module

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert max(1, min(4, cpus or 1)) == module.READ_THREADS


# --------------------------------------------------------------------------- full disk


def _chain(error: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
def test_a_full_disk_in_the_raw_writer_names_the_cause_the_file_and_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int,
) -> None:
    import resumekit.tensors.raw.files as module

    model, optimizer = _build()
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    manager.save(1)
    real_write = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            raise OSError(code, os.strerror(code))
        return real_write(fd, data, offset)

    monkeypatch.setattr(module.os, "pwrite", full)
    with pytest.raises(StorageError) as caught:
        manager.save(2)
    monkeypatch.undo()

    error = caught.value
    assert isinstance(error, OSError) and error.errno == code and error.step == 2
    message = str(error)
    assert os.strerror(code) in message and ".distcp" in message and " free of " in message
    assert str(tmp_path) in message and "step 2" in message
    assert not any(isinstance(link, BufferError) for link in _chain(error))
    assert [e.name for e in tmp_path.iterdir() if e.name != GENERATIONS_DIR] == ["step_000000001"]
    model, optimizer = _build()
    assert CheckpointManager(tmp_path, model=model, optimizer=optimizer).restore() == 1


def _writer_threads_started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    started: list[int] = []
    original = raw_writer.ThreadPoolExecutor

    class Counting(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.append(kwargs.get("max_workers", 0))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(raw_writer, "ThreadPoolExecutor", Counting)
    return started


def test_a_small_sync_save_writes_on_its_own_thread_a_large_or_background_one_on_writers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = _writer_threads_started(monkeypatch)
    small = {f"w{number}": torch.full((1000,), float(number)) for number in range(8)}
    tensor_io.save(small, tmp_path / "small")
    assert started == []
    tensor_io.save(small, tmp_path / "small-background", background=True)
    assert len(started) == 1
    large = {f"w{number}": torch.full((1 << 20,), float(number)) for number in range(8)}
    tensor_io.save(large, tmp_path / "large")  # 32 MiB: above SMALL_SAVE_BYTES
    assert len(started) == 2
    for name, state in (("small", small), ("small-background", small), ("large", large)):
        loaded = {key: torch.zeros_like(value) for key, value in state.items()}
        tensor_io.load(loaded, tmp_path / name)
        assert all(torch.equal(loaded[key], state[key]) for key in state), name
