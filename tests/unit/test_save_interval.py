"""save_every="auto": the Young/Daly rule, the root's history, and the manager's interval."""

from __future__ import annotations

import itertools
import json
import logging
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from torch import nn

import resumekit
from resumekit.errors import ConfigurationError
from resumekit.manager import CheckpointManager
from resumekit.runtime.save_interval import (
    INTERRUPTIONS_EVERY_PRIOR,
    AutoSaveEvery,
    auto_interval,
    history_interruptions,
    interruptions_every,
)
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import WriterGeneration
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import run_cli, run_json


def test_the_interval_is_the_square_root_of_twice_the_blocking_cost_times_the_mtbi() -> None:
    chosen = auto_interval(step_s=30.0, blocking_s=7.5, write_s=7.5,
                           interruptions_every_s=45_000.0, overlapped=False)
    assert chosen.young_daly_s == pytest.approx(math.sqrt(2 * 7.5 * 45_000.0))
    assert chosen.steps == round(math.sqrt(2 * 7.5 * 45_000.0) / 30.0) == 27
    assert "sqrt(2 x 7.50 x 45000)" in chosen.inputs


def test_a_cheaper_save_or_more_interruptions_shorten_the_interval() -> None:
    def steps(blocking: float, mtbi: float) -> int:
        return auto_interval(step_s=10.0, blocking_s=blocking, write_s=0.0,
                             interruptions_every_s=mtbi, overlapped=False).steps

    assert steps(0.5, 10_000.0) < steps(5.0, 10_000.0)
    assert steps(5.0, 1_000.0) < steps(5.0, 10_000.0)


def test_a_background_save_is_never_due_before_the_previous_write_can_end() -> None:
    # A free staging copy would ask for a save every step; the write takes 45 s.
    chosen = auto_interval(step_s=10.0, blocking_s=0.0, write_s=45.0,
                           interruptions_every_s=3600.0, overlapped=True)
    assert chosen.steps == chosen.floor_steps == 5
    assert "at least 5 steps (the write)" in chosen.inputs
    blocking = auto_interval(step_s=10.0, blocking_s=0.0, write_s=45.0,
                             interruptions_every_s=3600.0, overlapped=False)
    assert blocking.steps == 1  # a blocking save holds its write itself


def test_nonsense_inputs_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match="step_s=0"):
        auto_interval(step_s=0, blocking_s=1, write_s=1, interruptions_every_s=1,
                      overlapped=False)
    with pytest.raises(ValueError, match="blocking_s=-1"):
        auto_interval(step_s=1, blocking_s=-1, write_s=1, interruptions_every_s=1,
                      overlapped=False)


def test_the_mtbi_is_training_seconds_over_interruptions_that_lost_work() -> None:
    assert interruptions_every([3600.0, 1800.0], 3) == 1800.0
    assert interruptions_every([3600.0], 0) is None


def _claim(storage_root: Path, number: int, newest: int | None, at: datetime) -> None:
    folder = storage_root / ".resumekit-generations"
    folder.mkdir(exist_ok=True)
    record = WriterGeneration(number=number, token=f"t{number}", claimed_at=at,
                              newest_step=newest)
    (folder / f"{number:012d}.json").write_text(record.model_dump_json())


def test_the_roots_history_counts_relaunches_not_covered_by_a_preemption_save(
        tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path, model=model)
    for step, reason in ((10, "interval"), (20, "preemption")):
        manager.save(step, reason=reason)
    manager.close()
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for entry in (tmp_path / ".resumekit-generations").iterdir():
        entry.unlink()  # the manager's own claim: replaced by the history below
    _claim(tmp_path, 1, None, start)
    _claim(tmp_path, 2, 10, start + timedelta(hours=2))  # relaunched from an interval save
    _claim(tmp_path, 3, 20, start + timedelta(hours=4))  # after a committed preemption save
    storage = CheckpointManager(tmp_path, model=model, read_only=True).storage
    seconds, said = history_interruptions(storage, NameFormat(),
                                          now=start + timedelta(hours=6))
    assert seconds == 6 * 3600.0  # 1 of 2 relaunches lost work in 6 hours
    assert "1 of 2 relaunches" in said
    _claim(tmp_path, 4, 99, start + timedelta(hours=5))  # a step no longer in the root
    seconds, _ = history_interruptions(storage, NameFormat(), now=start + timedelta(hours=6))
    assert seconds == 3 * 3600.0


