"""Writing one file of a checkpoint: created new, hashed on its way out, failures named.

The pieces :mod:`resumekit.tensors.raw.writer`'s storage writers are made of:

* :class:`AlignedFile`: a new local data file, or one part of it (several threads write
  one file, each at its own offset: :func:`open_new_file`, ``pwrite``), written with
  ``O_DIRECT`` where the filesystem allows it (no page-cache copy, no dirty pages for
  writeback while training runs), its running checksum covering every byte of the part,
  padding included.
* :class:`Pack`: small items gathered into one packed region (:mod:`.format`).
* :class:`_HashingStream` and :class:`RecordingFileSystem`: any DCP ``FileSystem``'s
  write streams hashed and recorded by file name; a failed stream discarded (an object
  store then keeps no partial object), never completed by its close.
* :class:`FsspecFiles`: DCP's public ``FileSystemBase`` over fsspec (``s3://``,
  ``memory://``, ...).
* :func:`write_new_file`: small files, never over an existing one.
* :func:`write_failure`: an ``OSError`` as a :class:`~resumekit.errors.StorageError`
  naming the file (a full disk also names the free space).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import logging
import math
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import xxhash
from fsspec.core import url_to_fs
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from resumekit.errors import StorageError
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.manifest import Checksum, hex_digest
from resumekit.store.storage import open_filesystem
from resumekit.tensors.raw.format import (
    ALIGNMENT,
    CHUNK_BYTES,
    FOOTER,
    FORMAT_NAME,
    MEMBER,
    MEMBER_DESCRIPTORS,
    PACK_BYTES,
    PACK_FORMAT_VERSION,
    PACK_ITEM_ALIGNMENT,
    PACK_MAGIC,
    TRAILER_PACK_PREFIX,
    StorageInfo,
    align_up,
)

__all__ = [
    "METADATA_TMP",
    "AlignedFile",
    "FsspecFiles",
    "Pack",
    "RecordingFileSystem",
    "aligned_empty",
    "lower_thread_priority",
    "member_start",
    "open_new_file",
    "region_bytes",
    "write_failure",
    "write_new_file",
]

METADATA_TMP = f"{DCP_METADATA_FILE}.tmp"

logger = logging.getLogger("resumekit")


class FsspecFiles(FileSystemBase):
    """DCP's ``FileSystemBase`` over an fsspec filesystem (``s3://``, ``memory://``, ...).

    What DCP's own fsspec storage does, on DCP's public extension point: give it to a
    ``FileSystemWriter`` or ``FileSystemReader`` as its ``fs`` and set its ``path`` to
    :meth:`init_path`'s answer.

    Attributes:
        fs: The fsspec filesystem (set by :meth:`init_path`).
    """

    def __init__(self) -> None:
        self.fs: Any = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        """Open ``path``; a write stream that fails is removed (fsspec has no rollback)."""
        where = os.fspath(path)
        with self.fs.open(where, mode) as stream:
            try:
                yield stream
            except BaseException:
                if any(flag in mode for flag in "w+a"):
                    with contextlib.suppress(Exception):  # secondary to the error raised
                        self.rm_file(where)
                raise

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        """``path/suffix``."""
        return os.path.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike[str], **options: Any) -> str | os.PathLike[str]:
        """Find the fsspec filesystem of ``path`` (``options``: credentials, endpoint)."""
        self.fs, _ = open_filesystem(os.fspath(path), options)
        return path

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Rename ``path`` to ``new_path``."""
        self.fs.rename(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Create the directory ``path`` and its parents (nothing if it exists)."""
        self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether fsspec knows the protocol of ``checkpoint_id`` (a URL, not a ``Path``)."""
        if isinstance(checkpoint_id, Path):
            return False
        try:
            url_to_fs(os.fspath(checkpoint_id))
        except ValueError:
            return False
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists."""
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        """Remove the file ``path``."""
        self.fs.rm(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        """The names under ``path``."""
        return cast(list[str], self.fs.ls(os.fspath(path), detail=False))


class _Recorded(NamedTuple):
    size: int
    checksum: str


class _HashingStream(io.RawIOBase):
    """A write stream that hashes and counts every byte on its way to ``inner``.

    Errors of the inner stream (a dropped connection, a refused part upload, a full disk)
    are raised as :class:`StorageError` naming the file, the original attached as cause.
    Anything else (``fileno``, ``tell``, ...) is the inner stream's.
    """

    def __init__(self, inner: Any, where: str) -> None:
        super().__init__()
        self._inner = inner
        self._where = where
        self.checksum = Checksum()
        self.size = 0

    def writable(self) -> bool:
        """Always: this is a write stream."""
        return True

    def write(self, data: Any) -> int:
        """Hash ``data``, then write all of it (returns its length)."""
        view = memoryview(data).cast("B")
        self.checksum.update(view)
        try:
            self._inner.write(view)
        except Exception as error:
            raise write_failure(self._where, error, "write") from error
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes written so far."""
        return self.size

    def flush(self) -> None:
        """Flush the inner stream (an upload of a full part, on object stores)."""
        if self.closed or getattr(self._inner, "closed", False):
            return
        try:
            self._inner.flush()
        except Exception as error:
            raise write_failure(self._where, error, "flush") from error

    def close(self) -> None:
        """Close the inner stream: the upload completes here on object stores."""
        if self.closed:
            return
        try:
            self._inner.close()
        except Exception as error:
            raise write_failure(self._where, error, "close") from error
        finally:
            super().close()

    def fileno(self) -> int:
        """The inner stream's descriptor (local files: DCP fsyncs ``.metadata``)."""
        return int(self._inner.fileno())

    def discard(self) -> None:
        """Drop what was written without completing it; log (not raise) a failure."""
        try:
            discard = getattr(self._inner, "discard", None)
            if callable(discard):  # fsspec buffered files: abort the multipart upload
                discard()
                with contextlib.suppress(AttributeError):  # never upload on collection
                    self._inner.closed = True
            else:
                self._inner.close()
        except Exception as error:  # noqa: BLE001 - secondary to the write error
            logger.warning("resumekit: could not discard the failed write of %s: %s: %s",
                           self._where, type(error).__name__, error)
        finally:
            super().close()


class RecordingFileSystem:
    """Wraps a DCP ``FileSystem``: write streams hashed and recorded by file name.

    Everything but ``create_stream`` is the wrapped object's. A stream whose writer fails
    is discarded (an object store then keeps no partial object) and the write's error is
    raised; the wrapped ``FileSystem``'s own cleanup, whose errors could replace it, is
    not used for writes.
    """

    def __init__(self, inner: Any, root: str) -> None:
        self._inner = inner
        self._root = root.rstrip("/")
        self.recorded: dict[str, _Recorded] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _name_of(self, path: str) -> str:
        prefix = self._root + "/"
        return path[len(prefix):] if path.startswith(prefix) else os.path.basename(path)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        """Open ``path``; a write stream is hashed and recorded once it closed cleanly."""
        if not any(flag in mode for flag in "wax+"):
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        where = os.fspath(path)
        fsspec_fs = getattr(self._inner, "fs", None)
        try:
            inner = (fsspec_fs.open(where, mode) if fsspec_fs is not None
                     else open(where, mode))  # noqa: SIM115 - closed by the stream below
        except Exception as error:
            raise write_failure(where, error, "open") from error
        stream = _HashingStream(inner, where)
        try:
            yield stream
            stream.close()
        except BaseException:
            stream.discard()
            self._remove_partial(where, fsspec_fs)
            raise
        with self._lock:
            self.recorded[self._name_of(where)] = _Recorded(stream.size,
                                                            stream.checksum.value())

    def _remove_partial(self, where: str, fsspec_fs: Any) -> None:
        try:
            if fsspec_fs is not None:
                if fsspec_fs.exists(where):
                    fsspec_fs.rm_file(where)
            elif os.path.lexists(where):
                os.unlink(where)
        except Exception as error:  # noqa: BLE001 - secondary: the staging area is swept
            logger.warning("resumekit: could not remove the partial file %s: %s: %s",
                           where, type(error).__name__, error)



def _free_space(path: str) -> str:
    """Free bytes on the filesystem holding ``path``, as a phrase for a message."""
    try:
        stats = os.statvfs(os.path.dirname(path) or ".")
    except (AttributeError, OSError):
        return "free space unknown"
    free = stats.f_bavail * stats.f_frsize
    return f"{_human(free)} free of {_human(stats.f_blocks * stats.f_frsize)}"


def _human(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"  # pragma: no cover - the loop always returns


def write_failure(where: str, error: BaseException, operation: str) -> StorageError:
    """A :class:`StorageError` naming the file and the cause; ``errno`` kept.

    A full disk (``ENOSPC``, ``EDQUOT``) or a file over the size limit (``EFBIG``) also
    names the free space left on the filesystem (local paths).
    """
    if isinstance(error, StorageError):
        return error
    code = getattr(error, "errno", None)
    detail = f"{type(error).__name__}: {error}"
    if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) and "://" not in where:
        reason = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file is too large "
                  "for the filesystem", errno.EDQUOT: "the disk quota is exhausted"}[code]
        detail = f"{reason} ({os.strerror(code)}; {_free_space(where)}) [errno {code}]"
    failure = StorageError(f"cannot {operation} {where}: {detail}", path=where,
                           file=os.path.basename(where), operation=operation, errno=code)
    failure.strerror = os.strerror(code) if isinstance(code, int) else None
    failure.filename = where
    return failure



