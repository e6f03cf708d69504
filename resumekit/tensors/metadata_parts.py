"""Each restoring rank's part of a checkpoint's ``.metadata``, so its cost does not grow with W.

A checkpoint written by W ranks has W chunks per sharded tensor in its ``.metadata``
(offsets, sizes, and where each lies: file, offset, length, checksums). A rank that
restores needs only the chunks its own shards overlap: one per tensor when the run shards
as the checkpoint did (the common requeue case). Receiving and unpickling the whole file,
and planning by scanning every chunk of every tensor, made each rank's restore cost grow
with W (issue 40).

A restore reads ``.metadata`` on one rank (:func:`resumekit.restore.verification.share_metadata`),
which sends every other rank the :func:`skeleton` only: every key with its global size,
dtype and nesting (what the fit check and the optimizer's preallocation need), without
chunks or storage entries. When the load plans, each rank sends that rank its
:func:`request_of` (per key, the chunks of its destination: ``__create_chunk_list__`` of a
``DTensor``, the whole tensor otherwise), and gets back its :class:`Part`: the chunks that
overlap its request (found by :class:`MetadataServer` with a binary search on the chunks'
offsets, not a scan) with their storage entries (and, for a member of a packed region,
its region's first entry, which says where the region ends and where its checksum is).
The rank then plans with DCP's own planner on :func:`complete` (the skeleton filled
with its part), exactly as from the whole file: the overlaps are the same chunks, and DCP
matches a read to its stored entry by name and offset only.

Stock DCP, a load without a process group and a node-local copy read alone still read the
whole file themselves.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from resumekit import _compat
from resumekit.errors import CheckpointLoadError, CorruptCheckpointError
from resumekit.tensors.raw.format import (
    REGION_PREFIXES,
    is_packed_member,
)

__all__ = ["PREREAD_MAX_BYTES", "PREREAD_MAX_PART_BYTES", "MetadataServer", "Part",
           "Request", "complete", "exchange_over_group", "packed", "request_of", "serve_values",
           "skeleton"]

_REGION_PREFIXES = REGION_PREFIXES

Request = dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]
"""A rank's request: ``{key: [(offsets, sizes), ...]}`` of its destination chunks, or
``{key: None}`` for a key whose every stored chunk it wants (a non-tensor value, or a
destination whose chunks are not known)."""


Place = tuple[str, int, int, tuple[str, ...] | None]
"""Where a stored item lies: its file, offset, length and transform descriptors."""

Entry = tuple[str, tuple[int, ...] | None, Place]
"""A storage entry: its key, its chunk's offsets (None for a non-tensor value), its place."""

ItemKey = tuple[str, tuple[int, ...] | None]
"""A stored item: its key and its chunk's offsets (None for a non-tensor value)."""

ValueReader = Callable[[Sequence[ItemKey]], dict[ItemKey, Any]]
"""Reads stored items whole, verified, on the answering rank: a tensor of the stored
chunk's size for a tensor item, the stored bytes for a non-tensor value."""

PREREAD_MAX_BYTES = 4096
"""Stored items of at most this many bytes that a rank asks for whole (a non-tensor value,
a tensor stored as one chunk: AdamW's ``step`` scalars, the param groups) come read in its
part. DCP's save spreads such replicated items over every rank's files, so reading them
itself made each rank open, and check the trailers of, up to min(W, items) data files."""

PREREAD_MAX_PART_BYTES = 256 << 10
"""At most this many bytes of read items in one part (the rest is read by the rank)."""


@dataclasses.dataclass
class Part:
    """What one rank receives of a checkpoint's ``.metadata``.

    Plain tuples, which pickle fast: rank 0 pickles one part per distinct request.

    Attributes:
        chunks: ``{key: [(offsets, sizes), ...]}`` of the stored chunks that overlap the
            rank's request.
        storage: The storage entries of those chunks and of the requested non-tensor
            values, and of the first item of each packed region one of them lies in.
        values: The small items the request asks for whole, read and verified by the
            answering rank (:data:`PREREAD_MAX_BYTES`): a tensor of the stored chunk's
            size as ``(dtype name, shape, bytes)``, or a non-tensor value's stored bytes.
            The rank reads them from here (:func:`serve_values`), not from their files.
        alone: No stored chunk this part's rank reads (its values aside) is read by
            another rank, and every rank sent a request: the same on every rank, so all
            ranks skip the shared reads' agreement on who reads what
            (:meth:`resumekit.tensors.shared_reads.SharedReads.read_alone`), which
            would share nothing.
    """

    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    storage: list[Entry]
    values: dict[ItemKey, Any] = dataclasses.field(default_factory=dict)
    alone: bool = False


