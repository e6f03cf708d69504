"""A save plan remembered between saves (issues 38.2 and 40): reused while every rank's
layout is unchanged, the same bytes as a plan made in full, and planned afresh when a
shape, dtype, key, placement or flag changed on any rank; ``.metadata``'s bytes reused
only for the same write results."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resumekit import tensors as tensor_io
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors.plans import MemoSavePlanner, PlanAgain, SavePlans

save_module = importlib.import_module("resumekit.tensors.save")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def small_state(seed: int = 0, count: int = 30) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{n}.weight": torch.randn(16, generator=generator)
                      for n in range(count)},
            "optimizer": {"lr": 0.1, "step": torch.tensor(float(seed))},
            "extra": {"scale": torch.ones(3, dtype=torch.float64) * seed}}


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def loaded_back(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    def blank(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: blank(part) for key, part in value.items()}
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value

    into = blank(state)
    tensor_io.load(into, directory)
    return into


def assert_same_tensors(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        for key, value in want.items():
            assert_same_tensors(got[key], value, f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where


class _Planned:
    """Counts the local plans DCP's default planner makes in full (still making them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = DefaultSavePlanner.create_local_plan

        def counting(planner: DefaultSavePlanner) -> Any:
            self.count += 1
            return real(planner)

        monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", counting)


def test_saves_of_an_unchanged_layout_reuse_the_plan_and_write_what_a_plan_in_full_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans, planned = SavePlans(), _Planned(monkeypatch)
    for number in range(3):
        state = small_state(seed=number + 1)
        reported = tensor_io.save(state, tmp_path / f"memo{number}", plans=plans)
        full = tensor_io.save(state, tmp_path / f"full{number}")
        assert files_of(tmp_path / f"memo{number}") == files_of(tmp_path / f"full{number}")
        assert reported == full  # names, sizes, checksums, references
        assert_same_tensors(loaded_back(state, tmp_path / f"memo{number}"), state)
    assert (plans.misses, plans.hits) == (1, 2)
    assert planned.count == 1 + 3  # the memo's first save, and each save without it


@pytest.mark.parametrize("change", ["shape", "dtype", "key", "nesting", "requires_grad",
                                    "large", "not_a_tensor"])
