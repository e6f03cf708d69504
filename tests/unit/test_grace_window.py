"""The emergency save knows the clock: bytes / the root's measured write rate vs the grace left.

resumekit measures how fast its root takes a save (the tensor bytes of every committed save
over its write phase), records it in the manifest so that a requeued process knows it
before saving, and at the signal saves only what fits the grace window left, saying so at
once, with the numbers, when a save does not fit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors as tensor_io
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import (
    SAVE_TIME_MARGIN,
    EmergencySaveSkippedWarning,
    PreemptionHandler,
)
from resumekit.runtime.save_clock import CommitClock, SaveEstimate, state_bytes
from resumekit.store.manifest import Manifest, SaveThroughput, parse_manifest
from resumekit.warnings import ResumekitWarning
from tests.bandwidth import ThrottledWrites
from tests.limits import HANG_S

GATE_LIMIT_S = HANG_S  # a hang detector: the test opens the gate
STAGING = ".*.tmp-*"  # a staging directory being written (store/layout.py)


@pytest.fixture(autouse=True)
def _keep_sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _manager(root: Path, **kwargs: Any) -> tuple[CheckpointManager, nn.Module,
                                                  torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return CheckpointManager(root, model=model, optimizer=optimizer, **kwargs), model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 64)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _manifest(root: Path, step: int) -> tuple[Path, Manifest]:
    [path] = root.glob(f"*{step}/manifest.json")
    return path, parse_manifest(path.read_bytes(), source=str(path))


def _record_rate(root: Path, step: int, seconds: float) -> int:
    """Make the checkpoint of ``step`` record that its save took ``seconds``; its bytes."""
    path, manifest = _manifest(root, step)
    assert manifest.save_throughput is not None
    document = json.loads(path.read_text())
    document["save_throughput"]["seconds"] = seconds
    path.write_text(json.dumps(document))
    return manifest.save_throughput.bytes


def _restored(root: Path, rate_seconds: float, **kwargs: Any) -> tuple[
        CheckpointManager, nn.Module, torch.optim.Optimizer, int]:
    """A root whose step 5 recorded a save of ``rate_seconds``, restored by a new process."""
    first, model, optimizer = _manager(root)
    _train(model, optimizer)
    first.save(5, blocking=True)
    first.close()
    nbytes = _record_rate(root, 5, rate_seconds)
    ckpt, model, optimizer = _manager(root, **kwargs)
    assert ckpt.restore() == 5
    return ckpt, model, optimizer, nbytes


def _leftovers(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob(STAGING))


# -- measuring ------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "background"])
def test_every_committed_save_records_its_bytes_and_write_seconds_bounded_by_the_bandwidth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    bandwidth = 2e6  # bytes/s
    store = ThrottledWrites(bandwidth, monkeypatch)
    ckpt, model, optimizer = _manager(tmp_path, async_save=async_save)
    _train(model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    ckpt.close()
    _, manifest = _manifest(tmp_path, 1)
    record = manifest.save_throughput
    assert record is not None and record.blocking is not async_save
    # The tensor state, each tensor once, at its global size: what the writer wrote.
    tensors = {"model": model.state_dict(), "optimizer": list(optimizer.state.values())}
    assert record.bytes == state_bytes(tensors)
    [written] = store.written
    assert record.bytes <= written  # the files add a little metadata
    # The write phase took at least the bandwidth's time for the bytes: the measured rate
    # cannot exceed the bound.
    assert record.bytes_per_second <= written / record.seconds <= bandwidth


def test_a_manifest_without_a_save_throughput_still_reads() -> None:
    old = Manifest(step=3).model_dump(mode="json")
    del old["save_throughput"]
    manifest = parse_manifest(json.dumps(old).encode(), source="old/manifest.json")
    assert manifest.step == 3 and manifest.save_throughput is None
    recorded = Manifest(step=4, save_throughput=SaveThroughput(bytes=8_000_000, seconds=2.0))
    again = parse_manifest(recorded.to_json(), source="new/manifest.json")
    assert again.save_throughput == recorded.save_throughput
    assert again.save_throughput is not None
    assert again.save_throughput.bytes_per_second == 4_000_000


def test_the_clock_estimates_at_the_blocking_rate_and_a_background_rate_only_until_then(
) -> None:
    clock = CommitClock()
    assert clock.bytes_per_second is None
    assert clock.estimate(1000).seconds is None
    clock.wrote(45, 1_000_000, 0.1, blocking=False)  # only a background save: a lower bound
    assert clock.bytes_per_second == 10_000_000
    said = clock.estimate(1).measured_from
    assert "the background save of step 45" in said and "lower bound" in said
    clock.seed_throughput(40, nbytes=4_000_000, seconds=2.0)  # a restored emergency save's
    estimate = clock.estimate(8_000_000)
    assert estimate.seconds == 4.0
    assert estimate.measured_from == "the blocking save of step 40, recorded before this restart"
    clock.wrote(50, 3_000_000, 0.1, blocking=True)  # a blocking save here replaces the record
    assert clock.expected_save_seconds(3_000_000) == pytest.approx(0.1)
    clock.wrote(51, 1_000_000, 1.0, blocking=False)  # a slow background save changes nothing
    assert clock.bytes_per_second == pytest.approx(30_000_000)
    assert clock.estimate(1).measured_from == "the blocking save of step 50"
    clock.wrote(52, 0, 0.1, blocking=True)  # no bytes: measures nothing
    assert clock.bytes_per_second == pytest.approx(30_000_000)


def test_a_save_in_flight_is_estimated_at_the_background_rate() -> None:
    clock = CommitClock()
    clock.wrote(30, 1_000_000, 0.1, blocking=True)  # 10 MB/s blocking
    clock.wrote(31, 1_000_000, 1.0, blocking=False)  # 1 MB/s while training ran
    clock.write_started(35, 10_000_000)  # 10 s at the background rate, 1 s at the blocking
    estimate = clock.estimate(1_000_000)
    assert estimate.seconds == pytest.approx(0.1)
    assert estimate.in_flight_seconds is not None and 1 < estimate.in_flight_seconds <= 10


def test_a_save_in_flight_counts_the_seconds_it_still_needs_at_the_measured_rate() -> None:
    clock = CommitClock()
    clock.seed_throughput(40, nbytes=1_000_000, seconds=1.0)  # 1 MB/s
    started = clock.write_started(45, 100_000_000)  # 100 s of writing
    estimate = clock.estimate(1_000_000)
    assert estimate.in_flight_step == 45
    assert estimate.in_flight_seconds is not None and 0 < estimate.in_flight_seconds <= 100
    assert started > 0
    clock.write_ended(45)
    assert clock.estimate(1_000_000).in_flight_step is None


# -- deciding -------------------------------------------------------------------------------


def _signalled(grace: float) -> PreemptionHandler:
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=grace).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.agreed(12)
    return handler


def test_a_save_that_fits_the_grace_left_at_the_measured_rate_is_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "resumekit")
    handler = _signalled(grace=600)
    estimate = SaveEstimate(8_000_000, 4_000_000, "the blocking save of step 10")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not handler.should_skip_emergency_save(
            None, 0.0, steps_since_last_commit=2, estimate=estimate, newest_step=10)
    handler.uninstall()
    assert "making the emergency save at step 12" in caplog.text
    assert "8.0 MB at the measured 4.0 MB/s (the blocking save of step 10) = 2.00 s" \
        in caplog.text


def test_a_save_that_does_not_fit_is_not_started_and_the_warning_gives_the_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = _signalled(grace=6)
    estimate = SaveEstimate(80_000_000, 10_000_000, "the blocking save of step 10")
    with pytest.warns(EmergencySaveSkippedWarning) as caught:
        # The duration of the last save in this process (1 s) would fit: the rate decides.
        assert handler.should_skip_emergency_save(
            None, 1.0, steps_since_last_commit=2, estimate=estimate, newest_step=10)
    handler.uninstall()
    [warning] = caught
    message = str(warning.message)
    assert message.startswith("skipping the emergency save at step 12: a save would write "
                              "80.0 MB at the measured 10.0 MB/s (the blocking save of "
                              "step 10) = 8.00 s; x 1.0 margin = 8.0 s > ")
    assert "s left of the 6 s grace period, so it is not started" in message
    assert "step 10 stays the newest checkpoint" in message
    assert caplog.records[-1].levelname == "WARNING"  # and one log line, the same words
    assert message in caplog.records[-1].getMessage()


def test_with_a_save_in_flight_the_warning_says_it_completes_and_stays_newest() -> None:
    handler = _signalled(grace=20)
    # The new save alone would fit (8 s <= 20 s), the one in flight too, not both.
    estimate = SaveEstimate(80_000_000, 10_000_000, "the background save of step 10",
                            in_flight_step=10, in_flight_seconds=15.0)
    with pytest.warns(EmergencySaveSkippedWarning,
                      match=r"after the in-flight save of step 10 \(about 15.0 s more\); "
                            r"x 1.0 margin = 23.0 s > .* the in-flight save of step 10 is "
                            r"left to complete and stays the newest checkpoint"):
        assert handler.should_skip_emergency_save(
            None, 0.0, steps_since_last_commit=2, estimate=estimate, newest_step=5)
    handler.uninstall()


def test_a_save_in_flight_that_cannot_finish_in_time_is_said_too() -> None:
    handler = _signalled(grace=20)
    estimate = SaveEstimate(80_000_000, 10_000_000, "the background save of step 10",
                            in_flight_step=10, in_flight_seconds=25.0)
    with pytest.warns(EmergencySaveSkippedWarning,
                      match=r"the in-flight save of step 10 itself needs about 25.0 s x 1.0 "
                            r"and may not finish in time either: .* step 10 becomes the "
                            r"newest checkpoint if it commits before the kill, else step 5 "
                            r"stays the newest"):
        assert handler.should_skip_emergency_save(
            None, 0.0, steps_since_last_commit=2, estimate=estimate, newest_step=5)
    handler.uninstall()


def test_the_margin_is_the_stated_one() -> None:
    # docs/preemption.md states it: a save is attempted whenever it fits (a save the kill
    # cuts costs nothing the commit protocol does not protect).
    assert SAVE_TIME_MARGIN == 1.0


# -- the manager at the signal --------------------------------------------------------------


@pytest.mark.parametrize("fits", [True, False], ids=["fits", "does-not-fit"])
def test_a_requeued_process_decides_by_the_rate_its_restored_checkpoint_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fits: bool
) -> None:
    caplog.set_level(logging.INFO, "resumekit")
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    # The restored checkpoint's save took 1 ms (fits) or 1000 s (does not) for its bytes.
    ckpt, model, optimizer, nbytes = _restored(tmp_path, 0.001 if fits else 1000.0,
                                               preemption=handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6, 9):
            _train(model, optimizer)
            if step == 8:
                os.kill(os.getpid(), signal.SIGUSR1)
            stop = ckpt.step_end(step)
    assert stop is True
    skipped = [str(w.message) for w in caught if w.category is EmergencySaveSkippedWarning]
    latest = ckpt.latest()
    ckpt.close()
    assert "step 5, recorded before this restart" in caplog.text
    assert latest is not None
    if fits:
        assert skipped == []
        assert (latest.step, latest.manifest.reason.value) == (8, "preemption")
    else:
        [message] = skipped
        assert f"{nbytes / 1000:.1f} kB at the measured" in message
        assert "step 5 stays the newest checkpoint" in message
        assert latest.step == 5
        assert not list(tmp_path.glob("*8"))  # nothing of step 8 was started
    assert _leftovers(tmp_path) == []
    again, _, _ = _manager(tmp_path)
    assert again.restore() == latest.step  # the newest checkpoint loads
    again.close()


def test_a_save_every_step_is_not_started_when_the_clock_says_it_would_be_cut(
    tmp_path: Path,
) -> None:
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt, model, optimizer, _ = _restored(tmp_path, 1000.0, preemption=handler,
                                          save_every=10)
    for step in range(6, 11):
        _train(model, optimizer)
        if step == 10:
            os.kill(os.getpid(), signal.SIGUSR1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stop = ckpt.step_end(step)
    assert stop is True
    assert [w.category for w in caught] == [EmergencySaveSkippedWarning]
    latest = ckpt.latest()
    ckpt.close()
    assert latest is not None and latest.step == 5
    assert _leftovers(tmp_path) == []


class _ReleaseOnWarning(logging.Handler):
    """Release the gated background save when the skip is logged, and only then."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.gate = gate
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "skipping the emergency save" in record.getMessage():
            self.lines.append(record.getMessage())
            self.gate.set()


