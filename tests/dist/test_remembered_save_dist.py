"""A save from remembered plans agrees in one all-reduce, not DCP's planning round (issue 40).

On 2 real FSDP2 ranks (gloo, CPU): a run's first save plans in full (DCP's loop: a gather
and a scatter of plans); each later save with every rank's layout unchanged runs no
scatter of plans at all (one all-reduce of four integers decides), writes the same files
a save planned in full writes, and reloads exactly; a write that fails on one rank of such
a save is raised on every rank naming that rank, nothing is left half-believed (the plans
are forgotten) and the next save plans in full and succeeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumekit import tensors
from resumekit.errors import ResumekitError
from resumekit.tensors.plans import SavePlans
from resumekit.tensors.raw import RawTensorWriter
from tests.dist.test_save_planner_dist import _flat, _reload_matches, _state
from tests.dist.test_tensors_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def _counting(names: tuple[str, ...]) -> dict[str, int]:
    """Count this process's calls of the named ``torch.distributed`` collectives."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original,
                    **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _steady_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    counts = _counting(("scatter_object_list", "all_reduce", "gather_object", "gather",
                        "all_gather"))
    per_save, reloads = [], []
    for number in range(4):
        train_step(model, optimizer, "transformer", seed=number)
        state = _state(model, optimizer)
        before = dict(counts)
        tensors.save(state, Path(root) / f"save{number}", plans=plans)
        per_save.append({name: counts[name] - before[name] for name in counts})
        reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), {}))
    listing = sorted(path.name for path in (Path(root) / "save3").iterdir())
    return {"per_save": per_save, "reloads": reloads, "hits": plans.hits,
            "listing": listing}


def test_a_save_from_remembered_plans_runs_no_planning_round_and_reloads_exactly(
        tmp_path: Path) -> None:
    results = run_ranks(_steady_saves, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert result["reloads"] == [True] * 4, result
        assert result["hits"] == 3, result
        first, *later = result["per_save"]
        # the first save: the agreement says no, then DCP's loop scatters the plans
        assert first["all_reduce"] == 1 and first["scatter_object_list"] == 1, first
        for save in later:  # later saves: the agreement, the results gathered in one
            # gather of frames (gather_object would all-gather the sizes first), no plans
            assert save == {"scatter_object_list": 0, "all_reduce": 1, "gather_object": 0,
                            "gather": 1, "all_gather": 0}, result["per_save"]
    # the same files as a save planned in full (save 0), on both ranks' view
    assert results[0]["listing"] == results[1]["listing"]
    assert ".metadata" in results[0]["listing"]
    assert sorted(path.name for path in (tmp_path / "save0").iterdir()) == \
        results[0]["listing"]


def _failing_write(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    original = RawTensorWriter.write_data
    fail = {"now": False}

    def write_data(self: RawTensorWriter, plan: Any, planner: Any) -> Any:
        if fail["now"] and rank == 1:
            raise OSError(28, "No space left on device (injected on rank 1)")
        return original(self, plan, planner)

    RawTensorWriter.write_data = write_data  # type: ignore[method-assign]
    outcomes: list[str] = []
    for number in range(4):
        train_step(model, optimizer, "transformer", seed=number)
        state = _state(model, optimizer)
        fail["now"] = number == 2
        try:
            tensors.save(state, Path(root) / f"save{number}", plans=plans)
            outcomes.append("ok" if _reload_matches(Path(root) / f"save{number}",
                                                    _flat(state), {}) else "differs")
        except ResumekitError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    return {"outcomes": outcomes, "misses": plans.misses, "hits": plans.hits}


def test_a_write_failing_on_one_rank_of_a_remembered_save_is_raised_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_failing_write, world_size=2, args=(str(tmp_path),))
    for result in results:
        first, second, failed, after = result["outcomes"]
        assert (first, second, after) == ("ok", "ok", "ok"), result
        assert "rank 1" in failed and "No space left on device" in failed, failed
        # saves 0 (first) and 3 (after the failure: everything forgotten) planned in full;
        # 1 and 2 wrote remembered plans (2's write then failed)
        assert (result["misses"], result["hits"]) == (2, 2), result


def test_ranks_of_which_one_remembers_nothing_plan_in_full_instead_of_reusing_plans(
        tmp_path: Path) -> None:
    results = run_ranks(_forgetful, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert result["reloads"] == [True] * 3, result
    # rank 1 forgot between saves 1 and 2: save 2 plans in full on both ranks
    assert [r["misses"] for r in results] == [2, 2], results


def _forgetful(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    reloads = []
    for number in range(3):
        train_step(model, optimizer, "transformer", seed=number)
        if number == 2 and rank == 1:
            plans.forget()  # this rank alone remembers nothing now
        state = _state(model, optimizer)
        tensors.save(state, Path(root) / f"save{number}", plans=plans)
        reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), {}))
    torch.distributed.barrier()
    return {"reloads": reloads, "misses": plans.misses}


