"""Stock ``dcp.load`` with ``resumekit.StorageReader`` on real FSDP2 ranks (gloo, CPU).

One spawn of two ranks: they load a one-process checkpoint (1 -> 2) through stock DCP and
save two-rank checkpoints in both tensor formats, which this process then loads (2 -> 1).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import resumekit
from resumekit.manager import CheckpointManager
from resumekit.tensors import state_dicts
from tests.dist.test_tensors_fsdp import assert_identical, build, flatten, full_state, train_step
from tests.distributed_harness import run_ranks

KIND = "transformer"
STEP = "step_000000001"


def _save(root: str, model: Any, optimizer: Any, tensor_format: str) -> None:
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                tensor_format=tensor_format)  # type: ignore[arg-type]
    manager.save(1)
    manager.close()


def _two_ranks(rank: int, world_size: int, one_rank_root: str, raw_root: str,
               dcp_root: str) -> dict[str, Any] | None:
    # 1 -> 2: stock dcp.load, our reader, a fresh FSDP2 model + optimizer
    model, optimizer = build(KIND, seed=99, world_size=world_size)
    train_step(model, optimizer, KIND, seed=3)  # other values everywhere, Adam state exists
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    dcp.load(state, storage_reader=resumekit.StorageReader(f"{one_rank_root}/{STEP}"))
    state_dicts.apply_model_and_optimizer_state(model, optimizer, state)
    loaded = full_state(model, optimizer)

    # 2 -> 1 (checked by the test process): two FSDP2 ranks save in both formats
    model, optimizer = build(KIND, seed=0, world_size=world_size)
    train_step(model, optimizer, KIND, seed=1)
    _save(raw_root, model, optimizer, "raw")
    _save(dcp_root, model, optimizer, "dcp")
    saved = full_state(model, optimizer)
    return {"loaded": loaded, "saved": saved} if rank == 0 else None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("storage-reader")
    roots = {name: str(base / name) for name in ("one", "raw", "dcp")}
    model, optimizer = build(KIND, seed=0, world_size=None)
    train_step(model, optimizer, KIND, seed=1)
    _save(roots["one"], model, optimizer, "raw")
    one_rank = full_state(model, optimizer)
    results = run_ranks(_two_ranks, world_size=2,
                        args=(roots["one"], roots["raw"], roots["dcp"]))
    return {"roots": roots, "one_rank": one_rank, **results[0]}


def _load_in_one_process(reader: Any) -> dict[str, Any]:
    model, optimizer = build(KIND, seed=42, world_size=None)
    train_step(model, optimizer, KIND, seed=5)
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader)
    return state


def test_two_fsdp_ranks_load_a_one_process_checkpoint_through_stock_dcp_bit_identically(
    run: dict[str, Any],
) -> None:
    assert_identical(run["loaded"], run["one_rank"])


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_one_process_loads_a_two_rank_fsdp_checkpoint_through_the_reader_bit_identically(
    run: dict[str, Any], tensor_format: str
) -> None:
    step_dir = Path(run["roots"][tensor_format], STEP)
    state = _load_in_one_process(resumekit.StorageReader(step_dir))
    assert_identical(state, run["saved"])
    assert len(list((step_dir / "tensors").glob("*.distcp"))) >= 2  # really two writers


def test_stock_dcps_own_reader_reshards_a_two_rank_dcp_format_checkpoint(
    run: dict[str, Any],
) -> None:
    tensors = Path(run["roots"]["dcp"], STEP, "tensors")
    state = _load_in_one_process(FileSystemReader(tensors))
    assert_identical(state, run["saved"])
    assert len(flatten(state)) > 20  # weights, biases, moments and steps of every layer
