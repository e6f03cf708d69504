"""Each restoring rank's part of ``.metadata``: the same plan as from the whole file (issue 40).

The checkpoints here are metadata only, built as DCP records W ranks' chunks: dim-0 shards
(FSDP2's ``torch.chunk`` split, uneven and with empty shards), a 2-D grid of chunks, a 0-d
tensor stored once and a non-tensor value, each rank's items in its own files. A load
rank's reads are planned with DCP's own ``create_read_items_for_chunk_list`` from the
whole metadata and from the skeleton completed with the rank's part; they must be equal,
for the same world size and for every resharding tried.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from resumekit.errors import CheckpointLoadError, CorruptCheckpointError
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.tensors.metadata_parts import (
    MetadataServer,
    chunk_requests,
    complete,
    local_exchange,
    request_of,
    skeleton,
)
from resumekit.tensors.raw.format import TRAILER_PACK_PREFIX
from resumekit.tensors.reader import CheckedMetadata

ROWS = {"model.embed": (37, 8), "model.head": (5, 3), "optimizer.state.embed.exp_avg": (37, 8)}
GRID = ("model.grid", (12, 10))


def _split(length: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of ``rank`` (``torch.chunk``): ``(offset, size)``."""
    size = math.ceil(length / world)
    offset = min(rank * size, length)
    return offset, max(0, min(size, length - offset))


