"""The tiny FSDP2 model and AdamW that several multi-rank suites train and checkpoint."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


def tiny_fsdp2_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded ``Linear-GELU-Linear`` sharded with FSDP2 (each linear and the root), AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def stepped_tiny_fsdp2_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`tiny_fsdp2_adamw` after one training step: the optimizer has state to save."""
    model, optimizer = tiny_fsdp2_adamw()
    model(torch.ones(2, 6)).square().mean().backward()
    optimizer.step()
    return model, optimizer
