"""overlap="auto" on 2 gloo ranks: long steps stop at the signal's step, short steps overlap.

A step is made "long" by the handler's injected timer (its measurement input), never by
sleeping: the gloo vote itself runs for real. Any deadlock or desynchronised vote sequence
fails within the groups' 60 s timeout (and a vote at different steps raises at once).
"""

from __future__ import annotations

import itertools
import random
import signal

import pytest
import torch
import torch.distributed as dist

from resumekit.runtime.distributed import init_distributed, shutdown
from resumekit.runtime.preemption import PreemptionHandler
from tests.distributed_harness import run_ranks

SIGNALLED_RANK = 1
SIGNAL_AT_STEP = 12
GROUP_TIMEOUT_S = 60
MAX_STEPS = 2000


class SteppedTimer:
    """A clock only the test moves: one tick per reading, plus each step's length."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def _step(preemption: PreemptionHandler, rank: int, step: int, signal_rank: int,
          signal_step: int) -> bool:
    """One training step's end: the gradient all-reduce, maybe a signal, the vote."""
    dist.all_reduce(torch.ones(4))  # the step's gradient sync lines the ranks up
    if rank == signal_rank and step == signal_step:
        signal.raise_signal(signal.SIGUSR1)
    return preemption.agreed(step)


def _long_steps(rank: int, world_size: int, steps_s: tuple[float, float],
                poll_every: int | str) -> dict[str, object]:
    init_distributed(timeout=GROUP_TIMEOUT_S, checkpoint_timeout=GROUP_TIMEOUT_S)
    # Only the test moves the clock: a blocking vote measures 1 ms however long gloo takes
    # on a loaded machine (with the real clock, a vote stalled past 40 ms - 0.5 % of an
    # 8 s step - made the long-step rank wish to overlap too: a signal one step late).
    timer = SteppedTimer(tick_s=0.001)
    modes: list[bool] = []
    with PreemptionHandler(grace_period=25, poll_every=poll_every,  # type: ignore[arg-type]
                           ) as preemption:  # overlap="auto", the default
        preemption._timer = timer
        step = 0
        while step < MAX_STEPS:
            step += 1
            timer.now += steps_s[rank]  # the step's compute, as the handler measures it
            if _step(preemption, rank, step, SIGNALLED_RANK, SIGNAL_AT_STEP):
                break
            modes.append(preemption.overlapping)
    shutdown()
    return {"stop_step": step, "agreed_step": preemption.agreed_step, "modes": modes,
            "interval": preemption.poll_interval}


@pytest.mark.parametrize(("steps_s", "poll_every"), [((8.0, 8.0), "auto"), ((8.0, 0.0), 1)],
                         ids=["both-long", "one-long"])
def test_with_long_steps_a_signal_on_one_rank_stops_both_at_that_very_step(
        steps_s: tuple[float, float], poll_every: int | str) -> None:
    # (With one rank's steps short, poll_every=1: "auto" would adopt that rank's longer
    # interval, which is not what this test is about.)
    rank0, rank1 = run_ranks(_long_steps, world_size=2, args=(steps_s, poll_every),
                             init_group=False)
    # 8 s steps (the scale benchmark's): the vote blocks at every step, so the signal of
    # step 12 is counted at step 12's boundary, on both ranks - no step of the grace
    # window is spent waiting for an overlapped vote. A rank whose own steps look short
    # (it wishes to overlap) does not overrule one with long steps: the ranks adopt the
    # smallest wish.
    assert rank0["stop_step"] == rank1["stop_step"] == SIGNAL_AT_STEP
    assert rank0["agreed_step"] == rank1["agreed_step"] == SIGNAL_AT_STEP
    assert rank0["modes"] == rank1["modes"] == [False] * (SIGNAL_AT_STEP - 1)
    assert rank0["interval"] == rank1["interval"] == 1


def _short_steps(rank: int, world_size: int, signal_step: int) -> dict[str, object]:
    init_distributed(timeout=GROUP_TIMEOUT_S, checkpoint_timeout=GROUP_TIMEOUT_S)
    modes: list[bool] = []
    with PreemptionHandler(poll_every=1) as preemption:  # overlap="auto", real clock
        step = 0
        while step < MAX_STEPS:
            step += 1  # a step of no compute: the vote is most of it
            if _step(preemption, rank, step, SIGNALLED_RANK, signal_step):
                break
            modes.append(preemption.overlapping)
    shutdown()
    return {"stop_step": step, "modes": modes}


