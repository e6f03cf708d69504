"""The emergency save starts at the signal: the last completed step, copied and committed at once.

From the moment a rank records a preemption signal, the state of the last completed step
is copied off the training thread; the next ``optimizer.step()`` waits for the copy; on one
process it is committed at once, while the step in progress runs (on several, once the
ranks agree, see tests/dist/test_emergency_capture_dist.py). The newest committed step is
never lost or rewritten: a second signal starts no second copy, a signal during a restore
copies the first step completed after it, and a background save in flight commits first.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.background import EmergencyCapture
from resumekit.errors import AsyncSaveError
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.tensors.staging import CpuStager
from tests.limits import HANG_S

LIMIT_S = HANG_S  # a hang detector (tests/limits.py), never a timing


@pytest.fixture(autouse=True)
def _keep_sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()
    optimizer.step()


def _weights(root: Path, step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    fresh, optimizer = _build()
    reader = CheckpointManager(root, model=fresh, optimizer=optimizer, read_only=True)
    assert reader.restore(step) == step
    reader.close()
    return {name: value.clone() for name, value in fresh.state_dict().items()}


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_a_signal_mid_step_commits_the_last_completed_step_before_the_step_ends(
    tmp_path: Path,
) -> None:
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler,
                             save_every=100)
    assert ckpt.restore() == 0
    for step in (1, 2):
        _train(model, optimizer)
        assert not ckpt.step_end(step)
    at_two = _snapshot(model)
    os.kill(os.getpid(), signal.SIGUSR1)  # during step 3 (its forward and backward)
    _train(model, optimizer)  # its optimizer.step() waits for the copy of step 2
    assert ckpt._emergency is not None
    outcome = ckpt._emergency.settle()  # the write started at the signal; done by now
    assert outcome is not None and outcome.committed == 2
    # The log line's figures: the copy's seconds, and the signal to the write's start,
    # which holds the copy (what benchmarks/emergency_latency.py compares).
    assert outcome.copied_in is not None and outcome.write_from is not None
    assert 0 <= outcome.copied_in <= outcome.write_from
    latest = ckpt.latest()
    assert latest is not None and latest.step == 2  # before step_end(3)
    assert latest.manifest.reason == "preemption"
    assert ckpt.step_end(3) is True  # the agreed preemption commits step 3 too (it fits)
    ckpt.close()
    assert [entry.step for entry in ckpt.checkpoints()] == [2, 3]
    saved = _weights(tmp_path, 2, model)
    for name, value in at_two.items():
        assert torch.equal(saved[name], value), name  # step 2's, not step 3's update


def test_the_optimizer_step_after_a_signal_waits_for_the_copy_of_the_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    copying, release = threading.Event(), threading.Event()
    original = CpuStager.stage

    def held(self: CpuStager, state: Any, **kwargs: Any) -> Any:
        copying.set()
        if not release.wait(LIMIT_S):
            raise TimeoutError("the test never released the copy")
        return original(self, state, **kwargs)

    monkeypatch.setattr(CpuStager, "stage", held)
    # The step either reaches the hold (the hook works) or, if nothing holds it, finishes
    # and changes the weights before the copy is released: no wait on the clock decides.
    reached = threading.Event()
    hold = EmergencyCapture._hold

    def noted_hold(self: EmergencyCapture, *args: Any) -> None:
        reached.set()
        hold(self, *args)

    monkeypatch.setattr(EmergencyCapture, "_hold", noted_hold)
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler)
    ckpt.restore()
    _train(model, optimizer)
    ckpt.step_end(1)
    at_one = _snapshot(model)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert copying.wait(LIMIT_S)  # the capture thread has the state of step 1 ...
    reached.clear()
    stepping = threading.Thread(target=lambda: (_train(model, optimizer), reached.set()))
    stepping.start()  # ... and this optimizer.step() must wait for its copy
    assert reached.wait(LIMIT_S)  # in the hold, or (no hold) already stepped
    release.set()
    stepping.join()
    assert ckpt._emergency is not None
    assert ckpt._emergency.settle().committed == 1  # type: ignore[union-attr]
    ckpt.close()
    saved = _weights(tmp_path, 1, model)
    for name, value in at_one.items():
        assert torch.equal(saved[name], value), name


def test_a_second_signal_starts_no_second_copy_and_rewrites_nothing(tmp_path: Path) -> None:
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler)
    ckpt.restore()
    _train(model, optimizer)
    ckpt.step_end(1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ckpt._emergency is not None
    assert ckpt._emergency.settle().committed == 1  # type: ignore[union-attr]
    [path] = tmp_path.glob("*1/manifest.json")
    before = path.read_bytes()
    os.kill(os.getpid(), signal.SIGUSR1)  # a second signal
    assert ckpt.step_end(2) is True  # its round commits nothing; step 2 is saved as before
    ckpt.close()
    assert path.read_bytes() == before  # step 1 never rewritten
    assert [entry.step for entry in ckpt.checkpoints()] == [1, 2]
    assert len(handler.received) == 2


def test_a_signal_during_a_restore_copies_the_first_step_completed_after_it(
    tmp_path: Path,
) -> None:
    model, optimizer = _build()
    first = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    first.restore()
    _train(model, optimizer)
    first.save(5, blocking=True)
    first.close()
    [path] = tmp_path.glob("*5/manifest.json")
    before = path.read_bytes()

    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler)
    os.kill(os.getpid(), signal.SIGUSR1)  # before the restore: nothing to copy yet
    assert ckpt.restore() == 5
    _train(model, optimizer)
    at_six = None
    assert ckpt._emergency is not None
    stop = ckpt.step_end(6)  # step 6 completes: the capture copies it
    at_six = _snapshot(model)
    assert stop is True
    ckpt.close()
    assert path.read_bytes() == before  # the restored step 5 untouched
    assert [entry.step for entry in ckpt.checkpoints()] == [5, 6]
    saved = _weights(tmp_path, 6, model)
    for name, value in at_six.items():
        assert torch.equal(saved[name], value), name


def test_a_signal_while_a_background_save_is_in_flight_lets_it_commit_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _first_save_held(monkeypatch)
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler,
                             async_save=True, save_every=2)
    ckpt.restore()
    for step in (1, 2, 3):
        _train(model, optimizer)
        assert not ckpt.step_end(step)  # step 2's background save is held by the gate
    os.kill(os.getpid(), signal.SIGUSR1)  # the capture of step 3 waits for that save
    gate.set()
    assert ckpt._emergency is not None
    assert ckpt._emergency.settle().committed == 3  # type: ignore[union-attr]
    _train(model, optimizer)
    assert ckpt.step_end(4) is True
    ckpt.close()
    steps = [entry.step for entry in ckpt.checkpoints()]
    assert steps == [2, 3, 4]
    assert [entry.manifest.reason for entry in ckpt.checkpoints()
            if entry.manifest is not None] == ["interval", "preemption", "preemption"]


def test_a_signal_commits_the_last_completed_step_of_every_optimizer_in_a_list(
    tmp_path: Path,
) -> None:
    def build() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        return model, [torch.optim.AdamW(model[0].parameters(), lr=0.1),
                       torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.9)]

    def train(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        for part in optimizers:
            part.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        for part in optimizers:
            part.step()

    model, optimizers = build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizers,
                             capture_at_signal=True, preemption=handler,
                             save_every=100)
    assert ckpt.restore() == 0
    for step in (1, 2):
        train(model, optimizers)
        assert not ckpt.step_end(step)
    at_two = [{key: value.clone() for key, value in part.state_dict()["state"][0].items()
               if isinstance(value, torch.Tensor)} for part in optimizers]
    os.kill(os.getpid(), signal.SIGUSR1)  # during step 3
    train(model, optimizers)  # each optimizer's step() waits for the copy of step 2
    assert ckpt._emergency is not None
    outcome = ckpt._emergency.settle()
    assert outcome is not None and outcome.committed == 2
    ckpt.close()
    fresh, fresh_optimizers = build()
    reader = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizers,
                               read_only=True)
    assert reader.restore(2) == 2
    reader.close()
    for saved, part in zip(at_two, fresh_optimizers, strict=True):
        restored = part.state_dict()["state"][0]
        for key, value in saved.items():
            assert torch.equal(restored[key], value), key  # step 2's, not step 3's


def test_the_capture_is_on_by_default_with_a_handler_and_off_when_turned_off(
    tmp_path: Path,
) -> None:
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    on = CheckpointManager(tmp_path / "on", model=model, optimizer=optimizer,
                           preemption=handler)
    assert on._emergency is not None
    on.close()
    off = CheckpointManager(tmp_path / "off", model=model, optimizer=optimizer,
                            preemption=handler, capture_at_signal=False)
    assert off._emergency is None
    off.close()
    assert CheckpointManager(tmp_path / "none", model=model,
                             optimizer=optimizer)._emergency is None


def test_a_second_signal_during_the_emergency_write_starts_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    writing, release = threading.Event(), threading.Event()
    original = tensors.step_files

    def held(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "resumekit-emergency":
            writing.set()  # the tensor files of the copy are written; the rest waits
            if not release.wait(LIMIT_S):
                raise TimeoutError("the test never released the emergency write")
        return original(*args, **kwargs)

    monkeypatch.setattr(tensors, "step_files", held)
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             preemption=handler, save_every=2, capture_at_signal=True)
    ckpt.restore()
    for step in (1, 2, 3):
        _train(model, optimizer)
        assert not ckpt.step_end(step)
    [two] = tmp_path.glob("*2/manifest.json")
    before = two.read_bytes()
    at_three = _snapshot(model)
    caplog.set_level("WARNING", logger="resumekit")
    os.kill(os.getpid(), signal.SIGUSR1)  # the capture copies step 3 and writes it
    assert writing.wait(LIMIT_S)
    os.kill(os.getpid(), signal.SIGUSR1)  # a second signal, mid-write
    assert len(handler.received) == 2
    release.set()
    _train(model, optimizer)
    assert ckpt.step_end(4) is True  # the agreed preemption: step 4 saved as before
    ckpt.close()
    assert [entry.step for entry in ckpt.checkpoints()] == [2, 3, 4]
    assert two.read_bytes() == before  # the committed step 2 never rewritten
    writes = [r.getMessage() for r in caplog.records if "emergency save of step" in
              r.getMessage()]
    assert len(writes) == 1 and "step 3" in writes[0]  # one copy, one write
    [further] = [r.getMessage() for r in caplog.records
                 if "further preemption signal" in r.getMessage()]
    assert "(2 recorded: SIGUSR1, the last" in further
    assert "starts no second emergency copy" in further and "committed step 3" in further
    saved = _weights(tmp_path, 3, model)
    for name, value in at_three.items():
        assert torch.equal(saved[name], value), name


def test_a_signal_in_the_middle_of_a_restore_copies_nothing_half_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             preemption=handler, save_every=2, capture_at_signal=True)
    ckpt.restore()
    for step in (1, 2):
        _train(model, optimizer)
        assert not ckpt.step_end(step)
    at_two = _snapshot(model)
    _train(model, optimizer)
    assert not ckpt.step_end(3)  # step 3 completed: a copy of it could be taken now
    [two] = tmp_path.glob("*2/manifest.json")
    before = two.read_bytes()

    loading, release = threading.Event(), threading.Event()
    original = tensors.load

    def held(*args: Any, **kwargs: Any) -> Any:
        loading.set()
        if not release.wait(LIMIT_S):
            raise TimeoutError("the test never released the restore")
        return original(*args, **kwargs)

    monkeypatch.setattr(tensors, "load", held)
    caplog.set_level("WARNING", logger="resumekit")
    restoring = threading.Thread(target=lambda: restored.append(ckpt.restore(2)))
    restored: list[int] = []
    restoring.start()  # roll back to step 2 (a restore on another thread, held mid-load)
    assert loading.wait(LIMIT_S)
    os.kill(os.getpid(), signal.SIGUSR1)  # the signal arrives in the middle of the restore
    release.set()
    restoring.join(LIMIT_S)
    assert restored == [2]
    for name, value in at_two.items():
        assert torch.equal(model.state_dict()[name], value), name
    _train(model, optimizer)
    assert ckpt.step_end(3) is True  # the agreed preemption saves step 3 (retrained)
    ckpt.close()
    assert [entry.step for entry in ckpt.checkpoints()] == [2, 3]
    assert two.read_bytes() == before
    nothing = [r.getMessage() for r in caplog.records
               if "nothing could be copied" in r.getMessage()]
    assert len(nothing) == 1 and "s ago" in nothing[0], nothing
    assert not any("emergency save of step" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_background_save_that_fails_during_a_preemption_leaves_the_capture_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str,
) -> None:
    # Step 2's background save is held until the signal is in, then fails (a NAS that
    # fills up): the capture of step 2, the last completed step, still commits, and the
    # failure is raised by the agreed preemption's step_end, never swallowed.
    gate = _first_save_held(
        monkeypatch, then=OSError(28, "No space left on device (injected)"))
    model, optimizer = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                             capture_at_signal=True, preemption=handler,
                             async_save=True, async_writer=writer, save_every=2)
    ckpt.restore()
    for step in (1, 2):
        _train(model, optimizer)
        assert not ckpt.step_end(step)  # step 2's background save is held by the gate
    at_two = _snapshot(model)
    os.kill(os.getpid(), signal.SIGUSR1)  # during step 3: the capture of step 2 waits
    gate.set()  # for the save in flight, which now fails
    _train(model, optimizer)  # step 3's optimizer.step() waits for the copy of step 2
    with pytest.raises(AsyncSaveError, match="background save of step 2 failed"):
        ckpt.step_end(3)
    ckpt.close()
    assert [(entry.step, entry.manifest.reason) for entry in ckpt.checkpoints()
            if entry.manifest is not None] == [(2, "preemption")]
    saved = _weights(tmp_path, 2, model)
    for name, value in at_two.items():
        assert torch.equal(saved[name], value), name  # step 2's state, from the capture


def test_the_capture_thread_waits_on_descriptors_above_1024(tmp_path: Path) -> None:
    # A trainer with many files or sockets open: the capture's pipes get descriptors at or
    # above FD_SETSIZE (1024), which select() refuses; the thread must still wait on them.
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below what the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        model, optimizer = _build()
        handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
        ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                                 capture_at_signal=True, preemption=handler, save_every=2)
        assert ckpt._emergency is not None
        assert min(ckpt._emergency._signal_read, ckpt._emergency._control_read) >= 1024
        ckpt.restore()
        for step in (1, 2, 3):  # step 2's save is a settle point of the capture thread
            _train(model, optimizer)
            assert not ckpt.step_end(step)
        os.kill(os.getpid(), signal.SIGUSR1)  # during step 4: the copy of step 3
        _train(model, optimizer)
        assert ckpt.step_end(4) is True
        ckpt.close()
        assert [entry.step for entry in ckpt.checkpoints()] == [2, 3, 4]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _first_save_held(monkeypatch: pytest.MonkeyPatch, *, then: BaseException | None = None
                     ) -> threading.Event:
    """The first tensor save waits for the returned gate, then runs (or raises ``then``)."""
    gate = threading.Event()
    original = tensors.save
    calls = 0

    def held(state: Any, directory: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            if not gate.wait(LIMIT_S):
                raise TimeoutError("the test never released the background save")
            if then is not None:
                raise then
        return original(state, directory, **kwargs)

    monkeypatch.setattr(tensors, "save", held)
    return gate
