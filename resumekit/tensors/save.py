"""Saving tensors: ``dcp.save`` with DCP's default save planner, or remembered plans.

Both tensor formats save the same way; only the storage writer differs, chosen in
:func:`_make_writer` from :func:`tensor_format_for`: the raw tensor writer
(:mod:`resumekit.tensors.raw`) for local directories, DCP's own format (checked
writer) for fsspec URLs or when asked for. DCP's plan caching
(``DefaultSavePlanner(enable_plan_caching=True)``) is left off because in torch 2.13 it
decides that a local plan is unchanged from its keys, offsets and sizes alone, so a save
whose dtypes changed at the same shapes would reuse the previous save's ``.metadata`` and
describe the new bytes with the old dtypes (``tests/unit/test_repeated_saves.py``,
``dtype``). A save may pass ``plans`` (:class:`~resumekit.tensors.plans.SavePlans`: one
per channel of the manager's durable root, one per local tier's site), which reuses the
last save's plans, and ``.metadata``'s bytes, where every rank's layout, dtypes included,
is unchanged; every other save is planned in full. With a group of ranks such a save
first asks, in one all-reduce, whether every rank can write its remembered plan, and then
skips DCP's planning round (:mod:`resumekit.tensors.remembered_save`); otherwise it is
``dcp.save``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from resumekit.errors import ConfigurationError, ResumekitError, StorageError
from resumekit.store.layout import DCP_METADATA_FILE, TENSORS_DIR
from resumekit.store.manifest import FileEntry, checksum_chunks
from resumekit.store.storage import Storage
from resumekit.tensors.context import (
    directory_str,
    local_path,
    paused_collection,
    quiet_no_dist,
    resolve_group,
    without_zip_crc32,
)
from resumekit.tensors.failures import from_failures
from resumekit.tensors.plans import MemoSavePlanner, PlanAgain, SavePlans
from resumekit.tensors.raw import CheckedDcpWriter, RawTensorWriter, WrittenFile
from resumekit.tensors.remembered_save import save_remembered
from resumekit.tensors.remote import RemoteWrites, WriterSpec, shipped

__all__ = [
    "DEFAULT_SYNC_FILES",
    "DEFAULT_THREAD_COUNT",
    "TENSOR_FORMATS",
    "TensorFormat",
    "save",
    "step_files",
    "tensor_format_for",
]

logger = logging.getLogger("resumekit")

DEFAULT_THREAD_COUNT = 4
"""Writer threads per rank (each writes its own data file). The writes are I/O-bound even
on 2 cores, and 4 threads beat 1 and 2 on a local disk (``docs/performance.md``)."""

DEFAULT_SYNC_FILES = True
"""Whether each rank fsyncs the files it wrote, for local paths. Kept on: on a shared
filesystem only the writing node can flush its own dirty pages, so a later fsync by the
commit store on rank 0 cannot make another node's shards durable; fsync inside the save
costs no more than after it (``docs/performance.md``). Other fsspec URLs never fsync
(object stores are durable on close, and DCP's fallback for streams without a descriptor
is a machine-wide sync)."""

TensorFormat = Literal["raw", "dcp"]
TENSOR_FORMATS: tuple[TensorFormat, ...] = ("raw", "dcp")
"""How tensors are stored: ``"raw"``, resumekit's raw tensor files
(:mod:`resumekit.tensors.raw`: each tensor's bytes as they lie in memory, checksummed
per block, local paths only), or ``"dcp"``, DCP's own ``FileSystemWriter`` format, which
any DCP reader loads unchanged."""


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
    remote: RemoteWrites | None = None,
    alone: bool = False,
    plans: SavePlans | None = None,
) -> list[WrittenFile]:
    """Write ``state_dict`` into ``directory`` with DCP, each rank writing its own shards.

    Every rank of the group must call this with the same keys. ``directory`` should be
    empty (the commit store's staging directory); an existing checkpoint there is an error,
    never overwritten. With ``tensor_format="raw"`` local directories get raw tensor
    files, checksummed while written (:mod:`resumekit.tensors.raw`); fsspec URLs, and
    every directory with ``tensor_format="dcp"``, get DCP's own format
    (:func:`tensor_format_for`). Either way the save is ``dcp.save`` (see the module
    docstring); what it did is logged at DEBUG.

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
        remote: Have this rank's bytes written there (the writer process,
            :mod:`resumekit.tensors.remote`): planning, its collectives and ``.metadata``
            stay here. The same files, byte for byte.
        alone: This rank saves by itself, whatever group exists (a node-local copy of
            its own part): no collective runs; ``DTensor`` entries (FSDP2) are written as
            this rank's local shards, at their offsets in the global tensor, and
            ``.metadata`` describes those shards only. Loads back with ``load(...,
            alone=True)`` on the same rank of the same sharding.
        plans: Where this process remembers the plans of this writer's saves (one per
            root and channel, the same on every rank's call): a save whose every rank's
            state has the last one's layout reuses them and, on the coordinating rank,
            the last ``.metadata``'s bytes where its write results are the same
            (:mod:`resumekit.tensors.plans`); the files are the same, byte for byte.

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
    group, no_dist = (None, True) if alone else resolve_group(process_group)
    target = directory_str(directory)
    # Planning and resolve_data run without autograd where plans are remembered:
    # DTensor.to_local() is then the local shard itself, not a view made by an autograd
    # function (the same tensor's bytes, dtype and flags), and cheap for the layout key.
    context = () if plans is None else (
        tensor_format_for(target, tensor_format), remote is not None, no_dist,
        0 if group is None else dist.get_rank(group),
        1 if group is None else dist.get_world_size(group))

    def writer_and_planner() -> tuple[FileSystemWriter, DefaultSavePlanner]:
        made = _make_writer(target, storage_options, thread_count, sync_files, background,
                            tensor_format=tensor_format, remote=remote)
        cast(RawTensorWriter | CheckedDcpWriter, made).metadata_memo = plans
        return made, DefaultSavePlanner() if plans is None else MemoSavePlanner(plans, context)

    # With plans and a group of ranks, a save first tries its remembered plans with one
    # all-reduce (resumekit.tensors.remembered_save); refused, DCP's loop plans in full.
    together = plans is not None and not no_dist and dist.get_world_size(group) > 1
    for attempt in (1, 2):
        writer, planner = writer_and_planner()
        try:
            with quiet_no_dist(no_dist), without_zip_crc32(), paused_collection(background), \
                    contextlib.nullcontext() if plans is None else torch.no_grad():
                if not (together and attempt == 1 and save_remembered(
                        state_dict, writer, cast(MemoSavePlanner, planner),
                        cast(SavePlans, plans), group, where=target)):
                    if together and attempt == 1:
                        writer, planner = writer_and_planner()  # set up afresh
                    dcp_save(dict(state_dict), storage_writer=writer, process_group=group,
                             no_dist=no_dist, planner=planner)
        except BaseException as error:
            if plans is not None:
                plans.forget()  # on every rank: DCP raises a failure on all of them
            if isinstance(error, CheckpointException):
                if plans is not None and attempt == 1 and _plan_again(error):
                    # Said, not warned: a cache miss; the save is whole either way.
                    logger.info("tensor save into %s: planned again in full, as the "
                                "remembered plans are not reusable on every rank (a "
                                "rank's state changed its layout: a key, dtype or shape)",
                                target)
                    continue  # a layout changed on some ranks only
                raise from_failures(error, "save", target, None) from None
            if isinstance(error, ResumekitError) or not isinstance(error, Exception):
                raise
            raise StorageError(
                f"writing checkpoint {target} failed: {type(error).__name__}: {error}",
                path=target,
                operation="save",
            ) from error
        break
    written = list(cast(RawTensorWriter | CheckedDcpWriter, writer).written)
    logger.debug("tensor save: %s format, DCP save %s, %d files written by this rank into %s",
                 "raw" if isinstance(writer, RawTensorWriter) else "dcp",
                 "in one process" if no_dist else "on its process group",
                 len(written), target)
    return written


