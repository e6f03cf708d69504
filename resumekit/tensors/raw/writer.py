"""The raw format's DCP storage writers, on DCP's public ``StorageWriter`` extension points.

DCP's stock ``FileSystemWriter`` serialises every tensor with ``torch.save`` (a zip
archive per tensor). Planning, resharding and the ``.metadata`` file stay DCP's own; these
writers replace only how a rank's items reach its files (``write_data``) and check what
``finish`` records:

* :class:`RawTensorWriter` (local directories) writes each tensor's bytes as they lie in
  memory (:mod:`.format`), one file per rank written by ``thread_count`` threads, each its
  own consecutive part of the file. Every chunk is hashed on its way to the file, so the
  commit store gets each file's checksum (one of parts) without reading the file back
  (:attr:`RawTensorWriter.written`). File writes
  and the hash both release the GIL; for a background save the writer threads also drop
  to idle CPU priority, so the training loop keeps its cores.
* :class:`CheckedDcpWriter` (fsspec URLs: ``s3://``, ``memory://``, ...) writes DCP's own
  format, one file per thread, with the raw writer's guarantees: an error on any writer
  thread fails the save, every stream is hashed on its way out, and a failed upload is
  discarded, not completed by the stream's close, so the error raised is the write's,
  naming the file.
* Both report every file they wrote, ``.metadata`` included, with its size and checksum,
  and the ``.metadata`` entry names every data file the metadata references
  (:attr:`WrittenFile.references`), after checking that each item of the plan has stored
  data: the commit store cross-checks the ranks' reports against it.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resumekit.errors import StorageError
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.manifest import hex_digest, parts_checksum
from resumekit.tensors.raw.files import (
    METADATA_TMP,
    AlignedFile,
    DirectIoNotices,
    FsspecFiles,
    Pack,
    RecordingFileSystem,
    lower_thread_priority,
    member_start,
    open_new_file,
    region_bytes,
    write_failure,
)
from resumekit.tensors.raw.format import (
    CHUNK_BYTES,
    DATA_SUFFIX,
    PACK_BYTES,
    PACK_ITEM_BYTES,
    TRAILER_ALONE_DESCRIPTORS,
    StorageInfo,
    WrittenFile,
    align_up,
    block_bytes_for,
    byte_view,
    checksum_files,
    encode_trailer,
)

__all__ = [
    "SMALL_SAVE_BYTES",
    "CheckedDcpWriter",
    "RankFiles",
    "RawTensorWriter",
    "run_writer_threads",
]

SMALL_SAVE_BYTES = 16 << 20
"""A rank's files of fewer tensor bytes than this are written one after another on the
saving thread: starting and joining threads costs more than such writes gain from them."""

logger = logging.getLogger("resumekit")


@dataclasses.dataclass(frozen=True)
class RankFiles:
    """What a rank's save plan carries for these writers (its ``storage_data``).

    Attributes:
        prefix: The start of the names of the rank's files: ``__<rank>_``, as DCP names
            its own.
    """

    prefix: str


def _files_of(plan: SavePlan) -> RankFiles:
    files = plan.storage_data
    if not isinstance(files, RankFiles):
        raise TypeError(f"a save plan for resumekit's writers carries RankFiles, not "
                        f"{type(files).__name__} (it was not prepared by the writer)")
    return files


class _ReportingWriter:
    """Mixin for a DCP writer: every file it writes reported, the metadata checked.

    Mix it in before DCP's writer class and call :meth:`_start_reporting` after that
    class's ``__init__``.
    """

    fs: Any
    path: Any
    sync_files: bool
    written: list[WrittenFile]

    frames_metadata = False
    """Whether ``.metadata`` is laid out by rank (:mod:`resumekit.tensors.metadata_file`):
    the raw writer's; DCP's own format keeps DCP's pickle, which stock readers read."""

    def _start_reporting(self) -> None:
        self.written = []
        self.metadata_memo: MetadataMemo | None = None
        """Where ``.metadata``'s bytes are remembered between saves
        (:class:`~resumekit.tensors.plans.SavePlans`; None: pickled every time)."""
        self._plan_rank: int | None = None
        self._plans_together = True
        self.fs = RecordingFileSystem(self.fs, os.fspath(self.path))

    def _record(self, name: str, size: int, checksum: str) -> None:
        self.written.append(WrittenFile(name, size, checksum))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's set-up; the rank and whether ranks plan together are kept for the names."""
        self._plan_rank = kwargs.get("rank")
        self._plans_together = bool(kwargs.get("use_collectives", True))
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)  # type: ignore[misc]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's check (directory made, existing checkpoint refused); names a lone rank's files."""
        plan = super().prepare_local_plan(plan)  # type: ignore[misc]
        if self._plan_rank is not None and not self._plans_together:
            plan = dataclasses.replace(plan, storage_data=RankFiles(f"__{self._plan_rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank's plan the prefix of its files: ``__<rank>_``."""
        return [plan if plan.storage_data is not None
                else dataclasses.replace(plan, storage_data=RankFiles(f"__{rank}_"))
                for rank, plan in enumerate(plans)]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Check every item has stored data, write ``.metadata``, report it.

        With a :attr:`metadata_memo` (and no ``storage_meta``: the raw writer's), the
        metadata's pickled bytes are reused where they are provably the same
        (:meth:`_finish_remembered`).

        Raises:
            StorageError: An item of the plan has no stored data (a writer lost it
                without raising); nothing is written.
        """
        memo = self.metadata_memo
        if not self.frames_metadata and (
                memo is None or self.storage_meta() is not None):  # type: ignore[attr-defined]
            _check_every_item_stored(metadata, results, os.fspath(self.path))
            super().finish(metadata, results)  # type: ignore[misc]
            references = _references(results)
        else:
            references = self._finish_remembered(metadata, results, memo)
        recorder = cast(RecordingFileSystem, self.fs)
        with recorder._lock:
            temporary = [name for name in recorder.recorded if name.endswith(METADATA_TMP)]
            recorded = [(name, recorder.recorded.pop(name)) for name in temporary]
        for name, entry in recorded:
            self.written.append(WrittenFile(name.removesuffix(".tmp"), entry.size,
                                            entry.checksum, references))
        _emptied(metadata)

    def _finish_remembered(self, metadata: Metadata, results: list[list[WriteResult]],
                           memo: MetadataMemo | None) -> tuple[str, ...]:
        """DCP's ``FileSystemWriter.finish``, its pickled bytes reused where ``memo`` has them.

        Reused when ``metadata`` is the one remembered with them and every write result
        records the same item, file, offset, length and descriptors, in the same order,
        as the results they were pickled with: the same metadata, value for value, so the
        check that every item is stored and the files referenced are the same too (kept
        with the bytes). Otherwise checked, pickled here and remembered.

        The same bytes as DCP's: ``pickle.dump`` of the same metadata (its version, the
        results' storage records, no ``storage_meta``), written to ``.metadata.tmp``
        (fsynced if asked for), then renamed over any ``.metadata``.

        Returns:
            The files the metadata references.
        """
        signature = [(result.index.fqn, result.index.offset, result.storage_data)
                     for part in results for result in part]
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_meta = None
        kept = None if memo is None else memo.metadata_bytes(metadata, signature)
        references: tuple[str, ...]
        if kept is not None:
            data, (storage, references) = kept
            metadata.storage_data = storage  # equal to these results' (returned by DCP)
        else:
            _check_every_item_stored(metadata, results, os.fspath(self.path))
            storage = {}
            for part in results:
                storage.update({result.index: result.storage_data for result in part})
            metadata.storage_data = storage
            if self.frames_metadata:  # laid out by rank (schema_version 5)
                from resumekit.tensors import metadata_file  # noqa: PLC0415 - a cycle
                from resumekit.tensors.raw.format import raw_files  # noqa: PLC0415

                file_ranks = {str(result.storage_data.relative_path): rank
                              for rank, part in enumerate(results) for result in part}
                data = metadata_file.encode(metadata, file_ranks, len(results),
                                            raw_files(storage))
            else:
                data = pickle.dumps(metadata)
            references = _references(results)
            if memo is not None:
                memo.keep_metadata_bytes(metadata, signature, data, (storage, references))
        rank = self._plan_rank
        alone = not self._plans_together and rank is not None
        name = f"__{rank}{DCP_METADATA_FILE}" if alone else DCP_METADATA_FILE
        tmp_path = self.fs.concat_path(self.path, f"{name}.tmp")
        with self.fs.create_stream(tmp_path, "wb") as stream:
            stream.write(data)
            if self.sync_files:
                os.fsync(stream.fileno())
        metadata_path = self.fs.concat_path(self.path, name)
        if self.fs.exists(metadata_path):
            self.fs.rm_file(metadata_path)
        self.fs.rename(tmp_path, metadata_path)
        return references


def _emptied(metadata: Metadata) -> None:
    """Empty ``metadata``, written: ``dcp.save`` then sends it to every rank as is.

    DCP's save ends with its coordinator's ``finish`` and a broadcast of what that step
    returns, this very object, as ``dcp.save``'s return value (which resumekit never
    reads): a pickle of the whole ``.metadata`` made on rank 0 and unpickled on every rank
    at every save, growing with W x tensors (issue 40). The object is this save's own
    (the remembered plans give each save a copy), so rebinding its fields touches no
    other save's, and the broadcast carries an empty ``Metadata``.
    """
    metadata.state_dict_metadata = {}
    metadata.planner_data = None
    metadata.storage_data = None


def _references(results: Sequence[Sequence[WriteResult]]) -> tuple[str, ...]:
    """The files the items of ``results`` are stored in, and their checksum files."""
    return tuple(sorted(
        {result.storage_data.relative_path for part in results for result in part}
        | checksum_files({id(result): result.storage_data
                          for part in results for result in part})))


class MetadataMemo(Protocol):
    """Where a writer's ``finish`` finds and keeps ``.metadata``'s pickled bytes.

    :class:`~resumekit.tensors.plans.SavePlans` is one.
    """

    def metadata_bytes(self, metadata: Metadata, signature: list[tuple[Any, ...]]
                       ) -> tuple[bytes, Any] | None:
        """The bytes of ``metadata`` with these results and what was kept with them."""

    def keep_metadata_bytes(self, metadata: Metadata, signature: list[tuple[Any, ...]],
                            data: bytes, kept: Any) -> None:
        """Remember the bytes pickled from ``metadata`` with these results, and ``kept``."""


def _check_every_item_stored(metadata: Metadata, results: Sequence[Sequence[WriteResult]],
                             where: str) -> None:
    # (name, offsets) pairs, not MetadataIndex objects: building and hashing one of
    # those per item (Python-level dataclass methods) was a fifth of rank 0's finish at
    # the 5B shapes (issue 40); a MetadataIndex is equal where its name and offsets are
    # (a torch.Size hashes and compares as the tuple of its sizes)
    stored = {(result.index.fqn, result.index.offset) for part in results for result in part}
    missing: list[str] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            missing.extend(f"{fqn}{list(chunk.offsets)}" for chunk in entry.chunks
                           if (fqn, chunk.offsets) not in stored)
        elif isinstance(entry, BytesStorageMetadata) and (fqn, None) not in stored:
            missing.append(f"{fqn}[]")
    if missing:
        raise StorageError(
            f"writing checkpoint {where} lost {len(missing)} item(s) without an error "
            f"(first: {', '.join(missing[:3])}); nothing was written as .metadata",
            path=where, operation="save", file=DCP_METADATA_FILE,
        )


class CheckedDcpWriter(_ReportingWriter, FileSystemWriter):
    """DCP's own file format for any fsspec URL, with the raw writer's guarantees.

    DCP's own writer loses the errors of its extra writer threads (the save goes on, a
    shard short) and cleans up a failed stream by closing it, which on an object store
    completes the upload or raises a second error in place of the first. This writer runs
    each file on its own pool thread and re-raises every thread's error, hashes each
    stream on its way out (:attr:`written`, ``.metadata`` included) and discards a failed
    upload. The bytes are DCP's: each blob as it is, each tensor as ``torch.save`` writes
    it, blobs first, as DCP's writer lays out a file; stock readers load the result.

    Args:
        path: The (empty) directory, a local path or URL, to write into.
        thread_count: Files, and writer threads, per rank.
        sync_files: ``fsync`` each file before it is reported (local paths only: an
            object-store stream has no descriptor, and objects are durable on close).
        storage_options: fsspec options (credentials, ``endpoint_url``).
    """

    def __init__(self, path: str, *, thread_count: int, sync_files: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files,
                         thread_count=thread_count, overwrite=False)
        files = FsspecFiles()
        self.path = files.init_path(path, **dict(storage_options or {}))
        self.fs = files
        self._start_reporting()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URL fsspec can open."""
        return FsspecFiles.validate_checkpoint_id(checkpoint_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items, one file per thread; raise if any thread failed."""
        prefix = _files_of(plan).prefix
        buckets = [bucket for bucket in _balance(plan.items, self.thread_count) if bucket]
        self.written = []
        results: list[WriteResult] = []
        outcomes = run_writer_threads([
            functools.partial(self._write_file, f"{prefix}{number}{DATA_SUFFIX}", bucket,
                              planner) for number, bucket in enumerate(buckets)])
        recorder = cast(RecordingFileSystem, self.fs)
        for outcome in outcomes:
            results.extend(outcome)
        for name in sorted({r.storage_data.relative_path for r in results}):
            entry = recorder.recorded[name]
            self._record(name, entry.size, entry.checksum)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner
                    ) -> list[WriteResult]:
        """Write one file in DCP's format: its blobs, then its tensors, each ``torch.save``d."""
        ordered = ([item for item in items if item.type == WriteItemType.BYTE_IO]
                   + [item for item in items if item.type != WriteItemType.BYTE_IO])
        results: list[WriteResult] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in ordered:
                offset = stream.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(cast(io.BytesIO, data).getbuffer())
                else:
                    torch.save(_cpu_tensor(cast(torch.Tensor, data)), stream)
                stream.flush()  # an object store uploads each full part as it goes
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=StorageInfo(name, offset, length)))
            if self.sync_files:
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()  # what DCP's writer does for a stream without a descriptor
        return results


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, holding no storage beyond its own bytes (as DCP saves it)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()  # torch.save writes the whole storage
    return tensor


