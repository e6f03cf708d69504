"""Fencing holds when claims race, and a storage hiccup is never taken for a newer claim.

Issue 29, findings 3 and 4b. A zombie (an old SLURM restart still alive) that claims the
root while the requeued restart claims it too must never end up the one that commits; an
``EIO`` reading a writer's own generation record says nothing about a newer claim.
Interleavings are made deterministic by running the other claimer from inside a wrapped
:class:`~resumekit.store.storage.Storage` method, at the instant under test.
"""

from __future__ import annotations

import errno
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tenacity
import torch
from torch import nn

from resumekit.errors import FencedWriterError, StorageError
from resumekit.manager import CheckpointManager
from resumekit.store import generations, retry
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import GENERATIONS_DIR, generation_record_name
from resumekit.store.manifest import Lineage
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage

JOB = "4242"


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF", tenacity.wait_none())


@pytest.fixture
def restart(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """``restart(n)`` makes this process look like restart ``n`` of SLURM job 4242."""

    def become(count: int) -> None:
        monkeypatch.setenv("SLURM_JOB_ID", JOB)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(count))

    yield become


def _manager(root: Path | str, value: float, **kwargs: Any) -> CheckpointManager:
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return CheckpointManager(root, model=model, retention=None, **kwargs)


def _is_record(relative: str) -> bool:
    return relative.startswith(f"{GENERATIONS_DIR}/") and relative.endswith(".json") \
        and "newest-step" not in relative


def _on_first_record_read_inside_claim(monkeypatch: pytest.MonkeyPatch,
                                       action: Callable[[], None]) -> list[str]:
    """Run ``action`` once, right after the first generation record a claim reads."""
    inside: list[bool] = []
    done: list[str] = []
    real_claim = generations.claim
    real_read = Storage.read_small

    def claim(*args: Any, **kwargs: Any) -> Any:
        inside.append(True)
        try:
            return real_claim(*args, **kwargs)
        finally:
            inside.pop()

    def read_small(self: Storage, relative: str, **options: Any) -> bytes:
        data = real_read(self, relative, **options)
        if inside and not done and _is_record(relative):
            done.append(relative)
            action()  # the other claimer runs between this read and the next one
        return data

    monkeypatch.setattr(generations, "claim", claim)
    monkeypatch.setattr(Storage, "read_small", read_small)
    return done


# ----------------------------------------------------------------------- finding 3


def test_a_requeued_restart_claiming_between_a_zombies_reads_wins_and_the_zombie_never_commits(
    tmp_path: Path, restart: Callable[[int], None], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _manager(tmp_path, 5.0).save(100)  # generation 1: an earlier run, outside SLURM
    requeued: list[CheckpointManager] = []

    def the_requeued_restart_claims() -> None:
        restart(1)
        requeued.append(_manager(tmp_path, 0.0))
        assert requeued[0].restore() == 100  # claims generation 2
        restart(0)

    restart(0)
    zombie = _manager(tmp_path, 1.0)
    with pytest.MonkeyPatch.context() as patch:
        fired = _on_first_record_read_inside_claim(patch, the_requeued_restart_claims)
        with pytest.raises(FencedWriterError, match="later restart of the same job"):
            zombie.restore()
            zombie.save(200)  # (not reached once fixed: restore itself refuses the zombie)
    assert fired and requeued
    with pytest.raises(FencedWriterError):
        zombie.save(200)  # never restored: its save tries to claim, and is refused
    store = Storage(tmp_path)
    assert [e.step for e in list_checkpoints(store) if e.status == "committed"] == [100]
    requeued[0].save(200)  # the newer run is the one that goes on
    assert latest_committed(store).step == 200  # type: ignore[union-attr]
    newest = generations.newest_generation(store)
    assert newest is not None and newest.slurm_restart_count == 1


def test_a_claim_that_loses_the_number_to_a_racing_claimer_reads_that_claimer_before_it_claims(
    storage: Storage,
) -> None:
    store = storage  # on every backend: local, file://, memory://, S3
    generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=1))
    newer = Lineage(hostname="h", pid=3, slurm_job_id=JOB, slurm_restart_count=1)
    zombie = Lineage(hostname="h", pid=2, slurm_job_id=JOB, slurm_restart_count=0)
    real_list = Storage.list_names
    listings: list[int] = []

    def stale_listing(self: Storage, relative: str = "", **kwargs: Any) -> Any:
        names = real_list(self, relative, **kwargs)
        if relative == GENERATIONS_DIR and not listings:
            listings.append(1)  # the zombie lists; the requeued run claims right after
            generations.claim(Storage(store.url, store.storage_options), newest_step=None,
                              identity=newer)
        return names

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Storage, "list_names", stale_listing)
        with pytest.raises(FencedWriterError, match="later restart of the same job"):
            generations.claim(store, newest_step=None, identity=zombie)
    current = generations.newest_generation(store)
    assert current is not None and current.slurm_restart_count == 1
    generations.check(store, current, action="commit step 1")  # the newer run may commit


