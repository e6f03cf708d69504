"""Starting from the upstream trainer's weights-only ``checkpoint_step_N`` directories.

The upstream LingBot-VA trainer wrote ``checkpoint_step_N/transformer/
diffusion_pytorch_model.safetensors`` (bf16) and nothing else. The first resumekit run of
such a job must start from those weights at step N - loudly, because optimizer,
scheduler, RNG and data position start fresh - and must never prefer them over a
committed resumekit checkpoint.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from examples.lingbot.config import get_config
from examples.lingbot.model import LingBotVA
from examples.lingbot.recipe import build_optimizer, build_scheduler
from resumekit.errors import IncompatibleCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.warnings import ResumekitWarning

TINY = get_config("tiny")
NAME_FORMAT = "checkpoint_step_{step}"
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def _model(seed: int) -> LingBotVA:
    torch.manual_seed(seed)
    return LingBotVA(TINY.model)


def _bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().to(torch.bfloat16).contiguous()
            for name, value in model.state_dict().items()}


def _write_legacy(root: Path, step: int, state: dict[str, torch.Tensor]) -> Path:
    target = root / f"checkpoint_step_{step}" / WEIGHTS
    target.parent.mkdir(parents=True)
    save_file(state, str(target))
    (target.parent / "config.json").write_text(json.dumps({"dim": TINY.model.dim}))
    return target


def _manager(root: Path, model: nn.Module) -> tuple[CheckpointManager, torch.optim.Optimizer,
                                                     torch.optim.lr_scheduler.LambdaLR]:
    optimizer = build_optimizer(model, TINY.optim)
    scheduler = build_scheduler(optimizer, TINY.optim)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=scheduler,
                                name_format=NAME_FORMAT)
    return manager, optimizer, scheduler


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    loss = sum(param.float().square().mean() for param in model.parameters())
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_an_upstream_weights_only_directory_restores_its_step_and_bf16_weights_with_a_warning(
    tmp_path: Path,
) -> None:
    upstream = _bf16_state(_model(seed=0))
    _write_legacy(tmp_path, 40, upstream)
    model = _model(seed=1)
    manager, optimizer, scheduler = _manager(tmp_path, model)

    with pytest.warns(ResumekitWarning, match=r"(?s)checkpoint_step_40.*NOT an exact resume"):
        step = manager.restore()

    assert step == 40
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, upstream[name].to(torch.float32)), name
    assert optimizer.state_dict()["state"] == {}  # AdamW moments start fresh
    assert scheduler.last_epoch == 0  # so does the warm-up
    manager.close()


def test_a_split_upstream_export_with_an_index_file_is_imported_whole(tmp_path: Path) -> None:
    upstream = _bf16_state(_model(seed=0))
    folder = tmp_path / "checkpoint_step_7" / "transformer"
    folder.mkdir(parents=True)
    names = sorted(upstream)
    halves = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({key: upstream[key] for key in keys}, str(folder / file))
    index = {"weight_map": {key: file for file, keys in halves.items() for key in keys}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    model = _model(seed=1)
    manager, _, _ = _manager(tmp_path, model)

    with pytest.warns(ResumekitWarning):
        assert manager.restore() == 7

    for name, value in model.state_dict().items():
        assert torch.equal(value, upstream[name].float()), name
    manager.close()


def test_a_committed_checkpoint_is_preferred_over_a_newer_legacy_directory(
    tmp_path: Path,
) -> None:
    _write_legacy(tmp_path, 40, _bf16_state(_model(seed=0)))
    saved_model = _model(seed=2)
    writer, optimizer, scheduler = _manager(tmp_path, saved_model)
    _one_step(saved_model, optimizer, scheduler)
    writer.save(10)
    writer.close()
    expected = {name: value.clone() for name, value in saved_model.state_dict().items()}

    model = _model(seed=3)
    manager, optimizer, scheduler = _manager(tmp_path, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        step = manager.restore()

    assert step == 10
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert optimizer.state_dict()["state"]  # the committed checkpoint carries AdamW state
    assert scheduler.last_epoch == 1
    manager.close()


def test_after_a_legacy_import_the_next_save_commits_and_later_resumes_are_exact(
    tmp_path: Path,
) -> None:
    _write_legacy(tmp_path, 40, _bf16_state(_model(seed=0)))
    model = _model(seed=1)
    manager, optimizer, scheduler = _manager(tmp_path, model)
    with pytest.warns(ResumekitWarning):
        assert manager.restore() == 40
    _one_step(model, optimizer, scheduler)
    manager.save(41)
    manager.close()

    again = _model(seed=4)
    second, second_optimizer, second_scheduler = _manager(tmp_path, again)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        assert second.restore() == 41
    for name, value in again.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert second_scheduler.last_epoch == 1
    assert second_optimizer.state_dict()["state"]
    second.close()


def test_a_legacy_directory_of_another_model_shape_is_refused_naming_the_tensor(
    tmp_path: Path,
) -> None:
    upstream = _bf16_state(_model(seed=0))
    upstream["proj_out.weight"] = upstream["proj_out.weight"][:, :-1].contiguous()
    _write_legacy(tmp_path, 40, upstream)
    model = _model(seed=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    manager, _, _ = _manager(tmp_path, model)

    with pytest.raises(IncompatibleCheckpointError, match=r"proj_out\.weight"):
        manager.restore()

    for name, value in model.state_dict().items():  # nothing was loaded
        assert torch.equal(value, before[name]), name
    manager.close()


def test_saving_over_a_legacy_directory_of_the_same_name_is_a_collision_naming_it(
    tmp_path: Path,
) -> None:
    from resumekit.errors import StepCollisionError
    from resumekit.store.commit import CommitProtocol
    from resumekit.store.layout import NameFormat
    from resumekit.store.storage import Storage

    legacy = tmp_path / "checkpoint_step_200" / "transformer"
    legacy.mkdir(parents=True)
    (legacy / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    protocol = CommitProtocol(Storage(tmp_path), NameFormat("checkpoint_step_{step}"))
    with pytest.raises(StepCollisionError, match="checkpoint_step_200 already exists"):
        protocol.begin(200)
    assert (legacy / "diffusion_pytorch_model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in tmp_path.iterdir()
            if p.name != ".resumekit-generations"] == ["checkpoint_step_200"]  # no staging left
