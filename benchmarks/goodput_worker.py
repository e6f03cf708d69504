"""``torchrun ... -m benchmarks.goodput_worker <trainer args>``: the LingBot trainer, timed.

Runs ``examples.lingbot.train`` unchanged, with every rank appending an event per line to
the file named by ``RESUMEKIT_GOODPUT_EVENTS`` (ranks other than 0 to ``<that>.rank<N>``):
``launch``, ``restore_begin``/``restore_end``, ``step`` (after each metrics record),
``blocked_begin``/``blocked_end`` around every call of ``CheckpointManager.save``/``wait``/
``close`` (the time training waits on checkpointing) and ``exit``. Wall-clock seconds
(``time.time``), comparable across launches on one machine. See :mod:`benchmarks.goodput`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

EVENTS_ENV = "RESUMEKIT_GOODPUT_EVENTS"


def main() -> int:
    from examples.lingbot import train as trainer  # noqa: PLC0415 - after torchrun's env
    from resumekit.manager import CheckpointManager  # noqa: PLC0415

    rank = os.environ.get("RANK", "0")
    path = os.environ[EVENTS_ENV] + ("" if rank == "0" else f".rank{rank}")
    handle = open(path, "a", buffering=1)  # noqa: SIM115 - closed at exit

    def log(kind: str, **fields: Any) -> None:
        if not handle.closed:
            handle.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")

    def timed(method: Callable[..., Any], begin: str, end: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            log(begin, what=method.__name__)
            try:
                return method(*args, **kwargs)
            finally:
                log(end, what=method.__name__)
        return wrapper

    CheckpointManager.restore = timed(  # type: ignore[method-assign]
        CheckpointManager.restore, "restore_begin", "restore_end")
    for name in ("save", "wait", "close"):
        setattr(CheckpointManager, name,
                timed(getattr(CheckpointManager, name), "blocked_begin", "blocked_end"))
    append = trainer.MetricsLog.append

    def logged_append(self: Any, record: dict[str, Any]) -> None:
        append(self, record)
        log("step", step=int(record["step"]))

    trainer.MetricsLog.append = logged_append  # type: ignore[method-assign]
    log("launch")
    code = trainer.main(sys.argv[1:])
    log("exit", code=code)
    handle.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
