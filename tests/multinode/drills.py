"""What the multi-node drills share: the job's settings, submitting it, reading its runs.

Every drill submits ``examples/lingbot/train_lingbot.sbatch`` once (``--nodes=2``; drill 3
resizes the pending requeued job to 1 node and back, ``NamespaceCluster.resize_pending``), one
torchrun per node, ``NPROC=1`` rank per node: world size 2, the same
global batch as the 2-rank single-host reference), interrupts it, and compares the
finished run with the reference.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from examples.lingbot.train import METRICS_FILE, read_metrics
from tests.multinode.cluster import NamespaceCluster
from tests.slurm.job_processes import (
    find_worker,
    frozen,
    wait_for_signal_arrival,
    wait_while_job_runs,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SBATCH = REPO_ROOT / "examples" / "lingbot" / "train_lingbot.sbatch"
TRAINER = "examples.lingbot.train"

NUM_STEPS = 12
SAVE_INTERVAL = 4
#: Training-collective timeout of the drills' trainer (``--timeout``): a silent partition
#: in a training step is detected after this long.
TRAIN_TIMEOUT_S = 10
#: Checkpoint-coordination timeout (``--checkpoint-timeout``): bounds save, restore and the
#: meeting after a restore (load skew up to this long is absorbed).
CKPT_TIMEOUT_S = 40
#: SIGTERM -> SIGKILL on preemption (slurm.conf ``KillWait``) and torchrun's grace.
KILL_WAIT_S = 30
GRACE_S = 20
#: slurm.conf ``SlurmdTimeout``: a host silent this long is DOWN, its job NODE_FAIL-requeued.
SLURMD_TIMEOUT_S = 20
#: Deadline of any single wait (the 2-core machine is shared; most waits take seconds).
WAIT_S = 180.0

#: The ranks vote at every step, so a signal that reached the frozen rank 0 is acted on at
#: the next step (with ``poll_every="auto"`` a vote may come up to 1 s of training later,
#: and this tiny run can finish before that).
TRAIN_ARGS = ("--num-steps", str(NUM_STEPS), "--save-interval", str(SAVE_INTERVAL),
              "--keep-last", "0", "--no-progress", "--poll-every", "1")

_HEADER = re.compile(r"^\[batch\] job (\d+) restart (\d+) on (\S+) at \S+ config \S+ (\d+) "
                     r"node\(s\) \[([^\]]*\]?)\]", re.MULTILINE)
_COMMITTED = re.compile(r"resumekit: committed step (\d+) in")
_RESUMED = re.compile(r"lingbot\.train: resumed at step (\d+).*?\(epoch (\d+), (\d+) samples "
                      r"consumed\)")
_PREEMPTED = re.compile(r"preempted at step (\d+) \(")
_EXITED = re.compile(r"\[batch\] trainer exited with status (\d+)")


@dataclass
class Run:
    """One start of the batch script, as the job's appended output tells it."""

    restart: int
    batch_host: str
    nodes: int
    nodelist: str
    resumed_from: int | None
    resumed_epoch: int | None
    resumed_consumed: int | None
    committed: list[int]
    preempted_at: int | None
    exit_status: int | None
    text: str = field(repr=False, default="")


def runs_of(output: str) -> list[Run]:
    """Split the job's output into runs, one per ``[batch] job J restart R`` header."""
    headers = list(_HEADER.finditer(output))
    runs = []
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(output)
        text = output[header.start():end]
        resumed = _RESUMED.search(text)
        preempted = _PREEMPTED.search(text)
        exited = _EXITED.search(text)
        runs.append(Run(
            restart=int(header.group(2)), batch_host=header.group(3),
            nodes=int(header.group(4)), nodelist=header.group(5),
            resumed_from=int(resumed.group(1)) if resumed else None,
            resumed_epoch=int(resumed.group(2)) if resumed else None,
            resumed_consumed=int(resumed.group(3)) if resumed else None,
            committed=[int(s) for s in _COMMITTED.findall(text)],
            preempted_at=int(preempted.group(1)) if preempted else None,
            exit_status=int(exited.group(1)) if exited else None,
            text=text,
        ))
    return runs


