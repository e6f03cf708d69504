"""`resumekit import` of checkpoints torchtitan's own CheckpointManager wrote (2 FSDP2 ranks).

torchtitan 0.3.0's checkpointer (``torchtitan.components.checkpointer.CheckpointManager``)
trains its llama3, fused QKV and unfused, with its ``OptimizersContainer`` (two
optimizers, groups built with ``param_names``) and ``LRSchedulersContainer``, and writes
``step-5``. The import is restored on one process into the same torchtitan objects: every
weight, every Adam moment, the scheduler's position, the step and ``ntokens_seen`` as
torchtitan left them. Before: ``optimizer entry '...wqkv.weight.exp_avg' names no
parameter of the model`` (fused), ``missing from checkpoint: optimizer.param_groups.0.
param_names`` (unfused). Needs torchtitan's classes (tests/torchtitan_models.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from resumekit.cli import main as cli_main
from resumekit.manager import CheckpointManager
from tests.distributed_harness import run_ranks
from tests.torchtitan_models import llama3, optimizers_container, write_torchtitan_checkpoints


def _write(rank: int, world: int, folder: str, fuse_qkv: bool) -> dict[str, Any]:
    return write_torchtitan_checkpoints(folder, fuse_qkv=fuse_qkv, steps=5, interval=5)


@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["fused", "unfused"])
def test_a_torchtitan_checkpoint_imports_and_restores_exactly(tmp_path: Path,
                                                               fuse_qkv: bool) -> None:
    llama3()  # torchtitan importable here (else skipped, or failed under CI=true)
    reference = run_ranks(_write, 2, args=(str(tmp_path / "titan"), fuse_qkv))[0]
    source = tmp_path / "titan" / "checkpoint" / "step-5"
    assert cli_main(["import", str(source), str(tmp_path / "root")]) == 0

    from torchtitan.components.optimizer import LRSchedulersContainer

    model = llama3(fuse_qkv=fuse_qkv, seed=9)
    optimizers = optimizers_container(model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=5)
    ckpt = CheckpointManager(tmp_path / "root", model=[model], optimizer=optimizers,
                             scheduler=schedulers)
    assert ckpt.restore() == 5
    assert ckpt.extras["train_state"] == {"ntokens_seen": reference["ntokens_seen"]}
    assert schedulers.state_dict()["last_epoch"] == reference["last_epoch"]
    for name, param in model.named_parameters():
        assert torch.equal(param, reference["params"][name]), name
    names = {id(param): name for name, param in model.named_parameters()}
    moments = {names[id(param)]: state["exp_avg"]
               for part in optimizers.optimizers for param, state in part.state.items()}
    assert moments.keys() == reference["exp_avg"].keys()
    for name, moment in moments.items():
        assert torch.equal(moment, reference["exp_avg"][name]), name
    assert all("param_names" in group for part in optimizers.optimizers
               for group in part.param_groups)  # its own, kept
