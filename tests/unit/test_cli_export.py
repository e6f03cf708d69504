"""``resumekit export`` and ``resumekit.tools.export.export_checkpoint``."""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import tracemalloc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from resumekit import tensors
from resumekit.errors import ResumekitError, StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.storage import Storage
from resumekit.tools import legacy
from resumekit.tools.export import export_checkpoint
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
    expected = dict(tensors.iter_full_tensors(
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
    real = tensors.iter_full_tensors
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
    monkeypatch.setattr(tensors, "iter_full_tensors", counting)
    tracemalloc.start()
    gc.disable()  # freed by reference counting, not whenever the cycle collector runs
    try:
        result = export_checkpoint(tmp_path / "run", None, tmp_path / "out", dtype="bf16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        gc.enable()
        tracemalloc.stop()
    assert len(alive_at_yield) == result.tensors == 32
    # When each tensor arrives, every earlier one (and its bf16 copy) has been freed.
    assert alive_at_yield == [0] * 32
    # Python-side buffers (shard bytes read, headers) stay near one tensor, far below
    # the model: torch's own tensor storage is covered by the count above.
    assert result.largest_tensor_bytes == largest
    assert peak < 2 * largest < model_bytes // 8


class _FullDisk:
    """Files opened for writing through ``Storage.open`` take ``budget`` bytes in all, then
    fail with ``ENOSPC`` as a full disk does (after writing what still fit)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
        self.left = budget
        self.failures = 0
        real = Storage.open

        @contextmanager
        def open_on_a_small_disk(store: Storage, relative: str, mode: str = "rb"
                                 ) -> Iterator[Any]:
            with real(store, relative, mode) as handle:
                yield handle if "w" not in mode else _Limited(handle, self)

        monkeypatch.setattr(Storage, "open", open_on_a_small_disk)


class _Limited:
    def __init__(self, handle: Any, disk: _FullDisk) -> None:
        self.handle, self.disk = handle, disk

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        fits = min(len(view), self.disk.left)
        self.handle.write(view[:fits])
        self.disk.left -= fits
        if fits < len(view):
            self.disk.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def flush(self) -> None:
        self.handle.flush()


def _exported_bytes(root: Path, tmp_path: Path, max_shard_bytes: int) -> int:
    """What the same export writes on a disk with room."""
    roomy = tmp_path / "roomy"
    export_checkpoint(root, out=roomy, max_shard_bytes=max_shard_bytes)
    return sum(path.stat().st_size for path in roomy.rglob("*") if path.is_file())


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 64],
                         ids=["one file", "three shards and an index"])
def test_export_on_a_full_disk_names_the_file_and_the_bytes_needed_and_leaves_nothing(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], max_shard_bytes: int,
) -> None:
    root, _ = trained
    needed = _exported_bytes(root, tmp_path, max_shard_bytes)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    disk = _FullDisk(monkeypatch, budget=needed // 2)  # the first shards fit, not all
    code, _, err = run_cli(capsys, "export", str(root), "--out", str(out),
                           "--max-shard-size", f"{max_shard_bytes}B")
    assert code == 1 and disk.failures == 1
    assert_one_error_line(err, "the disk is full")
    line = err.strip()
    assert "[Errno 28]" not in line and "errno 28" in line
    assert str(out) in line and re.search(r"needs (at least )?\d+ bytes", line)
    # nothing of the export is left, not even the shards written before the disk filled
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt"]
    disk.left = needed // 2  # the API raises a StorageError with the numbers as attributes
    with pytest.raises(StorageError) as caught:
        export_checkpoint(root, out=out, max_shard_bytes=max_shard_bytes)
    assert isinstance(caught.value, ResumekitError) and caught.value.errno == errno.ENOSPC
    assert caught.value.needed_bytes >= needed - 4096
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt"]


def test_export_format_torch_on_a_full_disk_names_the_file_and_the_bytes_needed(
    trained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    target = out / "full.pt"
    disk = _FullDisk(monkeypatch, budget=600)  # torch's archive header fits, a tensor not
    code, _, err = run_cli(capsys, "export", str(root), "--format", "torch",
                           "--out", str(target))
    assert code == 1 and disk.failures == 1
    assert_one_error_line(err, "the disk is full")
    line = err.strip()
    # torch's own report of it is "[enforce fail at inline_container.cc] ... file write
    # failed": the cause is the write's OSError, named, with the file and the size
    assert "inline_container" not in line and "errno 28" in line
    assert str(target) in line and re.search(r"needs at least \d+ bytes", line)
    assert list(out.iterdir()) == []
