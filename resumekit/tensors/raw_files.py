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
* :class:`CheckedDcpWriter` (fsspec URLs: ``s3://``, ``memory://``, ...) writes DCP's own
  format through DCP's own code, one file per thread, but gives it the raw writer's
  guarantees: an error on any writer thread fails the save (DCP's threads drop theirs), every
  stream is hashed on its way out, and a failed upload is discarded, not completed by the
  stream's close, so the error raised is the write's, naming the file.
* Both writers report every file they wrote, ``.metadata`` included, with its size and
  checksum, and the ``.metadata`` entry names every data file the metadata references
  (:attr:`WrittenFile.references`), after checking that each item of the plan has stored
  data: the commit store cross-checks the ranks' reports against it.
* :class:`RawTensorReading` (mixed into DCP's readers) reads only the bytes a rank needs.
  When the piece of a stored tensor that a destination wants is one byte range (always for
  an unchanged world size, and for FSDP's dim-0 shards when resharding), it is read
  straight into the destination (``readinto``, no intermediate tensor); otherwise the
  stored tensor is read into one buffer that is narrowed and copied, the way DCP does.
  With ``verify`` every block a read touches is checked against the checksum recorded
  when it was written; a mismatch is a :class:`~resumekit.errors.CorruptCheckpointError`
  naming the file, the key and the offset. Items in DCP's own format (checkpoints of
  earlier versions, fsspec URLs) go to DCP's reader unchanged.

Format: an item of :data:`PACK_ITEM_BYTES` or more is stored alone, and its
``_StorageInfo.transform_descriptors`` is one string
``"resumekit-raw/1;<dtype>;<shape>;<block bytes>;xxh3_128:<hex>,<hex>,..."``: one checksum
per block of the item (:func:`block_bytes_for`: about a sixteenth of it, 64 KiB to 4 MiB),
so a reader that needs a slice verifies it without reading much more (``bytes`` and an
empty shape for non-tensor values). Smaller items share packed regions of at most
:data:`PACK_BYTES` (:class:`_Pack`): one write and one checksum per region, whose first
member records ``"resumekit-raw/3;<region length>;<checksum file>"`` and the others
``"resumekit-raw/member"`` (:data:`MEMBER_DESCRIPTORS`: nothing of their own; written
since issue 29, members written before record nothing); their dtype and shape are DCP's
metadata entries. The
region's checksum is in the rank's checksum file (``__<rank>_checksums.json``, listed in
the manifest, checked against it before use), so ``.metadata`` holds no checksum of a
packed region and its bytes depend only on the state's structure. Checkpoints written
before that (format 2: ``"resumekit-raw/2;<region length>;xxh3_128:<hex>"``) and before
packing (every item in format 1) still load. DCP's stock reader
stops at the first item it reads with ``ValueError: Unknown extension
name='resumekit-raw'`` instead of misreading it (every item is described); stock DCP
reads these checkpoints through :class:`resumekit.StorageReader` (``dcp.load(...,
storage_reader=resumekit.StorageReader(step_dir))``), and
``CheckpointManager(..., tensor_format="dcp")`` writes DCP's own format instead.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import io
import json
import logging
import math
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, NamedTuple, TypeVar, cast

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
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

from resumekit.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnreadableFormatError,
)
from resumekit.store.layout import DCP_METADATA_FILE, raw_checksums_file
from resumekit.store.manifest import CHECKSUM_ALGORITHM, Checksum, checksum_chunks, hex_digest
from resumekit.store.retry import read_with_retry
from resumekit.store.storage import parse_json

__all__ = [
    "ALIGNMENT",
    "CHUNK_BYTES",
    "FORMAT_NAME",
    "MEMBER_DESCRIPTORS",
    "CheckedDcpWriter",
    "RawTensorReading",
    "RawTensorWriter",
    "WrittenFile",
    "aligned_empty",
    "block_bytes_for",
    "checksum_files",
    "decode_checksums",
    "encode_checksums",
    "hex_digest",
    "is_described_pack",
    "is_packed_member",
    "is_raw",
    "publish_metadata",
    "raw_files",
    "refuse_existing_checkpoint",
    "write_checksums",
    "write_new_file",
    "written_metadata",
]

FORMAT_NAME = "resumekit-raw"
FORMAT_VERSION = 1
"""The descriptor of an item stored alone, with its own blocks (every version reads it)."""
PACK_FORMAT_VERSION = 3
"""The descriptor of the first item of a pack of small items (:class:`_Pack`), as written
now: ``resumekit-raw/3;<region length>;<checksum file>``, the region's checksum kept in
that rank's small checksum file (:func:`resumekit.store.layout.raw_checksums_file`), so the
``.metadata`` of an unchanged structure is the same bytes at every save."""
INLINE_PACK_FORMAT_VERSION = 2
"""Packs written before version 3: the region's checksum inside its descriptor
(``resumekit-raw/2;<region length>;xxh3_128:<hex>``); still read."""
MEMBER_DESCRIPTORS: tuple[str] = (f"{FORMAT_NAME}/member",)
"""The descriptors of a packed region's members after its first (written since issue 29):
no content of their own (the member lies in the region of its file that holds its
offset), but DCP's stock reader, whatever item of a file it reads first, stops at
``Unknown extension name='resumekit-raw'`` instead of ``torch.load``-ing raw bytes. One
shared tuple, so the pickled ``.metadata`` refers back to it per item. Members written
before carry none (:func:`is_packed_member`); both are read."""
CHECKSUMS_FORMAT = "resumekit-raw-checksums/1"
"""The ``format`` of a checksum file: ``{"format": ..., "regions": {data file: [[offset,
length, hex XXH3-128], ...]}}``."""
CHUNK_BYTES = 4 << 20
"""The largest checksummed block, hashed and written per system call: small enough to stay
in cache between the hash and the copy into the page cache, large enough to keep system
calls rare."""
ALIGNMENT = 4096
"""Items start on this boundary in a data file, and direct I/O moves whole multiples of it."""
MIN_BLOCK_BYTES = 64 << 10
#: A rank's files of fewer tensor bytes than this are written one after another on the
#: saving thread: starting and joining threads costs more than such writes gain from them.
SMALL_SAVE_BYTES = 16 << 20
"""The smallest checksummed block (items below it are one block)."""
PACK_ITEM_BYTES = MIN_BLOCK_BYTES
"""Items smaller than this share a packed, singly checksummed region with their neighbours."""
PACK_BYTES = 1 << 20
"""The largest packed region: what a reader of one small item reads and hashes at most."""
PACK_ITEM_ALIGNMENT = 16
"""Members of a pack start on this boundary inside it."""
_MEMBER = struct.Struct("<II16s")  # a packed member: offset in its region, length, XXH3-128
_FOOTER = struct.Struct("<II")  # member count, magic
_PACK_MAGIC = 0x31504B52  # "RKP1"
DATA_SUFFIX = ".distcp"
_METADATA_TMP = f"{DCP_METADATA_FILE}.tmp"

logger = logging.getLogger("resumekit")


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
        references: For ``.metadata``: every data file its items point to (the files
            the checkpoint cannot load without). Empty for data files.
    """

    name: str
    size: int
    checksum: str
    references: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    dtype: torch.dtype | None  # None: a non-tensor value (DCP's BYTE_IO)
    shape: tuple[int, ...]
    block_bytes: int
    blocks: tuple[str, ...]  # hex XXH3-128 of each block_bytes slice of the item
    # A packed item (format 2): (file offset, length) of the region holding it, which is
    # its one block; None for an item stored alone, whose blocks start at the item.
    region: tuple[int, int] | None = None

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
            raise UnreadableFormatError(
                f"{where}: unreadable storage descriptor {text[:120]!r} ({error})",
                path=where, file=where,
            ) from None
        return cls(dtype, shape, block_bytes, blocks)

    @staticmethod
    def decode_region(text: str, offset: int, *, where: str) -> tuple[int, int, str]:
        """``(offset, length, hex checksum)`` of a packed region.

        Args:
            text: The descriptor its first member records.
            offset: That member's offset: where the region starts.
            where: The file, for the error.
        """
        try:
            head, length_text, checksum = text.split(";")
            if head != f"{FORMAT_NAME}/{INLINE_PACK_FORMAT_VERSION}":
                raise ValueError(f"unknown format {head!r}")
            length = int(length_text)
            if length < 0:
                raise ValueError(f"region length {length}")
            algorithm, _, digest = checksum.partition(":")
            if algorithm != CHECKSUM_ALGORITHM or not digest:
                raise ValueError(f"unknown checksum {algorithm!r}")
        except ValueError as error:
            raise UnreadableFormatError(
                f"{where}: unreadable storage descriptor {text[:120]!r} ({error})",
                path=where, file=where,
            ) from None
        return offset, length, digest

    @staticmethod
    def decode_sidecar_region(text: str, *, where: str) -> tuple[int, str]:
        """``(length, checksum file)`` of a packed region of format 3."""
        try:
            head, length_text, sidecar = text.split(";")
            if head != f"{FORMAT_NAME}/{PACK_FORMAT_VERSION}":
                raise ValueError(f"unknown format {head!r}")
            length = int(length_text)
            if length < 0:
                raise ValueError(f"region length {length}")
            if not sidecar or "/" in sidecar or sidecar.startswith("."):
                raise ValueError(f"checksum file {sidecar!r}")
        except ValueError as error:
            raise UnreadableFormatError(
                f"{where}: unreadable storage descriptor {text[:120]!r} ({error})",
                path=where, file=where,
            ) from None
        return length, sidecar


_PACK_PREFIX = f"{FORMAT_NAME}/{PACK_FORMAT_VERSION};"
_INLINE_PACK_PREFIX = f"{FORMAT_NAME}/{INLINE_PACK_FORMAT_VERSION};"


def is_raw(info: _StorageInfo) -> bool:
    """Whether a stored item carries a descriptor of :class:`RawTensorWriter`.

    The members of a packed region after its first carry :data:`MEMBER_DESCRIPTORS`, or
    none in checkpoints written before it: which files are raw tensor files is
    :func:`raw_files`'s answer.
    """
    descriptors = info.transform_descriptors or ()
    return len(descriptors) == 1 and descriptors[0].startswith(f"{FORMAT_NAME}/")


def raw_files(storage_data: Mapping[Any, _StorageInfo]) -> set[str]:
    """The data files written by :class:`RawTensorWriter` (every item of such a file is raw).

    A file is raw when any of its items carries a raw descriptor: the writer of a file
    writes every item of it, and DCP's own writer records no resumekit descriptor.
    """
    return {info.relative_path for info in storage_data.values() if is_raw(info)}


def is_packed_member(descriptors: Sequence[str] | None) -> bool:
    """Whether ``descriptors`` are those of a packed region's member after its first.

    That is :data:`MEMBER_DESCRIPTORS`, or none at all (written before it; in a raw file,
    see :func:`raw_files`).
    """
    return not descriptors or tuple(descriptors) == MEMBER_DESCRIPTORS


def is_described_pack(descriptors: Sequence[str]) -> bool:
    """Whether ``descriptors`` are those of a format-3 region's first member."""
    return len(descriptors) == 1 and descriptors[0].startswith(_PACK_PREFIX)


def checksum_files(storage_data: Mapping[Any, _StorageInfo]) -> set[str]:
    """The checksum files (format 3) the packed regions of ``storage_data`` name."""
    found: set[str] = set()
    for info in storage_data.values():
        descriptors = info.transform_descriptors
        if descriptors and len(descriptors) == 1 and descriptors[0].startswith(_PACK_PREFIX):
            found.add(descriptors[0].rsplit(";", 1)[1])
    return found


class _FileLayout:
    """Where the raw items of one checkpoint lie: raw files, packed regions by file.

    Args:
        storage_data: The metadata's ``storage_data``.
        where: The path of an item's file, for errors.
        checksums: ``checksums(checksum file)`` gives ``{(data file, offset): (length,
            hex)}`` of the regions a checksum file (format 3) lists; None: not verified
            (the regions' checksums are then empty).
    """

    def __init__(self, storage_data: Mapping[Any, _StorageInfo], where: Any,
                 checksums: Any = None) -> None:
        self.raw: set[str] = set()
        regions: dict[str, list[tuple[int, int, str]]] = {}
        for info in storage_data.values():
            if not is_raw(info):
                continue
            self.raw.add(info.relative_path)
            text = cast(Sequence[str], info.transform_descriptors)[0]
            if text.startswith(_PACK_PREFIX):
                length, sidecar = _Descriptor.decode_sidecar_region(text, where=where(info))
                digest = ""
                if checksums is not None:
                    listed = checksums(sidecar).get((info.relative_path, info.offset))
                    if listed is None or listed[0] != length:
                        place = where(info)
                        raise CorruptCheckpointError(
                            f"{place}: the packed region at offset {info.offset} "
                            f"({length} bytes) is not listed with that length in its "
                            f"checksum file {sidecar}", path=place, file=place)
                    digest = listed[1]
                regions.setdefault(info.relative_path, []).append(
                    (info.offset, length, digest))
            elif text.startswith(_INLINE_PACK_PREFIX):
                regions.setdefault(info.relative_path, []).append(
                    _Descriptor.decode_region(text, info.offset, where=where(info)))
        self.regions = {name: sorted(found) for name, found in regions.items()}
        self.starts = {name: [region[0] for region in found]
                       for name, found in self.regions.items()}

    def region_of(self, info: _StorageInfo) -> tuple[int, int, str] | None:
        """The packed region of the file holding ``info``'s first byte, if any."""
        starts = self.starts.get(info.relative_path)
        if not starts:
            return None
        number = bisect.bisect_right(starts, info.offset) - 1
        if number < 0:
            return None
        region = self.regions[info.relative_path][number]
        return region if info.offset < region[0] + max(region[1], 1) else None


def check_listed_checksum(listed: Mapping[str, str] | None, name: str, data: bytes,
                          where: str) -> None:
    """With a manifest's ``{file: checksum}``, ``data`` (file ``name``) must match its entry.

    Raises:
        CorruptCheckpointError: Not listed, or another checksum.
    """
    if listed is None:
        return
    expected = listed.get(name)
    if expected is None:
        raise CorruptCheckpointError(
            f"{where} is not listed in the checkpoint's manifest, so it cannot be verified",
            path=where, file=where)
    actual = checksum_chunks([data])
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where} does not match its checksum in the manifest (expected {expected}, "
            f"got {actual})", path=where, file=where)


def encode_checksums(regions: Mapping[str, Sequence[tuple[int, int, str]]]) -> bytes:
    """The bytes of a checksum file listing ``{data file: [(offset, length, hex)]}``."""
    body = {"format": CHECKSUMS_FORMAT,
            "regions": {name: [list(region) for region in found]
                        for name, found in sorted(regions.items())}}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_checksums(data: bytes, *, where: str) -> dict[tuple[str, int], tuple[int, str]]:
    """Parse a checksum file: ``{(data file, offset): (length, hex)}``.

    Raises:
        UnreadableFormatError: Not a checksum file of a known format (naming it).
    """
    try:
        body = parse_json(data, source=where)
        if not isinstance(body, dict) or body.get("format") != CHECKSUMS_FORMAT:
            found = body.get("format") if isinstance(body, dict) else None
            raise ValueError(f"unknown format {found!r}")
        parsed: dict[tuple[str, int], tuple[int, str]] = {}
        for name, found in body["regions"].items():
            for offset, length, digest in found:
                if not (isinstance(offset, int) and isinstance(length, int)
                        and isinstance(digest, str)):
                    raise ValueError(f"bad entry {[offset, length, digest]!r}")
                parsed[(str(name), offset)] = (length, digest)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnreadableFormatError(
            f"{where}: unreadable checksum file ({error})", path=where, file=where,
        ) from None
    return parsed


# ------------------------------------------------------------------------------- writing


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
            raise _write_failure(self._where, error, "write") from error
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
            raise _write_failure(self._where, error, "flush") from error

    def close(self) -> None:
        """Close the inner stream: the upload completes here on object stores."""
        if self.closed:
            return
        try:
            self._inner.close()
        except Exception as error:
            raise _write_failure(self._where, error, "close") from error
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


class _RecordingFileSystem:
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
            raise _write_failure(where, error, "open") from error
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


class _ReportingWriter:
    """Mixin for a DCP writer: every file it writes reported, the metadata checked.

    Mix it in before DCP's writer class and call :meth:`_start_reporting` after that
    class's ``__init__``.
    """

    fs: Any
    path: Any
    written: list[WrittenFile]
    last_metadata: Metadata | None = None
    """The ``Metadata`` the last :meth:`finish` wrote (coordinating rank)."""
    last_jobs: list[tuple[str, list[WriteItem]]] | None = None
    """The files the last ``write_data`` wrote, each with its items in file order."""
    last_prefix: str | None = None
    """The file-name prefix DCP's final plan gave the last ``write_data`` (raw writer)."""
    last_results: list[WriteResult] | None = None
    """What the last ``write_data`` stored for each of its items (raw writer)."""

    def _start_reporting(self) -> None:
        self.written = []
        self.fs = _RecordingFileSystem(self.fs, os.fspath(self.path))

    def _record(self, name: str, size: int, checksum: str) -> None:
        self.written.append(WrittenFile(name, size, checksum))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Check every item has stored data, write ``.metadata``, report it.

        Raises:
            StorageError: An item of the plan has no stored data (a writer lost it
                without raising); nothing is written.
        """
        where = os.fspath(self.path)
        _check_every_item_stored(metadata, results, where)
        super().finish(metadata, results)  # type: ignore[misc]
        self.last_metadata = metadata
        recorder = cast(_RecordingFileSystem, self.fs)
        with recorder._lock:
            temporary = [name for name in recorder.recorded if name.endswith(_METADATA_TMP)]
            recorded = [(name, recorder.recorded.pop(name)) for name in temporary]
        references = tuple(sorted(
            {result.storage_data.relative_path for part in results for result in part}
            | checksum_files({id(result): result.storage_data
                              for part in results for result in part})))
        for name, entry in recorded:
            self.written.append(WrittenFile(name.removesuffix(".tmp"), entry.size,
                                            entry.checksum, references))


def _check_every_item_stored(metadata: Metadata, results: Sequence[Sequence[WriteResult]],
                             where: str) -> None:
    stored = {result.index for part in results for result in part}
    missing: list[str] = []
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            wanted = [MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]
        elif isinstance(entry, BytesStorageMetadata):
            wanted = [MetadataIndex(fqn)]
        else:
            continue
        missing.extend(f"{fqn}{list(index.offset or [])}" for index in wanted
                       if index not in stored)
    if missing:
        raise StorageError(
            f"writing checkpoint {where} lost {len(missing)} item(s) without an error "
            f"(first: {', '.join(missing[:3])}); nothing was written as .metadata",
            path=where, operation="save", file=DCP_METADATA_FILE,
        )


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


def _write_failure(where: str, error: BaseException, operation: str) -> StorageError:
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


class CheckedDcpWriter(_ReportingWriter, FsspecWriter):
    """DCP's own file format for any fsspec URL, with the raw writer's guarantees.

    DCP's ``FsspecWriter`` loses the errors of its extra writer threads (the save goes on,
    a shard short) and cleans up a failed stream by closing it, which on an object store
    completes the upload or raises a second error in place of the first. This writer runs
    each file on its own pool thread and re-raises every thread's error, hashes each
    stream on its way out (:attr:`written`, ``.metadata`` included) and discards a failed
    upload. The bytes are exactly DCP's: stock readers load the result.

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
                         thread_count=1, overwrite=False, **dict(storage_options or {}))
        self.file_count = thread_count  # DCP's own threads stay off: ours report errors
        self._start_reporting()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items, one file per thread; raise if any thread failed."""
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        buckets = [bucket for bucket in _balance(plan.items, self.file_count) if bucket]
        self.written = []
        results: list[WriteResult] = []
        outcomes = run_writer_threads([
            functools.partial(self._write_one, f"{prefix}{number}{DATA_SUFFIX}", bucket,
                              planner) for number, bucket in enumerate(buckets)])
        recorder = cast(_RecordingFileSystem, self.fs)
        for outcome in outcomes:
            results.extend(outcome)
        for name in sorted({cast(_StorageInfo, r.storage_data).relative_path
                            for r in results}):
            entry = recorder.recorded[name]
            self._record(name, entry.size, entry.checksum)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_one(self, name: str, items: list[WriteItem], planner: SavePlanner
                   ) -> list[WriteResult]:
        files: queue.Queue[tuple[Any, str, list[WriteItem]]] = queue.Queue()
        files.put((self.fs.concat_path(self.path, name), name, items))
        # DCP's single-thread path: runs on this thread, so its errors reach us.
        return super()._write_data(planner, files).wait()


class RawTensorWriter(_ReportingWriter, FileSystemWriter):
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
        """The files this rank wrote in the last save, with checksums (``.metadata`` too,
        on the coordinating rank)."""
        self._start_reporting()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items, one file per thread; raise if any thread failed.

        Raises:
            StorageError: A file could not be written (naming it; a full disk also names
                the free space). Every thread has stopped by then.
        """
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        buckets = [bucket for bucket in _balance(plan.items, self.thread_count) if bucket]
        jobs = [
            (f"{prefix}{number}{DATA_SUFFIX}",
             [(item, planner.resolve_data(item)) for item in bucket])
            for number, bucket in enumerate(buckets)
        ]
        results = self.write_jobs(jobs, prefix)
        self.last_jobs = [(name, [item for item, _ in items]) for name, items in jobs]
        self.last_prefix = prefix
        self.last_results = results
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def write_jobs(self, jobs: Sequence[tuple[str, Sequence[tuple[WriteItem,
                                                                   torch.Tensor | io.BytesIO]]]],
                   prefix: str) -> list[WriteResult]:
        """Write each ``(file name, [(item, data)])`` of ``jobs``, then the checksum file.

        :meth:`write_data` writes DCP's plan with it, and a replayed plan
        (:mod:`resumekit.tensors.replayed_save`) the same files in the same order with it: the
        same bytes. Resets and fills :attr:`written`.

        Returns:
            Every item's result, file by file in ``jobs`` order.

        Raises:
            StorageError: A file could not be written (naming it).
        """
        self.written = []
        results: list[WriteResult] = []
        sidecar = raw_checksums_file(prefix)
        outcomes = run_writer_threads([
            functools.partial(self._write_file, name, items, sidecar) for name, items in jobs],
            on_caller=not self.background and _is_small(
                [item for _, items in jobs for item, _ in items]))
        regions: dict[str, list[tuple[int, int, str]]] = {}
        for (name, _), (file_results, written, packed) in zip(jobs, outcomes, strict=True):
            results.extend(file_results)
            self.written.append(written)
            if packed:
                regions[name] = packed
        if regions:
            self.written.append(write_checksums(
                os.path.join(os.fspath(self.path), sidecar), sidecar, regions,
                sync=self.sync_files))
        return results

    def storage_meta(self) -> None:
        """None: no path or save id in ``.metadata``.

        Its bytes then depend only on the state's structure (DCP reads nothing from it;
        the step directory's manifest records the save).
        """
        return None

    def _write_file(
        self, name: str, items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]],
        sidecar: str,
    ) -> tuple[list[WriteResult], WrittenFile, list[tuple[int, int, str]]]:
        if self.background:
            _lower_thread_priority()
        path = os.path.join(os.fspath(self.path), name)
        try:
            return self._write_items(path, name, items, sidecar)
        except OSError as error:
            raise _write_failure(path, error, "write") from error

    def _write_items(
        self, path: str, name: str,
        items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]], sidecar: str,
    ) -> tuple[list[WriteResult], WrittenFile, list[tuple[int, int, str]]]:
        results: list[WriteResult] = []
        with _AlignedFile(path) as handle:
            pack = _Pack(name, sidecar)
            for item, data in items:
                small = _small_cpu_bytes(data)
                if small is not None:  # the common small tensor: copied, no view objects
                    if not pack.fits(small[1]):
                        results.extend(pack.flush(handle))
                    pack.add_from(item, *small)
                    continue
                view, address, dtype, shape = _bytes_of(data)
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
            results.extend(pack.flush(handle))
            if self.sync_files:
                os.fsync(handle.fd)
            written = WrittenFile(name, handle.offset, handle.checksum.value())
        return results, written, pack.regions

    def write_small(self, name: str, tensors: Sequence[torch.Tensor], sidecar: str
                    ) -> tuple[list[int], WrittenFile, list[tuple[int, int, str]]]:
        """Write small contiguous CPU tensors into data file ``name`` as packed regions.

        The same bytes :meth:`write_data` writes for the same items in this order (a
        replayed plan, :func:`resumekit.tensors.sharded.save`), without DCP's plan objects.

        Returns:
            Each tensor's offset in the file, the file, and its regions ``(offset,
            length, hex)``.

        Raises:
            StorageError: The file could not be written (naming it).
        """
        if self.background:
            _lower_thread_priority()
        path = os.path.join(os.fspath(self.path), name)
        offsets: list[int] = []
        try:
            with _AlignedFile(path) as handle:
                pack = _Pack(name, sidecar)
                for tensor in tensors:
                    length = tensor.numel() * tensor.element_size()
                    if not pack.fits(length):
                        offsets.extend(pack.flush_offsets(handle))
                    pack.add_from(None, tensor.data_ptr(), length)
                offsets.extend(pack.flush_offsets(handle))
                if self.sync_files:
                    os.fsync(handle.fd)
                written = WrittenFile(name, handle.offset, handle.checksum.value())
        except OSError as error:
            raise _write_failure(path, error, "write") from error
        return offsets, written, pack.regions


