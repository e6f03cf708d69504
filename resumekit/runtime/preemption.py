"""Notice preemption, and stop every rank at the same step to save.

The only module of resumekit that touches :mod:`signal`. A scheduler that preempts a job
first sends a signal (SLURM: ``SIGTERM``, or the ``--signal`` of your choice some seconds
ahead; Kubernetes: ``SIGTERM``), waits a grace period, then kills. In the incident this
library comes from the job was preempted five times a week and never knew.

:class:`PreemptionHandler` turns the signal into a flag - the handler does nothing else: no
I/O, no collectives, no exception - and :meth:`PreemptionHandler.agreed` turns one rank's
flag into a decision every rank takes *at the same step*: each ``poll_every`` steps the
ranks all-reduce (MAX) their flags on a gloo group, so a signal that reached a single rank
(a node being drained, a ``kill`` on one PID) stops them all at one step boundary, where an
emergency checkpoint can be saved.

Typical loop::

    with PreemptionHandler(grace_period=30) as preemption:
        for step in range(start, total):
            train_step()
            if preemption.agreed(step):
                if not preemption.should_skip_emergency_save(since_commit, save_seconds):
                    manager.save(step)
                    manager.wait()
                requeue_slurm_job()   # resumekit.runtime.requeue; only where SLURM will not
                sys.exit(EXIT_CODE_PREEMPTED)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Final, Literal

import torch
import torch.distributed as dist

from resumekit.errors import ConfigurationError, CoordinationError, PreemptionError
from resumekit.runtime import distributed
from resumekit.runtime.save_clock import SaveEstimate, smoothed
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "DEFAULT_SIGNALS",
    "EXIT_CODE_PREEMPTED",
    "SAVE_TIME_MARGIN",
    "EmergencySaveSkippedWarning",
    "IgnoreSignalsInWorkers",
    "PreemptionHandler",
    "SignalRecord",
    "as_signal",
    "protect_loader_workers",
]

logger = logging.getLogger(__name__)

EXIT_CODE_PREEMPTED: Final = 75
"""Exit status of a process that stopped because it was preempted (after its emergency save).

75 is ``EX_TEMPFAIL`` of ``sysexits.h``: "a temporary failure; try again later" - which is
exactly the state of a preempted run. Why not 0 and why not 143:

* **Not 0.** A zero exit tells every layer the training *finished*: torchrun's agent
  reports success, SLURM marks the job ``COMPLETED`` so ``--dependency=afterok`` chains
  start their evaluation job on an unfinished model, and a Kubernetes Job counts a
  completion.
* **Non-zero on purpose.** torchrun's agent restarts workers that exit non-zero (up to
  ``--max-restarts``); when only the workers were signalled (the node stays) that restart
  resumes from the emergency checkpoint just written - the right outcome. When the agent
  itself was signalled it is shutting down and restarts nothing. SLURM requeues a
  preempted job (``PreemptMode=REQUEUE``) whatever its exit status, and a cluster can
  requeue on this code by itself with ``RequeueExit=75`` in ``slurm.conf``.
* **Not 143 (128 + SIGTERM).** 143 means "killed by SIGTERM": it cannot be told apart from
  a process that died without saving. A distinct code lets a Kubernetes ``podFailurePolicy``
  rule (``onExitCodes: {operator: In, values: [75]}``, action ``Ignore``) keep preemptions
  from using up the Job's ``backoffLimit``, and lets a wrapper script tell "preempted, saved"
  from "crashed".
