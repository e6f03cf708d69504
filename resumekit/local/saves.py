"""``LocalSaves``: the local tier's saves, staged in ``step_end`` and written in the background.

A local save (issue 38.2) holds training for its staging copy only: the rank's part is
copied into host buffers of the local tier's own, and a thread of its own
(:class:`~resumekit.background.thread.BackgroundSave`, the one owner of its errors) writes,
commits and replicates it on a process group of its own, so that its collectives never
interleave with training's, the durable saves' or the emergency capture's. The next local
save waits for the one in flight (its buffers are reused).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from resumekit.background.thread import BackgroundSave
from resumekit.runtime.channels import Channel
from resumekit.store.coordination import activity
from resumekit.tensors.staging import CpuStager

__all__ = ["LocalSaves"]


class LocalSaves:
    """The local tier's writer: one thread, one save at a time, its own staging buffers.

    Args:
        channel: Where its collectives run: a group of its own with several ranks (the
            manager's channel when there is one rank).
        boost: Called while someone waits for a save (raises its writers' priority).
        page_aligned: Page-aligned staging buffers (the raw tensor format's direct I/O).

    Attributes:
        channel: The channel its saves run on.
        write_seconds: How long the last completed save's write, commit and replication
            took (None before the first), for ``save_every="auto"``.
    """

    def __init__(self, channel: Channel, *, boost: Callable[[], object] | None,
                 page_aligned: bool) -> None:
        self.channel = channel
        self._thread = BackgroundSave(boost=boost, what="local save", thread="local-save")
        self._stager: CpuStager | None = None
        self._page_aligned = page_aligned
        self.write_seconds: float | None = None

    def submit(self, step: int, tensors: Mapping[str, Any],
               write: Callable[[dict[str, Any], Channel], object]) -> None:
        """Wait for the save in flight, stage ``tensors``, write them on the thread.

        Args:
            step: The step saved.
            tensors: The rank's part (live tensors: copied here, before this returns).
            write: Writes, commits and replicates the staged copy over the channel.

        Raises:
            AsyncSaveError: The previous local save failed (nothing is staged).
        """
        self._thread.wait()
        if self._stager is None:
            self._stager = CpuStager(page_aligned=self._page_aligned, shared=False)
        staged = self._stager.stage(tensors)

        def run() -> None:
            began = time.monotonic()
            with activity(f"local save of step {step}", step=step):
                write(staged, self.channel)
            self.write_seconds = time.monotonic() - began

        self._thread.submit(step, run)

    def wait(self) -> None:
        """Block until the save in flight (if any) committed; re-raise its error once.

        Raises:
            AsyncSaveError: It failed (its error is the cause).
        """
        self._thread.wait()

    def join(self) -> None:
        """Block until the save in flight (if any) is done; raise nothing (kept for wait)."""
        self._thread.join()

    def close(self) -> None:
        """Wait for the save in flight and stop: its group is the manager's to destroy.

        Raises:
            AsyncSaveError: The save in flight failed.
        """
        self._thread.wait()
