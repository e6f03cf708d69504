"""overlap="auto": the vote blocks while it is cheap next to a step, and overlaps otherwise.

The votes run for real, on a one-rank gloo group handed to the handler; the steps are
made "long" or "short" by the handler's injected timer, not by sleeping: each reading of
the timer advances it by one tick (so a blocking vote measures one tick), and the test
advances it by the step's length between two ``agreed`` calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resumekit.errors import ConfigurationError
from resumekit.runtime.preemption import AUTO_POLL_BUDGET, PreemptionHandler

TICK_S = 0.001  # what the injected timer advances per reading: a blocking vote's time
LONG_STEP_S = 60.0  # AUTO_POLL_BUDGET x 60 s = 300 ms: a 1 ms vote is cheap
SHORT_STEP_S = 0.0  # a step of a few ticks: a 1 ms vote is most of it


class SteppedTimer:
    """A timer the test moves: one tick per reading, plus each step's length."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += TICK_S
        return self.now

    def step(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


def _handler(group: dist.ProcessGroup, **kwargs: object) -> tuple[PreemptionHandler,
                                                                   SteppedTimer]:
    handler = PreemptionHandler(group=group, poll_every=1, **kwargs)  # type: ignore[arg-type]
    timer = SteppedTimer()
    handler._timer = timer
    return handler, timer


def _run(handler: PreemptionHandler, timer: SteppedTimer, steps: range, step_s: float
         ) -> list[bool]:
    """``agreed`` at each step; the mode in force after each poll."""
    modes = []
    for step in steps:
        timer.step(step_s)
        assert not handler.agreed(step)
        modes.append(handler.overlapping)
    return modes


def test_the_default_overlap_is_auto_and_the_first_vote_blocks(
        one_rank_group: dist.ProcessGroup) -> None:
    handler, _ = _handler(one_rank_group)
    assert handler.overlap == "auto" and not handler.overlapping
    assert not handler.agreed(1)
    assert not handler.overlapping and handler._pending is None  # nothing left in flight
    assert not PreemptionHandler().overlapping and PreemptionHandler(overlap=True).overlapping


def test_with_long_steps_the_vote_stays_blocking_and_counts_a_request_at_the_next_poll(
        one_rank_group: dist.ProcessGroup) -> None:
    handler, timer = _handler(one_rank_group)
    assert _run(handler, timer, range(1, 11), LONG_STEP_S) == [False] * 10
    handler.request()
    timer.step(LONG_STEP_S)
    assert handler.agreed(11) and handler.agreed_step == 11  # no step lost to the vote


def test_with_short_steps_overlap_switches_on_after_the_first_polls(
        one_rank_group: dist.ProcessGroup) -> None:
    handler, timer = _handler(one_rank_group)
    # Poll 1 knows no step time yet; poll 2's blocking vote carries the wish to overlap
    # and every later poll is overlapped.
    assert _run(handler, timer, range(1, 11), SHORT_STEP_S) == [False] + [True] * 9
    assert handler._pending is not None  # a vote runs during the next step
    handler.request()
    timer.step(SHORT_STEP_S)
    assert not handler.agreed(11)  # the vote counted at 11 was cast at 10
    timer.step(SHORT_STEP_S)
    assert handler.agreed(12) and handler.agreed_step == 12


def test_steps_that_grow_long_switch_back_to_blocking_after_the_vote_in_flight_is_counted(
        one_rank_group: dist.ProcessGroup) -> None:
    handler, timer = _handler(one_rank_group)
    assert _run(handler, timer, range(1, 6), SHORT_STEP_S)[-1] is True
    # Step 6 is long: its poll counts the vote cast at 5 (overlap still wished) and starts
    # one that wishes to block; step 7's poll counts that one and blocks at once.
    assert _run(handler, timer, range(6, 7), LONG_STEP_S) == [True]
    handler.request()
    timer.step(LONG_STEP_S)
    assert handler.agreed(7) and handler.agreed_step == 7
    assert not handler.overlapping and handler._pending is None


def test_a_request_in_flight_when_the_mode_switches_is_counted_and_not_lost(
        one_rank_group: dist.ProcessGroup) -> None:
    handler, timer = _handler(one_rank_group)
    assert _run(handler, timer, range(1, 6), SHORT_STEP_S)[-1] is True
    handler.request()
    timer.step(LONG_STEP_S)
    assert not handler.agreed(6)  # cast at 6, overlapped: counted at 7
    timer.step(LONG_STEP_S)
    assert handler.agreed(7) and handler.agreed_step == 7


def test_overlap_true_overlaps_from_the_first_poll_and_false_never(
        one_rank_group: dist.ProcessGroup) -> None:
    always, timer = _handler(one_rank_group, overlap=True)
    assert _run(always, timer, range(1, 6), LONG_STEP_S) == [True] * 5
    always.request()
    assert not always.agreed(6)
    assert always.agreed(7)
    never, timer = _handler(one_rank_group, overlap=False)
    assert _run(never, timer, range(1, 6), SHORT_STEP_S) == [False] * 5
    never.request()
    assert never.agreed(6)


@pytest.mark.parametrize(
    ("overlap", "vote_s", "step_s", "wish"),
    [
        ("auto", None, None, False),  # nothing measured yet: block
        ("auto", 0.001, None, False),  # no step time yet
        ("auto", None, 0.01, False),  # no blocking vote yet
        ("auto", AUTO_POLL_BUDGET * 8.0, 8.0, False),  # exactly the budget: still cheap
        ("auto", AUTO_POLL_BUDGET * 8.0 * 1.01, 8.0, True),
        ("auto", 0.002, 8.0, False),  # a gloo vote next to an 8 s step
        ("auto", 0.0002, 0.01, True),  # the same vote next to a 10 ms step
        (True, None, None, True),
        (False, 1.0, 0.001, False),
    ],
)
def test_each_rank_wishes_to_overlap_only_a_vote_that_costs_more_than_the_budget(
        overlap: bool | str, vote_s: float | None, step_s: float | None, wish: bool) -> None:
    handler = PreemptionHandler(overlap=overlap)  # type: ignore[arg-type]
    handler._blocking_vote_seconds, handler._step_seconds = vote_s, step_s
    assert handler._wants_overlap() is wish
    # The wish travels negated in the ballot's last slot: MAX across ranks is their MIN.
    assert handler._ballot(3).tolist()[-1] == -int(wish)


@pytest.mark.parametrize("overlap", ["sometimes", 1, None])
def test_an_overlap_that_is_neither_a_bool_nor_auto_is_refused(overlap: object) -> None:
    with pytest.raises(ConfigurationError, match="overlap=") as caught:
        PreemptionHandler(overlap=overlap)  # type: ignore[arg-type]
    assert caught.value.name == "overlap"


@pytest.mark.parametrize(
    ("wanted", "caps", "interval"),
    [
        ([3, 9], [64, 64], 9),  # the largest budget wish: no rank's votes over budget
        ([3, 9], [64, 5], 5),  # ... but never past the smallest latency cap
        ([20, 2], [64, 4], 4),  # a rank with short-looking steps cannot stretch it
        ([1, 1], [1, 1], 1),
    ],
)
def test_auto_polling_adopts_the_largest_budget_wish_capped_by_the_smallest_latency_cap(
        wanted: list[int], caps: list[int], interval: int) -> None:
    handler = PreemptionHandler()
    ballots = []
    for wish, cap in zip(wanted, caps, strict=True):
        handler._proposed_interval = lambda wish=wish, cap=cap: (wish, cap)  # type: ignore[method-assign]
        ballots.append(handler._ballot(4))
    counted = torch.stack(ballots).max(dim=0).values  # what the all-reduce (MAX) gives
    handler._count(counted, 4, cast_at=0.0)
    assert handler.poll_interval == interval


@pytest.mark.parametrize(("overlap", "cap"), [(False, 20), (True, 10)])
def test_auto_polling_counts_a_signal_within_a_second_of_training_blocking_or_overlapped(
        overlap: bool, cap: int) -> None:
    # 50 ms steps: a blocking vote counts a signal at the next poll, so it may poll every
    # 20 steps; an overlapped one counts it a poll later, so it must poll every 10.
    handler = PreemptionHandler(overlap=overlap)
    handler._step_seconds = 0.05
    handler._vote_seconds = 0.0001
    handler._blocking_vote_seconds = 0.0001
    _wanted, proposed_cap = handler._proposed_interval()
    assert proposed_cap == cap
    assert proposed_cap * (2 if overlap else 1) * handler._step_seconds <= 1.0