def test_a_root_without_history_takes_the_prior_and_the_override_wins(
        tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(tmp_path / "a", model=model, save_every="auto") as manager:
        assert manager._auto_every is not None
        assert manager._auto_every.interruptions_every_s == INTERRUPTIONS_EVERY_PRIOR
        assert "prior" in manager._auto_every.source
        assert manager.save_interval is None  # nothing chosen before a save was timed
    with CheckpointManager(tmp_path / "b", model=model, save_every="auto",
                           interruptions_every=600.0) as manager:
        assert manager._auto_every is not None
        assert manager._auto_every.interruptions_every_s == 600.0


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_manager_saves_at_the_interval_its_measurements_choose_and_logs_a_change(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock()
    saved: list[int] = []
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                                save_every="auto", interruptions_every=3600.0)
    assert manager._auto_every is not None
    manager._auto_every.clock = clock
    real_save = CheckpointManager.save

    def timed_save(self: CheckpointManager, step: int, **kwargs: object) -> None:
        real_save(self, step, **kwargs)  # type: ignore[arg-type]
        clock.now += 2.0  # every save holds training 2 s on the fake clock
        saved.append(step)

    monkeypatch.setattr(CheckpointManager, "save", timed_save)
    caplog.set_level(logging.INFO, logger="resumekit")
    start = manager.restore()
    for step in range(start + 1, 80):
        clock.now += 10.0  # a 10 s step
        manager.step_end(step)
    manager.close()
    # Step 1 is not timed; step 2 is, and saves at once (it measures a save's cost);
    # then sqrt(2 x 2 x 3600) = 120 s = 12 steps.
    assert saved[:3] == [2, 14, 26]
    assert manager.save_interval == 12
    assert all(b - a == 12 for a, b in itertools.pairwise(saved))
    changes = [r.getMessage() for r in caplog.records if "save_every='auto'" in r.getMessage()]
    assert len(changes) == 1  # logged once: the interval did not change after
    assert "every 12 steps from step 2" in changes[0]
    assert "sqrt(2 x 2.00 x 3600) = 120 s" in changes[0]
    # resumekit inspect shows the interval in force when each checkpoint was written.
    code, document, _ = run_json(capsys, "inspect", str(tmp_path))
    assert code == 0
    rows = {row["step"]: row for row in document["checkpoints"]}
    newest = rows[saved[-1]]["save_interval"]
    assert newest["steps"] == 12 and newest["auto"]
    assert "interruptions_every= (given)" in newest["inputs"]
    code, out, _ = run_cli(capsys, "inspect", rows[saved[-1]]["path"])
    assert code == 0 and "every 12 steps (save_every='auto'" in out


def test_a_fixed_interval_is_recorded_for_inspect_too(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(tmp_path, model=model, save_every=5) as manager:
        manager.restore()
        assert manager.save_interval == 5
        for step in range(1, 6):
            manager.step_end(step)
    code, document, _ = run_json(capsys, "inspect", str(tmp_path))
    assert code == 0
    assert document["checkpoints"][0]["save_interval"] == {"steps": 5, "auto": False,
                                                           "inputs": ""}


def test_the_auto_state_starts_no_save_before_a_step_was_timed() -> None:
    clock = FakeClock()
    auto = AutoSaveEvery(3600.0, "test", clock=clock)
    auto.step_ended(1)
    assert not auto.due(1)
    auto.step_returned(1)
    clock.now += 5.0
    auto.step_ended(2)
    assert auto.due(2) and auto.step_seconds == 5.0
    proposal = auto.propose(blocking_s=0.5, write_s=0.0, overlapped=False)
    assert auto.adopt(2, proposal.steps, proposal)
    assert not auto.adopt(2 + proposal.steps, proposal.steps, proposal)  # unchanged


def test_a_local_tier_with_save_every_auto_saves_at_its_own_measured_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock()
    local_saves: list[int] = []
    manager = CheckpointManager(
        tmp_path / "durable", model=model, optimizer=optimizer, save_every=1000,
        interruptions_every=1800.0,
        local=resumekit.LocalTier(tmp_path / "local", save_every="auto", replicas=False))
    assert manager._local_auto is not None and manager._auto_every is None
    manager._local_auto.clock = clock
    real = CheckpointManager._save_local

    def timed_local(self: CheckpointManager, step: int, *args: object) -> None:
        real(self, step, *args)  # type: ignore[arg-type]
        clock.now += 0.25  # a local save holds training 0.25 s
        local_saves.append(step)

    monkeypatch.setattr(CheckpointManager, "_save_local", timed_local)
    for step in range(manager.restore() + 1, 40):
        clock.now += 5.0
        manager.step_end(step)
    manager.close()
    # sqrt(2 x 0.25 x 1800) = 30 s = 6 steps of 5 s; the first at the first timed step.
    assert local_saves[:3] == [2, 8, 14]
    assert manager.local_save_interval == 6
    assert manager.save_interval == 1000


def test_a_local_tier_with_save_every_auto_holds_at_least_its_background_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Local saves write in the background: the blocking time is the staging copy, and
    # the interval is floored by the last local write measured (issue 38.2).
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(
        tmp_path / "durable", model=model, optimizer=optimizer, save_every=1000,
        interruptions_every=1800.0,
        local=resumekit.LocalTier(tmp_path / "local", save_every="auto", replicas=False))
    seen: list[tuple[dict[str, object], float | None]] = []
    real = AutoSaveEvery.propose

    def spy(self: AutoSaveEvery, **inputs: object) -> object:
        seen.append((inputs, manager._local_saves.write_seconds))
        return real(self, **inputs)  # type: ignore[arg-type]

    monkeypatch.setattr(AutoSaveEvery, "propose", spy)
    assert manager._local_auto is not None
    clock = FakeClock()  # 5 s steps, saves that hold nothing: an interval of one step
    manager._local_auto.clock = clock
    for step in range(manager.restore() + 1, 8):
        clock.now += 5.0
        manager.step_end(step)
        manager._local_saves.join()  # the write measured before the next choice
    manager.close()
    assert len(seen) >= 2, seen
    assert all(inputs["overlapped"] is True for inputs, _ in seen), seen
    assert seen[0][0]["write_s"] == 0.0  # none measured before the first local save
    for inputs, measured in seen[1:]:
        assert measured is not None and measured > 0 and inputs["write_s"] == measured


def test_a_local_tier_refuses_an_interval_that_is_neither_a_count_nor_auto() -> None:
    with pytest.raises(ConfigurationError, match="a number of steps or 'auto'") as raised:
        resumekit.LocalTier("/tmp/x", save_every="often")
    assert raised.value.fields["name"] == "local.save_every"
    assert resumekit.LocalTier("/tmp/x", save_every="auto").save_every == "auto"


def test_a_garbled_save_interval_in_a_manifest_is_ignored_with_a_warning_not_a_failure(
        tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with CheckpointManager(tmp_path, model=model, save_every=5) as manager:
        manager.save(5)
    manifest_path = next(tmp_path.glob("step_*/manifest.json"))
    document = json.loads(manifest_path.read_text())
    assert document["save_interval"] == {"steps": 5, "auto": False, "inputs": ""}
    document["save_interval"] = {"steps": "often", "auto": "maybe"}
    manifest_path.write_text(json.dumps(document))
    with pytest.warns(ResumekitWarning, match=r"ignoring its save_interval \(steps: "):
        manager = CheckpointManager(tmp_path, model=model, save_every=5)
        assert manager.restore() == 5  # the checkpoint stays what the rest says
    manager.close()
