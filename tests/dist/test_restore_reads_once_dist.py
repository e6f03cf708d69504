"""A restore of replicated parameters reads each stored byte once, on 2 gloo ranks.

DDP (every rank holds the whole model and optimizer) and HSDP (a replicate dimension on
the mesh) restore the same pieces on every rank: with ``restore_reads="once"`` (the
default) one rank reads each piece and sends it to the other, so each reads about half.
Bytes read are counted where every read of a data file goes through (DCP's local
``FileSystem.create_stream``), not by resumekit's own bookkeeping.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import filesystem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from resumekit import CheckpointManager, tensors
from resumekit.errors import CorruptCheckpointError, IncompatibleCheckpointError
from resumekit.tensors import shared_reads
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks

WIDTH = 256  # a Linear(256, 256) weight is 256 KiB: past the size below which all read


class _CountingStream:
    """A file stream that adds every byte read from it to ``counts[0]``."""

    def __init__(self, stream: Any, counts: list[int]) -> None:
        self._stream = stream
        self._counts = counts

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._stream.read(size)
        self._counts[0] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        count: int = self._stream.readinto(buffer)
        self._counts[0] += count or 0
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def counting_data_reads() -> Iterator[list[int]]:
    """Count the bytes read from tensor data files (``*.distcp``) inside the block."""
    counts = [0]
    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            counted = "r" in mode and str(path).endswith(".distcp")
            yield _CountingStream(stream, counts) if counted else stream

    filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        filesystem.FileSystem.create_stream = original  # type: ignore[method-assign]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(8, WIDTH, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for number, state in enumerate(optimizer.state.values()):
        found.update({f"optimizer.{number}.{k}": _full(v) for k, v in state.items()})
    return found


def _data_bytes(step_dir: Path) -> int:
    return sum(path.stat().st_size for path in (step_dir / "tensors").glob("*.distcp"))


def _ddp(rank: int, world_size: int, root: str, reads: str, tensor_format: str = "raw"
         ) -> dict[str, Any]:
    model = DistributedDataParallel(_model(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=0)
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                tensor_format=tensor_format)
    manager.save(1)
    manager.close()
    saved = _snapshot(model, optimizer)
    model = DistributedDataParallel(_model(seed=5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=5)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, restore_reads=reads)
    with counting_data_reads() as counts:
        step = manager.restore()
    manager.close()
    got = _snapshot(model, optimizer)
    return {"step": step, "read": counts[0], "total": _data_bytes(Path(root) / "step_000000001"),
            "same": saved.keys() == got.keys() and all(
                torch.equal(saved[key], got[key]) for key in saved)}


def test_a_ddp_restore_reads_each_byte_once_split_between_the_replicas(tmp_path: Path) -> None:
    results = run_ranks(_ddp, world_size=2, args=(str(tmp_path), "once"))
    total = results[0]["total"]
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        assert 0.3 * total < result["read"] < 0.7 * total, (rank, result)
    assert sum(result["read"] for result in results) < 1.1 * total, results


def test_a_ddp_restore_told_every_rank_reads_reads_everything_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_ddp, world_size=2, args=(str(tmp_path), "every_rank"))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        assert result["read"] > 0.9 * result["total"], (rank, result)


def test_a_ddp_restore_of_dcps_own_format_read_once_is_bit_identical(tmp_path: Path) -> None:
    results = run_ranks(_ddp, world_size=2, args=(str(tmp_path), "once", "dcp"))
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)


def _ddp_fine_tune(rank: int, world_size: int, root: str, reads: str, strict: bool
                   ) -> dict[str, Any]:
    source = f"{root}/pretrain"
    model = DistributedDataParallel(_model(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=0)
    manager = CheckpointManager(source, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()
    saved = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    model = DistributedDataParallel(_model(seed=5))
    manager = CheckpointManager(f"{root}/finetune", model=model, restore_reads=reads)
    assert manager.restore() == 0
    with counting_data_reads() as counts:
        step = manager.load_weights(source, strict=strict)
    manager.close()
    got = model.module.state_dict()
    model_bytes = sum(v.numel() * v.element_size() for v in saved.values())
    return {"step": step, "read": counts[0], "model_bytes": model_bytes,
            "same": all(torch.equal(saved[k], got[k]) for k in saved)}


@pytest.mark.parametrize("strict", [True, False])
def test_a_ddp_fine_tune_reads_the_weights_once_split_between_the_replicas(
        tmp_path: Path, strict: bool) -> None:
    results = run_ranks(_ddp_fine_tune, world_size=2, args=(str(tmp_path), "once", strict))
    model_bytes = results[0]["model_bytes"]
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        assert 0.3 * model_bytes < result["read"] < 0.7 * model_bytes, (rank, result)
    assert sum(result["read"] for result in results) < 1.1 * model_bytes, results


def test_a_ddp_fine_tune_told_every_rank_reads_reads_the_weights_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_ddp_fine_tune, world_size=2,
                        args=(str(tmp_path), "every_rank", True))
    for rank, result in enumerate(results):
        assert result["same"] and result["read"] >= result["model_bytes"], (rank, result)


def _group_that_cannot_share(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    weights = {"w": torch.randn(WIDTH, WIDTH)}
    tensors.save({"model": weights}, root)
    # As with an NCCL-only group, which cannot move CPU tensors between ranks.
    shared_reads.SharedReads.can_run_on = staticmethod(lambda group: False)  # type: ignore[method-assign]
    loaded = {"model": {"w": torch.empty(WIDTH, WIDTH)}}
    with counting_data_reads() as counts, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensors.load(loaded, root, read_once=True)
    return {"same": torch.equal(loaded["model"]["w"], weights["w"]), "read": counts[0],
            "total": _data_bytes(Path(root)),
            "said": [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)]}


def test_a_group_that_cannot_share_reads_says_so_and_every_rank_reads_all(
        tmp_path: Path) -> None:
    results = run_ranks(_group_that_cannot_share, world_size=2, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["same"] and result["read"] > 0.9 * result["total"], (rank, result)
        assert any(f"restoring {tmp_path}: every rank reads all" in said
                   and "cannot move CPU tensors" in said for said in result["said"]), result


def _one_rank_misfits(rank: int, world_size: int, root: str) -> str:
    torch.manual_seed(0)
    tensors.save({"model": {"w": torch.randn(WIDTH, WIDTH)}}, root)
    width = WIDTH if rank == 0 else WIDTH // 2  # rank 1 fails its fit check, before reading
    try:
        tensors.load({"model": {"w": torch.empty(WIDTH, width)}}, root, read_once=True,
                     plan_locally=True)
    except IncompatibleCheckpointError as error:
        return str(error)
    return "loaded"


def test_a_rank_that_fails_before_reading_fails_the_ranks_waiting_to_share_its_reads(
        tmp_path: Path) -> None:
    # rank 0 waits in the exchange of what to share; rank 1 never gets there
    results = run_ranks(_one_rank_misfits, world_size=2, args=(str(tmp_path),),
                        group_timeout_s=30.0)
    assert all("model.w" in said for said in results), results


def _mixed_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {**{f"big{i}": torch.randn(512, 1024) for i in range(8)},  # 2 MiB
                      **{f"mid{i}": torch.randn(128, 256).to(torch.bfloat16)  # 64 KiB
                         for i in range(20)},
                      **{f"small{i}": torch.randn(7) for i in range(5)}}}


def _in_many_rounds(rank: int, world_size: int, root: str, corrupt: bool) -> dict[str, Any]:
    load_module = importlib.import_module("resumekit.tensors.load")
    from resumekit.tensors.shared_reads import SharedReads  # noqa: PLC0415

    class SmallRounds(SharedReads):
        """Rounds of 1 MiB per reader: many agreements, earlier rounds' transfers in flight."""

        def __init__(self, group: Any) -> None:
            super().__init__(group, round_bytes=1 << 20)

    load_module.SharedReads = SmallRounds  # type: ignore[misc]
    state = _mixed_state()
    tensors.save(state, root)
    dist.barrier()  # every rank's file is in place before any rank picks the largest
    data = max(Path(root).glob("*.distcp"), key=lambda path: (path.stat().st_size, path.name))
    if corrupt and rank == 0:
        damaged = bytearray(data.read_bytes())
        damaged[len(damaged) * 3 // 4] ^= 0xFF
        data.write_bytes(bytes(damaged))
    dist.barrier()
    into = {"model": {key: torch.zeros_like(value) for key, value in state["model"].items()}}
    outcome: dict[str, Any] = {"file": data.name}
    with counting_data_reads() as counts:
        try:
            tensors.load(into, root, read_once=True, plan_locally=True)
        except CorruptCheckpointError as error:
            outcome["error"] = str(error)
    outcome["read"] = counts[0]
    outcome["total"] = sum(path.stat().st_size for path in Path(root).glob("*.distcp"))
    outcome["same"] = all(torch.equal(into["model"][key], value)
                          for key, value in state["model"].items())
    return outcome


def test_a_restore_read_once_in_many_rounds_is_bit_identical_with_each_rank_reading_half(
        tmp_path: Path) -> None:
    results = run_ranks(_in_many_rounds, world_size=2, args=(str(tmp_path), False))
    for rank, result in enumerate(results):
        assert result["same"] and "error" not in result, (rank, result)
        assert 0.35 * result["total"] < result["read"] < 0.65 * result["total"], (rank, result)


def test_a_piece_corrupt_in_a_later_round_fails_both_ranks_naming_its_file(
        tmp_path: Path) -> None:
    results = run_ranks(_in_many_rounds, world_size=2, args=(str(tmp_path), True),
                        group_timeout_s=30.0)
    for rank, result in enumerate(results):
        assert result["file"] in result.get("error", ""), (rank, result)


def _hsdp_model(seed: int) -> nn.Module:
    model = _model(seed)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = _hsdp_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=0)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    manager.save(1)
    manager.close()
    saved = _snapshot(model, optimizer)
    placements = {str(p.placements) for p in model.parameters()}
    model = _hsdp_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=5)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    with counting_data_reads() as counts:
        step = manager.restore()
    manager.close()
    got = _snapshot(model, optimizer)
    return {"step": step, "read": counts[0], "placements": placements,
            "total": _data_bytes(Path(root) / "step_000000001"),
            "same": saved.keys() == got.keys() and all(
                torch.equal(saved[key], got[key]) for key in saved)}


