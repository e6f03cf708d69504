"""Where this process sits in the job, read from its launcher's environment.

:func:`detect_launch` reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, the agent's store and restart count, ``GROUP_RANK``), or
SLURM ``srun``'s (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the first host of
the node list, :func:`expand_nodelist`, and a port from the job id,
:func:`slurm_default_port`), or none (a single process), into one
:class:`LaunchEnvironment`. Inside ``sbatch`` + torchrun both sets of variables exist and
``SLURM_PROCID`` is 0 in every worker, so torchrun's variables win whenever they are
present. A variable that cannot be right is a ``DistributedSetupError`` naming it.

It reads the environment only: no process group, no store, no torch.
:mod:`resumekit.runtime.distributed` sets up the groups from what it finds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from resumekit.errors import DistributedSetupError

__all__ = [
    "DEFAULT_SLURM_PORT_BASE",
    "LaunchEnvironment",
    "Launcher",
    "detect_launch",
    "expand_nodelist",
    "slurm_default_port",
]

Launcher = Literal["torchrun", "slurm", "single"]

DEFAULT_SLURM_PORT_BASE = 15000
"""Under SLURM without ``MASTER_PORT``: port = ``15000 + SLURM_JOB_ID % 10000``.

The range 15000-24999 stays below Linux's ephemeral range (32768-60999), so an outgoing
connection never holds the port, and two jobs sharing a first node get different ports
unless their ids are equal modulo 10000.
"""

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
