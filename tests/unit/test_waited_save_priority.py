"""A waited-on save is never starved: once training waits for a background save, its
writers run at normal priority (issue 38.4).

Background writer threads run at ``SCHED_IDLE`` (else nice 19) so training keeps the
cores; on a CPU-busy host such a thread may get no CPU at all while training waits for it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.tensors.raw.files import lower_thread_priority, restore_lowered_priorities
from tests.limits import HANG_S

LIMIT_S = HANG_S  # a hang detector (tests/limits.py), never a timing


def _idle(tid: int) -> bool:
    return (os.sched_getscheduler(tid) == os.SCHED_IDLE
            or os.getpriority(os.PRIO_PROCESS, tid) == 19)


def _lowerable() -> bool:
    outcome: list[bool] = []

    def probe() -> None:
        lower_thread_priority()
        outcome.append(_idle(threading.get_native_id()))

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return outcome[0]


pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getscheduler") or not _lowerable(),
                                reason="needs Linux thread priorities")


def test_restoring_priorities_raises_an_idle_thread_to_normal() -> None:
    lowered, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def writer() -> None:
        lower_thread_priority()
        tid.append(threading.get_native_id())
        lowered.set()
        done.wait(LIMIT_S)

    thread = threading.Thread(target=writer)
    thread.start()
    assert lowered.wait(LIMIT_S)
    assert _idle(tid[0])
    assert restore_lowered_priorities(os.getpid()) >= 1
    assert not _idle(tid[0])
    done.set()
    thread.join()


def test_wait_raises_the_background_writers_of_the_save_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = tensors.save
    raised: list[bool] = []

    def idle_writer(*args: Any, **kwargs: Any) -> Any:
        lower_thread_priority()  # as the raw writer's threads do for a background save
        me = threading.get_native_id()
        deadline = time.monotonic() + LIMIT_S
        while _idle(me) and time.monotonic() < deadline:
            time.sleep(0.01)  # until someone waiting for this save raises it
        raised.append(not _idle(me))
        return original(*args, **kwargs)

    monkeypatch.setattr(tensors, "save", idle_writer)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer, async_save=True)
    ckpt.restore()
    ckpt.save(1)
    ckpt.wait()  # training waits for the save: its writer must not stay idle
    ckpt.close()
    assert raised == [True]
