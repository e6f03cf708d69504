"""Retention policies, their combinations, and prune's guarantees (newest, protected, live)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.commit import WRITER_FILE, CommitProtocol, PendingCheckpoint
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, Manifest, parse_manifest
from resumekit.store.retention import keep_all, keep_best, keep_every, keep_last, keep_steps, prune
from resumekit.store.storage import Storage
from tests.storage_backends import save_checkpoint

STEPS = [500, 1000, 1500, 2000, 2500, 3000]
HOUR = 3600.0


# -- policies ---------------------------------------------------------------------------


def test_keep_last_keeps_the_newest_n() -> None:
    assert keep_last(2).keep(STEPS) == {2500, 3000}
    assert keep_last(10).keep(STEPS) == set(STEPS)
    assert keep_last(1).keep([]) == set()


def test_keep_every_keeps_multiples_of_the_interval() -> None:
    assert keep_every(1000).keep(STEPS) == {1000, 2000, 3000}
    assert keep_every(1).keep(STEPS) == set(STEPS)


def test_keep_steps_keeps_only_listed_steps_that_exist() -> None:
    assert keep_steps(500, 2500, 7777).keep(STEPS) == {500, 2500}
    assert keep_steps().keep(STEPS) == set()


def test_keep_all_keeps_everything() -> None:
    assert keep_all().keep(STEPS) == set(STEPS)


def test_policies_ignore_input_order_and_duplicates() -> None:
    assert keep_last(2).keep([3000, 500, 3000, 2500, 1000]) == {2500, 3000}


def test_or_keeps_what_either_keeps_and_and_what_both_keep() -> None:
    assert (keep_last(2) | keep_every(1000)).keep(STEPS) == {1000, 2000, 2500, 3000}
    assert (keep_last(3) & keep_every(1000)).keep(STEPS) == {2000, 3000}
    nested = (keep_last(1) | keep_steps(500)) & keep_every(500)
    assert nested.keep(STEPS) == {500, 3000}
    assert repr(nested) == "((keep_last(1) | keep_steps(500,)) & keep_every(500))"


def test_keep_best_keeps_the_best_scored_steps_and_ranks_no_step_without_the_metric() -> None:
    scores = {500: {"val_loss": 0.5}, 1000: {"val_loss": 0.2}, 1500: {"acc": 0.9},
              2000: {"val_loss": 0.9}, 2500: {"val_loss": 0.2}, 3000: {"val_loss": 0.4}}
    assert keep_best(2, metric="val_loss").keep(STEPS, scores) == {1000, 2500}
    assert keep_best(1, metric="val_loss", mode="max").keep(STEPS, scores) == {2000}
    assert keep_best(2, metric="val_loss").keep(STEPS) == set()
    assert (keep_best(1, metric="val_loss") | keep_last(1)).keep(STEPS, scores) == {2500, 3000}
    combined = keep_best(3, metric="val_loss") & keep_every(1000)
    assert combined.keep(STEPS, scores) == {1000, 3000}
    assert combined.metrics == {"val_loss"}
    assert repr(combined) == "(keep_best(3, metric='val_loss', mode='min') & keep_every(1000))"


def test_a_manifest_records_finite_metrics_and_one_without_them_still_parses() -> None:
    recorded = parse_manifest(Manifest(step=1, metrics={"val_loss": 0.25}).to_json(),
                              source="m")
    assert recorded.metrics == {"val_loss": 0.25}
    document = json.loads(Manifest(step=2).to_json())
    del document["metrics"]  # written before metrics existed
    assert parse_manifest(json.dumps(document).encode(), source="old").metrics == {}
    with pytest.raises(ValueError, match="'val_loss' is nan, not a finite number"):
        Manifest(step=3, metrics={"val_loss": float("nan")})


@pytest.mark.parametrize("scope", ["all", "top"])
def test_prune_with_keep_best_reads_the_metric_each_manifest_recorded(
    tmp_path: Path, scope: str
) -> None:
    store = Storage(tmp_path)
    losses = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.3, 5: 0.7, 6: 0.8}
    for step, loss in losses.items():
        save_checkpoint(store, step, manifest=Manifest(step=step, metrics={"loss": loss}))
    report = prune(store, keep_best(2, metric="loss") | keep_last(1),
                   scope=scope)  # type: ignore[arg-type]
    assert report.deleted == [1, 3, 5]
    assert _committed(tmp_path) == [2, 4, 6]


@pytest.mark.parametrize("make", [lambda: keep_last(0), lambda: keep_every(0),
                                  lambda: keep_last(-1), lambda: keep_best(0, metric="m"),
                                  lambda: keep_best(1, metric="m", mode="low")])
def test_nonsense_policy_arguments_are_refused(make: object) -> None:
    with pytest.raises(ValueError, match="got"):
        make()  # type: ignore[operator]


# -- prune ------------------------------------------------------------------------------


def _committed(root: Path) -> list[int]:
    return [e.step for e in list_checkpoints(Storage(root)) if e.status == "committed"]


def _listing(root: Path) -> list[str]:
    """The root's entries, without the writer generation records."""
    return sorted(name for name in os.listdir(root) if name != GENERATIONS_DIR)


