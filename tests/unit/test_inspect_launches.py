"""``resumekit inspect``: a run's launches and its goodput, from its lineage (issue 38).

The figures come from the manifests alone: each launch's start (``Lineage.started_at``),
its checkpoints' publication times and reasons, the step it resumed from and the seconds
its saves held training (``Manifest.save_stalls``). The arithmetic is checked on manifests
with chosen times; real saves across simulated launches check what the manager records
and what inspect prints, against the manifests read back (no wall-time figure asserted).
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import CheckpointManager, LocalTier
from resumekit.runtime.save_clock import CommitClock
from resumekit.store.launches import goodput_of, launches_of
from resumekit.store.manifest import (
    Lineage,
    Manifest,
    SaveReason,
    SaveStalls,
    WriterGeneration,
    parse_manifest,
)
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import Trainer, run_cli, run_json, slurm_env

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def saved(step: int, seconds: float, *, restart: int, started: float | None,
          resumed: int | None, stalls: tuple[float, int] | None,
          reason: SaveReason = SaveReason.INTERVAL,
          generation: WriterGeneration | None = None) -> Manifest:
    """The manifest of ``step``, published ``seconds`` after T0 by SLURM job 100's restart."""
    lineage = Lineage(hostname="node1", pid=1000 + restart, slurm_job_id="100",
                      slurm_restart_count=restart, resumed_from_step=resumed,
                      started_at=None if started is None else at(started))
    return Manifest(step=step, created_at=at(seconds), reason=reason, lineage=lineage,
                    generation=generation,
                    save_stalls=None if stalls is None else SaveStalls(seconds=stalls[0],
                                                                     saves=stalls[1]))


def three_launches() -> list[Manifest]:
    """One second a step in every launch; the restart gaps and stalls below.

    Launch 1 starts at 0 from step 0, saves 100 (at 110 s, 10 s of stalls) and 200 (220 s,
    20 s) and crashes. Launch 2 starts at 520 s from 200, saves 300 (630 s) and is
    preempted at 350 (685 s, 15 s of stalls). Its emergency checkpoint is lost; launch 3
    starts at 800 s from 300 (it trains 300-350 again) and finishes at 400 (910 s).
    """
    return [
        saved(100, 110, restart=0, started=0, resumed=None, stalls=(10, 1)),
        saved(200, 220, restart=0, started=0, resumed=None, stalls=(20, 2)),
        saved(300, 630, restart=1, started=520, resumed=200, stalls=(10, 1)),
        saved(350, 685, restart=1, started=520, resumed=200, stalls=(15, 2),
              reason=SaveReason.PREEMPTION),
        saved(400, 910, restart=2, started=800, resumed=300, stalls=(10, 1),
              reason=SaveReason.FINAL),
    ]


def test_launches_are_told_apart_and_each_gets_its_restart_gap_retrained_steps_and_stalls(
) -> None:
    launches = launches_of(three_launches())
    assert [(launch.index, launch.steps) for launch in launches] == [
        (1, (100, 200)), (2, (300, 350)), (3, (400,))]
    assert [launch.ended for launch in launches] == ["unknown", "preempted", "finished"]
    assert [launch.restart_gap_s for launch in launches] == [None, 300.0, 115.0]
    # Launch 1 may have trained past 200 before it crashed: 0 is a lower bound. Launch 2
    # was preempted at 350, its last trained step: launch 3 trained 300-350 again.
    assert [launch.steps_trained_again for launch in launches] == [None, 0, 50]
    assert [launch.trained_again_exact for launch in launches] == [True, False, True]
    assert [launch.save_stalls_s for launch in launches] == [20.0, 15.0, 10.0]
    assert [launch.save_stall_count for launch in launches] == [2, 2, 1]
    assert [launch.trained_steps for launch in launches] == [200, 150, 100]
    assert [launch.step_s for launch in launches] == [1.0, 1.0, 1.0]
    assert all(launch.start_source == "recorded" for launch in launches)


def test_the_goodput_is_useful_step_time_over_wall_time_and_its_losses_add_up() -> None:
    goodput = goodput_of(launches_of(three_launches()))
    assert goodput.wall_s == 910.0
    assert goodput.useful_s == 400.0  # 200 + 150 + (100 - 50) steps of one second
    assert (goodput.restart_gaps_s, goodput.save_stalls_s, goodput.trained_again_s) == (
        415.0, 45.0, 50.0)
    assert goodput.fraction == pytest.approx(400 / 910)
    assert goodput.upper_bound  # launch 2's steps trained again is a lower bound
    assert goodput.missing is None
    document = goodput.to_json()
    assert document["goodput"] == pytest.approx(400 / 910)
    assert "useful training time / wall time" in document["method"]


