"""Sharded tensor I/O through ``torch.distributed.checkpoint`` (DCP): save, load, staging.

It knows tensors of models and optimizers, nothing about steps, manifests or commits: the
commit store hands it an empty staging directory, :func:`save` fills it, :func:`load` reads
one back. Every rank writes only its own shards, and a checkpoint written by N ranks loads
on M ranks (DCP reshards on load).

Typical use (the state views come from :mod:`resumekit.tensors.state_dicts`)::

    state = model_and_optimizer_state(model, optimizer)      # sharded views, no copy
    save(state, staging_dir, process_group=checkpoint_group)
    ...
    state = model_and_optimizer_state(model, optimizer)      # destination tensors
    load(state, step_dir, process_group=checkpoint_group)    # validated, then in place
    apply_model_and_optimizer_state(model, optimizer, state)

Safety: DCP reads ``.metadata`` with plain :mod:`pickle` and non-tensor values with
``torch.load(weights_only=False)``; both would run code from a tampered checkpoint. This
module reads metadata with :mod:`resumekit.tensors.safe_pickle` and non-tensor values with
``torch.load(weights_only=True)``.

Process groups: with ``process_group=None`` the save/load is single-process when
``torch.distributed`` is not initialised and uses the default (WORLD) group when it is.
When a group is passed, every DCP collective runs on that group only. A group of one rank
is single-process too: no collective runs, so a background save of a one-GPU run never
shares the training thread's NCCL communicator (NCCL communicators are not thread-safe).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import gc
import io
import logging
import os
import pickle
import threading
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist
from fsspec.core import split_protocol
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.serialization import get_crc32_options, set_crc32_options

from resumekit.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ResumekitError,
    StorageError,
    UnreadableFormatError,
    UnsafeCheckpointError,
)
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.manifest import checksum_chunks
from resumekit.store.retry import is_transient, read_with_retry
from resumekit.store.targets import locate_tensor_data
from resumekit.store.tree import flatten
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors import replayed_save, save_planner
from resumekit.tensors.raw import (
    CheckedDcpWriter,
    FsspecReader,
    RawTensorReading,
    RawTensorWriter,
    WrittenFile,
    aligned_empty,
    checksum_files,
    raw_files,
)
from resumekit.tensors.raw import FsspecFiles as FsspecFileSystem
from resumekit.tensors.safe_pickle import load_dcp_metadata
from resumekit.tensors.save_planner import StructureCachingSavePlanner

__all__ = [
    "DEFAULT_SYNC_FILES",
    "DEFAULT_THREAD_COUNT",
    "METADATA_FILE",
    "TENSOR_FORMATS",
    "CpuStager",
    "StorageReader",
    "TensorInfo",
    "WrittenFile",
    "collection_paused",
    "files_verified_on_read",
    "flatten_state",
    "iter_full_tensors",
    "load",
    "load_subset",
    "read_full_state",
    "read_metadata",
    "read_tensor_index",
    "remember_restored",
    "save",
    "tensor_format_for",
    "tensor_index_of",
]

logger = logging.getLogger("resumekit")

METADATA_FILE = DCP_METADATA_FILE
"""The file DCP writes last, describing every tensor and where its chunks live."""

DEFAULT_THREAD_COUNT = 4
"""Writer threads per rank (each writes its own ``.distcp`` file). Measured on a 2-core
ext4 machine, 200 MiB in 50 tensors, fsync on: 1 thread (DCP's default) 565-605 MiB/s,
2 threads 850-910 MiB/s, 4 threads ~990 MiB/s. On 1.5 GB of model + AdamW state
(``make bench``), DCP with 4 threads beat 2 in interleaved rounds, so 4 it is: the writes
are I/O-bound, even on 2 cores."""

DEFAULT_SYNC_FILES = True
"""Whether each rank fsyncs the files it wrote, for local paths. Kept on: on a shared
filesystem only the writing node can flush its own dirty pages, so a later fsync by the
commit store on rank 0 cannot make another node's shards durable. It costs nothing extra
overall: measured (2 threads, 200 MiB) save+fsync inside DCP 218-237 ms, save without
fsync then fsync afterwards 225 ms, and the commit store's second fsync of already
synced files is nearly free. Other fsspec URLs never fsync (object stores are durable on
close, and DCP's fallback for streams without a descriptor is a machine-wide sync)."""

TensorFormat = Literal["raw", "dcp"]
TENSOR_FORMATS: tuple[TensorFormat, ...] = ("raw", "dcp")
"""How tensors are stored: ``"raw"``, resumekit's raw tensor files
(:mod:`resumekit.tensors.raw_files`: each tensor's bytes as they lie in memory, checksummed
per block, local paths only), or ``"dcp"``, DCP's own ``FileSystemWriter`` format, which
any DCP reader loads unchanged."""

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
_MAX_LISTED = 10


# --------------------------------------------------------------------------- save / load


def save(
    state_dict: Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    thread_count: int = DEFAULT_THREAD_COUNT,
    sync_files: bool = DEFAULT_SYNC_FILES,
    background: bool = False,
    tensor_format: TensorFormat = "raw",
    plan_owner: str | None = None,
) -> list[WrittenFile]:
    """Write ``state_dict`` into ``directory`` with DCP, each rank writing its own shards.

    Every rank of the group must call this with the same keys. ``directory`` should be
    empty (the commit store's staging directory); an existing checkpoint there is an error,
    never overwritten. With ``tensor_format="raw"`` local directories get raw tensor
    files, checksummed while written (:mod:`resumekit.tensors.raw_files`); fsspec URLs, and
    every directory with ``tensor_format="dcp"``, get DCP's own format
    (:func:`tensor_format_for`). A raw save whose structure every rank of the group saved
    before, in the same slot, is written without DCP's planning and object collectives,
    byte for byte as DCP would (:mod:`resumekit.tensors.replayed_save`; one process:
    :func:`_save_planned`).

    Args:
        state_dict: Nested dicts of tensors, ``DTensor``s, primitives and ``Stateful``s.
        directory: A local path, a ``file://`` URL or any fsspec URL (``s3://b/x``,
            ``memory://x``).
        process_group: The group whose ranks save together (for example a dedicated gloo
            checkpoint group). ``None``: the default group if initialised, else one process.
        storage_options: fsspec options for URLs (credentials, endpoint); ignored locally.
        thread_count: Writer threads per rank (local paths).
        sync_files: fsync every written file before returning (local paths only).
        background: The save overlaps training: writer threads lower their CPU priority.
        tensor_format: ``"raw"`` (default) or ``"dcp"``; see :data:`TENSOR_FORMATS`.
        plan_owner: Names a writer whose saves never run at the same time (the same on
            every rank, e.g. a manager's root URL): its saves on different groups of the
            same ranks share remembered plans (:mod:`resumekit.tensors.save_planner`) and
            replay records (:mod:`resumekit.tensors.replayed_save`). None: per group.

    Returns:
        Every file this rank wrote, each with its size and the checksum computed while it
        was written (both formats, local directories and fsspec URLs alike). On the
        coordinating rank this includes ``.metadata``, whose
        :attr:`WrittenFile.references` name every data file the checkpoint's items
        point to.

    Raises:
        ConfigurationError: ``tensor_format`` is neither ``"raw"`` nor ``"dcp"``.
        StorageError: The write failed on some rank, on any writer thread (the message
            names rank, file and cause; a full disk also names the free space).
    """
    group, no_dist = _resolve_group(process_group)
    target = _directory_str(directory)
    writer = _make_writer(target, storage_options, thread_count, sync_files, background,
                          tensor_format=tensor_format)
    leaves, key, plan = None, None, None
    if no_dist and isinstance(writer, RawTensorWriter):
        with _collection_paused(background):
            leaves = _plain_leaves(state_dict)
            key = None if leaves is None else (thread_count, _structure(leaves))
            plan = None if key is None else _SAVE_PLANS.get(key)
    planner = StructureCachingSavePlanner(None if no_dist else group, plan_owner)
    try:
        if plan is not None:
            with _collection_paused(background):
                return _save_planned(plan, leaves or [], cast(RawTensorWriter, writer))
        if not no_dist and isinstance(writer, RawTensorWriter):
            with _without_zip_crc32(), _collection_paused(background):  # as DCP's below
                replayed = replayed_save.save_replayed(state_dict, writer, planner, group,
                                                       thread_count)
            if replayed is not None:
                return replayed
        with _quiet_no_dist(no_dist), _without_zip_crc32(), _collection_paused(background):
            dcp_save(dict(state_dict), storage_writer=writer, process_group=group,
                     no_dist=no_dist, planner=planner)
    except CheckpointException as error:
        raise _from_failures(error, "save", target, None) from None
    except ResumekitError:
        raise
    except Exception as error:
        raise StorageError(
            f"writing checkpoint {target} failed: {type(error).__name__}: {error}",
            path=target,
            operation="save",
        ) from error
    if key is not None and leaves is not None:
        _SAVE_PLANS.remember(key, leaves, cast(RawTensorWriter, writer))
    if not no_dist and isinstance(writer, RawTensorWriter):
        replayed_save.remember(planner, writer, thread_count)
    return list(cast(RawTensorWriter | CheckedDcpWriter, writer).written)


def remember_restored(
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    plan_owner: str | None = None,
    metadata_checksum: str | None = None,
) -> None:
    """Let the next save on ``process_group`` replay the checkpoint just restored.

    A fresh process remembers no planned save, so its first save would be planned in
    full; after this, when the run saves the same structure on the same ranks, it is
    written as the checkpoint in ``directory`` was laid out, without DCP's planning
    (:func:`resumekit.tensors.replayed_save.seed`; the save checks its state against the
    checkpoint first). Every rank of the group must call it once, after the same
    successful :func:`load`; a checkpoint that cannot be replayed (another world size,
    DCP's own format, an object store) only makes the next save plan in full.

    Args:
        directory: The restored checkpoint's tensor directory (a local path).
        process_group: The group the run's saves use (None: the default group).
        plan_owner: As for :func:`save`: the same string the run's saves pass.
        metadata_checksum: ``.metadata``'s checksum in the checkpoint's manifest: bytes
            that differ from it are not used.
    """
    group, no_dist = _resolve_group(process_group)
    if no_dist:
        return
    slot = save_planner.slot_of(group, plan_owner)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    local = _local_path(_directory_str(directory))
    metadata: Metadata | None = None
    data = b""
    try:
        if local is not None:
            source = os.path.join(local, DCP_METADATA_FILE)
            with open(source, "rb") as handle:
                data = handle.read()
            if metadata_checksum is None or checksum_chunks([data]) == metadata_checksum:
                with _collection_paused(False):
                    metadata = cast(Metadata, load_dcp_metadata(data, source=source))
    except Exception as error:  # noqa: BLE001 - not replayable; every rank still counts it
        why = f"{type(error).__name__}: {error}"
    else:
        why = "not a local directory" if local is None else \
            "its .metadata does not match the manifest's checksum"
    if metadata is None:  # counted all the same: every rank votes in step
        logger.debug("resumekit: the first save after restoring %s will be planned in "
                     "full: %s", directory, why)
        save_planner.set_replay_record(slot, None)
        return
    replayed_save.seed(slot, metadata, data, rank=rank, world_size=world_size)


# --------------------------------------------------------------------------- cached plans


_Leaves = list[tuple[tuple[str, ...], torch.Tensor]]


def _plain_leaves(state_dict: Mapping[str, Any]) -> _Leaves | None:
    """``[(path, tensor)]`` of a state whose every leaf a cached save plan can write, else None.

    Nested ``dict``s of ``str`` keys down to plain CPU tensors (``torch.Tensor`` or
    ``nn.Parameter``, no subclass such as ``DTensor``), contiguous, not lazily conjugated
    or negated, each smaller than the packing limit (so every one lies in a packed region
    whose checksum is outside ``.metadata``). In DCP's flattening order.
    """
    leaves: _Leaves = []
    plain = (torch.Tensor, nn.Parameter)
    limit = raw_tensor_files.PACK_ITEM_BYTES

    def walk(tree: Mapping[str, Any], path: tuple[str, ...]) -> bool:
        for key, value in tree.items():
            if type(key) is not str:
                return False
            if type(value) in plain:
                if (value.device.type != "cpu" or value.layout is not torch.strided
                        or not value.is_contiguous()
                        or value.is_conj() or value.is_neg()
                        or value.numel() * value.element_size() >= limit):
                    return False
                leaves.append(((*path, key), value))
            elif isinstance(value, dict):
                if not value or not walk(value, (*path, key)):
                    return False
            else:
                return False
        return True

    return leaves if state_dict and walk(state_dict, ()) else None


def _structure(leaves: _Leaves) -> tuple[Any, ...]:
    """What a save plan depends on: every leaf's path, shape and dtype, in order."""
    return tuple((path, value.shape, value.dtype) for path, value in leaves)


@dataclass(frozen=True)
class _SavePlan:
    """A single-process raw save, as DCP planned it for one structure.

    Attributes:
        files: Per data file, its name and the leaves written to it (their numbers in
            :func:`_plain_leaves` order), in file order.
        offsets: Per data file, every item's offset in it, as that save wrote them.
        metadata: The ``.metadata`` bytes DCP pickled (no checksum, path or save id in
            them: the same bytes for every save of this structure).
        metadata_checksum: Their ``"xxh3_128:<hex>"``.
        references: The data files and checksum file ``.metadata`` references.
        checksums_file: The name of that checksum file.
    """

    files: tuple[tuple[str, tuple[int, ...]], ...]
    offsets: tuple[tuple[int, ...], ...]
    metadata: bytes
    metadata_checksum: str
    references: tuple[str, ...]
    checksums_file: str


class _SavePlans:
    """The last few :class:`_SavePlan`s, by thread count and structure (process-wide).

    A plan is taken only for a state of exactly the structure it was made for (every
    path, shape and dtype equal, in order: :func:`_structure`), the same writer thread
    count and one process; any change makes DCP plan again and the result is
    remembered in its place.
    """

    KEPT = 4

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], _SavePlan] = {}
        self._lock = threading.Lock()
        self.built = 0  # plans made (for tests and benchmarks)

    def get(self, key: tuple[Any, ...]) -> _SavePlan | None:
        with self._lock:
            return self._plans.get(key)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.built = 0

    def remember(self, key: tuple[Any, ...], leaves: _Leaves, writer: RawTensorWriter) -> None:
        """Keep the plan of the save ``writer`` just made, where it can be replayed."""
        plan = _plan_of(leaves, writer)
        if plan is None:
            return
        with self._lock:
            self._plans.pop(key, None)
            self._plans[key] = plan
            while len(self._plans) > self.KEPT:
                del self._plans[next(iter(self._plans))]
            self.built += 1