def _stage(store: Storage, step: int, protocol: CommitProtocol | None = None
           ) -> PendingCheckpoint:
    """Begin a save of ``step`` and write one file into it, leaving it unpublished."""
    pending = (protocol or CommitProtocol(store)).begin(step)
    store.write_bytes(f"{pending.staging}/model.bin", b"unfinished")
    return pending


def _rewrite_writer(store: Storage, pending: PendingCheckpoint, **changes: object) -> None:
    path = f"{pending.staging}/{WRITER_FILE}"
    writer = json.loads(store.read_bytes(path))
    writer.update(changes)
    store.write_bytes(path, json.dumps(writer).encode())


def untouched_for(store: Storage, name: str, seconds: float) -> None:
    """Date every entry of ``name`` ``seconds`` back, as the storage itself records times.

    What a staging area looks like when nothing in it changed for that long (its writer's
    own clock, in the writer record, plays no part).
    """
    then = time.time() - seconds
    if store.is_local:
        root = Path(store.path(name))
        for path in [*root.rglob("*"), root]:
            os.utime(path, (then, then))
        return
    memory = store.fs.store  # memory:// (the object store of the unit tests)
    prefix = store.path(name).lstrip("/")
    for key, item in memory.items():
        if key.lstrip("/").startswith(prefix):
            item.created = datetime.fromtimestamp(then, tz=timezone.utc)


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    return child.pid