def _plan_again(error: CheckpointException) -> bool:
    """Whether DCP's failure is only the coordinator's refusal of remembered plans."""
    failures = error.failures
    return bool(failures) and all(isinstance(failure[0], PlanAgain)
                                  for failure in failures.values())


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
    if tensor_format == "raw" and local_path(directory_str(directory)) is not None:
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
    remote: RemoteWrites | None = None,
) -> FileSystemWriter:
    if thread_count < 1:
        raise ConfigurationError(f"thread_count must be >= 1, got {thread_count}",
                                 name="thread_count", value=thread_count)
    local = local_path(directory)
    if remote is not None:
        raw = tensor_format_for(directory, tensor_format) == "raw"
        return shipped(WriterSpec(
            kind="raw" if raw else "dcp", path=local if local is not None else directory,
            thread_count=thread_count, sync_files=sync_files and local is not None,
            background=background,
            storage_options=None if local is not None else dict(storage_options or {})),
            remote)
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




def step_files(storage: Storage, staging: str, written: Sequence[WrittenFile],
               small: Sequence[tuple[str, bytes]], *, coordinating: bool
               ) -> tuple[list[FileEntry], list[str]]:
    """Describe a rank's files of one step and write its small ones into ``staging``.

    The one rule of what a rank reports to the commit protocol, for durable saves and
    node-local ones alike: every tensor file it wrote (size and checksum taken while
    written), then each small file (``(path, bytes)``, written durably and hashed here).

    Args:
        storage: The root.
        staging: The step's staging directory under it.
        written: The tensor files this rank wrote (:func:`save`'s return).
        small: The small files (training state, rank state) to write.
        coordinating: Whether this rank wrote the tensors' ``.metadata`` (then it is
            required).

    Returns:
        The file entries, and the files the tensor metadata references (which the commit
        requires some rank to have reported).
    """
    entries = [FileEntry(path=f"{TENSORS_DIR}/{file.name}", size=file.size,
                         checksum=file.checksum) for file in written]
    required = {f"{TENSORS_DIR}/{name}" for file in written
                for name in (file.name, *file.references) if file.references}
    if coordinating:
        required.add(f"{TENSORS_DIR}/{DCP_METADATA_FILE}")
    for path, data in small:
        storage.write_bytes(f"{staging}/{path}", data, durable=True)
        entries.append(FileEntry(path=path, size=len(data), checksum=checksum_chunks([data])))
    return entries, sorted(required)
