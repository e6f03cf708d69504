"""Peer replicas: each rank's node-local checkpoints, also kept by a rank on another node.

A node-local checkpoint (``<local_root>/rank_00003/step_.../``, see the local tier) is
lost with its node. Each rank therefore also sends its committed local step directories
to one *partner* on another node, who keeps them in ``<local_root>/replica_of_rank_00003/``
(a resumekit root like any other: the same files byte for byte, the manifest unchanged, so
its checksums verify the copy). Losing any one node then loses no step: every rank's copy
is either on its own node or on the next one.

Who keeps whose copies (:class:`Partners`): the ranks' nodes are all-gathered; nodes are
ordered by their lowest rank; a rank's partner is the rank with the same local index on
the *next* node (wrapping), where local index = position among its node's ranks in rank
order. When the next node has fewer ranks the index wraps there (``j mod len``): some of
its ranks then keep the copies of two (or more) ranks, and ranks of a node with more ranks
than the previous one keep none. A partner is never on its own node when there are two
nodes or more. When every rank shares one node there is no partner (``partner is None``):
replicas would not survive the loss of that node, and the caller says so.

A node is the host name (``socket.gethostname()``) unless the environment variable
``RESUMEKIT_NODE_NAME`` is set (read only when set, by :meth:`Partners.of`): tests and
single-machine drills name several "nodes" on one host with it; a cluster whose host
names do not tell its nodes apart (containers) can set it too.

The transfers (:func:`replicate`, :func:`fetch`) are collectives over the checkpoint
process group (gloo: CPU tensors of bytes, ``torch.distributed.isend``/``irecv``), one
sender and one receiver per step directory, all pairs at once::

    1. all-gather: each sender reads its committed manifest (its link checks, each file's
       size against it); what the transfers are (every rank must pass the same maps);
       any failure here raises on every rank before a byte moves
    2. each sender sends its manifest's bytes (their XXH3 came with step 1); the receiver
       checks them, parses them, and decides: a committed copy with the same manifest
       bytes is kept (nothing sent), another committed copy of that step is never
       overwritten (StepCollisionError), else it stages ``.<name>.tmp-<token>/`` with a
       writer record (host, pid, token; a crashed receiver's staging is then swept)
    3. all-gather of the decisions (any failure raises on every rank)
    4. the files, in the manifest's order, in chunks of at most CHUNK_BYTES: round k sends
       every pair's k-th chunk (the rounds of one pair follow from its manifest on both
       sides, so no size is ever sent), while a thread reads each sender's next chunk
       and writes each receiver's previous one; the sender hashes what it reads, the
       receiver what arrives, each file checked against the manifest's checksum as it
       ends. A
       failure mid-stream (a read or write error) does not stop the stream: the sender
       sends zeros for what it could not read, the receiver drains what it cannot write,
       so no peer is left waiting, and the failure is reported in step 5
    5. the receiver of a stream whose every file matched writes the manifest (durable,
       last), removes its writer record, fsyncs, renames the staging directory into
       place (the commit point: POSIX rename, as the commit protocol), fsyncs the root;
       :func:`replicate` then prunes that replica root to its newest ``keep`` steps; a
       staging directory that did not commit is removed
    6. all-gather of the outcomes: an error on any rank raises on every rank, naming the
       rank, the step and the file (the lowest failing rank's error class, every failing
       rank's message)

Memory: a rank holds two chunks per stream it sends or receives (a replicate: one
stream out, plus one in per rank it keeps copies of), never a whole file. A peer that
dies or hangs breaks a send or receive within the group's timeout, raised as the
:class:`~resumekit.errors.CoordinationError` of the store's coordinator (naming the
activity, this rank and its peers); the staging directory of this rank is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resumekit.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ResumekitError,
    StepCollisionError,
    StorageError,
)
from resumekit.local.roots import parse_sub_root, replica_root_name
from resumekit.store.catalog import link_problem, list_checkpoints, refuse_links
from resumekit.store.coordination import (
    Coordinator,
    ProcessGroupCoordinator,
    SingleProcess,
    activity,
)
from resumekit.store.layout import MANIFEST_NAME, WRITER_FILE, NameFormat
from resumekit.store.manifest import Checksum, Manifest, hex_digest, parse_manifest
from resumekit.store.newest import forget_newest_hint
from resumekit.store.recovery import sweep_dead_writers
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "CHUNK_BYTES",
    "NODE_NAME_ENV",
    "Partners",
    "fetch",
    "holdings",
    "node_name",
    "parse_replica_dir",
    "replica_dir",
    "replicate",
]

#: The environment variable naming this process's node (read only when set).
NODE_NAME_ENV = "RESUMEKIT_NODE_NAME"
#: The most bytes of a file one send (and one receive buffer) holds.
CHUNK_BYTES = 64 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]*$")


def replica_dir(rank: int) -> str:
    """The name of the sub-root of a local root holding ``rank``'s replicas.

    The naming rule is :mod:`resumekit.local.roots`'s (``replica_root_name``).

    Example:
        >>> replica_dir(7)
        'replica_of_rank_00007'
    """
    return replica_root_name(rank)


def parse_replica_dir(name: str) -> int | None:
    """The source rank of a :func:`replica_dir` name, else None.

    Example:
        >>> parse_replica_dir("replica_of_rank_00007"), parse_replica_dir("rank_00007")
        (7, None)
    """
    sub = parse_sub_root(name)
    return None if sub is None or sub.kind != "replica" else sub.rank


def node_name() -> str:
    """This process's node: ``$RESUMEKIT_NODE_NAME`` when set (non-empty), else the host name."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Partners:
    """Who keeps whose replicas, as every rank of the checkpoint group sees it.

    Ranks are ranks of the checkpoint process group.

    Attributes:
        rank: This process's rank.
        nodes: The node of each rank, by rank.
        partners: For each rank, the rank that keeps its replicas (None on one node).

    Example:
        >>> plan = Partners.plan(["a", "a", "b", "b"], rank=1)
        >>> plan.partner, plan.sources, plan.partners
        (3, [3], (2, 3, 0, 1))
    """

    rank: int
    nodes: tuple[str, ...]
    partners: tuple[int | None, ...]

    @classmethod
    def plan(cls, nodes: Sequence[str], rank: int) -> Partners:
        """The partners of ranks on ``nodes`` (pure: no process group).

        Args:
            nodes: The node of each rank, by rank.
            rank: This process's rank.

        Raises:
            ConfigurationError: ``rank`` is not one of them.
        """
        if not 0 <= rank < len(nodes):
            raise ConfigurationError(f"rank {rank} is not one of the {len(nodes)} ranks",
                                     name="rank", value=rank)
        order: dict[str, list[int]] = {}
        for index, node in enumerate(nodes):
            order.setdefault(node, []).append(index)  # nodes by their lowest rank
        groups = list(order.values())
        partners: list[int | None] = [None] * len(nodes)
        if len(groups) > 1:
            for position, members in enumerate(groups):
                following = groups[(position + 1) % len(groups)]
                for local_index, member in enumerate(members):
                    partners[member] = following[local_index % len(following)]
        return cls(rank=rank, nodes=tuple(nodes), partners=tuple(partners))

    @classmethod
    def of(cls, group: Any = None, *, node: str | None = None) -> Partners:
        """All-gather every rank's node over ``group`` and plan (a collective).

        Args:
            group: The checkpoint process group (None: the default group; without an
                initialized process group, this process alone).
            node: This rank's node name (default :func:`node_name`).
        """
        coordinator = _coordinator(group)
        nodes = coordinator.all_gather(node if node is not None else node_name())
        return cls.plan(nodes, coordinator.rank)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.nodes)

    @property
    def partner(self) -> int | None:
        """The rank that keeps this rank's replicas (None: every rank on one node)."""
        return self.partners[self.rank]

    @property
    def sources(self) -> list[int]:
        """The ranks whose replicas this rank keeps, ascending."""
        return [source for source, keeper in enumerate(self.partners) if keeper == self.rank]

    def holder_of(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s replicas (None on one node)."""
        return self.partners[rank]

    def node_count(self) -> int:
        """Number of distinct nodes."""
        return len(set(self.nodes))


def holdings(local_root: Storage | str | os.PathLike[str],
             name_format: NameFormat | None = None) -> dict[int, list[int]]:
    """Which ranks' steps this rank keeps replicas of (committed ones only).

    Args:
        local_root: The node-local root (holding ``replica_of_rank_XXXXX/`` sub-roots).
        name_format: How their step directories are named (default ``step_{step:09d}``).

    Returns:
        Source rank -> its committed steps here, ascending; ranks with none are left out.
    """
    root = local_root if isinstance(local_root, Storage) else Storage(local_root)
    held: dict[int, list[int]] = {}
    for info in root.list_dir():
        source = parse_replica_dir(info.name)
        if source is None or not info.is_dir or info.is_link:
            continue
        sub = Storage(root.url_of(info.name), root.storage_options)
        steps = sorted(entry.step for entry in list_checkpoints(sub, name_format)
                       if entry.status == "committed")
        if steps:
            held[source] = steps
    return held


def replicate(own: Storage, name: str, partners: Partners,
              replica_root: Callable[[int], Storage], *, group: Any = None,
              keep: int = 2, name_format: NameFormat | None = None) -> None:
    """Send this rank's committed step ``name`` to its partner; keep its sources' (collective).

    Every rank calls it after every rank committed ``name`` in its own root. The partner
    writes the files into ``replica_root(source)`` under a hidden staging name, checks
    each against the manifest's checksums as it arrives, writes the manifest last,
    renames the directory into place and prunes that root to its newest ``keep`` steps.
    A copy already there with the same manifest is kept as it is (nothing is sent). On
    one node (``partners.partner is None`` everywhere) nothing is done.

    Args:
        own: This rank's own local root.
        name: The step directory (the same on every rank).
        partners: :meth:`Partners.of` over ``group``.
        replica_root: The root holding a source rank's replicas on this rank.
        group: The checkpoint process group.
        keep: Steps kept per replica root.
        name_format: How the step directories are named (default ``step_{step:09d}``),
            for that pruning.

    Raises:
        ConfigurationError: ``keep`` below 1, an unsafe ``name``, or a receiving root
            that is not a local directory.
        StepCollisionError: A partner holds another committed copy of that step (never
            overwritten).
        CorruptCheckpointError, IncompleteCheckpointError, StorageError: A file failed
            (read, size, checksum, write); raised on every rank, naming the rank, step
            and file.
        CoordinationError: A peer died or did not answer within the group's timeout.
    """
    if keep < 1:
        raise ConfigurationError(f"keep={keep}: a replica root keeps at least 1 step",
                                 name="keep", value=keep)
    transfers = [_Transfer(index, source, keeper, source, name)
                 for index, (source, keeper) in enumerate(
                     (s, k) for s, k in enumerate(partners.partners) if k is not None)]
    _run(transfers, group, what=f"replication of {name}",
         sender_root=lambda transfer: own, receiver_root=lambda t: replica_root(t.source),
         keep=keep, name_format=name_format)


def fetch(needs: Mapping[int, tuple[int, str]], holders: Mapping[int, int], own: Storage,
          replica_root: Callable[[int], Storage], *, group: Any = None) -> None:
    """Bring each needing rank its step from the rank holding its replica (collective).

    Every rank calls it with the same maps. For each rank ``r`` in ``needs`` (its step
    and directory name) the rank ``holders[r]`` sends its replica of ``r``'s step
    (from ``replica_root(r)``) and ``r`` writes it into its own root ``own``: staged,
    checked against the manifest's checksums as it arrives, renamed into place. A copy
    already committed there with the same manifest is kept (nothing is sent).

    Args:
        needs: Rank -> (step, step directory name) it needs.
        holders: Rank -> the rank holding its replica (for every rank in ``needs``).
        own: This rank's own local root.
        replica_root: The root holding a source rank's replicas on this rank.
        group: The checkpoint process group.

    Raises:
        ConfigurationError: A needing rank without a holder, one that holds its own
            replica, maps that differ between ranks, an unsafe name.
        StepCollisionError: The needing rank already has another committed copy of it.
        CorruptCheckpointError, IncompleteCheckpointError, StorageError: A replica file
            failed; raised on every rank, naming the rank, step and file.
        CoordinationError: A peer died or did not answer within the group's timeout.
    """
    transfers = []
    for index, rank in enumerate(sorted(needs)):
        step, name = needs[rank]
        holder = holders.get(rank)
        if holder is None or holder == rank:
            raise ConfigurationError(
                f"fetch of rank {rank}'s step {step}: "
                + ("no holder given" if holder is None else "it cannot hold its own replica"),
                name="holders", value=holder, rank=rank, step=step)
        transfers.append(_Transfer(index, holder, rank, rank, name, step))
    _run(transfers, group, what="fetch of replicas",
         sender_root=lambda t: replica_root(t.source), receiver_root=lambda t: own,
         keep=None, name_format=None)


# -- the engine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Transfer:
    """One step directory moving from ``sender`` to ``receiver`` (ranks of the group)."""

    index: int
    sender: int
    receiver: int
    source: int  # whose checkpoint it is
    name: str
    step: int | None = None  # what the caller expects, if it knows

    def describe(self) -> str:
        return f"rank {self.source}'s {self.name}"


@dataclass
class _Stream:
    """One end of a transfer on this rank, and what it found."""

    transfer: _Transfer
    storage: Storage
    manifest: Manifest | None = None
    raw: bytes = b""
    error: ResumekitError | None = None
    plan: list[tuple[int, int, int]] = field(default_factory=list)  # (file, offset, length)
    buffers: tuple[Any, ...] = ()  # two uint8 tensors of the largest chunk: one moves,
    # the other is read or written meanwhile
    handle: Any = None  # the open file being read or written
    current: int = -1  # the file being read or written
    running: Checksum | None = None
    staging: str | None = None
    skip: bool = False  # the receiver holds this very copy already

    def where(self, entry_path: str | None = None) -> str:
        base = self.transfer.name if self.staging is None else self.staging
        if entry_path is None or self.manifest is None:
            return self.storage.path(base)
        return self.storage.path(f"{base}/{self.manifest.data_path(entry_path)}")

    def fail(self, error: BaseException, rank: int, role: str, file: str | None = None
             ) -> None:
        """Record the first failure of this end, in words naming rank, step and file."""
        if self.error is None:
            self.error = _named(error, rank=rank, role=role, transfer=self.transfer,
                                step=self.manifest.step if self.manifest else None,
                                file=file)


def _coordinator(group: Any) -> Coordinator:
    if not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    return ProcessGroupCoordinator(group)


def _named(error: BaseException, *, rank: int, role: str, transfer: _Transfer,
           step: int | None, file: str | None) -> ResumekitError:
    """``error`` as a ResumekitError whose message says who, what and which file."""
    step = step if step is not None else transfer.step
    what = (f"rank {rank} ({role} of rank {transfer.source}'s {transfer.name}"
            f"{'' if step is None else f', step {step}'}"
            f"{'' if file is None else f', file {file}'})")
    fields: dict[str, Any] = {"rank": rank, "source_rank": transfer.source,
                              "step": step, "file": file}
    if isinstance(error, ResumekitError):
        kind: type[ResumekitError] = type(error)
        fields = {**error.fields, **{k: v for k, v in fields.items() if v is not None}}
        return kind(f"{what}: {error.message}", **fields)
    if isinstance(error, OSError):
        return StorageError(f"{what}: {type(error).__name__}: {error}", **fields)
    return ResumekitError(f"{what}: {type(error).__name__}: {error}", **fields)


def _plan(manifest: Manifest) -> list[tuple[int, int, int]]:
    """The chunks of a stream: ``(file index, offset, length)``, an empty file as one of 0."""
    plan = []
    for index, entry in enumerate(manifest.files):
        plan.append((index, 0, min(entry.size, CHUNK_BYTES)))
        plan.extend((index, offset, min(entry.size - offset, CHUNK_BYTES))
                    for offset in range(CHUNK_BYTES, entry.size, CHUNK_BYTES))
    return plan


def _buffers(plan: list[tuple[int, int, int]]) -> tuple[Any, ...]:
    largest = max((length for _, _, length in plan), default=0)
    return tuple(torch.empty(largest, dtype=torch.uint8) for _ in range(2 if len(plan) > 1
                                                                          else 1))


class _Wire:
    """Point-to-point sends and receives of uint8 tensors over the group (or nothing)."""

    def __init__(self, group: Any, coordinator: Coordinator) -> None:
        self.group = group
        self.coordinator = coordinator
        self.pending: list[Any] = []

    def _global(self, rank: int) -> int:
        return rank if self.group is None else int(dist.get_global_rank(self.group, rank))

    def send(self, tensor: Any, to: int, tag: int) -> None:
        """Post a send of ``tensor`` to ``to``; a broken peer raises CoordinationError."""
        try:
            work = dist.isend(tensor, self._global(to), group=self.group, tag=tag)
        except RuntimeError as error:  # gloo: a peer that closed fails the post itself
            self.pending = []
            raise self._broken(error) from error
        self.pending.append(work)

    def receive(self, tensor: Any, source: int, tag: int) -> None:
        """Post a receive into ``tensor`` from ``source``; a broken peer raises alike."""
        try:
            work = dist.irecv(tensor, self._global(source), group=self.group, tag=tag)
        except RuntimeError as error:
            self.pending = []
            raise self._broken(error) from error
        self.pending.append(work)

    def wait(self) -> None:
        """Wait for every send and receive posted; a broken peer raises CoordinationError."""
        pending, self.pending = self.pending, []
        try:
            for work in pending:
                work.wait()
        except RuntimeError as error:  # gloo: peer closed, or timed out
            raise self._broken(error) from error

    def _broken(self, error: RuntimeError) -> BaseException:
        """Gloo's ``error`` of a send or receive as the coordinator's CoordinationError.

        A peer that died shows at whichever comes first: posting the next send or receive
        (the connection already closed) or waiting for one under way.
        """
        failure = getattr(self.coordinator, "failure", None)
        return error if failure is None else failure("send/recv", error)


def _run(transfers: list[_Transfer], group: Any, *, what: str,
         sender_root: Callable[[_Transfer], Storage],
         receiver_root: Callable[[_Transfer], Storage], keep: int | None,
         name_format: NameFormat | None) -> None:
    """Move every transfer's step directory, all at once (the protocol of the docstring)."""
    if not transfers:  # one node (every rank's partners alike), or nothing needed
        return
    coordinator = _coordinator(group)
    for transfer in transfers:
        if not _SAFE_NAME.match(transfer.name):
            raise ConfigurationError(f"{what}: {transfer.name!r} is not a step directory name",
                                     name="name", value=transfer.name)
        if not (0 <= transfer.sender < coordinator.world_size
                and 0 <= transfer.receiver < coordinator.world_size):
            raise ConfigurationError(
                f"{what}: rank {transfer.source}'s transfer names rank(s) outside the "
                f"{coordinator.world_size} of the group", name="ranks", value=transfer)
    exchange = _Exchange(transfers, coordinator, _Wire(group, coordinator),
                         sender_root, receiver_root)
    with activity(what):
        try:
            exchange.run(keep, name_format)
        finally:
            exchange.clean_up()


class _Exchange:
    """This rank's part in moving ``transfers``: the steps of the module's docstring."""

    def __init__(self, transfers: list[_Transfer], coordinator: Coordinator, wire: _Wire,
                 sender_root: Callable[[_Transfer], Storage],
                 receiver_root: Callable[[_Transfer], Storage]) -> None:
        self.transfers = transfers
        self.coordinator = coordinator
        self.rank = rank = coordinator.rank
        self.wire = wire
        self.outgoing = [_Stream(t, sender_root(t)) for t in transfers if t.sender == rank]
        self.incoming = [_Stream(t, receiver_root(t)) for t in transfers
                         if t.receiver == rank]

    def run(self, keep: int | None, name_format: NameFormat | None) -> None:
        sizes = self.announce()
        self.manifests(sizes)
        skipped = self.decide()
        senders = [s for s in self.outgoing if s.transfer.index not in skipped]
        receivers = [s for s in self.incoming if not s.skip]
        self.stream(senders, receivers)
        for stream in receivers:  # 5. commit what arrived whole
            _finish_file(stream, self.rank, "receiver")
            _close(stream)
            if stream.error is None:
                _commit(stream, self.rank)
        if keep is not None:
            for stream in self.incoming:
                if stream.error is None:
                    _prune(stream.storage, keep, name_format)
        # 6. the outcomes
        _raise_any(self.coordinator.all_gather(_errors(self.outgoing + self.incoming)))

    def announce(self) -> dict[int, tuple[int, str]]:
        """1. What each sender has; every rank was given the same transfers."""
        for stream in self.outgoing:
            _read_manifest(stream, self.rank)
        for stream in self.incoming:
            _check_receiver(stream, self.rank)
        agreed = hashlib.sha256(repr(self.transfers).encode()).hexdigest()
        headers = {s.transfer.index: (len(s.raw), hex_digest(s.raw)) for s in self.outgoing
                   if s.error is None}
        gathered = self.coordinator.all_gather(
            (agreed, headers, _errors(self.outgoing + self.incoming)))
        differing = [r for r, (theirs, _, _) in enumerate(gathered) if theirs != agreed]
        if differing:
            raise ConfigurationError(
                f"the ranks were given different transfers (rank(s) {differing} differ from "
                f"rank {self.rank}'s): every rank must pass the same maps", name="transfers")
        _raise_any([errors for _, _, errors in gathered])
        sizes: dict[int, tuple[int, str]] = {}
        for _, header, _ in gathered:
            sizes.update(header)
        return sizes

    def manifests(self, sizes: dict[int, tuple[int, str]]) -> None:
        """2. Each sender sends its manifest's bytes; each receiver checks them, decides."""
        for stream in self.outgoing:
            raw = torch.frombuffer(bytearray(stream.raw), dtype=torch.uint8)
            self.wire.send(raw, stream.transfer.receiver, stream.transfer.index)
        buffers = {}
        for stream in self.incoming:
            length, _ = sizes[stream.transfer.index]
            buffers[stream.transfer.index] = torch.empty(length, dtype=torch.uint8)
            self.wire.receive(buffers[stream.transfer.index], stream.transfer.sender,
                              stream.transfer.index)
        self.wire.wait()
        for stream in self.incoming:
            received = buffers[stream.transfer.index].numpy().tobytes()
            _decide(stream, received, sizes[stream.transfer.index][1], self.rank)

    def decide(self) -> set[int]:
        """3. All-gather the receivers' decisions; the transfers whose copy is held already."""
        decisions = self.coordinator.all_gather((
            {s.transfer.index: s.skip for s in self.incoming if s.error is None},
            _errors(self.incoming)))
        _raise_any([errors for _, errors in decisions])
        skipped: set[int] = set()
        for chosen, _ in decisions:
            skipped.update(index for index, skip in chosen.items() if skip)
        return skipped

    def stream(self, senders: list[_Stream], receivers: list[_Stream]) -> None:
        """4. The files, chunk by chunk: round k moves every stream's k-th chunk.

        Two buffers per stream: while chunk k moves (sends and receives posted, waited
        for here), a thread reads chunk k + 1 of each stream sent and writes chunk k - 1
        of each stream received (files, hashes and writes release the GIL).
        """
        for stream in senders + receivers:
            assert stream.manifest is not None  # read in step 1 or 2, else raised
            stream.plan = _plan(stream.manifest)
            stream.buffers = _buffers(stream.plan)
        rounds = max((len(s.plan) for s in senders + receivers), default=0)

        def disk(k: int) -> None:  # read chunk k + 1 of each sender, write k - 1 received
            for stream in senders:
                if k + 1 < len(stream.plan):
                    _read_chunk(stream, k + 1, self.rank)
            for stream in receivers:
                if 0 <= k - 1 < len(stream.plan):
                    _write_chunk(stream, k - 1, self.rank)

        disk(-1)  # the first chunk of each sender
        with ThreadPoolExecutor(1, thread_name_prefix="resumekit-replica-io") as thread:
            for index in range(rounds):
                for stream in senders:
                    if index < len(stream.plan) and stream.plan[index][2]:
                        self.wire.send(_slot(stream, index), stream.transfer.receiver,
                                       stream.transfer.index)
                for stream in receivers:
                    if index < len(stream.plan) and stream.plan[index][2]:
                        self.wire.receive(_slot(stream, index), stream.transfer.sender,
                                          stream.transfer.index)
                meanwhile = thread.submit(disk, index)
                try:
                    self.wire.wait()
                finally:
                    meanwhile.result()
        disk(rounds)  # the last chunk of each receiver
        for stream in senders:
            _finish_file(stream, self.rank, "sender")

    def clean_up(self) -> None:
        """Close every file; remove every staging directory that did not commit."""
        for stream in self.incoming:
            _close(stream)
            if stream.staging is not None:
                with contextlib.suppress(OSError):
                    stream.storage.remove_tree(stream.staging)
        for stream in self.outgoing:
            _close(stream)


def _prune(storage: Storage, keep: int, name_format: NameFormat | None) -> None:
    """Keep a replica root's newest ``keep`` steps; a failure is a warning (committed)."""
    try:
        prune(storage, keep_last(keep), name_format=name_format, scope="top", errors="warn")
    except Exception as error:  # noqa: BLE001 - the replica is committed: warned, not raised
        warn(f"cannot prune the replica root {storage.path()} to its newest {keep} steps: "
             f"{error}", ResumekitWarning)


def _errors(streams: Sequence[_Stream]) -> list[ResumekitError]:
    return [stream.error for stream in streams if stream.error is not None]


def _raise_any(gathered_errors: Sequence[Sequence[ResumekitError]]) -> None:
    """Raise on every rank when any rank failed: the first error's class, every message."""
    found = [error for errors in gathered_errors for error in errors]
    if not found:
        return
    first = found[0]
    message = first.message if len(found) == 1 else "; ".join(
        [first.message, *(f"and {error.message}" for error in found[1:])])
    raise type(first)(message, **first.fields)


def _read_manifest(stream: _Stream, rank: int) -> None:
    """Sender, step 1: the committed manifest's bytes, its link checks and file sizes."""
    storage, name = stream.storage, stream.transfer.name
    try:
        problem = link_problem(storage, name)
        if problem is not None:
            raise StorageError(problem, path=storage.path(name))
        try:
            stream.raw = storage.read_small(f"{name}/{MANIFEST_NAME}")
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{storage.path(name)} is not a committed checkpoint (no {MANIFEST_NAME})",
                path=storage.path(name)) from None
        stream.manifest = parse_manifest(stream.raw,
                                         source=storage.path(f"{name}/{MANIFEST_NAME}"))
        expected = stream.transfer.step
        if expected is not None and stream.manifest.step != expected:
            raise IncompleteCheckpointError(
                f"{storage.path(name)} holds step {stream.manifest.step}, not {expected}",
                path=storage.path(name), step=stream.manifest.step)
        refuse_links(storage, name, stream.manifest)
        for entry in stream.manifest.files:
            relative = f"{name}/{stream.manifest.data_path(entry.path)}"
            try:
                size = storage.size(relative)
            except FileNotFoundError:
                raise IncompleteCheckpointError(
                    f"{storage.path(relative)} is missing", path=storage.path(relative),
                    file=entry.path) from None
            if size != entry.size:
                raise IncompleteCheckpointError(
                    f"{storage.path(relative)} has {size} bytes, the manifest says "
                    f"{entry.size}", path=storage.path(relative), file=entry.path)
    except Exception as error:  # noqa: BLE001 - raised on every rank after step 1
        stream.fail(error, rank, "sender", getattr(error, "file", None))


