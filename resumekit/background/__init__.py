"""A manager's background save work, one module per part.

* :mod:`.thread`: :class:`BackgroundSave`, the one owner of the save thread (one job at a
  time; its error re-raised by the next wait). Every background save runs there.
* :mod:`.process`: :class:`WriterProcess`, the long-lived writer process of
  ``async_writer="process"``, to which the save thread hands the rank's tensor bytes.
* :mod:`.emergency`: :class:`EmergencyCapture`, which copies the last completed step at a
  preemption signal and writes it while the step in progress runs.
* :mod:`.local`: :class:`LocalSaves`, the local tier's saves: staged in ``step_end``,
  written, committed and replicated on a thread and a process group of their own.

Where to start reading: :mod:`.thread`; the manager hands it every background save.

What it may import: of resumekit ``options`` and the wings below it (tools, restore, state,
tensors, runtime, store), ``errors`` and ``warnings``; the layer beside it (``save_job``,
``restore_root``, ``tiers``) and the manager above it never. :mod:`.thread` imports no torch
(a contract in pyproject.toml); the writer process, the emergency capture and the local
saves do.
"""

from __future__ import annotations

from resumekit.background.emergency import Boundary, Capture, EmergencyCapture
from resumekit.background.local import LocalSaves
from resumekit.background.process import WriterProcess
from resumekit.background.thread import BackgroundSave

__all__ = ["BackgroundSave", "Boundary", "Capture", "EmergencyCapture", "LocalSaves",
           "WriterProcess"]
