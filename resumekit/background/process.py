"""``WriterProcess``: a manager's long-lived writer process (``async_writer="process"``).

A background save still runs on the manager's save thread (:mod:`.thread`): DCP's plan
and its collectives, the small per-rank files and the commit protocol stay in the
trainer, on the process groups they already use. Only the bytes of the rank's tensors
(hashing and writing, the work that held the GIL) go to this process: the trainer's
writer (:mod:`resumekit.tensors.remote`) sends each ``write_data`` as a
:class:`~resumekit.tensors.remote.WriteRequest`, and the save thread waits, without the
GIL, for the reply. The staged tensors are not copied: they live in the stager's shared
memory segments (:class:`~resumekit.tensors.staging.SharedSegment`), whose descriptors
go over the same socket (``SCM_RIGHTS``) once each.

The process is a fresh interpreter (``python -c``, fork + exec at once: it inherits no
process group, thread or lock of the trainer, and never imports the trainer's
``__main__``), one per manager and rank, started at the first background save or when the
manager stages ahead. It ignores SIGINT and SIGTERM from its first instruction, and has
them blocked from the fork until then (the trainer decides what a signal means;
torchrun's agent and a SLURM ``scancel`` reach the whole process group, also while the
process still imports torch) and exits when the trainer
says so (:meth:`WriterProcess.close`), when its end of the socket reports EOF (the
trainer died) or when its parent changes. An error there comes back with its type,
message and traceback; a process that died (SIGKILL, the OOM killer) is noticed at once
(EOF on the socket, then its exit status) and reported with its pid and signal
(:class:`~resumekit.errors.WriterProcessError`), never waited on; the next save starts a
new one. One that died between saves is warned about and replaced at the next save,
which it had no part in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from resumekit.errors import ResumekitError, WriterProcessError
from resumekit.tensors.remote import WriteReply, WriteRequest, perform
from resumekit.tensors.staging import SharedSegment, attach
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["WriterProcess", "serve"]

logger = logging.getLogger("resumekit")

_SHIELDED = (signal.SIGINT, signal.SIGTERM)
"""The signals the writer process ignores from its first instruction (and, blocked, before)."""
_BOOT = ("import signal; "
         "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]; "
         "signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM)); "
         "import json, sys; sys.path[:0] = json.loads(sys.argv[3]); "
         "from resumekit.background.process import serve; "
         "serve(int(sys.argv[1]), int(sys.argv[2]))")
"""The writer process's program. Its first statements ignore SIGINT and SIGTERM, and only
then unblock them: :meth:`WriterProcess.start` forks it with both blocked (a blocked
signal stays pending across ``exec``; one pending when it is ignored is discarded), so a
signal sent to the whole process group while it starts - torchrun's agent ``killpg``-s
each worker's group at a SIGTERM, SLURM signals every process of the step - never kills
it, however long its ``import torch`` takes on a busy host."""
_POLL_SECONDS = 0.5
"""How often a waiting side looks at the other's liveness when no message came."""
_STOP_SECONDS = 60.0
"""How long :meth:`WriterProcess.close` waits for an idle writer to exit before killing it."""


class WriterProcess:
    """The trainer's end: starts the writer process, sends it requests, reads replies.

    Used from one thread at a time (the manager's save thread; :meth:`start` and
    :meth:`close` from the main thread while no save is in flight).

    Args:
        segments: The stager's shared segments (:meth:`CpuStager.segments`), read at each
            request: a segment the process has not mapped yet is sent first.
    """

    def __init__(self, segments: Callable[[], Sequence[SharedSegment]]) -> None:
        self._segments = segments
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._connection: Connection | None = None
        self._sent: set[int] = set()
        self._finalizer: weakref.finalize[Any, WriterProcess] | None = None

    @property
    def pid(self) -> int | None:
        """The running process's id (None before :meth:`start` and after it ended)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the process unless it runs; returns at once (it imports torch meanwhile)."""
        if self._process is not None:
            code = self._process.poll()
            if code is None:
                return
            warn(f"resumekit's writer process (pid {self._process.pid}) died between saves "
                 f"({_how(code)}); no save was in flight, starting a new one",
                 ResumekitWarning, stacklevel=3)
        self._forget()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Blocked on this thread while it forks: the child inherits the mask, so a signal
        # that reaches it before _BOOT ignores it stays pending and is then discarded. One
        # for the trainer meanwhile goes to another thread, or is delivered when unblocked.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELDED)
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()),
                 json.dumps(sys.path)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            theirs.close()
        self._process, self._socket = process, ours
        self._connection = Connection(os.dup(ours.fileno()))
        self._sent = set()
        self._finalizer = weakref.finalize(self, _stop, process, self._connection, ours)
        logger.debug("resumekit: started writer process %d", process.pid)

    def segments(self) -> Sequence[SharedSegment]:
        """The shared segments a request's tensors may lie in."""
        return self._segments()

    def write(self, request: WriteRequest) -> WriteReply:
        """Have the process write ``request``; block (GIL released) until it replied.

        Raises:
            ResumekitError: The writer raised it (the same error, with its remote
                traceback as ``remote_traceback``).
            WriterProcessError: The writer raised another error (its type, message and
                traceback), or the process died (its pid and exit code or signal).
        """
        self.start()
        process, connection, ours = self._process, self._connection, self._socket
        assert process is not None and connection is not None and ours is not None
        try:
            segments = list(self._segments())
            self._sent &= {segment.key for segment in segments}  # the others are unmapped
            for segment in segments:
                if segment.key not in self._sent and segment.fd >= 0:
                    connection.send_bytes(pickle.dumps(("segment", segment.key,
                                                        segment.nbytes)))
                    socket.send_fds(ours, [b"F"], [segment.fd])
                    self._sent.add(segment.key)
            connection.send_bytes(pickle.dumps(("write", request)))
            reply = self._receive(process, connection)
        except (EOFError, OSError):
            raise self._died(process, request) from None
        if reply[0] == "done":
            result: WriteReply = reply[1]
            return result
        raise _failure(process.pid, request, reply[1])

    def _receive(self, process: subprocess.Popen[bytes], connection: Connection) -> Any:
        while not connection.poll(_POLL_SECONDS):
            if process.poll() is not None:
                raise EOFError
        return pickle.loads(connection.recv_bytes())

    def _died(self, process: subprocess.Popen[bytes], request: WriteRequest
              ) -> WriterProcessError:
        try:
            code = process.wait(timeout=_STOP_SECONDS)
        except subprocess.TimeoutExpired:  # its socket closed, yet it lives on: end it
            process.kill()
            code = process.wait()
        self._forget()
        name = _signal_name(code)
        return WriterProcessError(
            f"resumekit's writer process (pid {process.pid}) died while writing "
            f"{request.writer.path}: {_how(code)}; nothing of this save was committed (a new "
            "writer process starts at the next save)",
            pid=process.pid, exit_code=code, signal=name, path=request.writer.path)

    def close(self) -> None:
        """Tell the process to exit and reap it (killed if it does not). Idempotent."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()
        self._process = self._connection = self._socket = None

    def _forget(self) -> None:
        """Let go of a process that has ended (reaped), and of its socket."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if self._connection is not None:
            self._connection.close()
        if self._socket is not None:
            self._socket.close()
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = self._connection = self._socket = None


