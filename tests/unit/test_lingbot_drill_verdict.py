"""The drill's verdicts: the SIGTERM launch's checkpoint, and run C's cut against its metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples.lingbot.drill import Segment, preemption_checkpoint_problem, world_size_problems


def _records(two_ranks: int, total: int) -> list[dict[str, Any]]:
    return [{"step": step, "world_size": 2 if step <= two_ranks else 1}
            for step in range(1, total + 1)]


def test_a_history_that_switches_to_one_rank_after_the_resumed_step_has_no_problem() -> None:
    assert world_size_problems(_records(5, 20), 5) == []


def test_a_history_cut_where_the_sigterm_stopped_not_where_c_resumed_is_named() -> None:
    # The skipped emergency save: agreed at 6, resumed from 5 - a cut at 6 is wrong.
    problems = world_size_problems(_records(5, 20), 6)
    assert problems == ["run C: resumed from step 6 on 1 rank, but the metrics of step(s) "
                        "[6] have world_size [1]"]


def test_a_history_with_a_gap_or_a_repeated_step_is_named() -> None:
    records = _records(5, 8)
    records.insert(3, dict(records[2]))
    problems = world_size_problems(records, 5)
    assert len(problems) == 1
    assert problems[0].startswith("run C: its metrics are not one history of steps 1..9:")


def _term(tmp_path: Path, newest: int, last: int, log: str) -> Segment:
    (tmp_path / "launch.log").write_text(log)
    return Segment(run="B", index=1, nproc=2, interruption="sigterm", signal_at=1,
                   resumed_from=0, last_step=last, newest_checkpoint=newest,
                   newest_reason="preemption", returncode=75, log=str(tmp_path / "launch.log"))


def test_a_preemption_checkpoint_of_the_stopping_step_has_no_problem(tmp_path: Path) -> None:
    assert preemption_checkpoint_problem(_term(tmp_path, 2, 2, "")) is None


def test_the_captures_step_one_behind_with_the_skip_said_has_no_problem(tmp_path: Path) -> None:
    log = "emergency save skipped, newest checkpoint is step 1; exiting with status 75\n"
    assert preemption_checkpoint_problem(_term(tmp_path, 1, 2, log)) is None


def test_an_older_checkpoint_the_trainer_did_not_explain_is_named(tmp_path: Path) -> None:
    problem = preemption_checkpoint_problem(_term(tmp_path, 1, 2, "saved nothing\n"))
    assert problem is not None
    assert "newest checkpoint is 1 (preemption), not the last logged step 2" in problem
    assert str(tmp_path / "launch.log") in problem
