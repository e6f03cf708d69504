"""DCP storage layer that keeps tensors as raw bytes, checksummed as they are written and read.

DCP's stock ``FileSystemWriter`` serialises every tensor with ``torch.save`` (a zip archive
per tensor) and its reader runs ``torch.load`` on every tensor, then copies the result into
place. This module replaces only that storage layer; planning, resharding and the
``.metadata`` file stay DCP's own:

* :class:`RawTensorWriter` (local directories) writes each tensor's bytes as they lie in
  memory, ``thread_count`` files per rank, each file from its own thread. Every chunk is
  hashed on its way to the file, so the commit store gets each file's checksum without
  reading the file back (:attr:`RawTensorWriter.written`). File writes and the hash both
  release the GIL; for a background save the writer threads also drop to idle CPU
  priority, so the training loop keeps its cores.
* :class:`RawTensorReading` (mixed into DCP's readers) reads only the bytes a rank needs.
  When the piece of a stored tensor that a destination wants is one byte range (always for
  an unchanged world size, and for FSDP's dim-0 shards when resharding), it is read
  straight into the destination (``readinto``, no intermediate tensor); otherwise the
  stored tensor is read into one buffer that is narrowed and copied, the way DCP does.
  With ``verify`` every block a read touches is checked against the checksum recorded
  when it was written; a mismatch is a :class:`~resumekit.errors.CorruptCheckpointError`
  naming the file, the key and the offset. Items in DCP's own format (checkpoints of
  earlier versions, fsspec URLs) go to DCP's reader unchanged.

Format: each stored item's ``_StorageInfo.transform_descriptors`` is one string
``"resumekit-raw/1;<dtype>;<shape>;<block bytes>;xxh3_128:<hex>,<hex>,..."``: one checksum
per block of the item (:func:`block_bytes_for`: about a sixteenth of it, 64 KiB to 4 MiB),
so a reader that needs a slice verifies it without reading much more (``bytes`` and an
empty shape for non-tensor values). DCP's stock reader stops at such an item with
``ValueError: Unknown extension name='resumekit-raw'`` instead of misreading it; stock DCP
reads these checkpoints through :class:`resumekit.StorageReader` (``dcp.load(...,
storage_reader=resumekit.StorageReader(step_dir))``), and
``CheckpointManager(..., tensor_format="dcp")`` writes DCP's own format instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import io
import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, NamedTuple, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resumekit.errors import CorruptCheckpointError, IncompleteCheckpointError
from resumekit.manifest import CHECKSUM_ALGORITHM, Checksum, hex_digest
from resumekit.retry import read_with_retry

__all__ = [
    "ALIGNMENT",
    "CHUNK_BYTES",
    "FORMAT_NAME",
    "RawTensorReading",
    "RawTensorWriter",
    "WrittenFile",
    "aligned_empty",
    "block_bytes_for",
    "is_raw",
]

FORMAT_NAME = "resumekit-raw"
FORMAT_VERSION = 1
CHUNK_BYTES = 4 << 20
"""The largest checksummed block, hashed and written per system call: small enough to stay
in cache between the hash and the copy into the page cache, large enough to keep system
calls rare."""
ALIGNMENT = 4096
"""Items start on this boundary in a data file, and direct I/O moves whole multiples of it."""
MIN_BLOCK_BYTES = 64 << 10
"""The smallest checksummed block (items below it are one block)."""
DATA_SUFFIX = ".distcp"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


READ_THREADS = max(1, min(4, _usable_cpus()))
"""Files a rank reads at once: 4, or fewer on a machine with fewer usable CPUs (a page-cache
read is a memory copy and the checksum a CPU pass, so threads beyond the cores only add
switching)."""


class WrittenFile(NamedTuple):
    """A file the writer produced, described while it was written.

    Attributes:
        name: File name relative to the checkpoint directory.
        size: Bytes written.
        checksum: ``"xxh3_128:<hex>"`` of the whole file.
    """

    name: str
    size: int
    checksum: str


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    dtype: torch.dtype | None  # None: a non-tensor value (DCP's BYTE_IO)
    shape: tuple[int, ...]
    block_bytes: int
    blocks: tuple[str, ...]  # hex XXH3-128 of each block_bytes slice of the item

    def encode(self) -> str:
        dtype = "bytes" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        shape = "x".join(str(size) for size in self.shape)
        return (f"{FORMAT_NAME}/{FORMAT_VERSION};{dtype};{shape};{self.block_bytes};"
                f"{CHECKSUM_ALGORITHM}:{','.join(self.blocks)}")

    @classmethod
    def decode(cls, text: str, *, where: str) -> _Descriptor:
        try:
            head, dtype_name, shape_text, block_text, checksums = text.split(";")
            if head != f"{FORMAT_NAME}/{FORMAT_VERSION}":
                raise ValueError(f"unknown format {head!r}")
            if dtype_name == "bytes":
                dtype = None
            else:
                dtype = getattr(torch, dtype_name)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"unknown dtype {dtype_name!r}")
            shape = tuple(int(size) for size in shape_text.split("x")) if shape_text else ()
            block_bytes = int(block_text)
            if block_bytes < 1:
                raise ValueError(f"block size {block_bytes}")
            algorithm, _, digests = checksums.partition(":")
            if algorithm != CHECKSUM_ALGORITHM:
                raise ValueError(f"unknown checksum {algorithm!r}")
            blocks = tuple(digests.split(",")) if digests else ()
        except (ValueError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"{where}: unreadable storage descriptor {text[:120]!r} ({error})",
                path=where, file=where,
            ) from None
        return cls(dtype, shape, block_bytes, blocks)


def is_raw(info: _StorageInfo) -> bool:
    """Whether a stored item was written by :class:`RawTensorWriter`."""
    descriptors = info.transform_descriptors or ()
    return len(descriptors) == 1 and descriptors[0].startswith(f"{FORMAT_NAME}/")


# ------------------------------------------------------------------------------- writing


class RawTensorWriter(FileSystemWriter):
    """DCP ``StorageWriter`` for a local directory: raw tensor bytes, hashed while written.

    Args:
        path: The (empty) directory to write into.
        thread_count: Files, and writer threads, per rank.
        sync_files: ``fsync`` each file before the write is reported done.
        background: The save overlaps training: writer threads run at idle CPU priority
            (``SCHED_IDLE``, else nice 19) so the training threads keep their cores.
    """

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int,
                 sync_files: bool, background: bool = False) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files,
                         thread_count=thread_count, overwrite=False)
        self.background = background
        self.written: list[WrittenFile] = []
        """The files this rank wrote in the last :meth:`write_data`, with checksums."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items, one file per thread; re-raise the first thread error."""
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        buckets = [bucket for bucket in _balance(plan.items, self.thread_count) if bucket]
        jobs = [
            (f"{prefix}{number}{DATA_SUFFIX}",
             [(item, planner.resolve_data(item)) for item in bucket])
            for number, bucket in enumerate(buckets)
        ]
        self.written = []
        results: list[WriteResult] = []
        with ThreadPoolExecutor(max_workers=max(len(jobs), 1),
                                thread_name_prefix="resumekit-writer") as pool:
            futures = [pool.submit(self._write_file, name, items) for name, items in jobs]
            for future in futures:  # in order: the first error is re-raised here
                file_results, written = future.result()
                results.extend(file_results)
                self.written.append(written)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(
        self, name: str, items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]]
    ) -> tuple[list[WriteResult], WrittenFile]:
        if self.background:
            _lower_thread_priority()
        path = os.path.join(os.fspath(self.path), name)
        results: list[WriteResult] = []
        with _AlignedFile(path) as handle:
            for item, data in items:
                view, address, dtype, shape = _bytes_of(data)
                block = block_bytes_for(len(view))
                stride = block * max(1, CHUNK_BYTES // block)  # whole blocks per write
                blocks: list[str] = []
                offset = handle.offset
                for start in range(0, len(view), stride):
                    chunk = view[start:start + stride]
                    blocks.extend(hex_digest(chunk[at:at + block])
                                  for at in range(0, len(chunk), block))
                    handle.write(chunk, None if address is None else address + start)
                handle.pad()  # the next item starts on an ALIGNMENT boundary
                descriptor = _Descriptor(dtype, shape, block, tuple(blocks)).encode()
                results.append(WriteResult(
                    index=item.index, size_in_bytes=len(view),
                    storage_data=_StorageInfo(name, offset, len(view),
                                              transform_descriptors=[descriptor]),
                ))
            if self.sync_files:
                os.fsync(handle.fd)
            written = WrittenFile(name, handle.offset, handle.checksum.value())
        return results, written


class _AlignedFile:
    """A new file written with ``O_DIRECT`` where the filesystem allows it.

    Direct I/O skips the page cache: no kernel copy of every byte and no dirty pages for
    writeback to flush while training runs. It needs ``ALIGNMENT``-aligned memory, file
    offsets and lengths: aligned sources (the CPU staging buffers of async saves) are
    written as they are, anything else is copied through an aligned bounce buffer (with
    ``ctypes.memmove``, which releases the GIL), and each item is padded with zeros to
    the next boundary. Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and
    FUSE filesystems) the same bytes are written through the page cache. The file's
    running checksum covers the padding too.
    """

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        self.direct = False
        if direct:
            try:
                self.fd = os.open(path, flags | direct, 0o644)
                self.direct = True
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.offset = 0
        self.checksum = Checksum()
        self._bounce: mmap.mmap | None = None

    def __enter__(self) -> _AlignedFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.fd)
        if self._bounce is not None:
            self._bounce.close()

    def write(self, chunk: memoryview, address: int | None) -> None:
        """Append ``chunk`` (at ``address`` in memory when known); pads nothing."""
        self.checksum.update(chunk)
        aligned = (address is not None and address % ALIGNMENT == 0
                   and len(chunk) % ALIGNMENT == 0 and self.offset % ALIGNMENT == 0)
        if not self.direct or aligned:
            self._write_all(chunk)
            return
        bounce = self._bounce_buffer()
        for start in range(0, len(chunk), CHUNK_BYTES):
            piece = chunk[start:start + CHUNK_BYTES]
            if address is not None:
                ctypes.memmove(_address_of(bounce), address + start, len(piece))
            else:
                memoryview(bounce)[:len(piece)] = piece
            padded = -(-len(piece) // ALIGNMENT) * ALIGNMENT
            memoryview(bounce)[len(piece):padded] = bytes(padded - len(piece))
            # The zeros past the piece are overwritten by the next write or kept as the
            # item's padding (pad() then only moves the offset).
            self._write_all(memoryview(bounce)[:padded], logical=len(piece))

    def pad(self) -> None:
        """Zero-fill up to the next ``ALIGNMENT`` boundary."""
        missing = (-self.offset) % ALIGNMENT
        if not missing:
            return
        zeros = bytes(missing)
        self.checksum.update(zeros)
        if self.direct:  # the bounce write already put these zeros on disk
            self.offset += missing
            os.lseek(self.fd, self.offset, os.SEEK_SET)
            return
        self._write_all(memoryview(zeros))

    def _write_all(self, data: memoryview, logical: int | None = None) -> None:
        total = len(data)
        while data:
            try:
                count = os.write(self.fd, data)
            except OSError as error:
                if not (self.direct and error.errno == errno.EINVAL):
                    raise
                # Refused at write time (some FUSE and network filesystems): continue
                # through the page cache, same bytes, same offsets.
                fcntl.fcntl(self.fd, fcntl.F_SETFL,
                            fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            data = data[count:]
        self.offset += total if logical is None else logical
        if logical is not None:
            os.lseek(self.fd, self.offset, os.SEEK_SET)

    def _bounce_buffer(self) -> mmap.mmap:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, CHUNK_BYTES)  # anonymous: page-aligned
        return self._bounce


def _address_of(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, *,
                  pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an ``ALIGNMENT`` boundary.

    The writer sends such tensors to disk with direct I/O without copying them (the CPU
    staging buffers of async saves are allocated this way).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin_memory)
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip:skip + nbytes].view(dtype).view(tuple(shape))


