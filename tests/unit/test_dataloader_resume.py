"""``data=loader``: the docs' DataLoader loop resumes bit for bit as written (issue 28 item 1).

The loop takes batches from a ``DataLoader`` with two workers, trains a model with
dropout, never calls ``sampler.advance()`` and builds the loader without ``generator=``.
An uninterrupted run is compared with one killed after a save (no close), whose unchanged
command then restores and continues: losses, the workers' base seeds and the final
tensors must be identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from resumekit import (
    CheckpointManager,
    ConfigurationError,
    ResumableDistributedSampler,
    wrap_sampler,
)

SAMPLES, BATCH, EPOCHS = 20, 4, 3  # 5 batches an epoch, 15 steps


class _Numbers(Dataset[tuple[torch.Tensor, int]]):
    """Fixed inputs; each item also says which base seed its worker was given."""

    def __init__(self, length: int = SAMPLES) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        info = get_worker_info()
        base = -1 if info is None else info.seed - info.id
        return (torch.arange(4, dtype=torch.float32) + index) / self.length, base


def _train(root: Path, *, killed_after: int | None = None, advance: bool = False,
           stateful: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0, seed=3)
    if stateful:  # its own position (one pass over all the data; no sampler epochs)
        loader: DataLoader[Any] = StatefulDataLoader(_Numbers(SAMPLES * EPOCHS),
                                                     batch_size=BATCH, num_workers=2)
    else:
        loader = DataLoader(_Numbers(), batch_size=BATCH, sampler=sampler, num_workers=2)
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, data=loader,
                             save_every=3, retention=None)
    start = ckpt.restore()
    losses: dict[int, float] = {}
    seeds: dict[int, list[int]] = {}
    step = start
    for epoch in range(0, 1) if stateful else range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, base in loader:
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if advance:
                sampler.advance(x.shape[0])
            step += 1
            losses[step], seeds[step] = loss.item(), base.tolist()
            ckpt.step_end(step)
            if step == killed_after:
                return {"start": start, "losses": losses}  # as if SIGKILLed
    ckpt.finish(step)
    ckpt.close()
    return {"start": start, "losses": losses, "seeds": seeds,
            "tensors": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_the_docs_dataloader_loop_resumes_bit_identical_without_advance_or_generator(
    tmp_path: Path, stateful: bool,
) -> None:
    reference = _train(tmp_path / "reference", stateful=stateful)
    killed = _train(tmp_path / "run", killed_after=8, stateful=stateful)
    resumed = _train(tmp_path / "run", stateful=stateful)
    assert (killed["start"], resumed["start"]) == (0, 6)  # saved at 6 (mid epoch 1)
    assert sorted(resumed["losses"]) == list(range(7, 16))
    for step, loss in resumed["losses"].items():
        assert loss == reference["losses"][step], f"step {step}"
        assert resumed["seeds"][step] == reference["seeds"][step], f"step {step}"
    for name, tensor in reference["tensors"].items():
        assert torch.equal(tensor, resumed["tensors"][name]), name


def test_a_loop_that_also_calls_advance_is_refused_at_the_next_batch(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="counts batches twice") as error:
        _train(tmp_path, advance=True)
    assert "moved from 4 to 8 consumed in epoch 0" in str(error.value)
    assert not list(tmp_path.glob("step_*"))


def test_a_dataloader_without_a_generator_is_given_one_and_draws_nothing_global(
    tmp_path: Path,
) -> None:
    torch.manual_seed(5)
    sampler = ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0)
    loader = DataLoader(_Numbers(), batch_size=BATCH, sampler=sampler)
    model = nn.Linear(4, 1)
    ckpt = CheckpointManager(tmp_path, model=model, data=loader, retention=None)
    assert isinstance(loader.generator, torch.Generator)
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(before, torch.get_rng_state())
    ckpt.close()


def test_a_dataloader_over_a_plain_sampler_is_refused_naming_the_resumable_sampler(
    tmp_path: Path,
) -> None:
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(ConfigurationError, match="DataLoader cannot be checkpointed: its "
                       "sampler RandomSampler has no resumable position") as error:
        CheckpointManager(tmp_path, model=nn.Linear(2, 2), data=loader, retention=None)
    assert "ResumableDistributedSampler" in str(error.value)
    assert "wrap_sampler" in str(error.value)
    assert error.value.name == "data"


def test_a_dataloader_over_a_wrapped_batch_sampler_counts_one_item_per_batch(
    tmp_path: Path,
) -> None:
    batches = wrap_sampler(torch.utils.data.BatchSampler(range(8), 2, drop_last=False),
                           world_size=1)
    loader = DataLoader(list(range(8)), batch_sampler=batches)
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2), data=loader, retention=None)
    ckpt.restore()
    taken = iter(loader)
    next(taken), next(taken)
    ckpt.save(2)
    ckpt.close()
    again = DataLoader(list(range(8)), batch_sampler=wrap_sampler(
        torch.utils.data.BatchSampler(range(8), 2, drop_last=False), world_size=1))
    second = CheckpointManager(tmp_path, model=nn.Linear(2, 2), data=again, retention=None)
    assert second.restore() == 2
    assert [batch.tolist() for batch in again] == [[4, 5], [6, 7]]
    second.close()



def test_a_sampler_checkpoint_restores_into_a_dataloader_and_back(tmp_path: Path) -> None:
    sampler = ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0)
    first = CheckpointManager(tmp_path, model=nn.Linear(4, 1), data=sampler, retention=None)
    first.restore()
    sampler.advance(8)
    first.save(2)
    first.close()
    again = ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0)
    loader = DataLoader(_Numbers(), batch_size=BATCH, sampler=again)
    second = CheckpointManager(tmp_path, model=nn.Linear(4, 1), data=loader, retention=None)
    assert second.restore() == 2
    assert again.consumed == 8
    next(iter(loader))
    second.save(3)
    second.close()
    back = ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0)
    third = CheckpointManager(tmp_path, model=nn.Linear(4, 1), data=back, retention=None)
    assert third.restore() == 3
    assert back.consumed == 8 + BATCH
    third.close()


def test_a_restore_over_a_dataset_that_shrank_below_the_wrapped_position_is_refused(
    tmp_path: Path,
) -> None:
    from torch.utils.data import SequentialSampler  # noqa: PLC0415

    from resumekit.errors import IncompatibleCheckpointError  # noqa: PLC0415

    def loader(length: int) -> DataLoader[int]:
        return DataLoader(list(range(length)), batch_size=1, sampler=wrap_sampler(
            SequentialSampler(range(length)), world_size=1))

    first = loader(100)
    ckpt = CheckpointManager(tmp_path, model=nn.Linear(2, 2), data=first, retention=None)
    ckpt.restore()
    taken = iter(first)
    for _ in range(80):
        next(taken)
    ckpt.save(80)
    ckpt.close()
    second = CheckpointManager(tmp_path, model=nn.Linear(2, 2), data=loader(50),
                               retention=None)
    with pytest.raises(IncompatibleCheckpointError, match="80 items consumed of the 50"):
        second.restore()
    second.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("step_", ".step_"))] == [
        "step_000000080"]  # refused, never set aside
