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

Launchers: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), SLURM ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
the first host of the node list), or a single process (no process group at all). Inside
``sbatch`` + torchrun both sets of variables exist and ``SLURM_PROCID`` is 0 in every worker,
so torchrun's variables win whenever they are present.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore

from resumekit.errors import CoordinationError, DistributedSetupError
from resumekit.warnings import warn

__all__ = [
    "DEFAULT_CHECKPOINT_TIMEOUT",
    "DEFAULT_SLURM_PORT_BASE",
    "DEFAULT_TIMEOUT",
    "DistributedContext",
    "LaunchEnvironment",
    "Launcher",
    "before_meet",
    "checkpoint_group",
    "current_context",
    "detect_launch",
    "expand_nodelist",
    "init_distributed",
    "meet",
    "preemption_group",
    "shutdown",
    "slurm_default_port",
]

logger = logging.getLogger(__name__)

Launcher = Literal["torchrun", "slurm", "single"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Timeout of the training group: short, so that a real hang is detected quickly."""

DEFAULT_CHECKPOINT_TIMEOUT = timedelta(hours=2)
"""Timeout of the checkpoint group: long enough for the slowest rank to load from NAS."""

DEFAULT_SLURM_PORT_BASE = 15000
"""Under SLURM without ``MASTER_PORT``: port = ``15000 + SLURM_JOB_ID % 10000``.

The range 15000-24999 stays below Linux's ephemeral range (32768-60999), so an outgoing
connection never holds the port, and two jobs sharing a first node get different ports
unless their ids are equal modulo 10000.
"""

_ARRIVAL_KEY = "init/arrived"
_ALL_ARRIVED_KEY = "init/all-arrived"


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in the job, as read from the launcher's variables.

    Attributes:
        launcher: Which launcher's variables were used.
        rank: Global rank of this process.
        world_size: Number of processes in the job.
        local_rank: Rank of this process on its node (selects its GPU).
        local_world_size: Number of processes on this node.
        master_addr: Host of the rendezvous store (rank 0's node); None for one process.
        master_port: Port of the rendezvous store; None for one process.
        agent_store: torchrun's agent already serves the store at that address
            (``TORCHELASTIC_USE_AGENT_STORE=True``): every rank connects as a client.
        restart_count: torchrun's ``TORCHELASTIC_RESTART_COUNT``. The agent's store
            outlives worker restarts, so each attempt works under its own key prefix.
        node_rank: Index of this process's node in the job (torchrun's ``GROUP_RANK``,
            SLURM's ``SLURM_NODEID``; else ``rank // local_world_size``).
        num_nodes: Nodes in the job (torchrun's ``GROUP_WORLD_SIZE``, SLURM's
            ``SLURM_STEP_NUM_NODES``/``SLURM_NNODES``/``SLURM_JOB_NUM_NODES``, else the
            length of the node list, else ``ceil(world_size / local_world_size)``).
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool = False
    restart_count: int = 0
    node_rank: int = 0
    num_nodes: int = 1


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
# Reading the launcher's environment


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu3`` into host names.

    Zero padding is kept (``node[08-10]`` gives ``node08 node09 node10``) and several
    bracket groups in one name multiply (``r[1-2]n[1-2]`` gives four hosts).

    Args:
        nodelist: The value of ``SLURM_JOB_NODELIST`` (or ``SLURM_STEP_NODELIST``).

    Returns:
        The host names, in order.

    Raises:
        DistributedSetupError: The list is empty or its brackets do not parse.
    """
    text = nodelist.strip()
    if not text:
        raise DistributedSetupError(
            "SLURM_JOB_NODELIST is empty", variable="SLURM_JOB_NODELIST", value=nodelist
        )
    hosts: list[str] = []
    for item in _split_top_level(text, nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_nodelist(original, "unmatched ']'")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise _bad_nodelist(original, "unmatched '['")
    items.append("".join(current))
    if any(not item for item in items):
        raise _bad_nodelist(original, "empty host name")
    return items


def _expand_host(item: str, original: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    expanded: list[str] = []
    for part in match.group(1).split(","):
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            low, high = int(bounds[0]), int(bounds[1])
            if high < low:
                raise _bad_nodelist(original, f"range {part!r} runs backwards")
            width = len(bounds[0])
            values = [str(number).zfill(width) for number in range(low, high + 1)]
        else:
            raise _bad_nodelist(original, f"range {part!r} is not N or N-M")
        for value in values:
            expanded.extend(_expand_host(prefix + value + suffix, original))
    return expanded


def _bad_nodelist(nodelist: str, why: str) -> DistributedSetupError:
    return DistributedSetupError(
        f"SLURM_JOB_NODELIST={nodelist!r} does not parse: {why}",
        variable="SLURM_JOB_NODELIST",
        value=nodelist,
    )


def slurm_default_port(job_id: str) -> int:
    """The rendezvous port used under SLURM when ``MASTER_PORT`` is not set.

    Args:
        job_id: ``SLURM_JOB_ID`` (digits).

    Returns:
        ``DEFAULT_SLURM_PORT_BASE + int(job_id) % 10000``.

    Raises:
        DistributedSetupError: The job id is not an integer.
    """
    return DEFAULT_SLURM_PORT_BASE + _int_var({"SLURM_JOB_ID": job_id}, "SLURM_JOB_ID") % 10000


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise DistributedSetupError(
            f"environment variable {name}={raw!r} is not an integer", variable=name, value=raw
        ) from None


def _tasks_on_node(tasks_per_node: str, node_id: int, variable: str) -> int:
    """Read ``2(x3),1`` (SLURM's compressed tasks-per-node form) for node ``node_id``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise DistributedSetupError(
                f"{variable}={tasks_per_node!r} does not parse (expected e.g. '4(x2),3')",
                variable=variable,
                value=tasks_per_node,
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node_id < len(counts):
        raise DistributedSetupError(
            f"SLURM_NODEID={node_id} is outside {variable}={tasks_per_node!r}",
            variable="SLURM_NODEID",
            value=str(node_id),
        )
    return counts[node_id]


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Work out the launcher and this process's place in the job from its environment.

    Rules, in order:

    1. torchrun (or any ``env://`` launcher): ``RANK`` or ``WORLD_SIZE`` is set. Both are
       then required; ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` default to a one-node job. These
       win over SLURM's variables, which torchrun inside ``sbatch`` leaves behind with
       ``SLURM_PROCID=0`` in every worker.
    2. SLURM ``srun``: ``SLURM_PROCID`` and ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``.
       The store runs on the first host of ``SLURM_STEP_NODELIST`` (else
       ``SLURM_JOB_NODELIST``) unless ``MASTER_ADDR`` is set, on ``MASTER_PORT`` or
       :func:`slurm_default_port`.
    3. Otherwise a single process.

    Args:
        environ: The variables to read; ``os.environ`` when None.

    Returns:
        The launch environment.

    Raises:
        DistributedSetupError: A variable is missing, not an integer or inconsistent with
            another; the error's ``variable`` names it.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _detect_torchrun(env)
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        return _detect_slurm(env)
    return LaunchEnvironment("single", 0, 1, 0, 1, None, None)


def _detect_torchrun(env: Mapping[str, str]) -> LaunchEnvironment:
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise DistributedSetupError(
                f"{other} is set but {name} is not: a distributed launch needs both",
                variable=name,
            )
    rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
    if world_size < 1:
        raise DistributedSetupError(
            f"WORLD_SIZE={world_size} must be at least 1", variable="WORLD_SIZE"
        )
    if not 0 <= rank < world_size:
        raise DistributedSetupError(
            f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})",
            variable="RANK",
        )
    local_world_size = (
        _int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
    )
    local_rank = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world_size
    _check_local(
        rank, world_size, local_rank, local_world_size,
        local_rank_var="LOCAL_RANK", local_size_var="LOCAL_WORLD_SIZE",
    )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise DistributedSetupError(
                f"RANK/WORLD_SIZE are set but {name} is not: the ranks cannot find each other",
                variable=name,
            )
    port = _port(env, "MASTER_PORT")
    restarts = (
        _int_var(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0
    )
    node_rank, num_nodes = _node_position(
        env, rank, world_size, local_world_size,
        rank_var="GROUP_RANK", size_vars=("GROUP_WORLD_SIZE",),
    )
    return LaunchEnvironment(
        "torchrun", rank, world_size, local_rank, local_world_size, env["MASTER_ADDR"], port,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart_count=restarts, node_rank=node_rank, num_nodes=num_nodes,
    )


def _node_position(
    env: Mapping[str, str], rank: int, world_size: int, local_world_size: int,
    *, rank_var: str, size_vars: tuple[str, ...], nodes_listed: int | None = None,
) -> tuple[int, int]:
    """``(node_rank, num_nodes)`` from the launcher's variables, else derived."""
    size_var = next((name for name in size_vars if name in env), None)
    if size_var is not None:
        num_nodes = _int_var(env, size_var)
    elif nodes_listed is not None:
        size_var, num_nodes = "SLURM_JOB_NODELIST", nodes_listed
    else:
        size_var = size_vars[0]
        num_nodes = -(-world_size // local_world_size)
    node_rank = _int_var(env, rank_var) if rank_var in env else rank // local_world_size
    if not 1 <= num_nodes <= world_size:
        raise DistributedSetupError(
            f"{size_var}={num_nodes} nodes is outside 1..{world_size} (the world size)",
            variable=size_var,
        )
    if not 0 <= node_rank < num_nodes:
        raise DistributedSetupError(
            f"{rank_var}={node_rank} is outside 0..{num_nodes - 1} ({size_var}={num_nodes})",
            variable=rank_var,
        )
    return node_rank, num_nodes


def _detect_slurm(env: Mapping[str, str]) -> LaunchEnvironment:
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    rank, world_size = _int_var(env, "SLURM_PROCID"), _int_var(env, size_var)
    if world_size < 1:
        raise DistributedSetupError(
            f"{size_var}={world_size} must be at least 1", variable=size_var
        )
    if not 0 <= rank < world_size:
        raise DistributedSetupError(
            f"SLURM_PROCID={rank} is outside 0..{size_var}-1 ({size_var}={world_size})",
            variable="SLURM_PROCID",
        )
    local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    per_node_var = next(
        (name for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if name in env),
        None,
    )
    if per_node_var is not None:
        node_id = _int_var(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        local_world_size = _tasks_on_node(env[per_node_var], node_id, per_node_var)
    else:
        local_world_size = max(local_rank + 1, 1)
    _check_local(
        rank, world_size, local_rank, local_world_size,
        local_rank_var="SLURM_LOCALID", local_size_var=per_node_var or "SLURM_TASKS_PER_NODE",
    )
    list_var = next(
        (
            name
            for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if name in env
        ),
        None,
    )
    nodes = expand_nodelist(env[list_var]) if list_var is not None else None
    if "MASTER_ADDR" in env:
        master_addr = env["MASTER_ADDR"]
    elif nodes is None:
        raise DistributedSetupError(
            "under SLURM neither MASTER_ADDR nor SLURM_JOB_NODELIST is set",
            variable="SLURM_JOB_NODELIST",
        )
    else:
        # The first node of the step serves the store: rank 0 runs there (SLURM's block
        # distribution puts task 0 on the first node of the list).
        master_addr = nodes[0]
    node_rank, num_nodes = _node_position(
        env, rank, world_size, local_world_size, rank_var="SLURM_NODEID",
        size_vars=("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
        nodes_listed=len(nodes) if nodes is not None else None,
    )
    if "MASTER_PORT" in env:
        port = _port(env, "MASTER_PORT")
    elif "SLURM_JOB_ID" in env:
        port = slurm_default_port(env["SLURM_JOB_ID"])
    else:
        raise DistributedSetupError(
            "under SLURM neither MASTER_PORT nor SLURM_JOB_ID is set", variable="MASTER_PORT"
        )
    return LaunchEnvironment(
        "slurm", rank, world_size, local_rank, local_world_size, master_addr, port,
        node_rank=node_rank, num_nodes=num_nodes,
    )


def _check_local(
    rank: int, world_size: int, local_rank: int, local_world_size: int,
    *, local_rank_var: str, local_size_var: str,
) -> None:
    if not 1 <= local_world_size <= world_size:
        raise DistributedSetupError(
            f"{local_size_var}={local_world_size} is outside 1..{world_size} (the world size)",
            variable=local_size_var,
        )
    if not 0 <= local_rank < local_world_size:
        raise DistributedSetupError(
            f"{local_rank_var}={local_rank} is outside 0..{local_world_size - 1} "
            f"({local_size_var}={local_world_size})",
            variable=local_rank_var,
        )
    if local_rank > rank:
        raise DistributedSetupError(
            f"{local_rank_var}={local_rank} is greater than the global rank {rank}",
            variable=local_rank_var,
        )


def _port(env: Mapping[str, str], name: str) -> int:
    port = _int_var(env, name)
    if not 0 < port < 65536:
        raise DistributedSetupError(f"{name}={port} is not a TCP port (1..65535)", variable=name)
    return port


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