def _check_receiver(stream: _Stream, rank: int) -> None:
    """Receiver, step 1: a local root, its crashed receives swept."""
    storage = stream.storage
    try:
        if not storage.atomic_rename:
            raise ConfigurationError(
                f"{storage.url}: a replica is received only into a local directory (its "
                "commit is a rename)", name="root", value=storage.url)
        if storage.exists():
            sweep_dead_writers(storage, list_checkpoints(storage), None)
    except Exception as error:  # noqa: BLE001 - raised on every rank after step 1
        stream.fail(error, rank, "receiver")


def _decide(stream: _Stream, raw: bytes, digest: str, rank: int) -> None:
    """Receiver, step 2: check the manifest that arrived; keep, refuse, or stage."""
    storage, name = stream.storage, stream.transfer.name
    try:
        if hex_digest(raw) != digest:
            raise CorruptCheckpointError(
                f"the manifest arrived corrupt (XXH3 {hex_digest(raw)}, sent as {digest})",
                path=storage.path(name), file=MANIFEST_NAME)
        stream.raw = raw
        stream.manifest = parse_manifest(raw, source=f"{stream.transfer.describe()} "
                                                     f"({MANIFEST_NAME}, received)")
        if storage.exists(name) or storage.is_link(name):
            try:
                held = storage.read_small(f"{name}/{MANIFEST_NAME}")
            except (FileNotFoundError, StorageError):
                held = None
            if held == raw and link_problem(storage, name) is None:
                stream.skip = True
                return
            raise StepCollisionError(
                f"{storage.path(name)} already exists "
                + ("holding another checkpoint of that step" if held is not None
                   else "and is not a committed checkpoint")
                + ": never overwritten (prune or move it away)",
                path=storage.path(name), step=stream.manifest.step)
        token = secrets.token_hex(6)
        staging = f".{name}.tmp-{token}"
        storage.make_dirs()
        storage.make_dir_exclusive(staging)
        stream.staging = staging
        writer = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                  "step": stream.manifest.step, "started": time.time(),
                  "replica_of": stream.transfer.source}
        storage.write_bytes(f"{staging}/{WRITER_FILE}", json.dumps(writer).encode())
    except Exception as error:  # noqa: BLE001 - raised on every rank after step 3
        stream.fail(error, rank, "receiver", getattr(error, "file", None))


