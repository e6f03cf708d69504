"""resumekit.tensors in one process: round trips, strict loading, staging, index, export."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import pickle
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from torch import nn

from resumekit import tensors as tensor_io
from resumekit.errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)
from resumekit.tensors import state_dicts
from tests.limits import HANG_S


class WritesMarker:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def mlp(seed: int, hidden: int = 8, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3)).to(dtype)


def trained(seed: int = 0, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after one step, so optimizer state exists."""
    model = mlp(seed, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dtype = next(model.parameters()).dtype
    model(torch.randn(4, 5, dtype=dtype)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer and optimizer.state_dict()}
    )


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (have, want) in enumerate(zip(actual, expected, strict=True)):
            assert_same(have, want, f"{where}[{index}]")
    else:
        assert actual == expected, where


def restore(model: nn.Module, optimizer: torch.optim.Optimizer | None, directory: Any) -> None:
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    tensor_io.load(state, directory)
    state_dicts.apply_model_and_optimizer_state(model, optimizer, state)


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "these tests are single-process"


# --------------------------------------------------------------------------- round trips


def test_a_single_process_round_trip_restores_model_and_optimizer_bit_identically(
    tmp_path: Path,
) -> None:
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), tmp_path / "ckpt")

    fresh = mlp(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    assert not torch.equal(fresh[0].weight, model[0].weight)
    restore(fresh, fresh_optimizer, tmp_path / "ckpt")
    assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))


def test_training_continues_identically_after_a_round_trip(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), tmp_path / "ckpt")
    fresh = mlp(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    restore(fresh, fresh_optimizer, tmp_path / "ckpt")
    batch = torch.randn(4, 5)
    for net, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        net(batch).square().mean().backward()
        opt.step()
    assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))


def test_fp32_and_bf16_tensors_keep_their_dtype_on_disk_and_after_load(tmp_path: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model, optimizer = trained(seed=0, dtype=dtype)
        directory = tmp_path / str(dtype)
        tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), directory)
        index = tensor_io.read_tensor_index(directory)
        assert index["model.0.weight"].dtype == dtype
        assert index["optimizer.state.0.weight.exp_avg"].dtype == dtype
        fresh = mlp(seed=1, dtype=dtype)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters())
        restore(fresh, fresh_optimizer, directory)
        assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_checkpoint_round_trips_through_a_url(tmp_path: Path, scheme: str) -> None:
    if scheme == "memory":
        url = f"memory://rk-{uuid.uuid4().hex}/ckpt"
    else:
        url = f"file://{tmp_path}/ckpt"
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), url)
    filesystem, path = fsspec.core.url_to_fs(url)
    assert filesystem.exists(f"{path}/.metadata")
    fresh = mlp(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    restore(fresh, fresh_optimizer, url)
    assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))
    assert set(tensor_io.read_tensor_index(url)) == set(tensor_io.read_tensor_index(url))
    names = [name for name, _ in tensor_io.iter_full_tensors(url, ["model.2.bias"])]
    assert names == ["model.2.bias"]
    if scheme == "memory":
        filesystem.rm(path, recursive=True)


def test_non_tensor_values_round_trip_alongside_tensors(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(4.0)}, "extra": {"lr": 0.5, "tags": ["a", "b"]}}
    tensor_io.save(state, tmp_path / "ckpt")
    target: dict[str, Any] = {"model": {"w": torch.zeros(4)}, "extra": {"lr": 0.0, "tags": []}}
    tensor_io.load(target, tmp_path / "ckpt")
    assert_same(target, state)


# --------------------------------------------------------------------------- strictness