_SAVE_PLANS = _SavePlans()


def _plan_of(leaves: _Leaves,  # noqa: PLR0911 - one return per reason it cannot replay
             writer: RawTensorWriter) -> _SavePlan | None:
    """The replayable plan of a save ``writer`` made of ``leaves``, or None.

    Only a plan whose every item is one leaf's whole tensor, packed (its region's
    checksum outside ``.metadata``), with DCP's keys and nesting exactly the leaves'.
    """
    metadata, jobs = writer.last_metadata, writer.last_jobs
    if metadata is None or jobs is None or metadata.storage_meta is not None:
        return None
    number_of = {".".join(path): number for number, (path, _) in enumerate(leaves)}
    if len(number_of) != len(leaves) or metadata.planner_data != {
            ".".join(path): path for path, _ in leaves}:
        return None
    if set(metadata.state_dict_metadata) != set(number_of):
        return None
    storage = metadata.storage_data or {}
    placed = _placed_members(jobs, storage, number_of, leaves)
    if placed is None:
        return None
    files, offsets = placed
    if sum(len(members) for _, members in files) != len(leaves):
        return None
    read_back = raw_tensor_files.written_metadata(writer)
    if read_back is None:
        return None
    data, entry = read_back
    sidecars = checksum_files(storage)
    if len(sidecars) != 1:
        return None
    return _SavePlan(tuple(files), tuple(offsets), data, entry.checksum, entry.references,
                     sidecars.pop())


