"""The state under test: a stack of linear layers plus AdamW state, sized in bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

#: Bytes of state per parameter: fp32 weight + AdamW exp_avg + exp_avg_sq.
BYTES_PER_PARAM = 12
LAYERS = 24
_ALIGN = 64
#: Activation elements per layer output in one forward/backward pass of
#: :func:`train_step` (a larger batch is split): about 8 MiB per fp32 tensor.
MICRO_BATCH_ELEMENTS = 2**21


@dataclass(frozen=True)
class Shape:
    """Layer count and width of the benchmark model.

    Attributes:
        layers: Number of ``Linear(width, width)`` layers.
        width: Their width.
    """

    layers: int
    width: int

    @property
    def params(self) -> int:
        """Parameter count (weights and biases)."""
        return self.layers * (self.width * self.width + self.width)

    @property
    def state_bytes(self) -> int:
        """Bytes of model plus AdamW state (the scalar ``step`` tensors aside)."""
        return self.params * BYTES_PER_PARAM


def shape_for(state_bytes: int, layers: int = LAYERS) -> Shape:
    """Return the model shape whose model + AdamW state is closest to ``state_bytes``."""
    per_layer = state_bytes / BYTES_PER_PARAM / layers
    width = max(8, round(math.sqrt(per_layer) / 8) * 8)
    if width >= 4 * _ALIGN:
        width = round(width / _ALIGN) * _ALIGN
    return Shape(layers, width)


def build_model(shape: Shape, seed: int = 0) -> nn.Sequential:
    """A deterministic stack of ``Linear`` + ``ReLU`` layers of ``shape``."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(shape.layers):
        blocks += [nn.Linear(shape.width, shape.width), nn.ReLU()]
    return nn.Sequential(*blocks)


def build_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """AdamW over ``model`` (its state appears after the first step)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def micro_batch_rows(width: int) -> int:
    """Rows of one forward/backward pass: :data:`MICRO_BATCH_ELEMENTS` / ``width``, >= 1."""
    return max(1, MICRO_BATCH_ELEMENTS // width)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: int = 16,
               seed: int = 0) -> float:
    """One forward/backward/AdamW step on a fixed random batch; returns the loss.

    A batch of more than :func:`micro_batch_rows` rows runs as that many rows per
    forward/backward pass, the gradients accumulated (the loss is the mean over the whole
    batch either way): a step made long by a large batch (the scale bench's tight-grace
    launch grows it until a step takes 3x the save) costs compute, never memory. One
    such launch on a loaded machine grew a batch past 10 GB of activations and the OOM
    killer took a rank.
    """
    width = next(model.parameters()).shape[-1]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=generator)
    optimizer.zero_grad(set_to_none=True)
    rows = micro_batch_rows(width)
    if batch <= rows:
        loss = model(x).pow(2).mean()
        loss.backward()
    else:
        total = torch.zeros(())
        for chunk in x.split(rows):
            part = model(chunk).pow(2).sum() / (batch * width)
            part.backward()
            total += part.detach()
        loss = total
    optimizer.step()
    return float(loss.detach())


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor of the model and the optimizer state (local shards)."""
    total = 0
    for tensor in model.state_dict().values():
        total += _local(tensor).numel() * tensor.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local(value).numel() * value.element_size()
    return total


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model and optimizer state, as local contiguous CPU tensors."""
    tensors = [_local(t) for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.contiguous() for t in tensors]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    local: torch.Tensor = to_local() if to_local is not None else tensor
    return local.detach()
