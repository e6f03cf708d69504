"""What a port of an outside trainer (nanoGPT, 16 lines) ran into, fixed in the library.

Wrapped models restore into unwrapped ones, tied weights are stored once, a loop that
ignores restore()'s step is caught at its first step_end, ``finish`` commits the last
step, ``extras`` is live, ``load_weights`` starts a fine-tune, and an imported checkpoint
restores into a full trainer-shaped manager.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import resumekit
from resumekit.errors import ConfigurationError, IncompatibleCheckpointError, ResumeStepError
from resumekit.manager import CheckpointManager
from resumekit.state import train_state as state_module
from resumekit.state.sampler import ResumableDistributedSampler
from resumekit.store.catalog import list_checkpoints, read_manifest
from resumekit.store.manifest import SaveReason
from resumekit.store.storage import Storage
from resumekit.tensors import read_tensor_index
from resumekit.tools.export import export_checkpoint, export_torch
from resumekit.warnings import ResumekitWarning


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bitwise(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def _newest(root: Path) -> Any:
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    return read_manifest(Storage(root), names[-1])


# --------------------------------------------------------------------------- 1. wrappers


def test_a_compiled_model_restores_into_the_plain_model_bit_for_bit(tmp_path: Path) -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    _train(compiled, optimizer)
    expected = _weights(model)
    with CheckpointManager(tmp_path, model=compiled, optimizer=optimizer) as ckpt:
        ckpt.save(2)
    assert "0.weight" in _newest(tmp_path).fingerprint["params"]
    plain = _mlp(seed=1)
    fresh = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    assert CheckpointManager(tmp_path, model=plain, optimizer=fresh).restore() == 2
    _assert_bitwise(plain, expected)
    again = torch.compile(_mlp(seed=2), backend="eager")  # plain -> compiled as well
    assert CheckpointManager(tmp_path, model=again).restore() == 2
    _assert_bitwise(again._orig_mod, expected)  # type: ignore[operator]


def test_an_older_manifest_whose_fingerprint_has_wrapper_prefixes_still_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    expected = _weights(model)

    def wrapper_names(self: state_module.TrainState) -> dict[str, list[Any]]:
        assert self.model is not None  # what earlier versions recorded: module.state_dict()
        return {name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                for name, p in self.model.state_dict().items()}

    def old_fingerprint(self: CheckpointManager, params: Any = None) -> dict[str, Any]:
        return {"config": self.config, "params": wrapper_names(self.state)}

    with monkeypatch.context() as patch:
        patch.setattr(state_module.TrainState, "fingerprint_params", wrapper_names)
        patch.setattr(CheckpointManager, "_fingerprint", old_fingerprint)  # the save's too
        with CheckpointManager(tmp_path, model=compiled) as ckpt:
            ckpt.save(1)
    assert "_orig_mod.0.weight" in _newest(tmp_path).fingerprint["params"]
    plain = _mlp(seed=3)
    assert CheckpointManager(tmp_path, model=plain).restore() == 1
    _assert_bitwise(plain, expected)


def test_a_model_that_really_differs_is_still_refused_after_canonicalising(
    tmp_path: Path
) -> None:
    with CheckpointManager(tmp_path, model=torch.compile(_mlp(), backend="eager")) as ckpt:
        ckpt.save(1)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    with pytest.raises(IncompatibleCheckpointError, match=r"2.weight: checkpoint \[\[4, 16\]"):
        CheckpointManager(tmp_path, model=other).restore()


# --------------------------------------------------------------------------- 2. tied weights


class TinyGPT(nn.Module):
    """nanoGPT's shape of tying: ``lm_head.weight`` is ``transformer.wte.weight``."""

    def __init__(self, vocab: int = 512, width: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab, width),
                                          "h": nn.Linear(width, width)})
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.transformer["h"](self.transformer["wte"](idx))))


def _tensor_bytes(root: Path) -> int:
    step = sorted(p for p in root.iterdir() if not p.name.startswith("."))[-1]
    return sum(f.stat().st_size for f in (step / "tensors").iterdir())


