"""A multi-rank save of a remembered structure, written without DCP's save machinery.

A steady-state save of a sharded run writes the same structure every time, and
:mod:`resumekit.tensors.save_planner` already plans it once. What DCP still does on every save is
most of a small save's cost: four rounds of pickled object collectives (the local plans to
the coordinator and back, the write results to it and its outcome back), walking the
plans, checking every item stored and pickling ``.metadata`` (on 2 gloo ranks, ~25 ms of
a ~40 ms write of the LingBot tiny trainer's 2.6 MB).

After a planned save of raw tensor files completes, each rank keeps a :class:`Replay`
record: its files in order with their write items, what each item stored, and (the
coordinator) the checkpoint's ``Metadata`` and ``.metadata`` bytes. A later save in the
same slot (:attr:`resumekit.tensors.save_planner.StructureCachingSavePlanner.slot`) replays it:

1. each rank flattens its state as DCP does and checks that its structure key is the
   record's and that every non-tensor value pickles to the length it had (a changed length
   would move the items after it);
2. one collective (an all-reduce of each rank's record number, or -1) agrees that every
   rank replays the same record; any disagreement and every rank plans in full, as before
   (logged at DEBUG with the directory and this rank's reason);
3. each rank writes its files with the raw writer's own code (the same items, order and
   offsets: the same bytes), and checks that every item stored where the record says;
4. one gather brings each rank's outcome and the storage entries that change from save to
   save (the block checksums of items too large to pack) to the coordinator, which writes
   ``.metadata`` (the record's bytes when nothing changed, else the record's ``Metadata``
   with those entries replaced, pickled as DCP does);
5. one broadcast tells every rank the outcome: every rank returns, or every rank raises
   (the failing rank its own error, the others one naming it) and forgets the record.

The files are byte for byte those DCP's path writes for the same state (tested against
it, ``.metadata`` included), so readers cannot tell the two apart.

A fresh process has no planned save to remember, so its first save would be planned in
full (on 2 gloo ranks ~85 ms more than a replay: a relaunch after every preemption pays
it). :func:`seed` makes the record from the checkpoint the process just restored instead:
its ``.metadata`` is what the coordinator kept, and each rank's files (named by rank), in
the order of their entries, are that rank's jobs. Such a record knows no structure key; the
first save that replays it checks its state against the checkpoint's metadata (every key,
shape, dtype, tensor properties, nesting, and that every chunk a rank is to write is one
it holds) and adopts the key, or votes to plan in full. A checkpoint of another world
size, of DCP's own format or written by another writer is not used.

A replay whose files come out unlike the record (an item stored elsewhere: a record made
from a checkpoint of an older layout) writes no ``.metadata``: every rank removes the files
it wrote and the save is planned in full instead, said at DEBUG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from resumekit.errors import ResumekitError, StorageError
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.manifest import checksum_chunks
from resumekit.tensors import save_planner
from resumekit.tensors.raw import (
    DATA_SUFFIX,
    RawTensorWriter,
    WrittenFile,
    checksum_files,
    is_described_pack,
    is_packed_member,
    publish_metadata,
    refuse_existing_checkpoint,
    written_metadata,
)

__all__ = ["Replay", "remember", "save_replayed", "seed"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replay:
    """One rank's record of a planned save, as a later save of its structure replays it.

    Attributes:
        number: Planned saves completed in the slot when it was made (the same on every
            rank that made its record at the same save).
        key: The writer's thread count and the state's structure key; None for a record
            made from a restored checkpoint, until a save's state was checked against it.
        prefix: The file-name prefix of this rank's files.
        jobs: Per data file, its name and its write items, in file order.
        stored: What each item stored (``relative_path``, offset, length, descriptors).
        varying: The items whose stored entry changes from save to save (block checksums
            in their descriptors): only their position must match.
        byte_lengths: The pickled length of each non-tensor item.
        shards: This rank's DTensor shard offsets by key (the planner's lookup).
        metadata: The coordinator's ``Metadata`` of that save (None elsewhere).
        metadata_bytes: Its ``.metadata`` bytes (coordinator).
        metadata_checksum: Their checksum (coordinator).
        references: The files ``.metadata`` references (coordinator).
        expected: For a record made from a restored checkpoint: its metadata's entries
            (``state_dict_metadata``) and nesting (``planner_data``), what a save's state
            is checked against before the record is replayed.
    """

    number: int
    key: Hashable
    prefix: str
    jobs: tuple[tuple[str, tuple[WriteItem, ...]], ...]
    stored: Mapping[MetadataIndex, _StorageInfo]
    varying: frozenset[MetadataIndex]
    byte_lengths: Mapping[MetadataIndex, int]
    shards: dict[str, Any]
    metadata: Metadata | None
    metadata_bytes: bytes | None
    metadata_checksum: str | None
    references: tuple[str, ...]
    expected: tuple[Mapping[str, Any], Any] | None = None


def _varies(info: _StorageInfo) -> bool:
    """Whether an item's stored entry carries per-save content (block checksums)."""
    descriptors = info.transform_descriptors or ()
    return not is_packed_member(descriptors) and not is_described_pack(descriptors)