def write_checksums(path: str, name: str,
                    regions: Mapping[str, Sequence[tuple[int, int, str]]], *,
                    sync: bool) -> WrittenFile:
    """Write a checksum file (new, exclusively created) and describe it.

    Raises:
        StorageError: It could not be written (naming it).
    """
    data = encode_checksums(regions)
    write_new_file(path, data, sync=sync)
    return WrittenFile(name, len(data), checksum_chunks([data]))


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
        raise _write_failure(path, error, "write") from error



def refuse_existing_checkpoint(directory: str) -> None:
    """Create ``directory`` if needed; raise if it already holds a ``.metadata``.

    What DCP's writer refuses (``overwrite=False``), for the saves that write without it.

    Raises:
        StorageError: A checkpoint is already there (it is never overwritten).
    """
    os.makedirs(directory, exist_ok=True)
    if os.path.lexists(os.path.join(directory, DCP_METADATA_FILE)):
        raise StorageError(
            f"writing checkpoint {directory} failed: a checkpoint already exists there "
            "(never overwritten)", path=directory, operation="save", file=DCP_METADATA_FILE)


def publish_metadata(directory: str, data: bytes, *, sync: bool) -> None:
    """Write ``.metadata`` as DCP's writer does: to ``.metadata.tmp``, then renamed.

    Raises:
        StorageError: It could not be written or renamed (naming it).
    """
    temporary = os.path.join(directory, _METADATA_TMP)
    write_new_file(temporary, data, sync=sync)
    try:
        os.replace(temporary, os.path.join(directory, DCP_METADATA_FILE))
    except OSError as error:
        raise _write_failure(temporary, error, "rename") from error