def _disjoint(parts: Sequence[Part]) -> bool:
    """Whether no stored chunk is read (not sent as a value) through two of ``parts``."""
    seen: set[ItemKey] = set()
    for part in parts:
        for key, chunks in part.chunks.items():
            for offsets, _ in chunks:
                item: ItemKey = (key, offsets)
                if item in part.values:
                    continue
                if item in seen:
                    return False
                seen.add(item)
    return True


def skeleton(metadata: Metadata) -> Metadata:
    """``metadata`` without chunks or storage entries: what every rank needs of it.

    Every key keeps its global size, dtype and nesting (``planner_data``); the size of
    the result does not grow with the number of ranks that wrote the checkpoint.
    """
    entries: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            entries[key] = TensorStorageMetadata(properties=entry.properties,
                                                 size=entry.size, chunks=[])
        else:
            entries[key] = entry
    return Metadata(state_dict_metadata=entries, planner_data=metadata.planner_data,
                    storage_data={}, storage_meta=metadata.storage_meta,
                    version=metadata.version)


def complete(metadata: Metadata, part: Part) -> Metadata:
    """Fill skeleton ``metadata`` (in place) with ``part``; return it.

    A key's chunks are replaced, not appended to: completing twice with the same part
    gives the same metadata.
    """
    stored = metadata.state_dict_metadata
    for key, chunks in part.chunks.items():
        entry = stored.get(key)
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                            for offsets, sizes in chunks]
    if metadata.storage_data is None:
        metadata.storage_data = {}
    info = _compat.dcp_storage_info()
    storage = metadata.storage_data
    for key, offsets, (path, offset, length, descriptors) in part.storage:
        index = MetadataIndex(key) if offsets is None else MetadataIndex(key, torch.Size(offsets))
        storage[index] = (info(path, offset, length) if descriptors is None
                          else info(path, offset, length, transform_descriptors=descriptors))
    return metadata


def request_of(flat: Mapping[str, Any], metadata: Metadata) -> Request:
    """This rank's request for the keys of flattened state ``flat`` that ``metadata`` holds.

    A ``DTensor`` (anything with ``__create_chunk_list__``) asks for its local chunks, a
    plain tensor for the whole tensor; anything else asks for every stored chunk.
    """
    request: Request = {}
    stored = metadata.state_dict_metadata
    for key, value in flat.items():
        entry = stored.get(key)
        if entry is None:
            continue
        if not isinstance(entry, TensorStorageMetadata):
            request[key] = None
            continue
        create = getattr(value, "__create_chunk_list__", None)
        if create is not None:
            request[key] = [(tuple(int(o) for o in chunk.offsets),
                             tuple(int(s) for s in chunk.sizes)) for chunk in create()]
        elif type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
            shape = tuple(int(s) for s in value.shape)
            request[key] = [((0,) * len(shape), shape)]
        else:  # a ShardedTensor or another kind: every chunk (the whole file's answer)
            request[key] = None
    return request