def test_a_changed_shape_raises_naming_the_key_and_loads_nothing(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), tmp_path / "ckpt")
    wider = mlp(seed=1, hidden=9)
    wider_optimizer = torch.optim.AdamW(wider.parameters())
    state = state_dicts.model_and_optimizer_state(wider, wider_optimizer)
    before = snapshot(wider, wider_optimizer)
    with pytest.raises(IncompatibleCheckpointError) as caught:
        tensor_io.load(state, tmp_path / "ckpt")
    message = str(caught.value)
    assert "model.0.weight: checkpoint has tensor (8, 5)" in message
    assert "state has tensor (9, 5)" in message
    assert "optimizer.state.0.weight.exp_avg_sq" in " ".join(caught.value.differences)
    assert str(tmp_path / "ckpt") in message
    assert_same(snapshot(wider, wider_optimizer), before)  # no partial load


def test_a_key_missing_from_the_checkpoint_raises_and_loads_nothing(tmp_path: Path) -> None:
    model = mlp(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model), tmp_path / "ckpt")
    deeper = nn.Sequential(*mlp(seed=1), nn.Linear(3, 3))
    state = state_dicts.model_and_optimizer_state(deeper)
    before = snapshot(deeper)
    missing = r"missing from checkpoint: model\.3\.weight"
    with pytest.raises(IncompatibleCheckpointError, match=missing):
        tensor_io.load(state, tmp_path / "ckpt")
    assert_same(snapshot(deeper), before)


def test_a_key_the_model_does_not_have_raises_as_unexpected(tmp_path: Path) -> None:
    deeper = nn.Sequential(*mlp(seed=0), nn.Linear(3, 3))
    tensor_io.save(state_dicts.model_and_optimizer_state(deeper), tmp_path / "ckpt")
    model = mlp(seed=1)
    before = snapshot(model)
    unexpected = r"unexpected in checkpoint: model\.3\.bias"
    with pytest.raises(IncompatibleCheckpointError, match=unexpected):
        tensor_io.load(state_dicts.model_and_optimizer_state(model), tmp_path / "ckpt")
    assert_same(snapshot(model), before)


def test_loading_only_the_model_from_a_full_checkpoint_is_allowed(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), tmp_path / "ckpt")
    fresh = mlp(seed=1)
    restore(fresh, None, tmp_path / "ckpt")
    assert_same(fresh.state_dict(), model.state_dict())


def test_applying_a_state_with_a_wrong_key_raises_before_touching_the_model() -> None:
    model, optimizer = trained(seed=0)
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    state = copy.deepcopy(state)
    state["model"]["0.weight"].add_(1.0)  # would change the model if applied
    state["model"]["0.wieght"] = state["model"].pop("0.bias")
    before = snapshot(model, optimizer)
    with pytest.raises(IncompatibleCheckpointError) as caught:
        state_dicts.apply_model_and_optimizer_state(model, optimizer, state)
    assert "missing: model.0.bias" in caught.value.differences
    assert "unexpected: model.0.wieght" in caught.value.differences
    assert_same(snapshot(model, optimizer), before)


def test_saving_over_an_existing_checkpoint_is_refused(tmp_path: Path) -> None:
    model = mlp(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model), tmp_path / "ckpt")
    with pytest.raises(StorageError, match="already exists"):
        tensor_io.save(state_dicts.model_and_optimizer_state(mlp(seed=1)), tmp_path / "ckpt")
    restored = mlp(seed=2)
    restore(restored, None, tmp_path / "ckpt")
    assert_same(restored.state_dict(), model.state_dict())