def remember(planner: save_planner.StructureCachingSavePlanner, writer: RawTensorWriter,
             thread_count: int) -> None:
    """Count the planned save ``writer`` just completed; keep its record where it can replay.

    Every rank of the group calls this after the same successful save. A rank whose save
    cannot be replayed (a value the structure key does not cover, a ``.metadata`` that
    names the save) keeps no record and votes against replaying the next one.
    """
    try:
        record = _record_of(planner, writer, thread_count)
    except Exception as error:  # noqa: BLE001 - counted all the same: ranks vote in step
        logger.debug("resumekit: the save in %s will not be replayed: %s: %s",
                     os.fspath(writer.path), type(error).__name__, error)
        record = None
    save_planner.set_replay_record(planner.slot, record)


def _record_of(planner: save_planner.StructureCachingSavePlanner, writer: RawTensorWriter,
               thread_count: int) -> Replay | None:
    jobs, results, prefix = writer.last_jobs, writer.last_results, writer.last_prefix
    if planner.structure is None or jobs is None or results is None or prefix is None:
        return None
    stored = {result.index: result.storage_data for result in results}
    if any(not isinstance(info, _StorageInfo) for info in stored.values()):
        return None
    items = [item for _, file_items in jobs for item in file_items]
    if len(stored) != len(items) or any(item.index not in stored for item in items):
        return None
    lengths = {item.index: stored[item.index].length for item in items
               if item.type == WriteItemType.BYTE_IO}
    metadata: Metadata | None = None
    data: bytes | None = None
    checksum: str | None = None
    references: tuple[str, ...] = ()
    if planner.is_coordinator:
        metadata = writer.last_metadata
        read_back = written_metadata(writer)
        if metadata is None or metadata.storage_meta is not None or read_back is None:
            return None
        data, entry = read_back
        metadata = dataclasses.replace(metadata, storage_data=dict(metadata.storage_data))
        checksum, references = entry.checksum, entry.references
    return Replay(
        number=save_planner.completed_saves(planner.slot) + 1,
        key=(thread_count, planner.structure), prefix=prefix,
        jobs=tuple((name, tuple(file_items)) for name, file_items in jobs),
        stored=stored, varying=frozenset(i for i, info in stored.items() if _varies(info)),
        byte_lengths=lengths, shards=dict(planner.shards), metadata=metadata,
        metadata_bytes=data, metadata_checksum=checksum, references=references)


class _NotSeedable(Exception):
    """Why a restored checkpoint cannot be replayed as it lies."""