def test_tied_weights_are_stored_once_and_restore_tied(tmp_path: Path) -> None:
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, 512, (2, 8))).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = _weights(model)
    with CheckpointManager(tmp_path / "tied", model=model, optimizer=optimizer) as ckpt:
        ckpt.save(2)
    manifest = _newest(tmp_path / "tied")
    assert manifest.state["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    step_dir = sorted((tmp_path / "tied").iterdir())[-1]
    index = read_tensor_index(step_dir / "tensors")
    assert "model.transformer.wte.weight" in index and "model.lm_head.weight" not in index
    assert "lm_head.weight" in manifest.fingerprint["params"]

    fresh = TinyGPT(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert CheckpointManager(tmp_path / "tied", model=fresh, optimizer=fresh_opt).restore() == 2
    assert fresh.lm_head.weight is fresh.transformer["wte"].weight
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer["wte"].weight.data_ptr()
    _assert_bitwise(fresh, expected)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])

    # Bytes saved: the same model untied writes the embedding twice.
    untied = TinyGPT()
    untied.lm_head.weight = nn.Parameter(untied.transformer["wte"].weight.detach().clone())
    with CheckpointManager(tmp_path / "untied", model=untied) as ckpt:
        ckpt.save(2)
    with CheckpointManager(tmp_path / "tied-weights-only", model=TinyGPT()) as ckpt:
        ckpt.save(2)
    saved = _tensor_bytes(tmp_path / "untied") - _tensor_bytes(tmp_path / "tied-weights-only")
    print(f"tied TinyGPT: {_tensor_bytes(tmp_path / 'tied-weights-only')} bytes of weights, "
          f"untied {_tensor_bytes(tmp_path / 'untied')}: {saved} bytes saved")
    assert saved >= 512 * 64 * 4  # one embedding matrix (fp32) is not written twice


