"""``.metadata`` laid out by rank (``schema_version`` 5, :mod:`resumekit.tensors.metadata_file`).

The whole metadata is the union of the head and the parts, value for value; each writing
rank's part holds its own chunks; a run sharded as its checkpoint is covered by its part
and plans the same answer from it as from the whole file; damage names the rank.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from resumekit.errors import CorruptCheckpointError
from resumekit.tensors import metadata_file
from resumekit.tensors.metadata_parts import MetadataServer, chunk_requests
from resumekit.tensors.parts_exchange import (
    Covered,
    PartsAnswerer,
    shared_metadata,
    small_shared_items,
)
from resumekit.tensors.raw.format import MEMBER_DESCRIPTORS, TRAILER_PACK_PREFIX
from resumekit.tensors.reader import read_metadata_bytes
from tests.unit.test_metadata_parts import _metadata, _wanted

REGION = (f"{TRAILER_PACK_PREFIX}4096",)


def _packed(world: int) -> Metadata:
    """:func:`_metadata` of ``world`` ranks, with a packed region in a rank's file.

    Its first item is a sharded tensor's chunk (that rank's), its member the optimizer's
    0-d ``step`` (a shared item): the region's first entry must come with the shared ones.
    """
    metadata = _metadata(world)
    storage = metadata.storage_data
    key = "model.head"
    chunks = metadata.state_dict_metadata[key].chunks
    last = len(chunks) - 1  # the last rank with a chunk of it (empty shards leave none)
    head_chunk = chunks[-1]
    index = MetadataIndex(key, head_chunk.offsets)
    storage[index] = _StorageInfo(f"__{last}_0.distcp", 8192, 60,
                                  transform_descriptors=REGION)
    storage[MetadataIndex("optimizer.state.embed.step", torch.Size(()))] = _StorageInfo(
        f"__{last}_0.distcp", 8256, 4, transform_descriptors=MEMBER_DESCRIPTORS)
    return metadata


def _encode(metadata: Metadata, world: int) -> bytes:
    files = {f"__{rank}_0.distcp": rank for rank in range(world)}
    return metadata_file.encode(metadata, files, world, files)


def _head(data: bytes) -> metadata_file.Head:
    length, expected = metadata_file.read_head_length(data, "m")
    return metadata_file.parse_head(
        data[metadata_file.FRAME_BYTES:metadata_file.FRAME_BYTES + length], expected, "m")


def _part(data: bytes, head: metadata_file.Head, rank: int) -> list[metadata_file.Row]:
    offset, length, checksum = head.parts[rank]
    return metadata_file.parse_part(data[head.base + offset:head.base + offset + length],
                                    checksum, "m", rank)


@pytest.mark.parametrize("world", [1, 2, 5, 64])
def test_the_whole_metadata_read_back_is_the_one_it_was_written_from(world: int) -> None:
    metadata = _packed(world)
    data = _encode(metadata, world)
    assert metadata_file.is_framed(data) and not metadata_file.is_framed(pickle.dumps(metadata))
    decoded = read_metadata_bytes(data, "m")
    assert decoded.state_dict_metadata == metadata.state_dict_metadata
    assert decoded.storage_data == metadata.storage_data
    assert decoded.planner_data == metadata.planner_data


def test_each_writing_ranks_part_holds_its_own_chunks_and_the_head_the_shared_items() -> None:
    world = 4
    metadata = _packed(world)
    data = _encode(metadata, world)
    head = _head(data)
    assert len(head.parts) == world
    assert head.shared_keys == {"optimizer.state.embed.step", "optimizer.param_groups.0.lr"}
    # the shared member's region's first entry (the last rank's chunk) is shared too
    assert any(row[0] == "model.head" and row[1] == -2 for row in head.shared)
    for rank in range(world):
        rows = _part(data, head, rank)
        assert rows and {row[4] for row in rows} == {f"__{rank}_0.distcp"}
        assert not {row[0] for row in rows} & head.shared_keys


@pytest.mark.parametrize("world", [2, 5, 64])
def test_a_run_sharded_as_its_checkpoint_is_covered_and_plans_as_from_the_whole_file(
        world: int) -> None:
    metadata = _packed(world)
    data = _encode(metadata, world)
    head = _head(data)
    whole = MetadataServer(metadata, "m")
    for rank in range(world):
        request = {key: chunk_requests(chunks) for key, chunks in _wanted(world, rank).items()}
        request["optimizer.param_groups.0.lr"] = None
        rows = _part(data, head, rank)
        assert metadata_file.covers(request, head.shared_keys, rows), rank
        own = MetadataServer(shared_metadata(head, rows), "m").part_for(request)
        expected = whole.part_for(request)
        assert own.chunks == expected.chunks, rank
        assert sorted(own.storage, key=repr) == sorted(expected.storage, key=repr), rank


@pytest.mark.parametrize(("saved", "loading"), [(2, 3), (4, 2), (5, 1)])
def test_a_run_of_another_sharding_is_not_covered(saved: int, loading: int) -> None:
    data = _encode(_packed(saved), saved)
    head = _head(data)
    uncovered = []
    for rank in range(min(saved, loading)):
        request = {key: chunk_requests(chunks)
                   for key, chunks in _wanted(loading, rank).items()}
        uncovered.append(not metadata_file.covers(request, head.shared_keys,
                                                  _part(data, head, rank)))
    assert any(uncovered)
    # every chunk of a sharded tensor (a request of None) is never covered by one part
    assert not metadata_file.covers({"model.embed": None}, head.shared_keys,
                                    _part(data, head, 0))


def test_a_flipped_byte_in_a_part_names_the_rank_and_the_whole_read_fails_too() -> None:
    world = 3
    data = bytearray(_encode(_packed(world), world))
    head = _head(bytes(data))
    offset, length, _ = head.parts[1]
    data[head.base + offset + length // 2] ^= 0x10
    with pytest.raises(CorruptCheckpointError, match="rank 1's part fails its checksum") as caught:
        _part(bytes(data), head, 1)
    assert caught.value.rank == 1
    with pytest.raises(CorruptCheckpointError, match="rank 1's part"):
        read_metadata_bytes(bytes(data), "m")
    _part(bytes(data), head, 0)  # the others' parts are still read


def test_a_flipped_byte_in_the_head_fails_its_checksum() -> None:
    data = bytearray(_encode(_packed(2), 2))
    data[metadata_file.FRAME_BYTES + 40] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match="its head fails its checksum"):
        read_metadata_bytes(bytes(data), "m")


def test_stock_pickle_stops_at_the_first_bytes_naming_the_format_and_its_reader() -> None:
    with pytest.raises(ValueError, match=r"resumekit\.StorageReader") as caught:
        pickle.loads(_encode(_packed(2), 2))  # noqa: S301 - what stock DCP's reader does
    assert str(caught.value) == metadata_file.REFUSAL


def test_the_small_shared_items_are_the_step_scalar_and_the_param_group_value() -> None:
    head = _head(_encode(_packed(3), 3))
    assert sorted(small_shared_items(head), key=repr) == sorted(
        [("optimizer.state.embed.step", ()), ("optimizer.param_groups.0.lr", None)], key=repr)


def test_a_head_grows_with_the_world_size_by_its_table_only() -> None:
    heads = {world: _head(_encode(_packed(world), world)) for world in (8, 256)}
    assert heads[8].shared == heads[256].shared
    # the skeleton and the shared items do not grow; the table grows by ~60 bytes a rank
    assert heads[256].base - heads[8].base < 100 * (256 - 8)


def test_a_one_chunk_tensor_of_part_of_its_size_is_not_a_shared_key() -> None:
    float32 = TensorProperties(dtype=torch.float32)
    metadata = Metadata({"x": TensorStorageMetadata(float32, torch.Size((4,)), [
        ChunkStorageMetadata(torch.Size((0,)), torch.Size((2,)))])},
        storage_data={MetadataIndex("x", torch.Size((0,))): _StorageInfo("__0_0.distcp", 0, 8)})
    head = _head(_encode(metadata, 1))
    assert head.shared_keys == set()


def test_a_rank_not_covered_makes_rank_0_read_the_whole_file_and_say_so(
        caplog: pytest.LogCaptureFixture) -> None:
    metadata = _packed(2)
    head = _head(_encode(metadata, 2))
    read: list[str] = []

    def read_whole() -> Metadata:
        read.append("whole")
        return metadata

    answerer = PartsAnswerer(head, "/ckpt/step_000000003/tensors/.metadata", read_whole,
                             lambda found, items: {})
    with caplog.at_level(logging.INFO, logger="resumekit"):
        answerer.parts_for([Covered(reads_shared=False), Covered(reads_shared=False)])
    assert read == [] and answerer.whole_reads == 0 and not caplog.records
    # rank 1 of another world size asks for its shard of a sharded tensor
    request = {"model.embed": chunk_requests(_wanted(3, 1)["model.embed"])}
    with caplog.at_level(logging.INFO, logger="resumekit"):
        replies = answerer.parts_for([Covered(reads_shared=False), request])
    assert read == ["whole"] and answerer.whole_reads == 1
    assert replies[1] is not None and replies[1].chunks
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1, said
    assert "/ckpt/step_000000003/tensors/.metadata" in said[0], said
    assert "rank 1 not covered by its own part" in said[0], said
    assert "reading it whole" in said[0], said
