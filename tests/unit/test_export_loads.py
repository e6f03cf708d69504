"""``resumekit export`` writes what diffusers, transformers and ``torch.load`` read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModel, LlamaConfig, LlamaModel

from resumekit.manager import CheckpointManager
from tests.unit.test_cli_support import assert_one_error_line, run_cli


def _train_and_save(root: Path, model: nn.Module, step: int, *,
                    extras: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    with CheckpointManager(root, model=model, optimizer=optimizer, extras=extras) as manager:
        manager.save(step)
    return optimizer


def _assert_no_local_path(out: Path, *paths: Path) -> None:
    """No file of the export names a local directory (the source, the output, tmp)."""
    for file in out.rglob("*"):
        if file.is_file():
            data = file.read_bytes()
            for path in paths:
                assert str(path).encode() not in data, (file, path)


def _tiny_wan() -> nn.Module:

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
        rope_max_seq_len=32)


def test_a_diffusers_export_loads_with_from_pretrained_in_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    model = _tiny_wan()
    config = json.loads(json.dumps(dict(model.config)))
    _train_and_save(tmp_path / "run", model, 30)  # the run recorded no model config
    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--out", str(out),
                           "--layout", "diffusers")
    assert code == 1
    assert_one_error_line(err, "--layout diffusers needs the model's config", "--model-config")
    assert not out.exists() or not any(out.rglob("*"))
    (tmp_path / "wan.json").write_text(json.dumps(config))
    code, stdout, err = run_cli(capsys, "export", str(tmp_path / "run"), "--out", str(out),
                                "--layout", "diffusers", "--dtype", "bf16",
                                "--model-config", str(tmp_path / "wan.json"))
    assert code == 0, err
    assert "config.json" in stdout
    loaded = WanTransformer3DModel.from_pretrained(str(out), subfolder="transformer",
                                                   torch_dtype=torch.bfloat16)
    expected = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor.to(torch.bfloat16)), key
    _assert_no_local_path(out, tmp_path)


def test_a_plain_export_of_a_run_with_a_model_config_loads_with_automodel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16)
    model = LlamaModel(config)
    _train_and_save(tmp_path / "run", model, 12,
                    extras={"model_config": json.loads(config.to_json_string())})
    out = tmp_path / "export"
    code, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModel.from_pretrained(str(out))
    assert type(loaded).__name__ == "LlamaModel"
    got = loaded.state_dict()
    for key, tensor in model.state_dict().items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), key
    _assert_no_local_path(out, tmp_path)


def test_a_torchtitan_step_directory_exports_its_top_level_model_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    _, optim_state = get_state_dict(model, optimizer)
    dcp.save({**model.state_dict(), "optimizer": optim_state,
              "train_state": {"step": torch.tensor(9)}},
             checkpoint_id=str(tmp_path / "outputs" / "step-9"))
    out = tmp_path / "export"
    code, stdout, err = run_cli(capsys, "export", str(tmp_path / "outputs" / "step-9"),
                                "--out", str(out))
    assert code == 0, err
    assert "exported step 9" in stdout
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    _assert_no_local_path(out, tmp_path)


def _assert_same_tree(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype, where
        assert torch.equal(left, right), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and left.keys() == right.keys(), where
        for key in left:
            _assert_same_tree(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            _assert_same_tree(a, b, f"{where}.{index}")
    else:
        assert left == right, where


def test_export_format_torch_writes_what_dcp_to_torch_save_writes_from_stock_dcp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = _train_and_save(tmp_path / "run", model, 5)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state},
             checkpoint_id=str(tmp_path / "stock"))  # the same state in stock DCP
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "stock.pt")
    code, stdout, err = run_cli(capsys, "export", str(tmp_path / "run"), "--format", "torch",
                                "--out", str(tmp_path / "ours.pt"))
    assert code == 0, err
    assert "ours.pt" in stdout
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    _assert_same_tree(ours, torch.load(tmp_path / "stock.pt", weights_only=True))
    assert ours["optimizer"]["state"]["0.weight"]["exp_avg"].shape == (16, 8)
    code, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--format", "torch",
                           "--out", str(tmp_path / "ours.pt"))
    assert code == 1
    assert_one_error_line(err, "ours.pt already exists", "--overwrite")
    code, _, err = run_cli(capsys, "export", str(tmp_path / "run"), "--format", "torch",
                           "--out", str(tmp_path / "x.pt"), "--dtype", "bf16")
    assert code == 2 and "--dtype does not apply to --format torch" in err
    # A plain DCP directory converts the same way.
    code, _, err = run_cli(capsys, "export", str(tmp_path / "stock"), "--format", "torch",
                           "--out", str(tmp_path / "stock-ours.pt"))
    assert code == 0, err
    _assert_same_tree(torch.load(tmp_path / "stock-ours.pt", weights_only=True), ours)