class RawTensorWriter(_ReportingWriter, FileSystemWriter):
    """DCP ``StorageWriter`` for a local directory: raw tensor bytes, hashed while written.

    Args:
        path: The (empty) directory to write into.
        thread_count: Writer threads per rank, each writing one part of the rank's file.
        sync_files: ``fsync`` each file before the write is reported done.
        background: The save overlaps training: writer threads run at idle CPU priority
            (``SCHED_IDLE``, else nice 19) so the training threads keep their cores.
    """

    frames_metadata = True

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int,
                 sync_files: bool, background: bool = False) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files,
                         thread_count=thread_count, overwrite=False)
        self.background = background
        self.direct_io = DirectIoNotices()
        """Where a refusal of direct I/O is said: once per directory of this save."""
        self.written: list[WrittenFile] = []
        """The files this rank wrote in the last save, with checksums (``.metadata`` too,
        on the coordinating rank)."""
        self._start_reporting()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its one data file, a part per thread.

        Raises:
            StorageError: A file could not be written (naming it; a full disk also names
                the free space). Every thread has stopped by then.
        """
        prefix = _files_of(plan).prefix
        buckets = [bucket for bucket in _balance(plan.items, self.thread_count) if bucket]
        name = f"{prefix}0{DATA_SUFFIX}"
        jobs = [(name, [(item, planner.resolve_data(item)) for item in bucket])
                for bucket in buckets]
        results = self.write_jobs(jobs)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def write_jobs(self, jobs: Sequence[tuple[str, Sequence[tuple[WriteItem,
                                                                   torch.Tensor | io.BytesIO]]]]
                   ) -> list[WriteResult]:
        """Write each ``(file name, [(item, data)])`` of ``jobs``: a part of that file each.

        The jobs of one file name are the consecutive parts of that file, each written by
        its own thread at an offset worked out before any is written (the parts' sizes
        follow from the items' lengths), and hashed by that thread as it writes. The file
        ends with its trailer (:func:`~resumekit.tensors.raw.format.encode_trailer`): the
        block checksums of its items stored alone and the checksums of its packed regions,
        what only a reader of this file needs, out of ``.metadata``. Its checksum for the
        manifest is a checksum of parts (:data:`~resumekit.store.manifest.PARTS_ALGORITHM`):
        each part's, then the trailer's.

        :meth:`write_data` writes DCP's plan with it, and the writer process
        (:mod:`resumekit.tensors.remote`) the same files in the same order: the same bytes.
        Resets and fills :attr:`written`.

        Returns:
            Every item's result, part by part in ``jobs`` order.

        Raises:
            StorageError: A file could not be written (naming it).
        """
        self.written = []
        files: dict[str, list[Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]]]] = {}
        for name, items in jobs:
            files.setdefault(name, []).append(items)
        on_caller = not self.background and _is_small(
            [item for _, items in jobs for item, _ in items])
        results: list[WriteResult] = []
        for name, parts in files.items():
            path = os.path.join(os.fspath(self.path), name)
            try:
                file_results, written = self._write_parts(path, name, parts, on_caller)
            except OSError as error:
                raise write_failure(path, error, "write") from error
            results.extend(file_results)
            self.written.append(written)
        return results

    def _write_parts(self, path: str, name: str,
                     parts: Sequence[Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]]],
                     on_caller: bool) -> tuple[list[WriteResult], WrittenFile]:
        """Write one data file: its parts, each on its own thread, then its trailer."""
        sizes = [_planned_bytes(items) for items in parts]
        starts = [sum(sizes[:number]) for number in range(len(parts))]
        shared = open_new_file(path, notices=self.direct_io)
        try:
            outcomes = run_writer_threads([
                functools.partial(self._write_part, path, name, items, shared=shared,
                                  start=start, size=size)
                for items, start, size in zip(parts, starts, sizes, strict=True)],
                on_caller=on_caller)
            results: list[WriteResult] = []
            regions: list[tuple[int, int, str]] = []
            stored: list[tuple[int, int, int, str]] = []
            digests: list[tuple[int, str]] = []
            for size, (part_results, digest, packed, alone) in zip(sizes, outcomes,
                                                                     strict=True):
                results.extend(part_results)
                regions.extend(packed)
                stored.extend(alone)
                digests.append((size, digest))
            trailer = encode_trailer(name, regions, stored)
            end = sum(sizes)
            with AlignedFile(path, shared=shared, start=end,
                             notices=self.direct_io) as handle:
                handle.write(memoryview(trailer), None)
            digests.append((len(trailer), hex_digest(trailer)))
            if self.sync_files:
                os.fsync(shared[0])
        finally:
            os.close(shared[0])
        return results, WrittenFile(name, end + len(trailer), parts_checksum(digests))

    def storage_meta(self) -> None:
        """None: no path or save id in ``.metadata``.

        Its bytes then depend only on the state's structure (DCP reads nothing from it;
        the step directory's manifest records the save).
        """
        return None

    def _write_part(
        self, path: str, name: str,
        items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]], *,
        shared: tuple[int, bool], start: int, size: int,
    ) -> tuple[list[WriteResult], str, list[tuple[int, int, str]],
               list[tuple[int, int, int, str]]]:
        """Write the part of ``size`` bytes at ``start`` of one data file.

        Returns:
            Its results, the hex XXH3-128 of the part, its packed regions ``(offset,
            length, hex)`` and its items stored alone ``(offset, length, block bytes,
            concatenated hex of each block)``.

        Raises:
            StorageError: A write failed (naming the file).
        """
        if self.background:
            lower_thread_priority()
        try:
            with AlignedFile(path, shared=shared, start=start,
                             notices=self.direct_io) as handle:
                results, packed, stored = self._write_items(handle, name, items)
                if handle.offset != start + size:
                    raise StorageError(
                        f"writing {path}: a part planned as bytes {start}+{size} ended at "
                        f"{handle.offset} (a bug in resumekit: nothing was committed)",
                        path=path, file=name, operation="write")
                digest = handle.checksum.value().partition(":")[2]
        except OSError as error:
            raise write_failure(path, error, "write") from error
        return results, digest, packed, stored

    def _write_items(
        self, handle: AlignedFile, name: str,
        items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]],
    ) -> tuple[list[WriteResult], list[tuple[int, int, str]],
               list[tuple[int, int, int, str]]]:
        """Write items through ``handle`` from its offset on.

        Returns:
            Their results, the packed regions ``(offset, length, hex)`` and the items
            stored alone ``(offset, length, block bytes, concatenated hex of each block)``.
        """
        results: list[WriteResult] = []
        stored: list[tuple[int, int, int, str]] = []
        pack = Pack(name)
        for item, data in items:
            small = _small_cpu_bytes(data)
            if small is not None:  # the common small tensor: copied, no view objects
                if not pack.fits(small[1]):
                    results.extend(pack.flush(handle))
                pack.add_from(item, *small)
                continue
            view, address = _bytes_of(data)
            if len(view) < PACK_ITEM_BYTES:
                if not pack.fits(len(view)):
                    results.extend(pack.flush(handle))
                pack.add(item, view)
                continue
            results.extend(pack.flush(handle))
            block = block_bytes_for(len(view))
            stride = block * max(1, CHUNK_BYTES // block)  # whole blocks per write
            blocks: list[str] = []
            offset = handle.offset
            for start in range(0, len(view), stride):
                blocks += handle.write(view[start:start + stride],
                                       None if address is None else address + start,
                                       block=block)
            handle.pad()  # the next item starts on an ALIGNMENT boundary
            stored.append((offset, len(view), block, "".join(blocks)))
            results.append(WriteResult(
                index=item.index, size_in_bytes=len(view),
                storage_data=StorageInfo(name, offset, len(view),
                                          transform_descriptors=TRAILER_ALONE_DESCRIPTORS),
            ))
        results.extend(pack.flush(handle))
        return results, pack.regions, stored


def _planned_bytes(items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]]) -> int:
    """The bytes :meth:`RawTensorWriter._write_items` writes for ``items``, from their lengths.

    The same layout: items of :data:`PACK_ITEM_BYTES` or more alone, padded to the next
    :data:`ALIGNMENT` boundary; smaller ones packed (:class:`Pack`: members on
    :data:`PACK_ITEM_ALIGNMENT` boundaries, a region closed when the next member and its
    row of the table would not fit in :data:`PACK_BYTES`, then its table and footer, the
    region padded to a boundary). A part's writer checks it ended where this said.
    """
    total = used = members = 0
    for _, data in items:
        length = _length_of(data)
        if length >= PACK_ITEM_BYTES:
            if members:
                total += region_bytes(used, members)
                used = members = 0
            total += align_up(length)
            continue
        if members and region_bytes(member_start(used) + length, members + 1) > PACK_BYTES:
            total += region_bytes(used, members)
            used = members = 0
        used = member_start(used) + length
        members += 1
    if members:
        total += region_bytes(used, members)
    return total


def _length_of(data: torch.Tensor | io.BytesIO) -> int:
    """The bytes an item's data takes in a file."""
    if isinstance(data, io.BytesIO):
        return len(data.getbuffer())
    return data.numel() * data.element_size()


def _bytes_of(data: torch.Tensor | io.BytesIO) -> tuple[memoryview, int | None]:
    """The bytes to store and their address in memory (tensors only)."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer(), None
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return byte_view(tensor), tensor.data_ptr()



def _small_cpu_bytes(data: torch.Tensor | io.BytesIO) -> tuple[int, int] | None:
    """``(address, length)`` of a small tensor whose memory holds exactly its bytes.

    A contiguous CPU tensor below :data:`PACK_ITEM_BYTES`, neither conjugated nor negated
    lazily; anything else is ``None`` (and goes through :func:`_bytes_of`).
    """
    if not isinstance(data, torch.Tensor) or data.device.type != "cpu":
        return None
    length = data.numel() * data.element_size()
    if (length >= PACK_ITEM_BYTES or not data.is_contiguous() or data.is_conj()
            or data.is_neg()):
        return None
    return data.data_ptr(), length



def _balance(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` lists: biggest tensors first, each to the lightest list."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        lightest = loads.index(min(loads))
        buckets[lightest].append(item)
        loads[lightest] += _item_bytes(item)
    return buckets


def _is_small(items: Sequence[WriteItem]) -> bool:
    """Whether ``items`` hold fewer tensor bytes than :data:`SMALL_SAVE_BYTES`."""
    return sum(_item_bytes(item) for item in items) < SMALL_SAVE_BYTES


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize



_T = TypeVar("_T")


def run_writer_threads(calls: Sequence[Callable[[], _T]], *,
                       on_caller: bool = False) -> list[_T]:
    """Run each call on a writer thread of its own; return their results in order.

    The one owner of a save's writer threads: every thread's error fails the save. The
    first is raised once all have ended, with the others attached to it as notes.

    Args:
        calls: One per file.
        on_caller: Run the calls one after another on the calling thread instead (a
            small state's save: no thread to start; the first error is raised at once).
            Never for a background save, whose writers lower their thread's priority.
    """
    if on_caller:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=max(len(calls), 1),
                            thread_name_prefix="resumekit-writer") as pool:
        futures = [pool.submit(call) for call in calls]
    errors = [error for error in (future.exception() for future in futures)
              if error is not None]
    if errors:
        for extra in errors[1:]:
            logger.error("resumekit: another writer thread failed too: %s: %s",
                         type(extra).__name__, extra)
            errors[0].add_note(f"another writer thread failed too: {extra}")
        raise errors[0]
    return [future.result() for future in futures]