class _Chunks:
    """One tensor's stored chunks (offsets, sizes), sorted by their offset along dim 0."""

    __slots__ = ("by_offsets", "chunks", "longest", "starts")

    def __init__(self, chunks: Sequence[ChunkStorageMetadata]) -> None:
        self.chunks = sorted((tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                             for c in chunks)
        self.starts = [offsets[0] if offsets else 0 for offsets, _ in self.chunks]
        self.longest = max((sizes[0] for _, sizes in self.chunks if sizes), default=0)
        self.by_offsets = {offsets: sizes for offsets, sizes in self.chunks}

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]
                    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The chunks that share at least one element with the box ``offsets + sizes``.

        A chunk stored at exactly ``offsets`` with ``sizes`` is the only one (the chunks
        of a checkpoint do not overlap: DCP's save checks it); otherwise a binary search
        on dimension 0 finds the candidates, each checked in every dimension.
        """
        if any(size == 0 for size in sizes):  # an empty shard reads nothing
            return []
        if self.by_offsets.get(offsets) == sizes:
            return [(offsets, sizes)]
        if not offsets:  # a 0-d tensor: its one chunk
            return list(self.chunks)
        low, high = offsets[0], offsets[0] + sizes[0]
        first = bisect.bisect_left(self.starts, low - self.longest + 1)
        last = bisect.bisect_left(self.starts, high)
        return [(co, cs) for co, cs in self.chunks[first:last]
                if all(max(o, c) < min(o + s, c + n)
                       for o, s, c, n in zip(offsets, sizes, co, cs, strict=True))]


class MetadataServer:
    """The rank that read ``.metadata`` answers every rank's :data:`Request` from it.

    The index (chunks sorted per key, the first entries of packed regions by file) is
    built once, on first use. Each stored item's answer (its chunk, its storage entry and
    that of its packed region's first item) is worked out once, when a rank first asks
    for it, and kept: a rank that asks for the chunk stored at exactly its offsets and
    sizes (a run sharded as the checkpoint was, the requeue case) costs a dictionary look-up
    per key, not a search, and every entry of an answer is a shared tuple (one pickle
    memo entry per descriptor tuple; no ``MetadataIndex`` built twice for one item).

    Args:
        metadata: The whole metadata.
        source: Its path (named in errors).
    """

    def __init__(self, metadata: Metadata, source: str) -> None:
        self.metadata = metadata
        self.source = source
        self._chunks: dict[str, _Chunks] | None = None
        self._heads: dict[str, tuple[list[int], list[Any]]] | None = None
        self._stored: dict[str, dict[tuple[int, ...] | None, Any]] = {}  # entries by key
        self._items: dict[str, dict[tuple[int, ...] | None, _Item]] = {}
        # per key, the items asked for exactly (their chunk's offsets and sizes): an
        # answer's look-up when a run shards as its checkpoint did
        self._exact: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], _Item]] = {}
        self._descriptors: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.answers = 0
        """Parts worked out so far (:meth:`part_for` calls): one per distinct request."""
        self._values: dict[ItemKey, Any] = {}  # items read for parts, kept for the next

    def prepare(self) -> None:
        """Build the index now (else on the first request)."""
        self._index()

    def _index(self) -> tuple[dict[str, _Chunks], dict[str, tuple[list[int], list[Any]]]]:
        if self._chunks is None or self._heads is None:
            self._chunks = {key: _Chunks(entry.chunks)
                            for key, entry in self.metadata.state_dict_metadata.items()
                            if isinstance(entry, TensorStorageMetadata)}
            heads: dict[str, list[tuple[int, MetadataIndex, Any]]] = {}
            stored: dict[str, dict[tuple[int, ...] | None, Any]] = {}
            for index, info in (self.metadata.storage_data or {}).items():
                of_key = stored.get(index.fqn)
                if of_key is None:
                    of_key = stored[index.fqn] = {}
                offset = index.offset
                of_key[None if offset is None else tuple(offset)] = info
                if _heads_region(info):
                    heads.setdefault(str(info.relative_path), []).append(
                        (int(info.offset), index, info))
            self._stored = stored
            self._heads = {name: ([offset for offset, _, _ in found],
                                  [(index, info) for _, index, info in found])
                           for name, found in ((n, sorted(f, key=lambda h: h[0]))
                                               for n, f in heads.items())}
            # Every stored chunk's answer, worked out here in one pass (each is asked
            # for about once: by the rank that shards as its writer did); an answer is
            # then a look-up per key. A chunk without an entry fails when asked for.
            for key, index_of in self._chunks.items():
                entries = stored.get(key, {})
                items = self._items.setdefault(key, {})
                exact = self._exact.setdefault(key, {})
                for chunk in index_of.chunks:
                    info = entries.get(chunk[0])
                    if info is not None and all(chunk[1]):  # an empty chunk: never read
                        item = items[chunk[0]] = self._make_item(key, chunk, info)
                        exact[chunk] = item
        return self._chunks, self._heads

    def _place(self, info: Any) -> Place:
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None:
            descriptors = tuple(descriptors)
            descriptors = self._descriptors.setdefault(descriptors, descriptors)
        return (str(info.relative_path), int(info.offset), int(info.length), descriptors)

    def _item(self, key: str, chunk: tuple[tuple[int, ...], tuple[int, ...]] | None) -> _Item:
        """The answer for the stored item of ``key`` at ``chunk``, worked out on first use.

        ``chunk`` is None for a non-tensor value.

        Raises:
            CorruptCheckpointError: A chunk has no storage entry (a damaged ``.metadata``).
        """
        offsets = None if chunk is None else chunk[0]
        items = self._items.get(key)
        if items is None:
            items = self._items[key] = {}
        found = items.get(offsets)
        if found is not None:
            return found
        self._index()
        info = self._stored.get(key, {}).get(offsets)
        if info is None:
            if offsets is None:  # a value without an entry: nothing to send for it
                found = _Item(None, (), None)
                items[offsets] = found
                return found
            raise CorruptCheckpointError(
                f"{self.source}: the chunk of {key} at offset {list(offsets)} "
                "has no storage entry", path=self.source, file=self.source, key=key)
        found = items[offsets] = self._make_item(key, chunk, info)
        return found

    def _make_item(self, key: str, chunk: tuple[tuple[int, ...], tuple[int, ...]] | None,
                   info: Any) -> _Item:
        offsets = None if chunk is None else chunk[0]
        own: Entry = (key, offsets, self._place(info))
        if _heads_region(info):
            return _Item(chunk, (own,), (key, offsets))
        region = (self._heads or {}).get(str(info.relative_path))
        if region is not None and is_packed_member(info.transform_descriptors):
            number = bisect.bisect_right(region[0], int(info.offset)) - 1
            if number >= 0:
                head_index, head_info = region[1][number]
                head_at = (None if head_index.offset is None
                           else tuple(int(o) for o in head_index.offset))
                return _Item(chunk, (own, (head_index.fqn, head_at, self._place(head_info))),
                             None)
        return _Item(chunk, (own,), None)

    def part_for(self, request: Request) -> Part:
        """The chunks ``request`` overlaps, with their storage entries.

        A member of a packed region of a raw tensor file comes with its region's first
        entry (which says where the region ends and where its checksum is), once per part.

        Raises:
            CorruptCheckpointError: A chunk has no storage entry (a damaged ``.metadata``).
        """
        chunks_of, _ = self._index()
        stored = self.metadata.state_dict_metadata
        chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        storage: list[Entry] = []
        heads: dict[tuple[str, tuple[int, ...] | None], Entry] = {}
        own_heads: set[tuple[str, tuple[int, ...] | None]] = set()
        exact_of = self._exact
        item_of = self._item

        for key, wanted in request.items():
            if wanted is not None and len(wanted) == 1:
                exact = exact_of.get(key)
                item = None if exact is None else exact.get(wanted[0])
                if item is not None:  # the stored chunk exactly: its answer
                    own = item.entries[0]
                    # the key as the entry holds it: one string in the part's pickle
                    chunks[own[0]] = [item.chunk]  # type: ignore[list-item]
                    storage.append(own)
                    if len(item.entries) > 1:
                        heads[item.entries[1][0], item.entries[1][1]] = item.entries[1]
                    if item.heads is not None:
                        own_heads.add(item.heads)
                    continue
            entry = stored.get(key)
            if entry is None:
                continue
            if not isinstance(entry, TensorStorageMetadata):
                found_items = [item_of(key, None)]
            else:
                found = _overlaps(chunks_of[key], wanted)
                chunks[key] = found
                found_items = [item_of(key, chunk) for chunk in found]
            for item in found_items:
                if item.entries:
                    storage.append(item.entries[0])
                    if len(item.entries) > 1:
                        heads[item.entries[1][0], item.entries[1][1]] = item.entries[1]
                if item.heads is not None:
                    own_heads.add(item.heads)
        storage.extend(head for at, head in heads.items() if at not in own_heads)
        return Part(chunks=chunks, storage=storage)

    def parts_for(self, requests: Sequence[Request | BaseException],
                  read_values: ValueReader | None = None) -> list[Part | None]:
        """Every rank's part, in rank order (None for a rank that sent an error).

        Each distinct request is answered once: ranks that shard alike (replicas: DDP,
        HSDP) ask the same, and get the same :class:`Part` object (pickled once by the
        scatter). With ``read_values``, each part also carries the small items its request
        asks for whole (:data:`PREREAD_MAX_BYTES`), read once for every part by this rank.

        Raises:
            CorruptCheckpointError: A chunk has no storage entry (a damaged ``.metadata``).
            ResumekitError: Reading the small items failed (from ``read_values``).
        """
        # Requests by a cheap fingerprint (a few of their entries): the ranks of a sharded
        # run differ in their first chunks, so each request is compared in full only
        # with the few distinct ones that share its fingerprint (replicas: equal ones).
        answered: dict[Any, list[tuple[Request, Part]]] = {}
        distinct: list[Part] = []
        parts: list[Part | None] = []
        for request in requests:
            if isinstance(request, BaseException):
                parts.append(None)
                continue
            alike = answered.setdefault(_fingerprint(request), [])
            part = next((found for asked, found in alike if asked == request), None)
            if part is None:
                part = self.part_for(request)
                self.answers += 1
                distinct.append(part)
                if len(alike) < _ALIKE_KEPT:  # past that, answered without a comparison
                    alike.append((request, part))
            parts.append(part)
        if read_values is not None:
            self._add_values(distinct, read_values)
        if len(distinct) == len(parts) and _disjoint(distinct):
            for part in distinct:
                part.alone = True
        return parts

    def _add_values(self, parts: Sequence[Part], read_values: ValueReader) -> None:
        """Put in each of ``parts`` the small items it asks for whole, all read in one call."""
        chosen = [self._small_items(part) for part in parts]
        missing = list(dict.fromkeys(item for items in chosen for item in items
                                     if item not in self._values))
        if missing:
            found = read_values(missing)
            lost = [item for item in missing if item not in found]
            if lost:
                key, offsets = lost[0]
                raise CorruptCheckpointError(
                    f"{self.source}: {key}{'' if offsets is None else f' at {list(offsets)}'}"
                    " was not read", path=self.source, file=self.source, key=key)
            self._values.update((item, packed(value)) for item, value in found.items())
        for part, items in zip(parts, chosen, strict=True):
            part.values = {item: self._values[item] for item in items}

    def _small_items(self, part: Part) -> list[ItemKey]:
        """The items of ``part`` stored whole in at most :data:`PREREAD_MAX_BYTES` each."""
        stored = self.metadata.state_dict_metadata
        chosen: list[ItemKey] = []
        total = 0
        for key, offsets, (_, _, length, _) in part.storage:
            entry = stored.get(key)
            if isinstance(entry, TensorStorageMetadata):
                if offsets is None or len(entry.chunks) != 1:
                    continue
                whole = (tuple(offsets), tuple(int(s) for s in entry.size))
                if (part.chunks.get(key) != [whole] or any(whole[0])
                        or tuple(int(s) for s in entry.chunks[0].sizes) != whole[1]):
                    continue  # a packed region's first entry, or a part of a tensor
            elif entry is None or offsets is not None:
                continue
            if length > PREREAD_MAX_BYTES or total + length > PREREAD_MAX_PART_BYTES:
                continue
            total += length
            chosen.append((key, offsets))
        return chosen


_ALIKE_KEPT = 8
"""Distinct requests kept per fingerprint (each later one is compared with these)."""


def _fingerprint(request: Request) -> tuple[int, tuple[Any, ...]]:
    """A few entries of ``request``: its size and the chunks of its first sharded keys."""
    shown: list[Any] = []
    for key, chunks in request.items():
        if chunks:
            shown.append((key, tuple(chunks)))
            if len(shown) == 4:
                break
    return len(request), tuple(shown)


class _Item(NamedTuple):
    """One stored item's answer.

    Its chunk (None for a value), its storage entry and that of its packed region's first
    item, and its own ``(key, offsets)`` if it is itself a region's first item (sent once
    in a part that also has its members).
    """

    chunk: tuple[tuple[int, ...], tuple[int, ...]] | None
    entries: tuple[Entry, ...]
    heads: tuple[str, tuple[int, ...] | None] | None


def _overlaps(index: _Chunks, wanted: list[tuple[tuple[int, ...], tuple[int, ...]]] | None
              ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The stored chunks of ``index`` that the chunks ``wanted`` overlap (None: all)."""
    if wanted is None:
        return list(index.chunks)
    if len(wanted) == 1:
        offsets, sizes = wanted[0]
        return ([(offsets, sizes)] if index.by_offsets.get(offsets) == sizes and all(sizes)
                else index.overlapping(offsets, sizes))
    return list(dict.fromkeys(chunk for offsets, sizes in wanted
                              for chunk in index.overlapping(offsets, sizes)))


