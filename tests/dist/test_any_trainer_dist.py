"""Wrapped models move between DDP, FSDP2 and one plain process; a fine-tune starts from
another run's weights on FSDP2: real gloo ranks, bitwise checks."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from resumekit.manager import CheckpointManager
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int) -> None:
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=data)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole FSDP2 model, gathered on rank 0 (empty on the other ranks)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _wrappers(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save a DDP and an FSDP2 checkpoint; restore the plain one into DDP."""
    ddp = DDP(_net())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    _train(ddp, optimizer, 2, rank)
    with CheckpointManager(f"{root}/ddp", model=ddp, optimizer=optimizer) as ckpt:
        ckpt.save(2)
    sharded = _net()
    fully_shard(sharded[0])
    fully_shard(sharded)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    _train(sharded, sharded_opt, 2, rank)
    with CheckpointManager(f"{root}/fsdp", model=sharded, optimizer=sharded_opt) as ckpt:
        ckpt.save(2)
    into = DDP(_net(seed=9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)  # world size 1 -> 2, resharded
        restored = CheckpointManager(f"{root}/plain", model=into).restore()
    return {"ddp": _local(ddp.module), "fsdp": _full(sharded), "restored": restored,
            "into_ddp": _local(into.module)}


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]],
                                                                dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("wrappers")
    plain = _net(seed=3)
    with CheckpointManager(root / "plain", model=plain) as ckpt:
        ckpt.save(5)
    results = run_ranks(_wrappers, 2, args=(str(root),))
    return root, results, {k: v.detach().clone() for k, v in plain.state_dict().items()}


def _restore_plain(root: Path) -> dict[str, torch.Tensor]:
    model = _net(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)  # world size 2 -> 1, resharded
        assert CheckpointManager(root, model=model, optimizer=optimizer).restore() == 2
    assert optimizer.state_dict()["state"], "the optimizer state came back too"
    return model.state_dict()


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def test_a_ddp_checkpoint_restores_into_the_plain_model_on_one_process_bit_for_bit(
    wrapped: tuple[Path, list[dict[str, Any]], dict[str, torch.Tensor]]
) -> None:
    root, results, _ = wrapped
    _assert_equal(_restore_plain(root / "ddp"), results[0]["ddp"])


def test_an_fsdp2_checkpoint_restores_into_the_plain_model_on_one_process_bit_for_bit(
    wrapped: tuple[Path, list[dict[str, Any]], dict[str, torch.Tensor]]
) -> None:
    root, results, _ = wrapped
    _assert_equal(_restore_plain(root / "fsdp"), results[0]["fsdp"])


def test_a_plain_checkpoint_restores_into_ddp_on_two_ranks_bit_for_bit(
    wrapped: tuple[Path, list[dict[str, Any]], dict[str, torch.Tensor]]
) -> None:
    _, results, plain = wrapped
    for result in results:
        assert result["restored"] == 5
        _assert_equal(result["into_ddp"], plain)


def _fine_tune(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = _net(seed=11)
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ckpt = CheckpointManager(f"{root}/tune", model=model, optimizer=optimizer,
                             config={"lr": 1e-4})
    start = ckpt.restore()
    loaded = ckpt.load_weights(f"{root}/pre")
    initial = _full(model)
    fresh_optimizer = not optimizer.state_dict()["state"]
    _train(model, optimizer, 2, rank)
    ckpt.save(start + 2)
    ckpt.close()
    tuned = _full(model)
    # The requeued fine-tune: its own checkpoint wins, the pretrained weights are not read.
    again = _net(seed=12)
    fully_shard(again[0])
    fully_shard(again)
    requeued = CheckpointManager(f"{root}/tune", model=again, config={"lr": 1e-4})
    resumed = requeued.restore()
    second = requeued.load_weights(f"{root}/pre")
    requeued.close()
    return {"start": start, "loaded": loaded, "initial": initial, "fresh": fresh_optimizer,
            "tuned": tuned, "resumed": resumed, "second": second, "again": _full(again)}


def test_load_weights_reshards_another_runs_weights_into_fsdp2_and_a_requeue_resumes_its_own(
    tmp_path: Path
) -> None:
    pre = _net(seed=2)
    pre_opt = torch.optim.AdamW(pre.parameters(), lr=1e-2)
    _train(pre, pre_opt, 2, 0)
    with CheckpointManager(tmp_path / "pre", model=pre, optimizer=pre_opt,
                           config={"lr": 1e-2}) as ckpt:
        ckpt.save(300)
    pretrained = {k: v.detach().clone() for k, v in pre.state_dict().items()}
    results = run_ranks(_fine_tune, 2, args=(str(tmp_path),))
    for result in results:
        assert result["start"] == 0 and result["loaded"] == 300 and result["fresh"]
        assert result["resumed"] == 2 and result["second"] is None
    _assert_equal(results[0]["initial"], pretrained)  # gathered on rank 0
    _assert_equal(results[0]["again"], results[0]["tuned"])