def seed(slot: str, metadata: Metadata, data: bytes, *, rank: int, world_size: int) -> None:
    """Count a restored checkpoint in ``slot``; keep the record it makes, if it can.

    Every rank of the group calls this once for the same restore, as after a planned
    save (:func:`remember`): a rank whose record cannot be made keeps none and votes
    against replaying, so the next save is planned in full on every rank.

    Args:
        slot: The cache slot the restored run's saves use.
        metadata: The checkpoint's ``.metadata``, as read.
        data: Its bytes.
        rank: This rank in the group.
        world_size: The group's size.
    """
    try:
        record: Replay | None = _record_from(metadata, data, rank, world_size,
                                             save_planner.completed_saves(slot) + 1)
    except Exception as error:  # noqa: BLE001 - counted all the same: ranks vote in step
        logger.debug("resumekit: the first save after restoring will be planned in full: "
                     "%s: %s", type(error).__name__, error)
        record = None
    save_planner.set_replay_record(slot, record)


def _rank_and_number(name: str) -> tuple[int, int] | None:
    """``(rank, n)`` of a raw data file ``__<rank>_<n>.distcp``, or None."""
    if not (name.startswith("__") and name.endswith(DATA_SUFFIX)):
        return None
    rank, _, number = name[2:-len(DATA_SUFFIX)].partition("_")
    return (int(rank), int(number)) if rank.isdigit() and number.isdigit() else None


def _record_from(metadata: Metadata, data: bytes, rank: int, world_size: int,
                 number: int) -> Replay:
    """This rank's record of the save that wrote ``metadata`` (see :func:`seed`)."""
    if metadata.storage_meta is not None:
        raise _NotSeedable("its .metadata names the save that wrote it")
    entries = metadata.state_dict_metadata
    files: dict[str, list[WriteItem]] = {}
    numbers: dict[str, int] = {}  # file name -> its n in __<rank>_<n>.distcp
    stored: dict[MetadataIndex, _StorageInfo] = {}
    if not any(isinstance(info, _StorageInfo) and info.transform_descriptors
               for info in metadata.storage_data.values()):
        raise _NotSeedable("it is not stored as raw tensor files (DCP's own format)")
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise _NotSeedable(f"{index.fqn} is not stored in a file")
        if not info.transform_descriptors:
            raise _NotSeedable(f"{index.fqn} is a packed member without a descriptor "
                               "(written before they had one); a save in full adds them")
        parsed = _rank_and_number(info.relative_path)
        owner = parsed[0] if parsed is not None else None
        if owner is None or owner >= world_size:
            raise _NotSeedable(f"{info.relative_path} is not a data file of one of this "
                               f"group's {world_size} ranks")
        if owner == rank and parsed is not None:
            numbers[info.relative_path] = parsed[1]
            files.setdefault(info.relative_path, []).append(_item_of(index, entries))
            stored[index] = info
    jobs = tuple((name, tuple(files[name])) for name in sorted(files, key=numbers.__getitem__))
    coordinator = rank == 0
    checksum = checksum_chunks([data]) if coordinator else None
    references = tuple(sorted({info.relative_path for info in metadata.storage_data.values()}
                              | checksum_files(metadata.storage_data))) if coordinator else ()
    return Replay(
        number=number, key=None, prefix=f"__{rank}_", jobs=jobs, stored=stored,
        varying=frozenset(i for i, info in stored.items() if _varies(info)),
        byte_lengths={index: stored[index].length for _, items in jobs for index in
                      (item.index for item in items if item.type == WriteItemType.BYTE_IO)},
        shards={item.index.fqn: item.index.offset for _, items in jobs for item in items
                if item.type != WriteItemType.BYTE_IO},
        metadata=dataclasses.replace(metadata, storage_data=dict(metadata.storage_data))
        if coordinator else None,
        metadata_bytes=data if coordinator else None, metadata_checksum=checksum,
        references=references, expected=(entries, metadata.planner_data))


