"""The raw tensor format on disk: descriptors, blocks and checksums, packed regions.

:class:`~resumekit.tensors.raw.writer.RawTensorWriter` writes and
:class:`~resumekit.tensors.raw.reader.RawTensorReading` reads what this module describes;
DCP's ``.metadata`` (its planning, its pickle) stays DCP's own, and this module parses
nothing else of it than the ``_StorageInfo`` of each item.

Each rank writes one data file (``__<rank>_0.distcp``, ``schema_version`` 4), its items
spread over the writer threads, each thread writing its share as one consecutive part of
the file at an offset worked out before anything is written. An item of
:data:`PACK_ITEM_BYTES` or more is stored alone, starting on an :data:`ALIGNMENT` boundary
of the file, checked in blocks (:func:`block_bytes_for`: about a sixteenth of it, 64 KiB
to 4 MiB), so a reader that needs a slice verifies it without reading much more. Its
``_StorageInfo.transform_descriptors`` is :data:`TRAILER_ALONE_DESCRIPTORS`
(``"resumekit-raw/5"``), one shared tuple, so the pickled ``.metadata`` holds it once: the
block size and the block checksums are in the file's **trailer** (:func:`encode_trailer`:
JSON of :data:`TRAILER_FORMAT`, zeros to an :data:`ALIGNMENT` boundary, the
:data:`TRAILER` footer with the JSON's length, the XXH3-128 of everything before the footer
and :data:`TRAILER_MAGIC`), read only by a reader of that file, and the item's dtype and
shape are DCP's own metadata entry's (issue 40: ``.metadata`` no bigger than DCP's, its
bytes depending only on the state's structure). Smaller items share packed regions of at
most :data:`PACK_BYTES` (:class:`Pack`): one write and one checksum per region, whose
first member records ``"resumekit-raw/6;<region length>"`` and the others
``"resumekit-raw/member"`` (:data:`MEMBER_DESCRIPTORS`: nothing of their own; written since
issue 29, members written before record nothing); their dtype and shape are DCP's metadata
entries, the region's checksum is in the same trailer. The manifest records the file's
checksum as one of parts (:data:`resumekit.store.manifest.PARTS_ALGORITHM`: each part's,
the trailer last), and a reader checks the trailer against it before use.

What earlier versions wrote still loads: up to ``schema_version`` 3, ``thread_count`` data
files per rank and a checksum file per rank (``__<rank>_checksums.json``,
:data:`CHECKSUMS_FORMAT`, listed in the manifest), items stored alone recording
``"resumekit-raw/4;<checksum file>"`` (:data:`ALONE_FORMAT_VERSION`) and packs
``"resumekit-raw/3;<region length>;<checksum file>"``; items stored alone with their dtype,
shape and block checksums in the descriptor
(``"resumekit-raw/1;<dtype>;<shape>;<block bytes>;xxh3_128:<hex>,<hex>,..."``, up to
``schema_version`` 2), packs with the checksum inline (format 2:
``"resumekit-raw/2;<region length>;xxh3_128:<hex>"``) and checksum files of regions only
(:data:`REGIONS_CHECKSUMS_FORMAT`). DCP's stock reader stops at the first item it reads with
``ValueError: Unknown extension name='resumekit-raw'`` instead of misreading it (every item
is described); stock DCP reads these checkpoints through :class:`resumekit.StorageReader`
(``dcp.load(..., storage_reader=resumekit.StorageReader(step_dir))``), and
``CheckpointManager(..., tensor_format="dcp")`` writes DCP's own format instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import struct
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, cast

import torch
from xxhash import xxh3_128_digest

from resumekit import _compat
from resumekit.errors import CorruptCheckpointError, UnreadableFormatError
from resumekit.store.manifest import CHECKSUM_ALGORITHM, checksum_chunks
from resumekit.store.storage import parse_json

__all__ = [
    "ALIGNMENT",
    "ALONE_FORMAT_VERSION",
    "ALONE_PREFIX",
    "CHECKSUMS_FORMAT",
    "CHUNK_BYTES",
    "DATA_SUFFIX",
    "FOOTER",
    "FORMAT_NAME",
    "INLINE_PACK_PREFIX",
    "MEMBER",
    "MEMBER_DESCRIPTORS",
    "MIN_BLOCK_BYTES",
    "PACK_BYTES",
    "PACK_ITEM_ALIGNMENT",
    "PACK_ITEM_BYTES",
    "PACK_MAGIC",
    "PACK_PREFIX",
    "REGIONS_CHECKSUMS_FORMAT",
    "REGION_PREFIXES",
    "TRAILER",
    "TRAILER_ALONE_DESCRIPTORS",
    "TRAILER_FORMAT",
    "TRAILER_MAGIC",
    "TRAILER_PACK_PREFIX",
    "ChecksumFile",
    "Descriptor",
    "FileLayout",
    "StorageInfo",
    "StoredItem",
    "WrittenFile",
    "align_up",
    "alone_descriptors",
    "block_bytes_for",
    "byte_view",
    "check_listed_checksum",
    "checksum_files",
    "decode_checksum_file",
    "decode_checksums",
    "decode_file_trailer",
    "decode_trailer",
    "encode_checksums",
    "encode_trailer",
    "is_packed_member",
    "is_raw",
    "raw_files",
    "trailer_length",
    "wrap_trailer",
]

FORMAT_NAME = "resumekit-raw"
FORMAT_VERSION = 1
"""The descriptor of an item stored alone with its dtype, shape and block checksums, as
written up to ``schema_version`` 2 (still read)."""
ALONE_FORMAT_VERSION = 4
"""The descriptor of an item stored alone, as written since ``schema_version`` 3:
``resumekit-raw/4;<checksum file>`` (:func:`alone_descriptors`), its block size and block
checksums in that checksum file, its dtype and shape DCP's metadata entry's."""
PACK_FORMAT_VERSION = 3
"""The descriptor of the first item of a pack of small items (:class:`Pack`), as written
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
CHECKSUMS_FORMAT = "resumekit-raw-checksums/2"
"""The ``format`` of a checksum file as written since ``schema_version`` 3: ``{"format":
..., "regions": {data file: [[offset, length, hex XXH3-128], ...]}, "items": {data file:
[[offset, length, block bytes, hex XXH3-128 of each block, concatenated], ...]}}``: the
packed regions and the items stored alone of the rank's data files."""
REGIONS_CHECKSUMS_FORMAT = "resumekit-raw-checksums/1"
"""The ``format`` of a checksum file written before ``schema_version`` 3: its packed regions
only (``"regions"``); still read."""
TRAILER_ALONE_FORMAT_VERSION = 5
"""The descriptor of an item stored alone, as written since ``schema_version`` 4:
``resumekit-raw/5`` (:data:`TRAILER_ALONE_DESCRIPTORS`), its block size and block
checksums in the trailer of its own data file (:func:`encode_trailer`)."""
TRAILER_PACK_FORMAT_VERSION = 6
"""The descriptor of the first item of a packed region, as written since ``schema_version``
4: ``resumekit-raw/6;<region length>``, the region's checksum in the trailer of its own
data file."""
TRAILER_ALONE_DESCRIPTORS: tuple[str] = (f"{FORMAT_NAME}/{TRAILER_ALONE_FORMAT_VERSION}",)
"""The descriptors of every item stored alone (``schema_version`` 4): one shared tuple, so
the pickled ``.metadata`` holds it once."""
TRAILER_FORMAT = "resumekit-raw-trailer/1"
"""The ``format`` of the JSON trailer that ends a data file of ``schema_version`` 4: what a
checksum file of :data:`CHECKSUMS_FORMAT` holds, for its own file only, followed by zeros
up to a multiple of :data:`ALIGNMENT` bytes and the :data:`TRAILER` footer."""
TRAILER = struct.Struct("<Q16s8s")  # JSON length, its XXH3-128, TRAILER_MAGIC: the last bytes
TRAILER_MAGIC = b"RKTRAIL1"
_HEX_DIGITS = 32  # one XXH3-128 in hex
CHUNK_BYTES = 4 << 20
"""The largest checksummed block, hashed and written per system call: small enough to stay
in cache between the hash and the copy into the page cache, large enough to keep system
calls rare."""
ALIGNMENT = 4096
"""Items start on this boundary in a data file, and direct I/O moves whole multiples of it."""
MIN_BLOCK_BYTES = 64 << 10
"""The smallest checksummed block (items below it are one block)."""
PACK_ITEM_BYTES = MIN_BLOCK_BYTES
"""Items smaller than this share a packed, singly checksummed region with their neighbours."""
PACK_BYTES = 1 << 20
"""The largest packed region: what a reader of one small item reads and hashes at most."""
PACK_ITEM_ALIGNMENT = 16
"""Members of a pack start on this boundary inside it."""
MEMBER = struct.Struct("<II16s")  # a packed member: offset in its region, length, XXH3-128
FOOTER = struct.Struct("<II")  # member count, magic
PACK_MAGIC = 0x31504B52  # "RKP1"
DATA_SUFFIX = ".distcp"
"""The suffix of a data file, as DCP names its own."""


