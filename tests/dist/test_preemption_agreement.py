"""A signal that reaches one rank stops every rank at the same step (2 gloo ranks)."""

from __future__ import annotations

import os
import signal
import stat
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resumekit.runtime.distributed import init_distributed, shutdown
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.runtime.requeue import requeue_slurm_job
from tests.distributed_harness import run_ranks
from tests.limits import COLLECTIVE_HANG_S, HANG_S

HANDSHAKE_LIMIT_S = HANG_S  # a hang detector
SIGNALLED_RANK = 1
SIGNAL_AFTER_STEP = 5
GRACE_S = 600.0


def _publish(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    partial.rename(path)


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + HANDSHAKE_LIMIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"never saw {path}")
        time.sleep(0.01)
    return path.read_text()


def _train_until_agreed(
    rank: int, world_size: int, shared: str, poll_every: int, overlap: bool, scontrol: str
) -> dict[str, object]:
    init_distributed(timeout=COLLECTIVE_HANG_S)
    folder = Path(shared)
    with PreemptionHandler(
        poll_every=poll_every, overlap=overlap, grace_period=GRACE_S
    ) as preemption:
        _publish(folder / f"rank{rank}.pid", str(os.getpid()))
        deadline = time.monotonic() + HANDSHAKE_LIMIT_S
        step = 0
        while True:
            step += 1
            gradient = torch.ones(4)
            dist.all_reduce(gradient)  # the training collective of this step
            if rank == SIGNALLED_RANK and step == SIGNAL_AFTER_STEP:
                _publish(folder / "send-the-signal", str(step))
            if preemption.agreed(step):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no agreement by step {step}")
        seconds_left = preemption.seconds_left()
        # Only rank 1 expects a save too long for the grace period: the decision is still
        # shared, and rank 0's warning names rank 1 and its reason.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            skip = preemption.should_skip_emergency_save(
                3600.0, expected_save_seconds=GRACE_S if rank == SIGNALLED_RANK else 10.0
            )
    requeued = requeue_slurm_job(job_id="111606", scontrol=scontrol)
    shutdown()
    return {
        "stop_step": step,
        "agreed_step": preemption.agreed_step,
        "signals": [record.name for record in preemption.received],
        "requeued": requeued,
        "knows_the_deadline": seconds_left is not None and seconds_left <= GRACE_S,
        "skip": skip,
        "skip_warnings": [str(w.message) for w in caught],
    }


def _send_signal_to(folder: Path, rank: int, sig: signal.Signals) -> Callable[[], None]:
    def send() -> None:
        _wait_for(folder / "send-the-signal")
        os.kill(int(_wait_for(folder / f"rank{rank}.pid")), sig)

    return send


@pytest.mark.parametrize(
    ("poll_every", "overlap"), [(1, False), (3, True)], ids=["every-step", "overlapped-every-3"]
)
def test_a_signal_to_one_rank_stops_both_ranks_at_the_same_step(
    tmp_path: Path, poll_every: int, overlap: bool
) -> None:
    calls = tmp_path / "scontrol-calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    sender = threading.Thread(
        target=_send_signal_to(tmp_path, SIGNALLED_RANK, signal.SIGUSR1), daemon=True
    )
    sender.start()
    results = run_ranks(
        _train_until_agreed,
        world_size=2,
        args=(str(tmp_path), poll_every, overlap, str(scontrol)),
        init_group=False,
    )
    sender.join(timeout=HANDSHAKE_LIMIT_S)
    rank0, rank1 = results
    assert rank0["stop_step"] == rank1["stop_step"] == rank0["agreed_step"]
    assert isinstance(rank0["stop_step"], int)
    assert rank0["stop_step"] > SIGNAL_AFTER_STEP - 1
    assert rank0["stop_step"] % poll_every == 0
    assert (rank0["signals"], rank1["signals"]) == ([], ["SIGUSR1"])
    assert (rank0["requeued"], rank1["requeued"]) == (True, False)
    assert rank0["knows_the_deadline"] is rank1["knows_the_deadline"] is True
    assert rank0["skip"] is rank1["skip"] is True
    [rank0_warning] = rank0["skip_warnings"]
    assert "rank 1 chose to skip (no time left)" in rank0_warning
    assert "inputs on rank 0:" in rank0_warning
    assert calls.read_text().splitlines() == ["requeue 111606"]