def test_an_older_restart_holding_the_newest_claim_is_refused_when_a_newer_one_claims_mid_read(
    storage: Storage,
) -> None:
    # Issue 37, finding 8: the older restart already holds the newest record, so its claim
    # would take the "same run" shortcut on what it listed; the newer restart of its job
    # claims between that listing and the reads.
    store = storage  # on every backend: local, file://, memory://, S3
    newer = Lineage(hostname="h", pid=3, slurm_job_id=JOB, slurm_restart_count=1)
    zombie = Lineage(hostname="h", pid=2, slurm_job_id=JOB, slurm_restart_count=0)
    held = generations.claim(store, newest_step=None, identity=zombie)
    real_list = Storage.list_names
    listings: list[int] = []

    def newer_claim_after_the_listing(self: Storage, relative: str = "", **kwargs: Any
                                      ) -> Any:
        names = real_list(self, relative, **kwargs)
        if relative == GENERATIONS_DIR and not listings:
            listings.append(1)
            generations.claim(Storage(store.url, store.storage_options), newest_step=None,
                              identity=newer)
        return names

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Storage, "list_names", newer_claim_after_the_listing)
        with pytest.raises(FencedWriterError, match="later restart of the same job"):
            generations.claim(store, newest_step=None, identity=zombie)
    assert listings
    current = generations.newest_generation(store)
    assert current is not None and current.slurm_restart_count == 1
    assert current.number == held.number + 1  # the older restart created nothing
    generations.check(store, current, action="commit step 1")  # the newer run may commit


def _on_listing_inside_claim(monkeypatch: pytest.MonkeyPatch,
                             action: Callable[[], None]) -> list[str]:
    """Run ``action`` once, right after a claim lists the generation records."""
    inside: list[bool] = []
    done: list[str] = []
    real_claim = generations.claim
    real_list = Storage.list_names

    def claim(*args: Any, **kwargs: Any) -> Any:
        inside.append(True)
        try:
            return real_claim(*args, **kwargs)
        finally:
            inside.pop()

    def list_names(self: Storage, relative: str = "", **kwargs: Any) -> Any:
        names = real_list(self, relative, **kwargs)
        if inside and not done and relative == GENERATIONS_DIR:
            done.append(relative)
            action()  # the other claimer runs between this listing and the reads
        return names

    monkeypatch.setattr(generations, "claim", claim)
    monkeypatch.setattr(Storage, "list_names", list_names)
    return done


@pytest.mark.parametrize("order", ["before-the-listing", "between-the-listing-and-the-reads"])
def test_an_older_restart_is_refused_whichever_order_its_listing_and_the_newer_claim_land_in(
    tmp_path: Path, restart: Callable[[int], None], order: str,
) -> None:
    # Through restore(): restart 0 claimed the root (its restore), and restores again
    # while restart 1 of the same job claims, before or during that restore's claim.
    restart(0)
    first = _manager(tmp_path, 1.0)
    first.save(100)
    first.close()
    requeued: list[CheckpointManager] = []

    def the_newer_restart_claims() -> None:
        restart(1)
        requeued.append(_manager(tmp_path, 0.0))
        assert requeued[0].restore() == 100
        restart(0)

    with pytest.MonkeyPatch.context() as patch:
        if order == "before-the-listing":
            the_newer_restart_claims()
        else:
            assert _on_listing_inside_claim(patch, the_newer_restart_claims) == []
        older = _manager(tmp_path, 1.0)
        with pytest.raises(FencedWriterError, match="later restart of the same job"):
            older.restore()
    assert requeued
    with pytest.raises(FencedWriterError):
        older.save(200)
    requeued[0].save(200)  # the newer restart goes on
    store = Storage(tmp_path)
    assert latest_committed(store).step == 200  # type: ignore[union-attr]
    newest = generations.newest_generation(store)
    assert newest is not None and newest.slurm_restart_count == 1


# ----------------------------------------------------------------------- finding 4b