StorageInfo = _compat.dcp_storage_info()
"""DCP's record of where an item lies; the raw writer's results are made of it."""


class StoredItem(Protocol):
    """Where DCP's ``.metadata`` says an item lies: the fields of its ``_StorageInfo``.

    Attributes:
        relative_path: The data file, relative to the checkpoint directory.
        offset: The item's first byte in that file.
        length: Its bytes.
        transform_descriptors: What the writer recorded of how it stored them (the raw
            format's descriptor), or None.
    """

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None


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
class Descriptor:
    """One item's descriptor: its dtype, shape and the checksums of its blocks.

    Written into the item's ``transform_descriptors`` in DCP's ``.metadata`` (or, for an
    item stored alone, into its rank's checksum file) by :meth:`encode`, and parsed back,
    checked, by :meth:`decode`.
    """

    dtype: torch.dtype | None  # None: a non-tensor value (DCP's BYTE_IO)
    shape: tuple[int, ...]
    block_bytes: int
    blocks: tuple[str, ...]  # hex XXH3-128 of each block_bytes slice of the item
    # A packed item (format 2): (file offset, length) of the region holding it, which is
    # its one block; None for an item stored alone, whose blocks start at the item.
    region: tuple[int, int] | None = None

    def encode(self) -> str:
        """The descriptor as the one string the format stores."""
        dtype = "bytes" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        shape = "x".join(str(size) for size in self.shape)
        return (f"{FORMAT_NAME}/{FORMAT_VERSION};{dtype};{shape};{self.block_bytes};"
                f"{CHECKSUM_ALGORITHM}:{','.join(self.blocks)}")

    @classmethod
    def decode(cls, text: str, *, where: str) -> Descriptor:
        """Parse :meth:`encode`'s string; a bad one is an error naming ``where``."""
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