def test_loading_a_directory_without_metadata_raises_checkpoint_not_found(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata"):
        tensor_io.load(state_dicts.model_and_optimizer_state(mlp(seed=0)), tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        tensor_io.read_tensor_index(tmp_path)


def test_a_missing_shard_file_raises_incomplete_checkpoint(tmp_path: Path) -> None:
    tensor_io.save(state_dicts.model_and_optimizer_state(mlp(seed=0)), tmp_path / "ckpt")
    for shard in (tmp_path / "ckpt").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(IncompleteCheckpointError, match="distcp"):
        tensor_io.load(state_dicts.model_and_optimizer_state(mlp(seed=1)), tmp_path / "ckpt")


# --------------------------------------------------------------------------- safety


def test_a_malicious_metadata_file_is_refused_everywhere_and_never_runs(tmp_path: Path) -> None:
    tensor_io.save(state_dicts.model_and_optimizer_state(mlp(seed=0)), tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    model = mlp(seed=1)
    before = snapshot(model)
    attempts = [
        lambda: tensor_io.read_tensor_index(tmp_path / "ckpt"),
        lambda: list(tensor_io.iter_full_tensors(tmp_path / "ckpt")),
        lambda: tensor_io.load(state_dicts.model_and_optimizer_state(model), tmp_path / "ckpt"),
    ]
    for attempt in attempts:
        with pytest.raises(UnsafeCheckpointError) as caught:
            attempt()
        assert str(tmp_path / "ckpt" / ".metadata") in str(caught.value)
        assert "system" in caught.value.refused
    assert not marker.exists()
    assert_same(snapshot(model), before)


def test_a_stored_value_that_needs_unrestricted_unpickling_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    tensor_io.save({"extra": {"hook": WritesMarker(marker)}}, tmp_path / "ckpt")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"extra\.hook"):
        tensor_io.load({"extra": {"hook": None}}, tmp_path / "ckpt")
    assert not marker.exists()


# --------------------------------------------------------------------------- index / export


def test_the_tensor_index_comes_from_metadata_alone(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), tmp_path / "ckpt")
    for shard in (tmp_path / "ckpt").glob("*.distcp"):
        shard.unlink()  # no tensor data left to read
    index = tensor_io.read_tensor_index(tmp_path / "ckpt")
    weight = index["model.0.weight"]
    assert (weight.fqn, weight.shape, weight.dtype, weight.nbytes) == (
        "model.0.weight", (8, 5), torch.float32, 8 * 5 * 4
    )
    assert index["optimizer.state.2.bias.step"].shape == ()
    assert "optimizer.param_groups.0.lr" not in index  # not a tensor
    assert len(index) == 4 + 4 * 3


def test_iter_full_tensors_yields_every_tensor_in_order_or_the_names_asked_for(
    tmp_path: Path,
) -> None:
    model, optimizer = trained(seed=0)
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    tensor_io.save(state, tmp_path / "ckpt")
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    expected.update(
        {
            f"optimizer.state.{fqn}.{k}": v
            for fqn, entry in state["optimizer"]["state"].items()
            for k, v in entry.items()
        }
    )
    yielded = dict(tensor_io.iter_full_tensors(tmp_path / "ckpt"))
    assert list(yielded) == list(tensor_io.read_tensor_index(tmp_path / "ckpt"))
    assert_same(yielded, expected)
    chosen = ["model.2.weight", "model.0.bias"]
    assert [name for name, _ in tensor_io.iter_full_tensors(tmp_path / "ckpt", chosen)] == chosen


def test_iter_full_tensors_rejects_an_unknown_name_before_yielding(tmp_path: Path) -> None:
    tensor_io.save(state_dicts.model_and_optimizer_state(mlp(seed=0)), tmp_path / "ckpt")
    tensors = tensor_io.iter_full_tensors(tmp_path / "ckpt", ["model.0.weight", "model.9.bias"])
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.9\.bias"):
        next(tensors)


def test_full_weights_load_into_a_model_cast_to_its_dtype() -> None:
    source = mlp(seed=0)
    weights = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    target = mlp(seed=1)
    state_dicts.apply_full_model_state(target, weights)
    assert target[0].weight.dtype == torch.float32
    assert_same(target.state_dict(), {k: v.float() for k, v in weights.items()})


def test_full_weights_with_a_wrong_shape_are_refused_and_change_nothing() -> None:
    weights = mlp(seed=0, hidden=9).state_dict()
    target = mlp(seed=1)
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError, match=r"0\.weight: model has tensor \(8, 5\)"):
        state_dicts.apply_full_model_state(target, weights)
    assert_same(snapshot(target), before)


# --------------------------------------------------------------------------- staging


