"""``BackgroundSave``: the one owner of a manager's background save thread.

An async save captures the state on the training thread and hands the writing to this
worker: one thread, one job at a time. A job's error is kept and re-raised to the
manager, wrapped in :class:`~resumekit.errors.AsyncSaveError`, by the next :meth:`wait`
(or :meth:`raise_if_failed`), so a failed background save is never silent; an error raised
in the writer process (:mod:`.process`) brings its traceback along, and the message shows
it. Imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from resumekit.errors import AsyncSaveError

__all__ = ["BackgroundSave"]

_BOOST_EVERY_S = 0.25
"""While the owner waits for a save, how often its writers' priority is raised again."""


class BackgroundSave:
    """One thread, one job at a time; the job's error re-raised by the next wait.

    The job's exception (including DCP's ``CheckpointException``, a ``BaseException``)
    is stored and re-raised, wrapped in :class:`~resumekit.errors.AsyncSaveError`, by the
    next :meth:`wait`.

    Args:
        boost: Called while someone waits for the job (raises its writers' priority).
        what: The job in words, for its error (``"local save"``).
        thread: The thread's name: ``resumekit-<thread>-<step>``.
    """

    def __init__(self, boost: Callable[[], object] | None = None, *,
                 what: str = "background save", thread: str = "save") -> None:
        # Raises the writers' idle CPU priority while someone waits for the job.
        self._boost = boost
        self._what, self._name = what, thread  # the job in its error, its thread's name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None

    def submit(self, step: int, job: Callable[[], None]) -> None:
        """Run ``job`` (the save of ``step``) on a new thread, after the previous job.

        Raises:
            AsyncSaveError: The previous job failed (``job`` is not started).
        """
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as error:  # noqa: BLE001 - handed to the owner in wait()
                self._error = error

        self._step = step
        self._thread = threading.Thread(target=run, name=f"resumekit-{self._name}-{step}",
                                        daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Block until the job in flight (if any) is done, from any thread; raise nothing.

        Its error stays for the owner's next :meth:`wait`.
        """
        thread = self._thread
        if thread is not None:
            self._join(thread)

    def _join(self, thread: threading.Thread) -> None:
        """Join ``thread``; while it runs, keep its writers at normal priority."""
        if self._boost is None:
            thread.join()
            return
        while thread.is_alive():
            # Writer threads lower their priority as each file starts: raised again
            # at every turn, so a save someone waits for is never starved.
            self._boost()
            thread.join(_BOOST_EVERY_S)

    def committed_newest(self, newest: int | None, committed: int | None) -> int | None:
        """The newest step to count as committed, from any thread, once the job is done.

        ``newest`` is the owner's newest step, counting the one it submitted here;
        ``committed`` the newest it saw commit. A job that ended in an error committed
        nothing: then ``committed``, not the step it was saving. Consumes nothing: the
        error stays for the owner's next :meth:`wait`.
        """
        thread = self._thread
        done = thread is None or not thread.is_alive()
        return committed if done and self._error is not None and newest == self._step else newest

    def raise_if_failed(self) -> None:
        """Re-raise a finished job's error without blocking on a running one."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; re-raise its error. Idempotent.

        Raises:
            AsyncSaveError: The job failed (its error is the cause); raised once.
        """
        thread, self._thread = self._thread, None
        if thread is not None:
            self._join(thread)
        error, self._error = self._error, None
        if error is not None:
            remote = getattr(error, "remote_traceback", None)
            shown = f"\nthe writer process's traceback:\n{remote}" if remote else ""
            raise AsyncSaveError(
                f"{self._what} of step {self._step} failed: {type(error).__name__}: "
                f"{error}{shown}",
                step=self._step,
            ) from error