def _open_next(stream: _Stream, index: int, mode: str, rank: int, role: str) -> None:
    """Close the file being streamed (checking it) and open file ``index``."""
    _finish_file(stream, rank, role)
    assert stream.manifest is not None
    stream.current = index
    entry = stream.manifest.files[index]
    stream.running = Checksum.like(entry.checksum)
    if stream.error is not None:
        return
    base = stream.transfer.name if mode == "rb" else stream.staging
    relative = f"{base}/{stream.manifest.data_path(entry.path)}"
    try:
        if mode == "wb":
            stream.storage.make_dirs(posixpath.dirname(relative))
            stream.handle = open(stream.storage.path(relative), "xb")  # noqa: SIM115
        else:
            stream.handle = _open_for_reading(stream.storage, relative)
    except Exception as error:  # noqa: BLE001 - reported in step 6
        stream.fail(error, rank, role, entry.path)


def _open_for_reading(storage: Storage, relative: str) -> Any:
    if storage.is_local:
        return open(storage.path(relative), "rb", buffering=0)
    return storage.fs.open(storage.path(relative), "rb")


def _close(stream: _Stream) -> None:
    handle, stream.handle = stream.handle, None
    if handle is not None:
        with contextlib.suppress(OSError):
            handle.close()


def _finish_file(stream: _Stream, rank: int, role: str) -> None:
    """The file streamed so far is complete: flush (receiver) and check its checksum."""
    if stream.current < 0 or stream.manifest is None:
        return
    entry = stream.manifest.files[stream.current]
    handle, stream.handle = stream.handle, None
    running, stream.running = stream.running, None
    stream.current = -1
    if stream.error is not None or running is None:
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()
        return
    try:
        if handle is not None:
            if role == "receiver":
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()
        actual = running.value()
        if actual != entry.checksum:
            where = (f"its copy {stream.where(entry.path)} fails its checksum"
                     if role == "sender" else "it arrived corrupt")
            raise CorruptCheckpointError(
                f"{entry.path}: {where}: expected {entry.checksum}, got {actual}",
                path=stream.where(), file=entry.path)
    except Exception as error:  # noqa: BLE001 - reported in step 6
        stream.fail(error, rank, role, entry.path)


