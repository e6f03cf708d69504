"""Each restoring rank plans from its part of ``.metadata``, on 2 gloo ranks (issue 40).

``.metadata`` is laid out by rank (``schema_version`` 5): rank 0 reads its head and sends
it; when the load plans, each rank reads its own part. With the same sharding that is one
chunk per sharded tensor (its own), and no rank reads the whole file: rank 0 parses it
0 times. Restoring the FSDP2 checkpoint into an unsharded model (each rank wants every
tensor whole), no rank's part covers its request: rank 0 reads the whole file once and
answers each rank with both ranks' chunks, as before schema 5: the resharding case still
reads everything it needs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import resumekit.restore_root
from resumekit import CheckpointManager
from resumekit.tensors import metadata_file
from tests.dist.tiny_fsdp2 import tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

# the module: the package exports a function of the same name
LOAD = importlib.import_module("resumekit.tensors.load")


def _steps(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(state["step"]) for state in optimizer.state.values()]


def _restore(rank: int, world_size: int, root: str, sharded: bool) -> dict[str, Any]:
    model, optimizer = tiny_fsdp2_adamw()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    for _ in range(3):
        model(torch.ones(4, 6)).square().mean().backward()
        optimizer.step()
    manager.save(1)
    saved = {key: value.full_tensor().clone() for key, value in model.state_dict().items()}
    manager.close()
    dist.barrier()
    received: list[Any] = []
    share = resumekit.restore_root.share_metadata
    values: list[Any] = []  # the items each part brought read
    exchange_over_group = LOAD.exchange_over_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        received.append(share(*args, **kwargs))
        return received[-1]

    def recording_exchange(*args: Any, **kwargs: Any) -> Any:
        exchange = exchange_over_group(*args, **kwargs)

        def recorded(request: Any) -> Any:
            part = exchange(request)
            values.extend(part.values)
            return part

        return recorded

    decode = metadata_file.decode
    decoded: list[str] = []

    def counted_decode(data: bytes, source: str) -> Any:
        decoded.append(source)
        return decode(data, source)

    resumekit.restore_root.share_metadata = recording  # type: ignore[assignment]
    LOAD.exchange_over_group = recording_exchange  # type: ignore[assignment]
    metadata_file.decode = counted_decode  # type: ignore[assignment]
    try:
        if sharded:
            model, optimizer = tiny_fsdp2_adamw()
        else:
            torch.manual_seed(5)
            model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        restorer = CheckpointManager(root, model=model, optimizer=optimizer,
                                     on_mismatch="ignore")
        step = restorer.restore()
        restorer.close()
    finally:
        metadata_file.decode = decode  # type: ignore[assignment]
        resumekit.restore_root.share_metadata = share  # type: ignore[assignment]
        LOAD.exchange_over_group = (  # type: ignore[assignment]
            exchange_over_group)
    got = {key: value.full_tensor() if hasattr(value, "full_tensor") else value
           for key, value in model.state_dict().items()}
    checked = received[0]
    chunks = {key: len(entry.chunks)
              for key, entry in checked.parsed().state_dict_metadata.items()
              if isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0}
    answerer = checked._answerer  # rank 0's
    return {"step": step, "whole": checked.whole, "chunks": chunks,
            "leader": checked.leader, "decoded": len(decoded),
            "whole_reads": None if answerer is None else answerer.whole_reads,
            "same": all(torch.equal(saved[key], got[key]) for key in saved),
            "steps": _steps(optimizer), "values": sorted(map(repr, values))}


def test_a_restoring_rank_plans_from_only_its_own_chunks_when_the_run_shards_as_the_checkpoint(
        tmp_path: Path) -> None:
    first, second = run_ranks(_restore, world_size=2, args=(str(tmp_path), True))
    assert first["step"] == second["step"] == 1 and first["same"] and second["same"]
    assert first["leader"] and not second["leader"]
    assert not first["whole"] and not second["whole"]  # rank 0 read the head only
    for found in (first, second):  # each planned from its own part
        assert found["chunks"] and set(found["chunks"].values()) == {1}, found["chunks"]
    # every rank was covered by its part: the whole file was never read nor parsed
    assert first["whole_reads"] == 0 and first["decoded"] == second["decoded"] == 0


def test_a_restoring_rank_gets_every_chunk_it_needs_when_the_run_does_not_shard(
        tmp_path: Path) -> None:
    first, second = run_ranks(_restore, world_size=2, args=(str(tmp_path), False))
    assert first["step"] == second["step"] == 1 and first["same"] and second["same"]
    assert not second["whole"]
    for found in (first, second):  # both ranks' chunks, from the whole file on rank 0
        assert found["chunks"] and set(found["chunks"].values()) == {2}, found["chunks"]
    # not covered by their parts (another sharding): rank 0 read and parsed it once
    assert first["whole_reads"] == 1 and first["decoded"] == 1 and second["decoded"] == 0


def test_every_restoring_rank_gets_the_optimizers_step_scalars_read_in_its_part(
        tmp_path: Path) -> None:
    first, second = run_ranks(_restore, world_size=2, args=(str(tmp_path), True))
    assert first["same"] and second["same"]
    assert first["steps"] == second["steps"] == [3.0] * 4
    # AdamW's 4 step scalars (spread by DCP's save over the ranks' files) and the param
    # group's values: read once, on rank 0, and not from their files by each rank
    for found in (first, second):
        steps = [value for value in found["values"] if ".step'" in value]
        assert len(steps) == 4, found["values"]
        assert any("param_groups.0.lr'" in value for value in found["values"])
