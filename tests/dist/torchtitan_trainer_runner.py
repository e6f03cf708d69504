"""torchtitan's training loop, driven from its own components, with ``ResumekitCheckpointer``.

``python -m torch.distributed.run --nproc-per-node 2 tests/dist/torchtitan_trainer_runner.py
OUT`` builds what torchtitan 0.3's ``Trainer.__init__`` builds - its llama3 ``debugmodel``
(stock, fused QKV; 2 layers) FSDP2-sharded on every rank, its ``OptimizersContainer`` and
``LRSchedulersContainer`` from their configs, its ``ParallelAwareDataloader``, the
``train_state`` - and the checkpointer as the trainer does,
``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=...,
lr_schedulers=..., states={"train_state": ...}, sd_adapter=None, base_folder=...)``, from a
``ResumekitCheckpointer.Config``: the one line a torchtitan user changes. The loop is
``Trainer.train``'s: ``load(step=load_step)``, then per step ``maybe_wait_for_staging()``,
``optimizers.step()``, ``lr_schedulers.step()``, ``save(step, last_step=...)``.

torchtitan's ``Trainer`` itself is not run: ``import torchtitan.trainer`` needs tensorboard,
its data loader HF ``datasets`` (torchtitan's own requirements, not installed with the
test-models extra), and its model's flex attention has no backward on CPU
(``NotImplementedError: FlexAttention does not support backward on CPU``). So the forward
and backward are replaced by gradients drawn from the global RNG (restored by the
checkpoint: a resume that lost it diverges) plus the batch's mean (the data position: a
resume that replays or skips data diverges). tests/dist/test_torchtitan_trainer.py runs the
``Trainer`` itself, with the shims of tests/dist/torchtitan_real_trainer_runner.py; this
loop stays for the comparison with torchtitan's own checkpointer.

Environment: ``TITAN_CHECKPOINTER=torchtitan`` builds torchtitan's own
``CheckpointManager.Config`` there instead (the comparison), ``TITAN_STEPS`` (default 8),
``TITAN_INTERVAL`` (4), ``TITAN_STOP_AFTER``
(leave the loop after this step, as a job that ran out of time would), ``TITAN_PAUSE_AT``
(after ``save`` of this step returned, write ``OUT/paused_<rank>`` (the pid) and wait: for a
preemption signal when ``TITAN_PAUSE_FOR=signal``, else until killed). Each rank writes
``OUT/rank_<r>.json`` (steps it trained, how it ended) and, when its loop ends,
``OUT/state_<r>.pt`` (whole parameters, optimizer state, scheduler, RNG, train state).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils.data import IterableDataset

from tests.distributed_harness import say_paused, write_record
from tests.limits import HANG_S
from tests.torchtitan_models import TrainProgress, llama3, optimizers_container


class TokenStream(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """This rank's token windows, stateful as torchtitan's text datasets are."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sample = rank, 0

    def __iter__(self) -> Any:
        while True:
            start = 1000 * self.rank + 7 * self.sample
            self.sample += 1
            tokens = torch.arange(start, start + 16)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample = state["sample"]


def _whole(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        return full.detach().clone()
    return value


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    steps = int(os.environ.get("TITAN_STEPS", "8"))
    interval = int(os.environ.get("TITAN_INTERVAL", "4"))
    stop_after = int(os.environ.get("TITAN_STOP_AFTER", "0")) or None
    pause_at = int(os.environ.get("TITAN_PAUSE_AT", "0")) or None
    record: dict[str, Any] = {"steps": [], "exit": 0}
    write_record(out, rank, record,
                 lambda: _train(out, rank, steps, interval, stop_after, pause_at, record))


def _train(out: Path, rank: int, steps: int, interval: int, stop_after: int | None,
           pause_at: int | None, record: dict[str, Any]) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer

    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)  # torchtitan seeds every rank alike (training.seed)
    model = llama3(fuse_qkv=True)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers = optimizers_container(model)
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=steps)
    dataloader = ParallelAwareDataloader(TokenStream(rank), dp_rank=rank, dp_world_size=world,
                                         batch_size=2)
    train_state = TrainProgress()
    # The one line: torchtitan's llama3_debugmodel has CheckpointManager.Config(...) here.
    # (preemption_poll_every=1: these steps take milliseconds, the automatic vote interval
    # would let the run end before a vote counts the signal)
    config: Any = ResumekitCheckpointer.Config(
        enable=True, interval=interval, keep_latest_k=0, last_save_model_only=False,
        preemption_poll_every=1)
    if os.environ.get("TITAN_CHECKPOINTER") == "torchtitan":  # its own, for the comparison
        config = CheckpointManager.Config(enable=True, interval=interval, keep_latest_k=0,
                                          last_save_model_only=False)
    checkpointer = config.build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers,
        lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None,
        base_folder=str(out.parent))
    checkpointer.load(step=config.load_step)
    record["restored"] = train_state.step
    data_iterator = iter(dataloader)
    while train_state.step < steps:
        train_state.step += 1
        inputs, labels = next(data_iterator)
        shift = inputs["input"].float().mean() / 1000
        for param in model.parameters():
            full = torch.randn(param.shape, dtype=param.dtype) + shift
            param.grad = distribute_tensor(full, param.device_mesh, param.placements)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += labels.numel()
        record["steps"].append(train_state.step)  # trained (a preemption exits in save)
        checkpointer.save(train_state.step, last_step=train_state.step == steps)
        if train_state.step == pause_at:
            _pause(out, rank, checkpointer)
        if train_state.step == stop_after:
            break
    checkpointer.close()
    names = {id(param): name for name, param in model.named_parameters()}
    torch.save({
        "params": {name: _whole(param) for name, param in model.named_parameters()},
        "optimizer": {names[id(param)]: {key: _whole(value) for key, value in state.items()}
                      for part in optimizers.optimizers for param, state in part.state.items()},
        "lr": [group["lr"] for part in optimizers.optimizers for group in part.param_groups],
        "scheduler": lr_schedulers.state_dict(),
        "rng": torch.get_rng_state(),
        "train_state": train_state.state_dict(),
        "next_batch": next(data_iterator)[1],
    }, out / f"state_{rank}.pt")
    dist.destroy_process_group()


def _pause(out: Path, rank: int, checkpointer: Any) -> None:
    """Say so, then wait for a preemption signal (``TITAN_PAUSE_FOR=signal``) or a kill."""
    say_paused(out, rank, os.getpid())
    deadline = time.monotonic() + HANG_S
    signal_wanted = os.environ.get("TITAN_PAUSE_FOR") == "signal"
    while not (signal_wanted and checkpointer.preemption.requested):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: neither signal nor kill {HANG_S}s after pausing")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