def test_staged_state_does_not_change_when_training_continues() -> None:
    model, optimizer = trained(seed=0)
    expected = copy.deepcopy(state_dicts.model_and_optimizer_state(model, optimizer))
    staged = tensor_io.CpuStager().stage(state_dicts.model_and_optimizer_state(model, optimizer))
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])
    assert_same(staged, expected)


def test_staging_twice_reuses_the_same_buffers() -> None:
    model, optimizer = trained(seed=0)
    stager = tensor_io.CpuStager()
    first = stager.stage(state_dicts.model_and_optimizer_state(model, optimizer))
    held = stager.nbytes
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()
    second = stager.stage(state_dicts.model_and_optimizer_state(model, optimizer))
    assert stager.nbytes == held
    for fqn in ("0.weight", "2.bias"):
        assert first["model"][fqn].data_ptr() == second["model"][fqn].data_ptr()
        assert torch.equal(second["model"][fqn], model.state_dict()[fqn])
    exp_avg = ("optimizer", "state", "0.weight", "exp_avg")
    assert _get(first, exp_avg).data_ptr() == _get(second, exp_avg).data_ptr()
    assert first["model"]["0.weight"].data_ptr() != model[0].weight.data_ptr()


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def test_staging_deep_copies_plain_values_and_keeps_tied_tensors_tied() -> None:
    shared = torch.ones(3)
    extras = {"names": ["a"], "tied": [shared, shared]}
    staged = tensor_io.CpuStager().stage({"extra": extras})
    extras["names"].append("b")
    assert staged["extra"]["names"] == ["a"]
    assert staged["extra"]["tied"][0] is staged["extra"]["tied"][1]


def test_staging_keeps_plain_numbers_and_strings_and_still_stages_a_stateful_subclass_of_one(
) -> None:
    class Counter(int):  # an int that is Stateful: its state_dict is what is staged
        def state_dict(self) -> dict[str, Any]:
            return {"count": torch.tensor(int(self))}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    leaves = {"lr": 0.1, "step": 3, "name": "adamw", "flag": True, "none": None,
              "raw": b"x", "counter": Counter(5)}
    staged = tensor_io.CpuStager().stage({"extra": leaves})["extra"]
    assert {key: staged[key] for key in ("lr", "step", "name", "flag", "none", "raw")} == {
        "lr": 0.1, "step": 3, "name": "adamw", "flag": True, "none": None, "raw": b"x"}
    assert isinstance(staged["counter"], dict)
    assert torch.equal(staged["counter"]["count"], torch.tensor(5))


