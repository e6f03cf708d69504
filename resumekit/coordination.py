"""How ranks agree during a save: barrier, broadcast, all-gather of small objects.

The commit protocol takes a :class:`Coordinator` instead of a process group, so the store
works (and is tested) in one process, and a trainer's ranks coordinate over the
*checkpoint* process group, never the training one.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

__all__ = [
    "Coordinator",
    "ProcessGroupCoordinator",
    "SingleProcess",
    "run_on_every_rank",
    "run_on_leader",
]

T = TypeVar("T")


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

    def broadcast(self, value: T) -> T:
        """Return rank 0's ``value`` on every rank."""
        ...

    def all_gather(self, value: T) -> list[T]:
        """Return every rank's ``value``, indexed by rank."""
        ...


class SingleProcess:
    """The coordinator of a save written by one process."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        """Nothing to wait for."""

    def broadcast(self, value: T) -> T:
        """Return ``value``."""
        return value

    def all_gather(self, value: T) -> list[T]:
        """Return ``[value]``."""
        return [value]


class ProcessGroupCoordinator:
    """Coordinate over a ``torch.distributed`` process group (the checkpoint group).

    Args:
        group: The process group; None means the default group.
    """

    def __init__(self, group: Any = None) -> None:
        # Imported here: the store (commit, catalog, CLI) must import without
        # torch.distributed, which costs seconds (crash tests fork writers by the hundred).
        import torch.distributed as dist  # noqa: PLC0415

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        """Block until every rank of the group arrives."""
        self._dist.barrier(group=self.group)

    def broadcast(self, value: T) -> T:
        """Return the group-rank-0 ``value`` on every rank."""
        box = [value]
        source = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]

    def all_gather(self, value: T) -> list[T]:
        """Return every rank's ``value``."""
        boxes: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(boxes, value, group=self.group)
        return boxes


def run_on_leader(coordinator: Coordinator, action: Any) -> Any:
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
    outcome = coordinator.broadcast(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def run_on_every_rank(coordinator: Coordinator, action: Any) -> Any:
    """Run ``action()`` on every rank; if it failed on any rank, raise on every rank.

    Each rank returns its own result. The error raised is the lowest failing rank's, so
    all ranks take the same branch and none is left waiting in the next collective.
    """
    outcome: tuple[str, Any] = ("ok", None)
    try:
        outcome = ("ok", action())
    except Exception as error:  # noqa: BLE001 - re-raised on every rank below
        outcome = ("error", error)
    for status, value in coordinator.all_gather(outcome):
        if status == "error":
            raise value
    return outcome[1]