def test_an_export_of_a_tied_checkpoint_loads_with_strict_true(tmp_path: Path) -> None:
    model = TinyGPT()
    with CheckpointManager(tmp_path / "root", model=model) as ckpt:
        ckpt.save(1)
    export_checkpoint(tmp_path / "root", out=tmp_path / "out")
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    target = TinyGPT(seed=9)
    target.load_state_dict(loaded, strict=True)
    _assert_bitwise(target, _weights(model))
    export_torch(tmp_path / "root", out=tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    TinyGPT(seed=9).load_state_dict(full["model"], strict=True)


# --------------------------------------------------------------------------- 3. resume step


def test_a_loop_that_counts_from_zero_after_a_restore_fails_at_its_first_step_end(
    tmp_path: Path
) -> None:
    model = _mlp()
    with CheckpointManager(tmp_path, model=model, save_every=5) as ckpt:
        ckpt.save(40)
    again = CheckpointManager(tmp_path, model=model, save_every=5)
    assert again.restore() == 40
    with pytest.raises(ResumeStepError, match=r"step_end\(1\) right after restoring step 40"):
        again.step_end(1)  # nanoGPT's loop ignoring the returned step
    right = CheckpointManager(tmp_path, model=model, save_every=5)
    start = right.restore()
    assert right.step_end(start + 1) is False
    assert right.step_end(start + 2) is False  # checked once, then out of the way
    fresh = CheckpointManager(tmp_path / "new", model=model, save_every=5)
    assert fresh.restore() == 0
    assert fresh.step_end(1) is False
    for manager in (again, right, fresh):
        manager.close()


# --------------------------------------------------------------------------- 4. finish


def _loop(root: Path, num_steps: int, save_every: int, trained: list[int]) -> CheckpointManager:
    model = _mlp()
    ckpt = CheckpointManager(root, model=model, save_every=save_every)
    start = ckpt.restore()
    if ckpt.finished:
        return ckpt
    for step in range(start, num_steps):
        trained.append(step)
        if ckpt.step_end(step + 1):
            break
    else:
        ckpt.finish(num_steps)
    return ckpt


def test_finish_commits_the_last_step_and_a_relaunch_trains_nothing(tmp_path: Path) -> None:
    trained: list[int] = []
    _loop(tmp_path, 12, 5, trained).close()
    assert [e.step for e in list_checkpoints(Storage(tmp_path))] == [5, 10, 12]
    assert _newest(tmp_path).reason == SaveReason.FINAL
    written = (tmp_path / "step_000000012" / "manifest.json").stat().st_mtime_ns
    again: list[int] = []
    relaunch = _loop(tmp_path, 12, 5, again)
    assert relaunch.finished and relaunch.latest() is not None
    assert again == []
    relaunch.finish(12)  # a finished run's finish writes nothing
    relaunch.close()
    assert (tmp_path / "step_000000012" / "manifest.json").stat().st_mtime_ns == written


def test_finish_on_an_interval_step_marks_it_final(tmp_path: Path) -> None:
    trained: list[int] = []
    _loop(tmp_path, 10, 5, trained).close()
    assert [e.step for e in list_checkpoints(Storage(tmp_path))] == [5, 10]
    assert _newest(tmp_path).reason == SaveReason.FINAL
    relaunch: list[int] = []
    ckpt = _loop(tmp_path, 10, 5, relaunch)
    assert ckpt.finished and relaunch == []
    ckpt.close()


# --------------------------------------------------------------------------- 5. extras


def test_extras_is_the_callers_mapping_and_numbers_from_tensors_are_saved(
    tmp_path: Path
) -> None:
    extras: dict[str, Any] = {"wandb_run_id": "abc"}
    with CheckpointManager(tmp_path, model=_mlp(), extras=extras) as ckpt:
        assert ckpt.extras is extras
        extras["best_loss"] = torch.tensor(0.5)
        extras["tokens"] = np.int64(1234)
        extras["lr"] = np.float32(0.25)
        ckpt.save(1)
    saved = _newest(tmp_path).extras
    assert saved == {"wandb_run_id": "abc", "best_loss": 0.5, "tokens": 1234, "lr": 0.25}
    mine: dict[str, Any] = {"new_key": 1}
    again = CheckpointManager(tmp_path, model=_mlp(), extras=mine)
    again.restore()
    assert again.extras is mine
    assert mine == {"new_key": 1, "wandb_run_id": "abc", "best_loss": 0.5, "tokens": 1234,
                    "lr": 0.25}
    again.close()


def test_an_extras_value_that_cannot_be_saved_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"extras.history is a tensor of shape \[3\]"):
        CheckpointManager(tmp_path, model=_mlp(), extras={"history": torch.zeros(3)})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        CheckpointManager(tmp_path, model=_mlp(), extras={"obj": object()})
    assert not tmp_path.joinpath("step_000000001").exists()


# --------------------------------------------------------------------------- 6. load_weights


