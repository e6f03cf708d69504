"""Training samples of the LingBot-VA recipe: synthetic, or read from episode files.

One sample (what ``dataset[i]`` returns) holds pre-extracted model inputs:

=================  ===========================  =========================================
key                shape / dtype                meaning
=================  ===========================  =========================================
``latents``        ``[C, F, H, W]`` float32     video latents from the VAE
``text``           ``[L, text_dim]`` float32    text-encoder embeddings (zeros if dropped)
``text_dropped``   ``[]`` bool                  the prompt was dropped (guidance training)
``actions``        ``[F_a, action_dim]`` f32    actions in [-1, 1]
``action_mask``    ``[F_a]`` bool               False for padding past the episode's end
``index``          ``[]`` int64                 the sample's index in its dataset
=================  ===========================  =========================================

:func:`collate` stacks samples into a batch with a leading batch dimension.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.utils.data import Dataset

from examples.lingbot.config import LingBotConfig
from examples.lingbot.errors import (
    BatchError,
    ConfigError,
    EpisodeDirectoryError,
    EpisodeFileError,
)

__all__ = [
    "EPISODE_KEYS",
    "EPISODE_SUFFIXES",
    "EpisodeDirectoryDataset",
    "SampleSpec",
    "SyntheticEpisodeDataset",
    "collate",
    "save_episode",
]

EPISODE_KEYS = ("latents", "text", "text_dropped", "actions", "action_mask")
"""Keys every episode file must hold (``index`` is assigned by the dataset)."""

EPISODE_SUFFIXES = (".pt", ".safetensors")
"""File suffixes :class:`EpisodeDirectoryDataset` reads; other files are ignored."""


@dataclass(frozen=True)
class SampleSpec:
    """Tensor shapes of one sample.

    Attributes:
        channels: Latent channels C.
        frames: Latent frames F.
        height: Latent height H.
        width: Latent width W.
        text_len: Text tokens L.
        text_dim: Text embedding size.
        action_frames: Action steps F_a.
        action_dim: Action vector size.
    """

    channels: int
    frames: int
    height: int
    width: int
    text_len: int
    text_dim: int
    action_frames: int
    action_dim: int

    @classmethod
    def from_config(cls, config: LingBotConfig) -> SampleSpec:
        """The sample shapes a config's model consumes."""
        data, model = config.data, config.model
        return cls(channels=model.in_channels, frames=data.num_frames, height=data.height,
                   width=data.width, text_len=data.text_len, text_dim=model.text_dim,
                   action_frames=data.action_frames, action_dim=model.action_dim)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every episode key."""
        return {
            "latents": (self.channels, self.frames, self.height, self.width),
            "text": (self.text_len, self.text_dim),
            "text_dropped": (),
            "actions": (self.action_frames, self.action_dim),
            "action_mask": (self.action_frames,),
        }


def _sample_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed that depends on (seed, index) only."""
    words = np.random.SeedSequence([seed, index]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


class SyntheticEpisodeDataset(Dataset[dict[str, Tensor]]):
    """Deterministic synthetic samples with the real batch structure.

    Sample ``i`` is drawn from a generator seeded by ``(seed, i)`` alone, so any sample
    can be regenerated without touching the others (what a resumed sampler relies on).
    The draws, in order: prompt dropout, valid action length (between half and all of
    ``action_frames``), latents, text, action increments. Actions are a clamped random
    walk, so they are smooth in time and lie in [-1, 1]; padded steps are zero.

    Args:
        spec: Sample shapes.
        num_samples: Dataset length.
        seed: Dataset seed.
        empty_prompt_prob: Probability that a sample's prompt is dropped.
    """

    def __init__(self, spec: SampleSpec, num_samples: int, *, seed: int = 0,
                 empty_prompt_prob: float = 0.1) -> None:
        if num_samples <= 0:
            raise ConfigError(f"num_samples={num_samples}: must be > 0", field="num_samples",
                              value=num_samples)
        self.spec = spec
        self.num_samples = num_samples
        self.seed = seed
        self.empty_prompt_prob = empty_prompt_prob

    @classmethod
    def from_config(cls, config: LingBotConfig) -> SyntheticEpisodeDataset:
        """The synthetic dataset a config describes."""
        return cls(SampleSpec.from_config(config), config.data.num_samples,
                   seed=config.data.seed, empty_prompt_prob=config.data.empty_prompt_prob)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} outside [0, {self.num_samples})")
        spec = self.spec
        gen = torch.Generator().manual_seed(_sample_seed(self.seed, index))
        dropped = bool(torch.rand((), generator=gen) < self.empty_prompt_prob)
        low = max(1, spec.action_frames // 2)
        valid = int(torch.randint(low, spec.action_frames + 1, (), generator=gen))
        latents = torch.randn(spec.channels, spec.frames, spec.height, spec.width, generator=gen)
        text = torch.randn(spec.text_len, spec.text_dim, generator=gen)
        steps = 0.25 * torch.randn(spec.action_frames, spec.action_dim, generator=gen)
        actions = steps.cumsum(dim=0).clamp(-1.0, 1.0)
        mask = torch.arange(spec.action_frames) < valid
        return {
            "index": torch.tensor(index, dtype=torch.int64),
            "latents": latents,
            "text": torch.zeros_like(text) if dropped else text,
            "text_dropped": torch.tensor(dropped),
            "actions": actions * mask.unsqueeze(-1),
            "action_mask": mask,
        }


def save_episode(path: str | os.PathLike[str], sample: Mapping[str, Tensor]) -> Path:
    """Write one sample's episode keys to ``path`` (``.pt`` or ``.safetensors``).

    Args:
        path: Destination; its suffix picks the format.
        sample: A mapping with at least :data:`EPISODE_KEYS`.

    Returns:
        The path written.

    Raises:
        EpisodeFileError: Unknown suffix or a missing key.
    """
    target = Path(path)
    missing = [key for key in EPISODE_KEYS if key not in sample]
    if missing:
        raise EpisodeFileError(f"cannot write {target}: sample lacks {missing}", path=str(target),
                               key=missing[0])
    tensors = {key: sample[key].detach().cpu().contiguous() for key in EPISODE_KEYS}
    if target.suffix == ".pt":
        torch.save(tensors, target)
    elif target.suffix == ".safetensors":
        save_file(tensors, str(target))
    else:
        raise EpisodeFileError(f"cannot write {target}: suffix must be one of {EPISODE_SUFFIXES}",
                               path=str(target), key=None)
    return target


def _load_tensors(path: Path) -> Mapping[str, object]:
    try:
        if path.suffix == ".pt":
            loaded: object = torch.load(path, map_location="cpu", weights_only=True)
        else:
            loaded = load_file(str(path))
    except Exception as error:  # every reader failure is reported with the file name
        raise EpisodeFileError(f"cannot read episode file {path}: {type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''}",
                               path=str(path), key=None) from error
    if not isinstance(loaded, Mapping):
        raise EpisodeFileError(f"episode file {path} holds a {type(loaded).__name__}, "
                               "expected a mapping of tensors", path=str(path), key=None)
    return loaded


def _check_episode(path: Path, loaded: Mapping[str, object],
                   shapes: dict[str, tuple[int, ...]] | None) -> dict[str, Tensor]:
    def fail(key: str, problem: str) -> EpisodeFileError:
        return EpisodeFileError(f"episode file {path}: key {key!r} {problem}", path=str(path),
                                key=key)

    sample: dict[str, Tensor] = {}
    for key in EPISODE_KEYS:
        if key not in loaded:
            raise fail(key, f"is missing (file has {sorted(map(str, loaded))})")
        value = loaded[key]
        if not isinstance(value, Tensor):
            raise fail(key, f"is a {type(value).__name__}, expected a tensor")
        if key in ("text_dropped", "action_mask"):
            if value.dtype != torch.bool:
                if value.is_floating_point() or value.is_complex() or not bool(
                    ((value == 0) | (value == 1)).all()
                ):
                    raise fail(key, f"must be bool (or 0/1 integers), got {value.dtype}")
                value = value.to(torch.bool)
        else:
            if not value.is_floating_point():
                raise fail(key, f"must be floating point, got {value.dtype}")
            value = value.to(torch.float32)
            if not bool(torch.isfinite(value).all()):
                raise fail(key, "holds NaN or infinite values")
        sample[key] = value

    ranks = {"latents": 4, "text": 2, "text_dropped": 0, "actions": 2, "action_mask": 1}
    for key, rank in ranks.items():
        if sample[key].dim() != rank:
            raise fail(key, f"has shape {tuple(sample[key].shape)}, expected {rank} dims")
    if sample["action_mask"].shape[0] != sample["actions"].shape[0]:
        raise fail("action_mask", f"has {sample['action_mask'].shape[0]} steps but 'actions' has "
                                  f"{sample['actions'].shape[0]}")
    if bool((sample["actions"].abs() > 1.0).any()):
        raise fail("actions", "has values outside [-1, 1]")
    if shapes is not None:
        for key, shape in shapes.items():
            if tuple(sample[key].shape) != shape:
                raise fail(key, f"has shape {tuple(sample[key].shape)}, expected {shape}")
    return sample


class EpisodeDirectoryDataset(Dataset[dict[str, Tensor]]):
    """Pre-extracted episodes, one file per sample, in a directory.

    Files ending in ``.pt`` (loaded with ``torch.load(weights_only=True)``) or
    ``.safetensors`` are read, in sorted name order; other files are ignored. Each must
    hold :data:`EPISODE_KEYS` with the shapes and dtypes of the module docstring. Files are
    read and checked when indexed, so a bad file fails the step that reads it, by name.

    Args:
        path: The directory.
        spec: Shapes every file must match; only self-consistency is checked when None.

    Raises:
        EpisodeDirectoryError: ``path`` is not a directory or holds no episode files.
    """

    def __init__(self, path: str | os.PathLike[str], spec: SampleSpec | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise EpisodeDirectoryError(f"episode directory {self.path} does not exist",
                                        path=str(self.path))
        self.files = sorted(entry for entry in self.path.iterdir()
                            if entry.suffix in EPISODE_SUFFIXES and entry.is_file())
        if not self.files:
            raise EpisodeDirectoryError(f"episode directory {self.path} holds no "
                                        f"{' or '.join(EPISODE_SUFFIXES)} files",
                                        path=str(self.path))
        self.spec = spec

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self.files):
            raise IndexError(f"episode index {index} outside [0, {len(self.files)})")
        path = self.files[index]
        shapes = None if self.spec is None else self.spec.shapes()
        sample = _check_episode(path, _load_tensors(path), shapes)
        sample["index"] = torch.tensor(index, dtype=torch.int64)
        return sample


def collate(samples: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Stack samples into a batch (a new leading dimension on every key).

    Args:
        samples: Samples with the same keys and per-key shapes.

    Returns:
        The batch.

    Raises:
        BatchError: No samples, differing keys, or differing shapes of a key.
    """
    if not samples:
        raise BatchError("cannot collate an empty list of samples", key=None, shape=None)
    keys = sorted(samples[0])
    batch: dict[str, Tensor] = {}
    for position, sample in enumerate(samples):
        if sorted(sample) != keys:
            raise BatchError(f"sample {position} has keys {sorted(sample)}, sample 0 has {keys}",
                             key=None, shape=None)
    for key in keys:
        shapes = {tuple(sample[key].shape) for sample in samples}
        if len(shapes) > 1:
            raise BatchError(f"cannot collate key {key!r}: samples have shapes {sorted(shapes)}",
                             key=key, shape=sorted(shapes))
        batch[key] = torch.stack([sample[key] for sample in samples])
    return batch
