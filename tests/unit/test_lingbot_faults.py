"""The LingBot trainer's test-only hold for the preemption signal (examples/lingbot/faults.py)."""

from __future__ import annotations

import pytest

from examples.lingbot import faults


class _Handler:
    """A preemption flag that turns True after ``after`` looks (a signal on its way)."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.looks = 0

    def __call__(self) -> bool:
        self.looks += 1
        return self.looks > self.after


def test_without_the_variable_no_step_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.HOLD_FOR_SIGNAL_VARIABLE, raising=False)
    handler = _Handler(after=10**9)
    faults.hold_for_signal(3, handler)
    assert handler.looks == 0


def test_only_the_named_step_is_held_and_until_the_signal_is_received(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.HOLD_FOR_SIGNAL_VARIABLE, "3")
    other = _Handler(after=10**9)
    faults.hold_for_signal(2, other)
    assert other.looks == 0
    handler = _Handler(after=4)
    faults.hold_for_signal(3, handler)
    assert handler.looks == 5  # it looked until the flag was up, and no longer


def test_a_signal_that_never_comes_fails_the_held_rank_naming_the_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.HOLD_FOR_SIGNAL_VARIABLE, "3")
    monkeypatch.setattr(faults, "HOLD_TIMEOUT_S", 0.0)
    with pytest.raises(RuntimeError, match=r"no preemption signal .* of step 3"):
        faults.hold_for_signal(3, _Handler(after=10**9))
