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
   bytes so far, so each of R replicas reads about 1/R of what they share
   (:func:`assign_readers`, the same answer on every rank);
3. in rounds of about :data:`ROUND_BYTES` per reader: each reader reads (and verifies)
   its pieces of the round; one all-gather of the outcome, so a failure on a reading rank
   (a checksum mismatch, a missing file) is raised on every rank, naming the file, before
   any rank waits for bytes from it; then the round's pieces start travelling
   asynchronously while the next round is read: a broadcast when every rank of the group
   wants them, point-to-point sends within the replica group otherwise (HSDP), pieces of
   :data:`ALONE_BYTES` or more straight from the reader's destination into the others',
   smaller ones packed together;
4. a last round reads what nobody shares, and its outcome is agreed on the same way.

When nothing is shared (FSDP without replicas) step 1 is the only collective.

The pieces travel as raw bytes, so what a rank receives is bit-identical to what it would
have read. The collectives run on the load's process group (the checkpoint group, gloo,
whose timeout is ``checkpoint_timeout``), like the agreement a restore already runs, so a
restore absorbs skew between ranks as before.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from resumekit.store.coordination import ProcessGroupCoordinator

__all__ = ["ALONE_BYTES", "BUCKET_BYTES", "ROUND_BYTES", "SHARED_MIN_BYTES", "WINDOW_BYTES",
           "ReadStats", "SharedReads", "Transfer", "assign_readers", "cut_rounds"]

logger = logging.getLogger("resumekit")

SHARED_MIN_BYTES = 64 << 10
"""Pieces smaller than this are read by every rank that wants them: the raw format packs
items below this size into shared regions read whole, so splitting them saves nothing."""

ALONE_BYTES = 1 << 20
"""Pieces of at least this size are sent alone, straight from the reader's destination into
the others' (no copy); smaller ones are packed together."""

BUCKET_BYTES = 16 << 20
"""Small pieces travel packed in buffers of up to this size."""

ROUND_BYTES = 64 << 20
"""Bytes each reader reads in a round before the ranks agree and its transfers start."""

