"""Writer generations: a zombie writer (an old SLURM restart still alive) is fenced.

The story of issue 12: restart 0 of job 4242 saves 100; restart 1 restores 100 and commits
200; restart 0, still alive, tries to commit 300. It must be refused, nothing of restart 1
touched, and no later restore may resume the zombie's state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import resumekit
from resumekit.errors import FencedWriterError, StepCollisionError
from resumekit.manager import CheckpointManager
from resumekit.store import generations
from resumekit.store.catalog import list_checkpoints, read_manifest
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import (
    GENERATIONS_DIR,
    generation_record_name,
    parse_generation_record_name,
)
from resumekit.store.manifest import (
    SCHEMA_VERSION,
    Lineage,
    Manifest,
    WriterGeneration,
    parse_manifest,
)
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.limits import HANG_S

REPO = Path(__file__).resolve().parents[2]
JOB = "4242"


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``restart(n)`` makes this process look like restart ``n`` of SLURM job 4242."""

    def restart(count: int) -> None:
        monkeypatch.setenv("SLURM_JOB_ID", JOB)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(count))

    yield restart


def _manager(root: Path, value: float) -> CheckpointManager:
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return CheckpointManager(root, model=model, retention=None)


def _weight(manager: CheckpointManager) -> float:
    assert manager.state.model is not None
    return float(next(manager.state.model.parameters()).detach().flatten()[0])