def test_with_short_steps_the_vote_overlaps_and_still_stops_both_ranks_at_one_step() -> None:
    signal_step = 40
    rank0, rank1 = run_ranks(_short_steps, world_size=2, args=(signal_step,),
                             init_group=False)
    modes = rank0["modes"]
    assert isinstance(modes, list)
    assert modes == rank1["modes"]  # one mode per poll, the same on both ranks
    assert modes[0] is False  # the first poll knows no timings: it blocks
    # The vote costs far more than 0.5 % of an empty step: overlap is on from the
    # second poll (a rank stalled for hundreds of ms could turn it off for a while).
    assert sum(modes) >= len(modes) // 2 and modes[1] is True
    assert rank0["stop_step"] == rank1["stop_step"]
    # Overlapped at the signal's step: one step later; blocking: that very step.
    expected = signal_step + 1 if modes[signal_step - 2] else signal_step
    assert rank0["stop_step"] == expected


def _random_switches(rank: int, world_size: int, seed: int, trials: int
                     ) -> list[dict[str, object]]:
    init_distributed(timeout=GROUP_TIMEOUT_S, checkpoint_timeout=GROUP_TIMEOUT_S)
    plan = random.Random(seed)  # the same plan on both ranks
    own = random.Random(seed * 1000 + rank)  # this rank's own step lengths
    results: list[dict[str, object]] = []
    for trial in range(trials):
        signal_rank, signal_step = plan.randrange(world_size), plan.randint(3, 30)
        poll_every: int | str = 1 if trial % 2 == 0 else "auto"
        timer = SteppedTimer(tick_s=0.001)  # a blocking vote measures 1 ms
        modes: list[bool] = []
        intervals: list[int] = []
        length, phase_left = 0.0, 0
        with PreemptionHandler(poll_every=poll_every) as preemption:  # type: ignore[arg-type]
            preemption._timer = timer
            step = 0
            while step < MAX_STEPS:
                step += 1
                if phase_left == 0:  # 3-8 steps of 0.5 s (blocking wished) or ~4 ms
                    length, phase_left = own.choice((0.5, 0.0)), own.randint(3, 8)
                phase_left -= 1
                timer.now += length
                if _step(preemption, rank, step, signal_rank, signal_step):
                    break
                modes.append(preemption.overlapping)
                intervals.append(preemption.poll_interval)
        results.append({"signal": (signal_rank, signal_step), "poll_every": poll_every,
                        "stop_step": step, "agreed_step": preemption.agreed_step,
                        "modes": modes, "intervals": intervals})
    shutdown()
    return results


def test_switching_modes_mid_run_never_deadlocks_nor_desynchronises_the_ranks() -> None:
    seed, trials = 2706, 14
    rank0, rank1 = run_ranks(_random_switches, world_size=2, args=(seed, trials),
                             init_group=False)
    polls = switches_on = switches_off = 0
    for zero, one in zip(rank0, rank1, strict=True):
        where = f"seed {seed}, trial {zero}"
        _, signal_step = zero["signal"]
        assert zero["stop_step"] == one["stop_step"] == zero["agreed_step"], where
        assert zero["modes"] == one["modes"], where  # the same mode at every step
        assert zero["intervals"] == one["intervals"], where
        modes, stop = zero["modes"], zero["stop_step"]
        if zero["poll_every"] == 1:
            polls += stop
            # Blocking at the signal's step: that step; overlapped: at most one later.
            expected = [signal_step] if not modes[signal_step - 2] else [signal_step,
                                                                          signal_step + 1]
            assert stop in expected, where
        else:
            assert signal_step <= stop <= signal_step + 2 * max(zero["intervals"]), where
        switches_on += sum(1 for a, b in itertools.pairwise(modes) if not a and b)
        switches_off += sum(1 for a, b in itertools.pairwise(modes) if a and not b)
    print(f"{polls} votes at every step, {switches_on} switches to overlap, "
          f"{switches_off} back to blocking")
    assert polls >= 30  # votes at every step, in the poll_every=1 trials alone
    assert switches_on >= 3 and switches_off >= 3  # the plan did switch, both ways
