"""``resumekit import``: other tools' checkpoints, written by the real libraries, restore bit
for bit through ``CheckpointManager.restore()``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import resumekit
from resumekit.errors import ConfigurationError, IncompatibleCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import read_manifest
from resumekit.store.manifest import SaveReason
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import assert_one_error_line, run_cli, run_json


def _mlp(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state by parameter name, copied."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": {k: v.detach().clone() for k, v in model_state.items()},
            "state": {fqn: {k: v.clone() for k, v in entry.items()}
                      for fqn, entry in optim_state["state"].items()}}


def _assert_restores_bitwise(root: Path, expected: dict[str, Any], model: nn.Module,
                             optimizer: torch.optim.Optimizer, step: int,
                             scheduler: Any = None) -> None:
    manager = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=scheduler)
    assert manager.restore() == step
    got = _snapshot(model, optimizer)
    assert got["model"].keys() == expected["model"].keys()
    for key, tensor in expected["model"].items():
        assert got["model"][key].dtype == tensor.dtype
        assert torch.equal(got["model"][key], tensor), key
    assert got["state"].keys() == expected["state"].keys()
    for fqn, entry in expected["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["state"][fqn][name], entry[name]), (fqn, name)


def _only_committed(root: Path) -> Any:
    names = [p.name for p in root.iterdir() if not p.name.startswith(".")]
    assert len(names) == 1, names
    return read_manifest(Storage(root), names[0])


def test_a_stock_dcp_checkpoint_needs_a_step_then_restores_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, = [_mlp()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             checkpoint_id=str(tmp_path / "plain"))
    expected = _snapshot(model, optimizer)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "import", "plain", "root")
    assert code == 2 and "records no step" in err and "--step" in err
    code, document, _ = run_json(capsys, "import", "plain", "root", "--step", "7")
    assert code == 0 and document["format"] == "dcp" and document["step"] == 7
    manifest = _only_committed(tmp_path / "root")
    assert manifest.reason == SaveReason.IMPORTED
    assert manifest.lineage.imported_from == {"path": "plain", "format": "dcp"}
    fresh = _mlp()
    _assert_restores_bitwise(tmp_path / "root", expected, fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 7)


def test_a_torchtitan_step_directory_with_a_flattened_optimizer_imports_at_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps=3)
    # torchtitan's layout: model keys at the top level, the optimizer flattened.
    flat = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**model.state_dict(), "optimizer": flat,
              "train_state": {"step": torch.tensor(3)}},
             checkpoint_id=str(tmp_path / "outputs" / "step-3"))
    expected = _snapshot(model, optimizer)
    code, out, err = run_cli(capsys, "import", str(tmp_path / "outputs" / "step-3"),
                             str(tmp_path / "root"))
    assert code == 0, err
    assert "imported torchtitan checkpoint" in out and "as step 3" in out
    fresh = _mlp()
    _assert_restores_bitwise(tmp_path / "root", expected, fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 3)


def test_an_accelerate_save_state_imports_with_the_step_given_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    accelerator = Accelerator(cpu=True)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "acc"))
    expected = _snapshot(accelerator.unwrap_model(model), optimizer.optimizer)
    code, _, err = run_cli(capsys, "import", str(tmp_path / "acc"), str(tmp_path / "root"),
                           "--format", "accelerate")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("resumekit import: error: ") and "records no step" in err
    assert "--step" in err
    code, out, err = run_cli(capsys, "import", str(tmp_path / "acc"), str(tmp_path / "root"),
                             "--format", "accelerate", "--step", "2")
    assert code == 0, err
    assert "RNG streams" in out and "NOT carried over" in out
    fresh = _mlp()
    _assert_restores_bitwise(tmp_path / "root", expected, fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 2)


def test_safetensors_weights_of_equal_shapes_need_the_model_for_the_parameter_order(
    tmp_path: Path,
) -> None:

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    accelerator.save_state(str(tmp_path / "acc"))
    expected = _snapshot(accelerator.unwrap_model(model), optimizer.optimizer)
    with pytest.raises(ConfigurationError, match=r"does not keep the parameter order.*model="):
        resumekit.import_checkpoint(tmp_path / "acc", tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())
    reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    with pytest.warns(ResumekitWarning, match="NOT carried over"):
        resumekit.import_checkpoint(tmp_path / "acc", tmp_path / "root", step=1,
                                    model=reference)
    _assert_restores_bitwise(tmp_path / "root", expected, reference,
                             torch.optim.AdamW(reference.parameters(), lr=1e-2), 1)


class _LitMLP(nn.Module):
    """The LightningModule's parameters, as a plain module (same names: ``net.*``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()