def written_metadata(writer: _ReportingWriter) -> tuple[bytes, WrittenFile] | None:
    """The ``.metadata`` bytes ``writer``'s last save wrote, read back, and their entry.

    None unless exactly one ``.metadata`` was reported and the file's bytes still have the
    checksum computed while it was written.
    """
    entries = [file for file in writer.written if file.name == DCP_METADATA_FILE]
    if len(entries) != 1:
        return None
    with open(os.path.join(os.fspath(writer.path), DCP_METADATA_FILE), "rb") as handle:
        data = handle.read()
    return (data, entries[0]) if checksum_chunks([data]) == entries[0].checksum else None

class _Pack:
    """Small items gathered into one region of a data file, written and hashed as one.

    Items below :data:`PACK_ITEM_BYTES` lie back to back (each on a
    :data:`PACK_ITEM_ALIGNMENT` boundary) in a region of at most :data:`PACK_BYTES`,
    written with one system call and covered, padding included, by one checksum. The
    region's first member starts the region and records its descriptor
    (``resumekit-raw/3;<region length>;<checksum file>``); the others record
    :data:`MEMBER_DESCRIPTORS` (no content: DCP's stock reader refuses them by name) and
    belong to the region of their file that holds their offset
    (:class:`_FileLayout`). The region ends with a table of its members (offset, length
    and XXH3-128 of each, then their count and a magic number), read only when the
    region's checksum fails, to name the damaged member. Each member's dtype and shape
    are DCP's own metadata entry's: the metadata holds nothing per small item beyond what
    DCP's own format does.
    """

    def __init__(self, name: str, sidecar: str) -> None:
        self.name = name
        self.sidecar = sidecar
        self.regions: list[tuple[int, int, str]] = []  # (offset, length, hex) written
        self.buffer = bytearray(PACK_BYTES)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.used = 0
        self.members: list[tuple[WriteItem | None, int, int]] = []  # item, offset, length

    def fits(self, length: int) -> bool:
        start = -(-self.used // PACK_ITEM_ALIGNMENT) * PACK_ITEM_ALIGNMENT
        table = (len(self.members) + 1) * _MEMBER.size + _FOOTER.size
        return _aligned(start + length + table) <= PACK_BYTES

    def add(self, item: WriteItem, view: memoryview) -> None:
        start = -(-self.used // PACK_ITEM_ALIGNMENT) * PACK_ITEM_ALIGNMENT
        self.buffer[self.used:start] = bytes(start - self.used)
        self.buffer[start:start + len(view)] = view
        self.used = start + len(view)
        self.members.append((item, start, len(view)))

    def add_from(self, item: WriteItem | None, address: int, length: int) -> None:
        """Add ``length`` bytes at ``address`` in memory (a contiguous CPU tensor's)."""
        start = -(-self.used // PACK_ITEM_ALIGNMENT) * PACK_ITEM_ALIGNMENT
        self.buffer[self.used:start] = bytes(start - self.used)
        if length:
            ctypes.memmove(self.address + start, address, length)
        self.used = start + length
        self.members.append((item, start, length))

    def flush(self, handle: _AlignedFile) -> list[WriteResult]:
        """Write the region (padded to the next boundary); one result per member."""
        if not self.members:
            return []
        base, descriptor = self._write_region(handle)
        results = [WriteResult(index=cast(WriteItem, item).index, size_in_bytes=length,
                               storage_data=_StorageInfo(
                                   self.name, base + start, length,
                                   transform_descriptors=MEMBER_DESCRIPTORS
                                   if number else [descriptor]))
                   for number, (item, start, length) in enumerate(self.members)]
        self.members, self.used = [], 0
        return results

    def flush_offsets(self, handle: _AlignedFile) -> list[int]:
        """Write the region as :meth:`flush` does; the members' file offsets only."""
        if not self.members:
            return []
        base, _ = self._write_region(handle)
        offsets = [base + start for _, start, _ in self.members]
        self.members, self.used = [], 0
        return offsets

    def _write_region(self, handle: _AlignedFile) -> tuple[int, str]:
        """Write the members, the table and the footer; the region's offset, descriptor."""
        buffer = memoryview(self.buffer)
        # Members, zeros, then the table and its footer, ending on an ALIGNMENT boundary:
        # the region's checksum covers every byte of it, padding included.
        table = len(self.members) * _MEMBER.size + _FOOTER.size
        at = _aligned(self.used + table) - table
        self.buffer[self.used:at] = bytes(at - self.used)
        for _, start, length in self.members:  # the table that names a damaged member
            _MEMBER.pack_into(self.buffer, at, start, length,
                              xxhash.xxh3_128_digest(buffer[start:start + length]))
            at += _MEMBER.size
        _FOOTER.pack_into(self.buffer, at, len(self.members), _PACK_MAGIC)
        region = buffer[:at + _FOOTER.size]
        base = handle.offset
        descriptor = f"{FORMAT_NAME}/{PACK_FORMAT_VERSION};{len(region)};{self.sidecar}"
        self.regions.append((base, len(region), hex_digest(region)))
        handle.write(region, None)
        handle.pad()
        return base, descriptor


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
        self.path = path
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

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        try:
            os.close(self.fd)
        except OSError as error:
            if exc_type is None:
                raise
            # Secondary: the error being raised already says why the file is unusable.
            logger.warning("resumekit: closing %s after a failed write failed too: %s",
                           self.path, error)
        if self._bounce is not None:
            # A view of it may still be alive (in the traceback of a failed write): then
            # the mapping goes away with the last view, not here.
            with contextlib.suppress(BufferError):
                self._bounce.close()
            self._bounce = None

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


def _is_small(items: Sequence[WriteItem]) -> bool:
    """Whether ``items`` hold fewer tensor bytes than :data:`SMALL_SAVE_BYTES`."""
    return sum(_item_bytes(item) for item in items) < SMALL_SAVE_BYTES


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


def _aligned(count: int) -> int:
    """``count`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-count // ALIGNMENT) * ALIGNMENT


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
        layout = self._layout()
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
            info: _StorageInfo = self.storage_data[request.storage_index]
            per_file.setdefault(info.relative_path, []).append(request)
        for name, items in per_file.items():
            where = str(os.fspath(self.fs.concat_path(self.path, name)))

            def read_file(items: list[ReadItem] = items) -> None:
                read(dataclasses.replace(plan, items=items), planner).wait()

            read_with_retry(where, read_file)

    def _read_raw(self, requests: list[ReadItem], planner: LoadPlanner) -> None:
        per_file: dict[str, list[_Job]] = {}
        layout = self._layout()
        for request in requests:
            info: _StorageInfo = self.storage_data[request.storage_index]
            text = (info.transform_descriptors or ("",))[0]
            if (is_packed_member(info.transform_descriptors)
                    or text.startswith((_PACK_PREFIX, _INLINE_PACK_PREFIX))):  # packed
                region = layout.region_of(info)
                if region is None:
                    where = self._where(info)
                    raise CorruptCheckpointError(
                        f"{where}: {request.storage_index.fqn} (bytes {info.offset}+"
                        f"{info.length}) has no storage descriptor and lies in no packed "
                        "region of its file", path=where, file=where,
                        key=request.storage_index.fqn)
                dtype, shape = self._stored_form(request, info)
                descriptor = _Descriptor(dtype, shape, region[1], (region[2],),
                                         (region[0], region[1]))
            else:  # stored alone (format 1; anything else is refused, naming it)
                descriptor = _Descriptor.decode(text, where=self._where(info))
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

    def _layout(self) -> _FileLayout:
        """The raw files and packed regions of ``storage_data`` (worked out once)."""
        cached = self.__dict__.get("_raw_layout")
        if cached is not None and cached[0] is self.storage_data:
            return cast(_FileLayout, cached[1])
        layout = _FileLayout(self.storage_data, self._where,
                             self._read_checksums if self.verify else None)
        self.__dict__["_raw_layout"] = (self.storage_data, layout)
        return layout

    def _read_checksums(self, name: str) -> dict[tuple[str, int], tuple[int, str]]:
        """Read (once per layout) and parse checksum file ``name``, checked first.

        With a manifest (``file_checksums``) the file must be listed in it and match its
        recorded checksum, as ``.metadata`` must: the regions' checksums come from it.
        """
        cache: dict[tuple[int, str], Any] = self.__dict__.setdefault("_checksum_files", {})
        key = (id(getattr(self, "storage_data", None)), name)
        found = cache.get(key)
        if found is not None:
            return cast(dict[tuple[str, int], tuple[int, str]], found)
        where = str(os.fspath(self.fs.concat_path(self.path, name)))

        def read() -> bytes:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                return cast(bytes, stream.read())

        try:
            data = read_with_retry(where, read)
        except FileNotFoundError as error:
            raise IncompleteCheckpointError(
                f"checkpoint {os.fspath(self.path)} is missing its checksum file {where}, "
                "which the checksums of its packed small tensors are in",
                path=os.fspath(self.path), file=where) from error
        check_listed_checksum(self.file_checksums, name, data, where)
        parsed = decode_checksums(data, where=where)
        cache.clear()
        cache[key] = parsed
        return parsed

    def _stored_form(self, request: ReadItem, info: _StorageInfo
                     ) -> tuple[torch.dtype | None, tuple[int, ...]]:
        """Dtype and shape of a packed item, from DCP's metadata entry of its key."""
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
            f"{where}: the metadata has no entry for the packed item {index.fqn} at "
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
            self._read_range(stream, job, (0, info.length), _byte_view(stored), packs)
            target.copy_(narrow_tensor_by_index(stored, request.storage_offsets,
                                                request.lengths))
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
            self._read_range(stream, job, (start, stop), _byte_view(target), packs)
            return target
        piece = torch.empty(tuple(request.lengths), dtype=descriptor.dtype)
        self._read_range(stream, job, (start, stop), _byte_view(piece), packs)
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
            count, magic = _FOOTER.unpack_from(region, len(region) - _FOOTER.size)
            table = len(region) - _FOOTER.size - count * _MEMBER.size
            if magic != _PACK_MAGIC or table < 0:
                raise ValueError("no table of members")
            for number in range(count):
                start, length, digest = _MEMBER.unpack_from(region, table + number * _MEMBER.size)
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
