"""The checkpoint group's broadcast and all-gather on real gloo ranks.

A small object takes one collective (its size rides in a fixed frame with its first
bytes); a longer one a second collective for the rest. Every value arrives whole,
whatever size each rank's is, and peer failures keep their names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from resumekit.errors import StepCollisionError
from resumekit.store.coordination import FRAME_BYTES, ProcessGroupCoordinator
from tests.distributed_harness import run_ranks


def _values(rank: int) -> list[Any]:
    """Values of many sizes: empty, small, one byte short of the frame, past it."""
    return [None, {"rank": rank, "files": [f"__{rank}_0.distcp"]},
            b"x" * (FRAME_BYTES - 64), "y" * (FRAME_BYTES * 3 + rank * 1000),
            ("error", StepCollisionError(f"step 10 exists (rank {rank})", path="/root"))]


def _exchange(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = ProcessGroupCoordinator()
    calls: list[str] = []
    broadcast, all_gather = dist.broadcast, dist.all_gather

    def counted(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return function(*args, **kwargs)
        return call

    dist.broadcast, dist.all_gather = counted("broadcast", broadcast), counted(
        "all_gather", all_gather)
    try:
        rounds, same = [], []
        for index, value in enumerate(_values(rank)):
            calls.clear()
            got = coordinator.broadcast(value)
            gathered = coordinator.all_gather(value)
            rounds.append(list(calls))
            expected = _values(0)[index]
            if isinstance(expected, tuple):  # an exception compares by type and text
                same.append(type(got[1]) is type(expected[1]) and str(got[1]) == str(
                    expected[1]) and [str(g[1]) for g in gathered] == [
                    str(_values(r)[index][1]) for r in range(world_size)])
            else:
                same.append(got == expected and gathered == [
                    _values(r)[index] for r in range(world_size)])
        # a value of a rank longer than the frame while the other's fits
        calls.clear()
        mixed = coordinator.all_gather(b"z" * (FRAME_BYTES * 2 if rank == 1 else 10))
        mixed_rounds = list(calls)
    finally:
        dist.broadcast, dist.all_gather = broadcast, all_gather
    return {"rounds": rounds, "same": same, "mixed": [len(v) for v in mixed],
            "mixed_rounds": mixed_rounds, "tensor": torch.equal(
                coordinator.broadcast(torch.arange(5) * (rank + 1)), torch.arange(5))}


def test_small_objects_take_one_collective_and_every_size_arrives_whole() -> None:
    for result in run_ranks(_exchange, world_size=2):
        assert all(result["same"]), result["same"]
        one, two = ["broadcast", "all_gather"], ["broadcast", "broadcast", "all_gather",
                                                 "all_gather"]
        assert result["rounds"] == [one, one, one, two, one], result["rounds"]
        assert result["mixed"] == [10, FRAME_BYTES * 2]
        assert result["mixed_rounds"] == ["all_gather", "all_gather"]
        assert result["tensor"]