def _heads_region(info: Any) -> bool:
    """Whether stored item ``info`` is the first of a packed region of a raw tensor file."""
    descriptors = info.transform_descriptors
    return bool(descriptors) and str(descriptors[0]).startswith(_REGION_PREFIXES)


#: Bytes of a pickle that the exchange's first gather carries in a fixed frame (and its
#: first scatter at least): a request or a part that fits takes one collective each way;
#: a longer one sends the rest in a second.
EXCHANGE_FRAME_BYTES = 16 << 10
#: The scatter's frame grows with the checkpoint's keys (a part holds a storage entry,
#: its checksums, per chunk of each key asked for) up to this many bytes: rank 0 sends
#: W frames, so a frame stays small.
EXCHANGE_FRAME_MAX_BYTES = 64 << 10
_FRAME_BYTES_PER_KEY = 1536


def exchange_frame_bytes(keys: int) -> int:
    """The scatter's frame for a checkpoint of ``keys`` keys (the same on every rank).

    From the skeleton every rank holds: a part of a run sharded as its checkpoint (one
    chunk per key) fits, up to :data:`EXCHANGE_FRAME_MAX_BYTES`.
    """
    return max(EXCHANGE_FRAME_BYTES, min(EXCHANGE_FRAME_MAX_BYTES,
                                         keys * _FRAME_BYTES_PER_KEY))
