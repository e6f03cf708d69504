"""DataLoader workers ignore the preemption signals (issue 36 item 4).

torch's DataLoader worker installs a SIGTERM handler that ends it; torchrun's agent signals
each worker's whole process group and SLURM every process of the step, so the workers died
and the next ``next(loader)`` raised before the ranks could agree and save. resumekit sets
a ``worker_init_fn`` on the loader it is given that makes the workers ignore the handler's
signals and then runs the user's own.
"""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from resumekit import (
    CheckpointManager,
    ConfigurationError,
    PreemptionHandler,
    ResumableDistributedSampler,
    protect_loader_workers,
)
from resumekit.runtime.preemption import IgnoreSignalsInWorkers

MARK = "RESUMEKIT_TEST_WORKER_MARK"


class _WhoServes(Dataset[dict[str, Any]]):
    """Each item says which process made it and what that process does with the signals."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"pid": os.getpid(), "mark": os.environ.get(MARK, ""),
                "term_ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,
                "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
                "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}


def _mark_worker(worker_id: int) -> None:
    os.environ[MARK] = f"user init ran in worker {worker_id}"


def _loader(**kwargs: Any) -> DataLoader[Any]:
    return DataLoader(_WhoServes(), batch_size=None, num_workers=1, **kwargs)


def test_a_protected_loaders_workers_ignore_the_signals_and_still_run_the_users_init() -> None:
    loader = protect_loader_workers(_loader(worker_init_fn=_mark_worker))
    item = next(iter(loader))
    assert item["pid"] != os.getpid()
    assert item["term_ignored"] and item["usr1_ignored"]
    assert item["mark"] == "user init ran in worker 0"
    # The main process keeps its own handlers.
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN


def _serve_after_sigterm(loader: DataLoader[Any]) -> int:
    """SIGTERM the worker, then take every remaining item (the worker serves them after)."""
    items = iter(loader)
    worker = next(items)["pid"]
    os.kill(worker, signal.SIGTERM)
    return 1 + sum(1 for _ in items)


def test_a_sigterm_to_a_protected_worker_leaves_the_loader_running() -> None:
    assert _serve_after_sigterm(protect_loader_workers(_loader())) == len(_WhoServes())


def test_a_sigterm_to_an_unprotected_worker_kills_it_and_the_loader_raises() -> None:
    # What the quickstart's loop met under torchrun before resumekit protected the loader.
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        _serve_after_sigterm(_loader())


def test_the_manager_protects_its_data_loader_with_the_handlers_signals(
    tmp_path: Path,
) -> None:
    loader = DataLoader(_WhoServes(), batch_size=4, num_workers=1, worker_init_fn=_mark_worker,
                        sampler=ResumableDistributedSampler(64, num_replicas=1, rank=0))
    handler = PreemptionHandler(signals=("SIGTERM", "SIGUSR2"))
    ckpt = CheckpointManager(tmp_path / "ckpt", model=nn.Linear(2, 2), data=loader,
                             preemption=handler, retention=None)
    try:
        assert isinstance(loader.worker_init_fn, IgnoreSignalsInWorkers)
        assert loader.worker_init_fn.then is _mark_worker
        batch = next(iter(loader))
        assert batch["term_ignored"].all() and batch["usr2_ignored"].all()
        assert not batch["usr1_ignored"].any()  # not this handler's signal
        assert set(batch["mark"]) == {"user init ran in worker 0"}
    finally:
        ckpt.close()


def test_without_a_preemption_handler_the_manager_leaves_the_loaders_workers_alone(
    tmp_path: Path,
) -> None:
    loader = DataLoader(_WhoServes(), batch_size=4, num_workers=1, worker_init_fn=_mark_worker,
                        sampler=ResumableDistributedSampler(64, num_replicas=1, rank=0))
    ckpt = CheckpointManager(tmp_path / "ckpt", model=nn.Linear(2, 2), data=loader,
                             retention=None)
    ckpt.close()
    assert loader.worker_init_fn is _mark_worker


def test_protecting_twice_keeps_one_wrapper_with_every_signal_and_the_users_init() -> None:
    loader = protect_loader_workers(_loader(worker_init_fn=_mark_worker), ("SIGTERM",))
    protect_loader_workers(loader, (signal.SIGUSR2, "SIGTERM"))
    wrapper = loader.worker_init_fn
    assert isinstance(wrapper, IgnoreSignalsInWorkers)
    assert wrapper.then is _mark_worker
    assert wrapper.signals == (signal.SIGTERM, signal.SIGUSR2)
    assert repr(wrapper).startswith("IgnoreSignalsInWorkers(SIGTERM/SIGUSR2, then=")


def test_the_workers_init_pickles_for_the_spawn_and_forkserver_start_methods() -> None:
    wrapper = IgnoreSignalsInWorkers(("SIGTERM", "USR1"), _mark_worker)
    copy = pickle.loads(pickle.dumps(wrapper))
    assert copy.signals == wrapper.signals and copy.then is _mark_worker


def test_an_object_without_worker_init_fn_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="list has no worker_init_fn"):
        protect_loader_workers([torch.zeros(1)])
