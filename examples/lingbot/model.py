"""A Wan-style video-action transformer (LingBot-VA shape), written from its description.

Video latents ``[B, C, F, H, W]`` become tokens through a 3-D patch embedding; actions
``[B, F_a, action_dim]`` become tokens through the action embedder. Both token kinds run
through the same ``WanVABlock`` stack, which

* modulates every token (AdaLN: shift/scale/gate for attention and FFN, six vectors) from
  that token's own timestep embedding: per latent frame for video tokens, per action step
  for action tokens (the action embedder has its own timestep embedder);
* self-attends over all tokens (``attn1``, 3-D rotary positions, QK RMS-norm);
* cross-attends to the projected text embeddings (``attn2``);
* applies a GELU feed-forward network (``ffn``).

Two heads read the result: ``proj_out`` predicts the latent velocity (unpatchified to the
latent shape) and ``action_proj_out`` the action velocity.

Parameter names are checkpoint keys and must not change: ``patch_embedding``,
``text_embedding``, ``time_embedding``, ``time_projection``, ``action_embedder``,
``blocks.{i}.attn1`` / ``.attn2`` / ``.ffn``, ``out_modulation``, ``proj_out``,
``action_proj_out``.

Everything is deterministic on CPU: no atomics, no data-dependent kernels, attention via
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from examples.lingbot.config import ModelConfig
from examples.lingbot.errors import BatchError

__all__ = [
    "ActionEmbedder",
    "Attention",
    "FeedForward",
    "LingBotVA",
    "TextEmbedding",
    "TimestepEmbedder",
    "WanVABlock",
    "count_parameters",
    "shard_model",
    "sinusoidal_embedding",
]

RopeTables = tuple[Tensor, Tensor]
"""(cos, sin), each ``[tokens, head_dim // 2]`` in float32."""


def sinusoidal_embedding(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of scalar positions (timesteps).

    Args:
        positions: Any shape ``[...]``; computed in float32.
        dim: Even feature size; the first half are cosines, the second sines.

    Returns:
        ``[..., dim]`` float32 features.
    """
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=positions.device) / half
    frequencies = torch.exp(-math.log(10000.0) * exponent)
    angles = positions.to(torch.float32).unsqueeze(-1) * frequencies
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def _rope_axis_sizes(head_dim: int) -> tuple[int, int, int]:
    pairs = head_dim // 2
    return pairs - 2 * (pairs // 3), pairs // 3, pairs // 3


def _rope_tables(positions: Tensor, head_dim: int, theta: float = 10000.0) -> RopeTables:
    """Rotary cos/sin tables for 3-D (frame, height, width) token positions ``[N, 3]``."""
    angles = []
    for axis, size in enumerate(_rope_axis_sizes(head_dim)):
        exponent = torch.arange(size, dtype=torch.float32, device=positions.device) / size
        frequencies = theta ** (-exponent)
        angles.append(positions[:, axis : axis + 1].to(torch.float32) * frequencies)
    table = torch.cat(angles, dim=-1)
    return torch.cos(table), torch.sin(table)


def _apply_rope(x: Tensor, rope: RopeTables) -> Tensor:
    """Rotate consecutive channel pairs of ``x`` ``[B, heads, N, head_dim]``."""
    cos, sin = rope
    pairs = x.to(torch.float32).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class TimestepEmbedder(nn.Module):
    """Flow-matching time t in [0, 1] → sinusoid of ``t * scale`` → two-layer SiLU MLP.

    Args:
        freq_dim: Size of the sinusoidal features.
        dim: Output size.
        scale: Multiplier of t before the sinusoid.
    """

    def __init__(self, freq_dim: int, dim: int, scale: float) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.scale = scale
        self.linear_1 = nn.Linear(freq_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timesteps: Tensor) -> Tensor:
        """Embed timesteps ``[...]`` to ``[..., dim]``."""
        features = sinusoidal_embedding(timesteps * self.scale, self.freq_dim)
        hidden = self.linear_1(features.to(self.linear_1.weight.dtype))
        out: Tensor = self.linear_2(F.silu(hidden))
        return out


class TextEmbedding(nn.Module):
    """Text-encoder embeddings to model tokens: linear, tanh-GELU, linear."""

    def __init__(self, text_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(text_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, text: Tensor) -> Tensor:
        """Project ``[B, L, text_dim]`` to ``[B, L, dim]``."""
        hidden = self.linear_1(text.to(self.linear_1.weight.dtype))
        out: Tensor = self.linear_2(F.gelu(hidden, approximate="tanh"))
        return out


class ActionEmbedder(nn.Module):
    """Action vectors to tokens, with their own timestep embedder.

    Args:
        action_dim: Size of one action vector.
        dim: Token size.
        freq_dim: Sinusoidal feature size of the action timestep embedder.
        scale: Multiplier of t before the sinusoid.
    """

    def __init__(self, action_dim: int, dim: int, freq_dim: int, scale: float) -> None:
        super().__init__()
        self.proj = nn.Linear(action_dim, dim)
        self.time_embedding = TimestepEmbedder(freq_dim, dim, scale)

    def forward(self, actions: Tensor, timesteps: Tensor) -> tuple[Tensor, Tensor]:
        """Return (tokens ``[B, F_a, dim]``, timestep embeddings ``[B, F_a, dim]``)."""
        tokens: Tensor = self.proj(actions.to(self.proj.weight.dtype))
        return tokens, self.time_embedding(timesteps)


class Attention(nn.Module):
    """Multi-head attention with RMS-normalised queries and keys.

    Self-attention when called without ``context``; cross-attention to ``context``
    otherwise. Rotary positions apply when ``rope`` is given.

    Args:
        dim: Token size.
        num_heads: Heads; ``dim // num_heads`` per head.
        eps: RMSNorm epsilon.
    """

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)

    def _heads(self, x: Tensor) -> Tensor:
        heads: Tensor = x.unflatten(-1, (self.num_heads, -1))
        return heads.transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        rope: RopeTables | None = None,
        key_mask: Tensor | None = None,
    ) -> Tensor:
        """Attend from ``x`` ``[B, N, dim]`` to ``context`` (or ``x``).

        Args:
            x: Query tokens.
            context: Key/value tokens ``[B, M, dim]``; ``x`` itself when None.
            rope: Rotary tables of the tokens of ``x`` (self-attention only).
            key_mask: ``[B, M]`` bool, True where a key may be attended to.
        """
        source = x if context is None else context
        q = self._heads(self.norm_q(self.q(x)))
        k = self._heads(self.norm_k(self.k(source)))
        v = self._heads(self.v(source))
        if rope is not None:
            q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out: Tensor = self.o(attended.transpose(1, 2).flatten(2))
        return out


class FeedForward(nn.Module):
    """Two linear layers with a tanh-approximated GELU between them."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, ffn_dim)
        self.fc_out = nn.Linear(ffn_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the network token-wise."""
        out: Tensor = self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))
        return out


class WanVABlock(nn.Module):
    """One transformer block with AdaLN modulation from per-token timestep embeddings.

    Args:
        dim: Token size.
        ffn_dim: Inner size of the feed-forward network.
        num_heads: Attention heads.
        eps: Norm epsilon.
    """

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.attn1 = Attention(dim, num_heads, eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.attn2 = Attention(dim, num_heads, eps)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = FeedForward(dim, ffn_dim)
        self.modulation = nn.Parameter(torch.empty(1, 1, 6, dim))

    def forward(
        self,
        x: Tensor,
        modulation: Tensor,
        context: Tensor,
        rope: RopeTables,
        key_mask: Tensor | None,
    ) -> Tensor:
        """Update tokens ``x`` ``[B, N, dim]``.

        Args:
            x: Tokens.
            modulation: ``[B, N, 6, dim]`` per-token timestep projections.
            context: Text tokens ``[B, L, dim]``.
            rope: Rotary tables of the tokens.
            key_mask: ``[B, N]`` bool, False for padded action tokens.
        """
        mod = self.modulation + modulation
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod.unbind(2)
        x = x + gate_a * self.attn1(self.norm1(x) * (1 + scale_a) + shift_a, rope=rope,
                                    key_mask=key_mask)
        x = x + self.attn2(self.norm2(x), context=context)
        out: Tensor = x + gate_f * self.ffn(self.norm3(x) * (1 + scale_f) + shift_f)
        return out


def _require(batch: Mapping[str, Tensor], key: str, shape: tuple[int | None, ...]) -> Tensor:
    if key not in batch:
        raise BatchError(f"model input lacks key {key!r} (has {sorted(batch)})", key=key,
                         shape=None)
    tensor = batch[key]
    actual = tuple(tensor.shape)
    if len(actual) != len(shape) or any(
        w is not None and w != a for w, a in zip(shape, actual, strict=True)
    ):
        wanted = tuple("*" if w is None else w for w in shape)
        raise BatchError(f"model input {key!r} has shape {actual}, expected {wanted}",
                         key=key, shape=actual)
    return tensor


class LingBotVA(nn.Module):
    """The video-action transformer.

    ``forward(batch)`` reads these keys (t is flow-matching time in [0, 1]):

    * ``latents``: ``[B, C, F, H, W]`` noisy video latents;
    * ``timesteps``: ``[B, F]`` per-frame t of the latents;
    * ``text``: ``[B, L, text_dim]`` text-encoder embeddings (zeros for a dropped prompt);
    * ``actions``: ``[B, F_a, action_dim]`` noisy actions;
    * ``action_timesteps``: ``[B, F_a]`` per-step t of the actions;
    * ``action_mask`` (optional): ``[B, F_a]`` bool, False for padded action steps, which
      are zeroed on input and hidden from attention, so they cannot affect any output.

    Args:
        config: Model shape.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.text_embedding = TextEmbedding(config.text_dim, dim)
        self.time_embedding = TimestepEmbedder(config.freq_dim, dim, config.timestep_scale)
        self.time_projection = nn.Linear(dim, 6 * dim)
        self.action_embedder = ActionEmbedder(config.action_dim, dim, config.freq_dim,
                                              config.timestep_scale)
        self.blocks = nn.ModuleList(
            WanVABlock(dim, config.ffn_dim, config.num_heads, config.eps)
            for _ in range(config.num_layers)
        )
        self.norm_out = nn.LayerNorm(dim, eps=config.eps, elementwise_affine=False)
        self.out_modulation = nn.Parameter(torch.empty(1, 1, 2, dim))
        self.proj_out = nn.Linear(dim, config.in_channels * math.prod(config.patch_size))
        self.action_proj_out = nn.Linear(dim, config.action_dim)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG, in a fixed order.

        Call after ``to_empty`` when the model was built on the meta device.
        """
        std = 1.0 / math.sqrt(self.config.dim)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if name.startswith(("text_embedding", "time_embedding", "action_embedder")):
                    nn.init.normal_(module.weight, std=0.02)
                else:
                    nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv3d):
                nn.init.xavier_uniform_(module.weight.view(module.weight.shape[0], -1))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                if isinstance(module, nn.LayerNorm) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, WanVABlock):
                module.modulation.normal_(std=std)
        self.out_modulation.normal_(std=std)

    def _positions(self, grid: tuple[int, int, int], action_frames: int,
                   device: torch.device) -> Tensor:
        frames, height, width = grid
        f, h, w = torch.meshgrid(torch.arange(frames, device=device),
                                 torch.arange(height, device=device),
                                 torch.arange(width, device=device), indexing="ij")
        video = torch.stack([f, h, w], dim=-1).reshape(-1, 3).to(torch.float32)
        # Actions sit on the frame axis in proportion to time, off the image grid.
        step = torch.arange(action_frames, device=device, dtype=torch.float32)
        action = torch.stack([step * frames / action_frames,
                              torch.full_like(step, -1.0), torch.full_like(step, -1.0)], dim=-1)
        return torch.cat([video, action], dim=0)

    def forward(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Predict flow-matching velocities.

        Args:
            batch: Model inputs, see the class docstring.

        Returns:
            ``(latent_pred [B, C, F, H, W], action_pred [B, F_a, action_dim])``.
        """
        cfg = self.config
        latents = _require(batch, "latents", (None, cfg.in_channels, None, None, None))
        b, _, frames, height, width = latents.shape
        timesteps = _require(batch, "timesteps", (b, frames))
        text = _require(batch, "text", (b, None, cfg.text_dim))
        actions = _require(batch, "actions", (b, None, cfg.action_dim))
        action_frames = actions.shape[1]
        action_t = _require(batch, "action_timesteps", (b, action_frames))
        action_mask = (_require(batch, "action_mask", (b, action_frames))
                       if "action_mask" in batch else None)
        pf, ph, pw = cfg.patch_size
        if frames % pf or height % ph or width % pw:
            raise BatchError(f"model input 'latents' shape {tuple(latents.shape)} is not a "
                             f"multiple of patch {cfg.patch_size}", key="latents",
                             shape=tuple(latents.shape))
        grid = (frames // pf, height // ph, width // pw)
        tokens_per_frame = grid[1] * grid[2]

        video = self.patch_embedding(latents.to(self.patch_embedding.weight.dtype))
        video = video.flatten(2).transpose(1, 2)
        video_t = self.time_embedding(timesteps[:, ::pf]).repeat_interleave(tokens_per_frame, 1)

        if action_mask is not None:
            actions = torch.where(action_mask.unsqueeze(-1), actions, torch.zeros_like(actions))
        action_tokens, action_temb = self.action_embedder(actions, action_t)

        x = torch.cat([video, action_tokens], dim=1)
        temb = torch.cat([video_t, action_temb], dim=1)
        modulation = self.time_projection(F.silu(temb)).unflatten(-1, (6, cfg.dim))
        context = self.text_embedding(text)
        rope = _rope_tables(self._positions(grid, action_frames, x.device), cfg.head_dim)
        key_mask = None
        if action_mask is not None:
            video_keys = torch.ones(b, video.shape[1], dtype=torch.bool, device=x.device)
            key_mask = torch.cat([video_keys, action_mask.to(torch.bool)], dim=1)

        for block in self.blocks:
            x = block(x, modulation, context, rope, key_mask)

        shift, scale = (self.out_modulation + temb.unsqueeze(2)).unbind(2)
        x = self.norm_out(x) * (1 + scale) + shift
        patches = self.proj_out(x[:, : video.shape[1]])
        latent_pred = (
            patches.view(b, *grid, pf, ph, pw, cfg.in_channels)
            .permute(0, 7, 1, 4, 2, 5, 3, 6)
            .reshape(b, cfg.in_channels, frames, height, width)
        )
        action_pred = self.action_proj_out(x[:, video.shape[1] :])
        return latent_pred, action_pred


def count_parameters(config: ModelConfig) -> int:
    """Parameters of ``LingBotVA(config)``, computed from the shapes alone.

    Args:
        config: Model shape.

    Returns:
        The number of scalar parameters.
    """
    d, c, a = config.dim, config.in_channels, config.action_dim
    patch = math.prod(config.patch_size)

    def linear(fan_in: int, fan_out: int) -> int:
        return fan_in * fan_out + fan_out

    timestep_embedder = linear(config.freq_dim, d) + linear(d, d)
    attention = 4 * linear(d, d) + 2 * d
    block = 2 * attention + 2 * d + linear(d, config.ffn_dim) + linear(config.ffn_dim, d) + 6 * d
    return (
        c * patch * d + d  # patch_embedding
        + linear(config.text_dim, d) + linear(d, d)  # text_embedding
        + timestep_embedder  # time_embedding
        + linear(d, 6 * d)  # time_projection
        + linear(a, d) + timestep_embedder  # action_embedder
        + config.num_layers * block
        + 2 * d  # out_modulation
        + linear(d, c * patch)  # proj_out
        + linear(d, a)  # action_proj_out
    )


def shard_model(model: LingBotVA, mesh: DeviceMesh | None = None, *,
                mixed_precision: bool) -> LingBotVA:
    """Shard ``model`` in place with FSDP2: one unit per block, then the root.

    Args:
        model: The model, on its final device (or meta, to be materialised afterwards).
        mesh: 1-D data-parallel mesh; the default process group when None.
        mixed_precision: bf16 parameters in compute with fp32 gradient reduction (GPU
            training); plain fp32 when False (CPU, tests).

    Returns:
        The same module object, now an ``FSDPModule`` as well.
    """
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
