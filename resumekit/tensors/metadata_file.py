"""``.metadata`` laid out by rank (``schema_version`` 5), so a restore reads it by parts.

DCP's ``.metadata`` is one pickle of the whole :class:`Metadata`: every chunk of every
tensor, with where it is stored. Its size grows with the number of ranks W that wrote
the checkpoint, and a restore that reads it whole on one rank (then answers every
other rank's request from it: :mod:`resumekit.tensors.metadata_parts`) made that rank's
side of every restore grow with W (issue 40: 49 s at W=1,024 for the 5B LingBot-VA
shapes), while every other rank waited for it.

The raw writer (:mod:`resumekit.tensors.raw`), which holds the whole metadata and every
rank's write results when it writes the file, lays it out instead as::

    frame:  :data:`MAGIC` | head length (8 bytes, little-endian) | head checksum
            (32 ASCII hex digits of its XXH3-128)
    head:   a pickle of {"format", "skeleton", "shared", "parts", "raw_files"}
    part 0, part 1, ..., part W-1: each a pickle of a list of rows

* ``skeleton``: the :func:`~resumekit.tensors.metadata_parts.skeleton` (every key's
  size, dtype and nesting, no chunks);
* ``shared``: the rows of every item whose key is stored as one chunk or is not a
  tensor (the small replicated items DCP's deduplication spreads over the ranks' files,
  AdamW's ``step``, the param groups), and of the first item of each packed region one of
  them lies in: what every rank needs, whatever the world size;
* ``parts``: per writing rank, ``(offset, length, checksum)`` of its part;
* ``raw_files``: the names of the raw tensor files (checked block by block on read).

Rank ``r``'s part holds the rows of every other item stored in its files: its own chunks
with their storage entries, and (being in the same file) the first entry of each packed
region its members lie in. A rank that restores as its checkpoint was sharded needs
exactly that: :func:`covers` says so, from its request alone.

A row is ``(key, number, offsets, sizes, file, offset, length, descriptors)``: ``number``
is the chunk's place in its key's list (-1 for a non-tensor value, -2 for a storage entry
with no chunk of its own here). Every value is a plain tuple, string or int: the pickles
hold no class but the skeleton's, and are read with the allow-list unpickler.

The whole :class:`Metadata` is the union (:func:`decode`), the same value for value as the
metadata the file was written from: built only where it is needed (a restore that
reshards, stock DCP through :class:`resumekit.StorageReader`, ``inspect``, ``verify``).
"""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from resumekit import _compat
from resumekit.errors import CorruptCheckpointError
from resumekit.store.manifest import checksum_chunks
from resumekit.tensors.raw.format import REGION_PREFIXES, is_packed_member
from resumekit.tensors.safe_pickle import DCP_METADATA_GLOBALS, restricted_loads

__all__ = ["FORMAT", "FRAME_BYTES", "MAGIC", "REFUSAL", "Head", "Row", "covers", "decode",
           "encode", "is_framed", "parse_head", "parse_part", "read_head_length",
           "rows_metadata", "stock_reader_refused"]

REFUSAL = ("this .metadata is resumekit's raw format laid out by rank (schema_version 5, "
           "'resumekit-raw'), which DCP's stock FileSystemReader cannot read: read it with "
           "resumekit.StorageReader(step_dir), or convert it with `resumekit export`")
"""What a stock reader's ``pickle.load`` of such a file raises (:func:`stock_reader_refused`)."""
_MESSAGE = REFUSAL.encode("utf-8")
MAGIC = (b"\x80\x02cresumekit.tensors.metadata_file\nstock_reader_refused\nX"
         + len(_MESSAGE).to_bytes(4, "little") + _MESSAGE + b"\x85R.")
"""The first bytes of a ``.metadata`` laid out by rank: a pickle (protocol 2) of a call of
:func:`stock_reader_refused`, so that a stock reader's ``pickle.load`` stops there with an
error naming the format. resumekit never unpickles it: it compares the bytes."""


def stock_reader_refused(message: str) -> None:
    """Raise ``message``: what unpickling a laid-out ``.metadata`` with :mod:`pickle` does.

    Raises:
        ValueError: Always.
    """
    raise ValueError(message)
FORMAT = "resumekit-metadata/1"
_DIGEST_CHARS = 32
FRAME_BYTES = len(MAGIC) + 8 + _DIGEST_CHARS
"""The frame before the head: the magic, the head's length and its checksum."""

Row = tuple[str, int, tuple[int, ...] | None, tuple[int, ...] | None, str, int, int,
            tuple[str, ...] | None]
"""``(key, number, offsets, sizes, file, offset, length, descriptors)`` (module docstring)."""

