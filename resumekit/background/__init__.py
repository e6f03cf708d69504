"""A manager's background save work, one module per part.

* :mod:`.thread`: :class:`BackgroundSave`, the one owner of the save thread (one job at a
  time; its error re-raised by the next wait). Every background save runs there.
* :mod:`.process`: :class:`WriterProcess`, the long-lived writer process of
  ``async_writer="process"``, to which the save thread hands the rank's tensor bytes.
* :mod:`.emergency`: :class:`EmergencyCapture`, which copies the last completed step at a
  preemption signal and writes it while the step in progress runs.

Where to start reading: :mod:`.thread`; the manager hands it every background save.

What it may import: of resumekit ``save_job`` and the wings below it (options, tools,
restore, state, tensors, runtime, store), ``errors`` and ``warnings``; ``restore_root``
beside it, the local tier (:mod:`resumekit.local`) and the manager above it never.
:mod:`.thread` imports no torch (a contract in pyproject.toml); the writer process and the
emergency capture do.
"""

from __future__ import annotations

from resumekit.background.emergency import Boundary, Capture, EmergencyCapture
from resumekit.background.process import WriterProcess
from resumekit.background.thread import BackgroundSave

__all__ = ["BackgroundSave", "Boundary", "Capture", "EmergencyCapture", "WriterProcess"]
