"""A store whose write bandwidth is bounded: the stand-in the grace-window tests save to.

:class:`ThrottledWrites` wraps ``resumekit.tensors.save`` (every tensor write of a
save goes through it) so that a save of ``n`` bytes takes at least ``n / bytes_per_second``
seconds: the writes run at the disk's speed, then the save is held until the bandwidth's
budget for those bytes is spent. A slow network filesystem looks the same from the trainer
(a save's duration grows with its bytes), and the bound is deterministic: the measured
throughput can never exceed it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from resumekit import tensors


class ThrottledWrites:
    """Bound the write bandwidth of every ``tensors.save`` in this process.

    Args:
        bytes_per_second: The bandwidth.
        patch: Where to install the wrapper: a ``pytest.MonkeyPatch`` (undone with it),
            or None to replace ``tensors.save`` for the rest of the process (a drill
            script).
    """

    def __init__(self, bytes_per_second: float, patch: Any = None) -> None:
        self.bytes_per_second = bytes_per_second
        self.written: list[int] = []  # bytes of each save, in order
        self._lock = threading.Lock()
        original = tensors.save

        def throttled(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            files = original(*args, **kwargs)
            nbytes = sum(file.size for file in files)
            with self._lock:
                self.written.append(nbytes)
            budget = started + nbytes / self.bytes_per_second
            # Hold the save until the bandwidth budget of its bytes is spent (a loop:
            # a sleep may wake early on a signal).
            while (remaining := budget - time.monotonic()) > 0:
                time.sleep(remaining)
            return files

        if patch is None:
            tensors.save = throttled  # type: ignore[assignment]
        else:
            patch.setattr(tensors, "save", throttled)
