"""A trainer for the crash test of the emergency write: it freezes mid-write and waits to die.

``python -m tests.crash.emergency_trainer ROOT FREEZE`` trains a small model with a
``CheckpointManager`` (blocking saves every 2 steps, a ``PreemptionHandler`` on SIGUSR1,
the emergency capture on by default), commits steps 2 and 4, completes step 5 and signals
itself during step 6. The capture thread copies step 5 and writes it; at the ``FREEZE``
point of that write (``tensors``: its tensor files are written, nothing else;
``small``: every file is written, the manifest not published) it prints ``FROZEN <step>``
and waits forever - a settled point for the test to send SIGKILL at. Each message is
one ``os.write`` of one line to stdout.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import torch
from torch import nn

from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler

FREEZES = ("tensors", "small")


def emit(*parts: object) -> None:
    """One line, one ``os.write``: whatever was said before the kill arrives whole."""
    os.write(1, (" ".join(str(part) for part in parts) + "\n").encode())


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer (the test rebuilds them to restore)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on a batch of its own."""
    torch.manual_seed(1000 + step)
    optimizer.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()
    optimizer.step()


def _freeze_in_the_emergency_write(point: str) -> None:
    name = "save" if point == "tensors" else "step_files"
    original = getattr(tensors, name)

    def frozen(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if threading.current_thread().name == "resumekit-emergency":
            emit("FROZEN", point)
            threading.Event().wait()  # until the SIGKILL
        return result

    setattr(tensors, name, frozen)


def main(argv: list[str]) -> int:
    root, point = argv
    if point not in FREEZES:
        raise SystemExit(f"freeze point {point!r}: one of {FREEZES}")
    _freeze_in_the_emergency_write(point)
    model, optimizer = build()
    handler = PreemptionHandler(signals=("SIGUSR1",), grace_period=600)
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, save_every=2,
                             preemption=handler, capture_at_signal=True)
    ckpt.restore()
    for step in range(1, 6):
        train(model, optimizer, step)
        ckpt.step_end(step)
        if step % 2 == 0:
            emit("COMMITTED", step)
    emit("SIGNAL", 5)
    os.kill(os.getpid(), signal.SIGUSR1)  # during step 6: the capture copies step 5
    train(model, optimizer, 6)  # its optimizer.step() waits for the copy, not the write
    emit("TRAINED", 6)
    ckpt.step_end(6)  # the agreed preemption waits for the frozen write: never returns
    emit("UNEXPECTED", "step_end(6) returned")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