def write_new_file(path: str, data: bytes, *, sync: bool) -> None:
    """Create ``path`` (never an existing file: ``O_EXCL``), write ``data``, fsync if asked.

    Raises:
        StorageError: It could not be written (naming it; a full disk also names the free
            space).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        raise write_failure(path, error, "write") from error



def member_start(used: int) -> int:
    """Where a packed region's next member starts when ``used`` bytes of it are taken."""
    return -(-used // PACK_ITEM_ALIGNMENT) * PACK_ITEM_ALIGNMENT


def region_bytes(used: int, members: int) -> int:
    """The bytes a packed region takes in its file.

    ``members`` members ending at ``used``, then their table and its footer, padded to the
    next ``ALIGNMENT`` boundary: the one rule :class:`Pack` writes by and a part's size is
    planned by.
    """
    return align_up(used + members * MEMBER.size + FOOTER.size)


class Pack:
    """Small items gathered into one region of a data file, written and hashed as one.

    Items below :data:`PACK_ITEM_BYTES` lie back to back (each on a
    :data:`PACK_ITEM_ALIGNMENT` boundary) in a region of at most :data:`PACK_BYTES`,
    written with one system call and covered, padding included, by one checksum. The
    region's first member starts the region and records its descriptor
    (``resumekit-raw/6;<region length>``, its checksum in its file's trailer; written
    before ``schema_version`` 4: ``resumekit-raw/3;<region length>;<checksum file>``);
    the others record
    :data:`MEMBER_DESCRIPTORS` (no content: DCP's stock reader refuses them by name) and
    belong to the region of their file that holds their offset
    (:class:`FileLayout`). The region ends with a table of its members (offset, length
    and XXH3-128 of each, then their count and a magic number), read only when the
    region's checksum fails, to name the damaged member. Each member's dtype and shape
    are DCP's own metadata entry's: the metadata holds nothing per small item beyond what
    DCP's own format does.
    """

    def __init__(self, name: str, sidecar: str | None = None) -> None:
        self.name = name
        self.sidecar = sidecar
        self.regions: list[tuple[int, int, str]] = []  # (offset, length, hex) written
        self.buffer = bytearray(PACK_BYTES)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.used = 0
        self.members: list[tuple[WriteItem, int, int]] = []  # item, offset, length

    def fits(self, length: int) -> bool:
        """Whether ``length`` more bytes (and their member row) fit in this region."""
        return region_bytes(member_start(self.used) + length,
                            len(self.members) + 1) <= PACK_BYTES

    def add(self, item: WriteItem, view: memoryview) -> None:
        """Copy ``view``, the bytes of ``item``, into the region at its next aligned offset."""
        start = member_start(self.used)
        self.buffer[self.used:start] = bytes(start - self.used)
        self.buffer[start:start + len(view)] = view
        self.used = start + len(view)
        self.members.append((item, start, len(view)))

    def add_from(self, item: WriteItem, address: int, length: int) -> None:
        """Add ``length`` bytes at ``address`` in memory (a contiguous CPU tensor's)."""
        start = member_start(self.used)
        self.buffer[self.used:start] = bytes(start - self.used)
        if length:
            ctypes.memmove(self.address + start, address, length)
        self.used = start + length
        self.members.append((item, start, length))

    def flush(self, handle: AlignedFile) -> list[WriteResult]:
        """Write the region (padded to the next boundary); one result per member."""
        if not self.members:
            return []
        base, descriptor = self._write_region(handle)
        results = [WriteResult(index=item.index, size_in_bytes=length,
                               storage_data=StorageInfo(
                                   self.name, base + start, length,
                                   transform_descriptors=MEMBER_DESCRIPTORS
                                   if number else [descriptor]))
                   for number, (item, start, length) in enumerate(self.members)]
        self.members, self.used = [], 0
        return results

    def _write_region(self, handle: AlignedFile) -> tuple[int, str]:
        """Write the members, the table and the footer; the region's offset, descriptor."""
        buffer = memoryview(self.buffer)
        # Members, zeros, then the table and its footer, ending on an ALIGNMENT boundary:
        # the region's checksum covers every byte of it, padding included.
        table = len(self.members) * MEMBER.size + FOOTER.size
        at = region_bytes(self.used, len(self.members)) - table
        self.buffer[self.used:at] = bytes(at - self.used)
        for _, start, length in self.members:  # the table that names a damaged member
            MEMBER.pack_into(self.buffer, at, start, length,
                              xxhash.xxh3_128_digest(buffer[start:start + length]))
            at += MEMBER.size
        FOOTER.pack_into(self.buffer, at, len(self.members), PACK_MAGIC)
        region = buffer[:at + FOOTER.size]
        base = handle.offset
        descriptor = (f"{TRAILER_PACK_PREFIX}{len(region)}" if self.sidecar is None else
                      f"{FORMAT_NAME}/{PACK_FORMAT_VERSION};{len(region)};{self.sidecar}")
        self.regions.append((base, len(region), hex_digest(region)))
        handle.write(region, None)
        handle.pad()
        return base, descriptor



HASH_PIECE = 512 << 10
"""Bytes copied and hashed at a time by :meth:`AlignedFile.write`: the piece stays in the
core's cache between its copy into the bounce buffer and its two hashes, so each byte is
read from memory once (hashing 4 MB chunks after copying them read them three times)."""


class _WriteBehind:
    """The one owner of an :class:`AlignedFile`'s write-behind thread.

    One thread writes what it is given, in the order given, while the file's writer
    copies and hashes the next piece into its other bounce buffer. A write's error is
    kept and raised to the owner by its next :meth:`wait` for that write or a later one
    (or by :meth:`close`); the writes queued behind a failed one are skipped, as a
    synchronous writer would never have issued them. :meth:`close` waits for every write
    and ends the thread, whatever happened.

    Args:
        write: Writes ``data`` at file offset ``at`` (all of it, or raises).
    """

    def __init__(self, write: Callable[[memoryview, int], None]) -> None:
        self._write = write
        # Created by the file's writer thread, so the thread inherits its CPU priority
        # (a background save's writers run at idle priority).
        self._pool = ThreadPoolExecutor(max_workers=1,
                                        thread_name_prefix="resumekit-write-behind")
        self._queue: deque[Future[None]] = deque()  # submitted, not yet waited for
        self._failed = False  # read and set on the write-behind thread only

    def submit(self, data: memoryview, at: int) -> Future[None]:
        """Queue the write of ``data`` at ``at``; ``data`` must stay unchanged until then."""
        future = self._pool.submit(self._run, data, at)
        self._queue.append(future)
        return future

    def _run(self, data: memoryview, at: int) -> None:
        if self._failed:
            return
        try:
            self._write(data, at)
        except BaseException:
            self._failed = True
            raise

    def wait(self, future: Future[None] | None = None) -> None:
        """Block until ``future``'s write and every earlier one are done (all if None).

        Raises:
            BaseException: The first of those writes that failed, as it was raised.
        """
        if future is not None and future not in self._queue:  # waited for already
            future.result()
            return
        while self._queue:
            head = self._queue.popleft()
            head.result()
            if head is future:
                return

    def close(self) -> None:
        """Wait for every queued write and end the thread; raise a write's error."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class AlignedFile:
    """A new file written with ``O_DIRECT`` where the filesystem allows it.

    Direct I/O skips the page cache: no kernel copy of every byte and no dirty pages for
    writeback to flush while training runs. It needs ``ALIGNMENT``-aligned memory, file
    offsets and lengths: aligned sources (the CPU staging buffers of async saves) are
    written as they are, anything else is copied through an aligned bounce buffer (with
    ``ctypes.memmove``, which releases the GIL), and each item is padded with zeros to
    the next boundary. Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and
    FUSE filesystems) the same bytes are written through the page cache. The file's
    running checksum covers the padding too.

    Bytes copied through a bounce buffer are written behind: from the second such piece
    on, the piece's ``pwrite`` runs on the file's write-behind thread (:class:`_WriteBehind`)
    while the caller copies and hashes the next piece into the other of two bounce
    buffers, so that copy and hash do not wait for the disk nor the disk for them. Every
    other write waits for those first, and the writes land in the order made. A write's
    error is raised by a later :meth:`write` or :meth:`pad`, or on leaving the ``with``
    block, which waits for every write and ends the thread whatever happened.
    """

    def __init__(self, path: str, *, shared: tuple[int, bool] | None = None,
                 start: int = 0) -> None:
        self.path = path
        self.owner = shared is None
        if shared is None:
            self.fd, self.direct = open_new_file(path)
        else:
            self.fd, self.direct = shared
        self.offset = start
        self.checksum = Checksum()
        self._bounces: list[mmap.mmap] = []  # at most two, allocated as first needed
        self._turn = 0  # the bounce buffer the next piece goes into
        self._in_flight: list[Future[None] | None] = [None, None]  # per bounce buffer
        self._behind: _WriteBehind | None = None
        self._bounced = False

    @property
    def bounced(self) -> bool:
        """Whether any bytes went through a bounce buffer (direct I/O of unaligned data)."""
        return self._bounced

    def __enter__(self) -> AlignedFile:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        failure: BaseException | None = None
        behind, self._behind = self._behind, None
        if behind is not None:
            try:
                behind.close()  # every write done, the thread ended: then the file closes
            except BaseException as error:  # noqa: BLE001 - raised below, or secondary
                if exc_type is None:
                    failure = error
                else:
                    logger.warning("resumekit: a write behind to %s failed too: %s: %s",
                                   self.path, type(error).__name__, error)
        self._in_flight = [None, None]
        try:
            if self.owner:
                os.close(self.fd)
        except OSError as error:
            if exc_type is None and failure is None:
                failure = error
            else:
                # Secondary: the error being raised already says why the file is unusable.
                logger.warning("resumekit: closing %s after a failed write failed too: %s",
                               self.path, error)
        for bounce in self._bounces:
            # A view of it may still be alive (in the traceback of a failed write): then
            # the mapping goes away with the last view, not here.
            with contextlib.suppress(BufferError):
                bounce.close()
        self._bounces = []
        if failure is not None:
            raise failure

    def write(self, chunk: memoryview, address: int | None, *,
              block: int | None = None) -> list[str]:
        """Append ``chunk`` (at ``address`` in memory when known); pads nothing.

        Each byte is read from memory once: every piece of at most :data:`HASH_PIECE`
        bytes is copied into the aligned bounce buffer (when direct I/O needs the copy)
        and hashed there, for the file's checksum and its block's, while it is in cache.
        Bounced bytes may still be on their way to the file on return (see the class).

        Args:
            chunk: The bytes, at most :data:`CHUNK_BYTES` when ``block`` is given.
            address: Where ``chunk`` starts in memory, if known.
            block: Also return the bare XXH3-128 hex digest of each ``block`` bytes of
                ``chunk`` (the last one may be shorter).

        Returns:
            The block digests, in order (empty without ``block``).

        Raises:
            OSError: This write, or an earlier one written behind, failed.
        """
        if block is not None and len(chunk) > CHUNK_BYTES:
            raise ValueError(f"a chunk hashed per block holds at most {CHUNK_BYTES} bytes, "
                             f"not {len(chunk)}")
        aligned = (address is not None and address % ALIGNMENT == 0
                   and len(chunk) % ALIGNMENT == 0 and self.offset % ALIGNMENT == 0)
        if not self.direct or aligned:
            digests = self._hash(chunk, block)
            self._write_now(chunk)
            return digests
        digests = []
        for start in range(0, len(chunk), CHUNK_BYTES):
            piece = chunk[start:start + CHUNK_BYTES]
            number, target = self._free_bounce()
            if address is None:
                target[:len(piece)] = piece
                digests += self._hash(target[:len(piece)], block)
            else:
                digests += self._hash(target[:len(piece)], block,
                                      copy_from=address + start)
            padded = -(-len(piece) // ALIGNMENT) * ALIGNMENT
            target[len(piece):padded] = bytes(padded - len(piece))
            # The zeros past the piece are overwritten by the next write or kept as the
            # item's padding (pad() then only moves the offset).
            self._write_bounced(number, target[:padded])
            self.offset += len(piece)
        return digests

    def _hash(self, data: memoryview, block: int | None, *,
              copy_from: int | None = None) -> list[str]:
        """Hash ``data`` into the file's checksum (and each ``block``'s digest) by pieces.

        With ``copy_from`` (an address in memory) each piece is first copied into ``data``.
        """
        digests: list[str] = []
        step = block or len(data) or 1
        target = _address_of_view(data) if copy_from is not None else 0
        for first in range(0, len(data), step):
            end = min(first + step, len(data))
            hasher = xxhash.xxh3_128() if block else None
            for at in range(first, end, HASH_PIECE):
                piece = data[at:min(at + HASH_PIECE, end)]
                if copy_from is not None:
                    ctypes.memmove(target + at, copy_from + at, len(piece))
                self.checksum.update(piece)
                if hasher is not None:
                    hasher.update(piece)
            if hasher is not None:
                digests.append(hasher.hexdigest())
        return digests

    def pad(self) -> None:
        """Zero-fill up to the next ``ALIGNMENT`` boundary."""
        missing = (-self.offset) % ALIGNMENT
        if not missing:
            return
        zeros = bytes(missing)
        self.checksum.update(zeros)
        if self.direct:  # the bounce write already put these zeros on disk
            self.offset += missing
            return
        self._write_now(memoryview(zeros))

    def _free_bounce(self) -> tuple[int, memoryview]:
        """The next bounce buffer, once the write behind of its previous piece is done."""
        number, self._turn = self._turn, 1 - self._turn
        if len(self._bounces) <= number:
            self._bounces.append(mmap.mmap(-1, CHUNK_BYTES))  # anonymous: page-aligned
        pending, self._in_flight[number] = self._in_flight[number], None
        if pending is not None and self._behind is not None:
            self._behind.wait(pending)
        return number, memoryview(self._bounces[number])

    def _write_bounced(self, number: int, data: memoryview) -> None:
        """Write ``data`` (in bounce buffer ``number``) at the offset: behind, but the first."""
        if not self._bounced:  # one piece (the common small file): no thread to start
            self._bounced = True
            self._write_at(data, self.offset)
            return
        if self._behind is None:
            self._behind = _WriteBehind(self._write_at)
        try:
            self._in_flight[number] = self._behind.submit(data, self.offset)
        except RuntimeError:  # no new work once the interpreter shuts down (a save in
            self._drain()  # an atexit handler): written here, after the earlier ones
            self._write_at(data, self.offset)

    def _write_now(self, data: memoryview) -> None:
        """Write ``data`` at the offset after every write behind; move the offset past it."""
        self._drain()
        self._write_at(data, self.offset)
        self.offset += len(data)

    def _drain(self) -> None:
        """Wait for every write behind (raising the first that failed)."""
        if self._behind is not None:
            self._in_flight = [None, None]
            self._behind.wait()

    def _write_at(self, data: memoryview, at: int) -> None:
        """Write all of ``data`` at file offset ``at`` (any thread)."""
        while data:
            try:
                count = os.pwrite(self.fd, data, at)
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
            at += count


def open_new_file(path: str) -> tuple[int, bool]:
    """Create ``path`` (never an existing file), with ``O_DIRECT`` where allowed.

    Returns:
        Its descriptor and whether it is open for direct I/O.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _address_of(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _address_of_view(view: memoryview) -> int:
    """The address of a writable view's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


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



def restore_lowered_priorities(pid: int) -> int:
    """Put every thread of process ``pid`` that runs at idle priority back to normal.

    A background save's writer threads run at ``SCHED_IDLE`` (or nice 19) so training
    keeps its cores; once training *waits* for that save (an agreed preemption, ``wait()``,
    ``finish()``, the next save), an idle-priority writer on a CPU-busy host is starved
    for nothing (58-104 s for a 1 GB commit in issue 38). Best effort: a thread that
    ended, or a nice value this process may not lower, is left as it is. Linux only
    (elsewhere: 0).

    Returns:
        The threads raised.
    """
    try:
        tids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    raised = 0
    for tid in tids:
        with contextlib.suppress(AttributeError, OSError):
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                raised += 1
                continue
        with contextlib.suppress(AttributeError, OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) == _IDLE_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                raised += 1
    return raised


_IDLE_NICE = 19


def lower_thread_priority() -> None:
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
        os.setpriority(os.PRIO_PROCESS, native, _IDLE_NICE)