_HEADER_WORDS = 3  # the scatter's frame: [pickle's bytes, longest pickle's, request rest]
_SIZE_BYTES = 8


class Answerer(Protocol):
    """What answers the gathered requests on group rank 0 (a :class:`MetadataServer`)."""

    def parts_for(self, requests: Sequence[Any], read_values: ValueReader | None = None
                  ) -> Sequence[Part | None]:
        """Every rank's part, in rank order (None for a rank that sent an error)."""


def exchange_over_group(group: dist.ProcessGroup | None, server: Answerer | None,
                        read_values: ValueReader | None = None, *,
                        frame_bytes: int = EXCHANGE_FRAME_BYTES
                        ) -> Callable[[Request | BaseException | EveryRank], Part]:
    """The exchange of requests and parts on ``group``: one gather, then one scatter.

    Group rank 0 holds ``server``; every rank of the group calls the returned function
    once, with its request, or with the error that kept it from making one (it still
    takes part, so no rank waits for it; the error is raised on it after the scatter),
    or with an :class:`EveryRank` error: that one (the lowest rank's), or an error on
    rank 0 while answering (``read_values`` included: a small item's file missing or
    damaged), is raised on every rank, before any rank reads a byte (an
    :class:`EveryRank`'s as :class:`RanksFailed`, holding it).

    Both directions send fixed frames (:data:`EXCHANGE_FRAME_BYTES` of pickle and its
    size; ``frame_bytes``, the same on every rank, for the parts), so a restore makes
    two collectives here, where DCP's object collectives make four (an all-gather of
    the sizes, whose messages grow with the group, then the gather; the sizes
    scattered, then the parts). A request longer than a frame is asked for in the
    scatter's frame: every rank then sends its rest in a second gather and gets its
    part in a second scatter; a part longer than a frame comes in two scatters.
    """

    def exchange(request: Request | BaseException | EveryRank) -> Part:
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        source = 0 if group is None else dist.get_global_rank(group, 0)
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        frames = _gather(_frame(data, EXCHANGE_FRAME_BYTES), rank, world, source, group)
        replies: list[Any] | None = None
        rest = 0
        if rank == 0:
            assert frames is not None
            sizes = [int.from_bytes(frame[:_SIZE_BYTES], "little") for frame in frames]
            rest = max(sizes) - EXCHANGE_FRAME_BYTES
            if rest <= 0:
                replies = _answer(server, frames, sizes, read_values, world)
        asked, reply = _scatter(replies, rank, world, source, group, rest=max(rest, 0),
                                frame_bytes=frame_bytes)
        if asked:  # a request did not fit its frame: the rests, then the parts
            more = _gather(_padded(data[EXCHANGE_FRAME_BYTES:], asked), rank, world, source,
                           group)
            if rank == 0:
                assert frames is not None and more is not None
                replies = _answer(server, [frame + extra for frame, extra in zip(
                    frames, more, strict=True)], sizes, read_values, world)
            _, reply = _scatter(replies, rank, world, source, group, rest=0,
                                frame_bytes=frame_bytes)
        if isinstance(reply, EveryRank):
            raise RanksFailed(reply.error)
        if isinstance(request, BaseException):
            raise request
        if isinstance(reply, BaseException):
            raise reply
        return reply  # type: ignore[no-any-return]

    return exchange


