"""Saves on 2 real FSDP2 ranks with DCP's default planner, and the state-dict views.

A save is ``dcp.save`` with ``DefaultSavePlanner()``: every save is planned (DCP's plan
caching is off: it would keep the previous ``.metadata`` when only dtypes change), on the
default group or on an async save's own gloo group, and every save reloads exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)

from resumekit import tensors
from resumekit.tensors import state_dicts
from tests.dist.test_tensors_fsdp import build, train_step
from tests.distributed_harness import run_ranks


def counting_calls(module: Any, name: str) -> list[int]:
    """Patch ``module.name`` (in this rank's process) to count its calls; ``[count]``."""
    calls = [0]
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def _counting_global_plans() -> list[int]:
    from torch.distributed.checkpoint import default_planner  # noqa: PLC0415 - this rank's

    return counting_calls(default_planner, "create_default_global_save_plan")


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **more: Any
           ) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, **more}


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{inner}": found for inner, found in _flat(value).items()})
        else:
            local = value.to_local() if hasattr(value, "to_local") else value
            out[key] = local.clone() if isinstance(local, torch.Tensor) else local
    return out


def _reload_matches(directory: Path, want: dict[str, Any], more: dict[str, Any]) -> bool:
    model, optimizer = build("transformer", seed=99, world_size=2)
    train_step(model, optimizer, "transformer", seed=99)  # optimizer state to load into
    target = _state(model, optimizer, **{
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else ""
        for key, value in more.items()})
    tensors.load(target, directory)
    got = _flat(target)
    return got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
        for k in want)


def _saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415 - in the rank's process

    calls = _counting_global_plans()
    background = dist.new_group(backend="gloo")  # as an async save's own group
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    results: dict[str, Any] = {}
    snapshots: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for number in range(7):
        train_step(model, optimizer, "transformer", seed=number)
        more: dict[str, Any] = {"note": "x" * (number + 1) ** 3,  # bytes items change size
                                "counter": torch.tensor([number])}
        if number == 2 and rank == 1:
            more["only_on_rank_1"] = torch.arange(3.0)  # one rank's structure changes
        if number >= 3:
            more["everywhere"] = torch.ones(2)  # every rank's structure changes
        if number == 5:  # the same shapes, another dtype: a new plan, new .metadata
            more["counter"] = torch.tensor([number], dtype=torch.int32)
        state = _state(model, optimizer, **more)
        before = calls[0]
        tensors.save(state, Path(root) / f"save{number}",
                     process_group=background if number in (4, 5) else None)
        results[f"planned{number}"] = calls[0] - before  # global plans made (coordinator)
        snapshots.append((_flat(state), more))
    results["reloads"] = [_reload_matches(Path(root) / f"save{number}", want, more)
                          for number, (want, more) in enumerate(snapshots)]
    return results


def test_every_save_on_either_group_is_planned_by_dcp_and_reloads_exactly(
        tmp_path: Path) -> None:
    results = run_ranks(_saves, world_size=2, args=(str(tmp_path),))
    assert results[1]["reloads"] == [True] * 7, results[1]
    coordinator = results[0]
    assert coordinator["reloads"] == [True] * 7, coordinator
    planned = [coordinator[f"planned{number}"] for number in range(7)]
    assert planned == [1] * 7, coordinator  # every save planned by DCP, nothing kept


def _named_state_against_dcp(rank: int, world_size: int) -> dict[str, bool]:
    from tests.unit.test_named_state import _same  # noqa: PLC0415 - in the rank's process

    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=1)
    found = state_dicts.named_state(model, optimizer)
    dcp_model, dcp_optimizer = get_state_dict(model, optimizer)
    # loading a state of other values (a step more, half the learning rate) two ways
    source_model, source = build("transformer", seed=0, world_size=world_size)
    for seed in (1, 2):
        train_step(source_model, source, "transformer", seed=seed)
    for group in source.param_groups:
        group["lr"] *= 0.5
    stored = state_dicts.named_state(source_model, source)
    assert stored is not None
    dcps_model, dcps = build("transformer", seed=0, world_size=world_size)
    train_step(dcps_model, dcps, "transformer", seed=1)
    set_optimizer_state_dict(dcps_model, dcps, stored[1], options=StateDictOptions(strict=True))
    loaded = state_dicts.load_named_optimizer_state(model, optimizer, stored[1])
    return {"fast": found is not None,
            "same": found is not None and _same(found[0], dcp_model)
            and _same(found[1], dcp_optimizer),
            "model alone": _same(state_dicts.model_state_dict(model), get_model_state_dict(model)),
            "loaded": loaded,
            "loads as DCP": _same(optimizer.state_dict(), dcps.state_dict())
            and _same(optimizer.state_dict(), source.state_dict())}


def test_named_state_of_an_fsdp2_model_is_exactly_dcps_get_state_dict_and_loads_as_dcps_set(
        ) -> None:
    for result in run_ranks(_named_state_against_dcp, world_size=2):
        assert result == {"fast": True, "same": True, "model alone": True, "loaded": True,
                          "loads as DCP": True}


def _zeros_against_from_local(rank: int, world_size: int) -> list[str]:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - in the rank's process

    model, _ = build("transformer", seed=0, world_size=world_size)
    unlike = []
    for name, param in model.named_parameters():
        for dtype in (torch.float32, torch.bfloat16):
            ours = state_dicts._zeros_like(param, dtype)
            local = torch.zeros_like(param.to_local(), dtype=dtype)
            public = DTensor.from_local(local, param.device_mesh, param.placements,
                                        run_check=False, shape=param.shape,
                                        stride=param.stride())
            assert isinstance(ours, DTensor)
            if not (ours._spec == public._spec and ours.shape == public.shape
                    and ours.stride() == public.stride() and ours.dtype == dtype
                    and not ours.requires_grad and torch.equal(ours.to_local(), local)
                    and ours.to_local().stride() == local.stride()):
                unlike.append(f"{name} {dtype}")
    return unlike


def test_preallocated_zeros_of_an_fsdp2_parameter_are_what_dtensor_from_local_builds(
        ) -> None:
    for unlike in run_ranks(_zeros_against_from_local, world_size=2):
        assert unlike == []


def _tied_of_an_fsdp2_model(rank: int, world_size: int) -> dict[str, Any]:
    from torch import nn  # noqa: PLC0415 - in the rank's process
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # same shapes, not tied
    model.head = nn.Linear(8, 10, bias=False)
    model.head.weight = model.embed.weight
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = state_dicts.model_state_dict(model)
    with torch.no_grad():
        no_grad = state_dicts.find_tied(state)
    return {"grad mode": state_dicts.find_tied(state), "no grad": no_grad,
            "dtensors": sorted(name for name, value in state.items()
                               if type(value).__name__ == "DTensor")}


def test_tied_weights_of_an_fsdp2_model_are_found_and_same_shaped_layers_are_not(
        ) -> None:
    for result in run_ranks(_tied_of_an_fsdp2_model, world_size=2):
        assert "head.weight" in result["dtensors"], result
        assert result["grad mode"] == {"head.weight": "embed.weight"}, result
        assert result["no grad"] == result["grad mode"], result
