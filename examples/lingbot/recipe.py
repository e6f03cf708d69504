"""The training recipe: flow-matching losses, AdamW and the warm-up schedule.

Flow matching, for latents and actions alike, with per-frame (per-step) times t:

    x_t = (1 - t) * x0 + t * noise        target velocity = noise - x0

The model predicts the velocity; ``latent_loss`` is its mean squared error over the
latents and ``action_loss`` the masked mean squared error over the valid action steps.
Every random draw (t and noise) comes from one explicit ``torch.Generator`` so a
checkpoint can hold its state and a resumed run draws exactly what an uninterrupted run
would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR

from examples.lingbot.config import OptimConfig
from examples.lingbot.errors import BatchError

__all__ = [
    "FlowNoise",
    "LossTerms",
    "WarmupThenConstant",
    "build_optimizer",
    "build_scheduler",
    "flow_matching_loss",
    "flow_matching_step",
    "sample_flow_noise",
]

Predictor = Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]
"""A model: ``model(inputs) -> (latent_pred, action_pred)``."""


class LossTerms(NamedTuple):
    """The losses of one batch (scalars that require grad when the model does)."""

    loss: Tensor
    """``latent_loss + action_loss_weight * action_loss``: what is back-propagated."""

    latent_loss: Tensor
    """Mean squared velocity error over all latent elements."""

    action_loss: Tensor
    """Per sample, the mean squared velocity error over its valid action steps; then the
    mean over samples (a sample without valid steps contributes 0)."""


@dataclass(frozen=True)
class FlowNoise:
    """The random draws of one batch.

    Attributes:
        timesteps: ``[B, F]`` t of the latent frames.
        action_timesteps: ``[B, F_a]`` t of the action steps.
        latent_noise: Noise shaped like the latents.
        action_noise: Noise shaped like the actions.
    """

    timesteps: Tensor
    action_timesteps: Tensor
    latent_noise: Tensor
    action_noise: Tensor

    @staticmethod
    def cat(parts: Sequence[FlowNoise]) -> FlowNoise:
        """Concatenate draws of several micro-batches along the batch dimension."""
        return FlowNoise(*(torch.cat([getattr(part, name) for part in parts]) for name in
                           ("timesteps", "action_timesteps", "latent_noise", "action_noise")))


def _key(batch: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in batch:
        raise BatchError(f"batch lacks key {key!r} (has {sorted(batch)})", key=key, shape=None)
    return batch[key]


def sample_flow_noise(batch: Mapping[str, Tensor], generator: torch.Generator, *,
                      frame_patch: int = 1) -> FlowNoise:
    """Draw t and noise for ``batch`` from ``generator``, in a fixed order.

    Draw order: latent-frame t ``[B, F / frame_patch]`` (uniform in [0, 1)), action t
    ``[B, F_a]``, latent noise, action noise (standard normal). The draws happen on the
    generator's device and are then moved to the batch's device.

    Args:
        batch: A collated batch with ``latents`` ``[B, C, F, H, W]`` and ``actions``.
        generator: The run's noise generator; its state advances.
        frame_patch: Latent frames per patch: frames of one patch share their t.

    Returns:
        The draws.
    """
    latents, actions = _key(batch, "latents"), _key(batch, "actions")
    b, _, frames, _, _ = latents.shape
    if frames % frame_patch:
        raise BatchError(f"latent frames {frames} not a multiple of frame_patch {frame_patch}",
                         key="latents", shape=tuple(latents.shape))
    device = generator.device
    timesteps = torch.rand(b, frames // frame_patch, generator=generator, device=device)
    action_timesteps = torch.rand(actions.shape[:2], generator=generator, device=device)
    latent_noise = torch.randn(latents.shape, generator=generator, device=device)
    action_noise = torch.randn(actions.shape, generator=generator, device=device)
    target = latents.device
    return FlowNoise(
        timesteps=timesteps.repeat_interleave(frame_patch, dim=1).to(target),
        action_timesteps=action_timesteps.to(target),
        latent_noise=latent_noise.to(target),
        action_noise=action_noise.to(target),
    )


def flow_matching_loss(model: Predictor, batch: Mapping[str, Tensor], noise: FlowNoise, *,
                       action_loss_weight: float = 1.0) -> LossTerms:
    """Noise the batch with ``noise``, run the model and score its velocity predictions.

    Args:
        model: The video-action model (plain or FSDP-sharded).
        batch: A collated batch (see ``examples.lingbot.data``).
        noise: The draws for this batch (:func:`sample_flow_noise`).
        action_loss_weight: Weight of the action loss in ``loss``.

    Returns:
        ``(loss, latent_loss, action_loss)``.
    """
    latents, actions = _key(batch, "latents"), _key(batch, "actions")
    mask = _key(batch, "action_mask").to(torch.bool)
    t_latent = noise.timesteps[:, None, :, None, None]
    t_action = noise.action_timesteps[:, :, None]
    inputs = {
        "latents": (1 - t_latent) * latents + t_latent * noise.latent_noise,
        "timesteps": noise.timesteps,
        "text": _key(batch, "text"),
        "actions": (1 - t_action) * actions + t_action * noise.action_noise,
        "action_timesteps": noise.action_timesteps,
        "action_mask": mask,
    }
    latent_pred, action_pred = model(inputs)
    latent_loss = F.mse_loss(latent_pred.float(), (noise.latent_noise - latents).float())
    error = action_pred.float() - (noise.action_noise - actions).float()
    # torch.where before squaring, not a multiply after: values under the mask cannot
    # reach the loss or its gradient, not even NaN.
    error = torch.where(mask.unsqueeze(-1), error, torch.zeros_like(error))
    per_step = error.square().mean(dim=-1)
    valid = mask.sum(dim=1).clamp(min=1).to(per_step.dtype)
    action_loss = (per_step.sum(dim=1) / valid).mean()
    return LossTerms(latent_loss + action_loss_weight * action_loss, latent_loss, action_loss)


def flow_matching_step(model: Predictor, batch: Mapping[str, Tensor],
                       generator: torch.Generator, *, frame_patch: int = 1,
                       action_loss_weight: float = 1.0) -> LossTerms:
    """Draw noise from ``generator`` and compute the losses of ``batch``.

    Args:
        model: The video-action model.
        batch: A collated batch.
        generator: The run's noise generator.
        frame_patch: Latent frames per patch (the model's ``patch_size[0]``).
        action_loss_weight: Weight of the action loss.

    Returns:
        ``(loss, latent_loss, action_loss)``.
    """
    noise = sample_flow_noise(batch, generator, frame_patch=frame_patch)
    return flow_matching_loss(model, batch, noise, action_loss_weight=action_loss_weight)


def build_optimizer(model: nn.Module, config: OptimConfig) -> AdamW:
    """AdamW over every parameter with the recipe's lr, betas, eps and weight decay."""
    return AdamW(model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                 weight_decay=config.weight_decay)


class WarmupThenConstant:
    """Learning-rate factor: linear from ``1 / warmup_steps`` to 1, then constant 1.

    The optimizer step with index ``s`` (0-based) uses ``min(1, (s + 1) / warmup_steps)``.
    A plain object, so ``LambdaLR.state_dict()`` records it and a restore can check it.

    Args:
        warmup_steps: Steps of the warm-up (0: constant from the start).
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


def build_scheduler(optimizer: Optimizer, config: OptimConfig) -> LambdaLR:
    """Linear warm-up over ``config.warmup_steps`` steps, then the constant peak lr."""
    return LambdaLR(optimizer, WarmupThenConstant(config.warmup_steps))