PACK_PREFIX = f"{FORMAT_NAME}/{PACK_FORMAT_VERSION};"
TRAILER_PACK_PREFIX = f"{FORMAT_NAME}/{TRAILER_PACK_FORMAT_VERSION};"
INLINE_PACK_PREFIX = f"{FORMAT_NAME}/{INLINE_PACK_FORMAT_VERSION};"
ALONE_PREFIX = f"{FORMAT_NAME}/{ALONE_FORMAT_VERSION};"
REGION_PREFIXES = (TRAILER_PACK_PREFIX, PACK_PREFIX, INLINE_PACK_PREFIX)
"""The descriptors that start a packed region (formats 6, 3 and 2)."""


def alone_descriptors(sidecar: str) -> tuple[str]:
    """The descriptors of every item a rank stores alone: ``resumekit-raw/4;<sidecar>``.

    The writer gives each of its items the one tuple this returns, so the pickled
    ``.metadata`` holds it once per rank (pickle refers back to an object it has written).
    """
    return (f"{ALONE_PREFIX}{sidecar}",)


def _sidecar_of(text: str, prefix: str, *, where: str) -> str:
    """The checksum file a descriptor of format 3 or 4 names (its last field)."""
    sidecar = text.rsplit(";", 1)[1] if text.startswith(prefix) else ""
    if not sidecar or "/" in sidecar or sidecar.startswith("."):
        raise UnreadableFormatError(
            f"{where}: unreadable storage descriptor {text[:120]!r} (checksum file "
            f"{sidecar!r})", path=where, file=where)
    return sidecar