"""

DEFAULT_SIGNALS: Final = (signal.SIGTERM, signal.SIGUSR1)
"""SIGTERM (what SLURM, Kubernetes and torchrun's agent send) and SIGUSR1 (a common
``sbatch --signal=B:USR1@<seconds>`` choice for the time-limit warning)."""

SAVE_TIME_MARGIN: Final = 1.0
"""An emergency save is attempted whenever ``expected_save_seconds * SAVE_TIME_MARGIN`` fits
in the time left of the grace period (with an asynchronous save in flight: the seconds it
still needs plus the new save's, times this margin). It was 1.5; it is 1.0 because a save
that the kill cuts costs nothing the commit protocol does not already protect (its staging
area is never read; the newest committed step stays the newest), while a margin turned away
saves that would have fit - at a step as long as the grace window, most of them."""



AUTO_POLL_BUDGET: Final = 0.005
"""With ``poll_every="auto"`` the votes may cost at most this fraction of training time."""

AUTO_POLL_MAX_SECONDS: Final = 1.0
"""With ``poll_every="auto"`` a signal counts within this much training time: a blocking
vote polls at least this often, an overlapped one (counted a poll after it is cast) twice
as often."""

AUTO_POLL_MAX_STEPS: Final = 64
"""With ``poll_every="auto"`` at most this many steps pass between two votes."""

class EmergencySaveSkippedWarning(ResumekitWarning):
    """An emergency save was skipped (no time left, or the last commit is recent enough)."""


@dataclass(frozen=True)
class SignalRecord:
    """One signal the handler received.

    Attributes:
        signum: The signal number.
        received_at: ``time.monotonic()`` when it arrived.
    """

    signum: int
    received_at: float

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``"SIGTERM"``."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


def as_signal(value: signal.Signals | int | str) -> signal.Signals:
    """A signal given by name (``"SIGTERM"``, ``"usr1"``), number or ``signal.Signals``.

    Raises:
        ConfigurationError: Not a signal.
    """
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        try:
            return signal.Signals[name]
        except KeyError:
            raise ConfigurationError(
                f"signals: {value!r} is not a signal name (e.g. 'SIGTERM', 'USR1')",
                name="signals",
                value=value,
            ) from None
    try:
        return signal.Signals(value)
    except ValueError:
        raise ConfigurationError(
            f"signals: {value!r} is not a signal number", name="signals", value=value
        ) from None


class IgnoreSignalsInWorkers:
    """A ``DataLoader`` ``worker_init_fn``: ignore the preemption signals, then the user's.

    torch's DataLoader worker installs a SIGTERM handler of its own that ends the worker,
    and SIGUSR1 ends any process without a handler. A scheduler or torchrun's agent
    signals every process of the job (its process group, its cgroup), workers included:
    a dead worker makes the next ``next(loader)`` raise ``DataLoader worker (pid ...) is
    killed by signal`` before the ranks can agree on a step and save. The workers need not
    hear the signal: the main process decides, and ends them when it exits.

    Picklable (a loader with the ``spawn`` or ``forkserver`` start method pickles its
    ``worker_init_fn``) as long as ``then`` is.

    Args:
        signals: The signals the workers ignore (a handler's ``signals``).
        then: The loader's own ``worker_init_fn``, called after, with the worker id.
    """

    def __init__(self, signals: Iterable[signal.Signals | int | str],
                 then: Callable[[int], None] | None = None) -> None:
        self.signals: tuple[int, ...] = tuple(dict.fromkeys(
            int(as_signal(item)) for item in signals))
        self.then = then

    def __call__(self, worker_id: int) -> None:
        """In worker ``worker_id``: ignore the signals, then run the loader's own function."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)

    def __repr__(self) -> str:
        names = "/".join(signal.Signals(sig).name for sig in self.signals)
        return f"IgnoreSignalsInWorkers({names}, then={self.then!r})"


def protect_loader_workers(loader: Any,
                           signals: Iterable[signal.Signals | int | str] = DEFAULT_SIGNALS,
                           ) -> Any:
    """Make the worker processes ``loader`` starts from now on ignore ``signals``.

    Sets ``loader.worker_init_fn`` to an ``IgnoreSignalsInWorkers`` (picklable) that calls the
    loader's own ``worker_init_fn`` after (protecting a loader twice keeps one wrapper,
    with both calls' signals). Workers read it when they start - at ``iter(loader)``, once
    for ``persistent_workers=True`` - so call it before the first ``iter(loader)``.
    ``CheckpointManager(data=loader, preemption=...)`` does this for its loader; call it
    for the others (a validation loader, ``data=sampler``).

    Args:
        loader: A ``torch.utils.data.DataLoader`` (or any object with a
            ``worker_init_fn`` attribute: torchdata's ``StatefulDataLoader``).
        signals: What the workers ignore (default: :data:`DEFAULT_SIGNALS`; pass a
            handler's ``signals``).

    Returns:
        ``loader``.

    Raises:
        ConfigurationError: ``loader`` has no ``worker_init_fn``, or a signal is unknown.
    """
    if not hasattr(loader, "worker_init_fn"):
        raise ConfigurationError(
            f"{type(loader).__name__} has no worker_init_fn: pass the DataLoader whose "
            "worker processes must ignore the preemption signals", name="loader",
            value=type(loader).__name__)
    current = loader.worker_init_fn
    wanted = list(signals)
    if isinstance(current, IgnoreSignalsInWorkers):
        wanted = [*current.signals, *wanted]
        current = current.then
    loader.worker_init_fn = IgnoreSignalsInWorkers(wanted, current)
    return loader


class PreemptionHandler:
    """Record preemption signals, and let all ranks agree to stop at one step.

    Args:
        signals: The signals that mean "you are being preempted" (``signal.Signals``,
            numbers, or names such as ``"SIGUSR2"`` / ``"USR2"``). ``SIGKILL`` and
            ``SIGSTOP`` cannot be caught.
        group: The process group of the vote; default the preemption group of
            :func:`resumekit.init_distributed` (gloo, long timeout). Without
            that context but with a default process group, the default group is used.
        poll_every: ``"auto"`` (the default): vote at the first call, then as often as
            keeps the votes under :data:`AUTO_POLL_BUDGET` of the step time, often
            enough that a signal counts within :data:`AUTO_POLL_MAX_SECONDS` of training
            (an overlapped vote, counted a poll late, polls twice as often), and at least
            every :data:`AUTO_POLL_MAX_STEPS` steps. Each rank proposes an interval from
            its own timings; the vote carries the proposals and every rank adopts the
            largest, so all ranks keep voting at the same steps. An integer: vote every
            this many steps (``step % poll_every == 0``; 1 costs one tiny all-reduce per
            step).
        grace_period: Seconds between the first signal and the kill, when known (SLURM's
            ``GraceTime``/``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``,
            torchrun's ``--shutdown-timeout``). Enables
            :meth:`should_skip_emergency_save`'s deadline rule.
        overlap: ``"auto"`` (the default): vote blocking - a signal is counted at the
            first poll after it - while a blocking vote is cheap next to a step, and
            overlap the votes only while this rank's measured blocking vote time
            exceeds :data:`AUTO_POLL_BUDGET` times its measured step time, on every
            rank (the same timings ``poll_every="auto"`` uses). Each rank's wish travels
            in the ballot and every rank adopts the counted vote's answer at the same
            poll; before anything is measured (the first polls) the vote blocks.
            ``True``: always start each vote without waiting for it and count it at the
            next poll: the all-reduce runs during the next step, so a poll waits only
            for a reduction that already ran, and a signal costs one poll more.
            ``False``: always block; a signal is counted at the first poll after it.
            ``docs/preemption.md`` has both costs measured.

    Raises:
        ConfigurationError: A signal is unknown or uncatchable, ``poll_every`` is neither
            ``"auto"`` nor an integer >= 1, ``overlap`` is neither a bool nor ``"auto"``,
            or ``grace_period <= 0``.
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals | int | str] = DEFAULT_SIGNALS,
        *,
        group: dist.ProcessGroup | None = None,
        poll_every: int | Literal["auto"] = "auto",
        grace_period: float | None = None,
        overlap: bool | Literal["auto"] = "auto",
    ) -> None:
        self.signals: tuple[signal.Signals, ...] = tuple(
            dict.fromkeys(as_signal(item) for item in signals)
        )
        if not self.signals:
            raise ConfigurationError(
                "PreemptionHandler needs at least one signal", name="signals", value=()
            )
        for sig in self.signals:
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ConfigurationError(
                    f"signals: {sig.name} cannot be caught", name="signals", value=sig.name
                )
        if poll_every != "auto" and (isinstance(poll_every, bool)
                                     or not isinstance(poll_every, int) or poll_every < 1):
            raise ConfigurationError(
                f"poll_every={poll_every!r} must be 'auto' or an integer >= 1",
                name="poll_every",
                value=poll_every,
            )
        if overlap != "auto" and not isinstance(overlap, bool):
            raise ConfigurationError(
                f"overlap={overlap!r} must be True, False or 'auto'",
                name="overlap",
                value=overlap,
            )
        if grace_period is not None and not grace_period > 0:
            raise ConfigurationError(
                f"grace_period={grace_period!r} must be a positive number of seconds or None",
                name="grace_period",
                value=grace_period,
            )
        self.poll_every = poll_every
        self.grace_period = None if grace_period is None else float(grace_period)
        self.overlap: bool | Literal["auto"] = overlap
        # overlap="auto": the mode every rank adopted from the last counted ballot
        # (blocking until a ballot says otherwise).
        self._auto_overlapping = False
        self._group = group
        self._received: list[SignalRecord] = []
        self._requested_by_code = False
        self._previous: dict[signal.Signals, Any] = {}
        self._installed = False
        self._agreed_step: int | None = None
        self._agreed_at: float | None = None
        self._signal_age_at_agreement = 0.0
        self._pending: tuple[Any, torch.Tensor, int, float] | None = None
        # poll_every="auto": the interval every rank adopted at the last counted vote,
        # the step of the next vote, and this rank's running step and vote times.
        self._interval = 1
        self._next_poll: int | None = None
        self._last_call: float | None = None
        self._step_seconds: float | None = None
        self._vote_seconds: float | None = None
        # overlap="auto": this rank's running time of a *blocking* vote (an overlapped
        # poll costs less; its time would flip the choice back at every other poll).
        self._blocking_vote_seconds: float | None = None
        # The clock of these timings; a test injects one to make steps "long".
        self._timer: Callable[[], float] = time.perf_counter
        # Write ends of the pipes a signal (or request()) wakes (add_wakeup): a tuple,
        # replaced whole, so the handler reads it without a lock.
        self._wakeups: tuple[int, ...] = ()

    # -- installation ---------------------------------------------------------------------

    def install(self) -> PreemptionHandler:
        """Install the handler for every configured signal, remembering the previous ones.

        Returns:
            ``self``, so ``handler = PreemptionHandler().install()`` reads naturally.

        Raises:
            PreemptionError: Called from a thread other than the main thread (Python only
                delivers signals there), or the handler is already installed.
        """
        if threading.current_thread() is not threading.main_thread():
            raise PreemptionError(
                "PreemptionHandler.install() must run on the main thread "
                f"(called from {threading.current_thread().name!r})",
                thread=threading.current_thread().name,
            )
        if self._installed:
            raise PreemptionError(
                "PreemptionHandler is already installed",
                signals=[sig.name for sig in self.signals],
            )
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        self._installed = True
        logger.debug("preemption handler installed for %s", [s.name for s in self.signals])
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back and collect a vote still in flight.

        A previous handler that was not installed from Python (``signal.getsignal``
        returned None) is replaced by the default action. A signal whose handler someone
        else replaced after :meth:`install` is left alone. Safe to call twice.
        """
        self._drain()
        if not self._installed:
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self._installed = False

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread, possibly in the middle of a save:
        # record and return. No locks, no collectives, no exception; the one system call
        # is a byte into each wakeup pipe (non-blocking), for the emergency capture.
        self._received.append(SignalRecord(signum, time.monotonic()))
        self._wake()

    def _wake(self) -> None:
        for fd in self._wakeups:
            # full (a byte is already waiting) or closed: nothing to do
            with contextlib.suppress(OSError):
                os.write(fd, b"\0")

    def add_wakeup(self, fd: int) -> None:
        """Write a byte to ``fd`` (a non-blocking pipe's write end) at every signal.

        Also at :meth:`request`, and at once when this rank already recorded one. How a
        thread (the manager's emergency capture) learns of a signal the moment it is
        recorded, without polling. The caller owns ``fd``; remove it with
        :meth:`remove_wakeup` before closing it.
        """
        self._wakeups = (*self._wakeups, fd)
        if self.requested:
            self._wake()

    def remove_wakeup(self, fd: int) -> None:
        """Stop writing to ``fd`` (see :meth:`add_wakeup`)."""
        self._wakeups = tuple(item for item in self._wakeups if item != fd)

    # -- local state ----------------------------------------------------------------------

    @property
    def installed(self) -> bool:
        """Whether the handler is currently installed."""
        return self._installed

    @property
    def requested(self) -> bool:
        """Whether *this* rank received a preemption signal (or :meth:`request` was called)."""
        return self._requested_by_code or bool(self._received)

    @property
    def received(self) -> tuple[SignalRecord, ...]:
        """Every signal this rank received, oldest first (a second signal is just recorded)."""
        return tuple(self._received)

    @property
    def agreed_step(self) -> int | None:
        """The step at which the ranks agreed to stop, or None."""
        return self._agreed_step

    def protect_loader(self, loader: Any) -> Any:
        """Make ``loader``'s worker processes ignore this handler's signals.

        ``protect_loader_workers`` with :attr:`signals`; ``CheckpointManager`` calls it
        for its ``data=`` loader.

        Returns:
            ``loader``.
        """
        return protect_loader_workers(loader, self.signals)

    def request(self) -> None:
        """Ask for a stop from code (a stop file, a health check); it votes like a signal."""
        self._requested_by_code = True
        self._wake()

    def _signal_age(self) -> float:
        if not self._received:
            return 0.0
        return max(0.0, time.monotonic() - self._received[0].received_at)

    def seconds_left(self) -> float | None:
        """Seconds left of the grace period, counted from the oldest signal on any rank.

        Known once the ranks agreed (the vote carries the age of the oldest signal) or, on
        the rank that was signalled, as soon as the signal arrived.

        Returns:
            The estimate (may be negative), or None without ``grace_period`` or a signal.
        """
        if self.grace_period is None:
            return None
        if self._agreed_at is not None:
            elapsed = self._signal_age_at_agreement + (time.monotonic() - self._agreed_at)
        elif self._received:
            elapsed = self._signal_age()
        else:
            return None
        return self.grace_period - elapsed

    # -- agreement ------------------------------------------------------------------------

    def _vote_group(self) -> dist.ProcessGroup | None:
        if self._group is not None:
            return self._group
        group = distributed.preemption_group()
        if group is not None:
            return group
        if dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def _ballot(self, step: int) -> torch.Tensor:
        age_ms = round(self._signal_age() * 1000)
        # The overlap wish is carried negated: MAX of -wish is -(MIN of wish), so the
        # ranks overlap only when every rank wants to (see _wants_overlap).
        wanted, cap = self._proposed_interval()
        return torch.tensor([int(self.requested), step, -step, age_ms,
                             wanted, -cap, -int(self._wants_overlap())],
                            dtype=torch.int64)

    def _count(self, ballot: torch.Tensor, step: int, cast_at: float) -> bool:
        flag, high, negated_low, age_ms, wanted, negated_cap, negated_overlap = (
            int(value) for value in ballot.tolist())
        if high != -negated_low:
            raise PreemptionError(
                f"ranks voted on preemption at different steps ({-negated_low}..{high}, this "
                f"rank at {step}): every rank must call agreed() with the same steps",
                step=step,
            )
        # The largest cost wish (no rank's votes over budget), capped by the smallest
        # latency cap (no rank waits longer than AUTO_POLL_MAX_SECONDS for a signal to
        # count): the same on every rank.
        self._interval = max(1, min(wanted, -negated_cap))
        if self.overlap == "auto":
            # The smallest wish (every rank wants overlap, or no rank gets it): the same
            # on every rank, and it takes effect from the next vote on.
            overlapping = negated_overlap == -1
            if overlapping != self._auto_overlapping:
                logger.debug("preemption vote at step %d: %s from now on", step,
                             "overlapped" if overlapping else "blocking")
            self._auto_overlapping = overlapping
        if flag:
            self._agreed_step = step
            self._agreed_at = time.monotonic()
            # The ballot carried the oldest signal's age when it was cast (a poll ago, if
            # overlapped); add the time since.
            self._signal_age_at_agreement = age_ms / 1000 + (self._agreed_at - cast_at)
            logger.warning(
                "preemption agreed at step %d (signals on this rank: %s)",
                step, [record.name for record in self._received] or "none",
            )
        return bool(flag)

    def agreed(self, step: int) -> bool:
        """Whether all ranks have agreed to stop; call at every step boundary on every rank.

        Every ``poll_every`` steps the ranks all-reduce (MAX) their flags, so they all see
        the same answer at the same step. A blocking vote counts the flags of this poll: a
        signal stops the ranks at the first poll after it. An overlapped vote (see
        ``overlap``; :attr:`overlapping` tells which mode is in force) counts the vote
        cast at the previous poll and starts a new one, so a signal stops them one poll
        later; leave the ``with`` block (or call :meth:`uninstall`) before
        :func:`resumekit.shutdown` so a vote in flight is collected. With
        ``overlap="auto"`` the mode changes only at a poll, after the vote in flight was
        counted, and the same way on every rank. Once True it stays True, without
        further collectives. With one process there is no collective and the local flag
        is checked at every call.

        Args:
            step: The step just finished; the same sequence on every rank.

        Returns:
            True from the step at which any rank's request was counted onwards.

        Raises:
            PreemptionError: Ranks called it with different steps.
            CoordinationError: The vote's all-reduce failed (a rank died or timed out).
        """
        if self._agreed_step is not None:
            return True
        group = self._vote_group()
        if group is None:
            if self.requested:
                self._agreed_step = step
                self._agreed_at = time.monotonic()
                self._signal_age_at_agreement = self._signal_age()
                return True
            return False
        now = self._timer()
        if self._last_call is not None:
            self._step_seconds = smoothed(self._step_seconds, now - self._last_call)
        self._last_call = now
        if not self._polls_at(step):
            return False
        try:
            agreed = self._vote(step, group)
        except PreemptionError:
            raise
        except RuntimeError as error:
            raise _collective_failed(f"preemption vote at step {step}", "preemption vote",
                                     error, step=step) from error
        self._vote_seconds = smoothed(self._vote_seconds, self._timer() - now)
        self._next_poll = step + self._interval
        return agreed

    @property
    def poll_interval(self) -> int:
        """Steps between two votes: ``poll_every``, or the interval ``"auto"`` adopted."""
        return self._interval if self.poll_every == "auto" else int(self.poll_every)

    def _polls_at(self, step: int) -> bool:
        if self.poll_every == "auto":
            return self._next_poll is None or step >= self._next_poll
        return step % self.poll_every == 0

    def _proposed_interval(self) -> tuple[int, int]:
        """This rank's wishes for ``poll_every="auto"``: (votes within budget, latency cap).

        The ranks take the largest first wish and the smallest cap, so a rank whose
        steps look short cannot stretch the interval past another rank's latency cap.
        """
        if self.poll_every != "auto" or not self._step_seconds or self._vote_seconds is None:
            return 1, 1
        wanted = math.ceil(self._vote_seconds / (AUTO_POLL_BUDGET * self._step_seconds))
        # A signal just after a poll is counted at the next poll when the vote blocks, and
        # a poll later when it is overlapped (cast at the next, counted at the one after):
        # either way within AUTO_POLL_MAX_SECONDS of training.
        polls_to_count = 2 if self._wants_overlap() else 1
        cap = min(AUTO_POLL_MAX_STEPS,
                  int(AUTO_POLL_MAX_SECONDS / (polls_to_count * self._step_seconds)))
        return max(1, wanted), max(1, cap)

    @property
    def overlapping(self) -> bool:
        """Whether the next vote is overlapped: ``overlap``, or what ``"auto"`` adopted.

        With ``overlap="auto"`` every rank adopts the same answer from the vote it
        counted, so this is the same on every rank after every poll.
        """
        if self.overlap == "auto":
            return self._auto_overlapping
        return bool(self.overlap)

    def _wants_overlap(self) -> bool:
        """This rank's wish for ``overlap="auto"``: overlap only a vote that is costly.

        True when the measured blocking vote takes more than :data:`AUTO_POLL_BUDGET` of
        the measured step: at every step the vote would cost more than the budget, and
        an overlapped vote costs a fraction of a blocking one. Otherwise (and before both
        are measured) False: a blocking vote counts a signal one poll sooner, which for
        long steps is a step of the grace period.
        """
        if self.overlap != "auto":
            return bool(self.overlap)
        if not self._step_seconds or self._blocking_vote_seconds is None:
            return False
        return self._blocking_vote_seconds > AUTO_POLL_BUDGET * self._step_seconds

    def _vote(self, step: int, group: dist.ProcessGroup) -> bool:
        # A vote still in flight is counted first: every rank counts the same (completed)
        # vote at the same step, and adopts the mode it carries for the rest of the poll.
        if self._pending is not None:
            work, ballot, _, cast_at = self._pending
            self._pending = None
            work.wait()
            if self._count(ballot, step, cast_at):
                return True
        if self.overlapping:
            # Start the next vote; it is counted at the next poll.
            cast_at, ballot = time.monotonic(), self._ballot(step)
            work = dist.all_reduce(ballot, op=dist.ReduceOp.MAX, group=group, async_op=True)
            self._pending = (work, ballot, step, cast_at)
            return False
        started = self._timer()
        cast_at, ballot = time.monotonic(), self._ballot(step)
        dist.all_reduce(ballot, op=dist.ReduceOp.MAX, group=group)
        self._blocking_vote_seconds = smoothed(self._blocking_vote_seconds,
                                               self._timer() - started)
        return self._count(ballot, step, cast_at)

    def _drain(self) -> None:
        if self._pending is None:
            return
        work, _, step, _ = self._pending
        self._pending = None
        try:
            work.wait()
        except RuntimeError as error:
            raise _collective_failed(f"the preemption vote started at step {step}",
                                     "preemption vote", error, step=step) from error

    # -- deadline -------------------------------------------------------------------------

    def should_skip_emergency_save(
        self,
        seconds_since_last_commit: float | None,
        expected_save_seconds: float,
        *,
        steps_since_last_commit: int | None = None,
        estimate: SaveEstimate | None = None,
        newest_step: int | None = None,
    ) -> bool:
        """Whether to skip the emergency save; call on every rank, after :meth:`agreed`.

        Skip (with an :class:`EmergencySaveSkippedWarning` and a ``logger.warning`` that
        name every input of the decision) when, on any rank:

        * **nothing new:** ``steps_since_last_commit == 0`` - the newest commit already
          holds this step;
        * **no time:** ``grace_period`` is known and the save's expected seconds (plus
          those an asynchronous save in flight still needs, from ``estimate``) times
          :data:`SAVE_TIME_MARGIN` exceed :meth:`seconds_left` - the save would likely
          be cut by the kill: it is never started (the commit protocol would keep the
          previous checkpoint, but the grace period is better spent exiting cleanly).
          The warning gives the numbers: bytes, measured rate, expected seconds,
          seconds left, and the step that stays newest; when the save in flight itself
          cannot finish in time, it says so too;
        * **recent enough, deadline unknown:** without ``grace_period``,
          ``0 <= seconds_since_last_commit <= expected_save_seconds`` - redoing the work
          since the last commit costs no more than saving it now, and a short save is
          the best bet against a kill that may come at any moment. With a known
          ``grace_period`` this rule does not apply: a save that fits the grace period
          costs the job nothing it could use (the node is being taken away), and every
          step it keeps is a step the requeued run need not redo.

        Measure ``seconds_since_last_commit`` with ``time.monotonic()`` in this process,
        from when the committed state was captured (for an asynchronous save: when
        ``save()`` returned, not when the commit finished). A negative or non-finite age
        (a wall-clock age across hosts whose clocks disagree) is never "recent": it is
        treated as unknown, with a warning. None (no commit, or an age this process cannot
        know) is never "recent" either.

        Ranks measure time differently, so with a process group the decision is
        all-reduced: if one rank says skip, all skip (and the warning names the ranks that
        chose to), and no rank waits in a save the others never start.

        Args:
            seconds_since_last_commit: Training seconds since the state of the newest
                committed checkpoint was captured, or None if there is none or it is
                unknown.
            expected_save_seconds: How long a blocking save takes (e.g. the last one's
                duration). The deadline rule takes ``estimate``'s seconds instead when it
                knows a rate; the recency rule always takes this.
            steps_since_last_commit: Steps done since the newest committed step, if
                known (only named in the warning, except 0: nothing new to save).
            estimate: The save's bytes and the root's measured write rate, and an
                asynchronous save still in flight (:meth:`CommitClock.estimate`).
            newest_step: The newest committed step (named in the warning as the step
                that stays newest when no save in flight will replace it).

        Returns:
            True to skip the save.

        Raises:
            CoordinationError: The all-reduce of the decision failed.
        """
        age = _sane_age(seconds_since_last_commit)
        # The deadline rule takes the save's time at the measured rate when there is one;
        # the recency rule (no deadline) keeps the duration of a save in this process.
        expected = expected_save_seconds
        if estimate is not None and estimate.seconds is not None:
            expected = estimate.seconds
        in_flight = 0.0
        if estimate is not None and estimate.in_flight_seconds is not None:
            in_flight = estimate.in_flight_seconds
        reasons: list[str] = []
        codes = 0
        if steps_since_last_commit == 0:
            codes |= _NOTHING_NEW
            reasons.append("the newest commit already holds this step")
        left = self.seconds_left()
        if left is not None and (in_flight + expected) * SAVE_TIME_MARGIN > left:
            codes |= _NO_TIME
            reasons.append(self._no_time(left, expected, in_flight, estimate, newest_step))
        if (self.grace_period is None and age is not None
                and age <= expected_save_seconds):
            codes |= _RECENT
            reasons.append(
                f"the last commit is {age:.1f} s old, no older than a save takes "
                f"({expected_save_seconds:.1f} s), and no grace period is known"
            )
        rank, skipping_ranks = self._agree_on_skip(codes, reasons)
        inputs = self._inputs(age, seconds_since_last_commit, expected,
                              steps_since_last_commit, left, estimate=estimate)
        if not skipping_ranks:
            logger.info("resumekit: making the emergency save%s (inputs on rank %d: %s)",
                        self._at_step(), rank, inputs)
            return False
        message = (f"skipping the emergency save{self._at_step()}: {'; '.join(reasons)} "
                   f"[inputs on rank {rank}: {inputs}]")
        logger.warning("resumekit: %s", message)
        warn(message, EmergencySaveSkippedWarning, stacklevel=2)
        return True

    def _agree_on_skip(self, codes: int, reasons: list[str]) -> tuple[int, list[int]]:
        """All-reduce every rank's skip codes; name the other ranks' in ``reasons``.

        Returns:
            This rank's rank in the vote group and the ranks that chose to skip.
        """
        group = self._vote_group()
        if group is None:
            return 0, [0] if codes else []
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        decision = torch.zeros(size, dtype=torch.int64)
        decision[rank] = codes
        try:
            dist.all_reduce(decision, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as error:
            raise _collective_failed("agreeing whether to skip the emergency save",
                                     "emergency save decision", error) from error
        chosen = decision.tolist()
        for other, other_codes in enumerate(chosen):
            if other_codes and other != rank:
                reasons.append(f"rank {other} chose to skip "
                               f"({_describe_codes(int(other_codes))})")
        return rank, [r for r, c in enumerate(chosen) if c]

    def _no_time(self, left: float, expected: float, in_flight: float,
                 estimate: SaveEstimate | None, newest_step: int | None) -> str:
        """The "no time" reason, with the numbers and the step that stays newest."""
        if estimate is None:
            return (f"{max(left, 0.0):.1f} s of the {self.grace_period:.0f} s grace period "
                    f"are left, a save needs about {expected:.1f} s x {SAVE_TIME_MARGIN}")
        window = f"{max(left, 0.0):.1f} s left of the {self.grace_period:g} s grace period"
        needed = (in_flight + expected) * SAVE_TIME_MARGIN
        said = (f"a save would write {estimate.describe()}; x {SAVE_TIME_MARGIN} margin "
                f"= {needed:.1f} s > {window}, so it is not started")
        newest = "no checkpoint" if newest_step is None else f"step {newest_step}"
        flying = estimate.in_flight_step
        if flying is None:
            return f"{said}; {newest} stays the newest checkpoint"
        if in_flight * SAVE_TIME_MARGIN > left:
            return (f"{said}; the in-flight save of step {flying} itself needs about "
                    f"{in_flight:.1f} s x {SAVE_TIME_MARGIN} and may not finish in time "
                    f"either: it is left to complete (nothing newer can be committed); "
                    f"step {flying} becomes the newest checkpoint if it commits before "
                    f"the kill, else {newest} stays the newest")
        return (f"{said}; the in-flight save of step {flying} is left to complete and "
                f"stays the newest checkpoint")

    def _at_step(self) -> str:
        return "" if self._agreed_step is None else f" at step {self._agreed_step}"

    def _inputs(self, age: float | None, given: float | None, expected: float,
                steps: int | None, left: float | None, *,
                estimate: SaveEstimate | None = None) -> str:
        if given is None:
            since = "age of the last commit unknown"
        elif age is None:
            since = f"age of the last commit {given:.1f} s (ignored)"
        else:
            since = f"last commit captured {age:.2f} s ago"
        parts = [since]
        if steps is not None:
            parts.append(f"{steps} step(s) since it")
        if estimate is not None:
            parts.append(f"the save writes {estimate.describe()}")
        parts.append(f"expected save {expected:.2f} s")
        parts.append("no grace period" if self.grace_period is None
                     else f"grace period {self.grace_period:g} s, "
                          f"{0.0 if left is None else left:.1f} s left")
        return ", ".join(parts)


_NOTHING_NEW, _NO_TIME, _RECENT = 1, 2, 4  # why a rank chose to skip, as bits of its ballot


def _sane_age(age: float | None) -> float | None:
    """``age``, or None (with a warning) when no age can be negative or non-finite."""
    if age is None or (math.isfinite(age) and age >= 0):
        return age
    message = (
        f"the age of the last commit is {age:.1f} s, which cannot be: an age taken "
        "from wall clocks of hosts that disagree (clock skew)? It is treated as "
        "unknown (never 'recent enough'); measure it with time.monotonic() in this "
        "process"
    )
    warn(message, ResumekitWarning, stacklevel=3)  # the caller of should_skip_...
    return None


def _describe_codes(codes: int) -> str:
    names = [name for bit, name in ((_NOTHING_NEW, "nothing new"), (_NO_TIME, "no time left"),
                                    (_RECENT, "last commit recent enough")) if codes & bit]
    return ", ".join(names)


def _collective_failed(what: str, reason: str, error: Exception, **fields: Any
                       ) -> CoordinationError:
    """The error every failed preemption collective raises: what, why, and this rank."""
    return CoordinationError(f"{what} failed: {error}", reason=reason, rank=dist.get_rank(),
                             **fields)
