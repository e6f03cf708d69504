"""The manager's channels: a process group, the coordinator over it, its commit protocol.

A manager talks to the other ranks on two channels: the main one (restore, blocking saves,
load_weights), on the checkpoint group of :func:`~resumekit.init_distributed` or the group
given, and, with ``async_save`` on several ranks, a save channel of its own, so that the
background save's collectives never interleave with the main thread's. Without a process
group (one rank) a channel coordinates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from resumekit.runtime import distributed
from resumekit.store.commit import CommitProtocol
from resumekit.store.coordination import Coordinator, ProcessGroupCoordinator, SingleProcess
from resumekit.store.generations import Fence
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage

__all__ = ["Channel", "is_distributed", "new_save_group", "open_channel"]


@dataclass(frozen=True)
class Channel:
    """A process group, the coordinator over it, and the commit protocol that uses it."""

    group: dist.ProcessGroup | None
    coordinator: Coordinator
    protocol: CommitProtocol


def is_distributed() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def new_save_group() -> dist.ProcessGroup:
    """A new gloo group of every rank, with the checkpoint timeout (default two hours)."""
    context = distributed.current_context()
    timeout = context.checkpoint_timeout if context is not None else timedelta(hours=2)
    group: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timeout)
    return group


def open_channel(storage: Storage, name_format: NameFormat, fence: Fence,
                 group: dist.ProcessGroup | None = None) -> Channel:
    """The channel over ``group`` (default: the checkpoint group, else a new gloo group).

    Args:
        storage: The root the commit protocol writes.
        name_format: Its step directory names.
        fence: The run's writer generation, shared by all of a manager's channels.
        group: The process group; ignored on one rank.
    """
    coordinator: Coordinator
    if not is_distributed():
        group, coordinator = None, SingleProcess()
    else:
        group = group or distributed.checkpoint_group() or new_save_group()
        coordinator = ProcessGroupCoordinator(group)
    return Channel(group, coordinator,
                   CommitProtocol(storage, name_format, coordinator, fence=fence))
