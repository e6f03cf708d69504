"""Typed configs of the LingBot-VA recipe.

Two named configs:

* ``tiny``: the same architecture and recipe at toy size; one optimizer step of two gloo
  ranks on CPU takes a fraction of a second. Tests and the preemption drill use it.
* ``furniture_all_e128``: the real dimensions of the incident's run (a Wan2.2-5B-shaped
  video-action transformer, 8 GPUs, effective batch 128, AdamW lr 3e-5 with 200 warm-up
  steps, grad-clip 2.0).

Every config is a frozen dataclass validated in ``__post_init__``; derive variants with
``dataclasses.replace`` (which validates again)::

    cfg = get_config("tiny")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_steps=50))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from examples.lingbot.errors import ConfigError

__all__ = [
    "DataConfig",
    "LingBotConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "config_names",
    "get_config",
]


def _require(condition: bool, field_name: str, message: str, value: object) -> None:
    if not condition:
        raise ConfigError(f"{field_name}={value!r}: {message}", field=field_name, value=value)


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        _require(value > 0, f"{type(owner).__name__}.{name}", "must be > 0", value)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the video-action transformer."""

    num_layers: int
    """Number of ``WanVABlock`` transformer blocks."""

    dim: int
    """Hidden size of every token."""

    num_heads: int
    """Attention heads; ``dim`` must divide evenly and the head size must be even."""

    ffn_dim: int
    """Inner size of each block's feed-forward network."""

    text_dim: int
    """Size of the incoming text-encoder embeddings (umT5-XXL gives 4096)."""

    in_channels: int = 48
    """Channels of the video latents (the Wan2.2 VAE gives 48); also the output channels."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """3-D patch (frames, height, width) that turns latents into tokens."""

    action_dim: int = 30
    """Size of one action vector (robot joint and gripper targets)."""

    freq_dim: int = 256
    """Size of the sinusoidal timestep features fed to the timestep embedders."""

    eps: float = 1e-6
    """Epsilon of every LayerNorm and RMSNorm."""

    timestep_scale: float = 1000.0
    """Flow-matching time t in [0, 1] is multiplied by this before the sinusoidal embedding."""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "dim", "num_heads", "ffn_dim", "text_dim",
                  "in_channels", "action_dim", "freq_dim", "eps", "timestep_scale")
        _require(len(self.patch_size) == 3 and all(p > 0 for p in self.patch_size),
                 "ModelConfig.patch_size", "must be three positive ints", self.patch_size)
        _require(self.dim % self.num_heads == 0, "ModelConfig.dim",
                 f"must be divisible by num_heads={self.num_heads}", self.dim)
        # Rotary embeddings split head_dim/2 frequency pairs over (frame, height, width).
        _require(self.head_dim % 2 == 0 and self.head_dim >= 6, "ModelConfig.num_heads",
                 f"gives head_dim={self.head_dim}; rotary embedding needs an even head_dim >= 6",
                 self.num_heads)
        _require(self.freq_dim % 2 == 0, "ModelConfig.freq_dim", "must be even", self.freq_dim)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.dim // self.num_heads


@dataclass(frozen=True)
class DataConfig:
    """Shape and generation of one training sample (shapes are of VAE latents)."""

    num_frames: int
    """Latent frames F of a video clip."""

    height: int
    """Latent height H (a multiple of the model's patch height)."""

    width: int
    """Latent width W (a multiple of the model's patch width)."""

    text_len: int
    """Text tokens L per prompt embedding."""

    action_frames: int
    """Action steps F_a per sample."""

    num_samples: int
    """Length of the synthetic dataset (one epoch)."""

    seed: int = 0
    """Seed of the synthetic dataset; sample i depends on (seed, i) only."""

    empty_prompt_prob: float = 0.1
    """Probability that a sample's prompt is dropped (zeros + flag), for guidance training."""

    def __post_init__(self) -> None:
        _positive(self, "num_frames", "height", "width", "text_len", "action_frames",
                  "num_samples")
        _require(self.seed >= 0, "DataConfig.seed", "must be >= 0", self.seed)
        _require(0.0 <= self.empty_prompt_prob <= 1.0, "DataConfig.empty_prompt_prob",
                 "must lie in [0, 1]", self.empty_prompt_prob)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, learning-rate schedule and gradient clipping."""

    lr: float
    """Peak learning rate, reached at the end of the warm-up and then held constant."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW coefficients of the running averages of gradient and squared gradient."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""

    eps: float = 1e-8
    """AdamW epsilon."""

    warmup_steps: int = 200
    """Optimizer steps of linear warm-up from lr/warmup_steps to lr (0: no warm-up)."""

    grad_clip: float = 2.0
    """Maximum global gradient norm (0: no clipping)."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "eps")
        _require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                 "OptimConfig.betas", "must be two values in [0, 1)", self.betas)
        _require(self.weight_decay >= 0, "OptimConfig.weight_decay", "must be >= 0",
                 self.weight_decay)
        _require(self.warmup_steps >= 0, "OptimConfig.warmup_steps", "must be >= 0",
                 self.warmup_steps)
        _require(self.grad_clip >= 0, "OptimConfig.grad_clip", "must be >= 0", self.grad_clip)


@dataclass(frozen=True)
class TrainConfig:
    """Batching, length, checkpoint cadence and seeds of a run."""

    world_size: int
    """Ranks the recipe is written for (GPUs); the trainer checks the launch against it."""

    micro_batch_size: int
    """Samples per rank per forward/backward."""

    grad_accum_steps: int
    """Micro-batches accumulated per optimizer step (gradients sync on the last only)."""

    effective_batch_size: int
    """Samples per optimizer step; must equal world_size * micro_batch_size * grad_accum_steps."""

    num_steps: int
    """Optimizer steps of the whole run (the budget a resumed run continues towards)."""

    save_interval: int
    """Optimizer steps between checkpoints."""

    seed: int = 0
    """Seed of the model initialisation and of the data order."""

    noise_seed: int = 1
    """Seed of the generator that draws flow-matching noise and timesteps (checkpointed)."""

    action_loss_weight: float = 1.0
    """Weight of the action loss in the total loss (latent loss has weight 1)."""

    mixed_precision: bool = False
    """bf16 parameters with fp32 gradient reduction under FSDP2 (GPU); fp32 otherwise."""

    def __post_init__(self) -> None:
        _positive(self, "world_size", "micro_batch_size", "grad_accum_steps",
                  "effective_batch_size", "num_steps", "save_interval")
        _require(self.action_loss_weight >= 0, "TrainConfig.action_loss_weight",
                 "must be >= 0", self.action_loss_weight)
        product = self.world_size * self.micro_batch_size * self.grad_accum_steps
        _require(product == self.effective_batch_size, "TrainConfig.effective_batch_size",
                 f"must equal world_size*micro_batch_size*grad_accum_steps = "
                 f"{self.world_size}*{self.micro_batch_size}*{self.grad_accum_steps} = {product}",
                 self.effective_batch_size)


@dataclass(frozen=True)
class LingBotConfig:
    """A complete recipe: model, data, optimizer and training loop."""

    name: str
    """Registry name of the config (``get_config(name)``)."""

    model: ModelConfig
    """Transformer shape."""

    data: DataConfig
    """Sample shapes and synthetic data generation."""

    optim: OptimConfig
    """Optimizer, schedule and clipping."""

    train: TrainConfig
    """Batching, run length and checkpoint cadence."""

    def __post_init__(self) -> None:
        patch_f, patch_h, patch_w = self.model.patch_size
        _require(self.data.num_frames % patch_f == 0, "DataConfig.num_frames",
                 f"must be a multiple of the patch frames {patch_f}", self.data.num_frames)
        _require(self.data.height % patch_h == 0, "DataConfig.height",
                 f"must be a multiple of the patch height {patch_h}", self.data.height)
        _require(self.data.width % patch_w == 0, "DataConfig.width",
                 f"must be a multiple of the patch width {patch_w}", self.data.width)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view of the whole config (for logs and checkpoint fingerprints)."""
        return dataclasses.asdict(self)


def _tiny() -> LingBotConfig:
    return LingBotConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, dim=64, num_heads=4, ffn_dim=128, text_dim=32),
        data=DataConfig(num_frames=2, height=4, width=4, text_len=8, action_frames=4,
                        num_samples=64),
        optim=OptimConfig(lr=1e-3, warmup_steps=5),
        train=TrainConfig(world_size=2, micro_batch_size=2, grad_accum_steps=2,
                          effective_batch_size=8, num_steps=20, save_interval=5),
    )


