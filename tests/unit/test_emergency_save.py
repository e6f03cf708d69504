"""The manager's emergency save: what it counts as "recent", and what it never drops."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.store.manifest import Manifest, parse_manifest
from tests.limits import HANG_S

GATE_LIMIT_S = HANG_S  # a hang detector: the test opens the gate


@pytest.fixture(autouse=True)
def _keep_sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _manager(root: Path, **kwargs: Any) -> tuple[CheckpointManager, nn.Module,
                                                  torch.optim.Optimizer]:
    model, optimizer = _build()
    return CheckpointManager(root, model=model, optimizer=optimizer, **kwargs), model, optimizer


def _preempt() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


class _GatedWrites:
    """Hold every tensor write of a save until ``release()`` (a save that takes a while)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.released = threading.Event()
        original = tensors.save

        def gated(*args: Any, **kwargs: Any) -> Any:
            if not self.released.wait(GATE_LIMIT_S):
                raise TimeoutError("the test never released the gated save")
            return original(*args, **kwargs)

        monkeypatch.setattr(tensors, "save", gated)

    def release(self) -> None:
        self.released.set()


def test_a_checkpoint_from_a_host_whose_clock_runs_ahead_does_not_skip_the_emergency_save(
    tmp_path: Path,
) -> None:
    first, model, optimizer = _manager(tmp_path)
    _train(model, optimizer)
    first.save(5)
    first.close()
    # The checkpoint was written on a host whose clock ran 10 minutes ahead.
    [path] = tmp_path.glob("*5/manifest.json")
    document = json.loads(path.read_text())
    ahead = datetime.fromisoformat(document["created_at"]) + timedelta(minutes=10)
    document["created_at"] = ahead.isoformat()
    path.write_text(json.dumps(document))

    # No grace period: the "recent enough" rule applies, so the age decides.
    handler = PreemptionHandler(signals=("SIGUSR1",))
    ckpt, model, optimizer = _manager(tmp_path, preemption=handler)
    assert ckpt.restore() == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(6, 9):
            _train(model, optimizer)
            if step == 8:
                _preempt()
            stop = ckpt.step_end(step)
    assert stop is True
    latest = ckpt.latest()
    assert latest is not None and (latest.step, latest.manifest.reason.value) == (8, "preemption")
    ckpt.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_preemption_agreed_at_a_save_every_step_commits_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    gate = _GatedWrites(monkeypatch)
    handler = PreemptionHandler(signals=("SIGUSR1",))  # no grace: recency applies
    ckpt, model, optimizer = _manager(tmp_path, save_every=5, async_save=async_save,
                                      preemption=handler)
    if not async_save:
        gate.release()
    for step in range(1, 11):
        _train(model, optimizer)
        if step == 10:
            gate.release()  # the background save of step 5 finishes only now
            _preempt()
        stop = ckpt.step_end(step)
    assert stop is True
    latest = ckpt.latest()
    assert latest is not None and latest.step == 10
    assert latest.manifest.reason.value == "preemption"
    ckpt.close()


def test_an_async_commit_counts_its_age_from_the_capture_not_from_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _GatedWrites(monkeypatch)
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    seen: list[tuple[float | None, float, int | None]] = []
    decide = handler.should_skip_emergency_save

    def recording(since: float | None, expected: float, *,
                  steps_since_last_commit: int | None = None, **more: Any) -> bool:
        seen.append((since, expected, steps_since_last_commit))
        return decide(since, expected, steps_since_last_commit=steps_since_last_commit,
                      **more)

    monkeypatch.setattr(handler, "should_skip_emergency_save", recording)
    ckpt, model, optimizer = _manager(tmp_path, save_every=5, async_save=True,
                                      preemption=handler)
    for step in range(1, 6):
        _train(model, optimizer)
        ckpt.step_end(step)
    captured = time.monotonic()  # step 5's state is staged; training goes on
    for step in range(6, 9):
        _train(model, optimizer)
        time.sleep(0.05)  # the step's compute
        if step == 8:
            trained = time.monotonic() - captured
            gate.release()
            _preempt()
        ckpt.step_end(step)
    # Decided at the signal (a save was in flight and the grace window runs), and again
    # once the save in flight committed: both count from the capture.
    assert len(seen) == 2
    for since, _, steps in seen:
        assert steps == 3
        assert since is not None and since >= trained  # counted from the capture
    committed = ckpt.latest()
    assert committed is not None and committed.step == 8
    ckpt.close()
    [path] = tmp_path.glob("*5/manifest.json")
    manifest = parse_manifest(path.read_bytes(), source=str(path))
    assert manifest.captured_at is not None
    assert manifest.captured_at < manifest.created_at  # committed after the release


def test_a_manifest_without_a_capture_time_still_reads() -> None:
    old = Manifest(step=3).model_dump(mode="json")
    del old["captured_at"]
    manifest = parse_manifest(json.dumps(old).encode(), source="old/manifest.json")
    assert manifest.step == 3 and manifest.captured_at is None
