"""Start (and stop) distributed training so that checkpoint skew never kills a job.

In the incident this library comes from, eight ranks finished loading a 9.5 GB checkpoint
from NAS at different times; the first one to finish waited in the first FSDP all-gather
for longer than the training group's timeout and the watchdog aborted the job. Raising the
timeout of *every* collective to an hour hid that, and made real hangs take an hour to show.

:func:`init_distributed` removes the cause instead:

* the training (default) process group keeps a short ``timeout``, so a real hang surfaces
  quickly;
* a second, always-gloo **checkpoint group** with its own long ``checkpoint_timeout``
  carries every checkpoint coordination (barriers, broadcasts, the preemption vote);
* :func:`meet` - called at the end of a restore - makes every rank wait for the slowest
  loader *on the checkpoint group*, so no training collective ever sees load skew;
* start-up skew (ranks scheduled minutes apart) is absorbed the same way: ranks meet on the
  rendezvous store with the long timeout before the training group is created.

Where this process sits in the job (torchrun, SLURM ``srun`` or a single process, which
gets no process group at all) is read by :mod:`resumekit.runtime.launch`; this module sets
up the groups from it (the rendezvous, the device, the training, checkpoint and preemption
groups), and uses and tears them down (:func:`meet`, :func:`shutdown`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore

from resumekit.errors import CoordinationError, DistributedSetupError
from resumekit.runtime.launch import LaunchEnvironment, Launcher, detect_launch
from resumekit.warnings import warn

__all__ = [
    "DEFAULT_CHECKPOINT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DistributedContext",
    "before_meet",
    "checkpoint_group",
    "current_context",
    "init_distributed",
    "meet",
    "preemption_group",
    "shutdown",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Timeout of the training group: short, so that a real hang is detected quickly."""

DEFAULT_CHECKPOINT_TIMEOUT = timedelta(hours=2)
"""Timeout of the checkpoint group: long enough for the slowest rank to load from NAS."""

_ARRIVAL_KEY = "init/arrived"
_ALL_ARRIVED_KEY = "init/all-arrived"