@pytest.mark.parametrize(("save_seconds", "said"), [
    # One save fits the 20 s window, the one in flight and a new one do not.
    (12.0, "the in-flight save of step 10 is left to complete and stays the newest"),
    # Not even the save in flight fits: said too; it is still the only one to wait for.
    (1000.0, "the in-flight save of step 10 itself needs about"),
], ids=["in-flight-fits", "in-flight-may-be-cut"])
def test_with_a_background_save_in_flight_it_says_so_at_once_and_lets_that_save_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save_seconds: float, said: str
) -> None:
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=20)
    # A save of this state takes ``save_seconds`` at the recorded rate.
    ckpt, model, optimizer, _ = _restored(tmp_path, save_seconds, preemption=handler,
                                          save_every=10, async_save=True)
    gate = threading.Event()
    original = tensor_io.save

    def gated(*args: Any, **kwargs: Any) -> Any:
        if not gate.wait(GATE_LIMIT_S):
            raise TimeoutError("the skip was not said before waiting for the save in flight")
        return original(*args, **kwargs)

    monkeypatch.setattr(tensor_io, "save", gated)
    release = _ReleaseOnWarning(gate)
    logging.getLogger("resumekit").addHandler(release)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6, 12):
                _train(model, optimizer)
                if step == 11:  # the background save of step 10 is held by the gate
                    os.kill(os.getpid(), signal.SIGUSR1)
                stop = ckpt.step_end(step)
    finally:
        logging.getLogger("resumekit").removeHandler(release)
        gate.set()
    assert stop is True
    [line] = release.lines  # said while the save of step 10 was still held: at once
    assert "after the in-flight save of step 10" in line
    assert said in line
    assert [f"resumekit: {w.message}" for w in caught
            if w.category is EmergencySaveSkippedWarning] == [line]
    latest = ckpt.latest()
    ckpt.close()
    assert latest is not None and latest.step == 10  # the save in flight committed
    assert not list(tmp_path.glob("*11"))
    assert _leftovers(tmp_path) == []
    again, _, _ = _manager(tmp_path)
    assert again.restore() == 10
    again.close()