def _item_of(index: MetadataIndex, entries: Mapping[str, Any]) -> WriteItem:
    """The write item DCP's plan made for the stored entry ``index``."""
    entry = entries.get(index.fqn)
    if isinstance(entry, BytesStorageMetadata):
        return WriteItem(index=index, type=WriteItemType.BYTE_IO)
    if not isinstance(entry, TensorStorageMetadata):
        raise _NotSeedable(f"{index.fqn} has no entry in the checkpoint's metadata")
    chunk = next((chunk for chunk in entry.chunks if chunk.offsets == index.offset), None)
    if chunk is None:
        raise _NotSeedable(f"{index.fqn} has no chunk at {index.offset}")
    whole = not any(chunk.offsets) and chunk.sizes == entry.size
    return WriteItem(index=index, type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes),
                         properties=entry.properties, size=entry.size))


def _unlike_restored(record: Replay, planner: save_planner.StructureCachingSavePlanner
                     ) -> str | None:
    """Why this rank's state is not the one a seeded record was made from, or None."""
    assert record.expected is not None
    entries, nesting = record.expected
    state = planner.state_dict
    if nesting != getattr(planner, "mappings", None):
        return "the state's nesting is not the restored checkpoint's"
    if len(state) != len(entries):
        return (f"the state has {len(state)} entries, the restored checkpoint "
                f"{len(entries)}")
    held: dict[str, list[ChunkStorageMetadata]] = {}
    chunks_by_layout: save_planner.ChunksByLayout = {}
    for fqn, value in state.items():
        unlike = _unlike_entry(fqn, value, entries.get(fqn), held, chunks_by_layout)
        if unlike is not None:
            return unlike
    for _, items in record.jobs:
        for item in items:
            if item.tensor_data is not None and item.tensor_data.chunk not in \
                    held.get(item.index.fqn, ()):
                return f"this rank does not hold {item.index.fqn} at {item.index.offset}"
    return None