def test_staged_state_saves_and_loads_back_equal(tmp_path: Path) -> None:
    model, optimizer = trained(seed=0)
    expected = snapshot(model, optimizer)
    stager = tensor_io.CpuStager()
    staged = stager.stage(state_dicts.model_and_optimizer_state(model, optimizer))
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()  # training moves on while the staged copy is written
    tensor_io.save(staged, tmp_path / "ckpt")
    fresh = mlp(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    restore(fresh, fresh_optimizer, tmp_path / "ckpt")
    assert_same(snapshot(fresh, fresh_optimizer), expected)


def test_saves_skip_torchs_zip_crc32_and_restore_the_setting_afterwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.serialization

    from resumekit.tensors import context
    module = importlib.import_module("resumekit.tensors.save")

    seen: list[bool] = []
    real_save = module.dcp_save

    def spying_save(*args: object, **kwargs: object) -> object:
        seen.append(torch.serialization.get_crc32_options())
        return real_save(*args, **kwargs)

    monkeypatch.setattr(module, "dcp_save", spying_save)
    # The setting is the process's: a background save an earlier test of this worker left
    # writing (a local tier's write, say) holds it off until it ends. Start after it.
    deadline = time.monotonic() + HANG_S  # a hang detector
    while context._crc32_users[0]:
        assert time.monotonic() < deadline, "a save of an earlier test never ended"
        time.sleep(0.01)
    torch.serialization.set_crc32_options(True)  # torch's default, whatever ran before
    model = torch.nn.Linear(4, 3)
    module.save({"model": model.state_dict()}, str(tmp_path / "ckpt"))
    assert seen == [False]  # the manifest's XXH3 covers every byte already
    # Restored when the last save in flight ends: this one, or a background save of an
    # earlier test that started beside it (seen in a CI rehearsal on torch 2.14.1).
    while context._crc32_users[0]:
        assert time.monotonic() < deadline, "a save of an earlier test never ended"
        time.sleep(0.01)
    assert torch.serialization.get_crc32_options() is True
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    tensor_io.load(loaded, str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())


def _files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_a_second_save_of_the_same_state_writes_byte_identical_files(
        tmp_path: Path, tensor_format: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state = {"model": model.state_dict(), "step": 7, "big": torch.randn(300_000)}
    first, second = tmp_path / "first", tmp_path / "second"
    tensor_io.save(state, first, tensor_format=tensor_format)  # type: ignore[arg-type]
    tensor_io.save(state, second, tensor_format=tensor_format)  # type: ignore[arg-type]
    first_files, second_files = _files_of(first), _files_of(second)
    if tensor_format == "dcp":  # DCP's own .metadata names its path and a fresh save id
        del first_files[tensor_io.METADATA_FILE], second_files[tensor_io.METADATA_FILE]
        assert tensor_io.read_metadata(first).state_dict_metadata == \
            tensor_io.read_metadata(second).state_dict_metadata
    assert first_files == second_files
    assert len(first_files) >= 2


@pytest.mark.parametrize("tensor_format", ["raw", "dcp"])
def test_a_save_and_a_load_each_say_at_debug_which_path_they_took(
        tmp_path: Path, tensor_format: str, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(4, 3)
    with caplog.at_level(logging.DEBUG, logger="resumekit"):
        tensor_io.save({"model": model.state_dict()}, tmp_path / "ckpt",
                     tensor_format=tensor_format)  # type: ignore[arg-type]
        tensor_io.load({"model": model.state_dict()}, tmp_path / "ckpt")
    said = [record.getMessage() for record in caplog.records
            if record.getMessage().startswith("tensor ")]
    assert len(said) == 2, said
    assert said[0].startswith(f"tensor save: {tensor_format} format, DCP save in one process")
    assert said[1].startswith(f"tensor load: {tensor_format} format, DCP load")


def test_a_save_of_other_dtypes_at_the_same_shapes_describes_the_new_dtypes(
        tmp_path: Path) -> None:
    # DCP 2.13's plan caching would take the second save's plan as unchanged (it compares
    # keys, offsets and sizes only) and write the first save's .metadata: saves plan anew.
    model = torch.nn.Linear(4, 3)
    tensor_io.save({"model": model.state_dict()}, tmp_path / "fp32")
    half = {key: value.to(torch.bfloat16) for key, value in model.state_dict().items()}
    tensor_io.save({"model": half}, tmp_path / "bf16")
    index = tensor_io.read_tensor_index(tmp_path / "bf16")
    assert {info.dtype for info in index.values()} == {torch.bfloat16}
    loaded = {"model": {key: torch.zeros_like(value) for key, value in half.items()}}
    tensor_io.load(loaded, tmp_path / "bf16")
    assert all(torch.equal(loaded["model"][key], value) for key, value in half.items())


def test_a_one_rank_process_group_saves_and_loads_without_any_collective(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-GPU run has an NCCL default group of one rank; its background save must not
    # issue collectives on it from another thread.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        def no_collective(*_: object, **__: object) -> None:
            raise AssertionError("a collective ran on a one-rank group")

        for name in ("barrier", "broadcast_object_list", "all_gather_object",
                     "gather_object", "scatter_object_list", "all_reduce"):
            monkeypatch.setattr(dist, name, no_collective)
        state = {"w": torch.arange(6.0)}
        tensor_io.save(state, tmp_path / "ckpt")
        loaded = {"w": torch.zeros(6)}
        tensor_io.load(loaded, tmp_path / "ckpt")
        assert torch.equal(loaded["w"], state["w"])
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
