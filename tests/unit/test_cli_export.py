"""``resumekit export`` and ``resumekit.export.export_checkpoint``."""

from __future__ import annotations

import json
import tracemalloc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from resumekit import legacy, sharded
from resumekit.export import export_checkpoint
from resumekit.manager import CheckpointManager
from resumekit.storage import Storage
from tests.unit.test_cli_support import (
    MODEL_CONFIG,
    assert_one_error_line,
    run_cli,
    run_json,
    write_checkpoints,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("export") / "run"
    trainer = write_checkpoints(root, [10, 20])
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return root, state


def _load_export(directory: Path, files: list[str]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(directory / name)))
    return weights


def test_export_writes_the_newest_model_as_one_safetensors_file_equal_to_the_state_dict(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, state = trained
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "export", str(root), "--out", str(out))
    assert code == 0, err
    assert "exported step 20" in stdout and "model.safetensors" in stdout
    # The run saved extras={"model_config": ...}: the plain layout writes it as config.json.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(weights[key], tensor), key
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert handle.metadata()["resumekit_step"] == "20"


def test_export_casts_floats_to_bf16_and_splits_into_indexed_shards(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = trained
    code, document, err = run_json(capsys, "export", str(root), "--step", "10", "--out",
                                   str(tmp_path), "--dtype", "bf16", "--max-shard-size", "64B")
    assert code == 0, err
    assert document["schema"] == "resumekit.export/1" and document["step"] == 10
    files = document["files"]
    # bf16 sizes 64, 16, 48 and 6 bytes pack greedily into files of at most 64 bytes.
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    weights = _load_export(tmp_path, files)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in weights.values())
    assert index["weight_map"] == {"0.weight": files[0], "0.bias": files[1],
                                   "2.weight": files[1], "2.bias": files[2]}
    expected = dict(sharded.iter_full_tensors(
        str(root / "step_000000010" / "tensors"),
        [f"model.{k}" for k in weights]))
    for key, tensor in weights.items():
        assert torch.equal(tensor, expected[f"model.{key}"].to(torch.bfloat16)), key


def test_the_diffusers_layout_writes_config_and_imports_back_as_legacy_weights(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, state = trained
    result = export_checkpoint(root, 20, tmp_path / "ckpt", layout="diffusers",
                               max_shard_bytes=100)
    transformer = tmp_path / "ckpt" / "transformer"
    assert result.out == str(transformer) and result.index is not None
    assert (transformer / "diffusion_pytorch_model.safetensors.index.json").exists()
    config = json.loads((transformer / "config.json").read_text())
    assert result.config_source == "extras.model_config"
    assert {k: config[k] for k in MODEL_CONFIG} == MODEL_CONFIG
    assert config["_resumekit"]["step"] == 20
    weights = legacy.read_full_weights(Storage(tmp_path), "ckpt")
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_export_refuses_to_overwrite_an_existing_export_unless_asked(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = trained
    assert run_cli(capsys, "export", str(root), "--out", str(tmp_path), "--max-shard-size",
                   "100")[0] == 0
    code, _, err = run_cli(capsys, "export", str(root), "--out", str(tmp_path))
    assert code == 1
    assert_one_error_line(err, "model-00001-of-", "already exists", "--overwrite")
    code, _, err = run_cli(capsys, "export", str(root), "--out", str(tmp_path),
                           "--overwrite", "--verify")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_export_errors_exit_1_and_bad_options_exit_2(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = trained
    code, _, err = run_cli(capsys, "export", str(root), "--step", "15", "--out", str(tmp_path))
    assert code == 1
    assert_one_error_line(err, "no checkpoint of step 15")
    code, _, err = run_cli(capsys, "export", str(root), "--out", str(tmp_path), "--dtype", "int8")
    assert code == 2 and "invalid choice" in err
    code, _, err = run_cli(capsys, "export", str(root))
    assert code == 2 and "--out" in err
    code, _, err = run_cli(capsys, "export", str(root), "--out", str(tmp_path),
                           "--max-shard-size", "lots")
    assert code == 2 and "not a size" in err


def test_export_holds_one_tensor_at_a_time_so_memory_is_bounded_by_the_largest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])  # 16 x 1 MiB weights
    manager = CheckpointManager(str(tmp_path / "run"), model=model,
                                optimizer=torch.optim.AdamW(model.parameters()))
    manager.save(1)
    manager.close()
    largest = 512 * 512 * 4
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert model_bytes > 16 * largest
    real = sharded.iter_full_tensors
    alive_at_yield: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        earlier: list[weakref.ref[torch.Tensor]] = []
        for name, tensor in real(*args, **kwargs):
            alive_at_yield.append(sum(
                t.numel() * t.element_size() for t in (ref() for ref in earlier)
                if t is not None))
            earlier.append(weakref.ref(tensor))
            yield name, tensor

    export_checkpoint(tmp_path / "run", None, tmp_path / "warm-up")  # imports, caches
    monkeypatch.setattr(sharded, "iter_full_tensors", counting)
    tracemalloc.start()
    try:
        result = export_checkpoint(tmp_path / "run", None, tmp_path / "out", dtype="bf16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(alive_at_yield) == result.tensors == 32
    # When each tensor arrives, every earlier one (and its bf16 copy) has been freed.
    assert alive_at_yield == [0] * 32
    # Python-side buffers (shard bytes read, headers) stay near one tensor, far below
    # the model: torch's own tensor storage is covered by the count above.
    assert result.largest_tensor_bytes == largest
    assert peak < 2 * largest < model_bytes // 8