def test_prune_deletes_only_what_the_policy_drops(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(store, step)
    report = prune(store, keep_last(2) | keep_steps(1))
    assert report.deleted == [2, 3]
    assert report.kept == [1, 4, 5]
    assert _committed(tmp_path) == [1, 4, 5]
    assert _listing(tmp_path) == ["step_000000001", "step_000000004",
                                            "step_000000005"]


def test_prune_never_deletes_the_newest_even_if_the_policy_keeps_nothing(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(store, step)
    report = prune(store, keep_steps())
    assert report.kept == [3]
    assert _committed(tmp_path) == [3]
    verify_checkpoint(store, "step_000000003")


def test_prune_never_deletes_the_step_the_run_resumed_from(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3, 4):
        save_checkpoint(store, step)
    report = prune(store, keep_last(1), protect=[2])
    assert report.deleted == [1, 3]
    assert _committed(tmp_path) == [2, 4]
    verify_checkpoint(store, "step_000000002")


def test_prune_leaves_unreadable_step_directories_alone(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(store, step)
    (tmp_path / "step_000000002" / MANIFEST_NAME).write_text("{ garbled")
    report = prune(store, keep_last(1))
    assert report.deleted == [1]
    assert _listing(tmp_path) == ["step_000000002", "step_000000003"]


def test_prune_never_sweeps_the_staging_of_a_live_writer(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    pending = _stage(store, 2)  # written by this (live) process
    _rewrite_writer(store, pending, started=time.time() - 10 * HOUR)
    untouched_for(store, pending.staging, 10 * HOUR)
    report = prune(store, keep_last(1), sweep_after=HOUR)
    assert report.swept == []
    assert store.exists(f"{pending.staging}/model.bin")


def test_prune_never_sweeps_a_save_in_flight_named_by_its_token(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    pending = _stage(store, 2)
    _rewrite_writer(store, pending, host="another-host", started=time.time() - 10 * HOUR)
    untouched_for(store, pending.staging, 10 * HOUR)
    report = prune(store, keep_all(), sweep_after=HOUR, active_tokens=[pending.token])
    assert report.swept == []
    assert store.exists(f"{pending.staging}/model.bin")


def test_prune_sweeps_abandoned_staging_of_a_dead_writer_after_the_threshold(
    tmp_path: Path, dead_pid: int
) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    old = _stage(store, 2)
    _rewrite_writer(store, old, pid=dead_pid)
    untouched_for(store, old.staging, 2 * HOUR)
    report = prune(store, keep_all(), sweep_after=HOUR)
    assert report.swept == [old.staging]
    assert _listing(tmp_path) == ["step_000000001"]
    verify_checkpoint(store, "step_000000001")


def test_prune_keeps_recent_staging_of_a_dead_writer(tmp_path: Path, dead_pid: int) -> None:
    store = Storage(tmp_path)
    recent = _stage(store, 2)
    _rewrite_writer(store, recent, pid=dead_pid, started=time.time())
    report = prune(store, keep_all(), sweep_after=HOUR)
    assert report.swept == []
    assert store.exists(f"{recent.staging}/model.bin")


def test_staging_from_another_host_is_swept_by_age_alone(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    writer = CommitProtocol(store)  # one writer: a newer one would fence (and sweep) it
    old = _stage(store, 2, writer)
    young = _stage(store, 3, writer)
    _rewrite_writer(store, old, host="elsewhere")
    _rewrite_writer(store, young, host="elsewhere")
    untouched_for(store, old.staging, 2 * HOUR)
    report = prune(store, keep_all(), sweep_after=HOUR)
    assert report.swept == [old.staging]
    assert _listing(tmp_path) == [young.staging]


def test_a_half_deleted_retired_directory_is_swept(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 1)
    save_checkpoint(store, 2)
    # A prune killed after de-committing step 1 (manifest gone) but before deleting it.
    retired = NameFormat().retired_name(1, "feed01")
    os.rename(tmp_path / "step_000000001", tmp_path / retired)
    os.remove(tmp_path / retired / MANIFEST_NAME)
    report = prune(store, keep_all(), sweep_after=0)
    assert report.swept == [retired]
    assert _listing(tmp_path) == ["step_000000002"]


def test_a_dry_run_reports_deletions_and_sweeps_but_deletes_nothing(
    tmp_path: Path, dead_pid: int
) -> None:
    store = Storage(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(store, step)
    abandoned = _stage(store, 4)
    _rewrite_writer(store, abandoned, pid=dead_pid)
    untouched_for(store, abandoned.staging, 2 * HOUR)
    before = store.walk_files()
    report = prune(store, keep_last(1), sweep_after=HOUR, dry_run=True)
    assert report.dry_run
    assert report.deleted == [1, 2]
    assert report.swept == [abandoned.staging]
    assert store.walk_files() == before


def test_prune_sweeps_abandoned_attempts_on_an_object_store(dead_pid: int) -> None:
    store = Storage(f"memory://rk-sweep-{os.getpid()}-{time.monotonic_ns()}")
    try:
        save_checkpoint(store, 1)
        old = _stage(store, 2)
        _rewrite_writer(store, old, pid=dead_pid)
        untouched_for(store, old.staging, 2 * HOUR)
        report = prune(store, keep_all(), sweep_after=HOUR)
        assert report.swept
        assert not store.exists(f"{old.staging}/model.bin")
    finally:
        store.remove_tree("")


def test_a_plain_managers_saves_record_metrics_and_keep_best_prunes_by_them(tmp_path) -> None:
    import torch
    from torch import nn

    from resumekit import CheckpointManager, ConfigurationError, keep_best, keep_last
    from resumekit.store.catalog import list_checkpoints
    from resumekit.store.storage import Storage

    model = nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), 0.1),
                                save_every=1, retention=keep_best(1, metric="val_loss")
                                | keep_last(1))
    manager.restore()
    for step, loss in ((1, 0.5), (2, 0.2), (3, 0.9), (4, 0.7)):
        manager.step_end(step, metrics={"val_loss": loss})
    with pytest.raises(ConfigurationError, match=r"metrics of step 5: 'val_loss' = nan"):
        manager.save(5, metrics={"val_loss": float("nan")})
    manager.close()
    kept = {e.step: e.manifest.metrics for e in list_checkpoints(Storage(tmp_path))
            if e.status == "committed"}
    assert kept == {2: {"val_loss": 0.2}, 4: {"val_loss": 0.7}}
