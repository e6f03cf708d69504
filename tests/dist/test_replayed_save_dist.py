"""resumekit.tensors.replayed_save on 2 real FSDP2 ranks: a steady-state save written without DCP.

The replayed save must write exactly DCP's bytes (every file, ``.metadata`` included), fall
back to DCP's path on every rank whenever any rank cannot replay, and fail on every rank
(never hang, never leave ``.metadata``) when one rank cannot write.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumekit.errors import StorageError
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.tensors import sharded
from resumekit.tensors.save_planner import forget_plans
from tests.dist.test_save_planner_dist import _flat, _reload_matches, _state, counting_calls
from tests.dist.test_sharded_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def _counting_dcp_saves() -> list[int]:
    return counting_calls(sharded, "dcp_save")


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _more(number: int) -> dict[str, Any]:
    # A replicated tensor too large to pack (its block checksums live in .metadata and
    # change with its values) and a non-tensor value of constant pickled length.
    generator = torch.Generator().manual_seed(number)
    return {"big": torch.randn(40_000, generator=generator), "label": f"save-{number:04d}"}


def _said(name: str = "resumekit.tensors.replayed_save") -> list[str]:
    """Every message logger ``name`` logs from now on in this rank, DEBUG included."""
    said: list[str] = []

    class _Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.addHandler(_Said())
    logger.setLevel(logging.DEBUG)
    return said


def _replayed_against_planned(rank: int, world_size: int, root: str) -> dict[str, Any]:
    forget_plans()
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer, **_more(0)), Path(root) / "planned-first")
    train_step(model, optimizer, "transformer", seed=1)
    state = _state(model, optimizer, **_more(1))
    written = sharded.save(state, Path(root) / "replayed")
    replayed_calls = dcp_calls[0]
    forget_plans()  # the same state the long way
    again = sharded.save(state, Path(root) / "planned")
    dist.barrier()
    one, two = _files(Path(root) / "replayed"), _files(Path(root) / "planned")
    same_files = one == two
    return {"dcp_calls": (replayed_calls, dcp_calls[0]), "same_files": same_files,
            "same_written": written == again,
            "reloads": _reload_matches(Path(root) / "replayed", _flat(state), _more(1))}


def test_a_replayed_save_writes_every_byte_dcps_planned_save_writes(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_replayed_against_planned, world_size=2,
                                            args=(str(tmp_path),))):
        assert result["dcp_calls"] == (1, 2), (rank, result)  # the second save: no DCP
        assert result["same_files"], rank
        assert result["same_written"], rank  # names, sizes, checksums, references
        assert result["reloads"], rank


def _lengths_decide(rank: int, world_size: int, root: str) -> dict[str, Any]:
    said = _said()
    forget_plans()
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    counts, reloads = [], []
    # Each rank's own value: the same length, then (rank 1 only) longer from save 2 on.
    labels = ["a" * 8, "b" * 8, "c" * 3000, "d" * 3000] if rank == 1 else ["a" * 8] * 4
    for number, label in enumerate(labels):
        train_step(model, optimizer, "transformer", seed=number)
        more: dict[str, Any] = {f"label{rank}": label}
        before = dcp_calls[0]
        state = _state(model, optimizer, **more)
        sharded.save(state, Path(root) / f"save{number}")
        counts.append(dcp_calls[0] - before)
        reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), more))
    return {"dcp_calls": counts, "reloads": reloads, "said": said}


def test_a_value_whose_pickled_length_changes_on_one_rank_makes_every_rank_plan_in_full(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_lengths_decide, world_size=2,
                                            args=(str(tmp_path),))):
        # save 0 plans; save 1 replays (same length, new value); save 2: rank 1's label
        # grew, so both ranks plan; save 3 replays the plan of save 2.
        assert result["dcp_calls"] == [1, 0, 1, 0], (rank, result)
        assert result["reloads"] == [True] * 4, (rank, result)
        # The one save planned in full says so, with this rank's reason, naming the save.
        (said,) = result["said"]
        assert "save2" in said and "planned in full, not replayed" in said, said
        assert ("label1 pickles to" in said) if rank == 1 else \
            ("another rank cannot replay" in said), said


def _one_rank_cannot_write(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from resumekit.tensors.raw import writer as raw_tensor_files  # noqa: PLC0415 - patched in this rank's process

    forget_plans()
    dcp_calls = _counting_dcp_saves()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=0)
    sharded.save(_state(model, optimizer), Path(root) / "first")
    original = raw_tensor_files.RawTensorWriter.write_jobs
    failing = [rank == 1]

    def write_jobs(self: Any, jobs: Any, prefix: str) -> Any:
        if failing[0]:
            raise raw_tensor_files._write_failure(
                str(Path(self.path) / jobs[0][0]), OSError(errno.ENOSPC, "No space left"),
                "write")
        return original(self, jobs, prefix)

    raw_tensor_files.RawTensorWriter.write_jobs = write_jobs  # type: ignore[method-assign]
    train_step(model, optimizer, "transformer", seed=1)
    error: StorageError | None = None
    before = dcp_calls[0]
    try:
        sharded.save(_state(model, optimizer), Path(root) / "second")
    except StorageError as caught:
        error = caught
    replayed = dcp_calls[0] == before
    failing[0] = False
    state = _state(model, optimizer)
    sharded.save(state, Path(root) / "third")
    return {"error": None if error is None else str(error),
            "errno": None if error is None else error.errno, "replayed": replayed,
            "metadata_left": (Path(root) / "second" / DCP_METADATA_FILE).exists(),
            "third_planned": dcp_calls[0] - before == 1,
            "third_reloads": _reload_matches(Path(root) / "third", _flat(state), {})}


def test_one_rank_failing_a_replayed_save_fails_it_on_every_rank_and_the_next_save_plans(
        tmp_path: Path) -> None:
    results = run_ranks(_one_rank_cannot_write, world_size=2, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["replayed"], (rank, result)
        assert result["error"] is not None, (rank, result)
        assert not result["metadata_left"], (rank, result)
        assert result["third_planned"] and result["third_reloads"], (rank, result)
    assert results[1]["errno"] == errno.ENOSPC  # the failing rank: its own error
    assert "the disk is full" in results[1]["error"]
    assert "rank 1" in results[0]["error"] and "second" in results[0]["error"]


def _one_rank_cannot_keep_its_record(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from resumekit.tensors import replayed_save  # noqa: PLC0415 - patched in this rank's process

    forget_plans()
    dcp_calls = _counting_dcp_saves()
    original = replayed_save._record_of
    broken = [rank == 0]

    def record_of(*args: Any) -> Any:
        if broken[0]:
            broken[0] = False
            raise OSError(errno.EIO, "Input/output error")
        return original(*args)

    replayed_save._record_of = record_of  # type: ignore[assignment]
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    counts, reloads = [], []
    for number in range(3):
        train_step(model, optimizer, "transformer", seed=number)
        state = _state(model, optimizer)
        before = dcp_calls[0]
        sharded.save(state, Path(root) / f"save{number}")
        counts.append(dcp_calls[0] - before)
        reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), {}))
    return {"dcp_calls": counts, "reloads": reloads}


def test_a_rank_that_cannot_keep_its_record_votes_to_plan_and_no_rank_waits_for_it(
        tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_one_rank_cannot_keep_its_record, world_size=2,
                                            args=(str(tmp_path),), group_timeout_s=60)):
        # save 0 plans, rank 0 keeps no record; save 1 plans on both; save 2 replays.
        assert result["dcp_calls"] == [1, 1, 0], (rank, result)
        assert result["reloads"] == [True] * 3, (rank, result)