def _placed_members(jobs: Any, storage: Mapping[Any, Any], number_of: Mapping[str, int],
                    leaves: _Leaves
                    ) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[int, ...]]] | None:
    """Each written file's leaf numbers and their offsets, in the writer's order.

    None unless every item is one leaf's whole tensor, packed in format 3.
    """
    files: list[tuple[str, tuple[int, ...]]] = []
    offsets: list[tuple[int, ...]] = []
    for name, items in jobs:
        members: list[int] = []
        where: list[int] = []
        for item in items:
            number = number_of.get(item.index.fqn)
            info = storage.get(item.index)
            if (number is None or item.tensor_data is None or info is None
                    or any(item.index.offset or ())
                    or tuple(item.tensor_data.size) != tuple(leaves[number][1].shape)):
                return None
            descriptors = info.transform_descriptors or ()
            if not (raw_tensor_files.is_packed_member(descriptors)
                    or raw_tensor_files.is_described_pack(descriptors)):
                return None  # a format-1 item: its blocks' checksums are in .metadata
            members.append(number)
            where.append(info.offset)
        files.append((name, tuple(members)))
        offsets.append(tuple(where))
    return files, offsets


def _save_planned(plan: _SavePlan, leaves: _Leaves, writer: RawTensorWriter
                  ) -> list[WrittenFile]:
    """Write ``leaves`` as ``plan`` says, without DCP's planning or its metadata pickle.

    The bytes of every file are what DCP's path through :class:`RawTensorWriter` writes
    for the same state: the same items in the same files at the same offsets (checked),
    the regions' checksums in the rank's checksum file, ``.metadata`` the plan's bytes.
    """
    directory = os.fspath(writer.path)
    raw_tensor_files.refuse_existing_checkpoint(directory)  # as DCP's writer
    writer.written = []
    sidecar = plan.checksums_file
    outcomes = raw_tensor_files.run_writer_threads([
        functools.partial(writer.write_small, name, [leaves[number][1] for number in members],
                          sidecar)
        for name, members in plan.files], on_caller=not writer.background and sum(
            tensor.nbytes for _, tensor in leaves) < raw_tensor_files.SMALL_SAVE_BYTES)
    regions: dict[str, list[tuple[int, int, str]]] = {}
    for (name, _), expected, (written_at, written, packed) in zip(
            plan.files, plan.offsets, outcomes, strict=True):
        if tuple(written_at) != expected:
            raise StorageError(  # cannot happen: the same items, sizes and order
                f"writing checkpoint {directory}: {name} came out unlike its plan; "
                "nothing was written as .metadata", path=directory, operation="save",
                file=name)
        writer.written.append(written)
        if packed:
            regions[name] = packed
    if regions:
        writer.written.append(raw_tensor_files.write_checksums(
            os.path.join(directory, sidecar), sidecar, regions, sync=writer.sync_files))
    raw_tensor_files.publish_metadata(directory, plan.metadata, sync=writer.sync_files)
    writer.written.append(WrittenFile(DCP_METADATA_FILE, len(plan.metadata),
                                      plan.metadata_checksum, plan.references))
    return list(writer.written)



def load(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
    plan_locally: bool = False,
) -> None:
    """Read the checkpoint in ``directory`` into ``state_dict``, in place.

    Destination tensors (``DTensor`` shards included) must already exist with their final
    shape and placement; each rank reads only what its shards need, so a checkpoint saved
    by N ranks loads on M. Before any tensor is read, the keys, shapes and dtypes of
    ``state_dict`` are checked against the checkpoint: every key asked for must exist, and
    under each top-level key asked for (``"model"``, ``"optimizer"``) the checkpoint must
    hold nothing more. Non-tensor leaves are replaced by the checkpoint's values.

    Args:
        state_dict: Destination; typically :func:`model_and_optimizer_state` output,
            possibly with more top-level entries.
        directory: A local path, ``file://`` URL or fsspec URL.
        process_group: As for :func:`save`.
        storage_options: fsspec options for URLs.
        verify: Check every byte read from raw tensor files against the checksum recorded
            when it was written. A mismatch may be found after other tensors were already
            read into ``state_dict``.
        plan_locally: Each rank plans and reads its own part alone, without DCP's plan
            gather, scatter and final all-gather (DCP's load plans need no coordination:
            its global load plan is the local plans). The caller then agrees on the
            outcome, since an error raises on the failing rank only (the manager runs it
            under :func:`resumekit.store.coordination.run_on_every_rank`).

    Raises:
        CheckpointNotFoundError: ``directory`` holds no DCP metadata.
        IncompatibleCheckpointError: Keys, shapes or dtypes differ (nothing was loaded).
        UnsafeCheckpointError: The metadata or a stored value would execute code.
        IncompleteCheckpointError: A shard file is missing.
        CorruptCheckpointError: The checkpoint could not be read.
    """
    _load_checked(state_dict, directory, process_group, storage_options, verify,
                  reject_unexpected=True, plan_locally=plan_locally)


def load_subset(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
) -> None:
    """As :func:`load`, but the checkpoint may hold more than ``state_dict`` asks for.

    Every key asked for must still exist with its shape and dtype (weights-only loads:
    the optimizer and any unused model tensor are not read).
    """
    _load_checked(state_dict, directory, process_group, storage_options, verify,
                  reject_unexpected=False)


def _load_checked(state_dict: dict[str, Any], directory: str | os.PathLike[str],
                  process_group: dist.ProcessGroup | None,
                  storage_options: Mapping[str, Any] | None, verify: bool, *,
                  reject_unexpected: bool, plan_locally: bool = False) -> None:
    group, no_dist = _resolve_group(process_group)
    target = _directory_str(directory)
    reader = _make_reader(target, storage_options, verify=verify)
    leaves: _Leaves | None = None
    if no_dist and isinstance(reader, _SafeFileSystemReader):
        try:
            with _collection_paused(False):
                leaves = _plain_leaves(state_dict)
                layout = None if leaves is None else _layout_for(reader)
                if layout is not None and layout.fits(leaves or [], reject_unexpected):
                    _read_laid_out(reader, layout, leaves or [])
                    return
        except _ReadItTheLongWay:
            pass  # damaged or short: DCP's path below reads it again and names what
        except ResumekitError:
            raise
        except OSError as error:
            raise _load_error(error, target, reader, rank=None) from error
        if leaves is not None:  # parsed above: DCP's path takes it, not a second parse
            reader.hand_over_metadata()
            reader = _make_reader(target, storage_options, verify=verify)
    planner = _CheckedLoadPlanner(target, reject_unexpected=reject_unexpected)
    _run_load(
        state_dict=state_dict, reader=reader, planner=planner, target=target,
        group=group, no_dist=no_dist or plan_locally,
    )


def _run_load(
    *,
    state_dict: dict[str, Any],
    reader: _SafeReaderMixin,
    planner: _CheckedLoadPlanner,
    target: str,
    group: dist.ProcessGroup | None,
    no_dist: bool,
) -> None:
    try:
        with _quiet_no_dist(no_dist), _collection_paused(False):
            dcp_load(
                state_dict,
                storage_reader=cast(FileSystemReader, reader),
                planner=planner,
                process_group=group,
                no_dist=no_dist,
            )
    except CheckpointException as error:
        raise _from_failures(error, "load", target, reader) from None
    except ResumekitError:
        raise
    except Exception as error:
        raise _load_error(error, target, reader, rank=None) from error


class _ReadItTheLongWay(Exception):
    """A laid-out read found a region that fails its checksum or ends early."""