def _unlike_entry(fqn: str, value: Any, entry: Any,
                  held: dict[str, list[ChunkStorageMetadata]],
                  chunks_by_layout: save_planner.ChunksByLayout
                  ) -> str | None:
    """Why ``value`` is not what the checkpoint's ``entry`` describes; note its chunks.

    The properties and chunks are those DCP's plan would record for ``value`` (a
    DTensor: of ``to_local()``, and its ``__create_chunk_list__``), computed without
    DCP's per-tensor autograd call, and once per global shape and placement.
    """
    kind = type(value)
    if kind is DTensor or kind is torch.Tensor or kind is torch.nn.Parameter:
        if kind is DTensor:
            local = value._local_tensor
            chunks = save_planner.dtensor_chunks(value, chunks_by_layout)
            # to_local() is the local tensor itself without grad mode, else an autograd
            # view that requires grad exactly when the DTensor does.
            grad = value.requires_grad if torch.is_grad_enabled() else local.requires_grad
        else:
            local, grad = value, value.requires_grad
            chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()),
                                           sizes=value.size())]
        properties = TensorProperties(
            dtype=local.dtype, layout=local.layout, requires_grad=grad,
            memory_format=torch.contiguous_format, pin_memory=local.is_pinned())
        if not isinstance(entry, TensorStorageMetadata) or entry.size != value.size() \
                or entry.properties != properties \
                or any(chunk not in entry.chunks for chunk in chunks):
            return f"{fqn} is not the restored checkpoint's tensor"
        held[fqn] = chunks
        return None
    if isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
        return f"{fqn} is a {kind.__name__}, which plans its own writes"
    if not isinstance(entry, BytesStorageMetadata):
        return f"{fqn} is not the restored checkpoint's non-tensor value"
    return None


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where ``group``'s tensor collectives take their tensors (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":  # pragma: no cover - GPU machines only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(vote: int, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` voted the same record number (>= 0)."""
    votes = torch.tensor([vote, -vote], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    low, high = int(votes[0]), -int(votes[1])
    return low == high and low >= 0


def _resolved(record: Replay, planner: save_planner.StructureCachingSavePlanner
              ) -> list[tuple[str, list[tuple[WriteItem, torch.Tensor | io.BytesIO]]]] | str:
    """The record's files with this state's data, or why not (a pickled length changed)."""
    planner.shards = record.shards
    jobs: list[tuple[str, list[tuple[WriteItem, torch.Tensor | io.BytesIO]]]] = []
    for name, items in record.jobs:
        resolved: list[tuple[WriteItem, torch.Tensor | io.BytesIO]] = []
        for item in items:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO) and \
                    data.getbuffer().nbytes != record.byte_lengths.get(item.index):
                return (f"the value of {item.index.fqn} pickles to {data.getbuffer().nbytes} "
                        f"bytes, not {record.byte_lengths.get(item.index)}")
            resolved.append((item, data))
        jobs.append((name, resolved))
    return jobs


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What a rank sends the coordinator after writing its files."""

    failure: str | None
    changed: dict[MetadataIndex, _StorageInfo]
    unlike: bool = False


def save_replayed(state_dict: Mapping[str, Any], writer: RawTensorWriter,
                  planner: save_planner.StructureCachingSavePlanner,
                  group: dist.ProcessGroup | None, thread_count: int
                  ) -> list[WrittenFile] | None:
    """Write ``state_dict`` by replaying the slot's record, or None: plan it in full.

    Every rank of ``group`` calls it for the same save, and either every rank gets None
    (it then saves through DCP) or every rank has written (or every rank raises).

    Raises:
        StorageError: A rank failed to write (the failing rank raises its own error, the
            others one naming it); nothing was written as ``.metadata``.
    """
    slot = planner.slot
    if save_planner.completed_saves(slot) == 0:  # no rank has a record yet: no vote
        return None
    record: Replay | None = save_planner.replay_record(slot)
    rank = dist.get_rank(group)
    coordinator = rank == 0
    directory = os.fspath(writer.path)
    jobs: Any = "this rank kept no record of the last planned save"
    try:
        planner.set_up_planner(_stateful_to_state_dict(dict(state_dict)), None, coordinator)
        if record is not None:
            record, jobs = _checked(record, planner, thread_count, coordinator)
    except Exception as error:  # noqa: BLE001 - vote to plan in full: DCP's path reports it
        jobs = f"{type(error).__name__}: {error}"
    if not _agree(record.number if record is not None and not isinstance(jobs, str) else -1,
                  group):
        # Not a skip: DCP plans the same files in full. Said at DEBUG, with the reason.
        logger.debug("resumekit: the save in %s is planned in full, not replayed: %s",
                     directory, jobs if isinstance(jobs, str) else "another rank cannot "
                     "replay its record")
        return None
    assert record is not None and not isinstance(jobs, str)  # every rank voted its number
    save_planner.touch(slot)
    own_error: BaseException | None = None
    outcome = _Outcome(None, {})
    try:
        outcome = _write(record, jobs, writer, directory, rank)
    except Exception as error:  # noqa: BLE001 - every rank must hear of it; re-raised below
        own_error = error
        outcome = _Outcome(f"{type(error).__name__}: {error}", {})
    failure, replan = _finish(record, outcome, writer, group, coordinator, directory)
    if failure is not None and replan:
        save_planner.forget_replay_record(slot)
        _remove_written(writer, directory)
        logger.debug("resumekit: the save in %s is planned in full, not replayed: its files "
                     "came out unlike the record (%s)", directory, failure)
        return None
    if failure is not None:
        save_planner.forget_replay_record(slot)
        if isinstance(own_error, ResumekitError):
            raise own_error
        raise StorageError(f"writing checkpoint {directory} failed: {failure}",
                           path=directory, operation="save") from own_error
    return list(writer.written)


def _checked(record: Replay, planner: save_planner.StructureCachingSavePlanner,
             thread_count: int, coordinator: bool) -> tuple[Replay, Any]:
    """The record to replay for the planner's state and its resolved jobs, or why not.

    A record made from a restored checkpoint is checked against the state once, and
    then keeps the state's structure key like any other.
    """
    key = (thread_count, save_planner.structure_key(
        planner.state_dict, getattr(planner, "mappings", None), coordinator))
    if record.key is None:  # made from the restored checkpoint
        unlike = "the state's structure cannot be cached" if key[1] is None \
            else _unlike_restored(record, planner)
        if unlike is not None:
            return record, unlike
        record = dataclasses.replace(record, key=key)
        save_planner.set_replay_record(planner.slot, record, count=False)
    if record.key != key:
        return record, "the state's structure (keys, shapes, dtypes, placements) changed"
    return record, _resolved(record, planner)


def _write(record: Replay, jobs: Sequence[tuple[str, Sequence[tuple[WriteItem, Any]]]],
           writer: RawTensorWriter, directory: str, rank: int) -> _Outcome:
    """This rank's files; what changed in their stored entries (or how they are unlike)."""
    refuse_existing_checkpoint(directory)  # as DCP's writer
    results: list[WriteResult] = writer.write_jobs(jobs, record.prefix)
    changed: dict[MetadataIndex, _StorageInfo] = {}
    for result in results:
        was, now = record.stored.get(result.index), result.storage_data
        if result.index in record.varying and was is not None and (
                now.relative_path, now.offset, now.length) == (
                was.relative_path, was.offset, was.length):
            changed[result.index] = now
        elif now != was:  # the same items, sizes and order, but another layout
            return _Outcome(f"rank {rank}'s item {result.index.fqn} was stored as {now}, "
                            f"the record says {was}", {}, unlike=True)
    return _Outcome(None, changed)


