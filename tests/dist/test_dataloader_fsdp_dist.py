"""The docs' FSDP2 loop with ``data=loader`` (issue 28 item 1), on two gloo ranks.

The quickstart's loop as written: a ``DataLoader`` over a
``ResumableDistributedSampler``, no ``generator=``, no ``sampler.advance()``, dropout,
AdamW with a warm-up, ``async_save=True``, a preemption handler. An uninterrupted run is
compared with one that is SIGTERMed (emergency save, exit 75), relaunched, SIGKILLed
after the save that ends epoch 0, and relaunched again: every step's loss and the final
tensors are bit-identical. The emergency checkpoint then resumes on one rank (world size
2 -> 1, warned; the rest of the epoch's samples, none repeated) and starts a fine-tune
from another root (``load_weights``, data position from the start).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import resumekit
from tests.distributed_harness import run_ranks

SAMPLES, BATCH, EPOCHS = 32, 2, 2  # 8 steps an epoch on 2 ranks, 16 steps
# No worker processes here: each would start a process per epoch and rank (most of this
# test's time). iter(loader) draws its base seed from the generator all the same, which is
# the trap; prefetching workers are covered by tests/unit/test_dataloader_resume.py.
WORKERS = 0


class _Indexed(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return (torch.arange(6, dtype=torch.float32) + index) / SAMPLES, index


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _loop(rank: int, world_size: int, root: str, *, kill: str | None = None,
          kill_at: int = 0, num_epochs: int = EPOCHS, tune_from: str | None = None,
          max_steps: int | None = None) -> dict[str, Any]:
    """The quickstart's FSDP2 loop; ``kill``: "sigterm" or "sigkill" at step ``kill_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.GELU(), nn.Linear(16, 3))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    sampler = resumekit.ResumableDistributedSampler(_Indexed(), seed=0)
    loader = DataLoader(_Indexed(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
    preemption = resumekit.PreemptionHandler(grace_period=600, poll_every=1,
                                             overlap=False).install()
    ckpt = resumekit.CheckpointManager(root, model=model, optimizer=optimizer,
                                       scheduler=scheduler, data=loader, save_every=4,
                                       async_save=True, retention=None,
                                       preemption=preemption)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", resumekit.ResumekitWarning)
        start = ckpt.restore()
        loaded = ckpt.load_weights(tune_from) if tune_from is not None else None
    out: dict[str, Any] = {"start": start, "loaded": loaded, "indices": [],
                           "warnings": [str(w.message) for w in seen],
                           "epoch_order": sampler.epoch_order()}
    if tune_from is not None:
        out["weights"] = _full(model)
    losses = Path(f"{root}-losses-rank{rank}.jsonl")
    step = start
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)                   # keeps the restored position in the epoch
        for x, index in loader:                    # one micro-batch per optimizer step
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            out["indices"] += index.tolist()
            with losses.open("a") as handle:
                handle.write(json.dumps([step, loss.item().hex()]) + "\n")
            if kill == "sigterm" and step == kill_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            if ckpt.step_end(step):
                ckpt.close()
                out.update(exit=resumekit.EXIT_CODE_PREEMPTED, step=step,
                           tensors=_full(model))
                return out                         # the docs: sys.exit(75)
            if kill == "sigkill" and step == kill_at:
                ckpt.wait()  # the kill comes once the background save of step 8 committed
                os.kill(os.getpid(), signal.SIGKILL)
            if step == max_steps:
                break
    ckpt.close()
    out.update(exit=0, step=step, tensors=_full(model))
    return out


def _losses(root: Path) -> dict[int, str]:
    """Each step's last recorded loss on rank 0 (a retrained step overwrites)."""
    lines = (root.parent / f"{root.name}-losses-rank0.jsonl").read_text().splitlines()
    return {step: loss for step, loss in map(json.loads, lines)}


def _one_rank_after(rank: int, world_size: int, copy: str, tune: str) -> dict[str, Any]:
    tuned = _loop(rank, world_size, tune, num_epochs=1, tune_from=copy, max_steps=2)
    resumed = _loop(rank, world_size, copy, num_epochs=1)
    return {"tuned": tuned, "resumed": resumed}


def test_the_docs_fsdp2_dataloader_loop_survives_sigterm_and_sigkill_bit_identical(
    tmp_path: Path,
) -> None:
    reference = run_ranks(_loop, 2, args=(str(tmp_path / "reference"),))
    run = tmp_path / "run"
    preempted = run_ranks(_preempted, 2, args=(str(run),))
    assert [r["exit"] for r in preempted] == [resumekit.EXIT_CODE_PREEMPTED] * 2
    assert preempted[0]["step"] == 6
    shutil.copytree(run, tmp_path / "copy")
    killed = run_ranks(_killed, 2, args=(str(run),), may_exit=(0, 1))
    assert killed == [None, None]  # SIGKILLed after step 10, the last save at 8
    final = run_ranks(_loop, 2, args=(str(run),))
    assert final[0]["start"] == 8 and final[0]["step"] == 16
    expected = _losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 17))
    assert _losses(run) == expected
    for name, tensor in reference[0]["tensors"].items():
        assert torch.equal(final[0]["tensors"][name], tensor), name

    after = run_ranks(_one_rank_after, 1, args=(str(tmp_path / "copy"),
                                                 str(tmp_path / "tune")))[0]
    tuned, resumed = after["tuned"], after["resumed"]
    assert (tuned["start"], tuned["loaded"]) == (0, 6)
    for name, tensor in preempted[0]["tensors"].items():
        assert torch.equal(tuned["weights"][name], tensor), name
    assert tuned["indices"] == tuned["epoch_order"][:4]  # the fine-tune's data starts at 0
    assert resumed["start"] == 6
    assert any("written by 2 rank(s), this run has 1" in text for text in resumed["warnings"])
    order = resumed["epoch_order"]
    before = set(preempted[0]["indices"] + preempted[1]["indices"])
    assert before == set(order[:24])  # 6 steps x 2 ranks x 2 samples
    assert resumed["indices"] == order[24:]  # the rest of epoch 0, on one rank


def _preempted(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _loop(rank, world_size, root, kill="sigterm", kill_at=6)


def _killed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _loop(rank, world_size, root, kill="sigkill", kill_at=10)
