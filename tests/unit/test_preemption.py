"""The preemption handler in one process: signals, handlers, deadline rule, requeue."""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from resumekit.errors import ConfigurationError, PreemptionError
from resumekit.runtime.preemption import (
    EXIT_CODE_PREEMPTED,
    EmergencySaveSkippedWarning,
    PreemptionHandler,
)
from resumekit.runtime.requeue import requeue_after_signal, requeue_slurm_job
from resumekit.runtime.save_clock import CommitClock
from resumekit.warnings import ResumekitWarning


class Recorder:
    """A plain handler standing in for whatever the trainer had installed before."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.seen.append(signum)


@pytest.fixture
def previous_handlers() -> Iterator[Recorder]:
    recorder = Recorder()
    sigs = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        signal.signal(sig, recorder)
    yield recorder
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_only_records_the_request(previous_handlers: Recorder) -> None:
    with PreemptionHandler() as handler:
        assert not handler.requested
        before = time.monotonic()
        signal.raise_signal(signal.SIGUSR1)
        assert handler.requested
        [record] = handler.received
        assert (record.signum, record.name) == (signal.SIGUSR1, "SIGUSR1")
        assert before <= record.received_at <= time.monotonic()
    assert previous_handlers.seen == []


def test_uninstall_puts_the_previous_handlers_back(previous_handlers: Recorder) -> None:
    handler = PreemptionHandler().install()
    assert signal.getsignal(signal.SIGTERM) == handler._on_signal
    handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous_handlers
    assert signal.getsignal(signal.SIGUSR1) is previous_handlers
    signal.raise_signal(signal.SIGTERM)
    assert previous_handlers.seen == [signal.SIGTERM]
    assert not handler.requested
    handler.uninstall()  # twice is fine


def test_a_second_signal_during_a_save_is_recorded_without_raising(
    tmp_path: Path, previous_handlers: Recorder
) -> None:
    chunks = 50
    with (
        PreemptionHandler(signals=(signal.SIGTERM, signal.SIGINT)) as handler,
        open(tmp_path / "shard.bin", "wb") as shard,
    ):
        for chunk in range(chunks):
            shard.write(bytes(1024))
            if chunk == 10:
                signal.raise_signal(signal.SIGTERM)
            if chunk == 20:
                signal.raise_signal(signal.SIGINT)  # would be KeyboardInterrupt by default
            if chunk == 30:
                signal.raise_signal(signal.SIGTERM)
    assert (tmp_path / "shard.bin").stat().st_size == chunks * 1024
    assert [record.name for record in handler.received] == ["SIGTERM", "SIGINT", "SIGTERM"]


def test_sigusr2_can_replace_sigusr1(previous_handlers: Recorder) -> None:
    with PreemptionHandler(signals=("USR2",)) as handler:
        signal.raise_signal(signal.SIGUSR1)
        assert not handler.requested
        assert previous_handlers.seen == [signal.SIGUSR1]
        signal.raise_signal(signal.SIGUSR2)
        assert handler.requested
        assert handler.signals == (signal.SIGUSR2,)


def test_installing_off_the_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            PreemptionHandler().install()
        except PreemptionError as error:
            errors.append(error)

    worker = threading.Thread(target=install, name="loader")
    worker.start()
    worker.join()
    assert len(errors) == 1 and "main thread" in str(errors[0]) and "loader" in str(errors[0])


def test_installing_twice_is_an_error(previous_handlers: Recorder) -> None:
    with PreemptionHandler() as handler, pytest.raises(PreemptionError, match="already"):
        handler.install()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"signals": (signal.SIGKILL,)}, "SIGKILL cannot be caught"),
        ({"signals": ("SIGNOPE",)}, "'SIGNOPE' is not a signal name"),
        ({"signals": ()}, "at least one signal"),
        ({"poll_every": 0}, "poll_every=0"),
        ({"poll_every": "sometimes"}, "poll_every='sometimes' must be 'auto'"),
        ({"grace_period": 0}, "grace_period=0"),
    ],
)
def test_impossible_settings_are_refused(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        PreemptionHandler(**arguments)  # type: ignore[arg-type]
    assert caught.value.name == next(iter(arguments))


def test_one_process_agrees_at_the_first_step_after_the_signal_and_stays_agreed(
    previous_handlers: Recorder,
) -> None:
    with PreemptionHandler(poll_every=5) as handler:
        assert [handler.agreed(step) for step in range(1, 4)] == [False] * 3
        signal.raise_signal(signal.SIGTERM)
        assert handler.agreed(4)  # no collective to wait for: poll_every does not delay
        assert handler.agreed(5) and handler.agreed_step == 4


def test_the_default_poll_interval_is_automatic_and_starts_at_every_step() -> None:
    handler = PreemptionHandler()
    assert handler.poll_every == "auto" and handler.poll_interval == 1
    assert PreemptionHandler(poll_every=7).poll_interval == 7


def test_a_request_from_code_counts_like_a_signal() -> None:
    handler = PreemptionHandler()
    assert not handler.agreed(1)
    handler.request()
    assert handler.agreed(2) and handler.received == ()


def test_a_save_no_longer_than_the_work_since_the_last_commit_is_skipped() -> None:
    handler = PreemptionHandler()
    with pytest.warns(EmergencySaveSkippedWarning, match="last commit is 20.0 s old"):
        assert handler.should_skip_emergency_save(20.0, expected_save_seconds=30.0)


def test_a_save_is_made_when_it_saves_more_work_than_it_costs_and_time_allows(
    previous_handlers: Recorder,
) -> None:
    with PreemptionHandler(grace_period=120) as handler:
        signal.raise_signal(signal.SIGTERM)
        assert handler.agreed(7)
        left = handler.seconds_left()
        assert left is not None and 100 < left <= 120
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not handler.should_skip_emergency_save(600.0, expected_save_seconds=30.0)
            assert not handler.should_skip_emergency_save(None, expected_save_seconds=30.0)


def test_a_save_that_would_not_finish_within_the_grace_period_is_skipped(
    previous_handlers: Recorder,
) -> None:
    with PreemptionHandler(grace_period=30) as handler:
        signal.raise_signal(signal.SIGTERM)
        assert handler.agreed(7)
        with pytest.warns(EmergencySaveSkippedWarning, match="at step 7: .* grace period"):
            assert handler.should_skip_emergency_save(3600.0, expected_save_seconds=35.0)


def test_without_a_grace_period_only_recency_decides() -> None:
    handler = PreemptionHandler()
    handler.request()
    assert handler.agreed(1) and handler.seconds_left() is None
    assert not handler.should_skip_emergency_save(36_000.0, expected_save_seconds=10_000.0)


def test_a_negative_age_of_the_last_commit_is_never_recent_and_is_reported_as_clock_skew(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "resumekit")  # the warning's DEBUG record, for traces
    handler = PreemptionHandler()  # no grace period: the recency rule applies
    handler.request()
    assert handler.agreed(3)
    with pytest.warns(ResumekitWarning, match=r"-599.9 s, which cannot be: .*clock skew"):
        assert not handler.should_skip_emergency_save(-599.9, expected_save_seconds=30.0)
    assert "clock skew" in caplog.text
    with pytest.warns(ResumekitWarning, match="cannot be"):
        assert not handler.should_skip_emergency_save(float("nan"), expected_save_seconds=1.0)


def test_with_a_known_grace_period_a_save_that_fits_is_made_however_recent_the_last_commit(
    previous_handlers: Recorder,
) -> None:
    with PreemptionHandler(grace_period=120) as handler:
        signal.raise_signal(signal.SIGTERM)
        assert handler.agreed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not handler.should_skip_emergency_save(
                0.5, expected_save_seconds=30.0, steps_since_last_commit=1)


def test_nothing_new_since_the_last_commit_is_skipped() -> None:
    handler = PreemptionHandler(grace_period=60)
    handler.request()
    assert handler.agreed(10)
    with pytest.warns(EmergencySaveSkippedWarning, match="already holds this step"):
        assert handler.should_skip_emergency_save(
            5.0, expected_save_seconds=1.0, steps_since_last_commit=0)


def test_a_skipped_emergency_save_names_every_input_of_the_decision(
    previous_handlers: Recorder, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "resumekit")  # the warning's DEBUG record, for traces
    with PreemptionHandler(grace_period=30) as handler:
        signal.raise_signal(signal.SIGTERM)
        assert handler.agreed(7)
        expected = (r"at step 7: .* grace period .*\[inputs on rank 0: last commit captured "
                    r"12.00 s ago, 3 step\(s\) since it, expected save 35.00 s, grace period "
                    r"30 s, \d+\.\d s left\]")
        with pytest.warns(EmergencySaveSkippedWarning, match=expected):
            assert handler.should_skip_emergency_save(
                12.0, expected_save_seconds=35.0, steps_since_last_commit=3)
    assert "skipping the emergency save at step 7" in caplog.text
    assert "expected save 35.00 s" in caplog.text


def test_the_preempted_exit_code_is_a_retryable_failure_not_success_or_a_signal_death() -> None:
    assert EXIT_CODE_PREEMPTED == os.EX_TEMPFAIL
    assert EXIT_CODE_PREEMPTED not in (0, 128 + signal.SIGTERM, 128 + signal.SIGKILL)


def _fake_scontrol(directory: Path, body: str) -> str:
    script = directory / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_requeue_runs_scontrol_requeue_with_the_job_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    scontrol = _fake_scontrol(tmp_path, f'echo "$@" >> {calls}')
    monkeypatch.setenv("SLURM_JOB_ID", "111859")
    assert requeue_slurm_job(scontrol=scontrol)
    assert requeue_slurm_job(job_id="111882_3", scontrol=scontrol)
    assert calls.read_text().splitlines() == ["requeue 111859", "requeue 111882_3"]


def test_requeue_outside_slurm_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not requeue_slurm_job(scontrol=_fake_scontrol(tmp_path, f"touch {calls}"))
    assert not calls.exists()


def test_a_refused_requeue_is_an_error_with_scontrols_message(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(
        tmp_path, 'echo "Requested operation is presently disabled for job $2" >&2; exit 1'
    )
    with pytest.raises(PreemptionError, match="exit status 1: Requested operation") as caught:
        requeue_slurm_job(job_id="111859", scontrol=scontrol)
    assert caught.value.returncode == 1 and caught.value.command[-1] == "111859"


def test_a_missing_scontrol_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-scontrol")
    with pytest.raises(PreemptionError, match="no-such-scontrol' was not found"):
        requeue_slurm_job(job_id="1", scontrol=missing)


def test_a_hanging_scontrol_is_an_error_after_the_timeout(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path, "exec sleep 30")
    with pytest.raises(PreemptionError, match=r"did not finish in 0\.5 s"):
        requeue_slurm_job(job_id="1", scontrol=scontrol, timeout=0.5)


def test_after_shutdown_only_the_launchers_rank_zero_requeues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    scontrol = _fake_scontrol(tmp_path, f'echo "$@" >> {calls}')
    monkeypatch.setenv("SLURM_JOB_ID", "111882")
    for variable, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(variable, value)
    assert not requeue_slurm_job(scontrol=scontrol)  # no process group any more: rank 1
    assert not calls.exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert requeue_slurm_job(scontrol=scontrol)
    assert calls.read_text().split() == ["requeue", "111882"]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_the_job_is_requeued_after_the_time_limit_warning_and_left_to_slurm_after_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handlers: Recorder,
    sig: signal.Signals,
) -> None:
    calls = tmp_path / "calls"
    scontrol = _fake_scontrol(tmp_path, f'echo "$@" >> {calls}')
    monkeypatch.setenv("SLURM_JOB_ID", "111859")
    with PreemptionHandler() as handler:
        os.kill(os.getpid(), sig)
        assert handler.requested
        requeued = requeue_after_signal(handler, scontrol=scontrol)
    assert requeued is (sig == signal.SIGUSR1)
    assert calls.exists() is (sig == signal.SIGUSR1)
    if requeued:
        assert calls.read_text().split() == ["requeue", "111859"]


def test_no_signal_no_requeue_and_the_signals_that_requeue_can_be_chosen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handlers: Recorder,
) -> None:
    calls = tmp_path / "calls"
    scontrol = _fake_scontrol(tmp_path, f'echo "$@" >> {calls}')
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with PreemptionHandler() as handler:
        assert not requeue_after_signal(handler, scontrol=scontrol)  # nothing received
        handler.request()  # from code: no signal at all
        assert not requeue_after_signal(handler, scontrol=scontrol)
        os.kill(os.getpid(), signal.SIGTERM)
        assert requeue_after_signal(handler, signals=("TERM",), scontrol=scontrol)
    assert calls.read_text().split() == ["requeue", "7"]


def test_a_refused_requeue_after_sigusr1_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handlers: Recorder,
) -> None:
    scontrol = _fake_scontrol(tmp_path, 'echo "Job is not requeueable" >&2; exit 1')
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    with PreemptionHandler() as handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(PreemptionError, match="not requeueable"):
            requeue_after_signal(handler, scontrol=scontrol)


def test_the_commit_clock_counts_training_time_from_the_capture_or_from_the_step_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    clock = CommitClock()
    assert clock.training_seconds_since_commit(5, None) is None  # nothing committed
    assert clock.training_seconds_since_commit(5, 3) is None  # restored, no step timed
    clock.step_returned(3)
    now[0] = 102.0
    clock.step_started(4)  # one step of 2 s
    clock.step_returned(4)
    assert clock.training_seconds_since_commit(5, 3) == pytest.approx(4.0)  # 2 steps x 2 s
    now[0] = 110.0
    clock.step_started(6)  # not the next step: a gap is not a step time
    assert clock.training_seconds_since_commit(5, 3) == pytest.approx(4.0)
    clock.captured(6, 111.0)
    now[0] = 113.5
    assert clock.training_seconds_since_commit(6, 6) == pytest.approx(2.5)
    clock.last_save_seconds = 7.0
    assert clock.expected_save_seconds() == 7.0  # no blocking save measured yet
    clock.blocking_save_took(3.0)
    assert clock.expected_save_seconds() == 3.0
