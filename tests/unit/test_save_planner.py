"""resumekit.tensors.save_planner.structure_key: every input of the local save plan is keyed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from resumekit.tensors.save_planner import structure_key


def _key(state: dict[str, Any], mappings: dict[str, Any] | None = None,
         coordinator: bool = True) -> Any:
    return structure_key(state, mappings if mappings is not None else
                         {name: (name,) for name in state}, coordinator)


def test_the_same_structure_with_other_values_has_the_same_key() -> None:
    assert _key({"w": torch.zeros(3), "lr": 0.1, "note": "a"}) == \
        _key({"w": torch.ones(3), "lr": 0.2, "note": "a longer note"})


@pytest.mark.parametrize("other", [
    {"w": torch.zeros(4), "lr": 0.1},  # shape
    {"w": torch.zeros(3, dtype=torch.float64), "lr": 0.1},  # dtype
    {"w": torch.zeros(3, requires_grad=True), "lr": 0.1},  # requires_grad
    {"w": torch.zeros(3), "lr": 0.1, "new": 1},  # a key more
    {"w": torch.zeros(3), "lr": torch.tensor(0.1)},  # a value turned into a tensor
    {"w2": torch.zeros(3), "lr": 0.1},  # a key renamed
], ids=["shape", "dtype", "requires_grad", "key added", "bytes to tensor", "key renamed"])
def test_any_change_a_local_plan_depends_on_changes_the_key(other: dict[str, Any]) -> None:
    assert _key({"w": torch.zeros(3), "lr": 0.1}) != _key(other)


def test_the_nesting_path_and_the_coordinator_role_are_part_of_the_key() -> None:
    state = {"a.b": torch.zeros(2)}
    assert _key(state, {"a.b": ("a", "b")}) != _key(state, {"a.b": ("a.b",)})
    assert _key(state, coordinator=True) != _key(state, coordinator=False)


def test_a_tensor_subclass_or_a_self_planning_value_is_never_cached() -> None:
    class Marked(torch.Tensor):
        pass

    class PlansItself:
        def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
            return []

    assert _key({"w": torch.zeros(2).as_subclass(Marked)}) is None
    assert _key({"w": PlansItself()}) is None


def test_a_process_saving_to_many_roots_remembers_the_plans_of_the_newest_few(
        tmp_path: Any) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from resumekit.tensors import save_planner, sharded

    save_planner.forget_plans()
    state = {"w": torch.arange(4.0), "step": 3}  # a non-tensor value: DCP's own path
    for number in range(save_planner.SLOTS_KEPT + 3):
        sharded.save(state, tmp_path / f"save{number}", plan_owner=f"root{number}")
    slots = [slot for slot in DefaultSavePlanner._cached_metadata  # noqa: SLF001
             if slot.startswith("resumekit-structure-cached:")]
    assert len(slots) == save_planner.SLOTS_KEPT
    assert not any(slot.startswith("resumekit-structure-cached:root0:") for slot in slots)
    assert len(save_planner._LOCAL_PLANS) == save_planner.SLOTS_KEPT  # noqa: SLF001
    sharded.save(state, tmp_path / "again", plan_owner="root0")  # planned afresh, fine
    loaded = {"w": torch.zeros(4), "step": 0}
    sharded.load(loaded, tmp_path / "again")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def _nested_state() -> dict[str, Any]:
    return {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)},
            "optimizer": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2, 3)}},
                          "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
            "extras": {"names": ["a", "b"], "pair": (1, torch.ones(1)), "empty": {}},
            "count": 3}


def test_a_planners_flattened_state_is_exactly_dcps_default_save_planners() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: PLC0415

    from resumekit.tensors.save_planner import StructureCachingSavePlanner  # noqa: PLC0415

    ours, dcps = StructureCachingSavePlanner(), DefaultSavePlanner()
    for planner in (ours, dcps):
        planner.set_up_planner(_nested_state(), None, True)
    assert list(ours.state_dict) == list(dcps.state_dict)
    assert ours.mappings == dcps.mappings and ours.is_coordinator
    for key, value in dcps.state_dict.items():
        mine = ours.state_dict[key]
        assert type(mine) is type(value)
        assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value


def test_a_planner_splits_sharded_tensors_as_dcp_does_when_the_state_holds_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.tensors import save_planner  # noqa: PLC0415

    class Sharded:
        """Stands for a ShardedTensor (one needs a process group to exist)."""

    split: list[list[str]] = []

    def flatten(state: dict[str, Any]) -> dict[str, Any]:
        split.append(sorted(state))
        return dict(state)

    monkeypatch.setattr(save_planner, "ShardedTensor", Sharded)
    monkeypatch.setattr(save_planner, "_flatten_sharded_tensors", flatten)
    planner = save_planner.StructureCachingSavePlanner()
    planner.set_up_planner(_nested_state(), None, False)
    assert split == []  # none: the flattened state is kept as it is
    planner.set_up_planner({**_nested_state(), "table": Sharded()}, None, False)
    assert split == [sorted([*planner.state_dict])]  # one: DCP's split runs