def submit(cluster: NamespaceCluster, root: Path, output: Path, *, nodes: str = "2",
           env: Mapping[str, str] | None = None) -> int:
    """Submit the LingBot sbatch script (tiny config, 1 rank per node) to ``extra``.

    Without ``env`` saying otherwise the job runs as before issue 30: no local tier
    (``LOCAL_EVERY=0``) and no in-job restart (``MAX_RESTARTS=0``: a failed rank ends the
    job, which SLURM or the test requeues); the local-tier drills turn both on.
    """
    settings = {
        "CONFIG": "tiny", "NPROC": "1", "SAVE_ROOT": str(root),
        "NUM_STEPS": str(NUM_STEPS), "SAVE_INTERVAL": str(SAVE_INTERVAL), "KEEP_LAST": "0",
        "GRACE_S": str(GRACE_S), "TIMEOUT_S": str(TRAIN_TIMEOUT_S),
        "CKPT_TIMEOUT_S": str(CKPT_TIMEOUT_S),
        "TRAIN_ARGS": "--no-progress --poll-every 1",
        "PYTHON": sys.executable, "REPO_DIR": str(REPO_ROOT), "PYTHONUNBUFFERED": "1",
        "LOCAL_EVERY": "0", "MAX_RESTARTS": "0",
        **(env or {}),
    }
    return cluster.submit_nodes(SBATCH, nodes=nodes, output=output, env=settings,
                                job_name="lingbot-mn", extra_args=["--gpus-per-node=0"])


def newest_step(root: Path) -> int:
    """The newest step in the run's ``metrics.jsonl`` (0 if none)."""
    return max((r["step"] for r in read_metrics(root / METRICS_FILE)), default=0)


def wait_for_step(cluster: NamespaceCluster, job_id: int, root: Path, step: int) -> None:
    """Wait until ``metrics.jsonl`` holds ``step`` (fails at once if the job ends)."""
    wait_while_job_runs(cluster, job_id, lambda: newest_step(root) >= step,
                        what=f"step {step} in {root / METRICS_FILE}", timeout=WAIT_S,
                        poll_s=0.02)


def wait_for_output(cluster: NamespaceCluster, output: Path, pattern: str, *, after: int,
                    timeout: float = WAIT_S) -> tuple[re.Match[str], float]:
    """Wait until regex ``pattern`` matches in ``output`` beyond offset ``after``.

    Returns:
        The match (offsets relative to the whole file) and the seconds waited.
    """
    regex = re.compile(pattern)
    began = time.monotonic()
    while True:
        text = output.read_text(errors="replace") if output.exists() else ""
        match = regex.search(text, after)
        if match:
            return match, time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise AssertionError(f"{pattern!r} not in {output} within {timeout:.0f} s; "
                                 f"tail: {text[-3000:]}")
        time.sleep(0.01)


def wait_requeued(cluster: NamespaceCluster, job_id: int, restarts_before: int) -> dict[str, str]:
    """Wait until the job is PENDING again with ``Restarts > restarts_before``."""
    return cluster.wait_for(
        job_id,
        lambda s: int(s.get("Restarts", "0")) > restarts_before
        and s.get("JobState") == "PENDING",
        WAIT_S, f"requeued (Restarts > {restarts_before}, PENDING)",
    )


def wait_for_run_step(cluster: NamespaceCluster, job_id: int, root: Path, output: Path,
                      *, restarts: int, step: int) -> None:
    """Wait until run ``restarts`` (0 = the first) of the job has logged ``step``.

    A restarted run first restores and rewrites ``metrics.jsonl`` (dropping the steps after
    its resume point), so the step is awaited only once the run's "resumed at step" line
    (one per restart) is in the output.
    """
    if restarts:
        cluster.wait_for_output(job_id, _RESUMED.pattern, WAIT_S, min_count=restarts)
    wait_for_step(cluster, job_id, root, step)


def preempt_at(cluster: NamespaceCluster, job_id: int, root: Path, output: Path, *,
               restarts: int, step: int,
               before_release: Callable[[], None] | None = None) -> float:
    """Preempt the job once its run ``restarts`` logged ``step``; requeue and release it.

    A tiny step takes a fraction of the ~1 s a preemption needs to arrive, so rank 0 is
    frozen (SIGSTOP) right after ``step`` and continued once SLURM's signal reached it:
    the preemption lands at that step. Returns the seconds to requeue.
    """
    if restarts:
        cluster.wait_for_output(job_id, _RESUMED.pattern, WAIT_S, min_count=restarts)
    # Found before the step is awaited: scanning /proc takes long on a loaded machine, and
    # a tiny run would be steps further by then.
    rank0 = find_worker(cluster, job_id, rank=0, module=TRAINER, timeout=WAIT_S)
    wait_for_step(cluster, job_id, root, step)
    began = time.monotonic()
    with frozen(rank0):
        cluster.preempt()
        wait_for_signal_arrival(rank0, signal.SIGTERM, timeout=WAIT_S)
    wait_requeued(cluster, job_id, restarts)
    requeue_s = time.monotonic() - began
    if before_release is not None:
        before_release()
    cluster.wait_job_gone(job_id)
    cluster.release(job_id)
    return requeue_s