def _balance(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` lists: biggest tensors first, each to the lightest list."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        lightest = loads.index(min(loads))
        buckets[lightest].append(item)
        loads[lightest] += _item_bytes(item)
    return buckets


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def _bytes_of(data: torch.Tensor | io.BytesIO
              ) -> tuple[memoryview, int | None, torch.dtype | None, tuple[int, ...]]:
    """The bytes to store, their address in memory (tensors only), dtype and shape."""
    if isinstance(data, io.BytesIO):
        return data.getbuffer(), None, None, ()
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return _byte_view(tensor), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared, as a flat memoryview."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, flat.view(torch.uint8).numpy())).cast("B")


def block_bytes_for(item_bytes: int) -> int:
    """The checksum block size of an item: about a sixteenth of it, within bounds.

    A resharding reader reads at most one block beyond each end of its slice, so blocks
    scale with the item; the bounds keep tiny items whole and huge ones at
    :data:`CHUNK_BYTES` per system call.
    """
    sixteenth = -(-item_bytes // 16)
    aligned = -(-sixteenth // ALIGNMENT) * ALIGNMENT
    return max(MIN_BLOCK_BYTES, min(CHUNK_BYTES, aligned))


def _lower_thread_priority() -> None:
    """Let this thread run only on CPU time the rest of the machine leaves; best effort.

    Linux schedules threads separately: ``SCHED_IDLE`` where allowed, else nice 19. The
    thread holds the GIL only for microseconds between system calls and hash updates, so
    a training thread rarely waits on it.
    """
    native = threading.get_native_id()
    try:
        os.sched_setscheduler(native, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):  # not Linux, or refused: fall back to nice
        pass
    with contextlib.suppress(AttributeError, OSError):  # else: normal priority
        os.setpriority(os.PRIO_PROCESS, native, 19)


# ------------------------------------------------------------------------------- reading


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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner's destinations."""
        raw: list[ReadItem] = []
        stock: list[ReadItem] = []
        for request in plan.items:
            (raw if is_raw(self.storage_data[request.storage_index]) else stock).append(request)
        if stock:
            if self.verify and self.file_checksums is not None:
                self._verify_stock_files(stock)
            super().read_data(  # type: ignore[misc]
                dataclasses.replace(plan, items=stock), planner).wait()
        if raw:
            self._read_raw(raw, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _verify_stock_files(self, requests: list[ReadItem]) -> None:
        """Hash each file in DCP's own format that ``requests`` read from, once, whole."""
        checksums = cast(Mapping[str, str], self.file_checksums)
        verified: set[str] = self.__dict__.setdefault("_verified_files", set())
        files: dict[str, tuple[_StorageInfo, list[str]]] = {}
        for request in requests:
            info: _StorageInfo = self.storage_data[request.storage_index]
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
            digest = Checksum()
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                while chunk := stream.read(CHUNK_BYTES):
                    digest.update(chunk)
            if digest.value() != expected:
                raise CorruptCheckpointError(
                    f"{where} does not match its checksum in the manifest (expected "
                    f"{expected}, got {digest.value()}); it holds {held}",
                    path=where, file=where, key=names[0],
                )
            verified.add(name)

    def _read_raw(self, requests: list[ReadItem], planner: LoadPlanner) -> None:
        per_file: dict[str, list[_Job]] = {}
        for request in requests:
            info: _StorageInfo = self.storage_data[request.storage_index]
            where = self._where(info)
            descriptor = _Descriptor.decode(cast(Sequence[str], info.transform_descriptors)[0],
                                            where=where)
            target = None
            if request.type != LoadItemType.BYTE_IO:
                target = planner.resolve_tensor(request).detach()
            per_file.setdefault(info.relative_path, []).append(
                _Job(request, info, descriptor, target))
        threads = max(1, min(self.read_threads, len(per_file)))
        with ThreadPoolExecutor(max_workers=threads,
                                thread_name_prefix="resumekit-reader") as pool:
            futures = [pool.submit(self._read_file, name, jobs)
                       for name, jobs in per_file.items()]
            loaded = [future.result() for future in futures]  # re-raises the first error
        for values in loaded:
            for job, value in values:
                if isinstance(value, io.BytesIO):
                    planner.load_bytes(job.request, value)
                else:
                    planner.commit_tensor(job.request, value)

    def _where(self, info: _StorageInfo) -> str:
        return str(os.fspath(self.fs.concat_path(self.path, info.relative_path)))

    def _read_file(self, name: str, jobs: list[_Job]) -> list[tuple[_Job, Any]]:
        """Read every item of one file; a transient error reads the whole file again."""
        where = self._where(jobs[0].info)

        def read() -> list[tuple[_Job, Any]]:
            values: list[tuple[_Job, Any]] = []
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for job in sorted(jobs, key=lambda j: j.info.offset):
                    stream.seek(job.info.offset)
                    values.append((job, self._read_item(stream, job, where)))
            return values

        return read_with_retry(where, read)

    def _read_item(self, stream: IO[bytes], job: _Job, where: str) -> Any:
        descriptor, info, request = job.descriptor, job.info, job.request
        key = request.storage_index.fqn
        if descriptor.dtype is None:
            buffer = bytearray(info.length)
            self._read_range(stream, job, (0, info.length), memoryview(buffer))
            return io.BytesIO(bytes(buffer))
        target = job.target
        assert target is not None
        item_size = descriptor.dtype.itemsize
        expected = math.prod(descriptor.shape) * item_size
        blocks = -(-info.length // descriptor.block_bytes)
        if expected != info.length or len(descriptor.blocks) != blocks:
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
            self._read_range(stream, job, (0, info.length), _byte_view(stored))
            target.copy_(narrow_tensor_by_index(stored, request.storage_offsets,
                                                request.lengths))
            return target
        first, count = span
        start, stop = first * item_size, (first + count) * item_size
        if (target.device.type == "cpu" and target.dtype == descriptor.dtype
                and target.is_contiguous()):
            self._read_range(stream, job, (start, stop), _byte_view(target))
            return target
        piece = torch.empty(tuple(request.lengths), dtype=descriptor.dtype)
        self._read_range(stream, job, (start, stop), _byte_view(piece))
        target.copy_(piece)
        return target

    def _read_range(self, stream: IO[bytes], job: _Job, span: tuple[int, int],
                    destination: memoryview) -> None:
        """Read bytes ``[start, stop)`` of an item into ``destination``.

        With ``verify``, every block the range touches is read whole and checked against
        its checksum: the blocks inside the range are read straight into ``destination``
        in one pass, the (at most two) partial ones at its ends through a scratch buffer.
        """
        info, (start, stop), where = job.info, span, self._where(job.info)
        if not self.verify:
            stream.seek(info.offset + start)
            self._read_exactly(stream, destination, job, where)
            return
        block = job.descriptor.block_bytes
        inner_low = -(-start // block) * block  # the whole blocks inside [start, stop)
        inner_high = max(inner_low, min(stop, info.length) // block * block)
        if stop == info.length:
            inner_high = stop if inner_low < stop else inner_high
        if inner_low < inner_high:
            stream.seek(info.offset + inner_low)
            inner = destination[inner_low - start:inner_high - start]
            self._read_exactly(stream, inner, job, where)
            for at in range(0, len(inner), block):
                self._check_block(job, (inner_low + at) // block, inner[at:at + block])
        scratch: memoryview | None = None
        for number in {start // block, (stop - 1) // block} if stop > start else ():
            low, high = number * block, min((number + 1) * block, info.length)
            if inner_low <= low and high <= inner_high:
                continue  # read above
            scratch = scratch if scratch is not None else memoryview(bytearray(block))
            view = scratch[:high - low]
            stream.seek(info.offset + low)
            self._read_exactly(stream, view, job, where)
            self._check_block(job, number, view)
            begin, end = max(start, low), min(stop, high)
            destination[begin - start:end - start] = view[begin - low:end - low]

    def _check_block(self, job: _Job, number: int, view: memoryview) -> None:
        if hex_digest(view) != job.descriptor.blocks[number]:
            where = self._where(job.info)
            raise CorruptCheckpointError(
                f"{where}: the bytes of {job.request.storage_index.fqn} at offset "
                f"{job.info.offset + number * job.descriptor.block_bytes} ({len(view)} "
                "bytes) do not match their checksum",
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


@dataclasses.dataclass
class _Job:
    request: ReadItem
    info: _StorageInfo
    descriptor: _Descriptor
    target: torch.Tensor | None


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), CHUNK_BYTES):
        yield view[start:start + CHUNK_BYTES]