def _eio_reading(monkeypatch: pytest.MonkeyPatch, relative: str, times: int) -> list[str]:
    """Fail reads of ``relative`` with EIO ``times`` times."""
    real_read = Storage.read_small
    failed: list[str] = []

    def read_small(self: Storage, name: str, **options: Any) -> bytes:
        if name == relative and len(failed) < times:
            failed.append(name)
            raise StorageError(f"cannot open {self.path(name)}: [Errno 5] Input/output error",
                               path=self.path(name), operation="open") from OSError(
                errno.EIO, "Input/output error", self.path(name))
        return real_read(self, name, **options)

    monkeypatch.setattr(Storage, "read_small", read_small)
    return failed


def test_one_eio_reading_the_writers_own_generation_record_is_retried_not_taken_for_fencing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    only = _manager(tmp_path, 1.0)
    only.save(100)
    failed = _eio_reading(monkeypatch, generation_record_name(1), times=1)
    with caplog.at_level(logging.WARNING, "resumekit"):
        only.save(200)  # the only writer: one EIO must not fence it
    assert failed == [generation_record_name(1)]
    assert any("retrying" in record.getMessage() for record in caplog.records)
    assert latest_committed(Storage(tmp_path)).step == 200  # type: ignore[union-attr]


def test_a_record_that_stays_unreadable_is_a_storage_error_saying_fencing_was_not_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    only = _manager(tmp_path, 1.0)
    only.save(100)
    _eio_reading(monkeypatch, generation_record_name(1), times=10**6)
    with pytest.raises(StorageError) as caught:
        only.save(200)
    assert not isinstance(caught.value, FencedWriterError)
    message = str(caught.value)
    assert generation_record_name(1).split("/")[-1] in message
    assert "could not check" in message and "not fenced" in message
    monkeypatch.undo()
    only.save(200)  # once the storage answers again, the same writer goes on
    assert latest_committed(Storage(tmp_path)).step == 200  # type: ignore[union-attr]


# ----------------------------------------------------------------------- own scenarios


def test_a_torn_record_of_a_killed_claimer_is_skipped_with_a_warning_and_still_fences_below(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    store = Storage(tmp_path)
    below = generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=1))
    torn = tmp_path / generation_record_name(2)
    torn.write_bytes(b'{"number": 2, "token": "5f0e')  # an older resumekit, killed mid-write
    with caplog.at_level(logging.WARNING, "resumekit"):
        with pytest.raises(FencedWriterError, match="refusing to commit step 5"):
            generations.check(store, below, action="commit step 5", step=5)
        above = generations.claim(store, newest_step=None,
                                  identity=Lineage(hostname="h", pid=3))
    assert above.number == 3  # the torn record's number stays taken
    assert any("000000000002.json" in r.getMessage() and "do not parse" in r.getMessage()
               for r in caplog.records)
    generations.check(store, above, action="commit step 5", step=5)


def test_a_transient_error_reading_the_successor_record_does_not_hide_the_newer_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(tmp_path)
    zombie = generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=1))
    generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=2))
    failed = _eio_reading(monkeypatch, generation_record_name(2), times=1)
    with pytest.raises(FencedWriterError, match="fenced by generation 2"):
        generations.check(store, zombie, action="commit step 5", step=5)
    assert failed == [generation_record_name(2)]
    _eio_reading(monkeypatch, generation_record_name(2), times=10**6)
    with pytest.raises(StorageError, match="could not check"):  # never "not fenced"
        generations.check(store, zombie, action="commit step 5", step=5)


_KILLED_BEFORE_THE_LINK = """
import os, signal, sys
from resumekit.store import generations
from resumekit.store.manifest import Lineage
from resumekit.store.storage import Storage
os.link = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
generations.claim(Storage(sys.argv[1]), newest_step=None,
                  identity=Lineage(hostname="h", pid=2))
"""


def test_a_claimer_killed_while_creating_its_record_leaves_no_record_at_all(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    held = generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=1))
    killed = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_THE_LINK, str(tmp_path)],
                            check=False, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    aside, record = sorted(p.name for p in (tmp_path / GENERATIONS_DIR).iterdir())
    assert record == "000000000001.json"
    assert aside.startswith(".000000000002.json.tmp-")  # written aside, never linked in
    generations.check(store, held, action="commit step 5", step=5)  # no half-made claim
    after = generations.claim(store, newest_step=None, identity=Lineage(hostname="h", pid=3))
    assert after.number == 2
    with pytest.raises(FencedWriterError):
        generations.check(store, held, action="commit step 5", step=5)