def test_an_hsdp_restore_is_bit_identical_and_each_replica_reads_half(tmp_path: Path) -> None:
    results = run_ranks(_hsdp, world_size=2, args=(str(tmp_path),))
    total = results[0]["total"]
    for rank, result in enumerate(results):
        assert any("Replicate()" in placed for placed in result["placements"]), result
        assert result["step"] == 1 and result["same"], (rank, result)
        assert 0.3 * total < result["read"] < 0.7 * total, (rank, result)


def _corrupt_for_its_reader(rank: int, world_size: int, root: str, fallback: bool
                            ) -> dict[str, Any]:
    model = DistributedDataParallel(_model(seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=0)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    manager.save(1)
    saved = _snapshot(model, optimizer)
    _train(model, optimizer, seed=1)
    manager.save(2)
    manager.close()
    damaged = max((Path(root) / "step_000000002" / "tensors").glob("*.distcp"),
                  key=lambda path: path.stat().st_size)
    dist.barrier()  # every rank chose the file before rank 0 rewrites (first truncates) it
    if rank == 0:  # the middle of the largest file: a large tensor's bytes, read by one rank
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    dist.barrier()
    model = DistributedDataParallel(_model(seed=5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, seed=5)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, fallback=fallback)
    outcome: dict[str, Any] = {"file": damaged.name}
    with counting_data_reads() as counts:
        try:
            outcome["step"] = manager.restore()
        except CorruptCheckpointError as error:
            outcome["error"] = str(error)
    manager.close()
    outcome["read"] = counts[0]
    outcome["same"] = "step" in outcome and all(
        torch.equal(value, _snapshot(model, optimizer)[key]) for key, value in saved.items())
    return outcome


@pytest.mark.parametrize("fallback", [False, True])
def test_a_corrupt_piece_seen_by_its_one_reader_fails_the_restore_on_both_ranks(
        tmp_path: Path, fallback: bool) -> None:
    results = run_ranks(_corrupt_for_its_reader, world_size=2,
                        args=(str(tmp_path), fallback), group_timeout_s=60.0)
    for rank, result in enumerate(results):
        if fallback:  # both ranks set step 2 aside and load step 1 together
            assert result.get("step") == 1 and result["same"], (rank, result)
        else:
            assert result["file"] in result.get("error", ""), (rank, result)
            assert "step_000000002" in result["error"], (rank, result)
