"""Stock DCP reads resumekit checkpoints: ``resumekit.StorageReader`` and ``tensor_format``.

One process. The two-rank FSDP2 cases (resharding) are in tests/dist/test_storage_reader_fsdp.py.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import resumekit
from resumekit import tensors as tensor_io
from resumekit.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    ResumekitError,
)
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import read_manifest
from resumekit.store.layout import MANIFEST_NAME
from resumekit.store.manifest import checksum_chunks
from resumekit.store.storage import Storage
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors import state_dicts
from resumekit.tensors.metadata_file import REFUSAL
from resumekit.tensors.reader import make_reader, read_metadata_bytes
from tests.limits import HANG_S

STEP = "step_000000003"


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are single-process"


@pytest.fixture(autouse=True)
def _quiet_single_process_notice() -> Any:
    with warnings.catch_warnings():  # stock dcp.load without a group says so; intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(seed)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        model(torch.randn(5, 6, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def saved(root: Path | str, tensor_format: str = "raw",
          seed: int = 0) -> tuple[dict[str, Any], str]:
    """A committed checkpoint of step 3; the state it holds (deep copy) and its step dir."""
    model, optimizer = trained(seed)
    expected = copy.deepcopy(state_dicts.model_and_optimizer_state(model, optimizer))
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                tensor_format=tensor_format)  # type: ignore[arg-type]
    manager.save(3)
    manager.close()
    step_dir = f"{root}/{STEP}"
    return expected, step_dir


def fresh_state(seed: int = 99) -> dict[str, Any]:
    """The state dict of a model + optimizer built afresh (other values everywhere)."""
    model, optimizer = build(seed)
    return state_dicts.model_and_optimizer_state(model, optimizer)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, list) and any(isinstance(item, dict) for item in tree):
        return flat(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def assert_bit_identical(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    have, want = flat(actual), flat(expected)
    assert sorted(have) == sorted(want)
    tensors = 0
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            tensors += 1
            assert have[key].dtype == value.dtype, key
            assert have[key].shape == value.shape, key
            assert torch.equal(have[key].reshape(-1).view(torch.uint8),
                               value.reshape(-1).view(torch.uint8)), key
        else:
            assert have[key] == value, key
    assert tensors >= 8  # weights, biases and both Adam moments of each


def data_files(step_dir: str) -> list[Path]:
    return sorted(Path(step_dir, "tensors").glob("*.distcp"))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def corrupt_error(error: BaseException) -> CorruptCheckpointError:
    """The CorruptCheckpointError inside what stock dcp.load raised (it wraps by rank)."""
    assert isinstance(error, CheckpointException), error
    causes = [cause for cause, _ in error.failures.values()]
    found = [cause for cause in causes if isinstance(cause, CorruptCheckpointError)]
    assert found, causes
    return found[0]


# ------------------------------------------------------------------------- the reader


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_stock_dcp_load_with_the_reader_fills_a_fresh_model_and_optimizer_bit_for_bit(
    tmp_path: Path, tensor_format: str
) -> None:
    expected, step_dir = saved(tmp_path, tensor_format)
    state = fresh_state()
    assert not torch.equal(flat(state)["model.0.weight"], flat(expected)["model.0.weight"])
    dcp.load(state, storage_reader=resumekit.StorageReader(step_dir))
    assert_bit_identical(state, expected)


@pytest.mark.parametrize("which", ["step directory", "tensors folder", "file URL"])
def test_the_reader_accepts_the_step_directory_its_tensors_folder_and_a_file_url(
    tmp_path: Path, which: str
) -> None:
    expected, step_dir = saved(tmp_path)
    path = {"step directory": step_dir, "tensors folder": f"{step_dir}/tensors",
            "file URL": f"file://{step_dir}"}[which]
    reader = resumekit.StorageReader(path)
    assert isinstance(reader, dcp.StorageReader)
    assert Path(reader.step_dir) == Path(step_dir)
    state = fresh_state()
    dcp.load(state, storage_reader=reader)
    assert_bit_identical(state, expected)


@pytest.mark.parametrize("which", ["step directory", "attempt tensors folder"])
def test_the_reader_finds_the_attempt_folder_of_an_object_store_checkpoint_by_its_manifest(
    which: str,
) -> None:
    root = f"memory://storage-reader-{uuid.uuid4().hex}"
    try:
        expected, step_dir = saved(root)
        manifest = read_manifest(Storage(root), STEP)
        assert manifest.data_dir.startswith("attempt-")
        assert manifest.tensor_format == "dcp"  # the object-store writer is DCP's own
        path = step_dir if which == "step directory" else \
            f"{step_dir}/{manifest.data_dir}/tensors"
        state = fresh_state()
        dcp.load(state, storage_reader=resumekit.StorageReader(path))
        assert_bit_identical(state, expected)
    finally:
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_the_reader_serves_dcp_to_torch_save_with_the_empty_state_dict_planner(
    tmp_path: Path,
) -> None:
    expected, step_dir = saved(tmp_path)
    # What dcp_to_torch_save does, with our reader in place of FileSystemReader:
    full: dict[str, Any] = {}
    _load_state_dict(full, storage_reader=resumekit.StorageReader(step_dir),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(full, tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_bit_identical(loaded, expected)


def test_stock_dcp_cannot_read_a_raw_checkpoint_but_the_reader_can(tmp_path: Path) -> None:
    expected, step_dir = saved(tmp_path)
    with pytest.raises(CheckpointException, match="resumekit-raw"):
        dcp_to_torch_save(f"{step_dir}/tensors", tmp_path / "full.pt")
    state = fresh_state()
    dcp.load(state, storage_reader=resumekit.StorageReader(step_dir))
    assert_bit_identical(state, expected)


def _small_then_large() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose first tensors are small (packed) and later ones large (stored alone).

    The writer puts the largest items first in each file, so the item DCP's stock reader
    asks for first (in the state's own order) is a packed member, not a region's first.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1024), nn.LayerNorm(1024),
                          nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("reads", ["model and optimizer", "model only", "optimizer only",
                                   "dcp_to_torch_save"])
def test_stock_dcp_refuses_a_raw_checkpoint_naming_the_format_whatever_it_reads_first(
    tmp_path: Path, reads: str
) -> None:
    model, optimizer = _small_then_large()
    with CheckpointManager(tmp_path, model=model, optimizer=optimizer) as manager:
        manager.save(3)
    tensors = f"{tmp_path}/{STEP}/tensors"
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    with pytest.raises(CheckpointException) as caught:
        if reads == "dcp_to_torch_save":
            dcp_to_torch_save(tensors, tmp_path / "full.pt")
        else:
            wanted = {"model and optimizer": state, "model only": {"model": state["model"]},
                      "optimizer only": {"optimizer": state["optimizer"]}}[reads]
            dcp.load(wanted, storage_reader=FileSystemReader(tensors))
    causes = [str(cause) for cause, _ in caught.value.failures.values()]
    # schema_version 5: it stops at .metadata, laid out by rank, whose first bytes say so
    assert causes and all(REFUSAL in cause for cause in causes), causes
    assert not any("weights_only" in cause for cause in causes), causes
    assert not (tmp_path / "full.pt").exists()


def test_a_raw_checkpoint_with_undescribed_packed_members_as_main_wrote_still_restores(
    tmp_path: Path,
) -> None:
    model, optimizer = _small_then_large()
    expected = copy.deepcopy(state_dicts.model_and_optimizer_state(model, optimizer))
    with CheckpointManager(tmp_path, model=model, optimizer=optimizer) as manager:
        manager.save(3)
    step_dir = f"{tmp_path}/{STEP}"
    _strip_member_descriptors(Path(step_dir))
    state = fresh_state_of(_small_then_large)
    dcp.load(state, storage_reader=resumekit.StorageReader(step_dir))
    assert_bit_identical(state, expected)
    fresh_model, fresh_optimizer = _small_then_large()
    with torch.no_grad():
        for parameter in fresh_model.parameters():
            parameter.zero_()
    with CheckpointManager(tmp_path, model=fresh_model,
                           optimizer=fresh_optimizer) as manager:
        assert manager.restore() == 3
    assert_bit_identical(state_dicts.model_and_optimizer_state(fresh_model, fresh_optimizer),
                         expected)


def fresh_state_of(build_it: Any) -> dict[str, Any]:
    model, optimizer = build_it()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1)
    return state_dicts.model_and_optimizer_state(model, optimizer)


def _strip_member_descriptors(step_dir: Path) -> None:
    """Rewrite ``tensors/.metadata`` as main wrote it: packed members carry no descriptor.

    The manifest's checksum of ``.metadata`` is updated to match (what main recorded).
    """
    path = step_dir / "tensors" / ".metadata"
    metadata = read_metadata_bytes(path.read_bytes(), str(path))  # this test's save
    stripped = 0
    for info in metadata.storage_data.values():
        descriptors = tuple(info.transform_descriptors or ())
        if descriptors == raw_tensor_files.MEMBER_DESCRIPTORS:
            info.transform_descriptors = None
            stripped += 1
    assert stripped  # the checkpoint has packed members after a region's first
    data = pickle.dumps(metadata)
    path.write_bytes(data)
    manifest_path = step_dir / MANIFEST_NAME
    document = json.loads(manifest_path.read_text())
    (entry,) = [entry for entry in document["files"] if entry["path"] == "tensors/.metadata"]
    entry["size"], entry["checksum"] = len(data), checksum_chunks([data])
    manifest_path.write_text(json.dumps(document))


def test_a_flipped_byte_in_a_raw_file_is_corrupt_naming_the_file_and_key(
    tmp_path: Path,
) -> None:
    _, step_dir = saved(tmp_path)
    info = {index.fqn: stored for index, stored in make_reader(
        f"{step_dir}/tensors", None).read_metadata().storage_data.items()}
    target = info["model.2.weight"]
    flip_byte(Path(step_dir, "tensors", target.relative_path), target.offset + 5)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(fresh_state(), storage_reader=resumekit.StorageReader(step_dir))
    error = corrupt_error(caught.value)
    assert target.relative_path in str(error) and "model.2.weight" in str(error)
    assert error.key == "model.2.weight"
    assert "model.2.weight" in str(caught.value)  # what a user sees, too


def test_a_flipped_byte_in_a_dcp_format_file_fails_its_manifest_checksum_naming_the_file(
    tmp_path: Path,
) -> None:
    _, step_dir = saved(tmp_path, "dcp")
    victim = data_files(step_dir)[0]
    flip_byte(victim, victim.stat().st_size // 2)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(fresh_state(), storage_reader=resumekit.StorageReader(step_dir))
    error = corrupt_error(caught.value)
    assert victim.name in str(error) and "manifest" in str(error)
    assert error.key is not None and error.key.startswith(("model.", "optimizer."))


def test_a_flipped_byte_in_the_metadata_is_caught_before_it_is_unpickled(
    tmp_path: Path,
) -> None:
    _, step_dir = saved(tmp_path)
    metadata = Path(step_dir, "tensors", ".metadata")
    flip_byte(metadata, metadata.stat().st_size - 3)
    reader = resumekit.StorageReader(step_dir)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata does not match"):
        reader.read_metadata()


@pytest.mark.parametrize("case", ["empty directory", "plain DCP checkpoint", "missing",
                                  "uncommitted step"])
def test_a_directory_that_is_not_a_resumekit_checkpoint_is_refused_naming_it(
    tmp_path: Path, case: str
) -> None:
    target = tmp_path / "not-ours"
    if case == "empty directory":
        target.mkdir()
    elif case == "plain DCP checkpoint":
        model, optimizer = trained()
        dcp.save(state_dicts.model_and_optimizer_state(model, optimizer),
                 checkpoint_id=str(target))
    elif case == "uncommitted step":
        _, step_dir = saved(tmp_path / "root")
        Path(step_dir, "manifest.json").unlink()
        target = Path(step_dir)
    with pytest.raises(CheckpointNotFoundError, match="not a resumekit checkpoint") as caught:
        resumekit.StorageReader(target)
    assert isinstance(caught.value, ResumekitError)
    assert str(target) in str(caught.value)
    assert caught.value.path == str(target)


def test_reset_points_the_reader_at_another_checkpoint(tmp_path: Path) -> None:
    first, first_dir = saved(tmp_path / "a", seed=0)
    second, second_dir = saved(tmp_path / "b", seed=1)
    reader = resumekit.StorageReader(first_dir)
    state = fresh_state()
    dcp.load(state, storage_reader=reader)
    assert_bit_identical(state, first)
    state = fresh_state()
    dcp.load(state, storage_reader=reader, checkpoint_id=second_dir)
    assert_bit_identical(state, second)


# ---------------------------------------------------------------- tensor_format="dcp"


def test_a_dcp_format_checkpoint_is_read_by_stock_dcp_with_its_own_reader(
    tmp_path: Path,
) -> None:
    expected, step_dir = saved(tmp_path, "dcp")
    state = fresh_state()
    dcp.load(state, storage_reader=FileSystemReader(f"{step_dir}/tensors"))
    assert_bit_identical(state, expected)
    dcp_to_torch_save(f"{step_dir}/tensors", tmp_path / "full.pt")
    assert_bit_identical(torch.load(tmp_path / "full.pt", weights_only=True), expected)


def test_torchs_format_utils_command_converts_a_dcp_format_checkpoint(tmp_path: Path) -> None:
    expected, step_dir = saved(tmp_path, "dcp")
    out = tmp_path / "full.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils",
                    "dcp_to_torch", f"{step_dir}/tensors", str(out)],
                   check=True, capture_output=True, timeout=HANG_S)
    assert_bit_identical(torch.load(out, weights_only=True), expected)


@pytest.mark.parametrize("async_save", [False, True])
def test_restore_of_a_dcp_format_checkpoint_is_bit_identical_and_records_the_format(
    tmp_path: Path, async_save: bool
) -> None:
    model, optimizer = trained()
    expected = copy.deepcopy(state_dicts.model_and_optimizer_state(model, optimizer))
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                                tensor_format="dcp", async_save=async_save)
    manager.save(3)
    manager.close()
    manifest = read_manifest(Storage(tmp_path), STEP)
    assert manifest.tensor_format == "dcp"
    assert not tensor_io.files_verified_on_read(tmp_path / STEP / "tensors")  # DCP's own
    fresh, fresh_optimizer = build(99)
    restored = CheckpointManager(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert restored.restore() == 3
    assert_bit_identical(state_dicts.model_and_optimizer_state(fresh, fresh_optimizer), expected)


def test_the_default_tensor_format_is_raw_and_recorded_so(tmp_path: Path) -> None:
    _, step_dir = saved(tmp_path)
    assert read_manifest(Storage(tmp_path), STEP).tensor_format == "raw"
    assert {p.name for p in data_files(step_dir)} == tensor_io.files_verified_on_read(
        f"{step_dir}/tensors")


def test_restore_of_a_dcp_format_checkpoint_verifies_it_against_the_manifest(
    tmp_path: Path,
) -> None:
    _, step_dir = saved(tmp_path, "dcp")
    victim = data_files(step_dir)[0]
    flip_byte(victim, victim.stat().st_size // 2)
    model, optimizer = build(99)
    before = copy.deepcopy(model.state_dict())
    manager = CheckpointManager(tmp_path, model=model, optimizer=optimizer, fallback=False)
    with pytest.raises(CorruptCheckpointError, match=victim.name):
        manager.restore()
    for key, value in model.state_dict().items():  # hashed before loading: nothing loaded
        assert torch.equal(value, before[key]), key


def test_an_unknown_tensor_format_is_refused_naming_the_argument(tmp_path: Path) -> None:
    model, optimizer = build(0)
    with pytest.raises(ConfigurationError, match="tensor_format") as caught:
        CheckpointManager(tmp_path, model=model, optimizer=optimizer,
                          tensor_format="safetensors")  # type: ignore[arg-type]
    assert caught.value.name == "tensor_format"
    assert caught.value.value == "safetensors"
    with pytest.raises(ConfigurationError, match="tensor_format"):
        tensor_io.save({"x": torch.zeros(2)}, tmp_path / "t",
                     tensor_format="zip")  # type: ignore[arg-type]


def test_an_explicit_raw_format_on_an_object_store_warns_and_records_dcp() -> None:
    root = f"memory://raw-on-objects-{uuid.uuid4().hex}"
    with pytest.warns(resumekit.ResumekitWarning, match=r"tensor_format='raw' cannot write to"):
        ckpt = resumekit.CheckpointManager(root, tensor_format="raw")
    assert ckpt.tensor_format == "dcp"


def test_the_default_format_picks_raw_on_local_disks_and_dcp_on_object_stores(
        tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    assert resumekit.CheckpointManager(tmp_path).tensor_format == "raw"
    memory_root = f"memory://default-{uuid.uuid4().hex}"
    assert resumekit.CheckpointManager(memory_root).tensor_format == "dcp"
    assert not [w for w in recwarn if "tensor_format" in str(w.message)]