WINDOW_BYTES = 1 << 30
"""Bytes of transfers a rank has started and not finished (more waits for the oldest): what
a rank holds beyond its destinations is at most this much of packed or staged buffers."""

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
                   bucket_bytes: int = BUCKET_BYTES, alone_bytes: int = ALONE_BYTES,
                   ) -> tuple[dict[Key, int], list[Transfer]]:
    """Give each piece wanted by several ranks one reader, and plan the sending.

    Deterministic: every rank computes it from the same gathered offers and gets the same
    answer. A piece goes to the rank, among those that want it, that reads the fewest bytes
    so far (what nobody shares with it counts), largest pieces first; ties go to the lower
    rank.

    Args:
        offers: Per group rank, the ``(key, bytes)`` of the pieces it could share.
        bucket_bytes: Pieces below ``alone_bytes`` are packed into transfers of up to this
            many bytes.
        alone_bytes: Pieces of at least this size travel alone.

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
    numbered: list[tuple[int, tuple[int, ...], int, Transfer]] = []
    for (members, reader), keys in sorted(groups.items()):
        bucket: list[tuple[Key, int]] = []
        filled = 0
        own: list[Transfer] = []
        for key in sorted(keys, key=lambda k: (-size[k], k)):
            if size[key] >= alone_bytes:
                own.append(Transfer(reader, members, ((key, size[key]),)))
                continue
            length = _aligned(size[key])
            if bucket and filled + length > bucket_bytes:
                own.append(Transfer(reader, members, tuple(bucket)))
                bucket, filled = [], 0
            bucket.append((key, size[key]))
            filled += length
        if bucket:
            own.append(Transfer(reader, members, tuple(bucket)))
        numbered += [(number, members, reader, t) for number, t in enumerate(own)]
    # Interleaved by reader (each reader's first, then each one's second, ...): the
    # readers' sends run at once, each rank sending while it receives.
    numbered.sort(key=lambda entry: entry[:3])
    return readers, [transfer for *_, transfer in numbered]


def piece_key(item: ReadItem) -> Key:
    """The key of the stored bytes ``item`` reads: the same on every rank that reads them."""
    index = item.storage_index
    text = repr((index.fqn, tuple(index.offset or ()), tuple(item.storage_offsets),
                 tuple(item.lengths)))
    return int(xxhash.xxh3_128_intdigest(text.encode()))


class SharedReads:
    """One load's reads, split among the ranks of ``group`` that want the same bytes.

    Give it to the reader (:func:`resumekit.tensors.reader.make_reader`'s ``shared``): the
    reader's ``read_data`` then runs :meth:`read`. A rank whose load fails before
    ``read_data`` (in planning) calls :meth:`settle` with its error, so the ranks waiting
    in ``read_data`` raise it too instead of waiting for bytes that will not come.

    Args:
        group: The load's process group (more than one rank).
        min_bytes: Pieces below this are read by every rank that wants them.
        round_bytes: Bytes each reader reads in a round, before an agreement.
        window_bytes: Bytes of transfers started and not yet finished, at most (one
            larger transfer runs alone).

    Attributes:
        stats: What this rank read, received and sent (after the load).
    """

    def __init__(self, group: dist.ProcessGroup, *, min_bytes: int = SHARED_MIN_BYTES,
                 round_bytes: int = ROUND_BYTES, window_bytes: int = WINDOW_BYTES) -> None:
        self.group = group
        self.coordinator = ProcessGroupCoordinator(group)
        self.min_bytes = min_bytes
        self.round_bytes = round_bytes
        self.window_bytes = window_bytes
        self.stats = ReadStats()
        self._offered = False
        self._alone = False
        self._pending: collections.deque[_Pending] = collections.deque()
        self._in_flight = 0

    @staticmethod
    def can_run_on(group: dist.ProcessGroup) -> bool:
        """Whether ``group`` moves CPU tensors (gloo, as the checkpoint group always is).

        A group given by the caller may be NCCL-only; its load then reads on every rank.
        """
        return "gloo" in str(dist.get_backend(group))

    def read_alone(self) -> None:
        """Every rank reads only bytes no other rank wants: skip the agreement on offers.

        Called on every rank alike, before :meth:`read`, when the metadata parts said so
        (:attr:`resumekit.tensors.metadata_parts.Part.alone`): :meth:`read` then reads
        the plan with no collective, and :meth:`settle` sends nothing; a failure is
        every rank's at the load's own agreement.
        """
        self._offered = True
        self._alone = True

    def read(self, plan: LoadPlan, planner: LoadPlanner,
             read: Callable[[LoadPlan, LoadPlanner], None], *, source: str) -> None:
        """Read this rank's share of ``plan`` with ``read`` and exchange the rest, in rounds.

        Round r: every reader reads its r-th transfer's pieces, all ranks agree on the
        outcome, then that round's transfers start (asynchronously) while the next round
        is read; the last round reads what nobody shares. A failure in round r is raised
        on every rank at round r's agreement, before any transfer of the failed reads
        starts (transfers of earlier rounds, agreed good, are finished first).

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
        if self._alone:
            self.stats.read_bytes = sum(_nbytes(planner, item) for item in plan.items
                                        if item.type != LoadItemType.BYTE_IO)
            read(plan, planner)
            return
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
        self._offered = True
        offers: list[_Offer] = self._agree(offer)
        self._read_in_rounds(plan, planner, read, offers, (pieces, sizes))

    def _read_in_rounds(self, plan: LoadPlan, planner: LoadPlanner,
                        read: Callable[[LoadPlan, LoadPlanner], None], offers: list[_Offer],
                        mine: tuple[dict[Key, ReadItem], dict[int, int]]) -> None:
        pieces, sizes = mine
        rounds, rest, failure = self._schedule(plan, offers, pieces, sizes)
        if not rounds:  # nothing shared (FSDP): no rank waits for another's reads
            if failure is not None:
                raise failure
            read(dataclasses.replace(plan, items=rest), planner)
            return
        rank = self.coordinator.rank
        for number in range(len(rounds) + 1):
            if failure is None:
                items = rest if number == len(rounds) else [
                    pieces[key] for t in rounds[number] if t.reader == rank
                    for key, _ in t.pieces]
                if items is not rest:
                    self.stats.read_bytes += sum(sizes[id(item)] for item in items)
                failure = _failure_of(read, dataclasses.replace(plan, items=items), planner)
            try:
                self._agree(("ok", None) if failure is None else ("error", failure))
            except BaseException:
                self._drain()
                raise
            for transfer in rounds[number] if number < len(rounds) else ():
                if rank in transfer.members:
                    self._start(transfer, [pieces[key] for key, _ in transfer.pieces],
                                planner)
        while self._pending:
            self._finish(self._pending.popleft(), planner)
        logger.debug("shared reads: read %d bytes, received %d, sent %d (%d shared pieces, "
                     "%d rounds)", self.stats.read_bytes, self.stats.received_bytes,
                     self.stats.sent_bytes, self.stats.shared_pieces, len(rounds))

    def _schedule(self, plan: LoadPlan, offers: list[_Offer], pieces: dict[Key, ReadItem],
                  sizes: dict[int, int]
                  ) -> tuple[list[list[Transfer]], list[ReadItem], Exception | None]:
        """The agreed rounds of transfers, the items this rank reads itself, and a failure.

        From agreed offers only, so every rank runs the same rounds and agreements.
        """
        if any(other.source != offers[0].source for other in offers):
            offers = [_Offer(o.source, ()) for o in offers]  # not one checkpoint: no sharing
        readers, transfers = assign_readers([o.pieces for o in offers])
        rounds = cut_rounds(transfers, self.round_bytes)
        try:
            shared = {id(item) for key, item in pieces.items() if key in readers}
            rest = [item for item in plan.items if id(item) not in shared]
            self.stats.shared_pieces = len(shared)
            self.stats.read_bytes = sum(sizes.get(id(item), 0) for item in rest)
        except Exception as error:  # noqa: BLE001 - every rank raises it, in the rounds
            return rounds, [], error
        return rounds, rest, None

    def settle(self, error: BaseException) -> None:
        """After ``error`` before :meth:`read`: tell the ranks waiting in it.

        Raises:
            ResumekitError: The lowest failing rank's error, when this rank had not yet
                offered its pieces (the caller raises its own otherwise).
        """
        if not self._offered:
            self._offered = True
            self._agree(("error", error))

    def _agree(self, outcome: tuple[str, Any]) -> Any:
        """All-gather ``outcome``; raise the first error, else return every rank's value."""
        gathered = self.coordinator.all_gather(outcome)
        for status, value in gathered:
            if status == "error":
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

    def _start(self, transfer: Transfer, items: list[ReadItem], planner: LoadPlanner) -> None:
        """Start one transfer this rank takes part in.

        While more than ``window_bytes`` are in flight, the oldest are finished first.
        """
        rank = self.coordinator.rank
        direct = None
        if rank == transfer.reader:
            buffer = _packed(planner, items)
            self.stats.sent_bytes += buffer.numel() * (len(transfer.members) - 1)
        else:
            if len(items) == 1:
                direct = _byte_view(planner.resolve_tensor(items[0]).detach())
            size = transfer.pieces[0][1] if len(items) == 1 else _layout(planner, items)[1]
            buffer = direct if direct is not None else torch.empty(size, dtype=torch.uint8)
            self.stats.received_bytes += sum(length for _, length in transfer.pieces)
        while self._pending and self._in_flight + buffer.numel() > self.window_bytes:
            self._finish(self._pending.popleft(), planner)
        source = self._global(transfer.reader)
        try:
            if len(transfer.members) == self.coordinator.world_size:
                works = [dist.broadcast(buffer, src=source, group=self.group, async_op=True)]
            elif rank == transfer.reader:
                works = [dist.isend(buffer, dst=self._global(member), group=self.group)
                         for member in transfer.members if member != rank]
            else:
                works = [dist.irecv(buffer, src=source, group=self.group)]
        except RuntimeError as error:  # gloo's peer-closed and timeout errors
            raise self.coordinator.failure("broadcast", error) from error
        self._pending.append(_Pending(transfer, items, buffer, direct is not None,
                                      [work for work in works if work is not None]))
        self._in_flight += buffer.numel()

    def _finish(self, pending: _Pending, planner: LoadPlanner | None) -> None:
        """Wait for one transfer; on a receiver, put its pieces in place (with a planner)."""
        self._in_flight -= pending.buffer.numel()
        try:
            for work in pending.works:
                work.wait()
        except RuntimeError as error:  # gloo's peer-closed and timeout errors
            raise self.coordinator.failure("broadcast", error) from error
        if planner is not None and pending.transfer.reader != self.coordinator.rank:
            if not pending.direct:
                _unpack(planner, pending.items, pending.buffer)
            for item in pending.items:
                planner.commit_tensor(item, planner.resolve_tensor(item).detach())

    def _drain(self) -> None:
        """Finish the transfers already started, before raising a later round's failure.

        They were agreed good, so every member runs them; their bytes are not put in place.
        """
        while self._pending:
            try:
                self._finish(self._pending.popleft(), None)
            except Exception:  # the failure being raised says more
                logger.debug("shared reads: a transfer failed while raising", exc_info=True)

    def _global(self, group_rank: int) -> int:
        return int(dist.get_global_rank(self.group, group_rank))


def cut_rounds(transfers: Sequence[Transfer], round_bytes: int = ROUND_BYTES
               ) -> list[list[Transfer]]:
    """``transfers`` (interleaved by reader) cut into rounds of about ``round_bytes`` each.

    Every rank cuts the same rounds, since the transfers are the same everywhere.
    """
    readers = len({transfer.reader for transfer in transfers})
    rounds: list[list[Transfer]] = []
    filled = 0
    for transfer in transfers:
        if not rounds or filled >= round_bytes * readers:
            rounds.append([])
            filled = 0
        rounds[-1].append(transfer)
        filled += sum(length for _, length in transfer.pieces)
    return rounds


@dataclasses.dataclass
class _Pending:
    """A transfer started and not yet waited for."""

    transfer: Transfer
    items: list[ReadItem]
    buffer: torch.Tensor
    direct: bool
    works: list[Any]


def _failure_of(read: Callable[[LoadPlan, LoadPlanner], None], plan: LoadPlan,
                planner: LoadPlanner) -> Exception | None:
    """Read ``plan`` (if it has items); the exception it raised, for every rank to raise."""
    try:
        if plan.items:
            read(plan, planner)
    except Exception as error:  # noqa: BLE001 - every rank raises it, at the agreement
        return error
    return None


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