def is_raw(info: StoredItem) -> bool:
    """Whether a stored item carries a descriptor of :class:`RawTensorWriter`.

    The members of a packed region after its first carry :data:`MEMBER_DESCRIPTORS`, or
    none in checkpoints written before it: which files are raw tensor files is
    :func:`raw_files`'s answer.
    """
    descriptors = info.transform_descriptors or ()
    return len(descriptors) == 1 and descriptors[0].startswith(f"{FORMAT_NAME}/")


def raw_files(storage_data: Mapping[Any, StoredItem]) -> set[str]:
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


def checksum_files(storage_data: Mapping[Any, StoredItem]) -> set[str]:
    """The checksum files the items of ``storage_data`` name.

    Those of packed regions (format 3) and of items stored alone (format 4).
    """
    found: set[str] = set()
    for info in storage_data.values():
        descriptors = info.transform_descriptors
        if descriptors and len(descriptors) == 1 and descriptors[0].startswith(
                (PACK_PREFIX, ALONE_PREFIX)):
            found.add(descriptors[0].rsplit(";", 1)[1])
    return found


def _checksums_of(sidecar: str, info: StoredItem) -> str:
    """Where a layout looked an item's checksums up, for a message."""
    return ("its file's trailer" if sidecar == info.relative_path
            else f"its checksum file {sidecar}")


def _trailer_region_length(text: str, *, where: str) -> int:
    """The region length of a packed region's descriptor of format 6."""
    try:
        head, length_text = text.split(";")
        length = int(length_text)
        if head != f"{FORMAT_NAME}/{TRAILER_PACK_FORMAT_VERSION}" or length < 0:
            raise ValueError(f"region length {length}")
    except ValueError as error:
        raise UnreadableFormatError(
            f"{where}: unreadable storage descriptor {text[:120]!r} ({error})",
            path=where, file=where) from None
    return length


class FileLayout:
    """Where the raw items of one checkpoint lie: raw files, packed regions by file.

    Args:
        storage_data: The metadata's ``storage_data``.
        where: The path of an item's file, for errors.
        checksums: ``checksums(checksum file)`` gives ``{(data file, offset): (length,
            hex)}`` of the regions a checksum file (format 3) lists; None: not verified
            (the regions' checksums are then empty).
        files: Only these data files (those a rank's plan reads): the checksum files of
            the others are not read. None: every file.
        blocks: ``blocks(checksum file)`` gives ``{(data file, offset): (length, block
            bytes, (hex, ...))}`` of the items stored alone (format 4) it lists; None: not
            verified (their blocks are then :func:`block_bytes_for` their length, with no
            checksums).
    """

    def __init__(self, storage_data: Mapping[Any, StoredItem], where: Any,
                 checksums: Any = None, files: Collection[str] | None = None,
                 blocks: Any = None) -> None:
        self.raw: set[str] = set()
        self.alone: dict[tuple[str, int], tuple[int, tuple[str, ...]]] = {}
        """``{(data file, offset): (block bytes, block checksums)}`` of format-4 items."""
        regions: dict[str, list[tuple[int, int, str]]] = {}
        for info in storage_data.values():
            if files is not None and info.relative_path not in files:
                continue
            if not is_raw(info):
                continue
            self.raw.add(info.relative_path)
            text = cast(Sequence[str], info.transform_descriptors)[0]
            if text.startswith(ALONE_PREFIX) or text == TRAILER_ALONE_DESCRIPTORS[0]:
                sidecar = (info.relative_path if text == TRAILER_ALONE_DESCRIPTORS[0]
                           else _sidecar_of(text, ALONE_PREFIX, where=where(info)))
                key = (info.relative_path, info.offset)
                if blocks is None:
                    self.alone[key] = (block_bytes_for(info.length), ())
                    continue
                found = blocks(sidecar).get(key)
                if found is None or found[0] != info.length:
                    place = where(info)
                    raise CorruptCheckpointError(
                        f"{place}: the item at offset {info.offset} ({info.length} bytes) "
                        f"is not listed with that length in {_checksums_of(sidecar, info)}",
                        path=place, file=place)
                self.alone[key] = (found[1], found[2])
            elif text.startswith((PACK_PREFIX, TRAILER_PACK_PREFIX)):
                if text.startswith(TRAILER_PACK_PREFIX):
                    length = _trailer_region_length(text, where=where(info))
                    sidecar = info.relative_path
                else:
                    length, sidecar = Descriptor.decode_sidecar_region(text, where=where(info))
                digest = ""
                if checksums is not None:
                    listed = checksums(sidecar).get((info.relative_path, info.offset))
                    if listed is None or listed[0] != length:
                        place = where(info)
                        raise CorruptCheckpointError(
                            f"{place}: the packed region at offset {info.offset} "
                            f"({length} bytes) is not listed with that length in "
                            f"{_checksums_of(sidecar, info)}", path=place, file=place)
                    digest = listed[1]
                regions.setdefault(info.relative_path, []).append(
                    (info.offset, length, digest))
            elif text.startswith(INLINE_PACK_PREFIX):
                regions.setdefault(info.relative_path, []).append(
                    Descriptor.decode_region(text, info.offset, where=where(info)))
        self.regions = {name: sorted(found) for name, found in regions.items()}
        self.starts = {name: [region[0] for region in found]
                       for name, found in self.regions.items()}

    def region_of(self, info: StoredItem) -> tuple[int, int, str] | None:
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