_VALUE = -1
_ENTRY_ONLY = -2


def is_framed(data: bytes) -> bool:
    """Whether ``data`` (a ``.metadata``, or its first bytes) is laid out by rank."""
    return data[:len(MAGIC)] == MAGIC


@dataclass
class Head:
    """What a restore reads of a ``.metadata`` laid out by rank, on one rank.

    Attributes:
        skeleton: Every key's size, dtype and nesting (no chunks).
        shared: The rows every rank needs (module docstring).
        parts: Per writing rank, ``(offset, length, checksum)`` of its part in the file.
        raw_files: The raw tensor files.
        base: Where the parts start in the file (the frame's and the head's length).
    """

    skeleton: Metadata
    shared: list[Row]
    parts: list[tuple[int, int, str]]
    raw_files: list[str]
    base: int = 0

    @property
    def shared_keys(self) -> set[str]:
        """The keys stored whole (one chunk of the whole tensor, or a non-tensor value)."""
        stored = self.skeleton.state_dict_metadata
        keys: set[str] = set()
        for key, number, offsets, sizes, *_ in self.shared:
            if number == _VALUE:
                keys.add(key)
            elif number == 0 and offsets is not None and sizes is not None and not any(
                    offsets):
                entry = stored.get(key)
                if isinstance(entry, TensorStorageMetadata) and tuple(
                        int(s) for s in entry.size) == tuple(sizes):
                    keys.add(key)
        return keys


def _place(info: Any, interned: dict[Any, Any]) -> tuple[str, int, int, tuple[str, ...] | None]:
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None:
        descriptors = tuple(descriptors)
        descriptors = interned.setdefault(descriptors, descriptors)
    path = str(info.relative_path)
    return (interned.setdefault(path, path), int(info.offset), int(info.length), descriptors)


def _heads_region(info: Any) -> bool:
    descriptors = info.transform_descriptors
    return bool(descriptors) and str(descriptors[0]).startswith(REGION_PREFIXES)


def _by_item(metadata: Metadata) -> dict[str, dict[tuple[int, ...] | None, Any]]:
    """The storage entries of ``metadata`` by key, then by chunk offsets."""
    by_item: dict[str, dict[tuple[int, ...] | None, Any]] = {}
    for index, info in (metadata.storage_data or {}).items():
        offset = index.offset
        by_item.setdefault(index.fqn, {})[
            None if offset is None else tuple(int(o) for o in offset)] = info
    return by_item


class _Layout:
    """The rows of one ``.metadata`` as :func:`encode` lays them out."""

    def __init__(self, world: int, file_ranks: Mapping[str, int]) -> None:
        self.shared: list[Row] = []
        self.parts: list[list[Row]] = [[] for _ in range(world)]
        self.members: list[Any] = []  # shared items' storage entries (maybe packed members)
        self.used: set[tuple[str, tuple[int, ...] | None]] = set()
        self.interned: dict[Any, Any] = {}
        self._file_ranks = file_ranks
        self._world = world

    def rank_of(self, info: Any) -> int | None:
        rank = self._file_ranks.get(str(info.relative_path))
        return rank if rank is not None and 0 <= rank < self._world else None

    def add(self, key: str, number: int, offsets: tuple[int, ...] | None,
            sizes: tuple[int, ...] | None, info: Any, *, whole: bool) -> None:
        row: Row = (key, number, offsets, sizes, *_place(info, self.interned))
        rank = self.rank_of(info)
        if whole or rank is None:
            self.shared.append(row)
            self.members.append(info)
        else:
            self.parts[rank].append(row)

    def add_key(self, key: str, entry: Any, entries: Mapping[tuple[int, ...] | None, Any]
                ) -> None:
        if not isinstance(entry, TensorStorageMetadata):
            info = entries.get(None)
            if info is not None:
                self.used.add((key, None))
                self.add(key, _VALUE, None, None, info, whole=True)
            return
        whole = len(entry.chunks) == 1
        for number, chunk in enumerate(entry.chunks):
            offsets = tuple(int(o) for o in chunk.offsets)
            sizes = tuple(int(s) for s in chunk.sizes)
            info = entries.get(offsets)
            if info is None:  # no storage entry (never read): kept with the shared rows
                self.shared.append((key, number, offsets, sizes, "", -1, -1, None))
                continue
            self.used.add((key, offsets))
            self.add(key, number, offsets, sizes, info, whole=whole)

    def add_rest(self, by_item: Mapping[str, Mapping[tuple[int, ...] | None, Any]]) -> None:
        """The entries of no chunk, where their file is; the shared members' region heads."""
        heads: dict[str, list[tuple[int, str, tuple[int, ...] | None, Any]]] = {}
        for key, entries in by_item.items():
            for offsets, info in entries.items():
                if (key, offsets) not in self.used:
                    row: Row = (key, _ENTRY_ONLY, offsets, None, *_place(info, self.interned))
                    rank = self.rank_of(info)
                    (self.shared if rank is None else self.parts[rank]).append(row)
                if _heads_region(info):
                    heads.setdefault(str(info.relative_path), []).append(
                        (int(info.offset), key, offsets, info))
        starts = {name: sorted(found, key=lambda head: head[0]) for name, found in heads.items()}
        offsets_of = {name: [head[0] for head in found] for name, found in starts.items()}
        added: set[tuple[str, tuple[int, ...] | None]] = set()
        for info in self.members:
            name = str(info.relative_path)
            if not is_packed_member(info.transform_descriptors) or name not in starts:
                continue
            number = bisect.bisect_right(offsets_of[name], int(info.offset)) - 1
            if number < 0:
                continue
            _, key, at, head_info = starts[name][number]
            if (key, at) not in added:
                added.add((key, at))
                self.shared.append((key, _ENTRY_ONLY, at, None,
                                    *_place(head_info, self.interned)))


