"""resumekit.tensors.raw on DCP's public storage API: the writers' own plans and files.

The writers name their files through ``prepare_local_plan``/``prepare_global_plan`` and
write them in ``write_data``; DCP's own format (fsspec URLs, ``tensor_format="dcp"``) is
written by :class:`CheckedDcpWriter` itself, item by item as DCP's stock writer writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.serialization import get_crc32_options, set_crc32_options

from resumekit.tensors import context
from resumekit.tensors.raw import (
    CheckedDcpWriter,
    FsspecFiles,
    FsspecReader,
    RankFiles,
    RawTensorWriter,
)
from resumekit.tensors.reader import read_metadata_bytes


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(40, 30, generator=generator)
    return {
        "big": torch.randn(50_000, generator=generator),
        "bf16": torch.randn(700, generator=generator).to(torch.bfloat16),
        "transposed": base.t(),
        "view": base[2:5],  # a view of a larger storage: saved with its own bytes only
        "scalar": torch.tensor(1.5),
        "step": 12,
        "name": "run-a",
        **{f"small{number}": torch.full((number + 1,), float(number)) for number in range(9)},
    }


def _storage(directory: Path) -> dict[Any, Any]:
    return dict(read_metadata_bytes((directory / ".metadata").read_bytes(), "test").storage_data)


def _item_bytes(directory: Path, info: Any) -> bytes:
    data = (directory / info.relative_path).read_bytes()
    return data[info.offset:info.offset + info.length]


def test_the_checked_writer_stores_every_item_with_the_bytes_of_dcps_stock_writer(
    tmp_path: Path,
) -> None:
    stock, checked = tmp_path / "stock", tmp_path / "checked"
    # torch.save's zip CRC is a process-wide switch that a resumekit save in flight turns
    # off (tensors.context.without_zip_crc32), and the checked writer always writes it: the
    # stock save holds the switch on, so a background save another test left running in
    # this process cannot make the two differ in that field alone.
    with context._CRC32_LOCK:
        before = get_crc32_options()
        set_crc32_options(True)
        try:
            dcp.save(_state(), storage_writer=FileSystemWriter(stock, sync_files=False),
                     no_dist=True)
        finally:
            set_crc32_options(before)
    writer = CheckedDcpWriter(str(checked), thread_count=3)
    dcp.save(_state(), storage_writer=writer, no_dist=True)

    stock_items, checked_items = _storage(stock), _storage(checked)
    assert stock_items.keys() == checked_items.keys()
    assert {info.relative_path for info in checked_items.values()} == {
        f"__0_{number}.distcp" for number in range(3)}
    for index, info in checked_items.items():
        assert info.transform_descriptors is None, index
        assert _item_bytes(checked, info) == _item_bytes(stock, stock_items[index]), index
    loaded = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None
              for key, value in _state().items()}
    dcp.load(loaded, storage_reader=FileSystemReader(checked), no_dist=True)
    for key, value in _state().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key
    reported = {file.name for file in writer.written}
    assert reported == {".metadata", *(f"__0_{number}.distcp" for number in range(3))}


@pytest.mark.parametrize("kind", ["raw", "checked"])
def test_a_rank_saving_without_collectives_names_its_files_and_metadata_by_its_rank(
    tmp_path: Path, kind: str,
) -> None:
    writer: RawTensorWriter | CheckedDcpWriter = (
        RawTensorWriter(tmp_path / "ckpt", thread_count=2, sync_files=False) if kind == "raw"
        else CheckedDcpWriter(str(tmp_path / "ckpt"), thread_count=2))
    writer.set_up_storage_writer(True, rank=3, use_collectives=False)
    assert writer.prepare_local_plan(SavePlan([])).storage_data == RankFiles("__3_")

    dcp.save(_state(), storage_writer=writer, no_dist=True, use_collectives=False)  # rank 0
    names = {file.name for file in writer.written}
    assert "__0.metadata" in names and not (tmp_path / "ckpt" / ".metadata").exists()
    stored = {info.relative_path for info in _storage_of(tmp_path / "ckpt", "__0.metadata")
              .values()}
    assert stored == {name for name in names if name.endswith(".distcp")}
    assert all(name.startswith("__0_") for name in stored)


def _storage_of(directory: Path, name: str) -> dict[Any, Any]:
    return dict(read_metadata_bytes((directory / name).read_bytes(), name).storage_data)


def test_ranks_planned_together_get_the_prefix_of_their_rank_and_keep_one_they_have() -> None:
    writer = CheckedDcpWriter("memory://resumekit-prefixes", thread_count=1)
    plans = writer.prepare_global_plan([SavePlan([]), SavePlan([], storage_data=RankFiles("x_")),
                                        SavePlan([])])
    assert [plan.storage_data for plan in plans] == [
        RankFiles("__0_"), RankFiles("x_"), RankFiles("__2_")]


def test_a_plan_the_writer_did_not_prepare_is_refused_naming_what_it_carries(
    tmp_path: Path,
) -> None:
    writer = RawTensorWriter(tmp_path, thread_count=1, sync_files=False)
    with pytest.raises(TypeError, match="RankFiles, not NoneType"):
        writer.write_data(SavePlan([]), planner=None)  # type: ignore[arg-type]


def test_fsspec_files_do_what_dcps_filesystem_api_asks_on_any_fsspec_url() -> None:
    files = FsspecFiles()
    root = files.init_path("memory://resumekit-files/ckpt")
    assert root == "memory://resumekit-files/ckpt"
    files.mkdir(root)
    path = files.concat_path(root, "a.bin")
    with files.create_stream(path, "wb") as stream:
        stream.write(b"abc")
    assert files.exists(path)
    files.rename(path, files.concat_path(root, "b.bin"))
    assert not files.exists(path)
    with files.create_stream(files.concat_path(root, "b.bin"), "rb") as stream:
        assert stream.read() == b"abc"
    assert [name.rsplit("/", 1)[1] for name in files.ls(root)] == ["b.bin"]
    files.rm_file(files.concat_path(root, "b.bin"))
    assert files.ls(root) == []

    with pytest.raises(OSError, match="refused"), \
            files.create_stream(files.concat_path(root, "c.bin"), "wb") as stream:
        stream.write(b"partial")
        raise OSError("refused")
    assert not files.exists(files.concat_path(root, "c.bin"))  # no partial file kept

    assert FsspecFiles.validate_checkpoint_id("memory://x")
    assert not FsspecFiles.validate_checkpoint_id(Path("/tmp/x"))
    assert not FsspecFiles.validate_checkpoint_id("no-such-protocol://x")


def test_a_checkpoint_at_an_fsspec_url_loads_through_the_public_reader_over_fsspec_files(
) -> None:
    url = "memory://resumekit-reader/ckpt"
    dcp.save(_state(), storage_writer=CheckedDcpWriter(url, thread_count=2), no_dist=True)
    reader = FsspecReader(url)
    assert isinstance(reader.fs, FsspecFiles) and reader.path == url
    assert FsspecReader.validate_checkpoint_id(url)
    loaded = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None
              for key, value in _state().items()}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    for key, value in _state().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key
