"""Async staging buffers allocated ahead (CpuStager.prepare, CheckpointManager(stage_ahead))."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.tensors import state_dicts


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are single-process"


def _trained(width: int = 64) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if optimizer is not None:
        total += sum(v.numel() * v.element_size() for s in optimizer.state.values()
                     for v in s.values() if isinstance(v, torch.Tensor))
    return total


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_a_prepared_stager_stages_into_the_buffers_it_allocated_ahead() -> None:
    model, optimizer = _trained()
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    stager = tensors.CpuStager()

    allocated = stager.prepare(state)
    assert allocated == stager.nbytes == _state_bytes(model, optimizer)
    buffers = {path: buffer.data_ptr() for path, buffer in stager._buffers.items()}

    staged = stager.stage(state)
    assert stager.nbytes == allocated  # nothing new allocated by the first stage
    assert {path: buffer.data_ptr() for path, buffer in stager._buffers.items()} == buffers
    assert torch.equal(staged["model"]["0.weight"], model[0].weight)
    assert staged["model"]["0.weight"].data_ptr() != model[0].weight.data_ptr()
    assert stager.prepare(state) == 0  # already prepared: nothing more


def test_tied_weights_get_one_prepared_buffer_as_they_get_one_staged_copy() -> None:
    shared = torch.randn(100)
    state = {"a": shared, "b": shared, "c": torch.randn(3)}
    stager = tensors.CpuStager()
    assert stager.prepare(state) == (100 + 3) * 4
    staged = stager.stage(state)
    assert staged["a"] is staged["b"] and stager.nbytes == (100 + 3) * 4


def test_prepared_buffers_are_resident_before_anything_is_staged() -> None:
    # 64 MiB: above glibc's largest mmap threshold, so the buffer is fresh, unmapped pages
    # (not memory freed earlier and still resident) until something writes them.
    state = {"big": torch.empty(64 << 20, dtype=torch.uint8)}
    stager = tensors.CpuStager()
    before = _rss()
    stager.prepare(state)
    assert _rss() - before >= 0.9 * (64 << 20)  # every page written, none left to fault


def test_an_async_manager_allocates_its_staging_buffers_when_built(tmp_path: Path) -> None:
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path / "run", model=model, optimizer=optimizer,
                                async_save=True)
    try:
        assert manager._stager is not None
        assert manager._stager.nbytes == _state_bytes(model, optimizer)
        buffers = {path: b.data_ptr() for path, b in manager._stager._buffers.items()}
        manager.save(1)
        manager.wait()
        assert {path: b.data_ptr() for path, b in manager._stager._buffers.items()} == buffers
    finally:
        manager.close()


def test_stage_ahead_false_and_sync_managers_allocate_nothing_up_front(tmp_path: Path) -> None:
    model, optimizer = _trained()
    for kwargs in ({"async_save": True, "stage_ahead": False}, {"async_save": False}):
        manager = CheckpointManager(tmp_path / "run", model=model, optimizer=optimizer,
                                    **kwargs)  # type: ignore[arg-type]
        assert manager._stager is None, kwargs
        manager.close()


def test_restore_prepares_the_optimizer_buffers_its_state_brought_and_steps_nothing(
    tmp_path: Path,
) -> None:
    model, optimizer = _trained()
    CheckpointManager(tmp_path / "run", model=model, optimizer=optimizer).save(5)

    fresh_model, _ = _trained()
    fresh_model.zero_grad(set_to_none=True)  # a new process: no gradients, no state
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)  # no state yet
    manager = CheckpointManager(tmp_path / "run", model=fresh_model, optimizer=fresh_optimizer,
                                async_save=True)
    try:
        assert manager._stager is not None
        assert not fresh_optimizer.state  # building the manager took no optimizer step
        assert manager._stager.nbytes == _state_bytes(fresh_model, None)
        assert manager.restore() == 5
        assert manager._stager.nbytes == _state_bytes(fresh_model, fresh_optimizer)
        assert manager._stager.nbytes == _state_bytes(model, optimizer)
    finally:
        manager.close()


def test_a_fresh_optimizers_buffers_are_staged_at_the_first_step_end_not_at_the_first_save(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state yet
    manager = CheckpointManager(tmp_path / "run", model=model, optimizer=optimizer,
                                async_save=True, save_every=3)
    try:
        assert manager._stager.nbytes == _state_bytes(model, None)  # the model only
        for step in range(1, 4):
            model(torch.randn(2, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.step_end(step)
            # From the first step_end on, the optimizer's buffers are there too...
            assert manager._stager.nbytes == _state_bytes(model, optimizer), step
            if step == 1:
                buffers = {p: b.data_ptr() for p, b in manager._stager._buffers.items()}
        manager.wait()  # ...and the save of step 3 staged into them, allocating nothing
        assert {p: b.data_ptr() for p, b in manager._stager._buffers.items()} == buffers
    finally:
        manager.close()
