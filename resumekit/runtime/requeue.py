"""After a preemption: requeue the SLURM job, or leave it to the scheduler.

:func:`requeue_slurm_job` asks SLURM to requeue this job (one rank does it);
:func:`requeue_after_signal` does so only when the signal received calls for it
(:data:`REQUEUE_SIGNALS`: the time-limit warning, not the scheduler's own preemption,
which SLURM requeues by itself).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterable
from typing import Final

import torch.distributed as dist

from resumekit.errors import PreemptionError
from resumekit.runtime import distributed, launch
from resumekit.runtime.preemption import PreemptionHandler, as_signal

__all__ = ["REQUEUE_SIGNALS", "requeue_after_signal", "requeue_slurm_job"]

logger = logging.getLogger("resumekit.runtime.preemption")


def requeue_slurm_job(
    *, job_id: str | None = None, scontrol: str = "scontrol", timeout: float = 60.0
) -> bool:
    """Ask SLURM to requeue this job (``scontrol requeue <job id>``), from rank 0 only.

    Needed only where SLURM will not requeue by itself - above all the time-limit warning
    ``sbatch --signal=B:USR1@<seconds>``; a preemption under ``PreemptMode=REQUEUE`` is
    requeued by SLURM. Call it *after* the emergency save has committed: requeueing a
    running job ends it at once. The job must be requeue-able (``sbatch --requeue`` or
    ``JobRequeue=1``).

    Args:
        job_id: The job to requeue; default ``SLURM_JOB_ID``.
        scontrol: The ``scontrol`` executable.
        timeout: Seconds to wait for ``scontrol``.

    Returns:
        True if ``scontrol requeue`` ran and succeeded; False on ranks other than 0 and
        outside SLURM (no job id).

    Raises:
        PreemptionError: ``scontrol`` is missing, timed out, or refused (its exit status
            and message are in the error).
    """
    context = distributed.current_context()
    if context is not None:
        rank = context.rank
    elif dist.is_initialized():
        rank = dist.get_rank()
    else:
        # After shutdown() (or without init_distributed) the launcher's variables still
        # say which process this is: never let every rank requeue the job.
        rank = launch.detect_launch().rank
    if rank != 0:
        return False
    job = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID")
    if not job:
        logger.info("not requeueing: SLURM_JOB_ID is not set (not a SLURM job)")
        return False
    command = [scontrol, "requeue", job]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise PreemptionError(
            f"cannot requeue SLURM job {job}: {scontrol!r} was not found on PATH",
            command=command,
            returncode=None,
        ) from None
    except subprocess.TimeoutExpired:
        raise PreemptionError(
            f"cannot requeue SLURM job {job}: {' '.join(command)!r} did not finish in {timeout} s",
            command=command,
            returncode=None,
        ) from None
    if completed.returncode != 0:
        message = (completed.stderr or completed.stdout).strip()
        raise PreemptionError(
            f"{' '.join(command)!r} failed with exit status {completed.returncode}: {message}",
            command=command,
            returncode=completed.returncode,
            stderr=completed.stderr,
        )
    logger.warning("requeued SLURM job %s", job)
    return True


REQUEUE_SIGNALS: Final = (signal.SIGUSR1,)
"""Signals after which SLURM does not requeue a job by itself: SIGUSR1, the usual
``sbatch --signal=B:USR1@<seconds>`` time-limit warning. A SIGTERM preemption under
``PreemptMode=REQUEUE`` is requeued by SLURM."""


def requeue_after_signal(
    preemption: PreemptionHandler,
    *,
    signals: Iterable[signal.Signals | int | str] = REQUEUE_SIGNALS,
    job_id: str | None = None,
    scontrol: str = "scontrol",
    timeout: float = 60.0,
) -> bool:
    """Requeue the SLURM job only if this process received one of ``signals``.

    The exit policy of a preempted SLURM job: a preemption (SIGTERM) is requeued by SLURM
    itself, but the time-limit warning of ``sbatch --signal=B:USR1@<seconds>`` is not - the
    job would simply end at its time limit. Call it once the emergency save is committed,
    last, just before exiting with :data:`EXIT_CODE_PREEMPTED` (requeueing a running job
    ends it at once; :func:`resumekit.shutdown` first is fine)::

        if ckpt.step_end(step + 1):
            ckpt.close()
            requeue_after_signal(preemption)
            sys.exit(EXIT_CODE_PREEMPTED)

    Args:
        preemption: The handler whose received signals decide.
        signals: The signals that call for a requeue (default :data:`REQUEUE_SIGNALS`).
        job_id: The job to requeue; default ``SLURM_JOB_ID``.
        scontrol: The ``scontrol`` executable.
        timeout: Seconds to wait for ``scontrol``.

    Returns:
        True if the job was requeued; False when none of ``signals`` was received
        (logged), and as :func:`requeue_slurm_job` returns it (ranks other than 0, no
        SLURM job).

    Raises:
        PreemptionError: ``scontrol`` is missing, timed out, or refused.
    """
    wanted = {as_signal(value) for value in signals}
    received = [record.name for record in preemption.received]
    if not any(record.signum in wanted for record in preemption.received):
        logger.info("not requeueing: the signal(s) received (%s) are not among %s; the "
                    "scheduler requeues (or ends) the job", ", ".join(received) or "none",
                    ", ".join(sorted(s.name for s in wanted)))
        return False
    return requeue_slurm_job(job_id=job_id, scontrol=scontrol, timeout=timeout)
