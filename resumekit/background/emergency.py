"""``EmergencyCapture``: at a preemption signal, the last completed step, copied at once.

The weights and optimizer state of the last completed step do not change until the next
``optimizer.step()``. So from the moment a rank records a preemption signal (the handler
writes a byte into a pipe, :meth:`PreemptionHandler.add_wakeup`), this worker's thread
copies them into the staging buffers - on the CPU a copy off the training thread, on CUDA
a device-to-host copy on a stream of its own into pinned buffers - while the training
thread goes on with the forward and backward passes of the step in progress. An optimizer
step pre-hook (``Optimizer.register_step_pre_hook``, public API) holds the next
``optimizer.step()`` until the copy is complete, so the copy is of one step, never of a
half-updated state. The small state of that step (step, scheduler, RNG streams, data
position, the optimizer's hyperparameters) was recorded at its ``step_end``
(:meth:`mark`): the forward pass of the next step moves the RNG and the data loader on.

Then the ranks agree (:meth:`run`'s ``agree``: one tiny all-reduce on a group of its own)
that every rank holds a copy of the same step and that its write fits the grace window
left, and write and commit it at once, from this thread, while training goes on. A rank
that was not signalled joins the agreement at its next settle point (:meth:`settle`: the
manager's next save, the agreed preemption, ``close()``), contributing nothing: the ranks
then write nothing here and the manager saves as before. Every rank runs the same number
of rounds: one per settle point, a signal's round counting as the next settle point's.

A round that commits nothing leaves every committed step as it was; a kill during the
write leaves a staging area that is never read (the commit protocol). Model buffers that
the forward pass updates in place (BatchNorm's running statistics) are copied as they are
when the copy runs; parameters and optimizer state are exact.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from resumekit.runtime.preemption import PreemptionHandler
from resumekit.tensors.staging import CpuStager
from resumekit.tensors.state_dicts import Optimizers, optimizer_parts

__all__ = ["Boundary", "Capture", "EmergencyCapture", "RoundOutcome"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class Boundary:
    """The small state of a completed step, recorded at its ``step_end``.

    Attributes:
        step: The step.
        micro_step: Its accumulation position.
        train: The serialised training state (rank 0's file).
        ranks: The serialised rank state (RNG streams, data position).
        groups: The optimizer's hyperparameters per parameter group (``params`` left out).
        captured_at: Its wall-clock time (recorded in the manifest).
        resumed: ``time.monotonic()`` when training after it resumed.
        event: A CUDA event recorded on the training stream at the boundary (the copy
            waits for it), or None off CUDA.
    """

    step: int
    micro_step: int
    train: bytes
    ranks: bytes
    groups: list[dict[str, Any]]
    captured_at: datetime
    resumed: float
    event: Any = None


@dataclass(frozen=True)
class Capture:
    """The state of one completed step, staged: what an emergency write writes.

    Attributes:
        boundary: The step and its small state.
        tensors: The staged tensor state (the stager's buffers).
        signal_at: ``time.monotonic()`` of the signal that started it.
        copied_in: Seconds the copy took.
        copied_at: ``time.monotonic()`` when the copy was complete.
    """

    boundary: Boundary
    tensors: dict[str, Any]
    signal_at: float
    copied_in: float
    copied_at: float


@dataclass(frozen=True)
class RoundOutcome:
    """What a round did: the step it committed (or None) and why, in words.

    Attributes:
        committed: The step it committed, or None.
        said: Why, in words.
        copied_in: Seconds this rank's copy took (None: no copy).
        write_from: Seconds from the signal to the start of this rank's write (None: no
            write started); the figure the emergency save's log line gives.
    """

    committed: int | None
    said: str
    copied_in: float | None = None
    write_from: float | None = None


class EmergencyCapture:
    """The capture thread of one manager and rank.

    Args:
        handler: The preemption handler whose signals start a capture.
        optimizer: Its ``optimizer.step()`` is held while a copy runs (None: nothing held).
        stager: Returns the staging buffers to copy into (called on the capture thread,
            after ``before_copy``).
        before_copy: Called on the capture thread before it copies (the manager waits
            there for a background save still using the buffers).
        agree: Called on the capture thread once per round with this rank's captured
            step (or None) and whether its write fits the window left (or the reason it
            does not); returns the step every rank holds and may write, or None. Runs the
            round's collective (a no-op on one process).
        write: Writes and commits a capture (on the capture thread); may raise.
    """

    def __init__(self, handler: PreemptionHandler, *,
                 optimizer: Optimizers | None,
                 stager: Callable[[], CpuStager], before_copy: Callable[[], None],
                 agree: Callable[[Capture | None], tuple[int | None, str]],
                 write: Callable[[Capture], None]) -> None:
        self._handler = handler
        self._stager, self._before_copy = stager, before_copy
        self._agree, self._write = agree, write
        self._cond = threading.Condition()
        self._boundary: Boundary | None = None
        self._template: dict[str, Any] | None = None
        self._signal_used = False  # a signal started the round after the last settle
        self._settle_wanted = False
        self._hurry = False  # a settle point waits for the round under way
        self._stopping = False
        self._started = self._done = self._settled = 0  # rounds
        self._outcomes: list[RoundOutcome] = []
        self._capturing = False  # a signal's round is in its copy phase
        self._signal_round: int | None = None  # the index of the round a signal started
        self._signal_read, self._signal_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._control_read, self._control_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._hooks = [_register_hold(part, self._hold) for part in _optimizer_parts(optimizer)]
        self._side_stream: Any = None
        handler.add_wakeup(self._signal_write)
        self._thread = threading.Thread(target=self._main, name="resumekit-emergency",
                                        daemon=True)
        self._thread.start()

    # -- the training thread ----------------------------------------------------------
    def set_template(self, tensors: Mapping[str, Any] | None) -> None:
        """The tensor state's structure over the live tensors (a capture's own views).

        Taken by the manager on the training thread wherever it builds the tensor state
        anyway (a save, a restore); its tensors are the live parameters and optimizer
        state, which optimizers update in place, so a copy made later reads their
        values then. None forgets it (the optimizer state was replaced).
        """
        with self._cond:
            self._template = None if tensors is None else dict(tensors)
            self._cond.notify_all()

    @property
    def has_template(self) -> bool:
        """Whether a template is set."""
        return self._template is not None

    def mark(self, boundary: Boundary | None) -> None:
        """Step ``boundary.step`` is complete: its state may be copied until the next hold.

        None: no step is complete now (a restore is under way).
        """
        with self._cond:
            self._boundary = boundary
            self._cond.notify_all()

    def _hold(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The optimizer step pre-hook: while a completed step is there to copy and a
        # signal's copy is under way or about to start, wait for it; then say no step is
        # complete until the next mark().
        with self._cond:
            while (self._boundary is not None and self._template is not None
                   and not self._stopping and self._copy_expected()):
                self._cond.wait()
            self._boundary = None

    def _copy_expected(self) -> bool:
        """Whether a signal's copy is under way, or recorded and about to start (locked)."""
        return self._capturing or (self._handler.requested and not self._signal_used
                                   and self._started == self._settled)

    def settle(self) -> RoundOutcome | None:
        """Run (or join) this settle point's round on every rank; return its outcome.

        Call on every rank at the same points (the manager's saves, the agreed
        preemption, close): a round a signal started since the last settle point is this
        one's. Blocks until the round, and a write it agreed on, are done.
        """
        with self._cond:
            target = self._settled + 1
            if self._started < target:
                self._settle_wanted = True
                _poke(self._control_write)
            self._hurry = True  # a capture still waiting for a completed step gives up
            self._cond.notify_all()
            while self._done < target:
                if not self._thread.is_alive():
                    raise RuntimeError("resumekit's emergency capture thread is not running")
                self._cond.wait(timeout=None)
            self._settled = target
            _poke(self._control_write)  # a signal held back may start the next round
            return self._outcomes[target - 1]

    def close(self) -> None:
        """Stop the thread (after :meth:`settle`), remove the hook and the wakeup."""
        self._handler.remove_wakeup(self._signal_write)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        _poke(self._control_write)
        self._thread.join()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for fd in (self._signal_read, self._signal_write, self._control_read,
                   self._control_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the capture thread -----------------------------------------------------------
    def _main(self) -> None:
        pending = False  # a signal recorded and not yet used
        while True:
            pending = _drain(self._signal_read) or pending
            with self._cond:
                if self._stopping:
                    return
                if pending and self._signal_used:  # a further signal: said, then dropped
                    pending = False
                    self._say_further_signal()
                wanted = self._settle_wanted
                # A signal starts one round per manager, and only when no round started
                # since the last settle point (else the next settle point's round is it).
                by_signal = (pending and not self._signal_used
                             and self._started == self._settled)
                if wanted or by_signal:
                    self._settle_wanted = False
                    if by_signal:
                        self._signal_used, pending = True, False
                        self._capturing = True
                        self._signal_round = self._started
                    self._started += 1
            if not (wanted or by_signal):
                _wait_readable(self._signal_read, self._control_read)
                _drain(self._control_read)
                continue
            outcome = self._round(by_signal)
            with self._cond:
                self._outcomes.append(outcome)
                self._done += 1
                self._hurry = self._capturing = False
                self._cond.notify_all()

    def _say_further_signal(self) -> None:
        """One line for signals after the one that started this manager's copy (locked)."""
        received = self._handler.received
        first = received[0].received_at if received else None
        if self._signal_round is not None and self._signal_round < len(self._outcomes):
            outcome = self._outcomes[self._signal_round]
            done = (f"committed step {outcome.committed}" if outcome.committed is not None
                    else f"committed nothing ({outcome.said})")
        else:
            done = "is still under way"
        names = ", ".join(record.name for record in received[1:]) or "a request"
        after = ("" if first is None or len(received) < 2
                 else f", the last {received[-1].received_at - first:.2f} s after the first")
        logger.warning("resumekit: a further preemption signal on this rank (%d recorded: "
                       "%s%s) starts no second emergency copy; the first signal's round "
                       "%s", len(received), names, after, done)

    def _round(self, by_signal: bool) -> RoundOutcome:
        capture: Capture | None = None
        try:
            if by_signal:
                signal_at = _first_signal(self._handler)
                capture = self._capture(signal_at)
            step, said = self._agree(capture)
        except Exception as error:  # noqa: BLE001 - the manager saves as before
            logger.warning("resumekit: emergency capture failed (%s: %s); the agreed "
                           "preemption saves as without it", type(error).__name__, error)
            return RoundOutcome(None, f"failed: {type(error).__name__}: {error}")
        copied_in = None if capture is None else capture.copied_in
        if capture is None or step != capture.boundary.step:
            return RoundOutcome(None, said, copied_in)
        write_from = time.monotonic() - capture.signal_at
        try:
            self._write(capture)
        except Exception as error:  # noqa: BLE001 - the newest commit stays as it was
            logger.warning("resumekit: the emergency write of step %d failed (%s: %s); "
                           "nothing was committed by it", capture.boundary.step,
                           type(error).__name__, error)
            return RoundOutcome(None, f"the write of step {capture.boundary.step} failed: "
                                      f"{error}", copied_in, write_from)
        return RoundOutcome(capture.boundary.step, said, copied_in, write_from)

    def _capture(self, signal_at: float) -> Capture | None:
        """Copy the last completed step into the staging buffers (None: none to copy)."""
        joined = False
        with self._cond:
            while True:
                while self._boundary is None or self._template is None:
                    if self._stopping or self._settle_wanted or self._hurry:
                        self._capturing = False
                        self._cond.notify_all()
                        why = ("no step was completed since the restore or the start "
                               "of the step in progress" if self._boundary is None
                               else "the optimizer has no state to copy yet")
                        logger.warning("resumekit: a preemption signal arrived %.2f s ago, "
                                       "but nothing could be copied before this settle "
                                       "point (%s); the agreed preemption saves",
                                       time.monotonic() - signal_at, why)
                        return None
                    self._cond.wait()
                if joined:
                    break
                # A background save still writing from the buffers finishes first
                # (without the lock: training goes on meanwhile).
                self._cond.release()
                try:
                    self._before_copy()
                finally:
                    self._cond.acquire()
                joined = True
            # Holding the lock: the next optimizer.step() waits in _hold until this
            # copy is complete.
            boundary, template = self._boundary, self._template
            assert boundary is not None and template is not None
            started = time.monotonic()
            stager = self._stager()
            try:
                tensors = self._copy(stager, template, boundary)
            finally:
                self._capturing = False
                self._cond.notify_all()
            copied = time.monotonic()
        return Capture(boundary, tensors, signal_at, copied - started, copied)

    def _copy(self, stager: CpuStager, template: Mapping[str, Any],
              boundary: Boundary) -> dict[str, Any]:
        if boundary.event is None:
            staged = stager.stage(template)
        else:  # CUDA: a device-to-host copy on a stream of its own, after the boundary
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream()
            stream = self._side_stream
            stream.wait_event(boundary.event)
            with torch.cuda.stream(stream):
                staged = stager.stage(template, synchronize=False)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
        optimizer = staged.get("optimizer")
        if isinstance(optimizer, dict) and isinstance(optimizer.get("param_groups"), list):
            groups = optimizer["param_groups"]
            optimizer["param_groups"] = [
                {**group, **copy.deepcopy(now)}
                for group, now in zip(groups, boundary.groups, strict=False)
            ] + groups[len(boundary.groups):]
        return staged


def _optimizer_parts(optimizer: Optimizers | None) -> tuple[torch.optim.Optimizer, ...]:
    return () if optimizer is None else optimizer_parts(optimizer)


def _register_hold(optimizer: torch.optim.Optimizer, hold: Callable[..., None]) -> Any:
    """Register ``hold`` as a step pre-hook of ``optimizer``, or of the one it wraps.

    A wrapper that subclasses ``Optimizer`` without running its constructor (Accelerate's
    ``AcceleratedOptimizer``) has no hooks of its own; its ``step()`` calls the wrapped
    optimizer's, whose hook then holds it.
    """
    try:
        return optimizer.register_step_pre_hook(hold)
    except AttributeError:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            raise
        return _register_hold(inner, hold)


def optimizer_groups(optimizer: Optimizers | None) -> list[dict[str, Any]]:
    """The hyperparameters per group (``params`` left out), copied.

    Several optimizers' groups come one after the other, as their merged state dict lists
    them.
    """
    return [{key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
            for part in _optimizer_parts(optimizer) for group in part.param_groups]


def _first_signal(handler: PreemptionHandler) -> float:
    received = handler.received
    return received[0].received_at if received else time.monotonic()


def _wait_readable(*fds: int) -> None:
    """Block until one of ``fds`` is readable.

    ``poll``, not ``select``: ``select`` refuses descriptors at or above ``FD_SETSIZE``
    (1024), which a trainer with many open files or sockets reaches, and its
    ``ValueError`` would end the capture thread.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll()


def _poke(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, b"\0")


def _drain(fd: int) -> bool:
    """Read every byte waiting in the non-blocking pipe ``fd``; whether there was one."""
    got = False
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return got
        except OSError:
            return got
        if not data:
            return got
        got = True
