"""resumekit.save_planner on 2 real FSDP2 ranks: an unchanged structure is planned once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from resumekit import sharded
from resumekit.save_planner import forget_plans
from tests.dist.test_sharded_fsdp import build, train_step
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


def _counting_local_plans() -> list[int]:
    from resumekit import save_planner  # noqa: PLC0415 - patched in this rank's process

    return counting_calls(save_planner, "create_default_local_save_plan")


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
    sharded.load(target, directory)
    got = _flat(target)
    return got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
        for k in want)


def _saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    forget_plans()
    calls = _counting_local_plans()
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    results: dict[str, Any] = {}
    snapshots: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for number in range(4):
        train_step(model, optimizer, "transformer", seed=number)
        more: dict[str, Any] = {"note": "x" * (number + 1) ** 3,  # bytes items change size
                                "counter": torch.tensor([number])}
        if number == 2 and rank == 1:
            more["only_on_rank_1"] = torch.arange(3.0)  # one rank's structure changes
        if number == 3:
            more["everywhere"] = torch.ones(2)  # every rank's structure changes
        state = _state(model, optimizer, **more)
        before = calls[0]
        sharded.save(state, Path(root) / f"save{number}")
        results[f"planned{number}"] = calls[0] - before
        snapshots.append((_flat(state), more))
    results["reloads"] = [_reload_matches(Path(root) / f"save{number}", want, more)
                          for number, (want, more) in enumerate(snapshots)]
    return results


def test_an_unchanged_structure_is_planned_once_and_every_save_reloads_exactly(
        tmp_path: Path) -> None:
    results = run_ranks(_saves, world_size=2, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["reloads"] == [True, True, True, True], (rank, result)
        assert result["planned0"] == 1, (rank, result)  # the first save plans
        assert result["planned1"] == 0, (rank, result)  # same structure: remembered
        # save 2: only rank 1's structure changed, only rank 1 plans again
        assert result["planned2"] == (1 if rank == 1 else 0), (rank, result)
        assert result["planned3"] == 1, (rank, result)


def _named_state_against_dcp(rank: int, world_size: int) -> dict[str, bool]:
    from tests.unit.test_named_state import _same  # noqa: PLC0415 - in the rank's process

    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=1)
    found = sharded.named_state(model, optimizer)
    dcp_model, dcp_optimizer = get_state_dict(model, optimizer)
    return {"fast": found is not None,
            "same": found is not None and _same(found[0], dcp_model)
            and _same(found[1], dcp_optimizer)}


def test_named_state_of_an_fsdp2_model_is_exactly_dcps_get_state_dict() -> None:
    for result in run_ranks(_named_state_against_dcp, world_size=2):
        assert result == {"fast": True, "same": True}
