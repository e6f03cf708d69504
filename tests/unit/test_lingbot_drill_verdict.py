"""The drill's cut of run C: the step its relaunch resumed from, checked against its metrics."""

from __future__ import annotations

from typing import Any

from examples.lingbot.drill import world_size_problems


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