def test_the_requeue_story_a_zombie_restart_cannot_commit_after_the_requeued_run_restored(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    tried = refused = 0
    restart(0)  # type: ignore[operator]
    zombie = _manager(tmp_path, 1.0)
    assert zombie.restore() == 0
    zombie.save(100)
    restart(1)  # type: ignore[operator]
    requeued = _manager(tmp_path, 0.0)
    assert requeued.restore() == 100
    with torch.no_grad():
        next(requeued.state.model.parameters()).fill_(2.0)  # type: ignore[union-attr]
    requeued.save(200)
    before = sorted(Storage(tmp_path).walk_files())

    with torch.no_grad():
        next(zombie.state.model.parameters()).fill_(3.0)  # type: ignore[union-attr]
    tried += 1
    with pytest.raises(FencedWriterError) as caught:
        zombie.save(300)
    refused += 1
    message = str(caught.value)
    assert "generation 1 (SLURM job 4242 restart 0" in message
    assert "generation 2 (SLURM job 4242 restart 1" in message
    assert caught.value.step == 300
    assert isinstance(caught.value, PermissionError)
    assert sorted(Storage(tmp_path).walk_files()) == before  # nothing of restart 1 touched

    requeued.save(300)  # no StepCollisionError: the zombie's 300 never existed
    latest = latest_committed(Storage(tmp_path))
    assert latest is not None and latest.manifest is not None
    assert latest.step == 300
    assert latest.manifest.generation is not None
    assert latest.manifest.generation.slurm_restart_count == 1

    restart(2)  # type: ignore[operator]
    resumed = _manager(tmp_path, 0.0)
    assert resumed.restore() == 300
    assert _weight(resumed) == 2.0  # restart 1's weights, never the zombie's 3.0
    assert (tried, refused) == (1, 1)


def test_a_zombie_that_began_before_the_claim_is_refused_at_the_commit_point(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    restart(0)  # type: ignore[operator]
    zombie = _manager(tmp_path, 1.0)
    zombie.save(100)
    store = Storage(tmp_path)
    pending = zombie._main.protocol.begin(300)  # the zombie's save is under way...
    store.write_bytes(f"{pending.staging}/model.bin", b"zombie weights")
    restart(1)  # type: ignore[operator]
    requeued = _manager(tmp_path, 0.0)
    assert requeued.restore() == 100  # ...when the requeued run claims the root
    with pytest.raises(FencedWriterError, match="refusing to commit step 300"):
        zombie._main.protocol.publish(pending, Manifest(step=300))
    assert not store.exists(pending.staging)  # its staging is gone, nothing committed
    assert [e.step for e in list_checkpoints(store) if e.status == "committed"] == [100]
    requeued.save(300)
    assert latest_committed(store).step == 300  # type: ignore[union-attr]


def _zombie_commit_inside_the_window(root: Path, restart: Any) -> CheckpointManager:
    """Restart 0 saves 100; restart 1 claims the root (restoring 100) while restart 0,
    already past its last fence check, renames step 300 in: the one race window.
    Returns restart 1's manager."""
    store = Storage(root)
    restart(0)
    _manager(root, 1.0).save(100)
    claimed: list[CheckpointManager] = []

    def requeue_inside_the_window(phase: str) -> None:
        if phase == "publish":  # after the last fence check, before the rename
            restart(1)
            claimed.append(_manager(root, 0.0))
            assert claimed[0].restore() == 100

    zombie = CommitProtocol(store, on_phase=requeue_inside_the_window)
    restart(0)
    pending = zombie.begin(300)
    store.write_bytes(f"{pending.staging}/model.bin", b"zombie weights")
    zombie.publish(pending, Manifest(step=300))  # the one window: the rename goes through
    return claimed[0]


def test_a_zombie_commit_inside_the_race_window_is_never_restored_and_never_suggests_replace(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    requeued = _zombie_commit_inside_the_window(tmp_path, restart)
    with pytest.raises(StepCollisionError) as caught:
        requeued.save(300)
    assert "replace=True" not in str(caught.value)
    assert "generation 1 (SLURM job 4242 restart 0" in str(caught.value)
    assert "generation 2 (SLURM job 4242 restart 1" in str(caught.value)
    requeued.save(250)  # the zombie's 300 does not count as the newest step

    restart(2)  # type: ignore[operator]
    resumed = _manager(tmp_path, 0.0)
    with pytest.warns(ResumekitWarning, match="not restoring from .*step_000000300") as seen:
        assert resumed.restore() == 250
    assert any("generation 1 (SLURM job 4242 restart 0" in str(w.message) for w in seen)
    assert any("generation 2 (SLURM job 4242 restart 1" in str(w.message) for w in seen)


def test_an_older_restart_cannot_claim_a_root_a_newer_restart_of_its_job_claimed(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    restart(1)  # type: ignore[operator]
    _manager(tmp_path, 0.0).save(10)
    restart(0)  # type: ignore[operator]
    late_zombie = _manager(tmp_path, 1.0)
    with pytest.raises(FencedWriterError, match=r"restart 0.*later restart of the same job"):
        late_zombie.restore()
    with pytest.raises(FencedWriterError):
        late_zombie.save(20)  # never restored: its first save tries to claim, and fails
    assert [e.step for e in list_checkpoints(Storage(tmp_path))] == [10]


def test_two_managers_of_one_slurm_allocation_share_a_generation(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    restart(3)  # type: ignore[operator]
    first = _manager(tmp_path, 0.0)
    first.restore()
    second = _manager(tmp_path, 0.0)
    second.restore()
    first.save(1)
    second.save(2)
    first.save(3)
    assert [e.step for e in list_checkpoints(Storage(tmp_path))] == [1, 2, 3]


def test_without_slurm_the_manager_that_restored_last_owns_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, another_process: Any,
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    old = _manager(tmp_path, 0.0)
    old.save(1)
    another_process(1)  # the requeued run is another process than the zombie
    new = _manager(tmp_path, 0.0)
    assert new.restore() == 1
    with pytest.raises(FencedWriterError):
        old.save(2)
    new.save(2)


def test_a_manager_on_a_root_it_cannot_write_restores_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, another_process: Any,
) -> None:
    _manager(tmp_path, 5.0).save(7)
    another_process(1)  # an eval job: another process

    def refuse(self: Storage, relative: str, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", self.path(relative))

    monkeypatch.setattr(Storage, "write_bytes_exclusive", refuse)
    reader = _manager(tmp_path, 0.0)
    with pytest.warns(ResumekitWarning, match="cannot record this run's writer generation"):
        assert reader.restore() == 7
    assert _weight(reader) == 5.0


def test_the_manifest_records_the_generation_and_older_manifests_still_read(
    tmp_path: Path,
) -> None:
    store = Storage(tmp_path)
    _manager(tmp_path, 0.0).save(5)
    manifest = read_manifest(store, "step_000000005")
    assert manifest.generation is not None and manifest.generation.number == 1
    document = json.loads(manifest.to_json())
    del document["generation"]  # as a resumekit before generations wrote it
    old = parse_manifest(json.dumps(document).encode(), source="old manifest")
    assert old.generation is None
    assert generations.zombie_reason(old, generations.newest_generation(store)) is None


_ZOMBIE = """
import json, os, sys, time
from pathlib import Path
import torch
from resumekit.manager import CheckpointManager
from resumekit.errors import FencedWriterError
root, ready, go = sys.argv[1:4]
model = torch.nn.Linear(4, 2)
ckpt = CheckpointManager(root, model=model, retention=None)
ckpt.restore()
ckpt.save(100)
Path(ready).write_text("saved")
deadline = time.monotonic() + 120
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no go file")
    time.sleep(0.05)
try:
    ckpt.save(300)
    print(json.dumps({"refused": False}))
except FencedWriterError as error:
    print(json.dumps({"refused": True, "message": str(error), "newer": error.newer}))
"""


def test_a_real_zombie_process_is_fenced_by_the_requeued_run_in_another_process(
    tmp_path: Path, slurm: object,
) -> None:
    restart = slurm
    root, ready, go = tmp_path / "ckpt", tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    zombie = subprocess.Popen(
        [sys.executable, "-c", _ZOMBIE, str(root), str(ready), str(go)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert zombie.poll() is None, zombie.communicate()
            assert time.monotonic() < deadline, "the zombie never saved step 100"
            time.sleep(0.05)
        restart(1)  # type: ignore[operator]
        requeued = _manager(root, 2.0)
        assert requeued.restore() == 100
        requeued.save(200)
        go.write_text("go")
        out, err = zombie.communicate(timeout=HANG_S)
    finally:
        if zombie.poll() is None:
            zombie.kill()
    assert zombie.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["refused"], result
    assert "SLURM job 4242 restart 0" in result["message"]
    assert "SLURM job 4242 restart 1" in result["newer"]
    assert [e.step for e in list_checkpoints(Storage(root))] == [100, 200]


# -- the order of generations -----------------------------------------------------------

identities = st.tuples(st.sampled_from([None, "7", "8"]), st.integers(0, 3))


@settings(max_examples=40, deadline=None)
@given(st.lists(identities, min_size=1, max_size=24))
def test_claims_are_totally_ordered_and_only_the_newest_may_commit(
    claims: list[tuple[str | None, int]],
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = Storage(directory)
        held: list[WriterGeneration] = []
        records: list[WriterGeneration] = []  # the model: every record created, in order
        for index, (job, count) in enumerate(claims):
            # outside SLURM every claim here is another process (pid): a new generation
            identity = Lineage(hostname="h", pid=1000 + index, slurm_job_id=job,
                               slurm_restart_count=count if job else None)
            kept = records[-generations.RECORDS_KEPT:]
            if job is not None and any(r.slurm_job_id == job
                                       and (r.slurm_restart_count or 0) > count
                                       for r in kept):
                with pytest.raises(FencedWriterError):
                    generations.claim(store, newest_step=None, identity=identity)
                continue
            claimed = generations.claim(store, newest_step=None, identity=identity)
            if records and job is not None and records[-1].slurm_job_id == job \
                    and records[-1].slurm_restart_count == count:
                assert claimed == records[-1]  # same allocation: same generation
            else:
                assert claimed.number == len(records) + 1  # strictly increasing, no gaps
                records.append(claimed)
            held.append(claimed)
            newest = records[-1]
            for generation in held:
                if generation.token == newest.token:
                    generations.check(store, generation, action="commit")
                else:
                    assert generations.fenced_by(generation, newest)
                    with pytest.raises(FencedWriterError):
                        generations.check(store, generation, action="commit")
        for a in records:
            for b in records:
                if a.token != b.token:
                    assert generations.fenced_by(a, b) != generations.fenced_by(b, a)
        assert len(os.listdir(Path(directory) / GENERATIONS_DIR)) == \
            min(len(records), generations.RECORDS_KEPT)


def test_a_checkpoint_is_a_zombies_only_if_an_older_generation_committed_it_after_a_claim(
) -> None:
    claim = WriterGeneration(number=3, token="c", newest_step=200, reads_schema=SCHEMA_VERSION)
    older = WriterGeneration(number=2, token="b")
    lost_race = WriterGeneration(number=3, token="x")
    assert generations.zombie_reason(Manifest(step=200, generation=older), claim) is None
    assert generations.zombie_reason(Manifest(step=300, generation=older), claim)
    assert generations.zombie_reason(Manifest(step=300, generation=lost_race), claim)
    assert generations.zombie_reason(Manifest(step=300, generation=claim), claim) is None
    assert generations.zombie_reason(Manifest(step=300), claim) is None
    empty = WriterGeneration(number=1, token="a", newest_step=None, reads_schema=SCHEMA_VERSION)
    assert generations.zombie_reason(Manifest(step=0, generation=older), empty) is None
    assert generations.zombie_reason(
        Manifest(step=0, generation=WriterGeneration(number=0 + 1, token="z")), empty)


def test_a_pruned_successor_record_still_fences_the_old_writer(tmp_path: Path) -> None:
    store = Storage(tmp_path)

    def process(pid: int) -> Lineage:
        return Lineage(hostname="h", pid=pid)

    first = generations.claim(store, newest_step=None, identity=process(1))
    for pid in range(2, generations.RECORDS_KEPT + 4):
        generations.claim(store, newest_step=None, identity=process(pid))
    assert not store.exists(generation_record_name(first.number + 1))  # pruned
    with pytest.raises(FencedWriterError):
        generations.check(store, first, action="commit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generations.check(store, generations.newest_generation(store),  # type: ignore[arg-type]
                          action="commit")


def test_managers_one_process_builds_one_after_another_share_its_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An eval loop or a benchmark building a manager per round is one run, not zombies.
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = _manager(tmp_path, 1.0)
    first.save(1)
    second = _manager(tmp_path, 0.0)
    assert second.restore() == 1
    first.save(2)
    assert first.restore() == 2
    records = [name for name in os.listdir(tmp_path / GENERATIONS_DIR)
               if parse_generation_record_name(name) is not None]  # (not the newest-step hint)
    assert len(records) == 1


def test_a_read_only_manager_restores_without_fencing_the_run_writing_there(
    tmp_path: Path, another_process: Any,
) -> None:
    trainer = _manager(tmp_path, 4.0)
    trainer.save(10)
    another_process(1)  # an eval job
    evaluator = CheckpointManager(tmp_path, model=nn.Linear(4, 2), read_only=True)
    assert evaluator.restore() == 10
    assert _weight(evaluator) == 4.0
    trainer.save(20)  # not fenced: the eval job claimed nothing
    with pytest.raises(resumekit.ConfigurationError, match="read_only"):
        evaluator.save(30)


def test_latest_and_inspect_name_the_checkpoint_restore_would_start_from_not_a_zombie_commit(
    tmp_path: Path, slurm: object,
) -> None:
    store = Storage(tmp_path)
    claimed = [_zombie_commit_inside_the_window(tmp_path, slurm)]
    assert latest_committed(store).step == 300  # type: ignore[union-attr]

    with pytest.warns(ResumekitWarning, match=r"passing over .*step_000000300.*fenced"):
        info = claimed[0].latest()
    assert info is not None and info.step == 100
    claimed[0].save(250)
    with pytest.warns(ResumekitWarning, match=r"passing over .*step_000000300"):
        info = claimed[0].latest()
    assert info is not None and info.step == 250

    listing = subprocess.run(
        [sys.executable, "-m", "resumekit", "inspect", str(tmp_path), "--json"],
        capture_output=True, text=True, check=True, cwd=REPO)
    document = json.loads(listing.stdout)
    assert document["resume_from"] == 250
    rows = {row["step"]: row for row in document["checkpoints"]}
    assert rows[300]["status"] == "committed" and not rows[300]["resume_from"]
    assert "fenced writer" in rows[300]["problem"]
    assert "restore never resumes from it" in rows[300]["problem"]
    assert rows[250]["resume_from"]
    one = subprocess.run(
        [sys.executable, "-m", "resumekit", "inspect", str(tmp_path / "step_000000300"),
         "--json"], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(one.stdout)["resume_from"] == 250
