"""The manager's channels: a process group, the coordinator over it, its commit protocol.

A manager talks to the other ranks on two channels: the main one (restore, blocking saves,
load_weights), on the checkpoint group of :func:`~resumekit.init_distributed` or the group
given, and, with ``async_save`` on several ranks, a save channel of its own, so that the
background save's collectives never interleave with the main thread's. Without a process
group (one rank) a channel coordinates nothing.

A group a channel made (:func:`open_channel` with ``own_group``, or without a group to take)
is the channel's: :func:`close_channels` destroys it, once, when the manager closes. A group
given (``process_group``) or :func:`~resumekit.init_distributed`'s is its owner's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from resumekit.runtime import distributed
from resumekit.store.commit import CommitProtocol
from resumekit.store.coordination import Coordinator, ProcessGroupCoordinator, SingleProcess
from resumekit.store.generations import Fence
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage

__all__ = ["Channel", "ChannelSet", "close_channels", "is_distributed", "new_save_group",
           "open_channel"]


@dataclass(frozen=True)
class Channel:
    """A process group, the coordinator over it, and the commit protocol that uses it.

    Attributes:
        group: The process group (None on one rank).
        coordinator: The coordinator over it.
        protocol: The commit protocol that uses it.
        owned: The group was made for this channel: :func:`close_channels` destroys it.
    """

    group: dist.ProcessGroup | None
    coordinator: Coordinator
    protocol: CommitProtocol
    owned: bool = False


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
                 group: dist.ProcessGroup | None = None, *, own_group: bool = False
                 ) -> Channel:
    """The channel over ``group`` (default: the checkpoint group, else a new gloo group).

    With several ranks this is a collective when it makes a group (every rank opens the
    same channels in the same order).

    Args:
        storage: The root the commit protocol writes.
        name_format: Its step directory names.
        fence: The run's writer generation, shared by all of a manager's channels.
        group: The process group; ignored on one rank, and with ``own_group``.
        own_group: Make a new gloo group of the channel's own (:func:`new_save_group`).
    """
    coordinator: Coordinator
    owned = False
    if not is_distributed():
        group, coordinator = None, SingleProcess()
    else:
        group = None if own_group else group or distributed.checkpoint_group()
        if group is None:
            group, owned = new_save_group(), True
        coordinator = ProcessGroupCoordinator(group)
    return Channel(group, coordinator,
                   CommitProtocol(storage, name_format, coordinator, fence=fence), owned)


def close_channels(channels: Iterable[Channel], *, meet: bool) -> None:
    """Destroy the groups ``channels`` made (each once, in the order given); keep the rest.

    Call once no thread uses them any more. A group neither given nor made here (the
    checkpoint group, the caller's) is left to its owner.

    Args:
        channels: The channels to close; one listed twice is closed once.
        meet: Meet the other ranks on each group before destroying it (a gloo group
            destroyed while a peer still sends on it can abort that peer): every rank
            closes the same channels. False where the ranks may not all get here (a
            constructor that failed on this rank): each group is destroyed at once.

    Raises:
        RuntimeError: A meeting failed (every group is destroyed all the same).
    """
    if not dist.is_initialized():
        return  # destroying the default group destroyed every group with it
    done: list[dist.ProcessGroup] = []
    failure: BaseException | None = None
    for channel in channels:
        group = channel.group
        if not channel.owned or group is None or any(group is seen for seen in done):
            continue
        done.append(group)
        try:
            if meet and failure is None:
                dist.barrier(group=group)
        except BaseException as error:  # noqa: BLE001 - destroyed all the same, then raised
            failure = error
        finally:
            dist.destroy_process_group(group)
    if failure is not None:
        raise failure


class ChannelSet:
    """The channels of one manager: opened here, and the groups they made closed once.

    Args:
        storage: The root their commit protocols write.
        name_format: Its step directory names.
        fence: The run's writer generation, shared by all of them.
    """

    def __init__(self, storage: Storage, name_format: NameFormat, fence: Fence) -> None:
        self._storage, self._name_format, self._fence = storage, name_format, fence
        self._opened: list[Channel] = []

    def open(self, group: dist.ProcessGroup | None = None, *, own_group: bool = False
             ) -> Channel:
        """:func:`open_channel`, remembered for :meth:`close`."""
        channel = open_channel(self._storage, self._name_format, self._fence, group,
                               own_group=own_group)
        self._opened.append(channel)
        return channel

    def close(self, *, meet: bool) -> Channel:
        """Destroy the groups the channels opened made (:func:`close_channels`), once.

        Returns:
            A channel of no group, for the closed manager (whose methods refuse to run):
            once it holds no channel opened here, the destroyed groups are freed, their
            sockets closed.

        Raises:
            RuntimeError: A meeting failed (every group is destroyed all the same).
        """
        opened, self._opened = self._opened, []
        close_channels(opened, meet=meet)
        coordinator = SingleProcess()
        return Channel(None, coordinator, CommitProtocol(
            self._storage, self._name_format, coordinator, fence=self._fence))
