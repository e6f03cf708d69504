"""Data objects a save could not capture are refused up front; a position that never moves warns.

Findings 2 and 3 of the "any trainer" issue: a ``DistributedSampler`` passed as ``data=``
was accepted until the first save raised a bare ``AttributeError``, and a loop that never
called ``sampler.advance()`` recorded 0 samples consumed without a word.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from resumekit import (
    CheckpointManager,
    ConfigurationError,
    ResumableDistributedSampler,
    ResumekitWarning,
    wrap_sampler,
)


def _manager(root: Path, **kwargs) -> CheckpointManager:
    model = nn.Linear(2, 2)
    return CheckpointManager(root, model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                             retention=None, **kwargs)


def test_torchs_distributed_sampler_as_data_is_refused_at_construction_naming_the_replacement(
    tmp_path: Path,
) -> None:
    sampler = DistributedSampler(list(range(8)), num_replicas=1, rank=0)
    with pytest.raises(ConfigurationError,
                       match="DistributedSampler cannot be checkpointed") as error:
        _manager(tmp_path, data=sampler)
    assert "ResumableDistributedSampler" in str(error.value)
    assert "wrap_sampler" in str(error.value)
    assert error.value.name == "data"
    assert not tmp_path.joinpath("step_000000001").exists()


def test_a_dataloader_over_the_default_sampler_is_refused_naming_what_to_pass(
    tmp_path: Path,
) -> None:
    loader = DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(ConfigurationError, match="DataLoader cannot be checkpointed: its "
                       "sampler SequentialSampler has no resumable position") as error:
        _manager(tmp_path, data=loader)
    assert "sampler=resumekit.ResumableDistributedSampler(dataset" in str(error.value)
    assert "StatefulDataLoader" in str(error.value)


def test_a_scheduler_without_state_methods_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="scheduler=object cannot be checkpointed"):
        _manager(tmp_path, scheduler=object())


def test_a_sampler_the_loop_never_advances_warns_once_at_the_save_naming_both_steps(
    tmp_path: Path,
) -> None:
    sampler = ResumableDistributedSampler(16, num_replicas=1, rank=0)
    manager = _manager(tmp_path, data=sampler)
    manager.restore()
    with pytest.warns(ResumekitWarning, match=r"has not moved from step 0 to step 5") as seen:
        manager.save(5)
    assert "advance()" in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        manager.save(10)  # once per run, not at every save
    manager.close()


def test_a_sampler_the_loop_advances_saves_without_a_warning(tmp_path: Path) -> None:
    sampler = wrap_sampler(SequentialSampler(range(16)), world_size=1)
    manager = _manager(tmp_path, data=sampler)
    manager.restore()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        for step in (1, 2, 3):
            sampler.advance(1)
            manager.save(step)
        manager.save(3, replace=True)  # the same step again: steps did not move
    manager.close()


def test_a_position_restored_and_then_never_advanced_warns_at_the_next_save(
    tmp_path: Path,
) -> None:
    sampler = ResumableDistributedSampler(16, num_replicas=1, rank=0)
    first = _manager(tmp_path, data=sampler)
    first.restore()
    sampler.advance(4)
    first.save(4)
    first.close()
    again = ResumableDistributedSampler(16, num_replicas=1, rank=0)
    second = _manager(tmp_path, data=again)
    assert second.restore() == 4
    assert again.consumed == 4
    with pytest.warns(ResumekitWarning, match=r"from step 4 to step 9 \(epoch 0, 4 samples"):
        second.save(9)
    second.close()
