"""Reading each byte once: ranks that need the same stored bytes split the reads.

With replicated parameters (DDP: every rank holds the whole model and optimizer; FSDP2's
HSDP: each replica group holds the same shards) every rank's load plan asks for the same
pieces of the same stored items, and reading them on every rank multiplies the store's
traffic by the number of replicas. :class:`SharedReads` finds those pieces from the plans
themselves: two read items naming the same stored item and the same piece of it (DCP's
storage index, storage offsets and lengths) read the same bytes, whatever the destination
is: a plain tensor (DCP's save kept one copy of it, which every rank reads), a ``DTensor``
shard replicated over a mesh dimension, or a tensor-parallel replica. Nothing has to be
declared, and no declaration is trusted.

What every rank of the group runs, in the same order:

1. one all-gather of the pieces each rank's plan wants that are worth sharing (tensors of
   at least :data:`SHARED_MIN_BYTES`; a 16-byte key and a size each). A rank that failed
   before reading (its planning, the fit check) sends its error instead, and every rank
   raises it;
2. each piece wanted by several ranks gets one reader among them, the least loaded in
   bytes so far, so each of R replicas reads about 1/R of what they share. Every rank
   reads the pieces it was given and the ones nobody shares with it, checked as always;
3. one all-gather of the outcome: a failure on a reading rank (a checksum mismatch, a
   missing file) is raised on every rank, naming the file, before any rank waits for
   bytes from it;
4. each reader sends its pieces: a broadcast when every rank of the group wants them,
   point-to-point sends to the others otherwise (HSDP's replica groups); pieces smaller
   than :data:`BUCKET_BYTES` travel packed together.

The pieces travel as raw bytes, so what a rank receives is bit-identical to what it would
have read. The collectives run on the load's process group (the checkpoint group, gloo,
whose timeout is ``checkpoint_timeout``), like the agreement a restore already runs, so a
restore absorbs skew between ranks as before.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from resumekit.store.coordination import ProcessGroupCoordinator

__all__ = ["BUCKET_BYTES", "SHARED_MIN_BYTES", "ReadStats", "SharedReads", "assign_readers"]

logger = logging.getLogger("resumekit")

SHARED_MIN_BYTES = 64 << 10
"""Pieces smaller than this are read by every rank that wants them: the raw format packs
items below this size into shared regions read whole, so splitting them saves nothing."""

BUCKET_BYTES = 64 << 20
"""Pieces up to this size are packed into buffers of about this size to be sent."""

_ALIGN = 16  # offsets of pieces in a packed buffer: any dtype can view its bytes in place

Key = int
"""A piece of a stored item: XXH3-128 of its storage index, offsets and lengths."""


@dataclasses.dataclass
class ReadStats:
    """What one rank's load read itself and exchanged (tensor bytes of planned pieces).

    Attributes:
        read_bytes: Bytes of tensor pieces this rank read from the store.
        received_bytes: Bytes of pieces received from the ranks that read them.
        sent_bytes: Bytes of pieces sent to other ranks (each receiver counted once).
        shared_pieces: Pieces of this rank's plan that more than one rank wanted.
    """

    read_bytes: int = 0
    received_bytes: int = 0
    sent_bytes: int = 0
    shared_pieces: int = 0


@dataclasses.dataclass(frozen=True)
class _Offer:
    """What one rank wants to share: the checkpoint it reads and its pieces."""

    source: str
    pieces: tuple[tuple[Key, int], ...]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Pieces one reader sends to the other ranks that want them, in one buffer.

    Attributes:
        reader: Group rank that read the pieces.
        members: Group ranks taking part (the reader included), ascending.
        pieces: ``(key, bytes)`` in the buffer's order.
    """

    reader: int
    members: tuple[int, ...]
    pieces: tuple[tuple[Key, int], ...]


def assign_readers(offers: Sequence[Iterable[tuple[Key, int]]], *,
                   bucket_bytes: int = BUCKET_BYTES) -> tuple[dict[Key, int], list[Transfer]]:
    """Give each piece wanted by several ranks one reader, and plan the sending.

    Deterministic: every rank computes it from the same gathered offers and gets the same
    answer. A piece goes to the rank, among those that want it, that reads the fewest bytes
    so far (what nobody shares with it counts), largest pieces first; ties go to the lower
    rank.

    Args:
        offers: Per group rank, the ``(key, bytes)`` of the pieces it could share.
        bucket_bytes: Pieces are packed into transfers of up to this many bytes (a larger
            piece travels alone).

    Returns:
        ``{key: reader}`` for every piece wanted by more than one rank, and the transfers
        in the order every rank runs them.
    """
    wanted: dict[Key, list[int]] = {}
    size: dict[Key, int] = {}
    for rank, pieces in enumerate(offers):
        for key, length in pieces:
            wanted.setdefault(key, []).append(rank)
            size[key] = length
    load = [0] * len(offers)
    for key, ranks in wanted.items():
        if len(ranks) == 1:
            load[ranks[0]] += size[key]
    readers: dict[Key, int] = {}
    for key in sorted((k for k, ranks in wanted.items() if len(ranks) > 1),
                      key=lambda k: (-size[k], k)):
        reader = min(wanted[key], key=lambda r: (load[r], r))
        readers[key] = reader
        load[reader] += size[key]
    groups: dict[tuple[tuple[int, ...], int], list[Key]] = {}
    for key, reader in readers.items():
        groups.setdefault((tuple(sorted(wanted[key])), reader), []).append(key)
    transfers: list[Transfer] = []
    for (members, reader), keys in sorted(groups.items()):
        bucket: list[tuple[Key, int]] = []
        filled = 0
        for key in sorted(keys, key=lambda k: (-size[k], k)):
            length = _aligned(size[key])
            if bucket and filled + length > bucket_bytes:
                transfers.append(Transfer(reader, members, tuple(bucket)))
                bucket, filled = [], 0
            bucket.append((key, size[key]))
            filled += length
        if bucket:
            transfers.append(Transfer(reader, members, tuple(bucket)))
    return readers, transfers