def encode(metadata: Metadata, file_ranks: Mapping[str, int], world: int,
           raw_files: Iterable[str]) -> bytes:
    """``metadata`` laid out by rank: the bytes of its ``.metadata``.

    Args:
        metadata: The whole metadata, its ``storage_data`` filled.
        file_ranks: The rank that wrote each data file (from the save's write results).
        world: The number of ranks that wrote the checkpoint.
        raw_files: The names of its raw tensor files.
    """
    from resumekit.tensors.metadata_parts import skeleton  # noqa: PLC0415 - a cycle

    by_item = _by_item(metadata)
    layout = _Layout(world, file_ranks)
    for key, entry in metadata.state_dict_metadata.items():
        layout.add_key(key, entry, by_item.get(key, {}))
    layout.add_rest(by_item)
    shared, parts = layout.shared, layout.parts
    pickled = [pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL) for rows in parts]
    table: list[tuple[int, int, str]] = []
    head_fields = {"format": FORMAT, "skeleton": skeleton(metadata), "shared": shared,
                   "raw_files": sorted(raw_files)}
    # the parts' offsets depend on the head's length, which depends on them: the offsets
    # are counted from the end of the head, so the head is pickled once
    at = 0
    for data in pickled:
        table.append((at, len(data), checksum_chunks([data])))
        at += len(data)
    head = pickle.dumps({**head_fields, "parts": table}, protocol=pickle.HIGHEST_PROTOCOL)
    digest = checksum_chunks([head]).split(":", 1)[1].encode("ascii")
    frame = MAGIC + len(head).to_bytes(8, "little") + digest
    return b"".join([frame, head, *pickled])


def read_head_length(frame: bytes, source: str) -> tuple[int, str]:
    """The head's length and checksum (``xxh3_128:<hex>``) from the file's first bytes.

    Raises:
        CorruptCheckpointError: ``frame`` is not one (naming ``source``).
    """
    if len(frame) < FRAME_BYTES or not is_framed(frame):
        raise CorruptCheckpointError(f"{source}: not a resumekit .metadata laid out by rank "
                                     f"(its first {FRAME_BYTES} bytes are not its frame)",
                                     path=source, file=source)
    length = int.from_bytes(frame[len(MAGIC):len(MAGIC) + 8], "little")
    digest = frame[len(MAGIC) + 8:FRAME_BYTES].decode("ascii", errors="replace")
    return length, f"xxh3_128:{digest}"


def _check_head(value: Any) -> None:
    if not (isinstance(value, dict) and value.get("format") == FORMAT
            and isinstance(value.get("shared"), list) and isinstance(value.get("parts"), list)
            and isinstance(value.get("raw_files"), list)
            and type(value.get("skeleton")).__name__ == "Metadata"):
        raise TypeError("not the head of a resumekit .metadata")


def parse_head(head: bytes, expected: str | None, source: str) -> Head:
    """The :class:`Head` of its bytes, checked against ``expected`` (the frame's checksum).

    Raises:
        CorruptCheckpointError: The checksum differs, or it is not a head.
        UnsafeCheckpointError: Its pickle would run code.
    """
    if expected is not None:
        actual = checksum_chunks([head])
        if actual != expected:
            raise CorruptCheckpointError(
                f"{source}: its head fails its checksum: expected {expected}, got {actual}",
                path=source, file=source)
    value = restricted_loads(head, allowed=DCP_METADATA_GLOBALS, source=source)
    try:
        _check_head(value)
    except TypeError as error:
        raise CorruptCheckpointError(f"{source}: {error}", path=source, file=source) from None
    return Head(skeleton=value["skeleton"], shared=value["shared"], parts=value["parts"],
                raw_files=value["raw_files"], base=FRAME_BYTES + len(head))