@dataclasses.dataclass(frozen=True)
class EveryRank:
    """A rank's failure sent in the exchange instead of its request, for every rank to raise.

    A restore's check of the rank's share of the files (``verify_share``): rank 0 answers
    every rank with the lowest rank's, so that no rank reads a byte of a checkpoint
    another rank found damaged, and no agreement of its own is needed.
    """

    error: BaseException


class RanksFailed(Exception):
    """What the exchange raises on every rank for an :class:`EveryRank` failure.

    The loader raises :attr:`error` itself, as it was raised on its rank (DCP wraps what
    a planner raises).
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _answer(server: Answerer | None, frames: list[bytes], sizes: list[int],
            read_values: ValueReader | None, world: int) -> list[Any]:
    """Rank 0's replies to the gathered requests (or its error, for every rank)."""
    try:
        if server is None:
            raise CorruptCheckpointError(
                "the rank that read the checkpoint's metadata holds none to share")
        gathered = [pickle.loads(frame[_SIZE_BYTES:_SIZE_BYTES + size])
                    for frame, size in zip(frames, sizes, strict=True)]
        failed = next((request for request in gathered if isinstance(request, EveryRank)),
                      None)
        if failed is not None:  # the lowest such rank's error, on every rank
            return [failed] * world
        return list(server.parts_for(gathered, read_values))
    except Exception as error:  # noqa: BLE001 - raised on every rank by the exchange
        return [error] * world