def _failing_finish_plan(rank: int, world_size: int, root: str) -> list[str]:
    from resumekit.tensors.plans import MemoSavePlanner  # noqa: PLC0415 - in the rank

    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    original = MemoSavePlanner.finish_plan

    def finish_plan(self: MemoSavePlanner, new_plan: Any) -> Any:
        if rank == 1 and plans.hits >= 1:
            raise RuntimeError("rank 1 lost its remembered plan (injected)")
        return original(self, new_plan)

    MemoSavePlanner.finish_plan = finish_plan  # type: ignore[method-assign]
    outcomes: list[str] = []
    for number in range(3):
        train_step(model, optimizer, "transformer", seed=number)
        try:
            tensors.save(_state(model, optimizer), Path(root) / f"save{number}", plans=plans)
            outcomes.append("ok")
        except ResumekitError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes


def test_a_remembered_plan_failing_to_finish_on_one_rank_is_raised_on_every_rank(
        tmp_path: Path) -> None:
    results = run_ranks(_failing_finish_plan, world_size=2, args=(str(tmp_path),))
    for outcomes in results:  # save 2 is remembered on both; rank 1's plan fails there
        assert outcomes[:2] == ["ok", "ok"], outcomes
        assert "rank 1 lost its remembered plan" in outcomes[2], outcomes


def _set_up_failing_once(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import warnings  # noqa: PLC0415 - in the rank's process

    from resumekit.tensors.plans import MemoSavePlanner  # noqa: PLC0415

    model, optimizer = build("transformer", seed=0, world_size=world_size)
    plans = SavePlans()
    original = MemoSavePlanner.create_local_plan
    failed = {"once": False}

    def create_local_plan(self: MemoSavePlanner) -> Any:
        if rank == 1 and plans.hits >= 1 and not failed["once"]:
            failed["once"] = True
            raise RuntimeError("a transient fault in rank 1's planning (injected)")
        return original(self)

    MemoSavePlanner.create_local_plan = create_local_plan  # type: ignore[method-assign]
    reloads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for number in range(3):
            train_step(model, optimizer, "transformer", seed=number)
            state = _state(model, optimizer)
            tensors.save(state, Path(root) / f"save{number}", plans=plans)
            reloads.append(_reload_matches(Path(root) / f"save{number}", _flat(state), {}))
    return {"reloads": reloads, "said": [str(w.message) for w in caught
                                         if "remembered save plan" in str(w.message)]}


def test_a_rank_failing_to_set_up_its_remembered_plan_warns_and_the_save_plans_in_full(
        tmp_path: Path) -> None:
    results = run_ranks(_set_up_failing_once, world_size=2, args=(str(tmp_path),))
    for result in results:  # save 2 planned in full (the fault did not recur), whole
        assert result["reloads"] == [True] * 3, result
    assert results[0]["said"] == [], results[0]
    (said,) = results[1]["said"]
    assert str(tmp_path / "save2") in said and "transient fault" in said, said
    assert "planned in full" in said, said
