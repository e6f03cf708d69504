"""Export of a checkpoint written by two FSDP2 ranks, in one process without a group."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from resumekit.cli import main
from resumekit.manager import CheckpointManager
from tests.distributed_harness import run_ranks


def _train_and_save(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor] | None:
    torch.manual_seed(0)
    # Odd sizes: shards of unequal length (FSDP2 pads the last rank's shard).
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    for _ in range(3):
        loss = model(torch.randn(4, 5, generator=generator)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    manager.save(3)
    manager.close()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert dist.get_world_size() == world_size
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


def test_export_of_a_two_rank_fsdp2_checkpoint_equals_the_full_state_dict(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    full, _ = run_ranks(_train_and_save, 2, args=(str(root),))
    assert full is not None
    assert not dist.is_initialized()  # the export below runs without any process group
    step_dir = root / "step_000000003"
    assert json.loads((step_dir / "manifest.json").read_text())["world_size"] == 2
    assert {p.name.split("_")[2] for p in (step_dir / "tensors").glob("*.distcp")} == {"0", "1"}
    out = tmp_path / "export"
    # The run recorded no model config: the diffusers layout needs one (--model-config).
    assert main(["export", str(root), "--out", str(out), "--layout", "diffusers"]) == 1
    (tmp_path / "config.json").write_text(json.dumps({"in_features": 5, "out_features": 3}))
    assert main(["export", str(root), "--out", str(out), "--layout", "diffusers",
                 "--model-config", str(tmp_path / "config.json")]) == 0
    assert json.loads((out / "transformer" / "config.json").read_text())["in_features"] == 5
    weights = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert weights.keys() == full.keys()
    for key, tensor in full.items():
        assert torch.equal(weights[key], tensor), key
    assert main(["export", str(root), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    halves = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for key, tensor in full.items():
        assert torch.equal(halves[key], tensor.to(torch.bfloat16)), key