def _stop(process: subprocess.Popen[bytes], connection: Connection,
          ours: socket.socket) -> None:
    """Ask the process to exit, wait, kill it if it does not; close the socket."""
    with contextlib.suppress(OSError):  # it has exited already
        connection.send_bytes(pickle.dumps(("stop",)))
    try:
        process.wait(timeout=_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        logger.warning("resumekit: writer process %d did not exit; killing it", process.pid)
        process.kill()
        process.wait()
    connection.close()
    ours.close()


def _how(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal)."""
    name = _signal_name(code)
    return f"killed by signal {-code} ({name})" if name else f"exit code {code}"


def _signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return None


def _failure(pid: int, request: WriteRequest,
             described: tuple[bytes | None, str, str, str]) -> BaseException:
    """The error to raise in the trainer for an error the writer process raised.

    Args:
        pid: The writer process.
        request: What it was writing.
        described: What :func:`_described_error` sent.
    """
    pickled, kind, message, remote_traceback = described
    error: Any = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - its class does not unpickle here: told as text
            error = None
    if isinstance(error, ResumekitError):  # the writer's own error: the same as in-process
        error.fields.update(pid=pid, remote_traceback=remote_traceback)
        error.pid, error.remote_traceback = pid, remote_traceback  # type: ignore[attr-defined]
        error.add_note(f"raised in resumekit's writer process (pid {pid})")
        return error
    return WriterProcessError(
        f"resumekit's writer process (pid {pid}) failed writing {request.writer.path}: "
        f"{kind}: {message}", pid=pid, remote_type=kind, remote_traceback=remote_traceback,
        path=request.writer.path)


# -- the writer process's side ----------------------------------------------------------
def serve(fd: int, parent: int) -> None:
    """The writer process's loop: map segments, write requests, until told to stop.

    Args:
        fd: Its end of the socket to the trainer.
        parent: The trainer's pid (it exits once its parent is another).
    """
    for shielded in _SHIELDED:  # _BOOT did it already; a direct call does it here
        signal.signal(shielded, signal.SIG_IGN)
    torch.set_num_threads(1)
    ours = socket.socket(fileno=fd)
    connection = Connection(os.dup(fd))
    segments: dict[int, torch.Tensor] = {}
    while True:
        if not connection.poll(_POLL_SECONDS):
            if os.getppid() != parent:
                return
            continue
        try:
            message = pickle.loads(connection.recv_bytes())
        except EOFError:
            return
        if message[0] == "segment":
            _, key, nbytes = message
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
            try:
                segments[key] = attach(fds[0], nbytes)
            finally:
                os.close(fds[0])
        elif message[0] == "write":
            request: WriteRequest = message[1]
            for key in [key for key in segments if key not in request.segments]:
                del segments[key]
            try:  # torch's CRC switch as the trainer's writer threads see it: the same bytes
                reply: tuple[Any, ...] = ("done", perform(request, segments))
            except BaseException as error:  # noqa: BLE001 - sent to the trainer
                reply = ("failed", _described_error(error))
            try:
                connection.send_bytes(pickle.dumps(reply))
            except OSError:  # the trainer died while this was written: nobody to tell
                return
        else:
            return


def _described_error(error: BaseException) -> tuple[bytes | None, str, str, str]:
    """``error`` as (its pickle, or None if it does not round-trip; type; message; traceback)."""
    text = "".join(traceback.format_exception(error))
    pickled: bytes | None
    try:
        pickled = pickle.dumps(error)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - described as text instead
        pickled = None
    return pickled, type(error).__name__, str(error), text