def _time_votes(rank: int, world_size: int, steps: int, compute_s: float) -> dict[str, object]:
    init_distributed(timeout=COLLECTIVE_HANG_S)
    timings: dict[str, object] = {}
    for overlap in (False, True):
        samples: list[float] = []
        answers: set[bool] = set()
        with PreemptionHandler(poll_every=1, overlap=overlap) as preemption:
            for step in range(1, steps + 1):
                time.sleep(compute_s)  # the step's compute, in which an overlapped vote runs
                dist.all_reduce(torch.ones(4))  # the step's gradient sync lines the ranks up
                started = time.perf_counter()
                answers.add(preemption.agreed(step))
                samples.append(time.perf_counter() - started)
        timings["overlapped" if overlap else "blocking"] = {
            "median_us": statistics.median(samples) * 1e6,
            "p90_us": statistics.quantiles(samples, n=10)[-1] * 1e6,
            "answers": sorted(answers),
        }
    shutdown()
    return timings


def test_the_per_step_cost_of_the_vote_is_measured_for_both_modes(
    record_property: Callable[[str, object], None],
) -> None:
    steps, compute_s = 300, 0.002
    results = run_ranks(_time_votes, world_size=2, args=(steps, compute_s), init_group=False)
    for rank, timings in enumerate(results):
        for mode in ("blocking", "overlapped"):
            numbers = timings[mode]
            assert numbers["answers"] == [False]  # nobody was signalled: nobody stops
            share = numbers["median_us"] / 10_000 * 100
            line = (
                f"rank {rank} {mode}: median {numbers['median_us']:.0f} us, "
                f"p90 {numbers['p90_us']:.0f} us per agreed() = {share:.2f}% of a 10 ms step"
            )
            print(line)
            record_property(f"rank{rank}_{mode}_median_us", round(numbers["median_us"], 1))


REQUEST_AT_STEP = 60


def _auto_polling(rank: int, world_size: int, step_seconds: float) -> dict[str, object]:
    init_distributed(timeout=COLLECTIVE_HANG_S)
    intervals: list[tuple[int, int]] = []
    with PreemptionHandler() as preemption:  # poll_every="auto", the default
        step = 0
        while True:
            step += 1
            # Rank 1's steps are slower: the ranks' own proposals differ.
            time.sleep(step_seconds * (3 if rank == 1 else 1))
            dist.all_reduce(torch.ones(4))  # the step's gradient sync lines the ranks up
            if rank == 1 and step == REQUEST_AT_STEP:
                preemption.request()
            if preemption.agreed(step):
                break
            intervals.append((step, preemption.poll_interval))
            if step > 10 * REQUEST_AT_STEP:
                raise TimeoutError(f"rank {rank}: no agreement by step {step}")
    shutdown()
    return {"stop_step": step, "intervals": intervals}


def test_auto_polling_adopts_one_interval_on_every_rank_and_still_stops_them_together() -> None:
    rank0, rank1 = run_ranks(_auto_polling, world_size=2, args=(0.001,), init_group=False)
    # Every rank adopted the same interval at the same step: the votes stayed in lockstep.
    assert rank0["intervals"] == rank1["intervals"]
    adopted = [interval for _, interval in rank0["intervals"]]
    assert max(adopted) > 1  # millisecond steps: voting at every step would cost too much
    assert max(adopted) <= 64
    assert rank0["stop_step"] == rank1["stop_step"]
    # Counted at the first poll after the request, or the one after (overlapped votes:
    # overlap="auto" turns them on for millisecond steps).
    assert REQUEST_AT_STEP < rank0["stop_step"] <= REQUEST_AT_STEP + 2 * max(adopted)