def parse_part(data: bytes, expected: str | None, source: str, rank: int) -> list[Row]:
    """Rank ``rank``'s part from its bytes, checked against the head's ``expected`` checksum.

    Raises:
        CorruptCheckpointError: The checksum differs, or it is not a part (naming the
            file and the rank).
    """
    if expected is not None:
        actual = checksum_chunks([data])
        if actual != expected:
            raise CorruptCheckpointError(
                f"{source}: rank {rank}'s part fails its checksum: expected {expected}, "
                f"got {actual}", path=source, file=source, rank=rank)
    value = restricted_loads(data, allowed=(), source=f"{source} (rank {rank}'s part)")
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{source}: rank {rank}'s part is not a list of rows",
                                     path=source, file=source, rank=rank)
    return value


def rows_metadata(skeleton: Metadata, rows: Iterable[Row]) -> Metadata:
    """``skeleton`` (changed in place) with the chunks and storage entries of ``rows``.

    A key's chunks come in their numbered order; descriptors are tuples, as the raw
    writer records them.

    Raises:
        CorruptCheckpointError: A row is not one.
    """
    stored = skeleton.state_dict_metadata
    info = _compat.dcp_storage_info()
    numbered: dict[str, list[tuple[int, ChunkStorageMetadata]]] = {}
    storage = skeleton.storage_data if isinstance(skeleton.storage_data, dict) else {}
    try:
        for key, number, offsets, sizes, path, offset, length, descriptors in rows:
            if number >= 0 and offsets is not None and sizes is not None:
                numbered.setdefault(key, []).append(
                    (number, ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))))
            if offset < 0:  # a chunk without a storage entry
                continue
            index = MetadataIndex(key) if offsets is None else MetadataIndex(
                key, torch.Size(offsets))
            if descriptors is None:
                storage[index] = info(path, offset, length)
            else:
                storage[index] = info(path, offset, length,
                                      transform_descriptors=tuple(descriptors))
    except (TypeError, ValueError) as error:
        raise CorruptCheckpointError(f"a row of a resumekit .metadata is not one ({error})"
                                     ) from error
    for key, chunks in numbered.items():
        entry = stored.get(key)
        if isinstance(entry, TensorStorageMetadata):
            chunks.sort(key=lambda chunk: chunk[0])
            entry.chunks = [chunk for _, chunk in chunks]
    skeleton.storage_data = storage
    return skeleton


def decode(data: bytes, source: str) -> Metadata:
    """The whole :class:`Metadata` of a ``.metadata`` laid out by rank (every part read).

    Raises:
        CorruptCheckpointError: A checksum differs or a piece is not what it should be.
        UnsafeCheckpointError: A pickle would run code.
    """
    length, expected = read_head_length(data, source)
    head = parse_head(data[FRAME_BYTES:FRAME_BYTES + length], expected, source)
    base = FRAME_BYTES + length
    rows: list[Row] = list(head.shared)
    end = base
    for rank, (offset, size, checksum) in enumerate(head.parts):
        start = base + offset
        if start < base or start + size > len(data):
            raise CorruptCheckpointError(f"{source}: rank {rank}'s part lies past its end",
                                         path=source, file=source, rank=rank)
        rows.extend(parse_part(data[start:start + size], checksum, source, rank))
        end = max(end, start + size)
    if end != len(data):
        raise CorruptCheckpointError(f"{source}: {len(data) - end} bytes past its last part",
                                     path=source, file=source)
    return rows_metadata(head.skeleton, rows)


def covers(request: Mapping[str, Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None],
           shared_keys: set[str], rows: Sequence[Row]) -> bool:
    """Whether a rank's request asks for nothing but the shared items and its part's chunks.

    Every chunk it asks for of a key not stored whole must be one of its part's chunks
    exactly (offsets and sizes): the only stored chunk that overlaps it (a checkpoint's
    chunks do not overlap). An empty chunk asks for nothing.
    """
    own: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for row in rows:
        if row[1] >= 0 and row[2] is not None and row[3] is not None:
            own.setdefault(row[0], set()).add((row[2], row[3]))
    for key, wanted in request.items():
        if key in shared_keys:
            continue
        if wanted is None:
            return False
        chunks = own.get(key, set())
        for chunk in wanted:
            if all(chunk[1]) and (tuple(chunk[0]), tuple(chunk[1])) not in chunks:
                return False
    return True