def test_checkpoints_written_before_the_start_and_stalls_were_recorded_say_unknown() -> None:
    claim = WriterGeneration(number=2, token="b", claimed_at=at(500))
    old = [manifest.model_copy(update={
        "lineage": manifest.lineage.model_copy(update={"started_at": None}),
        "save_stalls": None,
        "generation": claim if manifest.step >= 300 else WriterGeneration(
            number=1, token="a", claimed_at=at(100))})
        for manifest in three_launches()[:3]]
    launches = launches_of(old)
    assert [launch.steps for launch in launches] == [(100, 200), (300,)]
    # A fresh start claims the root at its first save: not its start.
    assert (launches[0].started_at, launches[0].start_source) == (None, None)
    # A resumed launch claimed the root as it restored: its start, said so.
    assert (launches[1].started_at, launches[1].start_source) == (at(500), "restore's claim")
    assert launches[1].restart_gap_s == 280.0
    assert [launch.save_stalls_s for launch in launches] == [None, None]
    goodput = goodput_of(launches)
    assert goodput.fraction is None
    assert goodput.missing is not None and "launch 1 (steps 100-200) records no start" \
        in goodput.missing


def test_a_relaunch_sharing_the_previous_launchs_writer_generation_has_no_claimed_start(
) -> None:
    """torchrun restarting inside one SLURM allocation shares its generation: that claim
    was the first launch's, not the relaunch's start."""
    claim = WriterGeneration(number=1, token="a", claimed_at=at(5))
    first = Manifest(step=10, created_at=at(50), generation=claim,
                     lineage=Lineage(hostname="n", pid=1, slurm_job_id="9",
                                     slurm_restart_count=0))
    again = Manifest(step=20, created_at=at(90), generation=claim,
                     lineage=Lineage(hostname="n", pid=2, slurm_job_id="9",
                                     slurm_restart_count=0, resumed_from_step=10))
    launches = launches_of([first, again])
    assert len(launches) == 2
    assert (launches[1].started_at, launches[1].restart_gap_s) == (None, None)


def test_a_recorded_start_or_stalls_that_do_not_parse_are_dropped_with_a_warning() -> None:
    document = json.loads(three_launches()[0].to_json())
    document["lineage"]["started_at"] = "yesterday"
    document["save_stalls"] = {"seconds": -3, "saves": 1}
    with pytest.warns(ResumekitWarning) as caught:
        manifest = parse_manifest(json.dumps(document).encode(), source="r/step_100")
    assert manifest.step == 100  # the checkpoint itself reads
    assert manifest.lineage.started_at is None and manifest.save_stalls is None
    said = " ".join(str(warning.message) for warning in caught)
    assert "r/step_100: ignoring its lineage.started_at" in said
    assert "r/step_100: ignoring its save_stalls" in said


# --------------------------------------------------------------------------- real saves