@dataclass(frozen=True)
class DistributedContext:
    """What :func:`init_distributed` set up; the same object on every later call.

    Attributes:
        rank: Global rank of this process.
        world_size: Number of processes.
        local_rank: Rank on this node.
        local_world_size: Processes on this node.
        device: The device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: Backend of the training (default) group, e.g. ``"nccl"`` or ``"gloo"``;
            ``"none"`` for a single process.
        launcher: ``"torchrun"``, ``"slurm"`` or ``"single"``.
        checkpoint_group: The gloo group with the long timeout that carries every
            checkpoint coordination; None for a single process.
        preemption_group: A second gloo group (same long timeout) that carries only the
            per-step preemption vote. It is separate because a background save may run
            collectives on the checkpoint group at the same time, and two threads issuing
            collectives on one group can interleave differently on different ranks.
        timeout: Timeout of the training group.
        checkpoint_timeout: Timeout of the checkpoint group.
        node_rank: Index of this rank's node (see :class:`LaunchEnvironment`).
        num_nodes: Nodes in the job.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: Launcher
    checkpoint_group: dist.ProcessGroup | None
    preemption_group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_TIMEOUT
    checkpoint_timeout: timedelta = DEFAULT_CHECKPOINT_TIMEOUT
    node_rank: int = 0
    num_nodes: int = 1

    @property
    def is_distributed(self) -> bool:
        """Whether a process group exists (False for a single process)."""
        return self.checkpoint_group is not None

    @property
    def is_leader(self) -> bool:
        """Whether this is global rank 0."""
        return self.rank == 0


@dataclass(frozen=True)
class _Request:
    timeout: timedelta
    checkpoint_timeout: timedelta
    backend: str | None
    device: torch.device | None


_lock = threading.Lock()
_context: DistributedContext | None = None
_request: _Request | None = None
_owns_default_group = False
_meet_hooks: contextvars.ContextVar[tuple[Callable[[str], None], ...]] = contextvars.ContextVar(
    "resumekit_meet_hooks", default=())


# ---------------------------------------------------------------------------------------
# Setting up


def _as_timeout(value: timedelta | float, name: str) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise DistributedSetupError(
            f"{name}={value!r} must be a timedelta or a number of seconds", variable=name
        )
    result = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    if result <= timedelta(0):
        raise DistributedSetupError(
            f"{name}={value!r} must be positive (a collective needs time to complete)",
            variable=name,
        )
    return result


def _as_device(device: torch.device | str | int | None) -> torch.device | None:
    if device is None:
        return None
    try:
        if isinstance(device, int):
            return torch.device("cuda", device)
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise DistributedSetupError(
            f"device={device!r} is not a device ({error})", variable="device"
        ) from None


def _choose_device(launch: LaunchEnvironment, requested: torch.device | None) -> torch.device:
    if requested is not None:
        if requested.type == "cuda" and requested.index is None:
            requested = torch.device("cuda", launch.local_rank)
        if requested.type == "cuda":
            _check_cuda_index(requested.index or 0, "device")
        return requested
    if torch.cuda.is_available():
        _check_cuda_index(launch.local_rank, "LOCAL_RANK")
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def _check_cuda_index(index: int, variable: str) -> None:
    if not torch.cuda.is_available():
        raise DistributedSetupError(
            f"{variable} asks for CUDA device {index} but CUDA is not available",
            variable=variable,
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DistributedSetupError(
            f"{variable}={index} but this node has only {count} visible CUDA device(s) "
            "(check CUDA_VISIBLE_DEVICES and the tasks per node)",
            variable=variable,
        )


def _choose_backend(requested: str | None, device: torch.device) -> str:
    if requested is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if "nccl" in requested and not torch.cuda.is_available():
        raise DistributedSetupError(
            f"backend={requested!r} needs CUDA, which is not available here",
            variable="backend",
        )
    return requested


def init_distributed(
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    *,
    backend: str | None = None,
    checkpoint_timeout: timedelta | float = DEFAULT_CHECKPOINT_TIMEOUT,
    device: torch.device | str | int | None = None,
) -> DistributedContext:
    """Join the job's process group and create the checkpoint group.

    Call once per process, before building the model. A second call with the same
    arguments returns the same context (other modules should use :func:`current_context`).

    The steps: read the launcher's variables (:func:`detect_launch`); bind the device
    (``torch.cuda.set_device(local_rank)``); start or reach the TCP rendezvous store and wait
    there, for the longer of ``timeout`` and ``checkpoint_timeout``, until every rank has
    arrived; create the default group
    with the short ``timeout`` (NCCL gets ``device_id``, so it connects eagerly); create the
    always-gloo checkpoint group with ``checkpoint_timeout``.

    A default group that already exists (created by the trainer or a framework) is adopted:
    only the checkpoint group is created, and :func:`shutdown` leaves the default group to
    its owner. A single process (no launcher variables) gets no process group at all.

    Args:
        timeout: Timeout of every training collective (timedelta or seconds). Keep it short:
            load and start-up skew are absorbed by the checkpoint group instead.
        backend: Backend of the training group; default ``"nccl"`` when the device is a
            GPU, else ``"gloo"``.
        checkpoint_timeout: Timeout of the checkpoint group (timedelta or seconds): the
            longest one rank may wait for another during save, restore and start-up.
        device: The device to compute on; default ``cuda:<local_rank>`` when CUDA is
            available, else CPU. Pass ``"cpu"`` to train on CPU on a GPU machine.

    Returns:
        The context: rank, world size, device, backend, launcher, checkpoint group.

    Raises:
        DistributedSetupError: The environment is missing or inconsistent, a timeout is not
            positive, the rendezvous port is in use, or a second call conflicts with the
            first; ``variable`` names what is at fault.
    """
    global _context, _request, _owns_default_group  # noqa: PLW0603 - one context per process
    request = _Request(
        timeout=_as_timeout(timeout, "timeout"),
        checkpoint_timeout=_as_timeout(checkpoint_timeout, "checkpoint_timeout"),
        backend=backend,
        device=_as_device(device),
    )
    with _lock:
        if _context is not None:
            if request != _request:
                raise DistributedSetupError(
                    "init_distributed() was already called with different arguments "
                    f"(first: {_describe(_request)}; now: {_describe(request)}); "
                    "use resumekit.runtime.distributed.current_context() to reach the existing one",
                    variable="init_distributed",
                )
            return _context
        launch = detect_launch()
        if launch.launcher == "single" and not dist.is_initialized():
            chosen = _choose_device(launch, request.device)
            if chosen.type == "cuda":
                torch.cuda.set_device(chosen)
            _context = DistributedContext(
                rank=0, world_size=1, local_rank=0, local_world_size=1, device=chosen,
                backend="none", launcher="single", checkpoint_group=None,
                timeout=request.timeout, checkpoint_timeout=request.checkpoint_timeout,
            )
            _request = request
            return _context
        _context, _owns_default_group = _init_group(launch, request)
        _request = request
        return _context


def _describe(request: _Request | None) -> str:
    if request is None:
        return "none"
    fields = dataclasses.asdict(request)
    return ", ".join(f"{key}={value}" for key, value in fields.items())


def _init_group(
    launch: LaunchEnvironment, request: _Request
) -> tuple[DistributedContext, bool]:
    chosen = _choose_device(launch, request.device)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    owns = not dist.is_initialized()
    if owns:
        backend = _choose_backend(request.backend, chosen)
        assert launch.master_addr is not None and launch.master_port is not None
        # Start-up skew is bounded by the longer of the two timeouts: a short checkpoint
        # timeout (one chosen to catch a hung peer quickly) must not fail a late start.
        store = _rendezvous(launch, max(request.timeout, request.checkpoint_timeout))
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=request.timeout,
            device_id=chosen if "nccl" in backend else None,
        )
        rank, world_size = launch.rank, launch.world_size
    else:
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if launch.launcher != "single" and (rank, world_size) != (
            launch.rank,
            launch.world_size,
        ):
            raise DistributedSetupError(
                f"the existing default process group has rank {rank} of {world_size} but the "
                f"{launch.launcher} environment says rank {launch.rank} of {launch.world_size}",
                variable="RANK",
            )
    group = dist.new_group(backend="gloo", timeout=request.checkpoint_timeout)
    vote_group = dist.new_group(backend="gloo", timeout=request.checkpoint_timeout)
    context = DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=launch.local_rank,
        local_world_size=launch.local_world_size,
        device=chosen,
        backend=backend,
        launcher=launch.launcher,
        checkpoint_group=group,
        preemption_group=vote_group,
        timeout=request.timeout,
        checkpoint_timeout=request.checkpoint_timeout,
        node_rank=launch.node_rank,
        num_nodes=launch.num_nodes,
    )
    logger.info(
        "rank %d/%d (%s, %s on %s) on %s, node %d of %d: training timeout %s, checkpoint "
        "timeout %s",
        rank, world_size, launch.launcher, backend, chosen, socket.gethostname(),
        launch.node_rank, launch.num_nodes, request.timeout, request.checkpoint_timeout,
    )
    return context, owns


def _rendezvous(launch: LaunchEnvironment, wait: timedelta) -> Store:
    """Open the TCP store and return once every rank has reached it (within ``wait``).

    Rank 0 serves the store, unless torchrun's agent already does. The agent's store is
    prefixed per torchrun attempt, so keys left by a previous attempt (it survives worker
    restarts) are never read back; the attempt is the node's restart count, which every
    node agrees on only when every node's agent counted the restart (see
    ``docs/local-tier.md``, "In-job restart": multi-node jobs run torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a store of rank 0's per attempt).
    """
    address = f"{launch.master_addr}:{launch.master_port}"
    serves = launch.rank == 0 and not launch.agent_store
    try:
        raw = TCPStore(
            str(launch.master_addr),
            int(launch.master_port or 0),
            launch.world_size,
            serves,
            timeout=wait,
            wait_for_workers=False,
            multi_tenant=True,
        )
    except dist.DistNetworkError as error:
        if serves:
            raise DistributedSetupError(
                f"rank 0 cannot serve the rendezvous store on MASTER_ADDR:MASTER_PORT={address} "
                f"(port in use or address not local?): {error}",
                variable="MASTER_PORT",
                address=address,
            ) from None
        raise DistributedSetupError(
            f"rank {launch.rank} cannot reach the rendezvous store at "
            f"MASTER_ADDR:MASTER_PORT={address} within {wait}: {error}",
            variable="MASTER_ADDR",
            address=address,
        ) from None
    # Only the agent's store outlives a restart; one rank 0 serves is new for every attempt.
    # (Multi-node torchrun: TORCHELASTIC_RESTART_COUNT is per node - a node restarted for
    # a membership change does not count it - so there it must not name a store rank 0
    # serves, or the ranks of one restart would wait under different prefixes.)
    attempt = launch.restart_count if launch.agent_store else 0
    store = PrefixStore(f"resumekit/attempt-{attempt}", raw)
    # Ranks can start minutes apart (node boot, container pull). Meet here, with the long
    # timeout, so the training group below is created by ranks that are all present.
    if store.add(_ARRIVAL_KEY, 1) == launch.world_size:
        store.set(_ALL_ARRIVED_KEY, "1")
    try:
        store.wait([_ALL_ARRIVED_KEY], wait)
    except dist.DistError as error:
        arrived = store.add(_ARRIVAL_KEY, 0)
        raise DistributedSetupError(
            f"only {arrived} of {launch.world_size} ranks reached the rendezvous store at "
            f"MASTER_ADDR:MASTER_PORT={address} within {wait}: {error}"
            + _split_attempt_hint(launch),
            variable="WORLD_SIZE",
            address=address,
        ) from None
    return store


def _split_attempt_hint(launch: LaunchEnvironment) -> str:
    """Why a multi-node in-job restart on torchrun's shared store may not meet, if it is one."""
    if not (launch.agent_store and launch.num_nodes > 1 and launch.restart_count > 0):
        return ""
    return (
        f"; this is torchrun's restart {launch.restart_count} as node {launch.node_rank} "
        f"counts it, on the store torchrun's agents share: a node restarted for another "
        f"node's failure does not count the restart, so the ranks of one restart can wait "
        f"under different attempts; run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
        f"(a new store for every attempt; docs/local-tier.md, \"In-job restart\")"
    )