def _slot(stream: _Stream, index: int) -> Any:
    """The buffer (cut to length) of chunk ``index`` of a stream."""
    return stream.buffers[index % len(stream.buffers)][:stream.plan[index][2]]


def _read_chunk(stream: _Stream, index: int, rank: int) -> None:
    """Read chunk ``index`` into its buffer and hash it.

    What cannot be read is sent as zeros: the failure is reported in step 6, the stream
    goes on.
    """
    file, offset, length = stream.plan[index]
    if offset == 0:
        _open_next(stream, file, "rb", rank, "sender")
    if length == 0:
        return
    view = _slot(stream, index)
    filled = 0
    if stream.error is None and stream.handle is not None:
        array = view.numpy()
        try:
            while filled < length:
                got = stream.handle.readinto(memoryview(array)[filled:])
                if not got:
                    assert stream.manifest is not None
                    entry = stream.manifest.files[file]
                    raise IncompleteCheckpointError(
                        f"{stream.where(entry.path)} ended at {offset + filled} bytes, the "
                        f"manifest says {entry.size}", file=entry.path)
                filled += got
        except Exception as error:  # noqa: BLE001 - reported in step 6
            assert stream.manifest is not None
            stream.fail(error, rank, "sender", stream.manifest.files[file].path)
    if filled < length:
        view[filled:].zero_()
    elif stream.running is not None:
        stream.running.update(view.numpy())