@dataclass(frozen=True)
class _Layout:
    """Where every tensor of a checkpoint of small packed tensors lies (from ``.metadata``).

    Attributes:
        items: ``{fqn: (path, shape, dtype)}``: DCP's nesting, global shape and dtype.
        regions: Per data file, its packed regions in file order: ``(offset, length,
            members)``, each member ``(fqn, offset in the region, length)``.
        per_top: Items per top-level key of the state (``"model"``, ``"optimizer"``).
        raw: The raw tensor files.
        checksums: The checksum files the regions' checksums are in.
    """

    items: dict[str, tuple[tuple[str, ...], tuple[int, ...], torch.dtype]]
    regions: dict[str, tuple[tuple[int, int, tuple[tuple[str, int, int], ...]], ...]]
    per_top: dict[str, int]
    raw: frozenset[str]
    checksums: frozenset[str]

    def fits(self, leaves: _Leaves, reject_unexpected: bool) -> bool:
        """Whether ``leaves`` are destinations for items of this layout, as DCP would check.

        Every leaf must be an item with the same nesting, shape and dtype; for a full
        load (``reject_unexpected``) every item under a top-level key of the state must
        be a leaf too. Anything else is left to DCP's path, which says what differs.
        """
        items = self.items
        for path, value in leaves:
            found = items.get(".".join(path))
            if found is None or found[0] != path or found[2] != value.dtype or \
                    found[1] != value.shape:
                return False
        if reject_unexpected:
            tops = {path[0] for path, _ in leaves}
            return sum(self.per_top.get(top, 0) for top in tops) == len(leaves)
        return True


class _Layouts:
    """The layouts of the last few ``.metadata`` files read, by their checksum."""

    KEPT = 4

    def __init__(self) -> None:
        self._layouts: dict[str, _Layout | None] = {}
        self._lock = threading.Lock()
        self.built = 0  # layouts worked out (for tests and benchmarks)

    def get(self, digest: str) -> tuple[bool, _Layout | None]:
        with self._lock:
            if digest in self._layouts:
                return True, self._layouts[digest]
            return False, None

    def put(self, digest: str, layout: _Layout | None) -> None:
        with self._lock:
            self._layouts.pop(digest, None)
            self._layouts[digest] = layout
            while len(self._layouts) > self.KEPT:
                del self._layouts[next(iter(self._layouts))]
            self.built += 1

    def clear(self) -> None:
        with self._lock:
            self._layouts.clear()
            self.built = 0


_LAYOUTS = _Layouts()


def _layout_for(reader: _SafeReaderMixin) -> _Layout | None:
    """The layout of the checkpoint ``reader`` reads, or None when it has none.

    The bytes of ``.metadata`` are read (and, with a manifest, checked) every time; they
    are parsed only when no layout of the same bytes is known. The parsed metadata is
    kept by the reader for DCP's path.
    """
    data, source, digest = reader.metadata_bytes()
    known, layout = _LAYOUTS.get(digest)
    if known:
        return layout
    metadata = reader._parse_metadata(data, source, digest, None)
    layout = _layout_of(metadata)
    _LAYOUTS.put(digest, layout)
    return layout


_LayoutItems = dict[str, tuple[tuple[str, ...], tuple[int, ...], torch.dtype]]
_Region = tuple[int, int, tuple[tuple[str, int, int], ...]]


def _layout_of(metadata: Metadata) -> _Layout | None:
    """The layout of ``metadata``, or None unless every item can be read from one.

    That is: every item one small tensor, whole, packed in format 3 (its region's
    checksum in a checksum file), its nesting DCP's plain one of ``str`` keys.
    """
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    storage = metadata.storage_data or {}
    if paths is None or not storage:
        return None
    items = _layout_items(metadata, paths)
    found = None if items is None else _members_by_file(storage, items)
    if items is None or found is None:
        return None
    by_file, leaders = found
    regions: dict[str, tuple[_Region, ...]] = {}
    for name, members in by_file.items():
        laid = _regions_of(sorted(members), sorted(leaders.get(name, [])))
        if laid is None:
            return None  # the reader's long way names this
        regions[name] = laid
    per_top: dict[str, int] = {}
    for path, _, _ in items.values():
        per_top[path[0]] = per_top.get(path[0], 0) + 1
    return _Layout(items, regions, per_top, frozenset(by_file),
                   frozenset(checksum_files(storage)))


def _layout_items(metadata: Metadata, paths: Mapping[str, Any]) -> _LayoutItems | None:
    """Return ``{fqn: (path, shape, dtype)}``, or None.

    None unless every item is one whole tensor under plain ``str`` keys.
    """
    items: _LayoutItems = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        path = paths.get(fqn)
        if (not isinstance(entry, TensorStorageMetadata) or len(entry.chunks) != 1
                or not isinstance(path, tuple) or ".".join(map(str, path)) != fqn
                or not all(type(atom) is str for atom in path)):
            return None
        chunk = entry.chunks[0]
        shape = torch.Size(entry.size)
        if any(chunk.offsets) or torch.Size(chunk.sizes) != shape:
            return None
        items[fqn] = (path, shape, entry.properties.dtype)
    return items


def _members_by_file(storage: Mapping[Any, Any], items: _LayoutItems
                     ) -> tuple[dict[str, list[tuple[int, int, str]]],
                                dict[str, list[tuple[int, int]]]] | None:
    """Each file's ``(offset, length, fqn)`` members and ``(start, length)`` regions.

    None when an item is not a whole packed tensor of ``items`` (format 3), or an item
    has no storage.
    """
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    leaders: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        descriptors = info.transform_descriptors
        if not raw_tensor_files.is_packed_member(descriptors):
            if not raw_tensor_files.is_described_pack(descriptors):
                return None
            length = int(descriptors[0].split(";")[1])
            leaders.setdefault(info.relative_path, []).append((info.offset, length))
        if index.fqn not in items or any(index.offset or ()):
            return None
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    if sum(len(found) for found in by_file.values()) != len(items):
        return None
    return by_file, leaders


def _regions_of(members: list[tuple[int, int, str]], starts: list[tuple[int, int]]
                ) -> tuple[_Region, ...] | None:
    """Return one file's regions with their members (inputs sorted), or None.

    None unless each member lies inside one region and every member is in one.
    """
    laid: list[_Region] = []
    at = 0
    for start, length in starts:
        inside: list[tuple[str, int, int]] = []
        while at < len(members) and members[at][0] < start + max(length, 1):
            offset, size, fqn = members[at]
            if offset < start or offset + size > start + length:
                return None
            inside.append((fqn, offset - start, size))
            at += 1
        laid.append((start, length, tuple(inside)))
    return tuple(laid) if at == len(members) else None


def _read_laid_out(reader: _SafeReaderMixin, layout: _Layout, leaves: _Leaves) -> None:
    """Read every packed region once, check it, copy each member into its destination.

    With ``verify`` each region is checked against its checksum (from the rank's
    checksum file, itself checked against the manifest when the reader has one) before
    any of its bytes is copied out.

    Raises:
        _ReadItTheLongWay: A region fails its checksum or a file ends early: the caller
            reads through DCP's path, whose reader names the damaged tensor.
    """
    reading = cast(RawTensorReading, reader)
    destinations = {".".join(path): value for path, value in leaves}
    sums: dict[tuple[str, int], tuple[int, str]] = {}
    if reader.verify:
        for name in sorted(layout.checksums):
            sums.update(reading._read_checksums(name))
    root = os.fspath(reader.path)

    def read_file(name: str) -> None:
        where = os.path.join(root, name)

        def read() -> None:
            with open(where, "rb", buffering=0) as handle:
                for start, length, members in layout.regions[name]:
                    if not any(fqn in destinations for fqn, _, _ in members):
                        continue  # a subset load that wants none of this region
                    buffer = bytearray(max(length, 1))
                    view = memoryview(buffer)[:length]
                    handle.seek(start)
                    got = 0
                    while got < length:
                        count = handle.readinto(view[got:])
                        if not count:
                            raise _ReadItTheLongWay(where)
                        got += count
                    if reader.verify:
                        listed = sums.get((name, start))
                        if listed is None or listed[0] != length or \
                                raw_tensor_files.hex_digest(view) != listed[1]:
                            raise _ReadItTheLongWay(where)
                    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
                    for fqn, shift, size in members:
                        target = destinations.get(fqn)
                        if target is not None and size:
                            ctypes.memmove(target.data_ptr(), address + shift, size)

        read_with_retry(where, read)

    names = sorted(layout.regions)
    threads = max(1, min(reading.read_threads, len(names)))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resumekit-reader") as pool:
        for future in [pool.submit(read_file, name) for name in names]:
            future.result()


