"""A weights-only (legacy) import on 2 FSDP2 ranks reads each rank's shards, not the file.

Each rank's resident memory during the import is measured (the kernel's high-water mark,
reset just before) against the size of the upstream safetensors file: reading the whole
file on every rank, as before, costs at least the file per rank. No timing is asserted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.timing import PeakRss
from resumekit.store.storage import Storage
from resumekit.tools import legacy
from tests.distributed_harness import run_ranks

LAYERS, WIDTH = 12, 2048  # 12 x (2048 x 2048 + 2048) fp32: a 201 MB file
NAME = "checkpoint_step_40"
WEIGHTS = f"{NAME}/transformer/diffusion_pytorch_model.safetensors"


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _reference(number: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(number)
    return torch.randn(shape, generator=generator)


def _write_upstream(root: Path) -> int:
    state = {}
    for number, (key, param) in enumerate(_model().to("meta").state_dict().items()):
        state[key] = _reference(number, tuple(param.shape))
    (root / WEIGHTS).parent.mkdir(parents=True)
    save_file(state, str(root / WEIGHTS))
    return (root / WEIGHTS).stat().st_size


def _import_on_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():  # initialised, as a real model is: its own pages are resident
        for param in model.parameters():
            param.to_local().zero_()
    dist.barrier()
    with PeakRss() as rss:
        legacy.load_weights_only(Storage(root), NAME, model)
    exact = True
    for number, param in enumerate(model.state_dict().values()):
        full = param.full_tensor()
        exact = exact and torch.equal(full, _reference(number, tuple(full.shape)))
    return {"extra": rss.extra, "exact": exact, "measured_exactly": rss.exact}


def test_each_rank_of_a_two_rank_import_holds_far_less_than_the_file_and_gets_exact_weights(
    tmp_path: Path,
) -> None:
    size = _write_upstream(tmp_path)
    assert size > 190_000_000

    results = run_ranks(_import_on_rank, world_size=2, args=(str(tmp_path),))

    for rank, result in enumerate(results):
        assert result["exact"], rank
        # Reading the whole file costs >= 1x of it per rank; a rank's own shards, read
        # one tensor at a time, cost about one tensor's half (8 MB here).
        assert result["extra"] < 0.75 * size, (rank, result, size)