def _write_chunk(stream: _Stream, index: int, rank: int) -> None:
    """Hash and write chunk ``index``, arrived (drained unwritten after a failure)."""
    file, offset, length = stream.plan[index]
    if offset == 0:
        _open_next(stream, file, "wb", rank, "receiver")
    if length == 0 or stream.error is not None or stream.handle is None:
        return
    array = _slot(stream, index).numpy()
    if stream.running is not None:
        stream.running.update(array)
    try:
        stream.handle.write(memoryview(array))
    except Exception as error:  # noqa: BLE001 - reported in step 6
        assert stream.manifest is not None
        stream.fail(error, rank, "receiver", stream.manifest.files[file].path)


def _commit(stream: _Stream, rank: int) -> None:
    """Receiver, step 5: manifest last, writer record gone, fsync, rename into place."""
    storage, staging, name = stream.storage, stream.staging, stream.transfer.name
    assert staging is not None and stream.manifest is not None
    try:
        storage.write_bytes(f"{staging}/{MANIFEST_NAME}", stream.raw, durable=True)
        storage.remove_file(f"{staging}/{WRITER_FILE}")
        for directory in sorted(_directories_of(stream.manifest), reverse=True):
            storage.fsync_dir(f"{staging}/{directory}")
        storage.fsync_dir(staging)
        forget_newest_hint(storage)
        storage.rename_dir(staging, name)  # the commit point
        stream.staging = None
        storage.fsync_dir()
    except Exception as error:  # noqa: BLE001 - reported in step 6
        stream.fail(error, rank, "receiver")


def _directories_of(manifest: Manifest) -> set[str]:
    directories = set()
    for entry in manifest.files:
        parts = manifest.data_path(entry.path).split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directories.add("/".join(parts[:depth]))
    return directories