@pytest.fixture(scope="module")
def relaunched_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SLURM job 7: restart 0 saves 10, 20 and dies; restart 1 resumes from 20, saves 30
    and is preempted at 40; restart 2 resumes from 40 and finishes at 50."""
    root = tmp_path_factory.mktemp("relaunched") / "run"
    with slurm_env("7", 0):
        first = Trainer(root)
        first.save(10, reason="interval")
        first.save(20, reason="interval")
        first.close()
    with slurm_env("7", 1):
        second = Trainer(root)
        assert second.manager.restore() == 20
        second.save(30, reason="interval")
        second.save(40, reason="preemption")
        second.close()
    with slurm_env("7", 2):
        third = Trainer(root)
        assert third.manager.restore() == 40
        third.save(50, reason="final")
        third.close()
    return root


def manifest_of(root: Path, step: int) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        (root / f"step_{step:09d}" / "manifest.json").read_text())
    return document


def seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def test_each_save_records_its_launchs_start_and_the_seconds_its_saves_held_training(
        relaunched_root: Path) -> None:
    manifests = {step: manifest_of(relaunched_root, step) for step in (10, 20, 30, 40, 50)}
    starts = {step: manifest["lineage"]["started_at"] for step, manifest in manifests.items()}
    assert starts[10] == starts[20] != starts[30] == starts[40] != starts[50]
    for step in (10, 30, 50):  # the manager was built before its first save
        assert seconds_between(starts[step], manifests[step]["created_at"]) >= 0
    stalls = {step: manifest["save_stalls"] for step, manifest in manifests.items()}
    # Counted per launch, each save up to its publication: they only grow in a launch.
    assert [stalls[step]["saves"] for step in (10, 20, 30, 40, 50)] == [1, 2, 1, 2, 1]
    assert 0 < stalls[10]["seconds"] <= stalls[20]["seconds"]
    assert 0 < stalls[30]["seconds"] <= stalls[40]["seconds"]
    # A blocking save holds training at least for its own write phase.
    assert stalls[10]["seconds"] >= manifests[10]["save_throughput"]["seconds"]


def test_inspect_json_lists_the_launches_and_the_goodput_from_the_manifests(
        relaunched_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = run_json(capsys, "inspect", str(relaunched_root))
    assert code == 0
    assert len(document["chain"]) == 3  # the existing keys stay
    launches = document["launches"]
    assert [(item["launch"], item["slurm_restart_count"], item["resumed_from_step"],
             item["first_step"], item["last_step"], item["saves"], item["ended"])
            for item in launches] == [
        (1, 0, None, 10, 20, 2, "unknown"), (2, 1, 20, 30, 40, 2, "preempted"),
        (3, 2, 40, 50, 50, 1, "finished")]
    assert [(item["steps_trained_again"], item["steps_trained_again_exact"])
            for item in launches] == [(None, True), (0, False), (0, True)]
    manifests = {step: manifest_of(relaunched_root, step) for step in (10, 20, 30, 40, 50)}
    assert launches[0]["restart_gap_seconds"] is None
    assert launches[1]["restart_gap_seconds"] == pytest.approx(seconds_between(
        manifests[20]["created_at"], manifests[30]["lineage"]["started_at"]))
    assert launches[2]["restart_gap_seconds"] == pytest.approx(seconds_between(
        manifests[40]["created_at"], manifests[50]["lineage"]["started_at"]))
    assert [item["save_stall_seconds"] for item in launches] == [
        manifests[step]["save_stalls"]["seconds"] for step in (20, 40, 50)]
    goodput = document["goodput"]
    assert goodput["missing"] is None and goodput["upper_bound"] is True
    wall = seconds_between(manifests[10]["lineage"]["started_at"], manifests[50]["created_at"])
    assert goodput["wall_seconds"] == pytest.approx(wall)
    assert goodput["useful_seconds"] + goodput["restart_gap_seconds"] + \
        goodput["save_stall_seconds"] + goodput["trained_again_seconds"] == pytest.approx(wall)
    assert goodput["goodput"] == pytest.approx(goodput["useful_seconds"] / wall)


def test_inspect_prints_a_launches_table_and_the_goodput_with_its_method(
        relaunched_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "inspect", str(relaunched_root))
    assert code == 0, err
    section = out[out.index("Launches (goodput)"):]
    rows = [line.split() for line in section.splitlines() if line.strip()[:1].isdigit()]
    assert [row[:5] for row in rows] == [["1", "7", "0", rows[0][3], "-"],
                                         ["2", "7", "1", rows[1][3], "20"],
                                         ["3", "7", "2", rows[2][3], "40"]]
    assert "preempted" in section and "finished" in section and ">= 0" in section
    assert "Goodput: at most " in section and "(method: useful training time" in section


def test_async_saves_count_their_staging_as_held_and_a_launch_without_a_start_says_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(8, 8)
    manager = CheckpointManager(tmp_path / "run", model=model, async_save=True,
                                retention=None)
    with torch.no_grad():
        for step in (1, 2, 3):
            model.weight.add_(1.0)
            manager.save(step)
    manager.close()
    stalls = [manifest_of(tmp_path / "run", step)["save_stalls"] for step in (1, 2, 3)]
    assert [record["saves"] for record in stalls] == [1, 2, 3]
    assert stalls[0]["seconds"] <= stalls[1]["seconds"] <= stalls[2]["seconds"]
    # The older release's checkpoint beside them records neither start nor stalls.
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / "schema_2" / "root", old)
    code, document, _ = run_json(capsys, "inspect", str(old))
    assert code == 0
    (launch,) = document["launches"]
    assert (launch["started_at"], launch["save_stall_seconds"]) == (None, None)
    assert document["goodput"]["goodput"] is None
    assert "records no start" in document["goodput"]["missing"]
    code, out, _ = run_cli(capsys, "inspect", str(old))
    assert "Goodput: unknown (launch 1 (step" in out and "unknown" in out


def test_a_local_tiers_saves_count_among_the_saves_that_held_training(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with pytest.warns(ResumekitWarning, match="no copy is replicated"), CheckpointManager(
            tmp_path / "durable", model=model, optimizer=optimizer, save_every=2,
            local=LocalTier(tmp_path / "local", 1)) as manager:
        for step in (1, 2, 3, 4):
            manager.step_end(step)
    # A step's durable save comes before its local one: step 2 counts local 1 and
    # itself; step 4 local 1, 2, 3, durable 2 and itself.
    assert manifest_of(tmp_path / "durable", 2)["save_stalls"]["saves"] == 2
    assert manifest_of(tmp_path / "durable", 4)["save_stalls"]["saves"] == 5


def test_the_clock_counts_what_saves_held_and_a_blocking_save_up_to_its_publication() -> None:
    clock = CommitClock()
    clock.held(2.5)
    clock.held(float("nan"))  # measures nothing
    assert clock.stalls(None) == SaveStalls(seconds=2.5, saves=1)

    def failing_save() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        clock.hold(failing_save)  # a save that failed held training all the same
    assert clock.saves_held == 2
    publishing = clock.stalls(time.monotonic())  # a blocking save still under way
    assert publishing.saves == 3 and publishing.seconds >= 2.5
    assert clock.started_at.tzinfo is not None
