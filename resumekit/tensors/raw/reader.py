"""Reading the raw format: in place, checked block by block, inside DCP's own readers.

:class:`RawTensorReading` is mixed into DCP's ``FileSystemReader`` (or a reader over
:class:`~resumekit.tensors.raw.files.FsspecFiles`) and reads only the bytes a rank needs.
When the piece of a stored tensor that a destination wants is one byte range (always for
an unchanged world size, and for FSDP's dim-0 shards when resharding), it is read straight
into the destination (``readinto``, no intermediate tensor); otherwise the stored tensor is
read into one buffer that is narrowed and copied, the way DCP does. With ``verify`` every
block a read touches is checked against the checksum recorded when it was written; a
mismatch is a :class:`~resumekit.errors.CorruptCheckpointError` naming the file, the key
and the offset. Items in DCP's own format (checkpoints of earlier versions, fsspec URLs) go
to DCP's reader unchanged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from resumekit.errors import CorruptCheckpointError, IncompleteCheckpointError
from resumekit.store.manifest import Checksum, hex_digest, parse_parts_checksum
from resumekit.store.retry import read_with_retry
from resumekit.tensors.raw.files import FsspecFiles
from resumekit.tensors.raw.format import (
    ALONE_PREFIX,
    CHUNK_BYTES,
    DATA_SUFFIX,
    FOOTER,
    MEMBER,
    PACK_MAGIC,
    REGION_PREFIXES,
    TRAILER,
    TRAILER_ALONE_DESCRIPTORS,
    TRAILER_PACK_PREFIX,
    ChecksumFile,
    Descriptor,
    FileLayout,
    StoredItem,
    byte_view,
    check_listed_checksum,
    decode_checksum_file,
    decode_trailer,
    is_packed_member,
    is_raw,
    trailer_length,
)

__all__ = ["READ_THREADS", "FsspecReader", "RawTensorReading"]


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


READ_THREADS = max(1, min(4, _usable_cpus()))
"""Files a rank reads at once: 4, or fewer on a machine with fewer usable CPUs (a page-cache
read is a memory copy and the checksum a CPU pass, so threads beyond the cores only add
switching)."""



class FsspecReader(FileSystemReader):
    """DCP's ``FileSystemReader`` over :class:`FsspecFiles`: checkpoints at fsspec URLs.

    What DCP's own fsspec reader is, on its public ``FileSystemReader``; mix
    :class:`RawTensorReading` in before it to read the raw format too.

    Args:
        path: The checkpoint's URL (``s3://bucket/run/step_000001000/tensors``, ...).
        **storage_options: fsspec options (credentials, ``endpoint_url``).
    """

    def __init__(self, path: str | os.PathLike[str], **storage_options: Any) -> None:
        super().__init__(path)
        files = FsspecFiles()
        self.path = files.init_path(path, **storage_options)
        self.fs = cast(Any, files)  # DCP types it as its local FileSystem; any FileSystemBase does

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URL fsspec can open."""
        return FsspecFiles.validate_checkpoint_id(checkpoint_id)


