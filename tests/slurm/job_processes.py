"""Reach into a running SLURM job's processes: find a torchrun worker, freeze it, watch signals.

A preemption test that wants SIGTERM to land at a precise moment (inside a save, right after
a restore) cannot rely on timing: ``sbatch`` of the preemptor to SIGTERM takes ~1 s, a tiny
training step a fraction of that. Instead the test freezes the rank-0 worker with SIGSTOP
at the moment it wants, preempts, waits until the kernel shows SIGTERM *pending* on the
frozen process (``/proc/<pid>/status``: ``ShdPnd``/``SigPnd``) - or until SLURM's own
SIGCONT, which precedes the SIGTERM of a preemption, has made it run again - and lets it
continue: the handler then runs exactly there. Nothing in the library or the trainer knows.

Every wait polls a real condition against a deadline; on failure the message says what was
last seen, and a job that ends meanwhile fails the wait at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.slurm.cluster import TERMINAL_STATES, SlurmCluster, SlurmClusterError, SlurmTimeoutError

__all__ = [
    "find_worker",
    "frozen",
    "pending_signals",
    "process_state",
    "wait_for_signal_arrival",
    "wait_while_job_runs",
]

#: Poll interval of the fast waits (a staging directory lives for well under a second).
FAST_POLL_S = 0.005
#: How often a fast wait also asks scontrol whether the job ended.
JOB_CHECK_S = 1.0


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z`` ...), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def pending_signals(pid: int) -> set[int]:
    """Signals pending on ``pid`` (process-wide ``ShdPnd`` and main thread ``SigPnd``)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return set()
    mask = 0
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("ShdPnd", "SigPnd"):
            mask |= int(value.strip(), 16)
    return {bit + 1 for bit in range(64) if mask >> bit & 1}


def wait_while_job_runs(
    slurm: SlurmCluster,
    job_id: int,
    condition: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    poll_s: float = FAST_POLL_S,
) -> None:
    """Poll ``condition`` every ``poll_s`` until true; fail fast if the job ends first.

    Raises:
        SlurmTimeoutError: Not within ``timeout`` seconds.
        SlurmClusterError: The job reached a terminal state first.
    """
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + JOB_CHECK_S
    while not condition():
        now = time.monotonic()
        if now >= next_check:
            next_check = now + JOB_CHECK_S
            state = slurm.job_state(job_id)
            if state.get("JobState") in TERMINAL_STATES and not condition():
                raise SlurmClusterError(
                    f"job {job_id} ended ({state.get('JobState')}) while waiting for {what}; "
                    f"{slurm.describe(job_id)}"
                )
        if now > deadline:
            raise SlurmTimeoutError(
                f"{what}: not within {timeout:.0f} s; {slurm.describe(job_id)}"
            )
        time.sleep(poll_s)


def _is_worker(pid: int, job_id: int, rank: int, module: str) -> bool:
    env = _environ(pid)
    if env.get("SLURM_JOB_ID") != str(job_id) or env.get("RANK") != str(rank):
        return False
    argv = _cmdline(pid)
    # torchrun starts each worker as `python -u -m <module> ...`; the agent's own command
    # line names torch.distributed.run and carries no RANK of its own.
    return module in argv and "torch.distributed.run" not in argv


def find_worker(
    slurm: SlurmCluster, job_id: int, *, rank: int = 0, module: str, timeout: float
) -> int:
    """The pid of the live torchrun worker of ``rank`` running ``-m module`` in ``job_id``.

    Workers are recognised by the job's ``SLURM_JOB_ID`` and torchrun's ``RANK`` in their
    environment and the module in their command line; zombies (empty environment) never
    match, so a previous run of a requeued job is not found.

    Raises:
        SlurmTimeoutError: No such process within ``timeout`` seconds.
        SlurmClusterError: The job ended first.
    """
    found: list[int] = []

    def look() -> bool:
        found[:] = [pid for pid in slurm.processes() if _is_worker(pid, job_id, rank, module)]
        return len(found) == 1

    wait_while_job_runs(slurm, job_id, look, what=f"rank {rank} worker of job {job_id}",
                        timeout=timeout, poll_s=0.05)
    return found[0]


@contextlib.contextmanager
def frozen(pid: int, *, timeout: float = 10.0) -> Iterator[int]:
    """SIGSTOP ``pid`` until the block ends (then SIGCONT, whatever happened inside).

    Yields once the kernel reports the process stopped (state ``T``), so the caller knows
    it executes nothing more; signals sent meanwhile stay pending and are handled after
    SIGCONT.

    Raises:
        SlurmTimeoutError: The process did not stop within ``timeout`` seconds.
        ProcessLookupError: The process is gone.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while (state := process_state(pid)) != "T":
            if state is None:
                raise ProcessLookupError(f"process {pid} exited before it stopped")
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(f"process {pid} not stopped after {timeout} s: {state}")
            time.sleep(FAST_POLL_S)
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_for_signal_arrival(pid: int, signum: int, *, timeout: float) -> tuple[str, float]:
    """Wait until ``signum`` reaches the stopped process ``pid``; say how, and how long it took.

    SLURM precedes the SIGTERM of a preemption (or cancel) with a SIGCONT to every process
    of the job, so a process frozen by :func:`frozen` may be continued by the scheduler a
    moment before the SIGTERM lands, instead of showing the SIGTERM pending while stopped.

    Returns:
        ``("pending", seconds)`` if ``signum`` was seen pending on the stopped process, or
        ``("continued", seconds)`` if something else (the scheduler's SIGCONT) made it run.

    Raises:
        SlurmTimeoutError: Neither within ``timeout`` seconds (message: what is pending).
        ProcessLookupError: The process is gone.
    """
    began = time.monotonic()
    while True:
        pending = pending_signals(pid)
        if signum in pending:
            return "pending", time.monotonic() - began
        state = process_state(pid)
        if state is None:
            raise ProcessLookupError(f"process {pid} exited while waiting for signal {signum}")
        if state != "T":
            return "continued", time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise SlurmTimeoutError(
                f"signal {signum} not pending on process {pid} after {timeout} s; "
                f"pending: {sorted(pending)}"
            )
        time.sleep(FAST_POLL_S)