def test_a_changed_layout_is_planned_in_full_and_loads_back_as_saved(
        tmp_path: Path, change: str) -> None:
    plans = SavePlans()
    tensor_io.save(small_state(seed=1), tmp_path / "first", plans=plans)
    state = small_state(seed=2)
    model = state["model"]
    if change == "shape":
        model["layer7.weight"] = torch.randn(17)
    elif change == "dtype":  # the same shape and bytes per element: only the dtype differs
        model["layer7.weight"] = model["layer7.weight"].to(torch.int32)
    elif change == "key":
        model["layer99.weight"] = model.pop("layer7.weight")
    elif change == "nesting":  # the same dotted key from another nesting
        del state["extra"]
        state["extra.scale"] = torch.ones(3, dtype=torch.float64)
    elif change == "requires_grad":  # recorded in DCP's metadata
        model["layer7.weight"] = model["layer7.weight"].requires_grad_()
    elif change == "large":  # stored alone: its blocks' checksums are in .metadata
        model["layer7.weight"] = torch.randn(raw_tensor_files.PACK_ITEM_BYTES // 4)
    elif change == "not_a_tensor":
        state["optimizer"]["step"] = 2
    tensor_io.save(state, tmp_path / "changed", plans=plans)
    assert (plans.misses, plans.hits) == (2, 0)
    tensor_io.save(state, tmp_path / "full")
    assert files_of(tmp_path / "changed") == files_of(tmp_path / "full")
    got = loaded_back(state, tmp_path / "changed")
    assert_same_tensors(got, state)
    tensor_io.save(state, tmp_path / "again", plans=plans)  # the new layout is remembered
    assert (plans.misses, plans.hits) == (2, 1)


def test_a_dtype_change_at_the_same_shapes_back_and_forth_is_never_read_with_a_stale_dtype(
        tmp_path: Path) -> None:
    plans = SavePlans()
    for number, dtype in enumerate([torch.float32, torch.int32, torch.float32, torch.int32]):
        state = {"w": (torch.arange(8) * (number + 1)).to(dtype)}
        tensor_io.save(state, tmp_path / str(number), plans=plans)
        into = {"w": torch.zeros(8, dtype=dtype)}
        tensor_io.load(into, tmp_path / str(number))
        assert into["w"].dtype == dtype and torch.equal(into["w"], state["w"])
    assert (plans.misses, plans.hits) == (4, 0)


def test_a_tensor_subclass_is_never_remembered(tmp_path: Path) -> None:
    class Marked(torch.Tensor):
        pass

    plans = SavePlans()
    for number in range(2):
        state = {"w": torch.arange(4.0).as_subclass(Marked), "b": torch.ones(2)}
        tensor_io.save(state, tmp_path / str(number), plans=plans)
    assert (plans.misses, plans.hits) == (2, 0)


def test_a_one_rank_groups_save_is_one_process_s_and_reuses_the_plan(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        plans = SavePlans()
        for number in range(2):
            tensor_io.save(small_state(seed=number), tmp_path / str(number), plans=plans)
        assert (plans.misses, plans.hits) == (1, 1)
    finally:
        dist.destroy_process_group()


def _planners(states: list[dict[str, Any]], memories: list[SavePlans]
              ) -> list[MemoSavePlanner]:
    planners = [MemoSavePlanner(plans) for plans in memories]
    for rank, (planner, state) in enumerate(zip(planners, states, strict=True)):
        planner.set_up_planner(state, None, rank == 0)
    return planners


def _sent(plan: Any) -> Any:
    return pickle.loads(pickle.dumps(plan))  # what DCP's gather and scatter do


def _round(states: list[dict[str, Any]], memories: list[SavePlans]) -> list[Any]:
    """One save's planning on len(states) simulated ranks (rank 0 coordinates)."""
    planners = _planners(states, memories)
    sent = [_sent(planner.create_local_plan()) for planner in planners]
    finals, _ = planners[0].create_global_plan(sent)
    return [planner.finish_plan(_sent(final))
            for planner, final in zip(planners, finals, strict=True)]


def test_the_coordinator_reuses_its_plans_only_when_every_rank_sent_a_marker_of_its_round(
        ) -> None:
    memories = [SavePlans(), SavePlans()]
    states = [{"a": torch.ones(4), "lr": 0.1}, {"b": torch.ones(4), "lr": 0.1}]
    first = _round(states, memories)
    again = _round(states, memories)
    assert again == first and all(final.items for final in first)
    assert [(m.misses, m.hits) for m in memories] == [(1, 1), (1, 1)]
    assert (memories[0].global_misses, memories[0].global_hits) == (1, 1)
    # rank 1's layout changes (a dtype at the same shape): its plan against rank 0's marker
    states[1] = {"b": torch.ones(4, dtype=torch.int32), "lr": 0.1}
    planners = _planners(states, memories)
    sent = [_sent(planner.create_local_plan()) for planner in planners]
    assert not sent[0].usable and sent[1].usable and sent[1].items
    with pytest.raises(PlanAgain, match="1 of 2 ranks sent a marker"):
        planners[0].create_global_plan(sent)
    assert memories[0].replans == 1
    for plans in memories:  # as resumekit.tensors.save does on every rank, then again
        plans.forget()
    finals = _round(states, memories)
    written = {item.index.fqn: item for final in finals for item in final.items}
    assert written["b"].tensor_data.properties.dtype == torch.int32
    assert [(m.misses, m.hits) for m in memories] == [(2, 1), (2, 1)]


def test_a_marker_of_a_round_the_coordinator_does_not_remember_is_refused() -> None:
    memories = [SavePlans(), SavePlans()]
    states = [{"w": torch.ones(4)}, {"w": torch.ones(4)}]
    _round(states, memories)
    memories[0].forget()  # the coordinator forgot (its save failed), rank 1 did not
    planners = _planners(states, memories)
    sent = [_sent(planner.create_local_plan()) for planner in planners]
    assert sent[0].usable and not sent[1].usable
    with pytest.raises(PlanAgain):
        planners[0].create_global_plan(sent)
    rounds = [SavePlans(), SavePlans()]
    _round(states, rounds)  # another root's plans: another round
    planners = _planners(states, [rounds[0], memories[1]])
    sent = [_sent(planner.create_local_plan()) for planner in planners]
    assert not sent[0].usable and not sent[1].usable
    with pytest.raises(PlanAgain):
        planners[0].create_global_plan(sent)


def test_metadata_bytes_are_reused_only_for_the_same_results(tmp_path: Path) -> None:
    plans = SavePlans()
    notes = ["short", "short", "a longer note" * 500, "a longer note" * 500]
    for number, note in enumerate(notes):
        state = {**small_state(seed=number), "note": note}
        tensor_io.save(state, tmp_path / str(number), plans=plans)
        tensor_io.save(state, tmp_path / f"{number}-full")
        assert files_of(tmp_path / str(number)) == files_of(tmp_path / f"{number}-full")
        into = {**small_state(seed=99), "note": ""}
        tensor_io.load(into, tmp_path / str(number))
        assert into["note"] == note
    assert (plans.misses, plans.hits) == (1, 3)
    assert plans.metadata_reused == 2  # the second and the fourth: the note's length changed


def test_a_dtensors_placements_and_shape_are_part_of_the_layout(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plans = SavePlans()

        def save(name: str, tensor: torch.Tensor, placement: Any) -> None:
            state = {"w": distribute_tensor(tensor, mesh, [placement]), "b": torch.ones(2)}
            tensor_io.save(state, tmp_path / name, plans=plans, alone=True)
            full = tmp_path / f"{name}-full"
            tensor_io.save(state, full, alone=True)
            assert files_of(tmp_path / name) == files_of(full)
            into = {"w": distribute_tensor(torch.zeros_like(tensor), mesh, [placement]),
                    "b": torch.zeros(2)}
            tensor_io.load(into, tmp_path / name, alone=True)
            assert torch.equal(into["w"].to_local(), tensor)

        save("a", torch.arange(6.0).reshape(2, 3), Shard(0))
        save("b", torch.arange(6.0).reshape(2, 3) + 1, Shard(0))
        assert (plans.misses, plans.hits) == (1, 1)
        save("c", torch.arange(6.0).reshape(2, 3), Replicate())
        save("d", torch.arange(8.0).reshape(2, 4), Replicate())
        assert (plans.misses, plans.hits) == (3, 1)
    finally:
        dist.destroy_process_group()


def test_a_failed_save_forgets_the_plans_and_the_next_save_is_planned_in_full(
        tmp_path: Path) -> None:
    plans = SavePlans()
    state = small_state(seed=1)
    tensor_io.save(state, tmp_path / "first", plans=plans)
    tensor_io.save(state, tmp_path / "taken")  # a checkpoint already there: refused
    with pytest.raises(Exception, match="already exists"):
        tensor_io.save(state, tmp_path / "taken", plans=plans)
    tensor_io.save(state, tmp_path / "after", plans=plans)
    assert (plans.misses, plans.hits) == (2, 0)
    assert files_of(tmp_path / "after") == files_of(tmp_path / "first")
    assert_same_tensors(loaded_back(state, tmp_path / "after"), state)