class ChecksumFile(NamedTuple):
    """A parsed checksum file.

    Attributes:
        regions: ``{(data file, offset): (length, hex)}`` of its packed regions.
        items: ``{(data file, offset): (length, block bytes, (hex, ...))}`` of its items
            stored alone (empty in a file of :data:`REGIONS_CHECKSUMS_FORMAT`).
    """

    regions: dict[tuple[str, int], tuple[int, str]]
    items: dict[tuple[str, int], tuple[int, int, tuple[str, ...]]]


def encode_checksums(regions: Mapping[str, Sequence[tuple[int, int, str]]],
                     items: Mapping[str, Sequence[tuple[int, int, int, str]]] | None = None,
                     ) -> bytes:
    """The bytes of a checksum file.

    Args:
        regions: ``{data file: [(offset, length, hex)]}`` of the packed regions.
        items: ``{data file: [(offset, length, block bytes, concatenated hex of each
            block)]}`` of the items stored alone.
    """
    body = {"format": CHECKSUMS_FORMAT,
            "regions": {name: [list(region) for region in found]
                        for name, found in sorted(regions.items())},
            "items": {name: [list(item) for item in found]
                      for name, found in sorted((items or {}).items())}}
    return json.dumps(body, separators=(",", ":")).encode()


def encode_trailer(name: str, regions: Sequence[tuple[int, int, str]],
                   items: Sequence[tuple[int, int, int, str]]) -> bytes:
    """The trailer that ends data file ``name``: its checksums, zeros, the footer.

    Its length is a multiple of :data:`ALIGNMENT`, so the file stays one for direct I/O.

    Args:
        name: The data file's name in the checkpoint.
        regions: ``(offset, length, hex)`` of its packed regions.
        items: ``(offset, length, block bytes, concatenated hex of each block)`` of its
            items stored alone.
    """
    return wrap_trailer(json.dumps({"format": TRAILER_FORMAT,
                                    "regions": {name: [list(region) for region in regions]},
                                    "items": {name: [list(item) for item in items]}},
                                   separators=(",", ":")).encode())


def wrap_trailer(body: bytes) -> bytes:
    """A trailer holding ``body`` (JSON): ``body``, zeros, the footer that checks them."""
    total = align_up(len(body) + TRAILER.size)
    covered = body + bytes(total - len(body) - TRAILER.size)  # the zeros are checked too
    return covered + TRAILER.pack(len(body), _trailer_digest(covered, len(body)),
                                  TRAILER_MAGIC)


def _trailer_digest(covered: bytes, body: int) -> bytes:
    """The XXH3-128 a trailer's footer records: of the trailer before it and its length."""
    return xxh3_128_digest(covered + body.to_bytes(8, "little"))