def test_load_weights_starts_a_fine_tune_at_step_zero_and_a_requeue_resumes_its_own(
    tmp_path: Path
) -> None:
    pre = _mlp()
    pre_opt = torch.optim.AdamW(pre.parameters(), lr=1e-2)
    _train(pre, pre_opt)
    pretrained = _weights(pre)
    with CheckpointManager(tmp_path / "pre", model=pre, optimizer=pre_opt,
                           config={"lr": 1e-2}) as ckpt:
        ckpt.save(500)

    model = _mlp(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tune = CheckpointManager(tmp_path / "tune", model=model, optimizer=opt,
                             config={"lr": 1e-4}, save_every=3)
    assert tune.restore() == 0
    assert tune.load_weights(tmp_path / "pre") == 500
    _assert_bitwise(model, pretrained)
    assert opt.state_dict()["state"] == {}  # fresh optimizer
    _train(model, opt, 3)
    tune.step_end(3)  # its own checkpoint of step 3
    tune.close()
    manifest = _newest(tmp_path / "tune")
    assert manifest.lineage.initialized_from["step"] == 500
    tuned = _weights(model)

    requeued = _mlp(seed=6)
    again = CheckpointManager(tmp_path / "tune", model=requeued, config={"lr": 1e-4})
    assert again.restore() == 3
    assert again.load_weights(tmp_path / "pre") is None  # resumes its own checkpoint
    _assert_bitwise(requeued, tuned)
    not_restored = CheckpointManager(tmp_path / "tune", model=_mlp())
    with pytest.raises(ConfigurationError, match="call restore"):
        not_restored.load_weights(tmp_path / "pre")
    for manager in (again, not_restored):
        manager.close()


def test_load_weights_strict_refuses_a_new_head_and_non_strict_names_it(
    tmp_path: Path
) -> None:
    with CheckpointManager(tmp_path / "pre", model=_mlp()) as ckpt:
        ckpt.save(7)
    headed = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    first = headed[0].weight.detach().clone()
    ckpt = CheckpointManager(tmp_path / "tune", model=headed)
    with pytest.raises(IncompatibleCheckpointError, match="nothing was loaded"):
        ckpt.load_weights(tmp_path / "pre" / "step_000000007")
    assert torch.equal(headed[0].weight, first)
    with pytest.warns(ResumekitWarning, match=r"2 model entries keep their current values"):
        assert ckpt.load_weights(tmp_path / "pre", strict=False) == 7
    assert torch.equal(headed[0].weight, _mlp().state_dict()["0.weight"])
    ckpt.close()


# --------------------------------------------------------------------------- imported


def _full_trainer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return optimizer, scheduler, ResumableDistributedSampler(64, seed=1)


def test_a_weights_only_import_restores_into_a_full_trainer_naming_what_starts_fresh(
    tmp_path: Path
) -> None:
    model = _mlp()
    weights = _weights(model)
    (tmp_path / "up" / "checkpoint_step_40" / "transformer").mkdir(parents=True)
    save_file(weights, str(tmp_path / "up" / "checkpoint_step_40" / "transformer" /
                           "diffusion_pytorch_model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)
        resumekit.import_checkpoint(tmp_path / "up" / "checkpoint_step_40", tmp_path / "root",
                                    format="lingbot")
    fresh = _mlp(seed=8)
    optimizer, scheduler, sampler = _full_trainer(fresh)
    ckpt = CheckpointManager(tmp_path / "root", model=fresh, optimizer=optimizer,
                             scheduler=scheduler, data=sampler, config={"lr": 1e-2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore() == 40
    ours = [w for w in caught if issubclass(w.category, ResumekitWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert os.fspath(tmp_path / "root" / "step_000000040") in message
    for part in ("data position", "scheduler", "optimizer", "RNG",
                 "records no configuration"):
        assert part in message, part
    _assert_bitwise(fresh, weights)
    assert sampler.state_dict()["consumed"] == 0  # the data position starts fresh
    # The run goes on and saves a checkpoint of its own, which restores exactly.
    _train(fresh, optimizer, 1)
    ckpt.step_end(41)
    ckpt.save(41)
    ckpt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        again = CheckpointManager(tmp_path / "root", model=_mlp(), config={"lr": 1e-2})
        assert again.restore() == 41
        again.close()


def test_a_lightning_import_restores_with_its_optimizer_and_only_data_and_rng_fresh(
    tmp_path: Path
) -> None:
    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(12, 8)), batch_size=4)
    module = Module()
    trainer = L.Trainer(max_steps=3, default_root_dir=tmp_path / "pl", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu")
    trainer.fit(module, data)
    ckpt_file = next((tmp_path / "pl").rglob("*.ckpt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)
        resumekit.import_checkpoint(ckpt_file, tmp_path / "root")
    fresh = Module()
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sampler = ResumableDistributedSampler(64, seed=1)
    ckpt = CheckpointManager(tmp_path / "root", model=fresh, optimizer=optimizer,
                             data=sampler)
    with pytest.warns(ResumekitWarning, match=r"holds no data position, RNG of that run"):
        assert ckpt.restore() == 3
    assert optimizer.state_dict()["state"]  # the optimizer state came with it
    _assert_bitwise(fresh, _weights(module))
    ckpt.close()


def test_a_resumekit_checkpoint_without_a_data_position_is_still_an_error(
    tmp_path: Path
) -> None:
    with CheckpointManager(tmp_path, model=_mlp()) as ckpt:
        ckpt.save(1)
    with pytest.raises(IncompatibleCheckpointError, match="no data position"):
        CheckpointManager(tmp_path, model=_mlp(),
                          data=ResumableDistributedSampler(64, seed=1)).restore()
    assert json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())[
        "reason"] == "manual"