def piece_key(item: ReadItem) -> Key:
    """The key of the stored bytes ``item`` reads: the same on every rank that reads them."""
    index = item.storage_index
    text = repr((index.fqn, tuple(index.offset or ()), tuple(item.storage_offsets),
                 tuple(item.lengths)))
    return int(xxhash.xxh3_128_intdigest(text.encode()))


class SharedReads:
    """One load's reads, split among the ranks of ``group`` that want the same bytes.

    Give it to the reader (:func:`resumekit.tensors.reader.make_reader`'s ``shared``): the
    reader's ``read_data`` then runs :meth:`read`. A rank whose load fails outside
    ``read_data`` (before it, in planning) calls :meth:`settle` with its error, so the ranks
    waiting in ``read_data`` raise it too instead of waiting for bytes that will not come.

    Args:
        group: The load's process group (more than one rank).
        min_bytes: Pieces below this are read by every rank that wants them.
        bucket_bytes: Pieces up to this are sent packed in buffers of about this size.

    Attributes:
        stats: What this rank read, received and sent (after the load).
    """

    def __init__(self, group: dist.ProcessGroup, *, min_bytes: int = SHARED_MIN_BYTES,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.coordinator = ProcessGroupCoordinator(group)
        self.min_bytes = min_bytes
        self.bucket_bytes = bucket_bytes
        self.stats = ReadStats()
        self._agreements_left = 2

    def read(self, plan: LoadPlan, planner: LoadPlanner,
             read: Callable[[LoadPlan, LoadPlanner], None], *, source: str) -> None:
        """Read this rank's share of ``plan`` with ``read``, then exchange the rest.

        Args:
            plan: This rank's load plan.
            planner: Its planner (destinations are resolved through it).
            read: Reads a plan's items into the planner's destinations (the reader's own
                ``read_data``), raising on any failure.
            source: What identifies the checkpoint (the digest of its ``.metadata``): ranks
                share reads only when every rank reads the same one.

        Raises:
            ResumekitError: Any rank's failure to plan or read (the lowest rank's), on
                every rank; :class:`~resumekit.errors.CoordinationError` when the group
                itself breaks.
        """
        pieces: dict[Key, ReadItem] = {}
        sizes: dict[int, int] = {}  # id(item): bytes, for every tensor item of the plan
        offer: tuple[str, Any]
        try:
            sizes = {id(item): _nbytes(planner, item) for item in plan.items
                     if item.type != LoadItemType.BYTE_IO}
            pieces = self._pieces(plan, sizes)
            offer = ("ok", _Offer(source, tuple(
                (key, sizes[id(item)]) for key, item in pieces.items())))
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            offer = ("error", error)
        offers: list[_Offer] = self._agree(offer)
        transfers: list[Transfer] = []
        try:
            if any(other.source != offers[0].source for other in offers):
                offers = [_Offer(o.source, ()) for o in offers]  # not one checkpoint
            readers, transfers = assign_readers([o.pieces for o in offers],
                                                bucket_bytes=self.bucket_bytes)
            rank = self.coordinator.rank
            skipped = {id(item) for key, item in pieces.items()
                       if readers.get(key, rank) != rank}
            own = [item for item in plan.items if id(item) not in skipped]
            self.stats.shared_pieces = sum(key in readers for key in pieces)
            self.stats.read_bytes = sum(sizes.get(id(item), 0) for item in own)
            read(dataclasses.replace(plan, items=own), planner)
            outcome: tuple[str, Any] = ("ok", None)
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            outcome = ("error", error)
        self._agree(outcome)
        self._exchange(transfers, pieces, planner)
        logger.debug("shared reads: read %d bytes, received %d, sent %d (%d shared pieces)",
                     self.stats.read_bytes, self.stats.received_bytes,
                     self.stats.sent_bytes, self.stats.shared_pieces)

    def settle(self, error: BaseException) -> None:
        """After ``error`` outside :meth:`read`: tell the other ranks, unless told already.

        Raises:
            ResumekitError: The lowest failing rank's error, when there are agreements
                left to run (the caller raises its own otherwise).
        """
        if self._agreements_left > 0:
            self._agree(("error", error))

    def _agree(self, outcome: tuple[str, Any]) -> Any:
        """All-gather ``outcome``; raise the first error, else return every rank's value."""
        self._agreements_left -= 1
        try:
            gathered = self.coordinator.all_gather(outcome)
        except BaseException:
            self._agreements_left = 0
            raise
        for status, value in gathered:
            if status == "error":
                self._agreements_left = 0
                raise value
        return [value for _, value in gathered]

    def _pieces(self, plan: LoadPlan, sizes: dict[int, int]) -> dict[Key, ReadItem]:
        """The tensor pieces of ``plan`` worth sharing (each once in the plan), by key."""
        found: dict[Key, ReadItem] = {}
        repeated: set[Key] = set()
        for item in plan.items:
            if sizes.get(id(item), 0) < self.min_bytes:
                continue
            key = piece_key(item)
            if key in found:
                repeated.add(key)
            found[key] = item
        for key in repeated:  # read twice into two destinations: left to this rank
            del found[key]
        return found

    def _exchange(self, transfers: list[Transfer], pieces: dict[Key, ReadItem],
                  planner: LoadPlanner) -> None:
        rank = self.coordinator.rank
        for transfer in transfers:
            if rank not in transfer.members:
                continue
            items = [pieces[key] for key, _ in transfer.pieces]
            if rank == transfer.reader:
                buffer = _packed(planner, items)
                self._send(buffer, transfer)
                self.stats.sent_bytes += buffer.numel() * (len(transfer.members) - 1)
                continue
            direct = _byte_view(planner.resolve_tensor(items[0]).detach()) \
                if len(items) == 1 else None
            size = transfer.pieces[0][1] if len(items) == 1 else _layout(planner, items)[1]
            buffer = direct if direct is not None else torch.empty(size, dtype=torch.uint8)
            self._send(buffer, transfer)
            self.stats.received_bytes += sum(length for _, length in transfer.pieces)
            if direct is None:
                _unpack(planner, items, buffer)
            for item in items:
                planner.commit_tensor(item, planner.resolve_tensor(item).detach())

    def _send(self, buffer: torch.Tensor, transfer: Transfer) -> None:
        """The reader's ``buffer`` into every member's (a broadcast, or sends)."""
        source = self._global(transfer.reader)
        rank = self.coordinator.rank
        collective = "broadcast"
        try:
            if len(transfer.members) == self.coordinator.world_size:
                dist.broadcast(buffer, src=source, group=self.group)
            elif rank == transfer.reader:
                collective = "send"
                works = [dist.isend(buffer, dst=self._global(member), group=self.group)
                         for member in transfer.members if member != rank]
                for work in works:
                    if work is not None:
                        work.wait()
            else:
                collective = "recv"
                dist.recv(buffer, src=source, group=self.group)
        except RuntimeError as error:  # gloo's peer-closed and timeout errors
            raise self.coordinator.failure(collective, error) from error

    def _global(self, group_rank: int) -> int:
        return int(dist.get_global_rank(self.group, group_rank))


def _nbytes(planner: LoadPlanner, item: ReadItem) -> int:
    """Bytes of the piece ``item`` reads (its destination's dtype is the stored one)."""
    target = planner.resolve_tensor(item)
    return int(target.numel()) * target.element_size()


def _aligned(length: int) -> int:
    return -(-length // _ALIGN) * _ALIGN


def _layout(planner: LoadPlanner, items: Sequence[ReadItem]) -> tuple[list[int], int]:
    """Offsets of ``items``' pieces in a packed buffer, and its size."""
    offsets, end = [], 0
    for item in items:
        offsets.append(end)
        end += _aligned(_nbytes(planner, item))
    return offsets, end


def _byte_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as a flat uint8 CPU view, or None when they are not one range."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    return tensor.reshape(-1).view(torch.uint8)


def _packed(planner: LoadPlanner, items: Sequence[ReadItem]) -> torch.Tensor:
    """The reader's pieces (already read into its destinations) in one uint8 buffer."""
    if len(items) == 1:
        target = planner.resolve_tensor(items[0]).detach()
        view = _byte_view(target)
        if view is None:
            view = target.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        return view
    offsets, size = _layout(planner, items)
    buffer = torch.empty(size, dtype=torch.uint8)
    for item, offset in zip(items, offsets, strict=True):
        target = planner.resolve_tensor(item).detach()
        length = int(target.numel()) * target.element_size()
        buffer[offset:offset + length].view(target.dtype).view(target.shape).copy_(target)
    return buffer


def _unpack(planner: LoadPlanner, items: Sequence[ReadItem], buffer: torch.Tensor) -> None:
    """Copy each piece of a received ``buffer`` into its destination."""
    if len(items) == 1:
        offsets = [0]
    else:
        offsets, _ = _layout(planner, items)
    for item, offset in zip(items, offsets, strict=True):
        target = planner.resolve_tensor(item).detach()
        length = int(target.numel()) * target.element_size()
        target.copy_(buffer[offset:offset + length].view(target.dtype).view(target.shape))
