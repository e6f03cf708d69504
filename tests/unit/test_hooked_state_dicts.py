"""Models whose state dict is not their parameters (state-dict hooks) save, restore, export.

The pattern is torchtitan's fused QKV projection: one ``wqkv`` parameter saved as
``wq``/``wk``/``wv`` by a state-dict post hook and merged back by a load pre hook; DCP's
``get_state_dict`` raised ``AttributeError: ... has no attribute 'wq'`` at the first save.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import resumekit
from resumekit.cli import main as cli_main
from resumekit.manager import CheckpointManager
from resumekit.tensors import state_dicts
from resumekit.tools.testing import Probe, check_resume_equivalence, crash_after, stop_after
from tests.hooked_models import FusedQKV, HookedNet, train_steps

OWN_KEYS = ["embed.weight", "embed.bias", "attn.wq.weight", "attn.wk.weight",
            "attn.wv.weight", "attn.wq.bias", "attn.wk.bias", "attn.wv.bias",
            "mix.proj.weight", "mix.proj.bias", "mix.format_version", "head.weight",
            "head.bias"]


def _trained(seed: int = 0, steps: int = 3) -> tuple[HookedNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = HookedNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, steps, seed=seed)
    return model, optimizer


def _stored_keys(root: Path) -> list[str]:
    [step_dir] = root.glob("step_*")
    return sorted(resumekit.StorageReader(step_dir).read_metadata().state_dict_metadata)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values()]


def test_a_model_with_a_split_fused_parameter_saves_its_own_keys_and_restores_exactly(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = CheckpointManager(tmp_path, model=model, optimizer=optimizer)
    ckpt.save(3)
    ckpt.close()
    keys = _stored_keys(tmp_path)
    assert [k for k in keys if k.startswith("model.")] == sorted(f"model.{k}" for k in OWN_KEYS)
    # The optimizer follows the parameters' names: the fused one's state stays fused.
    assert "optimizer.state.attn.wqkv.weight.exp_avg" in keys
    assert not any(k.startswith("optimizer.state.attn.wq.") for k in keys)

    fresh, fresh_optimizer = _trained(seed=1, steps=1)
    assert not torch.equal(fresh.attn.wqkv.weight, model.attn.wqkv.weight)
    restored = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert restored.restore() == 3
    restored.close()
    for (name, want), (_, have) in zip(model.named_parameters(), fresh.named_parameters(),
                                       strict=True):
        assert torch.equal(want, have), name
    for want, have in zip(_optimizer_tensors(optimizer), _optimizer_tensors(fresh_optimizer),
                          strict=True):
        assert torch.equal(want, have)
    assert fresh.mix.loaded_versions[-1] == 3.0  # the load hook saw the key its hook added


def test_a_hooked_model_restored_into_a_process_whose_optimizer_never_stepped(
        tmp_path: Path) -> None:
    model, optimizer = _trained()
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(3)
    torch.manual_seed(5)
    fresh = HookedNet()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer).restore() == 3
    assert torch.equal(fresh.attn.wqkv.weight, model.attn.wqkv.weight)
    assert torch.equal(fresh_optimizer.state[fresh.attn.wqkv.weight]["exp_avg"],
                       optimizer.state[model.attn.wqkv.weight]["exp_avg"])


def _train(root: str, num_steps: int, probe: Probe) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HookedNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(root, model=model, optimizer=optimizer, save_every=2)
    start = ckpt.restore()
    data = torch.Generator().manual_seed(9)
    batches = [torch.randn(6, 4, generator=data) for _ in range(num_steps)]
    for step in range(start, num_steps):
        loss = model(batches[step]).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.step_end(step + 1)
        probe.after_step(step + 1, loss, ckpt)
    ckpt.close()
    return {"model": model, "optimizer": optimizer}


def test_a_hooked_model_resumes_bit_identically_after_a_stop_and_a_crash(
        tmp_path: Path) -> None:
    report = check_resume_equivalence(_train, num_steps=8,
                                      interruptions=[stop_after(3), crash_after(6)],
                                      workdir=tmp_path)
    assert report.equivalent, report.describe()
    assert report.restarts == 2


@pytest.mark.parametrize("wrap", ["compile", "activation checkpointing"])
def test_a_wrapped_hooked_model_saves_the_same_keys_as_the_bare_one(
        tmp_path: Path, wrap: str) -> None:
    model, optimizer = _trained()
    if wrap == "compile":
        wrapped: nn.Module = torch.compile(model)  # wraps only: nothing compiles uncalled
    else:
        model.attn = checkpoint_wrapper(model.attn)  # type: ignore[assignment]
        wrapped = model
    state = state_dicts.model_and_optimizer_state(wrapped, optimizer)
    assert list(state["model"]) == OWN_KEYS
    assert "attn.wqkv.weight" in state["optimizer"]["state"]
    CheckpointManager(tmp_path, model=wrapped, optimizer=optimizer).save(3)

    fresh, fresh_optimizer = _trained(seed=2, steps=1)  # bare: the keys are the same
    assert CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer).restore() == 3
    assert torch.equal(fresh.attn.wqkv.weight, dict(wrapped.named_parameters())[
        next(n for n, _ in wrapped.named_parameters() if n.endswith("wqkv.weight"))])


def test_an_unfused_model_takes_the_weights_of_a_fused_ones_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _trained()
    CheckpointManager(tmp_path / "fused", model=model, optimizer=optimizer).save(3)

    class Unfused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    torch.manual_seed(3)
    unfused = HookedNet()
    unfused.attn = Unfused()  # type: ignore[assignment]
    target = CheckpointManager(tmp_path / "unfused", model=unfused,
                               optimizer=torch.optim.AdamW(unfused.parameters()))
    assert target.restore() == 0
    assert target.load_weights(tmp_path / "fused") == 3
    fused = model.attn.wqkv.weight
    assert torch.equal(unfused.attn.wq.weight, fused[:8])
    assert torch.equal(unfused.attn.wv.weight, fused[12:])
    # and back: the fused model loads the weights through its merging load hook
    back = HookedNet()
    assert CheckpointManager(tmp_path / "back", model=back).load_weights(tmp_path / "fused") == 3
    assert torch.equal(back.attn.wqkv.weight, fused)


def test_the_export_of_a_hooked_models_checkpoint_holds_its_own_keys(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    model, optimizer = _trained()
    CheckpointManager(tmp_path / "root", model=model, optimizer=optimizer).save(3)
    out = tmp_path / "export"
    assert cli_main(["export", str(tmp_path / "root"), "--out", str(out)]) == 0
    files = sorted(out.glob("*.safetensors"))
    exported: dict[str, torch.Tensor] = {}
    for file in files:
        exported.update(safetensors.load_file(str(file)))
    assert sorted(exported) == sorted(OWN_KEYS)
    reference = model.state_dict()
    for key in OWN_KEYS:
        assert torch.equal(exported[key], reference[key]), key


def test_a_state_dict_hook_adding_a_key_alone_is_saved_and_handed_back(tmp_path: Path) -> None:
    from tests.hooked_models import Versioned

    model = nn.Sequential(Versioned(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    CheckpointManager(tmp_path, model=model, optimizer=optimizer).save(1)
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        fresh[0].proj.weight.zero_()
    fresh[0].loaded_versions.clear()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer).restore() == 1
    assert torch.equal(fresh[0].proj.weight, model[0].proj.weight)
    assert fresh[0].loaded_versions == [3.0]


def test_a_fused_module_alone_keeps_dcps_answer_where_dcp_has_one() -> None:
    plain = nn.Sequential(nn.Linear(2, 2))
    assert state_dicts.hooked_state(plain) is None  # no hook-made key: DCP's rules stand
    fused = FusedQKV(4, 4, 2)
    assert list(state_dicts.hooked_state(fused) or {}) == [
        "wq.weight", "wk.weight", "wv.weight", "wq.bias", "wk.bias", "wv.bias"]
    manifest_like = json.dumps(sorted(state_dicts.model_state_dict(fused)))
    assert "wqkv" not in manifest_like