def trailer_length(footer: bytes, size: int, *, where: str) -> int:
    """The length of a data file's trailer, from its last :data:`TRAILER` ``.size`` bytes.

    Raises:
        CorruptCheckpointError: No footer of a trailer there (naming the file).
    """
    try:
        body, _, magic = TRAILER.unpack(footer)
    except struct.error:
        body, magic = 0, b""
    if magic != TRAILER_MAGIC or body + TRAILER.size > size:
        raise CorruptCheckpointError(
            f"{where}: its last {TRAILER.size} bytes are not the footer of a checksum "
            "trailer (the file is damaged or cut short)", path=where, file=where)
    return align_up(body + TRAILER.size)


def decode_trailer(trailer: bytes, *, where: str) -> ChecksumFile:
    """Parse a data file's trailer (:func:`encode_trailer`), checked against its footer.

    Raises:
        CorruptCheckpointError: The trailer does not match the checksum its footer records.
        UnreadableFormatError: Not a trailer of a known format (naming the file).
    """
    body, digest, _ = TRAILER.unpack_from(trailer, len(trailer) - TRAILER.size)
    covered = trailer[:len(trailer) - TRAILER.size]
    if body > len(covered) or _trailer_digest(covered, body) != digest:
        raise CorruptCheckpointError(
            f"{where}: its checksum trailer ({len(trailer)} bytes at its end) does not match "
            "the checksum its footer records", path=where, file=where)
    return decode_checksum_file(covered[:body], where=where)


def decode_file_trailer(data: bytes, *, where: str) -> ChecksumFile:
    """The checksums in the trailer of a whole data file's bytes ``data``.

    Raises:
        CorruptCheckpointError: No trailer, or one that fails its checksum (naming the file).
    """
    length = trailer_length(data[-TRAILER.size:], len(data), where=where)
    return decode_trailer(data[len(data) - length:], where=where)


def decode_checksums(data: bytes, *, where: str) -> dict[tuple[str, int], tuple[int, str]]:
    """Parse a checksum file's packed regions: ``{(data file, offset): (length, hex)}``.

    Raises:
        UnreadableFormatError: Not a checksum file of a known format (naming it).
    """
    return decode_checksum_file(data, where=where).regions


def decode_checksum_file(data: bytes, *, where: str) -> ChecksumFile:
    """Parse a checksum file of either format.

    :data:`CHECKSUMS_FORMAT`, or :data:`REGIONS_CHECKSUMS_FORMAT` as written before
    ``schema_version`` 3 (no items).

    Raises:
        UnreadableFormatError: Not a checksum file of a known format, or an entry that is
            not one (naming the file).
    """
    try:
        body = parse_json(data, source=where)
        found = body.get("format") if isinstance(body, dict) else None
        if found not in (CHECKSUMS_FORMAT, REGIONS_CHECKSUMS_FORMAT, TRAILER_FORMAT):
            raise ValueError(f"unknown format {found!r}")
        regions: dict[tuple[str, int], tuple[int, str]] = {}
        for name, listed in body["regions"].items():
            for offset, length, digest in listed:
                if not (isinstance(offset, int) and isinstance(length, int)
                        and isinstance(digest, str)):
                    raise ValueError(f"bad entry {[offset, length, digest]!r}")
                regions[(str(name), offset)] = (length, digest)
        items: dict[tuple[str, int], tuple[int, int, tuple[str, ...]]] = {}
        for name, listed in (body["items"] if found != REGIONS_CHECKSUMS_FORMAT
                             else {}).items():
            for offset, length, block, digests in listed:
                if not (isinstance(offset, int) and isinstance(length, int)
                        and isinstance(block, int) and isinstance(digests, str)
                        and block > 0 and length >= 0
                        and len(digests) == -(-length // block) * _HEX_DIGITS):
                    raise ValueError(f"bad entry {[offset, length, block, digests[:64]]!r}")
                items[(str(name), offset)] = (length, block, tuple(
                    digests[at:at + _HEX_DIGITS] for at in range(0, len(digests), _HEX_DIGITS)))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnreadableFormatError(
            f"{where}: unreadable checksum file ({error})", path=where, file=where,
        ) from None
    return ChecksumFile(regions, items)


def align_up(count: int) -> int:
    """``count`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-count // ALIGNMENT) * ALIGNMENT



def byte_view(tensor: torch.Tensor) -> memoryview:
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

