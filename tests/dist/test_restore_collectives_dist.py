"""How many collectives a restore makes on 2 gloo ranks: pinned, so a new one is seen (issue 40).

Each collective of gloo passes O(W) messages through some rank (an all-gather through every
rank), on gloo's transport thread: at W = 32 that thread's CPU was the largest part of a
restoring rank's growth. The count is of the tensor collectives the wire sees (an object
collective of ``torch.distributed`` is two: its sizes, then its bytes), made by the main
thread from the start of ``restore()`` to its end.
"""

from __future__ import annotations

import collections
import importlib
import json
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from resumekit import CheckpointManager
from tests.dist.tiny_fsdp2 import stepped_tiny_fsdp2_adamw, tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

#: The tensor collectives of ``torch.distributed`` (what its object collectives call).
COLLECTIVES = ("barrier", "broadcast", "all_gather", "all_gather_into_tensor", "all_reduce",
               "gather", "scatter", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "monitored_barrier")

#: A restore of a run sharded as its checkpoint (FSDP2), ``restore_reads="once"``:
#: the survey's broadcast (with the writer generation's claim and ``.metadata``), the
#: metadata parts' gather (with each rank's check of its share of the files) and
#: scatter, the load's agreement and the read's (each one all-reduce of one integer where
#: no rank failed), the final meeting.
EXPECTED = {"broadcast": 1, "all_reduce": 2, "gather": 1, "scatter": 1, "barrier": 1}


def _counting() -> tuple[collections.Counter[str], list[bool]]:
    """Count this process's collectives (main thread) while the flag is set."""
    counts: collections.Counter[str] = collections.Counter()
    active = [False]
    main = threading.main_thread()
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue

        def counted(*args: Any, _original: Callable[..., Any] = original, _name: str = name,
                    **kwargs: Any) -> Any:
            if active[0] and threading.current_thread() is main:
                counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(c10d, name, counted)
        if getattr(torch.distributed, name, None) is original:
            setattr(torch.distributed, name, counted)
    return counts, active


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor().clone() for key, value in model.state_dict().items()}


def _restore(rank: int, world_size: int, root: str, small_frames: bool) -> dict[str, Any]:
    if small_frames:  # every request and part longer than its frame: the second rounds
        # (the package's ``load`` is a function: the module is looked up by its name)
        load = importlib.import_module("resumekit.tensors.load")
        parts = importlib.import_module("resumekit.tensors.metadata_parts")
        parts.EXCHANGE_FRAME_BYTES = 64
        load.exchange_frame_bytes = lambda keys: 64
    model, optimizer = stepped_tiny_fsdp2_adamw()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()
    saved = _weights(model)
    model, optimizer = tiny_fsdp2_adamw()
    restorer = CheckpointManager(root, model=model, optimizer=optimizer)
    counts, active = _counting()
    active[0] = True
    step = restorer.restore()
    active[0] = False
    restorer.close()
    got = _weights(model)
    return {"step": step, "counts": dict(counts),
            "same": all(torch.equal(saved[key], got[key]) for key in saved)}


def test_a_restore_makes_one_broadcast_two_all_reduces_one_gather_one_scatter_one_barrier(
        tmp_path: Path) -> None:
    results = run_ranks(_restore, world_size=2, args=(str(tmp_path), False))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        assert result["counts"] == EXPECTED, (rank, result["counts"])


def test_requests_and_parts_longer_than_their_frames_take_a_second_gather_and_two_scatters(
        tmp_path: Path) -> None:
    results = run_ranks(_restore, world_size=2, args=(str(tmp_path), True))
    longer = {**EXPECTED, "gather": 2, "scatter": 3}
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        assert result["counts"] == longer, (rank, result["counts"])


def _restore_damaged(rank: int, world_size: int, root: str, checked: bool) -> dict[str, Any]:
    model, optimizer = tiny_fsdp2_adamw()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    for step in (1, 2):
        model(torch.full((2, 6), float(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save(step)
        if step == 1:
            at_1 = _weights(model)
    manager.close()
    step_2 = Path(root) / "step_000000002"
    if checked:  # a file rank 1 alone checksums before the load (its share, r::n)
        listed = [entry["path"] for entry in json.loads(
            (step_2 / "manifest.json").read_text())["files"]]
        share = [path for path in listed if path != "tensors/.metadata"][1::world_size]
        damaged = step_2 / next(path for path in share if path.endswith(".pt"))
        at = -1
    else:  # rank 1's file: at its start, its shard of model.0.weight, which only rank 1
        # reads (the run shards as its checkpoint; rank 0 reads the small whole items)
        damaged = step_2 / "tensors" / "__1_0.distcp"
        at = 100
    torch.distributed.barrier()
    if rank == 0:
        data = bytearray(damaged.read_bytes())
        data[at] ^= 0xFF
        damaged.write_bytes(bytes(data))
    torch.distributed.barrier()
    model, optimizer = tiny_fsdp2_adamw()
    restorer = CheckpointManager(root, model=model, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = restorer.restore()
    restorer.close()
    got = _weights(model)
    return {"step": step, "file": str(damaged), "warnings": [str(w.message) for w in caught],
            "same": all(torch.equal(at_1[key], got[key]) for key in at_1)}


def test_a_damaged_file_only_one_rank_reads_fails_both_ranks_naming_it_and_both_fall_back(
        tmp_path: Path) -> None:
    # No rank reads another's bytes here, so the ranks skip agreeing on who reads what:
    # the reading rank's failure must still reach the other at the load's agreement.
    results = run_ranks(_restore_damaged, world_size=2, args=(str(tmp_path), False))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        named = [w for w in result["warnings"] if result["file"] in w and "step 2" in w
                 and "model.0.weight" in w and "checksum" in w]
        assert named, (rank, result["warnings"])


def test_a_file_only_one_rank_checksums_before_the_load_fails_both_ranks_naming_it(
        tmp_path: Path) -> None:
    # The check's failure on rank 1 travels in the metadata parts' gather (no agreement
    # of its own): both ranks raise it there, before reading, and fall back together.
    results = run_ranks(_restore_damaged, world_size=2, args=(str(tmp_path), True))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        named = [w for w in result["warnings"] if result["file"] in w and "step 2" in w
                 and "checksum" in w]
        assert named, (rank, result["warnings"])
