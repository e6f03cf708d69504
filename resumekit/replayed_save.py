"""A multi-rank save of a remembered structure, written without DCP's save machinery.

A steady-state save of a sharded run writes the same structure every time, and
:mod:`resumekit.save_planner` already plans it once. What DCP still does on every save is
most of a small save's cost: four rounds of pickled object collectives (the local plans to
the coordinator and back, the write results to it and its outcome back), walking the
plans, checking every item stored and pickling ``.metadata`` (on 2 gloo ranks, ~25 ms of
a ~40 ms write of the LingBot tiny trainer's 2.6 MB).

After a planned save of raw tensor files completes, each rank keeps a :class:`Replay`
record: its files in order with their write items, what each item stored, and (the
coordinator) the checkpoint's ``Metadata`` and ``.metadata`` bytes. A later save in the
same slot (:attr:`resumekit.save_planner.StructureCachingSavePlanner.slot`) replays it:

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
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict
from torch.distributed.checkpoint.storage import WriteResult

from resumekit import save_planner
from resumekit.errors import ResumekitError, StorageError
from resumekit.layout import DCP_METADATA_FILE
from resumekit.manifest import checksum_chunks
from resumekit.raw_tensor_files import (
    RawTensorWriter,
    WrittenFile,
    is_described_pack,
    publish_metadata,
    refuse_existing_checkpoint,
    written_metadata,
)

__all__ = ["Replay", "remember", "save_replayed"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replay:
    """One rank's record of a planned save, as a later save of its structure replays it.

    Attributes:
        number: Planned saves completed in the slot when it was made (the same on every
            rank that made its record at the same save).
        key: The writer's thread count and the state's structure key.
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


def _varies(info: _StorageInfo) -> bool:
    """Whether an item's stored entry carries per-save content (block checksums)."""
    descriptors = info.transform_descriptors or ()
    return bool(descriptors) and not is_described_pack(descriptors)


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
            jobs = _resolved(record, planner) if record.key == (
                thread_count, save_planner.structure_key(
                    planner.state_dict, getattr(planner, "mappings", None), coordinator)) \
                else "the state's structure (keys, shapes, dtypes, placements) changed"
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
    failure = _finish(record, outcome, writer, group, coordinator, directory)
    if failure is not None:
        save_planner.forget_replay_record(slot)
        if isinstance(own_error, ResumekitError):
            raise own_error
        raise StorageError(f"writing checkpoint {directory} failed: {failure}",
                           path=directory, operation="save") from own_error
    return list(writer.written)


def _write(record: Replay, jobs: Sequence[tuple[str, Sequence[tuple[WriteItem, Any]]]],
           writer: RawTensorWriter, directory: str, rank: int) -> _Outcome:
    """This rank's files; what changed in their stored entries."""
    refuse_existing_checkpoint(directory)  # as DCP's writer
    results: list[WriteResult] = writer.write_jobs(jobs, record.prefix)
    changed: dict[MetadataIndex, _StorageInfo] = {}
    for result in results:
        was, now = record.stored.get(result.index), result.storage_data
        if result.index in record.varying and was is not None and (
                now.relative_path, now.offset, now.length) == (
                was.relative_path, was.offset, was.length):
            changed[result.index] = now
        elif now != was:  # cannot happen: the same items, sizes and order
            raise StorageError(
                f"writing checkpoint {directory}: rank {rank}'s item "
                f"{result.index.fqn} came out unlike its remembered plan ({now} instead "
                f"of {was}); nothing was written as .metadata", path=directory,
                operation="save", file=now.relative_path)
    return _Outcome(None, changed)


def _finish(record: Replay, outcome: _Outcome, writer: RawTensorWriter,  # noqa: PLR0917
            group: dist.ProcessGroup | None, coordinator: bool, directory: str) -> str | None:
    """Gather every rank's outcome, write ``.metadata`` (coordinator), agree on the result.

    Returns:
        None when every rank wrote and ``.metadata`` is in place, else what failed (the
        same text on every rank).
    """
    root = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list[_Outcome] | None = [outcome] * dist.get_world_size(group) \
        if coordinator else None
    dist.gather_object(outcome, gathered if coordinator else None, dst=root, group=group)
    failure: str | None = None
    if coordinator:
        assert gathered is not None and record.metadata is not None
        failures = [f"rank {number}: {each.failure}" for number, each in enumerate(gathered)
                    if each.failure is not None]
        if failures:
            failure = "; ".join(failures)
        else:
            try:
                writer.written.append(_write_metadata(record, gathered, directory,
                                                      writer.sync_files))
            except Exception as error:  # noqa: BLE001 - reported to every rank below
                failure = f"rank 0: {type(error).__name__}: {error}"
    status = torch.tensor([0 if failure is None else 1], dtype=torch.int64,
                          device=_collective_device(group))
    dist.broadcast(status, src=root, group=group)
    if int(status[0]) == 0:
        return None
    message = [failure]
    dist.broadcast_object_list(message, src=root, group=group)
    return str(message[0])


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
