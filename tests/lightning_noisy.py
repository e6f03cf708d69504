"""The small Lightning module the Lightning integration's tests train, in one or two processes.

It draws from the global RNG every step (the noise) and reads its data through a
resumable sampler built in ``setup()``: exactly what ``ResumekitCallback`` must restore for
a resumed run to end bit for bit where the uninterrupted one does.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn

from resumekit.state.sampler import ResumableDistributedSampler


class Noisy(L.LightningModule):
    """A two-layer regression with dropout and per-step noise over ``samples`` rows."""

    def __init__(self, samples: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.data = torch.randn(samples, 8, generator=torch.Generator().manual_seed(0))
        self.target = torch.randn(samples, 1, generator=torch.Generator().manual_seed(1))
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
        self.sampler: ResumableDistributedSampler | None = None

    def setup(self, stage: str) -> None:
        self.sampler = ResumableDistributedSampler(len(self.data), seed=3)

    def train_dataloader(self) -> Any:
        dataset = torch.utils.data.TensorDataset(self.data, self.target)
        return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=self.sampler)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        noise = 0.1 * torch.randn_like(y)  # the global RNG (per rank): the callback restores it
        return (self.net(x) - y - noise).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
