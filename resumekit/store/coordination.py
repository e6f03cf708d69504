"""How ranks agree during a save or a restore: small objects and outcomes, shared.

The commit protocol takes a :class:`Coordinator` instead of a process group, so the store
works (and is tested) in one process, and a trainer's ranks coordinate over the
*checkpoint* process group, never the training one.

A collective that fails because a peer died (gloo: ``Connection closed by peer``) or hung
past the group's timeout (``Application timeout caused pair closure``, ``Timed out
waiting ... for recv``) is raised once, here, as a :class:`~resumekit.errors.
CoordinationError` that names the operation (set with :func:`activity`, e.g. "save of
step 200"), the collective, this rank, its peers and ``checkpoint_timeout``; gloo's own
error is its ``__cause__``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

from resumekit.errors import CoordinationError

__all__ = [
    "Coordinator",
    "ProcessGroupCoordinator",
    "SingleProcess",
    "activity",
    "agree_on_failure",
    "gather_outcomes",
    "picklable_error",
    "run_on_every_rank",
    "run_on_leader",
    "values_or_failure",
]

T = TypeVar("T")

_activity: contextvars.ContextVar[tuple[str, dict[str, Any]] | None] = \
    contextvars.ContextVar("resumekit_coordination_activity", default=None)

#: Pickled bytes an object may have to be sent in one collective (the frame's payload).
FRAME_BYTES = 16 << 10
_SIZE_BYTES = 8

#: Words of a gloo error that mean "the peer did not answer in time" (else: it went away).
_TIMEOUT_WORDS = ("timeout", "timed out")


@contextlib.contextmanager
def activity(what: str, **fields: Any) -> Iterator[None]:
    """Name what the collectives run inside the block are for, in their errors.

    Per thread (a ``contextvars`` variable): a background save names its own activity
    while the main thread names another.

    Args:
        what: The operation, e.g. ``"save of step 200"``.
        **fields: Attributes for the :class:`~resumekit.errors.CoordinationError`
            (``step=200``).

    Yields:
        Nothing.
    """
    token = _activity.set((what, dict(fields)))
    try:
        yield
    finally:
        _activity.reset(token)


class Coordinator(Protocol):
    """What the commit protocol needs from the ranks taking part in a save."""

    @property
    def rank(self) -> int:
        """This process's rank among the writers."""
        ...

    @property
    def world_size(self) -> int:
        """Number of writers."""
        ...

    def barrier(self) -> None:
        """Return once every writer has called it."""
        ...

    def broadcast(self, value: T, source: int = 0) -> T:
        """Return rank ``source``'s ``value`` on every rank."""
        ...

    def all_gather(self, value: T) -> list[T]:
        """Return every rank's ``value``, indexed by rank."""
        ...

    def gather(self, value: T) -> list[T] | None:
        """Return every rank's ``value`` on rank 0, indexed by rank; None on the others."""
        ...

    def lowest_failing(self, failed: bool) -> int | None:
        """Return the lowest rank that passed ``failed=True``, or None where none did."""
        ...


