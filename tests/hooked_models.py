"""Small models whose state dicts are not their parameters: the state-dict hook pattern.

torchtitan's ``FusedQKVLinear`` keeps one fused parameter (``wqkv.weight``) and, through a
state-dict post hook, saves it as the three unfused ones (``wq.weight``, ``wk.weight``,
``wv.weight``); a load pre hook merges them back. Under FSDP2 its hook first gathers the
sharded parameter to a replicated ``DTensor`` (a collective inside ``state_dict()``).
:class:`FusedQKV` does the same, written here from that description (nothing copied), and
:class:`Versioned` adds a tensor that exists only in the state dict (a buffer added by a
hook). :class:`HookedNet` puts both in a small network a test can train.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


class FusedQKV(nn.Module):
    """One fused ``wqkv`` projection, saved and loaded as separate ``wq``/``wk``/``wv``."""

    def __init__(self, dim: int, q_out: int, kv_out: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, q_out + 2 * kv_out, bias=True)
        self.sizes = (q_out, kv_out, kv_out)
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._merge_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        return q + torch.cat([k, v], dim=-1).sum(-1, keepdim=True)

    @staticmethod
    def _split_on_save(module: FusedQKV, state_dict: dict[str, Any], prefix: str,
                       local_metadata: Any) -> None:
        for part in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}wqkv.{part}")
            if isinstance(fused, DTensor):  # gather, as torchtitan's hook does
                fused = fused.redistribute(fused.device_mesh,
                                           [Replicate()] * fused.device_mesh.ndim)
            for name, piece in zip(("wq", "wk", "wv"), fused.split(module.sizes, dim=0),
                                   strict=True):
                state_dict[f"{prefix}{name}.{part}"] = piece.contiguous()

    @staticmethod
    def _merge_on_load(module: FusedQKV, state_dict: dict[str, Any], prefix: str,
                       *args: Any) -> None:
        for part in ("weight", "bias"):
            keys = [f"{prefix}{name}.{part}" for name in ("wq", "wk", "wv")]
            if all(key in state_dict for key in keys):
                pieces = [state_dict.pop(key) for key in keys]
                if isinstance(pieces[0], DTensor):
                    pieces = [piece.redistribute(piece.device_mesh,
                                                 [Replicate()] * piece.device_mesh.ndim)
                              for piece in pieces]
                state_dict[f"{prefix}wqkv.{part}"] = torch.cat(pieces, dim=0)


class Versioned(nn.Module):
    """A linear layer whose state dict carries a format version no attribute holds."""

    VERSION = 3.0

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.loaded_versions: list[float] = []
        self.register_state_dict_post_hook(self._add_version)
        self.register_load_state_dict_pre_hook(self._take_version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    @staticmethod
    def _add_version(module: Versioned, state_dict: dict[str, Any], prefix: str,
                     local_metadata: Any) -> None:
        state_dict[f"{prefix}format_version"] = torch.tensor(Versioned.VERSION)

    @staticmethod
    def _take_version(module: Versioned, state_dict: dict[str, Any], prefix: str,
                      *args: Any) -> None:
        version = state_dict.pop(f"{prefix}format_version", None)
        if version is not None:
            module.loaded_versions.append(float(version))


class HookedNet(nn.Module):
    """embed -> FusedQKV -> Versioned -> head: two kinds of hooked module in one network."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.attn = FusedQKV(dim, dim, dim // 2)
        self.mix = Versioned(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(torch.relu(self.attn(self.embed(x)))))


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *,
                seed: int = 0) -> None:
    """Run ``steps`` seeded steps on random data (the same data on every rank)."""
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=data)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
