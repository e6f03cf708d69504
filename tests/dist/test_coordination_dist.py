"""The checkpoint group's broadcast, gather, all-gather and failure agreement on gloo ranks.

A small object takes one collective (its size rides in a fixed frame with its first
bytes); a longer one a second collective for the rest. Every value arrives whole,
whatever size each rank's is, and peer failures keep their names.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumekit.errors import StepCollisionError
from resumekit.store.coordination import FRAME_BYTES, ProcessGroupCoordinator, agree_on_failure
from tests.distributed_harness import run_ranks


def _values(rank: int) -> list[Any]:
    """Values of many sizes: empty, small, one byte short of the frame, past it."""
    return [None, {"rank": rank, "files": [f"__{rank}_0.distcp"]},
            b"x" * (FRAME_BYTES - 64), "y" * (FRAME_BYTES * 3 + rank * 1000),
            ("error", StepCollisionError(f"step 10 exists (rank {rank})", path="/root"))]


@contextlib.contextmanager
def _calls_of(*names: str) -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` calls among ``names`` made inside, in order."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in names}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _exchange(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = ProcessGroupCoordinator()
    with _calls_of("broadcast", "all_gather") as calls:
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


class _Unpicklable(Exception):
    """An error holding a lock: it does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _agree(rank: int, world_size: int, failing: tuple[int, ...], unpicklable: bool
           ) -> dict[str, Any]:
    coordinator = ProcessGroupCoordinator()
    own: Exception | None = None
    if rank in failing:
        own = (_Unpicklable if unpicklable else StepCollisionError)(
            f"step 7 exists (rank {rank})")
    raised: Exception | None = None
    with _calls_of("all_reduce", "broadcast", "all_gather") as calls:
        try:
            agree_on_failure(coordinator, own)
        except Exception as error:  # noqa: BLE001 - what each rank raised is the result
            raised = error
    return {"calls": calls, "type": type(raised).__name__ if raised else None,
            "text": str(raised) if raised else None, "own": raised is own and own is not None,
            "from": coordinator.broadcast(rank, source=world_size - 1)}


def test_ranks_that_all_succeed_agree_in_one_all_reduce_and_raise_nothing() -> None:
    for result in run_ranks(_agree, world_size=3, args=((), False)):
        assert result["calls"] == ["all_reduce"] and result["type"] is None, result
        assert result["from"] == 2  # a broadcast from the last rank reaches every rank


def test_every_rank_raises_the_lowest_failing_ranks_error_sent_from_that_rank() -> None:
    results = run_ranks(_agree, world_size=3, args=((1, 2), False))
    for rank, result in enumerate(results):
        assert result["calls"] == ["all_reduce", "broadcast"], (rank, result)
        assert result["type"] == "StepCollisionError", (rank, result)
        assert result["text"] == "step 7 exists (rank 1)", (rank, result)
        assert result["own"] == (rank == 1), (rank, result)  # rank 1 raises its own object


def test_an_error_that_does_not_pickle_reaches_the_other_ranks_as_text_naming_it() -> None:
    results = run_ranks(_agree, world_size=2, args=((0,), True))
    assert results[0]["type"] == "_Unpicklable" and results[0]["own"], results[0]
    assert results[1]["type"] == "CoordinationError", results[1]
    assert "rank 0 failed with _Unpicklable: step 7 exists (rank 0)" in results[1]["text"]
    assert "does not pickle" in results[1]["text"]


def _gather(rank: int, world_size: int) -> dict[str, Any]:
    coordinator = ProcessGroupCoordinator()
    rounds, got = [], []
    with _calls_of("gather", "send", "recv", "all_gather") as calls:
        for index in range(len(_values(0))):
            calls.clear()
            got.append(coordinator.gather(_values(rank)[index]))
            rounds.append(list(calls))
    same = [gathered is None if rank else [str(v) for v in gathered] == [
        str(_values(r)[index]) for r in range(world_size)] for index, gathered in enumerate(got)]
    return {"rounds": rounds, "same": same}


def test_a_gather_brings_every_value_to_rank_0_alone_and_longer_ones_point_to_point() -> None:
    results = run_ranks(_gather, world_size=3)
    for rank, result in enumerate(results):
        assert all(result["same"]), (rank, result["same"])
        # each value's size: small, small, frame - 64, past the frame (every rank), small
        # ranks 1 and 2 send the rest of theirs to rank 0
        longer = ["gather", "recv", "recv"] if rank == 0 else ["gather", "send"]
        assert result["rounds"] == [["gather"], ["gather"], ["gather"], longer, ["gather"]], (
            rank, result["rounds"])


def _publish_failing(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from resumekit.store.commit import CommitProtocol  # noqa: PLC0415 - in the rank
    from resumekit.store.manifest import Manifest  # noqa: PLC0415
    from resumekit.store.storage import Storage  # noqa: PLC0415

    protocol = CommitProtocol(Storage(root), coordinator=ProcessGroupCoordinator())
    pending = protocol.begin(3)
    failure = OSError(28, f"No space left on device (rank {rank})") if rank == 2 else None
    try:
        protocol.publish(pending, Manifest(step=3), failure=failure)
        raised = None
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(error).__name__}: {error}"
    return {"raised": raised, "committed": sorted(p.name for p in Path(root).iterdir()
                                                  if p.name.startswith("step_"))}


def test_a_write_failing_on_rank_2_is_raised_on_every_rank_through_the_gather(
        tmp_path: Path) -> None:
    results = run_ranks(_publish_failing, world_size=3, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["raised"] == "OSError: [Errno 28] No space left on device (rank 2)", (
            rank, result)
        assert result["committed"] == [], (rank, result)