def _furniture_all_e128() -> LingBotConfig:
    return LingBotConfig(
        name="furniture_all_e128",
        # Wan2.2-TI2V-5B dimensions plus the action embedder and head.
        model=ModelConfig(num_layers=30, dim=3072, num_heads=24, ffn_dim=14336, text_dim=4096),
        # Latents of 8 frames of 256x320 video through a 4x/16x/16x VAE; 4 actions per frame.
        data=DataConfig(num_frames=8, height=16, width=20, text_len=512, action_frames=32,
                        num_samples=100_000),
        optim=OptimConfig(lr=3e-5, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=200,
                          grad_clip=2.0),
        # The incident's checkpoint names (200, 750, 1000) are all multiples of 50.
        train=TrainConfig(world_size=8, micro_batch_size=1, grad_accum_steps=16,
                          effective_batch_size=128, num_steps=10_000, save_interval=50,
                          mixed_precision=True),
    )


_CONFIGS: dict[str, Callable[[], LingBotConfig]] = {
    "furniture_all_e128": _furniture_all_e128,
    "tiny": _tiny,
}


def config_names() -> list[str]:
    """Names accepted by :func:`get_config`, sorted."""
    return sorted(_CONFIGS)


def get_config(name: str) -> LingBotConfig:
    """Return a fresh instance of the named config.

    Args:
        name: One of :func:`config_names` (``"tiny"``, ``"furniture_all_e128"``).

    Raises:
        ConfigError: ``name`` is unknown; the message lists the known names.
    """
    try:
        factory = _CONFIGS[name]
    except KeyError:
        known = config_names()
        raise ConfigError(f"unknown LingBot config {name!r}; known configs: {', '.join(known)}",
                          name=name, known=known) from None
    return factory()