def _grid(shape: tuple[int, int], rank: int, world: int) -> tuple[tuple[int, int], ...]:
    """A 2-D mesh's chunk of ``rank``: rows by ``world // 2`` ranks, columns by 2."""
    rows, columns = max(1, world // 2), 2 if world > 1 else 1
    row, column = divmod(rank, columns)
    r_off, r_size = _split(shape[0], row, rows)
    c_off, c_size = _split(shape[1], column, columns)
    return (r_off, c_off), (r_size, c_size)


def _chunks(world: int) -> dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """Every rank's chunk of every tensor: ``(rank, offsets, sizes)``, as DCP records them
    (a rank's empty shard leaves no chunk)."""
    found: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    for key, shape in ROWS.items():
        found[key] = []
        for rank in range(world):
            offset, size = _split(shape[0], rank, world)
            found[key].append((rank, (offset, 0), (size, shape[1])))
    found[GRID[0]] = [(rank, *_grid(GRID[1], rank, world)) for rank in range(world)]
    return {key: [chunk for chunk in chunks if 0 not in chunk[2]]
            for key, chunks in found.items()}


def _metadata(world: int) -> Metadata:
    """The ``.metadata`` of a checkpoint of ``world`` ranks (chunks, files, a 0-d tensor)."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    float32 = TensorProperties(dtype=torch.float32)
    shapes = {**ROWS, GRID[0]: GRID[1]}
    for key, chunks in _chunks(world).items():
        entries[key] = TensorStorageMetadata(float32, torch.Size(shapes[key]), [
            ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for _, o, s in chunks])
        for rank, offsets, sizes in chunks:  # rank r's chunk, in its own file
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(
                f"__{rank}_0.distcp", 64 * rank, math.prod(sizes) * 4)
    entries["optimizer.state.embed.step"] = TensorStorageMetadata(
        float32, torch.Size(()), [ChunkStorageMetadata(torch.Size(()), torch.Size(()))])
    storage[MetadataIndex("optimizer.state.embed.step", torch.Size(()))] = _StorageInfo(
        "__0_0.distcp", 9000, 4)
    entries["optimizer.param_groups.0.lr"] = BytesStorageMetadata()
    storage[MetadataIndex("optimizer.param_groups.0.lr")] = _StorageInfo(
        "__0_0.distcp", 9004, 20)
    return Metadata(entries, planner_data={key: tuple(key.split(".")) for key in entries},
                    storage_data=storage)


def _wanted(world: int, rank: int) -> dict[str, list[ChunkStorageMetadata]]:
    """The destination chunks of load rank ``rank`` of ``world`` (FSDP2's dim-0 split)."""
    wanted: dict[str, list[ChunkStorageMetadata]] = {}
    for key, shape in ROWS.items():
        offset, size = _split(shape[0], rank, world)
        wanted[key] = [ChunkStorageMetadata(torch.Size((offset, 0)),
                                            torch.Size((size, shape[1])))]
    offsets, sizes = _grid(GRID[1], rank, world)
    wanted[GRID[0]] = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
    wanted["optimizer.state.embed.step"] = [
        ChunkStorageMetadata(torch.Size(()), torch.Size(()))]
    return wanted


def _reads(items: Any) -> list[tuple[Any, ...]]:
    """Read items without the chunk-position hint of their indices (DCP never compares it)."""
    return sorted((item.type.value, item.dest_index.fqn, tuple(item.dest_index.offset or ()),
                   tuple(item.dest_offsets), item.storage_index.fqn,
                   tuple(item.storage_index.offset or ()), tuple(item.storage_offsets),
                   tuple(item.lengths)) for item in items)


def _part_metadata(whole: Metadata, wanted: dict[str, list[ChunkStorageMetadata]]
                   ) -> Metadata:
    request: dict[str, Any] = {key: chunk_requests(chunks) for key, chunks in wanted.items()}
    request["optimizer.param_groups.0.lr"] = None
    server = MetadataServer(whole, "/ckpt/tensors/.metadata")
    sent = pickle.loads(pickle.dumps(skeleton(whole)))  # as it travels
    return complete(sent, pickle.loads(pickle.dumps(server.part_for(request))))


@pytest.mark.parametrize(("saved", "loading"), [
    (1, 1), (2, 2), (8, 8), (64, 64), (2, 3), (3, 2), (8, 3), (5, 16), (64, 7), (1, 4), (4, 1)])
def test_a_ranks_reads_planned_from_its_part_equal_those_planned_from_the_whole_metadata(
        saved: int, loading: int) -> None:
    whole = _metadata(saved)
    for rank in range(loading):
        wanted = _wanted(loading, rank)
        part = _part_metadata(whole, wanted)
        for key, chunks in wanted.items():
            expected = create_read_items_for_chunk_list(
                key, whole.state_dict_metadata[key], chunks)
            got = create_read_items_for_chunk_list(key, part.state_dict_metadata[key], chunks)
            assert _reads(got) == _reads(expected), (key, rank)
            for item in got:  # every read finds its stored entry, the same one
                assert part.storage_data[item.storage_index] == \
                    whole.storage_data[item.storage_index], (key, item)
        lr = MetadataIndex("optimizer.param_groups.0.lr")
        assert part.storage_data[lr] == whole.storage_data[lr]


@pytest.mark.parametrize("world", [8, 64, 512])
def test_a_ranks_part_does_not_grow_with_the_world_size_when_the_run_shards_as_the_checkpoint(
        world: int) -> None:
    whole = _metadata(world)
    rank = world // 2 + 1
    part = MetadataServer(whole, "m").part_for(
        {key: chunk_requests(chunks) for key, chunks in _wanted(world, rank).items()})
    for key in ROWS:
        offset, _ = _split(ROWS[key][0], rank, world)
        expected = [] if offset >= ROWS[key][0] else [(offset, 0)]
        assert [offsets for offsets, _ in part.chunks[key]] == expected, key
    grid = _grid(GRID[1], rank, world)
    assert len(part.chunks[GRID[0]]) == (0 if 0 in grid[1] else 1)
    # its own file and rank 0's (the 0-d tensor stored once): never every rank's
    assert {place[0] for _, _, place in part.storage} <= {
        f"__{rank}_0.distcp", "__0_0.distcp"}


def test_the_skeleton_sent_to_every_rank_does_not_grow_with_the_world_size() -> None:
    sizes = [len(pickle.dumps(skeleton(_metadata(world)))) for world in (2, 64, 1024)]
    assert sizes[0] == sizes[1] == sizes[2], sizes
    whole = [len(pickle.dumps(_metadata(world))) for world in (2, 1024)]
    assert whole[1] > 5 * whole[0], whole
    shaped = skeleton(_metadata(64))
    assert shaped.state_dict_metadata.keys() == _metadata(64).state_dict_metadata.keys()
    entry = shaped.state_dict_metadata["model.embed"]
    assert isinstance(entry, TensorStorageMetadata)
    assert tuple(entry.size) == (37, 8) and entry.chunks == []


@pytest.mark.parametrize("asked", [((0, 0), (5, 3)), ((2, 0), (2, 3))],
                         ids=["overlapping", "exactly"])
def test_a_chunk_without_a_storage_entry_is_an_error_naming_the_key_and_the_file(
        asked: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    whole = _metadata(4)
    del whole.storage_data[MetadataIndex("model.head", torch.Size((2, 0)))]
    server = MetadataServer(whole, "/ckpt/tensors/.metadata")
    with pytest.raises(CorruptCheckpointError, match=r"/ckpt/tensors/\.metadata.*model\.head"):
        server.part_for({"model.head": [asked]})


def test_a_rank_asking_for_an_empty_stored_chunk_exactly_gets_no_chunk_and_no_entry() -> None:
    # DCP records a rank's empty shard (FSDP2 at W > rows) as a chunk of size 0
    whole = _metadata(8)
    entry = whole.state_dict_metadata["model.head"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.chunks.append(ChunkStorageMetadata(torch.Size((5, 0)), torch.Size((0, 3))))
    whole.storage_data[MetadataIndex("model.head", torch.Size((5, 0)))] = _StorageInfo(
        "__7_0.distcp", 0, 0)
    server = MetadataServer(whole, "m")
    for _ in range(2):  # asked first, then again: the same answer
        part = server.part_for({"model.head": [((5, 0), (0, 3))],
                                "model.embed": [((5, 0), (5, 8))]})
        assert part.chunks["model.head"] == []
        assert part.chunks["model.embed"] == [((5, 0), (5, 8))]
        assert [(key, offsets) for key, offsets, _ in part.storage] == [
            ("model.embed", (5, 0))]


def test_every_ranks_part_answered_in_one_call_is_its_part_asked_alone() -> None:
    saved, loading = 8, 5  # ranks 0-4 reshard; rank 5 as saved; rank 6's request failed
    whole = _metadata(saved)
    requests: list[Any] = [
        {key: chunk_requests(chunks) for key, chunks in _wanted(loading, rank).items()}
        for rank in range(loading)]
    requests.append({key: chunk_requests(chunks) for key, chunks in _wanted(saved, 5).items()}
                    | {"optimizer.param_groups.0.lr": None})
    requests.append(ValueError("rank 6 could not make its request"))
    parts = MetadataServer(whole, "m").parts_for(requests)
    assert parts[-1] is None
    for request, part in zip(requests[:-1], parts[:-1], strict=True):
        alone = MetadataServer(whole, "m").part_for(request)  # a fresh index
        assert part is not None
        assert part.chunks == alone.chunks
        assert sorted(map(repr, part.storage)) == sorted(map(repr, alone.storage))
    assert parts[5] is not None
    assert sorted(offsets for offsets, _ in parts[5].chunks["model.embed"]) == [(25, 0)]


def test_completing_twice_with_the_same_part_gives_the_same_chunks() -> None:
    whole = _metadata(4)
    part = MetadataServer(whole, "m").part_for({"model.embed": [((0, 0), (37, 8))]})
    shaped = complete(complete(skeleton(whole), part), part)
    entry = shaped.state_dict_metadata["model.embed"]
    assert isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 4


def test_a_plain_tensor_asks_for_itself_whole_and_a_value_for_every_chunk() -> None:
    whole = _metadata(2)
    flat = {"model.embed": torch.zeros(37, 8), "optimizer.param_groups.0.lr": 0.1,
            "not.in.checkpoint": torch.zeros(1)}
    assert request_of(flat, whole) == {"model.embed": [((0, 0), (37, 8))],
                                       "optimizer.param_groups.0.lr": None}


def test_the_metadata_sent_to_other_ranks_is_the_skeleton_with_the_raw_file_names(
        tmp_path: Any) -> None:
    from torch.distributed.checkpoint import FileSystemWriter, save  # noqa: PLC0415

    save({"w": torch.arange(6.0)}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    checked = CheckedMetadata.parse(data, str(tmp_path / ".metadata"))
    sent = pickle.loads(pickle.dumps(checked.for_ranks()))
    assert checked.exchanged and checked.whole
    assert sent.exchanged and not sent.whole and sent.digest == checked.digest
    assert sent.raw_files() == checked.raw_files()
    entry = sent.parsed().state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata) and entry.chunks == []
    assert sent.parsed().storage_data == {}


def test_a_planner_with_an_exchange_plans_the_same_reads_as_from_the_whole_metadata() -> None:
    whole = _metadata(3)
    state = {"model": {"embed": torch.zeros(37, 8), "head": torch.zeros(5, 3),
                       "grid": torch.zeros(12, 10)},
             "optimizer": {"state": {"embed": {"exp_avg": torch.zeros(37, 8),
                                               "step": torch.zeros(())}},
                           "param_groups": [{"lr": 0.0}]}}
    plain = _CheckedLoadPlanner("d", reject_unexpected=True)
    plain.set_up_planner(state, whole)
    expected = plain.create_local_plan().items
    received = pickle.loads(pickle.dumps(skeleton(whole)))
    planner = _CheckedLoadPlanner("d", reject_unexpected=True,
                                  exchange=local_exchange(MetadataServer(whole, "m")))
    planner.set_up_planner(state, received)
    got = planner.create_local_plan().items
    assert _reads(got) == _reads(expected)
    assert all(item.storage_index in received.storage_data for item in got)
    on_leader = _CheckedLoadPlanner("d", reject_unexpected=True, whole=True,
                                    exchange=local_exchange(MetadataServer(whole, "m")))
    on_leader.set_up_planner(state, whole)
    assert _reads(on_leader.create_local_plan().items) == _reads(expected)
    entry = whole.state_dict_metadata["model.embed"]  # the leader's copy is kept whole
    assert isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 3


def test_a_rank_whose_set_up_failed_still_takes_part_in_the_exchange_then_raises() -> None:
    whole = _metadata(2)
    calls: list[Any] = []

    def exchange(request: Any) -> Any:
        calls.append(request)
        if isinstance(request, BaseException):
            raise request
        raise AssertionError("expected the set-up's error")

    planner = _CheckedLoadPlanner("d", reject_unexpected=True, exchange=exchange)
    with pytest.raises(Exception, match="boom"):
        planner.set_up_planner({"model": _Exploding()}, skeleton(whole))
    assert len(calls) == 1 and isinstance(calls[0], Exception)


class _Exploding(dict[str, Any]):
    """A state whose flattening fails."""

    def items(self) -> Any:
        raise RuntimeError("boom")


def test_a_raw_checkpoint_reads_back_checked_from_a_part_with_its_packed_regions_first_entries(
        tmp_path: Any) -> None:
    from torch.distributed.checkpoint import load  # noqa: PLC0415

    from resumekit import tensors  # noqa: PLC0415
    from resumekit.tensors.reader import make_reader  # noqa: PLC0415

    generator = torch.Generator().manual_seed(3)
    saved = {"model": {f"small{n}": torch.randn(7 + n, generator=generator) for n in range(40)}}
    saved["model"]["large"] = torch.randn(300_000, generator=generator)
    saved["model"]["scalar"] = torch.tensor(2.5)
    tensors.save(saved, tmp_path, thread_count=2)
    checked = CheckedMetadata.parse((tmp_path / ".metadata").read_bytes(),
                                    str(tmp_path / ".metadata"))
    sent = pickle.loads(pickle.dumps(checked.for_ranks()))
    assert sent.raw_files(), "the checkpoint should be in the raw format"
    heads = {index for index, info in checked.parsed().storage_data.items()
             if str((info.transform_descriptors or ("",))[0]).startswith(TRAILER_PACK_PREFIX)}
    assert heads, "the small tensors should be packed"
    # the regions' first items are not asked for: their members still need them
    unasked = {index.fqn.split(".", 1)[1] for index in heads}
    wanted = {"model": {key: torch.zeros_like(value) for key, value in saved["model"].items()
                        if key not in unasked}}
    assert len(wanted["model"]) > 10
    planner = _CheckedLoadPlanner(str(tmp_path), reject_unexpected=False,
                                  exchange=local_exchange(checked.server()))
    reader = make_reader(str(tmp_path), None, metadata=sent)
    load(wanted, storage_reader=reader, planner=planner, no_dist=True)
    for key, value in wanted["model"].items():
        assert torch.equal(value, saved["model"][key]), key
    received = sent.parsed().storage_data
    assert heads <= set(received)


@pytest.mark.parametrize("world", [2, 8, 64])
def test_ranks_that_ask_the_same_get_one_answer_and_the_same_part(world: int) -> None:
    whole = _metadata(8)
    replicated = {"model.embed": [((0, 0), (37, 8))], "optimizer.param_groups.0.lr": None}
    requests: list[Any] = [pickle.loads(pickle.dumps(replicated)) for _ in range(world)]
    requests[1] = ValueError("rank 1 could not make its request")
    server = MetadataServer(whole, "m")
    parts = server.parts_for(requests)
    assert server.answers == 1  # not world - 1: one answer per distinct request
    assert parts[1] is None
    assert all(part is parts[0] for part in parts[2:])
    alone = MetadataServer(whole, "m").part_for(replicated)
    assert parts[0] is not None and parts[0].chunks == alone.chunks


@pytest.mark.parametrize("world", [2, 8, 64])
def test_ranks_of_a_sharded_run_each_get_their_own_answer_once(world: int) -> None:
    whole = _metadata(world)
    requests: list[Any] = [
        {key: chunk_requests(chunks) for key, chunks in _wanted(world, rank).items()}
        for rank in range(world)]
    groups = 2  # two replicas of each shard layout (HSDP): each layout answered once
    server = MetadataServer(whole, "m")
    parts = server.parts_for([request for request in requests for _ in range(groups)])
    # ranks past the rows of a short tensor hold empty shards: they ask the same
    assert server.answers == len({repr(request) for request in requests})
    assert world < 38 or server.answers < world
    for rank, request in enumerate(requests):
        mine = parts[rank * groups]
        assert mine is not None and parts[rank * groups + 1] is mine
        assert mine.chunks == MetadataServer(whole, "m").part_for(request).chunks


def _optimizer_like(generator: torch.Generator) -> dict[str, Any]:
    """A state with small replicated items (AdamW's ``step`` scalars, a param group value),
    packed small tensors and a tensor stored alone."""
    return {"model": {"big": torch.randn(300_000, generator=generator),
                      "small": torch.randn(9, generator=generator)},
            "optimizer": {"state": {"big": {"step": torch.tensor(7.0)},
                                    "small": {"step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.25}]}}


def test_small_items_asked_for_whole_come_read_in_the_part_and_are_not_read_again(
        tmp_path: Any) -> None:
    from torch.distributed.checkpoint import load  # noqa: PLC0415

    from resumekit import tensors  # noqa: PLC0415
    from resumekit.tensors.reader import SafeReader, make_reader, read_whole_items  # noqa: PLC0415

    saved = _optimizer_like(torch.Generator().manual_seed(4))
    tensors.save(saved, tmp_path, thread_count=2)
    checked = CheckedMetadata.parse((tmp_path / ".metadata").read_bytes(),
                                    str(tmp_path / ".metadata"))
    sent = pickle.loads(pickle.dumps(checked.for_ranks()))
    server = checked.server()
    reads: list[list[Any]] = []

    def read_values(items: Any) -> dict[Any, Any]:
        reads.append(list(items))
        return read_whole_items(make_reader(str(tmp_path), None, metadata=checked),
                                checked.parsed(), items)

    def exchange(request: Any) -> Any:
        # three ranks asking the same: their small items are read once, for all
        parts = server.parts_for([request, request, request], read_values)
        return pickle.loads(pickle.dumps(parts[2]))  # as it travels

    read_by_reader: list[str] = []

    class Recording(SafeReader):
        def _read_file(self, name: str, jobs: list[Any]) -> Any:
            read_by_reader.extend(job.request.storage_index.fqn for job in jobs)
            return super()._read_file(name, jobs)

    wanted = {"model": {key: torch.zeros_like(value) for key, value in saved["model"].items()},
              "optimizer": {"state": {key: {"step": torch.tensor(0.0)}
                                      for key in saved["model"]},
                            "param_groups": [{"lr": 0.0}]}}
    planner = _CheckedLoadPlanner(str(tmp_path), reject_unexpected=True, exchange=exchange)
    reader = Recording(str(tmp_path))
    reader.checked_metadata = sent
    load(wanted, storage_reader=reader, planner=planner, no_dist=True)
    assert len(reads) == 1
    assert sorted(reads[0]) == sorted([("optimizer.state.big.step", ()),
                                       ("optimizer.state.small.step", ()),
                                       ("model.small", (0,)),
                                       ("optimizer.param_groups.0.lr", None)])
    assert set(planner.values) == set(reads[0])
    assert read_by_reader == ["model.big"]  # the rest came in the part
    for key, value in saved["model"].items():
        assert torch.equal(wanted["model"][key], value), key
        assert torch.equal(wanted["optimizer"]["state"][key]["step"],
                           saved["optimizer"]["state"][key]["step"]), key
    assert wanted["optimizer"]["param_groups"][0]["lr"] == 0.25


def test_a_copy_holding_parsed_metadata_reads_small_items_without_the_metadata_file(
        tmp_path: Any) -> None:
    from resumekit import tensors  # noqa: PLC0415
    from resumekit.tensors.reader import make_reader, read_whole_items  # noqa: PLC0415

    saved = _optimizer_like(torch.Generator().manual_seed(6))
    tensors.save(saved, tmp_path, thread_count=2)
    checked = CheckedMetadata.parse((tmp_path / ".metadata").read_bytes(),
                                    str(tmp_path / ".metadata"))
    holder = CheckedMetadata.from_parsed(checked.parsed(), checked.source, checked.digest,
                                         checked.raw_files())
    (tmp_path / ".metadata").unlink()  # the reader takes the metadata from the holder
    assert not holder.whole and holder.parsed() is checked.parsed()
    assert holder.raw_files() == checked.raw_files() != set()
    items = [("optimizer.state.big.step", ()), ("model.small", (0,))]
    found = read_whole_items(make_reader(str(tmp_path), None, metadata=holder),
                             holder.parsed(), items)
    assert torch.equal(found[items[0]], saved["optimizer"]["state"]["big"]["step"])
    assert torch.equal(found[items[1]], saved["model"]["small"])


def test_a_damaged_small_item_read_for_the_parts_is_an_error_naming_its_file(
        tmp_path: Any) -> None:
    from resumekit import tensors  # noqa: PLC0415
    from resumekit.tensors.reader import make_reader, read_whole_items  # noqa: PLC0415

    tensors.save(_optimizer_like(torch.Generator().manual_seed(5)), tmp_path, thread_count=2)
    checked = CheckedMetadata.parse((tmp_path / ".metadata").read_bytes(),
                                    str(tmp_path / ".metadata"))
    step = MetadataIndex("optimizer.state.big.step", torch.Size(()))
    info = checked.parsed().storage_data[step]
    damaged = tmp_path / info.relative_path
    data = bytearray(damaged.read_bytes())
    data[info.offset] ^= 0xFF
    damaged.write_bytes(bytes(data))
    server = MetadataServer(checked.parsed(), "m")

    def read_values(items: Any) -> dict[Any, Any]:
        return read_whole_items(make_reader(str(tmp_path), None, metadata=checked),
                                checked.parsed(), items)

    request = {"optimizer.state.big.step": [((), ())]}
    with pytest.raises(CorruptCheckpointError, match=info.relative_path):
        server.parts_for([request, request], read_values)


def test_a_value_asked_for_as_a_tensors_chunk_is_an_error_naming_its_key(
        tmp_path: Any) -> None:
    from resumekit import tensors  # noqa: PLC0415
    from resumekit.tensors.reader import make_reader, read_whole_items  # noqa: PLC0415

    tensors.save(_optimizer_like(torch.Generator().manual_seed(5)), tmp_path, thread_count=2)
    checked = CheckedMetadata.parse((tmp_path / ".metadata").read_bytes(),
                                    str(tmp_path / ".metadata"))
    lr = "optimizer.param_groups.0.lr"
    with pytest.raises(CorruptCheckpointError, match=f"{lr}: asked for its chunk") as caught:
        read_whole_items(make_reader(str(tmp_path), None, metadata=checked),
                         checked.parsed(), [(lr, (0,))])
    assert caught.value.key == lr


def test_a_large_or_sharded_item_is_left_for_the_rank_to_read() -> None:
    whole = _metadata(4)
    request: Any = {key: chunk_requests(chunks) for key, chunks in _wanted(4, 1).items()}
    request["optimizer.param_groups.0.lr"] = None
    request["model.head"] = [((0, 0), (5, 3))]  # every chunk of a sharded tensor: not whole
    asked: list[Any] = []

    def read_values(items: Any) -> dict[Any, Any]:
        asked.extend(items)
        return {item: torch.zeros(()) if item[1] is not None else b"v" for item in items}

    part = MetadataServer(whole, "m").parts_for([request], read_values)[0]
    assert part is not None
    assert sorted(asked, key=repr) == [("optimizer.param_groups.0.lr", None),
                                       ("optimizer.state.embed.step", ())]
    assert set(part.values) == set(asked)


def test_requests_alike_in_their_first_keys_are_still_answered_each_as_asked() -> None:
    whole = _metadata(16)
    first = {key: chunk_requests(chunks) for key, chunks in _wanted(1, 0).items()
             if key != "model.grid"}  # every rank asks these whole: one fingerprint
    requests: list[Any] = [
        first | {"model.grid": chunk_requests(_wanted(16, rank)["model.grid"])}
        for rank in range(16)] * 2
    server = MetadataServer(whole, "m")
    parts = server.parts_for(requests)
    assert server.answers <= 16 + 16 - 8  # past 8 kept, a repeat may be answered again
    for request, part in zip(requests, parts, strict=True):
        assert part is not None
        assert part.chunks == MetadataServer(whole, "m").part_for(request).chunks


@pytest.mark.parametrize("value", [
    torch.tensor(3.0), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.tensor([True, False]), torch.arange(4, dtype=torch.int64)[::2],
    torch.empty(0, 3)])
def test_a_small_item_travels_as_its_bytes_and_lands_bit_identical(value: torch.Tensor) -> None:
    from resumekit.tensors.metadata_parts import _unpacked, packed  # noqa: PLC0415

    sent = pickle.loads(pickle.dumps(packed(value)))
    assert isinstance(sent[2], bytes)  # not a pickled tensor: cheap to unpickle
    got = _unpacked(sent, "k")
    assert got.dtype == value.dtype and got.shape == value.shape
    assert torch.equal(got, value)


def test_a_received_value_that_is_not_a_tensors_bytes_is_a_load_error_naming_its_key() -> None:
    # What rank 0 packed from a checked read always decodes: one that does not is a fault
    # of the code or the transport, never damage, so nothing may be set aside for it.
    from resumekit.tensors.metadata_parts import _unpacked  # noqa: PLC0415

    with pytest.raises(CheckpointLoadError, match=r"optimizer\.state\.w\.step") as caught:
        _unpacked(("no_such_dtype", (), b"\0\0\0\0"), "optimizer.state.w.step")
    assert not isinstance(caught.value, CorruptCheckpointError)
    assert caught.value.fields["key"] == "optimizer.state.w.step"


class _Into:
    """A planner's tensor side: resolves every read to one destination tensor."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        return self.target

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        """Nothing to do: the tensor was copied into its destination."""


@pytest.mark.parametrize(("stored", "wanted", "into"), [
    ((3,), (4,), (4,)),  # the read reaches past the value received
    ((4,), (4,), (3,)),  # the destination does not take the read
])
def test_a_received_value_that_does_not_fit_its_read_is_a_load_error_not_damage(
        stored: tuple[int, ...], wanted: tuple[int, ...], into: tuple[int, ...]) -> None:
    # Rank 0 read the value whole at the stored chunk's size, from the .metadata this
    # rank planned by: a misfit is a fault of the code, and nothing may be set aside.
    from torch.distributed.checkpoint.planner import (  # noqa: PLC0415
        LoadItemType,
        LoadPlan,
        ReadItem,
    )

    from resumekit.tensors.metadata_parts import packed, serve_values  # noqa: PLC0415

    index = MetadataIndex("optimizer.state.w.exp_avg", torch.Size((0,)))
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=index,
                    dest_offsets=torch.Size((0,)), storage_index=index,
                    storage_offsets=torch.Size((0,)), lengths=torch.Size(wanted))
    values = {("optimizer.state.w.exp_avg", (0,)): packed(torch.arange(float(stored[0])))}
    with pytest.raises(CheckpointLoadError, match=r"optimizer\.state\.w\.exp_avg") as caught:
        serve_values(LoadPlan([item]), _Into(torch.zeros(into)), values)  # type: ignore[arg-type]
    assert not isinstance(caught.value, CorruptCheckpointError)
    assert caught.value.fields["key"] == "optimizer.state.w.exp_avg"