class SingleProcess:
    """The coordinator of a save written by one process."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        """Nothing to wait for."""

    def broadcast(self, value: T, source: int = 0) -> T:
        """Return ``value``."""
        return value

    def all_gather(self, value: T) -> list[T]:
        """Return ``[value]``."""
        return [value]

    def gather(self, value: T) -> list[T] | None:
        """Return ``[value]``."""
        return [value]

    def lowest_failing(self, failed: bool) -> int | None:
        """Return 0 where ``failed``, else None."""
        return 0 if failed else None


class ProcessGroupCoordinator:
    """Coordinate over a ``torch.distributed`` process group (the checkpoint group).

    Args:
        group: The process group; None means the default group.
    """

    def __init__(self, group: Any = None) -> None:
        # Imported here: the store (commit, catalog, CLI) must import without
        # torch.distributed, which is slow to import (crash tests fork writers by the
        # hundred).
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        self._torch = torch
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # gloo moves CPU tensors: a small object then takes one collective (see _framed)
        self._framed = dist.get_backend(group) == "gloo"

    def barrier(self) -> None:
        """Block until every rank of the group arrives.

        Raises:
            CoordinationError: A peer died or did not arrive within the group's timeout.
        """
        self._run("barrier", lambda: self._dist.barrier(group=self.group))

    def broadcast(self, value: T, source: int = 0) -> T:
        """Return the ``value`` of group rank ``source`` on every rank.

        Raises:
            CoordinationError: A peer died or did not answer within the group's timeout.
        """
        if self._framed:
            return self._broadcast_framed(value, source)
        box = [value]
        self._run("broadcast", lambda: self._dist.broadcast_object_list(
            box, src=self._global_rank(source), group=self.group))
        return box[0]

    def gather(self, value: T) -> list[T] | None:
        """Return every rank's ``value`` on group rank 0 (indexed by rank), None on the others.

        On gloo one gather of fixed frames (each value's size and first bytes); a value
        longer than its frame sends the rest to rank 0 alone (a ``send``, and rank 0 a
        ``recv`` from that rank). A rank other than 0 passes one message, whatever the
        world size, where an all-gather passes one per rank through every rank.

        Raises:
            CoordinationError: A peer died or did not answer within the group's timeout.
        """
        leader = self._global_rank(0)
        if not self._framed:
            boxes: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            self._run("gather", lambda: self._dist.gather_object(
                value, boxes, dst=leader, group=self.group))
            return boxes
        # rank 0 keeps its own value: nothing of it is sent
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if self.rank else b""
        mine = self._frame(data)
        frames = ([self._torch.zeros(_SIZE_BYTES + FRAME_BYTES, dtype=self._torch.uint8)
                   for _ in range(self.world_size)] if self.rank == 0 else None)
        self._run("gather", lambda: self._dist.gather(mine, frames, dst=leader,
                                                      group=self.group))
        if frames is None:
            if len(data) > FRAME_BYTES:
                rest = self._padded(data[FRAME_BYTES:], len(data) - FRAME_BYTES)
                self._run("send", lambda: self._dist.send(rest, dst=leader, group=self.group))
            return None
        gathered: list[T] = []
        for rank, frame in enumerate(frames):
            if rank == 0:
                gathered.append(value)
                continue
            got = frame.numpy().tobytes()
            size = _size_of(got)
            if size > FRAME_BYTES:
                more = self._torch.zeros(size - FRAME_BYTES, dtype=self._torch.uint8)
                source = self._global_rank(rank)
                self._run("recv", functools.partial(self._dist.recv, more, src=source,
                                                    group=self.group))
                got += more.numpy().tobytes()
            gathered.append(cast(T, _value_of(got, size)))
        return gathered

    def lowest_failing(self, failed: bool) -> int | None:
        """Return the lowest group rank that passed ``failed=True``, or None where none did.

        On gloo one all-reduce (MIN) of one integer, which costs a rank far less than an
        all-gather as the world grows (docs/performance.md, "Agreements in one integer").

        Raises:
            CoordinationError: A peer died or did not answer within the group's timeout.
        """
        if not self._framed:  # NCCL's collectives take device tensors: use the objects'
            flags = self.all_gather(failed)
            return next((rank for rank, flag in enumerate(flags) if flag), None)
        mark = self._torch.tensor([self.rank if failed else self.world_size],
                                  dtype=self._torch.int64)
        self._run("all_reduce", lambda: self._dist.all_reduce(
            mark, op=self._dist.ReduceOp.MIN, group=self.group))
        lowest = int(mark.item())
        return None if lowest >= self.world_size else lowest

    def all_gather(self, value: T) -> list[T]:
        """Return every rank's ``value``.

        Raises:
            CoordinationError: A peer died or did not answer within the group's timeout.
        """
        if self._framed:
            return self._all_gather_framed(value)
        boxes: list[Any] = [None] * self.world_size
        self._run("all_gather", lambda: self._dist.all_gather_object(
            boxes, value, group=self.group))
        return boxes

    # The object collectives of torch.distributed send each object's size first, then
    # its bytes: two collectives. Here a fixed frame carries the size and the first
    # FRAME_BYTES of the pickle, so an object that fits (every one a save or a restore
    # sends, on the LingBot models) takes one; a longer one sends the rest in a second.

    def _padded(self, data: bytes, length: int) -> Any:
        """A uint8 tensor of ``length`` bytes: ``data``, then zeros."""
        tensor = self._torch.zeros(length, dtype=self._torch.uint8)
        if data:
            tensor[:len(data)] = self._torch.frombuffer(bytearray(data),
                                                        dtype=self._torch.uint8)
        return tensor

    def _frame(self, data: bytes) -> Any:
        """``data``'s size (8 bytes, little-endian), then its first FRAME_BYTES."""
        return self._padded(len(data).to_bytes(_SIZE_BYTES, "little") + data[:FRAME_BYTES],
                            _SIZE_BYTES + FRAME_BYTES)

    def _broadcast_framed(self, value: T, source: int) -> T:
        sending = self.rank == source
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if sending else b""
        frame = self._frame(data)
        src = self._global_rank(source)
        self._run("broadcast", lambda: self._dist.broadcast(frame, src=src, group=self.group))
        received = frame.numpy().tobytes()
        size = _size_of(received)
        if size > FRAME_BYTES:
            rest = self._padded(data[FRAME_BYTES:], size - FRAME_BYTES)
            self._run("broadcast", lambda: self._dist.broadcast(rest, src=src,
                                                                group=self.group))
            received += rest.numpy().tobytes()
        if sending:
            return value
        return cast(T, _value_of(received, size))

    def _all_gather_framed(self, value: T) -> list[T]:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        frames = [self._torch.zeros(_SIZE_BYTES + FRAME_BYTES, dtype=self._torch.uint8)
                  for _ in range(self.world_size)]
        mine = self._frame(data)
        self._run("all_gather", lambda: self._dist.all_gather(frames, mine, group=self.group))
        received = [frame.numpy().tobytes() for frame in frames]
        sizes = [_size_of(got) for got in received]
        longest = max(sizes)
        if longest > FRAME_BYTES:
            rests = [self._torch.zeros(longest - FRAME_BYTES, dtype=self._torch.uint8)
                     for _ in range(self.world_size)]
            own = self._padded(data[FRAME_BYTES:], longest - FRAME_BYTES)
            self._run("all_gather", lambda: self._dist.all_gather(rests, own,
                                                                  group=self.group))
            received = [got + rest.numpy().tobytes() for got, rest in zip(
                received, rests, strict=True)]
        return [cast(T, _value_of(got, size))
                for got, size in zip(received, sizes, strict=True)]

    def _run(self, collective: str, call: Callable[[], object]) -> None:
        try:
            call()
        except RuntimeError as error:  # gloo's peer-closed and timeout errors
            raise self.failure(collective, error) from error

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return int(self._dist.get_global_rank(self.group, group_rank))

    def failure(self, collective: str, error: BaseException) -> CoordinationError:
        """The :class:`CoordinationError` for ``collective`` failing with gloo's ``error``.

        It names the activity (:func:`activity`), the collective, this rank and its peers
        (global ranks), whether the peer went away or timed out, and ``checkpoint_timeout``
        of :func:`resumekit.runtime.distributed.current_context`.
        """
        from resumekit.runtime import distributed  # noqa: PLC0415 - torch.distributed, see above

        named = _activity.get()
        what, fields = named if named is not None else ("checkpoint coordination", {})
        rank = self._global_rank(self.rank)
        peers = [self._global_rank(r) for r in range(self.world_size) if r != self.rank]
        context = distributed.current_context()
        timeout = None if context is None else context.checkpoint_timeout
        limit = ("the group's timeout" if timeout is None
                 else f"checkpoint_timeout={timeout.total_seconds():g} s")
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if any(word in text.lower() for word in _TIMEOUT_WORDS):
            cause = (f"a peer among rank(s) {peers} did not answer within {limit} "
                     "(it hung, or is far behind)")
        else:
            cause = (f"a peer among rank(s) {peers} closed its connection (it died: "
                     f"crashed, was killed or exited; {limit})")
        message = (f"{what} failed on rank {rank} of {self.world_size}: the {collective} on "
                   f"the checkpoint process group broke because {cause}: "
                   f"{type(error).__name__}: {text}")
        details = {"reason": what, "rank": rank, "peers": peers, "collective": collective,
                   "checkpoint_timeout": None if timeout is None
                   else timeout.total_seconds(), **fields}
        return CoordinationError(message, **details)


def _size_of(received: bytes) -> int:
    """The pickle's size a frame carries (its first bytes)."""
    return int.from_bytes(received[:_SIZE_BYTES], "little")


def _value_of(received: bytes, size: int) -> Any:
    """The value a frame (and, past FRAME_BYTES, its rest appended) carries."""
    return pickle.loads(received[_SIZE_BYTES:_SIZE_BYTES + size])


def run_on_leader(coordinator: Coordinator, action: Callable[[], T]) -> T:
    """Run ``action()`` on rank 0 and give every rank its result or its exception.

    An error raised on rank 0 is re-raised on every rank, so all ranks take the same
    branch and none is left waiting in a collective.
    """
    outcome: tuple[str, Any] = ("ok", None)
    if coordinator.rank == 0:
        try:
            outcome = ("ok", action())
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            outcome = ("error", error)
    try:
        outcome = coordinator.broadcast(outcome)
    except CoordinationError as error:
        if outcome[0] != "error":
            raise
        raise _with_own_failure(error, outcome[1]) from error
    if outcome[0] == "error":
        raise outcome[1]
    result: T = outcome[1]  # rank 0's action() result, broadcast
    return result


def run_on_every_rank(coordinator: Coordinator, action: Callable[[], T]) -> T:
    """Run ``action()`` on every rank; if it failed on any rank, raise on every rank.

    Each rank returns its own result (only the outcome is shared: :func:`agree_on_failure`).
    The error raised is the lowest failing rank's, so all ranks take the same branch and
    none is left waiting in the next collective.

    A rank whose own part failed (a DCP collective broken by a dead peer, raised as gloo's
    raw ``RuntimeError``) and whose agreement then fails too raises the agreement's
    :class:`~resumekit.errors.CoordinationError` (gloo's error is its ``__cause__``), which
    also quotes this rank's own failure.
    """
    result: T | None = None
    own: Exception | None = None
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - re-raised on every rank below
        own = error
    agree_on_failure(coordinator, own)
    return cast(T, result)  # no rank failed, so action() returned here


def agree_on_failure(coordinator: Coordinator, failure: Exception | None) -> None:
    """Raise on every rank the lowest failing rank's ``failure``; return where none failed.

    The ranks learn which rank failed first in one small collective
    (:meth:`Coordinator.lowest_failing`); only where one did is its error broadcast from it
    (a second collective). That rank raises its own ``failure``; the others raise its
    copy. An error that does not pickle travels as a :class:`CoordinationError` quoting it.
    A rank whose own ``failure`` is set and whose collective fails too raises the
    collective's :class:`~resumekit.errors.CoordinationError`, which also quotes that
    failure.

    Args:
        coordinator: The ranks.
        failure: This rank's error, if its part failed.

    Raises:
        Exception: The lowest failing rank's error.
    """
    try:
        lowest = coordinator.lowest_failing(failure is not None)
        if lowest is None:
            return
        sent: BaseException | None = None
        if lowest == coordinator.rank and failure is not None:
            sent = picklable_error(failure, coordinator.rank)
        shared = coordinator.broadcast(sent, source=lowest)
    except CoordinationError as error:
        if failure is None:
            raise
        raise _with_own_failure(error, failure) from error
    if lowest == coordinator.rank and failure is not None:
        raise failure
    assert isinstance(shared, BaseException), shared
    raise shared


def picklable_error(error: BaseException, rank: int) -> BaseException:
    """``error``, or a :class:`CoordinationError` quoting it where it does not pickle.

    What a rank sends of its failure: an error that does not pickle would fail the
    sending rank before the collective and leave the others waiting in it.
    """
    try:
        pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as why:  # noqa: BLE001 - any pickling failure: sent as text instead
        return CoordinationError(f"rank {rank} failed with {type(error).__name__}: {error} "
                                 f"(the error itself does not pickle: {why})", rank=rank)
    return error


def gather_outcomes(coordinator: Coordinator, value: T, failure: Exception | None
                    ) -> list[tuple[str, Any]] | None:
    """Every rank's outcome on rank 0 (None on the others): one gather.

    Rank 0 takes the values, or the lowest failing rank's error, with
    :func:`values_or_failure` (inside :func:`run_on_leader`, which raises it on every
    rank). A rank whose own ``failure`` is set and whose gather fails too raises the
    gather's :class:`~resumekit.errors.CoordinationError`, which also quotes that failure;
    an error that does not pickle travels as a :class:`CoordinationError` quoting it.

    Args:
        coordinator: The ranks.
        value: This rank's value (ignored where ``failure`` is set).
        failure: This rank's error, if its part failed.

    Returns:
        On rank 0 each rank's ``("ok", value)`` or ``("error", failure)``, in rank order;
        None on the others.
    """
    outcome: tuple[str, Any] = ("ok", value) if failure is None else (
        "error", picklable_error(failure, coordinator.rank))
    try:
        return coordinator.gather(outcome)
    except CoordinationError as error:
        if failure is None:
            raise
        raise _with_own_failure(error, failure) from error


def values_or_failure(gathered: Sequence[tuple[str, Any]]) -> list[Any]:
    """The values :func:`gather_outcomes` gathered; raise the lowest failing rank's error."""
    for status, shared in gathered:
        if status == "error":
            raise shared
    return [shared for _, shared in gathered]


def _with_own_failure(error: CoordinationError, own: BaseException) -> CoordinationError:
    """``error`` (the cause), also quoting this rank's own failure, which came first."""
    return CoordinationError(
        f"{error.message}; before that, this rank's own part had failed: "
        f"{type(own).__name__}: {own}", **error.fields)