def _padded(data: bytes, length: int) -> torch.Tensor:
    """A uint8 tensor of ``length`` bytes: ``data``, then zeros."""
    tensor = torch.zeros(length, dtype=torch.uint8)
    if data:
        tensor[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


def _frame(data: bytes, length: int) -> torch.Tensor:
    """``data``'s size (8 bytes, little-endian), then its first ``length`` bytes."""
    return _padded(len(data).to_bytes(_SIZE_BYTES, "little") + data[:length],
                   _SIZE_BYTES + length)


def _gather(tensor: torch.Tensor, rank: int, world: int, source: int,
            group: dist.ProcessGroup | None) -> list[bytes] | None:
    """Every rank's ``tensor`` (all of one length) as bytes on group rank 0; None elsewhere."""
    into = [torch.zeros_like(tensor) for _ in range(world)] if rank == 0 else None
    dist.gather(tensor, into, dst=source, group=group)
    return None if into is None else [got.numpy().tobytes() for got in into]


def _scatter(values: list[Any] | None, rank: int, world: int, source: int,
             group: dist.ProcessGroup | None, *, rest: int, frame_bytes: int
             ) -> tuple[int, Any]:
    """Group rank 0's ``values[r]`` on each rank ``r``, or its ask for ``rest`` more bytes.

    Tensor collectives (``dist.scatter``), not DCP's object scatter: a load that plans
    locally runs none of DCP's plan collectives. A value given to several ranks (one
    object) is pickled once. One scatter of fixed frames (a header, then the first
    ``frame_bytes`` of the pickle); a second for what longer pickles hold past that.

    Returns:
        ``(rest, None)`` when rank 0 asks every rank for ``rest`` more bytes of its
        request, else ``(0, value)``.
    """
    pickles: list[bytes] = []
    if rank == 0 and values is not None:
        pickled: dict[int, bytes] = {}
        for value in values:
            data = pickled.get(id(value))
            if data is None:
                data = pickled[id(value)] = pickle.dumps(value,
                                                         protocol=pickle.HIGHEST_PROTOCOL)
            pickles.append(data)
    header_bytes = _HEADER_WORDS * _SIZE_BYTES
    longest = max((len(data) for data in pickles), default=0)
    frames = None
    if rank == 0:
        frames = []
        for number in range(world):
            data = pickles[number] if pickles else b""
            header = b"".join(word.to_bytes(_SIZE_BYTES, "little")
                              for word in (len(data), longest, rest))
            frames.append(_padded(header + data[:frame_bytes],
                                  header_bytes + frame_bytes))
    mine = torch.zeros(header_bytes + frame_bytes, dtype=torch.uint8)
    dist.scatter(mine, frames, src=source, group=group)
    received = mine.numpy().tobytes()
    size, longest, asked = (int.from_bytes(received[i:i + _SIZE_BYTES], "little")
                            for i in range(0, header_bytes, _SIZE_BYTES))
    if asked:
        return asked, None
    body = received[header_bytes:]
    if longest > frame_bytes:
        extra = longest - frame_bytes
        rests = None if rank != 0 else [_padded(data[frame_bytes:], extra)
                                        for data in pickles]
        tail = torch.zeros(extra, dtype=torch.uint8)
        dist.scatter(tail, rests, src=source, group=group)
        body += tail.numpy().tobytes()
    return 0, pickle.loads(body[:size])


def serve_values(plan: LoadPlan, planner: LoadPlanner, values: Mapping[ItemKey, Any]
                 ) -> LoadPlan:
    """Load the items of ``plan`` that ``values`` holds (a :class:`Part`'s); return the rest.

    A tensor item is copied from its stored chunk (narrowed as DCP's reader narrows what
    it reads), a value is loaded by the planner from its bytes (resumekit's planner loads
    it without unrestricted unpickling), so they land as if read from their files.

    Raises:
        CheckpointLoadError: A read item does not fit the value received for it. Rank 0
            read that value whole into a tensor of the stored chunk's size, from the same
            ``.metadata`` this rank planned its reads by: a misfit is a fault of the code,
            never damage to the checkpoint (nothing is set aside for it).
    """
    if not values:
        return plan
    rest: list[ReadItem] = []
    for item in plan.items:
        index = item.storage_index
        key: ItemKey = (index.fqn, None if index.offset is None
                        else tuple(int(o) for o in index.offset))
        if key not in values:
            rest.append(item)
            continue
        value = values[key]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(value))
            continue
        source = _unpacked(value, index.fqn)
        received = tuple(source.size())
        try:
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                      strict=True)):
                source = source.narrow(dim, int(start), int(length))
        except (RuntimeError, IndexError, ValueError) as error:
            raise _misfit(index.fqn, f"its read of {list(item.lengths)} at "
                          f"{list(item.storage_offsets)} is not within the value received, "
                          f"of {received} ({error})") from error
        target = planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise _misfit(index.fqn, f"the value received for it has {tuple(source.size())} "
                          f"elements where its read wants {tuple(target.size())}")
        target.copy_(source)
        planner.commit_tensor(item, target)
    return dataclasses.replace(plan, items=rest)