# ---------------------------------------------------------------------------------------
# Using and tearing down


def current_context() -> DistributedContext | None:
    """The context :func:`init_distributed` returned, or None before it (or after shutdown)."""
    return _context


def checkpoint_group() -> dist.ProcessGroup | None:
    """The checkpoint group (gloo, long timeout), or None for one process or before init."""
    return None if _context is None else _context.checkpoint_group


def preemption_group() -> dist.ProcessGroup | None:
    """The group of the preemption vote (gloo, long timeout), or None for one process."""
    return None if _context is None else _context.preemption_group


@contextlib.contextmanager
def before_meet(hook: Callable[[str], None]) -> Iterator[None]:
    """Run ``hook(reason)`` inside every :func:`meet` of this thread, just before it waits.

    A testing seam: a test gives one rank a hook that blocks (a slow NAS read, a slow
    loader) to reproduce load skew without touching the code under test. Nothing is
    registered in production, so the library itself never sleeps.

    Args:
        hook: Called with the meeting's ``reason``.

    Yields:
        Nothing; the hook is removed on exit.
    """
    token = _meet_hooks.set((*_meet_hooks.get(), hook))
    try:
        yield
    finally:
        _meet_hooks.reset(token)


def meet(group: dist.ProcessGroup | None = None, *, reason: str) -> None:
    """Wait until every rank reaches this point, on the checkpoint group (long timeout).

    Call it where ranks may arrive far apart and a training collective follows - above
    all at the end of a restore, so the fastest loader waits here (up to
    ``checkpoint_timeout``) instead of in the first all-gather (``timeout``).

    Args:
        group: The group to meet on; default the checkpoint group. Without a context but
            with a default group (a trainer that did not call :func:`init_distributed`),
            the default group is used, with a warning: its timeout then bounds the skew.
        reason: What the ranks meet for (``"end of restore from step_000001000"``); it
            names the meeting in errors and logs.

    Raises:
        CoordinationError: A rank did not arrive within the group's timeout, or left.
    """
    for hook in _meet_hooks.get():
        hook(reason)
    target = group if group is not None else checkpoint_group()
    if target is None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        warn(
            f"meet({reason!r}) without init_distributed(): meeting on the default group, "
            "whose (short) timeout now bounds how far apart ranks may arrive",
            RuntimeWarning,
            stacklevel=2,
        )
    rank = dist.get_rank()
    try:
        dist.barrier(group=target)
    except RuntimeError as error:
        context = current_context()
        limit = context.checkpoint_timeout if context and group is None else "the group timeout"
        raise CoordinationError(
            f"rank {rank}: ranks did not all meet for {reason!r} within {limit}: {error}",
            reason=reason,
            rank=rank,
        ) from error


def shutdown() -> None:
    """Leave the job cleanly: meet on the checkpoint group, then destroy the groups.

    The final barrier matters: a gloo group plus a gloo subgroup destroyed while a peer is
    still sending can abort the process at exit. A default group this module did not create
    is left to its owner. Safe to call twice, or without :func:`init_distributed`.
    """
    global _context, _request, _owns_default_group
    with _lock:
        context, owns = _context, _owns_default_group
        _context, _request, _owns_default_group = None, None, False
    if context is None or context.checkpoint_group is None or not dist.is_initialized():
        return
    group = context.checkpoint_group
    try:
        dist.barrier(group=group)
    finally:
        if context.preemption_group is not None:
            dist.destroy_process_group(context.preemption_group)
        dist.destroy_process_group(group)
        if owns:
            dist.destroy_process_group()