def test_a_lightning_checkpoint_imports_at_its_global_step_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    lit = Lit()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / "lightning"))
    trainer.fit(lit, DataLoader(TensorDataset(torch.randn(12, 8)), batch_size=4))
    (ckpt,) = (tmp_path / "lightning" / "checkpoints").glob("*.ckpt")  # ModelCheckpoint
    expected = _snapshot(lit, trainer.optimizers[0])
    code, document, err = run_json(capsys, "import", str(ckpt), str(tmp_path / "root"))
    assert code == 0, err
    assert document["format"] == "lightning" and "step" in document["carried"]
    assert any("epoch's data restarts" in item for item in document["not_carried"])
    fresh = _LitMLP()
    _assert_restores_bitwise(tmp_path / "root", expected, fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 3)


def test_an_hf_trainer_checkpoint_imports_its_step_scheduler_and_both_decay_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16)

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = (torch.arange(8) + index) % 32
            return {"input_ids": ids, "labels": ids}

    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, save_steps=2,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             weight_decay=0.1, disable_tqdm=True, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    source = tmp_path / "hf" / "checkpoint-2"
    assert (source / "model.safetensors").exists() and (source / "optimizer.pt").exists()
    expected = _snapshot(model, trainer.optimizer.optimizer)
    code, out, err = run_cli(capsys, "import", str(source), str(tmp_path / "root"))
    assert code == 0, err
    assert "model, optimizer, scheduler, step" in out
    # q/k/v/o projections share one shape: only the architecture's order tells them apart.
    fresh = LlamaForCausalLM(config)
    decay = set(trainer.get_decay_parameter_names(fresh))
    named = list(fresh.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
         {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=5e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    _assert_restores_bitwise(tmp_path / "root", expected, fresh, optimizer, 2,
                             scheduler=scheduler)
    assert scheduler.last_epoch == trainer.lr_scheduler.last_epoch == 2


def test_a_lingbot_upstream_directory_imports_its_weights_at_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _mlp()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (tmp_path / "up" / "checkpoint_step_40" / "transformer").mkdir(parents=True)
    save_file(weights, str(tmp_path / "up" / "checkpoint_step_40" / "transformer" /
                           "diffusion_pytorch_model.safetensors"))
    code, document, err = run_json(capsys, "import", str(tmp_path / "up" / "checkpoint_step_40"),
                                   str(tmp_path / "root"), "--format", "lingbot")
    assert code == 0, err
    assert document["step"] == 40 and "optimizer" not in document["carried"]
    fresh = _mlp()
    assert CheckpointManager(tmp_path / "root", model=fresh).restore() == 40
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())


def test_index_keyed_optimizer_state_that_does_not_fit_the_parameters_is_refused(
    tmp_path: Path,
) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps=1)
    # A model state dict holds buffers too: the counts differ and the import says so.
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
             checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(IncompatibleCheckpointError, match=r"holds 6 parameters but 9"):
        resumekit.import_checkpoint(tmp_path / "plain", tmp_path / "root", step=1)
    assert not any((tmp_path / "root").glob("step_*"))
    resumekit.import_checkpoint(tmp_path / "plain", tmp_path / "root", step=1, model=model)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    _assert_restores_bitwise(tmp_path / "root", _snapshot(model, optimizer), fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 1)


def test_a_directory_that_is_no_known_checkpoint_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "src"), str(tmp_path / "root"))
    assert code == 1
    assert_one_error_line(err, str(tmp_path / "src"), "not a checkpoint resumekit can import")
    assert json.dumps(os.listdir(tmp_path)) == json.dumps(["src"])
