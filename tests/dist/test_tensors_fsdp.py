"""resumekit.tensors with real FSDP2 ranks (gloo, CPU): sharded save, resharded load."""

from __future__ import annotations

import copy
import math
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resumekit import tensors as tensor_io
from resumekit.errors import IncompatibleCheckpointError
from resumekit.tensors import state_dicts
from resumekit.tensors.reader import read_metadata_bytes
from tests.distributed_harness import run_ranks

VOCAB, WIDTH, HIDDEN = 11, 6, 10  # odd sizes: shards are uneven on 2 and 3 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(WIDTH), dim=-1)
        x = x + self.proj(attention @ v)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 3))


def build(kind: str, seed: int, world_size: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model (FSDP2-sharded per layer and at the root when world_size is given) + AdamW."""
    torch.manual_seed(seed)
    model = TinyTransformer() if kind == "transformer" else mlp()
    if world_size is not None:
        mesh = init_device_mesh("cpu", (world_size,))
        layers = model.layers if isinstance(model, TinyTransformer) else [model[0], model[2]]
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, kind: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    if kind == "transformer":
        tokens = torch.randint(0, VOCAB, (2, 4), generator=generator)
        loss = model(tokens).square().mean()
    else:
        loss = model(torch.randn(4, 5, generator=generator)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded model + optimizer state (on rank 0; a collective on FSDP ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    # deepcopy: replicated CPU tensors (Adam's "step") come back as the live objects
    return copy.deepcopy({"model": model_state, "optimizer": optimizer_state})


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, list) and any(isinstance(item, dict) for item in tree):
        return flatten(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def assert_identical(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    flat_actual, flat_expected = flatten(actual), flatten(expected)
    assert sorted(flat_actual) == sorted(flat_expected)
    for key, want in flat_expected.items():
        have = flat_actual[key]
        if isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype, key
            assert torch.equal(have, want), f"{key} differs"
        else:
            assert have == want, key


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any = None
) -> None:
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    tensor_io.load(state, directory, process_group=group)
    state_dicts.apply_model_and_optimizer_state(model, optimizer, state)


# --------------------------------------------------------------------------- rank functions


def _save_stage_and_reload(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Train one step, stage, train on, save the staged copy; reload it into a new model."""
    group = dist.new_group(backend="gloo")  # a dedicated checkpoint group, as the manager has
    model, optimizer = build("transformer", seed=0, world_size=world_size)
    train_step(model, optimizer, "transformer", seed=1)
    reference = full_state(model, optimizer)

    stager = tensor_io.CpuStager()
    first = stager.stage(state_dicts.model_and_optimizer_state(model, optimizer))
    staged = stager.stage(state_dicts.model_and_optimizer_state(model, optimizer))
    weight = "layers.0.qkv.weight"
    reused = (
        first["model"][weight].to_local().data_ptr()
        == staged["model"][weight].to_local().data_ptr()
    )
    staged_is_dtensor = type(staged["model"][weight]).__name__ == "DTensor"
    # the second staging reuses the first's DTensor wrappers too (no per-tensor rebuild)
    reused = reused and first["model"][weight] is staged["model"][weight]

    train_step(model, optimizer, "transformer", seed=2)  # training mutates the originals
    mutated = full_state(model, optimizer)
    tensor_io.save(staged, directory, process_group=group)

    fresh, fresh_optimizer = build("transformer", seed=99, world_size=world_size)
    restore(fresh, fresh_optimizer, directory, group)
    loaded = full_state(fresh, fresh_optimizer)
    if rank != 0:
        return {"reused": reused, "dtensor": staged_is_dtensor}
    return {
        "reference": reference,
        "mutated": mutated,
        "loaded": loaded,
        "reused": reused,
        "dtensor": staged_is_dtensor,
    }


def _load_and_gather(rank: int, world_size: int, directory: str, kind: str) -> Any:
    model, optimizer = build(kind, seed=123, world_size=world_size)
    restore(model, optimizer, directory)
    state = full_state(model, optimizer)
    return state if rank == 0 else None


def _save_on_a_one_rank_group(rank: int, directory: str) -> bool:
    only_rank_zero = dist.new_group(ranks=[0], backend="gloo")
    if rank == 0:
        state = {"model": {"w": torch.arange(6.0)}, "note": "rank zero alone"}
        tensor_io.save(state, directory, process_group=only_rank_zero)
        target: dict[str, Any] = {"model": {"w": torch.zeros(6)}, "note": ""}
        tensor_io.load(target, directory, process_group=only_rank_zero)
        assert torch.equal(target["model"]["w"], torch.arange(6.0))
        assert target["note"] == "rank zero alone"
    dist.barrier()  # rank 1 never entered DCP: any DCP collective on WORLD would hang
    return True


def _load_into_a_wider_model(rank: int, world_size: int, directory: str) -> str:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(5, HIDDEN + 2), nn.ReLU(), nn.Linear(HIDDEN + 2, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters())
    before = full_state(model, optimizer)
    state = state_dicts.model_and_optimizer_state(model, optimizer)
    with pytest.raises(IncompatibleCheckpointError) as caught:
        tensor_io.load(state, directory)
    after = full_state(model, optimizer)
    if rank == 0:
        assert_identical(after, before)  # nothing was partially loaded
    return str(caught.value)


def _apply_full_weights(rank: int, world_size: int, weights: dict[str, torch.Tensor]) -> Any:
    model, _ = build("mlp", seed=77, world_size=world_size)
    state_dicts.apply_full_model_state(model, {k: v.to(torch.bfloat16) for k, v in weights.items()})
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if rank == 0 else None


def _attempt(action: Any, *args: Any) -> tuple[str, Any]:
    """Run one part of a multi-part rank function; report its failure instead of raising."""
    try:
        return "ok", action(*args)
    except Exception:  # noqa: BLE001 - the test of that part shows it
        return "error", traceback.format_exc()


def _one_process_checkpoint_scenarios(
    rank: int, world_size: int, directory: str, scratch: str, weights: dict[str, torch.Tensor]
) -> dict[str, tuple[str, Any]]:
    """Several independent checks on one pair of ranks (spawning ranks is the slow part)."""
    return {
        "full": _attempt(_apply_full_weights, rank, world_size, weights),
        "group": _attempt(_save_on_a_one_rank_group, rank, scratch),
        "load": _attempt(_load_and_gather, rank, world_size, directory, "mlp"),
        "wider": _attempt(_load_into_a_wider_model, rank, world_size, directory),
    }


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("fsdp") / "ckpt"
    results = run_ranks(_save_stage_and_reload, world_size=2, args=(str(directory),))
    return directory, results


def test_two_fsdp_ranks_save_and_two_ranks_load_bit_identically(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = fsdp_run
    assert_identical(results[0]["loaded"], results[0]["reference"])


def test_staged_fsdp_state_is_a_dtensor_snapshot_in_reused_buffers(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = fsdp_run
    assert all(result["reused"] and result["dtensor"] for result in results)
    mutated = flatten(results[0]["mutated"])
    reference = flatten(results[0]["reference"])
    # training really moved on after staging, yet the checkpoint holds the staged state
    assert not torch.equal(mutated["model.head.weight"], reference["model.head.weight"])


def test_each_rank_writes_only_its_own_shards(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, _ = fsdp_run
    metadata = read_metadata_bytes((directory / ".metadata").read_bytes(), "test")
    bytes_by_rank = {"__0_": 0, "__1_": 0}
    files_by_tensor: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not hasattr(entry, "chunks"):
            continue  # a non-tensor value
        chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
        bytes_by_rank[info.relative_path[:4]] += (
            math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        )
        files_by_tensor.setdefault(index.fqn, set()).add(info.relative_path[:4])
    tensors = tensor_io.read_tensor_index(directory)
    full_bytes = sum(info.nbytes for info in tensors.values())
    assert sum(bytes_by_rank.values()) == full_bytes  # every byte written exactly once
    for prefix, written in bytes_by_rank.items():
        assert 0 < written < 0.75 * full_bytes, f"rank {prefix} wrote {written} of {full_bytes}"
    for name, info in tensors.items():
        if name.startswith("model.") and info.shape[0] >= 2:
            assert files_by_tensor[name] == {"__0_", "__1_"}, f"{name} written by one rank"
    embed = metadata.state_dict_metadata["model.embed.weight"]
    assert [tuple(chunk.sizes) for chunk in embed.chunks] == [(6, WIDTH), (5, WIDTH)]


def test_a_two_rank_checkpoint_loads_in_one_process_without_a_process_group(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = fsdp_run
    assert not dist.is_initialized()
    model, optimizer = build("transformer", seed=7, world_size=None)
    restore(model, optimizer, str(directory))
    assert_identical(full_state(model, optimizer), results[0]["reference"])


def test_a_two_rank_checkpoint_loads_on_three_ranks(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = fsdp_run
    loaded = run_ranks(_load_and_gather, world_size=3, args=(str(directory), "transformer"))
    assert_identical(loaded[0], results[0]["reference"])


def test_iter_full_tensors_assembles_every_tensor_of_a_two_rank_checkpoint(
    fsdp_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = fsdp_run
    expected = {
        key: value
        for key, value in flatten(results[0]["reference"]).items()
        if isinstance(value, torch.Tensor)
    }
    seen = []
    for name, tensor in tensor_io.iter_full_tensors(directory):
        assert torch.equal(tensor, expected[name]), name
        seen.append(name)
    assert sorted(seen) == sorted(expected)


@pytest.fixture(scope="module")
def one_process_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], list[dict[str, tuple[str, Any]]]]:
    """An MLP checkpoint saved by one process, then used by two FSDP ranks."""
    root = tmp_path_factory.mktemp("one-process")
    model, optimizer = build("mlp", seed=3, world_size=None)
    train_step(model, optimizer, "mlp", seed=4)
    tensor_io.save(state_dicts.model_and_optimizer_state(model, optimizer), root / "ckpt")
    results = run_ranks(
        _one_process_checkpoint_scenarios, world_size=2,
        args=(str(root / "ckpt"), str(root / "scratch"), model.state_dict()),
    )
    return full_state(model, optimizer), results


def outcome(results: list[dict[str, tuple[str, Any]]], part: str) -> list[Any]:
    for rank, result in enumerate(results):
        status, value = result[part]
        assert status == "ok", f"rank {rank}: {value}"
    return [result[part][1] for result in results]


def test_a_one_process_checkpoint_loads_on_two_fsdp_ranks(
    one_process_checkpoint: tuple[dict[str, Any], list[dict[str, tuple[str, Any]]]],
) -> None:
    expected, results = one_process_checkpoint
    assert_identical(outcome(results, "load")[0], expected)


def test_save_and_load_coordinate_only_on_the_group_they_are_given(
    one_process_checkpoint: tuple[dict[str, Any], list[dict[str, tuple[str, Any]]]],
) -> None:
    _, results = one_process_checkpoint
    assert outcome(results, "group") == [True, True]


def test_a_changed_shape_fails_on_every_rank_naming_the_key_and_loads_nothing(
    one_process_checkpoint: tuple[dict[str, Any], list[dict[str, tuple[str, Any]]]],
) -> None:
    _, results = one_process_checkpoint
    for message in outcome(results, "wider"):
        assert "model.0.weight" in message
        assert "optimizer.state.0.weight.exp_avg" in message


def test_full_weights_load_into_fsdp_ranks_cast_to_the_model_dtype(
    one_process_checkpoint: tuple[dict[str, Any], list[dict[str, tuple[str, Any]]]],
) -> None:
    expected, results = one_process_checkpoint
    loaded = outcome(results, "full")[0]
    weights = {k: v.to(torch.bfloat16).float() for k, v in expected["model"].items()}
    assert_identical(loaded, weights)