# --------------------------------------------------------------------------- index / export


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its metadata describes it.

    Attributes:
        fqn: Fully qualified name as flattened by DCP (``"model.layers.0.weight"``,
            ``"optimizer.state.layers.0.weight.exp_avg"``).
        shape: Global (unsharded) shape.
        dtype: Element type.
        nbytes: Size of the full tensor in bytes.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def read_tensor_index(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, TensorInfo]:
    """List the tensors of a checkpoint from its metadata, reading no tensor data.

    The metadata pickle is read with an allow-list unpickler: nothing in it can run code.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        storage_options: fsspec options for URLs.

    Returns:
        ``{fqn: TensorInfo}`` for every tensor, in the checkpoint's order. Non-tensor
        values (learning rates, step counters stored as Python objects) are not listed.

    Raises:
        CheckpointNotFoundError: No metadata file.
        UnsafeCheckpointError: The metadata references a disallowed global.
        CorruptCheckpointError: The metadata is unreadable.
    """
    return _tensor_index(read_metadata(directory, storage_options))


def read_metadata(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Metadata:
    """Read a checkpoint's DCP ``.metadata`` with the allow-list unpickler.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL (the tensors directory).
        storage_options: fsspec options for URLs.

    Raises:
        CheckpointNotFoundError: No metadata file.
        UnsafeCheckpointError: The metadata references a disallowed global.
        CorruptCheckpointError: The metadata is unreadable.
    """
    return _make_reader(_directory_str(directory), storage_options).read_metadata()


def tensor_index_of(metadata: Metadata) -> dict[str, TensorInfo]:
    """Return ``{fqn: TensorInfo}`` of the tensors ``metadata`` describes.

    The index :func:`read_tensor_index` returns, for a caller that also needs the metadata.
    """
    return _tensor_index(metadata)


def files_verified_on_read(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> set[str]:
    """Name the data files whose every byte :func:`load` checks against a checksum.

    Those are the raw tensor files (:mod:`resumekit.tensors.raw_files`); their ranks'
    small checksum files are not (they are hashed whole like any other file), nor are
    files in DCP's own format (earlier versions, fsspec URLs). Reads only the metadata.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        storage_options: fsspec options for URLs.

    Returns:
        File names relative to ``directory``.
    """
    reader = _make_reader(_directory_str(directory), storage_options)
    layout = _layout_for(reader)  # a known layout: no unpickling at all
    if layout is not None:
        reader.hand_over_metadata()
        return set(layout.raw)
    metadata = reader.read_metadata()
    found = raw_files(metadata.storage_data or {})
    reader.hand_over_metadata()  # a load usually follows: it need not unpickle it again
    return found


def iter_full_tensors(
    directory: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each tensor of a checkpoint whole (all shards assembled), one at a time.

    Needs no process group and uses none. Only one full tensor is allocated at a time
    (plus the shard being copied into it), so peak memory is bounded by the largest
    tensor, not the checkpoint; the caller should drop each tensor before the next.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        names: Fully qualified names to yield, in this order; ``None`` for every tensor
            in the checkpoint's order.
        storage_options: fsspec options for URLs.

    Yields:
        ``(fqn, tensor)`` with a CPU tensor of the stored global shape and dtype.

    Raises:
        IncompatibleCheckpointError: A requested name is not a tensor of the checkpoint
            (raised before anything is yielded).
    """
    target = _directory_str(directory)
    reader = _make_reader(target, storage_options)
    index = _tensor_index(reader.read_metadata())
    wanted = list(index) if names is None else list(names)
    unknown = [name for name in wanted if name not in index]
    if unknown:
        raise _incompatible(
            target, [f"not a tensor of the checkpoint: {name}" for name in unknown]
        )
    for name in wanted:
        info = index[name]
        holder: dict[str, Any] = {name: torch.empty(info.shape, dtype=info.dtype)}
        planner = _CheckedLoadPlanner(target, reject_unexpected=False)
        _run_load(
            state_dict=holder, reader=reader, planner=planner, target=target,
            group=None, no_dist=True,
        )
        # No local name for the tensor: once the caller drops it, it is freed before the
        # next one is allocated (peak memory: one tensor).
        yield name, holder.pop(name)


# --------------------------------------------------------------------------- staging


class CpuStager:
    """Copies a state dict into CPU buffers that are allocated once and reused.

    An asynchronous save stages the state (a fast device-to-host copy), lets training
    mutate the originals, and writes the staged copy in the background. Buffers are keyed
    by their position in the state dict and reused while shape and dtype stay the same;
    they are pinned when CUDA is available so device copies run asynchronously.
    ``DTensor``s stay ``DTensor``s with the same mesh and placements over a CPU local
    shard. Non-tensor leaves are deep-copied; ``Stateful`` leaves are replaced by a staged
    copy of their ``state_dict()`` (what DCP would save of them).

    The staged dict aliases the buffers: wait for the save of one staged dict to finish
    before staging again.

    Args:
        pin_memory: Pin the buffers; ``None`` pins exactly when CUDA is available.
        page_aligned: Start every buffer on a page boundary, so the raw tensor writer
            sends it to a local disk with direct I/O without copying it. Leave it off for
            fsspec URLs: DCP's own writer copies a tensor whose storage is larger than it.
    """

    def __init__(self, *, pin_memory: bool | None = None, page_aligned: bool = True) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._aligned = page_aligned
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self._wrappers: dict[tuple[str, ...], DTensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def close(self) -> None:
        """Release every buffer (the next :meth:`stage` allocates afresh)."""
        self._buffers.clear()
        self._wrappers.clear()

    def prepare(self, state_dict: Mapping[str, Any]) -> int:
        """Allocate and touch the buffers :meth:`stage` will use for ``state_dict``.

        The first stage of a state otherwise pays for the allocation and for the first
        write to every page of it (a page fault each; pinning, with CUDA), which made the
        first asynchronous save block many times longer than a copy. Nothing is copied;
        buffers that already fit are kept. Call it where a pause is expected (building a
        manager, restoring), with the state that will be staged.

        Args:
            state_dict: The same structure :meth:`stage` will get (or a part of it: a
                missing part is allocated when first staged).

        Returns:
            Bytes newly allocated.
        """
        before = self.nbytes
        seen: set[int] = set()
        for key, value in state_dict.items():
            self._prepare(value, (str(key),), seen)
        return self.nbytes - before

    def _prepare(self, value: Any, path: tuple[str, ...], seen: set[int]) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:  # tied weights share one buffer, as in stage()
                return
            seen.add(id(value))
            local = value.to_local() if isinstance(value, DTensor) else value
            self._buffer_for(local, path, touch=True)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._prepare(v, (*path, str(k)), seen)
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                self._prepare(v, (*path, str(i)), seen)
        elif isinstance(value, Stateful) and not isinstance(value, type):
            self._prepare(value.state_dict(), path, seen)

    def _buffer_for(self, source: torch.Tensor, path: tuple[str, ...], *,
                    touch: bool = False) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = (aligned_empty(source.shape, source.dtype, pin_memory=self._pin)
                      if self._aligned else
                      torch.empty(source.shape, dtype=source.dtype, pin_memory=self._pin))
            if touch and buffer.numel():
                buffer.view(-1).view(torch.uint8).zero_()  # every page mapped now
            self._buffers[path] = buffer
            self._wrappers.pop(path, None)
        return buffer

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Return a copy of ``state_dict`` whose tensors live in this stager's CPU buffers.

        Args:
            state_dict: Nested dicts/lists/tuples of tensors, ``DTensor``s, ``Stateful``s
                and other (deep-copyable) values.

        Returns:
            The same structure, detached from the originals.
        """
        seen: dict[int, tuple[Any, Any]] = {}
        staged = {
            key: self._stage(value, (str(key),), seen) for key, value in state_dict.items()
        }
        if any(
            isinstance(source, torch.Tensor) and source.device.type == "cuda"
            for source, _ in seen.values()
        ):
            torch.cuda.synchronize()
        return staged

    def _stage(self, value: Any, path: tuple[str, ...], seen: dict[int, tuple[Any, Any]]) -> Any:
        if isinstance(value, torch.Tensor):
            hit = seen.get(id(value))
            if hit is not None and hit[0] is value:  # tied weights stay tied
                return hit[1]
            staged = (
                self._stage_dtensor(value, path)
                if isinstance(value, DTensor)
                else self._copy_into(value.detach(), path)
            )
            seen[id(value)] = (value, staged)
            return staged
        if isinstance(value, Mapping):
            return {k: self._stage(v, (*path, str(k)), seen) for k, v in value.items()}
        if type(value) in (list, tuple):
            items = [self._stage(v, (*path, str(i)), seen) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, Stateful) and not isinstance(value, type):
            return self._stage(value.state_dict(), path, seen)
        return copy.deepcopy(value)

    def _copy_into(self, source: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor:
        buffer = self._buffer_for(source, path)
        buffer.copy_(source, non_blocking=self._pin and source.device.type == "cuda")
        return buffer

    def _stage_dtensor(self, value: DTensor, path: tuple[str, ...]) -> DTensor:
        # ``_local_tensor``, not ``to_local()``: the same shard, without an autograd
        # function call per tensor (two per DTensor were ~10 ms of a tiny async save)
        local = self._copy_into(value._local_tensor.detach(), path)
        wrapper = self._wrappers.get(path)
        if wrapper is None or wrapper._local_tensor is not local or wrapper._spec != value._spec:
            # Built directly (not via ``from_local``) so the local shard stays on CPU even
            # when the mesh is a CUDA mesh: DCP saves each rank's local shard as it is.
            wrapper = DTensor(local, value._spec, requires_grad=False)
            self._wrappers[path] = wrapper
        return wrapper


# --------------------------------------------------------------------------- internals


_CRC32_LOCK = threading.Lock()
_crc32_users = [0, True]  # saves in flight, the setting to restore when the last one ends


@contextmanager
def _without_zip_crc32() -> Generator[None, None, None]:
    """Skip the zip CRC-32 ``torch.save`` computes over every byte DCP writes.

    The commit store hashes every file (XXH3-128, in the manifest) anyway, and the CRC is a
    single-core pass over all the data: measured on 1.5 GB of model + AdamW state, saves
    ran 1.36x faster without it (``docs/performance.md``). Files written so still load
    with ``torch.load``. The switch is process-wide, so overlapping saves share it under a
    counter and the last one out restores the previous setting.
    """
    with _CRC32_LOCK:
        if _crc32_users[0] == 0:
            _crc32_users[1] = get_crc32_options()
            set_crc32_options(False)
        _crc32_users[0] += 1
    try:
        yield
    finally:
        with _CRC32_LOCK:
            _crc32_users[0] -= 1
            if _crc32_users[0] == 0:
                set_crc32_options(bool(_crc32_users[1]))


@contextmanager
def _collection_paused(background: bool) -> Generator[None, None, None]:
    """Pause Python's cyclic garbage collector for a foreground save or load.

    Planning, writing and reading create several objects per tensor that all stay alive
    until the end; with thousands of tensors the collector's passes over them cost more
    than the work itself (measured: ``docs/performance.md``, per-tensor overhead). Only on
    the main thread and never for a background save, whose pause would cover the training
    loop; the previous setting is restored, and nothing is collected that would not be
    collected later anyway.
    """
    if (background or threading.current_thread() is not threading.main_thread()
            or not gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def collection_paused() -> contextlib.AbstractContextManager[None]:
    """Pause Python's cyclic garbage collector here, on the main thread only.

    For foreground work that allocates a few objects per tensor (captures, fingerprints):
    as :func:`save` and :func:`load` do for DCP's plan objects. Never on another thread
    (a background save's pause would cover the training loop); the previous setting is
    restored.
    """
    return _collection_paused(False)


def _resolve_group(
    process_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, bool]:
    group = process_group
    if group is None and dist.is_available() and dist.is_initialized():
        group = cast(dist.ProcessGroup, dist.group.WORLD)
    if group is None or dist.get_world_size(group) == 1:
        return None, True
    return group, False


@contextmanager
def _quiet_no_dist(no_dist: bool) -> Generator[None, None, None]:
    """Silence DCP's "assuming single process" warning when single-process is the intent.

    Only on the main thread: ``catch_warnings`` swaps the process-wide filter list, and a
    background save restoring it could drop filters the main thread set meanwhile.
    """
    if not no_dist or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _directory_str(directory: str | os.PathLike[str]) -> str:
    return os.fspath(directory)


def _local_path(directory: str) -> str | None:
    """The local filesystem path of ``directory``, or ``None`` for a non-local URL."""
    protocol, path = split_protocol(directory)
    if protocol is None:
        return directory
    if protocol in ("file", "local"):
        return str(path)
    return None


def tensor_format_for(directory: str | os.PathLike[str],
                      tensor_format: TensorFormat = "raw") -> TensorFormat:
    """The format :func:`save` writes into ``directory`` when asked for ``tensor_format``.

    ``"raw"`` where the raw writer can write (local paths), ``"dcp"`` otherwise (fsspec
    URLs, whose writer is DCP's own), and ``"dcp"`` whenever asked for.

    Raises:
        ConfigurationError: ``tensor_format`` is neither ``"raw"`` nor ``"dcp"``.
    """
    if tensor_format not in TENSOR_FORMATS:
        raise ConfigurationError(
            f"tensor_format must be 'raw' or 'dcp', not {tensor_format!r}",
            name="tensor_format", value=tensor_format)
    if tensor_format == "raw" and _local_path(_directory_str(directory)) is not None:
        return "raw"
    return "dcp"


def _make_writer(
    directory: str,
    storage_options: Mapping[str, Any] | None,
    thread_count: int,
    sync_files: bool,
    background: bool = False,
    *,
    tensor_format: TensorFormat = "raw",
) -> FileSystemWriter:
    if thread_count < 1:
        raise ValueError(f"thread_count must be >= 1, got {thread_count}")
    local = _local_path(directory)
    if tensor_format_for(directory, tensor_format) == "raw":
        assert local is not None
        return RawTensorWriter(local, thread_count=thread_count, sync_files=sync_files,
                               background=background)
    if local is not None:  # DCP's own format, every thread's error re-raised
        return cast(FileSystemWriter, CheckedDcpWriter(
            local, thread_count=thread_count, sync_files=sync_files))
    # fsspec streams have no file descriptor: DCP's fallback for sync_files would be a
    # machine-wide os.sync(). Object stores are durable on close anyway.
    return cast(FileSystemWriter, CheckedDcpWriter(
        directory, thread_count=thread_count, storage_options=storage_options))


_PARSED: dict[tuple[str, str], Metadata] = {}
"""Parsed metadata handed from a reader that only looked to the next reader (by file and
checksum), each taken once."""
_PARSED_KEPT = 2
_PARSED_LOCK = threading.Lock()


class _SafeReaderMixin:
    """Reads ``.metadata`` with the allow-list unpickler, once, and remembers failures."""

    fs: Any
    path: Any
    load_id: str
    _metadata: Metadata | None = None
    metadata_error: ResumekitError | None = None
    verify: bool = True
    file_checksums: Mapping[str, str] | None = None

    if TYPE_CHECKING:  # provided by the DCP reader class this is mixed into

        def _get_metadata_path(self, rank: int | None = None) -> os.PathLike[str]: ...

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Return the checkpoint metadata, read safely on first use."""
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            return self._metadata
        data, source, digest = self.metadata_bytes(rank)
        return self._parse_metadata(data, source, digest, rank)

    def metadata_bytes(self, rank: int | None = None) -> tuple[bytes, str, str]:
        """``.metadata``'s bytes, path and checksum; with a manifest, checked against it.

        Raises:
            CheckpointNotFoundError: No metadata file.
            CorruptCheckpointError: It does not match the manifest.
        """
        source = os.fspath(self._get_metadata_path(rank))

        def read() -> bytes:
            with self.fs.create_stream(source, "rb") as stream:
                return cast(bytes, stream.read())

        try:
            data = read_with_retry(source, read)
        except FileNotFoundError as error:
            found = CheckpointNotFoundError(
                f"no checkpoint metadata at {source}", path=os.fspath(self.path), file=source
            )
            if rank is None:
                self.metadata_error = found
            raise found from error
        try:
            digest = checksum_chunks([data])
            if rank is None:
                self._check_metadata_bytes(data, source, digest)
        except ResumekitError as error:
            self.metadata_error = error
            raise
        return data, source, digest

    def _parse_metadata(self, data: bytes, source: str, digest: str,
                        rank: int | None) -> Metadata:
        try:
            with _PARSED_LOCK:
                metadata = _PARSED.pop((source, digest), None)
            if metadata is None:
                with _collection_paused(False):
                    metadata = cast(Metadata, load_dcp_metadata(data, source=source))
        except ResumekitError as error:
            self.metadata_error = error
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        if rank is None:
            self._metadata = metadata
            self._metadata_key = (source, digest)
        return metadata

    def hand_over_metadata(self) -> None:
        """Give the metadata this reader parsed to the next reader of the same bytes.

        For a caller that only looked at it: the next reader of the same file with the
        same checksum takes the parsed object instead of unpickling it again (thousands
        of objects for thousands of tensors). At most a few are kept, each taken once.
        """
        key = getattr(self, "_metadata_key", None)
        if self._metadata is None or key is None:
            return
        with _PARSED_LOCK:
            _PARSED[key] = self._metadata
            while len(_PARSED) > _PARSED_KEPT:
                del _PARSED[next(iter(_PARSED))]
        self._metadata = None


    def _check_metadata_bytes(self, data: bytes, source: str, actual: str) -> None:
        """With ``verify`` and a manifest, ``.metadata`` must match its recorded checksum.

        The checksums of raw tensor blocks are in it, so it is checked before any is used.
        """
        if not self.verify or self.file_checksums is None:
            return
        expected = self.file_checksums.get(DCP_METADATA_FILE)
        if expected is None:
            raise CorruptCheckpointError(
                f"{source} is not listed in the checkpoint's manifest, so it cannot be "
                "verified", path=os.fspath(self.path), file=source)
        if actual != expected:
            raise CorruptCheckpointError(
                f"{source} does not match its checksum in the manifest (expected "
                f"{expected}, got {actual})", path=os.fspath(self.path), file=source)


class _SafeFileSystemReader(_SafeReaderMixin, RawTensorReading, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeReaderMixin, RawTensorReading, FsspecReader):
    pass


class StorageReader(_SafeReaderMixin, RawTensorReading, FileSystemReader):
    """A DCP ``StorageReader`` for resumekit checkpoints: stock DCP tools read ours with it.

    Pass it wherever DCP takes a reader::

        dcp.load(state_dict, storage_reader=resumekit.StorageReader(step_dir))

    It loads the model and optimizer tensors of a committed checkpoint (``state_dict``
    as :func:`model_and_optimizer_state` or DCP's ``get_state_dict`` builds it:
    ``{"model": ..., "optimizer": ...}``), in either tensor format: resumekit's raw tensor
    files and DCP's own (``tensor_format="dcp"``, object stores, earlier versions).
    Resharding works as in DCP (a checkpoint of N ranks loads on M). The step, scheduler,
    RNG and data position are not DCP data; restore them with
    :class:`~resumekit.CheckpointManager`.

    With ``verify`` (the default) every byte read is checked: ``.metadata`` against the
    manifest before anything else, raw tensor files block by block as they are read, and
    each file in DCP's own format hashed whole against the manifest before DCP reads it.
    A mismatch raises :class:`~resumekit.errors.CorruptCheckpointError` naming the file
    and key (``dcp.load`` reports a reader's error wrapped in its ``CheckpointException``,
    whose ``failures`` hold it by rank). ``.metadata`` and non-tensor values are read
    without unrestricted unpickling (see the module docstring); the latter only when the
    planner is resumekit's, as DCP's default planner unpickles them itself.

    Args:
        path: The step directory (holding ``manifest.json``) or its ``tensors/`` folder
            (``attempt-<token>/tensors`` on object stores): a local path, ``file://`` URL
            or fsspec URL (``s3://bucket/run/step_000001000``).
        storage_options: fsspec options for URLs (credentials, endpoint).
        verify: Check every byte read against the checksums recorded at save time.

    Attributes:
        step_dir: The step directory of the checkpoint being read.

    Raises:
        CheckpointNotFoundError: ``path`` is not a resumekit checkpoint (no
            ``manifest.json`` in it or in a step directory above it).
        ManifestError: The manifest is unreadable or invalid.
        IncompleteCheckpointError: The checkpoint holds no tensor data.
    """

    step_dir: str

    def __init__(self, path: str | os.PathLike[str], *,
                 storage_options: Mapping[str, Any] | None = None,
                 verify: bool = True) -> None:
        self._options = dict(storage_options or {})
        self.verify = verify
        url = self._locate(path)
        super().__init__(_local_path(url) or url)
        self._point_at(url)

    def _locate(self, path: str | os.PathLike[str]) -> str:
        data = locate_tensor_data(_directory_str(path), self._options)
        self.step_dir = data.step_dir
        self.file_checksums = dict(data.checksums)
        self._metadata = None
        self.metadata_error = None
        self.__dict__.pop("_verified_files", None)
        return data.url

    def _point_at(self, url: str) -> None:
        local = _local_path(url)
        if local is None:
            self.fs = FsspecFileSystem()
            self.path = self.fs.init_path(url, **self._options)
        else:
            self.fs = LocalFileSystem()
            self.path = self.fs.init_path(local)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; with ``checkpoint_id``, of that step (or tensor) directory."""
        super().reset()
        self._metadata = None
        self.metadata_error = None
        if checkpoint_id is not None:
            self._point_at(self._locate(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path or an fsspec URL."""
        return FsspecFileSystem.validate_checkpoint_id(os.fspath(checkpoint_id))


def _make_reader(directory: str, storage_options: Mapping[str, Any] | None, *,
                 verify: bool = True) -> _SafeReaderMixin:
    local = _local_path(directory)
    reader: _SafeFileSystemReader | _SafeFsspecReader
    if local is not None:
        reader = _SafeFileSystemReader(local)
    else:
        reader = _SafeFsspecReader(directory, **dict(storage_options or {}))
    reader.verify = verify
    return reader


def _load_plain_value(directory: str, fqn: str, value: io.BytesIO) -> Any:
    """Load one non-tensor value with ``weights_only=True``: never code from a checkpoint.

    Stock DCP unpickles non-tensor values (learning rates, ``param_groups``) with
    ``torch.load(weights_only=False)``; both load planners here read them through this.
    """
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{directory}: value {fqn!r} is not a plain Python value and would "
            f"need unrestricted unpickling ({error})",
            path=directory,
            key=fqn,
        ) from error


class _CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus a strict fit check and safe non-tensor loading.

    Its local plan is DCP's default one, with each ``DTensor`` layout's local chunk
    worked out once (DCP asks every ``DTensor`` for it: ~45 µs each, the larger part of
    the plan when a model's parameters share a few shapes, and an optimizer's state
    repeats them).
    """

    def __init__(self, directory: str, *, reject_unexpected: bool) -> None:
        super().__init__(flatten_state_dict=True, allow_partial_load=False)
        self._directory = directory
        self._reject_unexpected = reject_unexpected

    def create_local_plan(self) -> LoadPlan:
        """DCP's default local load plan, a ``DTensor``'s chunks computed once per layout.

        Where the checkpoint holds a key the flattened state lacks, DCP's own plan runs
        (it may retry under an older flattening); so does any value but a plain
        ``DTensor`` over a plain local tensor, item by item.
        """
        metadata = self.metadata
        if metadata is None or not metadata.state_dict_metadata.keys() <= self.state_dict.keys():
            return super().create_local_plan()
        stored = metadata.state_dict_metadata
        chunks_by_layout: save_planner.ChunksByLayout = {}
        requests: list[ReadItem] = []
        for fqn, value in self.state_dict.items():
            entry = stored.get(fqn)
            if (type(value) is not DTensor or type(value._local_tensor) is not torch.Tensor
                    or not isinstance(entry, TensorStorageMetadata)
                    or entry.size != value.size()
                    or value.device_mesh.get_coordinate() is None):
                requests += create_default_local_load_plan(
                    {fqn: value}, metadata, not self.allow_partial_load).items
                continue
            requests += create_read_items_for_chunk_list(
                fqn, entry, save_planner.dtensor_chunks(value, chunks_by_layout))
        return LoadPlan(requests)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten ``state_dict`` as DCP does, then check it against ``metadata``."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        differences = _check_against_metadata(
            self.state_dict,
            metadata,
            scope=set(self.original_state_dict) if self._reject_unexpected else None,
        )
        if differences:
            raise _incompatible(self._directory, differences)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load a non-tensor value with ``weights_only=True`` (no arbitrary code)."""
        fqn = read_item.dest_index.fqn
        loaded = _load_plain_value(self._directory, fqn, value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _tensor_index(metadata: Metadata) -> dict[str, TensorInfo]:
    index: dict[str, TensorInfo] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape = tuple(int(size) for size in entry.size)
        dtype = entry.properties.dtype
        numel = 1
        for size in shape:
            numel *= size
        index[fqn] = TensorInfo(fqn, shape, dtype, numel * dtype.itemsize)
    return index


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return f"non-tensor {type(value).__name__}"


def _check_against_metadata(
    flat: Mapping[str, Any], metadata: Metadata, *, scope: set[str] | None
) -> list[str]:
    stored = metadata.state_dict_metadata
    differences = [f"missing from checkpoint: {key}" for key in flat if key not in stored]
    if scope is not None:
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        for key in stored:
            path = paths.get(key)
            top = str(path[0]) if isinstance(path, tuple) and path else key.split(".", 1)[0]
            if key not in flat and top in scope:
                differences.append(f"unexpected in checkpoint: {key}")
    for key, value in flat.items():
        entry = stored.get(key)
        if entry is None:
            continue
        if isinstance(entry, TensorStorageMetadata):
            want = f"tensor {tuple(entry.size)} {entry.properties.dtype}"
            if not isinstance(value, torch.Tensor) or (
                tuple(value.shape) != tuple(entry.size) or value.dtype != entry.properties.dtype
            ):
                differences.append(f"{key}: checkpoint has {want}, state has {_describe(value)}")
        elif isinstance(value, torch.Tensor):
            differences.append(f"{key}: checkpoint has a non-tensor, state has {_describe(value)}")
    return differences


def _holds_state(items: Sequence[Any]) -> bool:
    return any(isinstance(item, (torch.Tensor, Mapping)) for item in items)


def flatten_state(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a state dict to dotted keys as DCP does.

    Lists holding tensors or dicts (an optimizer's ``param_groups``) are containers; any
    other list is a value.
    """
    return flatten(tree, prefix, expand=_holds_state)


def _compare_flat(given: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    differences = [f"missing: {key}" for key in expected if key not in given]
    differences += [f"unexpected: {key}" for key in given if key not in expected]
    for key, want in expected.items():
        if key not in given:
            continue
        have = given[key]
        if isinstance(want, torch.Tensor) != isinstance(have, torch.Tensor) or (
            isinstance(want, torch.Tensor)
            and isinstance(have, torch.Tensor)
            and (want.shape != have.shape or want.dtype != have.dtype)
        ):
            differences.append(f"{key}: expected {_describe(want)}, got {_describe(have)}")
    return differences


def _incompatible(where: str, differences: Sequence[str]) -> IncompatibleCheckpointError:
    shown = "; ".join(differences[:_MAX_LISTED])
    more = len(differences) - _MAX_LISTED
    suffix = f"; and {more} more" if more > 0 else ""
    return IncompatibleCheckpointError(
        f"{where} does not fit the state being restored "
        f"({len(differences)} differences, nothing loaded): {shown}{suffix}",
        path=where,
        differences=list(differences),
    )


def _load_error(
    error: BaseException, target: str, reader: _SafeReaderMixin | None, rank: int | None
) -> ResumekitError:
    if isinstance(error, ResumekitError):
        return error
    if reader is not None and reader.metadata_error is not None:
        return reader.metadata_error
    where = "" if rank is None else f" on rank {rank}"
    if isinstance(error, FileNotFoundError):
        missing = error.filename or str(error)
        return IncompleteCheckpointError(
            f"checkpoint {target} is missing file {missing}{where}",
            path=target,
            file=missing,
        )
    if isinstance(error, OSError) or is_transient(error):
        # the storage failed (an I/O error, a dropped connection), not the bytes: never
        # corruption, never a reason to set the checkpoint aside
        return StorageError(
            f"reading checkpoint {target} failed{where}: {type(error).__name__}: {error} "
            "(a storage error, not corruption: nothing was set aside)",
            path=target,
            operation="load",
        )
    # Not a checksum (those raise our own errors): DCP's reading failed on what it was
    # given, which is damage or what another torch version wrote.
    return UnreadableFormatError(
        f"reading checkpoint {target} failed{where}: {type(error).__name__}: {error}",
        path=target,
        file=None,
    )


def _from_failures(
    error: CheckpointException, operation: str, target: str, reader: _SafeReaderMixin | None
) -> ResumekitError:
    failures = sorted(error.failures.items())
    for _rank, (cause, _trace) in failures:
        if isinstance(cause, ResumekitError):
            return cause
    if reader is not None and reader.metadata_error is not None:
        return reader.metadata_error
    rank, (cause, _trace) = failures[0]
    if operation == "load":
        return _load_error(cause, target, None, rank)
    ranks = ", ".join(str(r) for r, _ in failures)
    return StorageError(
        f"writing checkpoint {target} failed on rank(s) {ranks}: "
        f"{type(cause).__name__}: {cause}",
        path=target,
        operation=operation,
    )


# --------------------------------------------------------------------------- full state


class _SafeEmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's "rebuild the state dict from the metadata" planner, loading values safely.

    Stock DCP unpickles non-tensor values (learning rates, ``param_groups``) with
    ``torch.load(weights_only=False)``; this reads them with ``weights_only=True``.
    """

    def __init__(self, directory: str) -> None:
        super().__init__()
        self._directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor value without running code from the checkpoint."""
        fqn = read_item.dest_index.fqn
        loaded = _load_plain_value(self._directory, fqn, value)
        set_element(self.original_state_dict, self.mappings[fqn], loaded)


def read_full_state(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read a whole DCP checkpoint into one nested state dict, without a process group.

    The same structure ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    builds (every tensor whole, nesting rebuilt from the metadata), read safely: the
    metadata through the allow-list unpickler, non-tensor values with
    ``torch.load(weights_only=True)``. Works on stock DCP directories (``dcp.save``,
    torchtitan ``step-N``) and on a resumekit checkpoint's ``tensors/`` directory, whose
    raw tensor files are verified against their checksums as they are read. Holds the whole
    checkpoint in memory.

    Args:
        directory: The DCP directory (the one holding ``.metadata``): a local path or URL.
        storage_options: fsspec options for URLs.

    Returns:
        The nested state dict, e.g. ``{"model": {...}, "optimizer": {...}}``.

    Raises:
        CheckpointNotFoundError: No ``.metadata`` in ``directory``.
        UnsafeCheckpointError: The metadata or a stored value would run code.
        CorruptCheckpointError: A file is unreadable or fails its checksum.
    """
    target = os.fspath(directory)
    reader = _make_reader(target, storage_options)
    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            _load_state_dict(state, storage_reader=cast(Any, reader),
                             planner=_SafeEmptyStateDictLoadPlanner(target), no_dist=True)
    except ResumekitError:
        raise
    except CheckpointException as error:
        causes = [cause for cause, _ in error.failures.values()]
        found = next((c for c in causes if isinstance(c, ResumekitError)), None)
        if found is not None:
            raise found from None
        if reader.metadata_error is not None:
            raise reader.metadata_error from None
        raise CorruptCheckpointError(
            f"reading checkpoint {target} failed: {causes[0] if causes else error}",
            path=target,
        ) from None
    except Exception as error:
        if reader.metadata_error is not None:
            raise reader.metadata_error from error
        raise CorruptCheckpointError(
            f"reading checkpoint {target} failed: {type(error).__name__}: {error}",
            path=target,
        ) from error
    return state