# -- numbers read from disk -------------------------------------------------------------------


@pytest.mark.parametrize("literal", ["1e999", "1e-320", "-2.0", "NaN", "0"])
def test_a_recorded_save_rate_that_is_not_a_usable_number_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, literal: str
) -> None:
    caplog.set_level(logging.INFO, "resumekit")
    first, model, optimizer = _manager(tmp_path)
    _train(model, optimizer)
    first.save(5, blocking=True)
    first.close()
    path, _ = _manifest(tmp_path, 5)
    document = json.loads(path.read_text())
    document["save_throughput"]["seconds"] = "SECONDS"
    path.write_text(json.dumps(document).replace('"SECONDS"', literal))
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=60)
    ckpt, model, optimizer = _manager(tmp_path, preemption=handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore() == 5
        for step in range(6, 9):
            _train(model, optimizer)
            if step == 8:
                os.kill(os.getpid(), signal.SIGUSR1)
            stop = ckpt.step_end(step)  # the emergency save: never a ZeroDivisionError
    said = [str(w.message) for w in caught]
    assert any(str(path) in message and "save_throughput" in message for message in said), said
    assert "recorded before this restart" not in caplog.text  # the rate was not used
    latest = ckpt.latest()
    ckpt.close()
    assert stop is True and latest is not None
    assert (latest.step, latest.manifest.reason.value) == (8, "preemption")


@pytest.mark.parametrize("seconds", [float("inf"), 1e-320, float("nan"), -1.0])
def test_the_clock_takes_no_rate_from_seconds_that_are_not_a_usable_number(
        seconds: float) -> None:
    clock = CommitClock()
    clock.seed_throughput(40, nbytes=188, seconds=seconds)
    clock.wrote(41, 188, seconds, blocking=False)
    assert clock.bytes_per_second is None
    clock.write_started(45, 10_000_000)  # a save in flight: no ZeroDivisionError
    estimate = clock.estimate(1_000_000)
    assert estimate.seconds is None and estimate.in_flight_seconds is None
    assert clock.expected_save_seconds(1_000_000) == 0.0


def test_a_manifest_with_an_unusable_save_rate_still_reads_without_it_and_says_so() -> None:
    recorded = Manifest(step=4, save_throughput=SaveThroughput(bytes=8_000_000, seconds=2.0))
    raw = recorded.to_json().replace(b'"seconds": 2.0', b'"seconds": 1e999')
    assert raw != recorded.to_json()
    with pytest.warns(ResumekitWarning, match=r"run/step_4/manifest\.json: ignoring its "
                      r"save_throughput \(seconds inf"):
        manifest = parse_manifest(raw, source="run/step_4/manifest.json")
    assert manifest.step == 4 and manifest.save_throughput is None
    with pytest.raises(ValueError, match="seconds"):  # nor can one be built in code
        SaveThroughput(bytes=1, seconds=float("inf"))