class RawTensorReading:
    """Mixin for a DCP reader: raw items read in place and verified, others left to DCP.

    Mix it in before DCP's ``FileSystemReader`` or ``FsspecReader``. Attributes set by the
    caller: ``verify`` (check every byte read against its recorded checksum),
    ``read_threads`` (files read at once; default :data:`READ_THREADS`) and
    ``file_checksums`` (``{file name: "xxh3_128:<hex>"}`` from a manifest, or ``None``).
    Items in DCP's own format carry no checksum of their own: with ``verify`` and
    ``file_checksums``, every such file a read touches is hashed whole, once per reader,
    and compared before DCP reads from it; without ``file_checksums`` they are read
    unchecked (the commit store verified them before the load).
    """

    verify: bool = True
    read_threads: int = READ_THREADS
    file_checksums: Mapping[str, str] | None = None
    fs: Any
    path: Any
    storage_data: dict[Any, Any]
    _raw_metadata: Metadata | None = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        """DCP's set-up; the metadata is kept for the dtype and shape of packed items."""
        self._raw_metadata = metadata
        super().set_up_storage_reader(  # type: ignore[misc]
            metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner's destinations."""
        raw: list[ReadItem] = []
        stock: list[ReadItem] = []
        layout = self._layout({self.storage_data[request.storage_index].relative_path
                               for request in plan.items})
        for request in plan.items:
            info = self.storage_data[request.storage_index]
            (raw if info.relative_path in layout.raw else stock).append(request)
        if stock:
            if self.verify and self.file_checksums is not None:
                self._verify_stock_files(stock)
            self._read_stock(plan, stock, planner)
        if raw:
            self._read_raw(raw, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _verify_stock_files(self, requests: list[ReadItem]) -> None:
        """Hash each file in DCP's own format that ``requests`` read from, once, whole."""
        checksums = cast(Mapping[str, str], self.file_checksums)
        verified: set[str] = self.__dict__.setdefault("_verified_files", set())
        files: dict[str, tuple[StoredItem, list[str]]] = {}
        for request in requests:
            info: StoredItem = self.storage_data[request.storage_index]
            if info.relative_path not in verified:
                files.setdefault(info.relative_path, (info, []))[1].append(
                    request.storage_index.fqn)
        for name, (info, names) in files.items():
            where = self._where(info)
            held = ", ".join(names[:3]) + (f" and {len(names) - 3} more"
                                           if len(names) > 3 else "")
            expected = checksums.get(name)
            if expected is None:
                raise CorruptCheckpointError(
                    f"{where} is not listed in the checkpoint's manifest, so its bytes "
                    f"cannot be verified (it holds {held})",
                    path=where, file=where, key=names[0],
                )

            def hashed(name: str = name) -> str:
                digest = Checksum()
                with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                    while chunk := stream.read(CHUNK_BYTES):
                        digest.update(chunk)
                return digest.value()

            actual = read_with_retry(where, hashed)  # a transient error hashes it again
            if actual != expected:
                raise CorruptCheckpointError(
                    f"{where} does not match its checksum in the manifest (expected "
                    f"{expected}, got {actual}); it holds {held}",
                    path=where, file=where, key=names[0],
                )
            verified.add(name)

    def _read_stock(self, plan: LoadPlan, requests: list[ReadItem],
                    planner: LoadPlanner) -> None:
        """DCP's own read of the items in its format, file by file.

        A transient error (a dropped connection, ``EIO``) reads that file's items again
        (:func:`~resumekit.store.retry.read_with_retry`; loading an item twice writes the same
        values); one that outlives the retries is a
        :class:`~resumekit.errors.StorageError` naming the file, never corruption.
        """
        read = super().read_data  # type: ignore[misc]
        per_file: dict[str, list[ReadItem]] = {}
        for request in requests:
            info: StoredItem = self.storage_data[request.storage_index]
            per_file.setdefault(info.relative_path, []).append(request)
        for name, items in per_file.items():
            where = str(os.fspath(self.fs.concat_path(self.path, name)))

            def read_file(items: list[ReadItem] = items) -> None:
                read(dataclasses.replace(plan, items=items), planner).wait()

            read_with_retry(where, read_file)

    def _read_raw(self, requests: list[ReadItem], planner: LoadPlanner) -> None:
        per_file: dict[str, list[_Job]] = {}
        layout = self._layout({self.storage_data[request.storage_index].relative_path
                               for request in requests})
        for request in requests:
            info: StoredItem = self.storage_data[request.storage_index]
            text = (info.transform_descriptors or ("",))[0]
            if (is_packed_member(info.transform_descriptors)
                    or text.startswith(REGION_PREFIXES)):  # packed
                region = layout.region_of(info)
                if region is None:
                    where = self._where(info)
                    raise CorruptCheckpointError(
                        f"{where}: {request.storage_index.fqn} (bytes {info.offset}+"
                        f"{info.length}) has no storage descriptor and lies in no packed "
                        "region of its file", path=where, file=where,
                        key=request.storage_index.fqn)
                dtype, shape = self._stored_form(request, info)
                descriptor = Descriptor(dtype, shape, region[1], (region[2],),
                                         (region[0], region[1]))
            elif (text.startswith(ALONE_PREFIX)  # stored alone, blocks in its checksum file
                  or text == TRAILER_ALONE_DESCRIPTORS[0]):  # or its file's trailer
                dtype, shape = self._stored_form(request, info)
                block, blocks = layout.alone[(info.relative_path, info.offset)]
                descriptor = Descriptor(dtype, shape, block, blocks)
            else:  # stored alone (format 1; anything else is refused, naming it)
                descriptor = Descriptor.decode(text, where=self._where(info))
            target = None
            if request.type != LoadItemType.BYTE_IO:
                target = planner.resolve_tensor(request).detach()
            per_file.setdefault(info.relative_path, []).append(
                _Job(request, info, descriptor, target))
        # One data file per rank (schema_version 4): a file's items are read by as many
        # threads as the files leave idle, each a run of neighbouring items.
        ways = max(1, self.read_threads // max(1, len(per_file)))
        pieces = [(name, piece) for name, jobs in per_file.items()
                  for piece in _split(jobs, ways)]
        threads = max(1, min(self.read_threads, len(pieces)))
        with ThreadPoolExecutor(max_workers=threads,
                                thread_name_prefix="resumekit-reader") as pool:
            futures = [pool.submit(self._read_file, name, jobs) for name, jobs in pieces]
            loaded = [future.result() for future in futures]  # re-raises the first error
        for values in loaded:
            for job, value in values:
                if isinstance(value, io.BytesIO):
                    planner.load_bytes(job.request, value)
                else:
                    planner.commit_tensor(job.request, value)

    def _where(self, info: StoredItem) -> str:
        return str(os.fspath(self.fs.concat_path(self.path, info.relative_path)))

    def _layout(self, files: set[str]) -> FileLayout:
        """The raw files and packed regions of ``files`` (worked out once for them).

        Only the data files a read touches: a rank reads the checksum files of the ranks
        whose files it reads, not every rank's (a restore's per-rank cost would grow with
        the world size that wrote the checkpoint).
        """
        cached = self.__dict__.get("_raw_layout")
        if cached is not None and cached[0] is self.storage_data and files <= cached[1]:
            return cast(FileLayout, cached[2])
        if self.verify:
            self._read_trailers(files)
        layout = FileLayout(
            self.storage_data, self._where,
            (lambda name: self._read_checksums(name).regions) if self.verify else None,
            files=files,
            blocks=(lambda name: self._read_checksums(name).items) if self.verify else None)
        self.__dict__["_raw_layout"] = (self.storage_data, frozenset(files), layout)
        return layout

    def _read_trailers(self, files: set[str]) -> None:
        """Read the checksum trailers of the data files ``files`` holds, a few at once.

        The layout then finds them read. Each file's read is a few small reads at its end
        (on a NAS, round trips): a rank that reads many files (rank 0 reading the small
        items every rank asks for whole, one or two per rank's file) reads up to
        :data:`READ_THREADS` at once. This thread owns them: the first failure in file
        name order is raised, naming its file, as a read one after another would.
        """
        cache: dict[tuple[int, str], Any] = self.__dict__.setdefault("_checksum_files", {})
        marker = id(getattr(self, "storage_data", None))
        names = sorted({info.relative_path for info in self.storage_data.values()
                        if info.relative_path in files and is_raw(info)
                        and (marker, info.relative_path) not in cache
                        and _in_trailer(cast(Sequence[str], info.transform_descriptors)[0])})
        if len(names) < 2 or self.read_threads < 2:
            return  # the layout reads it (or none) itself
        with ThreadPoolExecutor(max_workers=min(self.read_threads, len(names)),
                                thread_name_prefix="resumekit-reader") as pool:
            futures = [pool.submit(self._read_trailer, name, self._where_file(name))
                       for name in names]
            read = [future.result() for future in futures]  # re-raises, in name order
        for name, parsed in zip(names, read, strict=True):
            self._keep_checksums((marker, name), parsed)

    def _where_file(self, name: str) -> str:
        return str(os.fspath(self.fs.concat_path(self.path, name)))

    def _keep_checksums(self, key: tuple[int, str], parsed: ChecksumFile) -> None:
        """Cache ``parsed`` under ``key``, dropping another checkpoint's (owner thread)."""
        cache: dict[tuple[int, str], Any] = self.__dict__.setdefault("_checksum_files", {})
        for stale in [k for k in cache if k[0] != key[0]]:  # another checkpoint's
            del cache[stale]
        cache[key] = parsed

    def _read_checksums(self, name: str) -> ChecksumFile:
        """Read (once per layout) and parse checksum file ``name``, checked first.

        With a manifest (``file_checksums``) the file must be listed in it and match its
        recorded checksum, as ``.metadata`` must: the regions' checksums come from it. A
        data file's ``name`` (``schema_version`` 4): its trailer (:meth:`_read_trailer`).
        """
        cache: dict[tuple[int, str], Any] = self.__dict__.setdefault("_checksum_files", {})
        key = (id(getattr(self, "storage_data", None)), name)
        found = cache.get(key)
        if found is not None:
            return cast(ChecksumFile, found)
        where = str(os.fspath(self.fs.concat_path(self.path, name)))
        if name.endswith(DATA_SUFFIX):
            parsed = self._read_trailer(name, where)
            self._keep_checksums(key, parsed)
            return parsed

        def read() -> bytes:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                return cast(bytes, stream.read())

        try:
            data = read_with_retry(where, read)
        except FileNotFoundError as error:
            raise IncompleteCheckpointError(
                f"checkpoint {os.fspath(self.path)} is missing its checksum file {where}, "
                "which the checksums of its tensors' bytes are in",
                path=os.fspath(self.path), file=where) from error
        check_listed_checksum(self.file_checksums, name, data, where)
        parsed = decode_checksum_file(data, where=where)
        self._keep_checksums(key, parsed)
        return parsed

    def _read_trailer(self, name: str, where: str) -> ChecksumFile:
        """Read and parse the checksum trailer that ends data file ``name``.

        It must match the checksum its footer records and, with a manifest
        (``file_checksums``), the last part of the file's checksum there, as a checksum
        file must match its entry.

        Raises:
            CorruptCheckpointError: No trailer, or one that fails a checksum (naming the
                file).
        """
        def read() -> bytes:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                size = stream.seek(0, os.SEEK_END)
                stream.seek(max(0, size - TRAILER.size))
                length = trailer_length(stream.read(TRAILER.size), size, where=where)
                stream.seek(size - length)
                return cast(bytes, stream.read(length))

        data = read_with_retry(where, read)
        if self.file_checksums is not None:
            expected = self.file_checksums.get(name)
            parts = None if expected is None else parse_parts_checksum(expected)
            if not parts:
                raise CorruptCheckpointError(
                    f"{where} is not listed in the checkpoint's manifest with a checksum of "
                    f"parts (found {expected!r}), so its checksum trailer cannot be verified",
                    path=where, file=where)
            if parts[-1] != (len(data), hex_digest(data)):
                raise CorruptCheckpointError(
                    f"{where}: its checksum trailer ({len(data)} bytes) does not match its "
                    f"checksum in the manifest", path=where, file=where)
        return decode_trailer(data, where=where)

    def _stored_form(self, request: ReadItem, info: StoredItem
                     ) -> tuple[torch.dtype | None, tuple[int, ...]]:
        """Dtype and shape of a packed item or one of format 4, from DCP's metadata entry."""
        index = request.storage_index
        where = self._where(info)
        entry = (None if self._raw_metadata is None
                 else self._raw_metadata.state_dict_metadata.get(index.fqn))
        if isinstance(entry, BytesStorageMetadata):
            return None, ()
        if isinstance(entry, TensorStorageMetadata):
            chunks = entry.chunks
            hint = index.index
            if hint is not None and 0 <= hint < len(chunks) and \
                    tuple(chunks[hint].offsets) == tuple(index.offset or ()):
                return entry.properties.dtype, tuple(chunks[hint].sizes)
            for chunk in chunks:
                if tuple(chunk.offsets) == tuple(index.offset or ()):
                    return entry.properties.dtype, tuple(chunk.sizes)
        raise CorruptCheckpointError(
            f"{where}: the metadata has no entry for the item {index.fqn} at "
            f"offset {list(index.offset or ())}", path=where, file=where, key=index.fqn,
        )

    def _read_file(self, name: str, jobs: list[_Job]) -> list[tuple[_Job, Any]]:
        """Read every item of one file; a transient error reads the whole file again."""
        where = self._where(jobs[0].info)

        def read() -> list[tuple[_Job, Any]]:
            values: list[tuple[_Job, Any]] = []
            packs: dict[int, Any] = {}  # the packed region read (and verified) last
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for job in sorted(jobs, key=lambda j: j.info.offset):
                    stream.seek(job.info.offset)
                    values.append((job, self._read_item(stream, job, where, packs)))
            return values

        return read_with_retry(where, read)

    def _read_item(self, stream: IO[bytes], job: _Job, where: str,
                   packs: dict[int, Any] | None = None) -> Any:
        descriptor, info, request = job.descriptor, job.info, job.request
        key = request.storage_index.fqn
        if descriptor.region is not None:
            low, length = descriptor.region
            if not low <= info.offset <= info.offset + info.length <= low + length:
                raise CorruptCheckpointError(
                    f"{where}: {key} records bytes {info.offset}+{info.length} outside its "
                    f"packed region {low}+{length}", path=where, file=where, key=key,
                )
        if descriptor.dtype is None:
            buffer = bytearray(info.length)
            self._read_range(stream, job, (0, info.length), memoryview(buffer), packs)
            return io.BytesIO(bytes(buffer))
        target = job.target
        assert target is not None
        item_size = descriptor.dtype.itemsize
        expected = math.prod(descriptor.shape) * item_size
        blocks = (1 if descriptor.region is not None
                  else -(-info.length // descriptor.block_bytes))
        if expected != info.length or (len(descriptor.blocks) != blocks
                                       and (self.verify or descriptor.blocks)):
            raise CorruptCheckpointError(
                f"{where}: {key} records {info.length} bytes in {len(descriptor.blocks)} "
                f"blocks for shape {list(descriptor.shape)} of {descriptor.dtype} "
                f"({expected} bytes)", path=where, file=where, key=key,
            )
        if tuple(target.shape) != tuple(request.lengths):
            raise CorruptCheckpointError(
                f"{where}: {key} gives a piece of shape {list(request.lengths)} for a "
                f"destination of shape {list(target.shape)}", path=where, file=where, key=key,
            )
        span = _contiguous_span(descriptor.shape, request.storage_offsets, request.lengths)
        if span is None:  # a piece that is not one byte range: read the item, narrow it
            stored = torch.empty(descriptor.shape, dtype=descriptor.dtype)
            self._read_range(stream, job, (0, info.length), byte_view(stored), packs)
            target.copy_(_narrow(stored, request.storage_offsets, request.lengths))
            return target
        first, count = span
        start, stop = first * item_size, (first + count) * item_size
        if (target.device.type == "cpu" and target.dtype == descriptor.dtype
                and target.is_contiguous()):
            if descriptor.region is not None and packs is not None and stop > start:
                # A small item: copied out of its (checked) region, no view objects.
                _, address = self._region(stream, job, packs)
                shift = info.offset - descriptor.region[0]
                ctypes.memmove(target.data_ptr(), address + shift + start, stop - start)
                return target
            self._read_range(stream, job, (start, stop), byte_view(target), packs)
            return target
        piece = torch.empty(tuple(request.lengths), dtype=descriptor.dtype)
        self._read_range(stream, job, (start, stop), byte_view(piece), packs)
        target.copy_(piece)
        return target

    def _read_range(self, stream: IO[bytes], job: _Job, span: tuple[int, int],
                    destination: memoryview,
                    packs: dict[int, Any] | None = None) -> None:
        """Read bytes ``[start, stop)`` of an item into ``destination``.

        With ``verify``, every block the range touches is read whole and checked against
        its checksum: the blocks inside the range are read straight into ``destination``
        in one pass, the (at most two) partial ones at its ends through a scratch buffer.
        A packed item's block is its whole region: with ``packs`` the region is read (and
        verified) once, kept there by file offset, and every member is copied out of it.
        """
        info, where = job.info, self._where(job.info)
        base, extent = job.descriptor.region or (info.offset, info.length)
        shift = info.offset - base  # block numbers count from the region's start
        start, stop = span[0] + shift, span[1] + shift
        if job.descriptor.region is not None and packs is not None:
            region, _ = self._region(stream, job, packs)
            destination[:] = region[start:stop]
            return
        if not self.verify:
            stream.seek(base + start)
            self._read_exactly(stream, destination, job, where)
            return
        block = job.descriptor.block_bytes
        inner_low = -(-start // block) * block  # the whole blocks inside [start, stop)
        inner_high = max(inner_low, min(stop, extent) // block * block)
        if stop == extent:
            inner_high = stop if inner_low < stop else inner_high
        if inner_low < inner_high:
            stream.seek(base + inner_low)
            inner = destination[inner_low - start:inner_high - start]
            self._read_exactly(stream, inner, job, where)
            for at in range(0, len(inner), block):
                self._check_block(job, (inner_low + at) // block, inner[at:at + block])
        scratch: memoryview | None = None
        for number in {start // block, (stop - 1) // block} if stop > start else ():
            low, high = number * block, min((number + 1) * block, extent)
            if inner_low <= low and high <= inner_high:
                continue  # read above
            scratch = scratch if scratch is not None else memoryview(bytearray(block))
            view = scratch[:high - low]
            stream.seek(base + low)
            self._read_exactly(stream, view, job, where)
            self._check_block(job, number, view)
            begin, end = max(start, low), min(stop, high)
            destination[begin - start:end - start] = view[begin - low:end - low]

    def _region(self, stream: IO[bytes], job: _Job, packs: dict[int, Any]
                ) -> tuple[memoryview, int]:
        """The packed region of ``job`` and its address in memory.

        Read (and, with ``verify``, checked) once, then kept in ``packs``.
        """
        base, extent = cast(tuple[int, int], job.descriptor.region)
        found = packs.get(base)
        if found is not None:
            return cast(tuple[memoryview, int], found)
        buffer = bytearray(max(extent, 1))
        region = memoryview(buffer)[:extent]
        stream.seek(base)
        self._read_exactly(stream, region, job, self._where(job.info))
        if self.verify and hex_digest(region) != job.descriptor.blocks[0]:
            self._name_damaged_member(job, region)
        packs.clear()  # members are read in file order: one region at a time
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        packs[base] = (region, address)
        return region, address

    def _name_damaged_member(self, job: _Job, region: memoryview) -> None:
        """Raise for a packed region that fails its checksum, naming the damaged member.

        The region's table of members says which member's bytes changed; when none did
        (the damage is in the table or the padding) the region itself is named.
        """
        info, where = job.info, self._where(job.info)
        base = cast(tuple[int, int], job.descriptor.region)[0]
        damaged: list[tuple[int, int]] = []
        try:
            count, magic = FOOTER.unpack_from(region, len(region) - FOOTER.size)
            table = len(region) - FOOTER.size - count * MEMBER.size
            if magic != PACK_MAGIC or table < 0:
                raise ValueError("no table of members")
            for number in range(count):
                start, length, digest = MEMBER.unpack_from(region, table + number * MEMBER.size)
                if xxhash.xxh3_128_digest(region[start:start + length]) != digest:
                    damaged.append((start, length))
        except (ValueError, struct.error):
            damaged = []
        names = {(item.offset - base): index.fqn for index, item in self.storage_data.items()
                 if item.relative_path == info.relative_path}
        if damaged:
            start, length = damaged[0]
            key = names.get(start, job.request.storage_index.fqn)
            raise CorruptCheckpointError(
                f"{where}: the bytes of {key} at offset {base + start} ({length} bytes, in "
                f"a region of packed small items at offset {base}) do not match their "
                "checksum", path=where, file=where, key=key,
            )
        key = job.request.storage_index.fqn
        raise CorruptCheckpointError(
            f"{where}: the region of packed small items at offset {base} ({len(region)} "
            f"bytes, holding {key}) does not match its checksum, though each member's "
            "bytes do: its table of members is damaged", path=where, file=where, key=key,
        )

    def _check_block(self, job: _Job, number: int, view: memoryview) -> None:
        if hex_digest(view) != job.descriptor.blocks[number]:
            where = self._where(job.info)
            base = (job.descriptor.region or (job.info.offset, 0))[0]
            packed = " (a region of packed small items)" if job.descriptor.region else ""
            raise CorruptCheckpointError(
                f"{where}: the bytes of {job.request.storage_index.fqn} at offset "
                f"{base + number * job.descriptor.block_bytes} ({len(view)} "
                f"bytes{packed}) do not match their checksum",
                path=where, file=where, key=job.request.storage_index.fqn,
            )

    def _read_exactly(self, stream: IO[bytes], destination: memoryview, job: _Job,
                      where: str) -> None:
        for chunk in _chunks(destination):
            got = 0
            while got < len(chunk):
                count = stream.readinto(chunk[got:])  # type: ignore[attr-defined]
                if not count:
                    raise IncompleteCheckpointError(
                        f"{where} ends early: {job.request.storage_index.fqn} needs "
                        f"{job.info.length} bytes at offset {job.info.offset}",
                        path=where, file=where, key=job.request.storage_index.fqn,
                    )
                got += count


def _split(jobs: list[_Job], ways: int) -> list[list[_Job]]:
    """``jobs`` (of one file) in up to ``ways`` runs of neighbouring items, of similar bytes."""
    if ways <= 1 or len(jobs) <= 1:
        return [jobs]
    ordered = sorted(jobs, key=lambda job: job.info.offset)
    share = sum(job.info.length for job in ordered) / ways
    runs: list[list[_Job]] = [[]]
    load = 0
    for job in ordered:
        if runs[-1] and load >= share and len(runs) < ways:
            runs.append([])
            load = 0
        runs[-1].append(job)
        load += job.info.length
    return runs


def _contiguous_span(shape: tuple[int, ...], offsets: Sequence[int],
                     lengths: Sequence[int]) -> tuple[int, int] | None:
    """Locate a piece of a row-major tensor as one range of elements.

    Returns:
        ``(first element, element count)`` of the piece ``offsets``/``lengths`` of
        ``shape``, or ``None`` when the piece is not one contiguous range.
    """
    partial = [dim for dim in range(len(shape))
               if offsets[dim] != 0 or lengths[dim] != shape[dim]]
    count = math.prod(lengths)
    if partial:
        outer = partial[-1]
        if any(lengths[dim] != 1 for dim in range(outer)):
            return None
    first, stride = 0, 1
    for dim in reversed(range(len(shape))):
        first += offsets[dim] * stride
        stride *= shape[dim]
    return first, count


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]
            ) -> torch.Tensor:
    """The piece ``offsets``/``lengths`` of ``tensor`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


@dataclasses.dataclass
class _Job:
    request: ReadItem
    info: StoredItem
    descriptor: Descriptor
    target: torch.Tensor | None


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start:start + CHUNK_BYTES]


def _in_trailer(descriptor: str) -> bool:
    """Whether an item of this descriptor has its checksums in its data file's trailer."""
    return descriptor == TRAILER_ALONE_DESCRIPTORS[0] or descriptor.startswith(
        TRAILER_PACK_PREFIX)