def _misfit(key: str, cause: str) -> CheckpointLoadError:
    """A value received from rank 0 that does not fit its read: a code fault, not damage."""
    cause = f"{key}: {cause}"
    return CheckpointLoadError(
        f"{cause}: rank 0 read it whole, at the stored chunk's size, from the .metadata "
        "this rank planned by, so this is a fault of the code, not damage to the "
        "checkpoint (nothing is set aside)",
        path=None, step=None, rank=None, file=None, cause=cause, key=key)


def packed(value: Any) -> Any:
    """A read item as it travels: a tensor as ``(dtype, shape, bytes)``, bytes as they are.

    Unpickling a pickled tensor costs about 0.2 ms, its bytes about a microsecond.
    """
    if not isinstance(value, torch.Tensor):
        return bytes(value)
    flat = value.detach().contiguous().reshape(-1)
    return (str(value.dtype).removeprefix("torch."), tuple(value.shape),
            flat.view(torch.uint8).numpy().tobytes())


def _unpacked(value: Any, key: str) -> torch.Tensor:
    """The tensor of :func:`packed`'s ``(dtype, shape, bytes)``.

    ``value`` was built by rank 0's :func:`packed` from a tensor it had read and checked,
    and travelled over the process group: whatever the file held, it decodes. One that
    does not is a fault of the code or the transport, never damage to the checkpoint, so
    restore must not set the checkpoint aside for it.

    Raises:
        CheckpointLoadError: It is not one (naming ``key``).
    """
    try:
        name, shape, data = value
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(name)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    except (TypeError, ValueError, RuntimeError, AttributeError) as error:
        cause = f"{key}: the value received for it is not a tensor's bytes ({error})"
        raise CheckpointLoadError(
            f"{cause}: rank 0 packs what it read and checked, so this is a fault of the "
            "code or the transport, not damage to the checkpoint (nothing is set aside)",
            path=None, step=None, rank=None, file=None, cause=cause, key=key) from error


def local_exchange(server: MetadataServer) -> Callable[[Request | BaseException], Part]:
    """The exchange of a rank that holds the whole metadata and plans alone."""

    def exchange(request: Request | BaseException) -> Part:
        if isinstance(request, BaseException):
            raise request
        return server.part_for(request)

    return exchange


def chunk_requests(chunks: Iterable[ChunkStorageMetadata]
                   ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``chunks`` as a request's list of ``(offsets, sizes)``."""
    return [(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
            for c in chunks]
