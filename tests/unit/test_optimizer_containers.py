"""Several optimizers saved as one, and what cannot be captured refused when the manager is built.

torchtitan hands its checkpointer an ``OptimizersContainer``: an ``Optimizer`` subclass
wrapping one optimizer per model part (and per optimizer kind) whose ``state_dict()`` is a
flat form of its own. Given as ``optimizer=`` it failed with a bare ``KeyError: 'state'`` at
the first save, ``save_every`` steps into the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit.errors import ConfigurationError, IncompatibleCheckpointError
from resumekit.manager import CheckpointManager


class Container(torch.optim.Optimizer):
    """Several optimizers as one, the way torchtitan's container is built (our own code)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # a flat form: no 'state', no 'param_groups'
        return {f"{number}.{key}": value for number, optimizer in enumerate(self.optimizers)
                for key, value in optimizer.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for number, optimizer in enumerate(self.optimizers):
            optimizer.load_state_dict({key: state_dict[f"{number}.{key}"]
                                       for key in ("state", "param_groups")})


class Flat(torch.optim.SGD):
    """An optimizer whose own state_dict() is a form resumekit cannot load into."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"flat.lr": self.param_groups[0]["lr"]}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _two(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model[0].parameters(), lr=1e-2),
            torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)]


FORMS: dict[str, Callable[[list[torch.optim.Optimizer]], Any]] = {
    "container": Container,
    "list": list,
    "tuple": tuple,
    "dict": lambda parts: {"adamw": parts[0], "sgd": parts[1]},
}


def _train(model: nn.Module, optimizer: Any, steps: int, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    parts = (optimizer.values() if isinstance(optimizer, dict)
             else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=data)).square().mean().backward()
        for part in parts:
            part.step()
            part.zero_grad()


def _moments(parts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [value for part in parts for state in part.state.values()
            for value in state.values()]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_several_optimizers_are_saved_as_one_and_restored_exactly(tmp_path: Path,
                                                                  form: str) -> None:
    torch.manual_seed(0)
    model = _net()
    parts = _two(model)
    optimizer = FORMS[form](parts)
    _train(model, optimizer, 3, seed=1)
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(3)

    torch.manual_seed(5)
    fresh = _net()
    fresh_parts = _two(fresh)
    restored = CheckpointManager(tmp_path, model=fresh, optimizer=FORMS[form](fresh_parts))
    assert restored.restore() == 3
    for want, have in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(want, have)
    assert [group["lr"] for part in fresh_parts for group in part.param_groups] == [1e-2, 0.1]
    for want, have in zip(_moments(parts), _moments(fresh_parts), strict=True):
        assert torch.equal(want, have)
    _train(model, optimizer, 1, seed=2)  # both continue the same
    _train(fresh, FORMS[form](fresh_parts), 1, seed=2)
    for want, have in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(want, have)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_several_optimizers_fresh_at_the_start_of_an_async_run_are_staged_once_they_have_state(
        tmp_path: Path, form: str) -> None:
    torch.manual_seed(0)
    model = _net()
    parts = _two(model)
    optimizer = FORMS[form](parts)
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer, async_save=True,
                             save_every=2)
    for step in (1, 2):  # step_end read `.state` of the tuple of parts: AttributeError
        _train(model, optimizer, 1, seed=step)
        assert ckpt.step_end(step) is False
    ckpt.close()
    assert [entry.step for entry in ckpt.checkpoints() if entry.status == "committed"] == [2]


def test_a_checkpoint_of_several_optimizers_restores_into_a_container_of_other_shape(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net()
    both = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                            {"params": model[2].parameters(), "lr": 0.2}], momentum=0.9)
    _train(model, both, 2, seed=1)
    CheckpointManager(tmp_path, model=model, optimizer=both).save(2)
    fresh = _net()
    split = [torch.optim.SGD(fresh[0].parameters(), lr=0.5, momentum=0.9),
             torch.optim.SGD(fresh[2].parameters(), lr=0.5, momentum=0.9)]
    assert CheckpointManager(tmp_path, model=fresh, optimizer=Container(split)).restore() == 2
    assert [part.param_groups[0]["lr"] for part in split] == [0.1, 0.2]
    assert torch.equal(split[1].state[fresh[2].weight]["momentum_buffer"],
                       both.state[model[2].weight]["momentum_buffer"])


def _refused(**objects: Any) -> str:
    with pytest.raises(ConfigurationError) as caught:
        CheckpointManager("/nonexistent/never/created", **objects)
    assert not Path("/nonexistent/never/created").exists()
    return str(caught.value)


def test_an_object_that_is_no_optimizer_is_refused_when_the_manager_is_built() -> None:
    message = _refused(model=_net(), optimizer="adamw")
    assert "optimizer cannot be checkpointed: it is a str" in message
    assert "OptimizersContainer" in message  # the forms it takes


def test_an_optimizer_whose_state_dict_is_not_torchs_form_is_refused_by_name() -> None:
    model = _net()
    message = _refused(model=model, optimizer=[torch.optim.SGD(model[0].parameters(), lr=1.0),
                                               Flat(model[2].parameters(), lr=1.0)])
    assert "optimizer[1] (Flat)" in message and "not torch's form" in message
    assert "flat.lr" in message


def test_an_optimizer_over_tensors_the_model_does_not_hold_is_refused() -> None:
    model = _net()
    stray = nn.Parameter(torch.zeros(3, 3))
    message = _refused(model=model, optimizer={"main": torch.optim.SGD(model.parameters(),
                                                                       lr=1.0),
                                               "extra": torch.optim.SGD([stray], lr=1.0)})
    assert "optimizer['extra'] (SGD) param_groups[0]" in message and "[3, 3]" in message


def test_two_optimizers_updating_one_parameter_are_refused() -> None:
    model = _net()
    message = _refused(model=model, optimizer=Container([
        torch.optim.SGD(model.parameters(), lr=1.0),
        torch.optim.SGD(model[0].parameters(), lr=1.0)]))
    assert "optimizer.optimizers[1] (SGD)" in message
    assert "optimizer.optimizers[0] updates too" in message


def test_an_empty_list_of_optimizers_and_one_listed_twice_are_refused() -> None:
    model = _net()
    assert "an empty list" in _refused(model=model, optimizer=[])
    once = torch.optim.SGD(model.parameters(), lr=1.0)
    assert "listed twice" in _refused(model=model, optimizer=[once, once])


def test_a_model_that_is_no_module_or_several_is_refused_and_one_in_a_list_is_taken(
        tmp_path: Path) -> None:
    assert "model= cannot be checkpointed: it is a dict" in _refused(model={"w": 1})
    assert "pipeline-parallel" in _refused(model=[_net(), _net()])
    model = _net()
    ckpt = CheckpointManager(tmp_path, model=[model],  # type: ignore[arg-type]
                             optimizer=[torch.optim.SGD(model.parameters(), lr=1.0)])
    assert ckpt.state.model is model
    ckpt.save(1)
    assert CheckpointManager(tmp_path, model=model).restore() == 1


def _named_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(model.named_parameters()), lr=1e-2)  # groups get param_names


@pytest.mark.parametrize("names_when", ["saved", "restored"])
def test_a_groups_param_names_on_one_side_only_do_not_stop_a_restore(
        tmp_path: Path, names_when: str) -> None:
    torch.manual_seed(0)
    model = _net()
    optimizer = (_named_adamw(model) if names_when == "saved"
                 else torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, optimizer, 2, seed=1)
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(2)

    fresh = _net()
    fresh_optimizer = (torch.optim.AdamW(fresh.parameters(), lr=1e-2) if names_when == "saved"
                       else _named_adamw(fresh))
    assert CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer).restore() == 2
    assert torch.equal(fresh_optimizer.state[fresh[0].weight]["exp_avg"],
                       optimizer.state[model[0].weight]["exp_avg"])
    has_names = "param_names" in fresh_optimizer.param_groups[0]
    assert has_names == (names_when == "restored")  # the live optimizer's own, kept
    if has_names:
        assert fresh_optimizer.param_groups[0]["param_names"][0] == "0.weight"


def test_a_scheduler_missing_on_one_side_is_named_as_the_fix_for_initial_lr(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # initial_lr
    _train(model, optimizer, 1, seed=1)
    CheckpointManager(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler).save(1)
    fresh = _net()
    ckpt = CheckpointManager(tmp_path, model=fresh,
                             optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    with pytest.raises(IncompatibleCheckpointError) as caught:
        ckpt.restore()
    assert "initial_lr" in str(caught.value)
    assert "build it, and pass it as scheduler=" in str(caught.value)