def _remove_written(writer: RawTensorWriter, directory: str) -> None:
    """Remove the files this rank's replay wrote (its save is planned in full instead)."""
    for file in writer.written:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, file.name))
    writer.written = []


def _finish(record: Replay, outcome: _Outcome, writer: RawTensorWriter,  # noqa: PLR0917
            group: dist.ProcessGroup | None, coordinator: bool, directory: str
            ) -> tuple[str | None, bool]:
    """Gather every rank's outcome, write ``.metadata`` (coordinator), agree on the result.

    Returns:
        ``(None, False)`` when every rank wrote and ``.metadata`` is in place, else what
        failed (the same text on every rank) and whether only layouts were unlike the
        record (nothing failed: the save can be planned in full instead).
    """
    root = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list[_Outcome] | None = [outcome] * dist.get_world_size(group) \
        if coordinator else None
    dist.gather_object(outcome, gathered if coordinator else None, dst=root, group=group)
    failure: str | None = None
    replan = False
    if coordinator:
        assert gathered is not None and record.metadata is not None
        failures = [f"rank {number}: {each.failure}" for number, each in enumerate(gathered)
                    if each.failure is not None]
        if failures:
            failure = "; ".join(failures)
            replan = all(each.unlike for each in gathered if each.failure is not None)
        else:
            try:
                writer.written.append(_write_metadata(record, gathered, directory,
                                                      writer.sync_files))
            except Exception as error:  # noqa: BLE001 - reported to every rank below
                failure = f"rank 0: {type(error).__name__}: {error}"
    status = torch.tensor([0 if failure is None else 2 if replan else 1], dtype=torch.int64,
                          device=_collective_device(group))
    dist.broadcast(status, src=root, group=group)
    if int(status[0]) == 0:
        return None, False
    message = [failure]
    dist.broadcast_object_list(message, src=root, group=group)
    return str(message[0]), int(status[0]) == 2


def _write_metadata(record: Replay, gathered: Sequence[_Outcome], directory: str,
                    sync: bool) -> WrittenFile:
    """Write ``.metadata`` (through a temporary name) and describe it."""
    assert record.metadata is not None and record.metadata_bytes is not None
    changed = {index: info for each in gathered for index, info in each.changed.items()}
    if changed:
        storage = dict(record.metadata.storage_data)
        storage.update(changed)  # existing keys: DCP's order kept, so its pickle's bytes
        data = pickle.dumps(dataclasses.replace(record.metadata, storage_data=storage))
        checksum = checksum_chunks([data])
    else:
        data, checksum = record.metadata_bytes, str(record.metadata_checksum)
    publish_metadata(directory, data, sync=sync)
    return WrittenFile(DCP_METADATA_FILE, len(data), str(checksum), record.references)
