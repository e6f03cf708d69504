"""Start from a weights-only checkpoint written by a trainer without resumekit.

LingBot-VA's upstream trainer writes ``checkpoint_step_N/transformer/
diffusion_pytorch_model.safetensors`` (optionally split, with a
``diffusion_pytorch_model.safetensors.index.json``) and nothing else: no optimizer,
scheduler, RNG or data position. Importing one loads the weights into the (possibly
sharded) model and sets the step to N; everything else starts fresh, and the manager
warns loudly. A legacy directory is never chosen over a committed resumekit checkpoint.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from torch import nn

from resumekit import sharded
from resumekit.errors import CheckpointNotFoundError, CorruptCheckpointError
from resumekit.storage import Storage

__all__ = ["find_weight_files", "load_weights_only", "read_full_weights"]

_INDEX_SUFFIX = ".safetensors.index.json"


def find_weight_files(storage: Storage, name: str) -> list[str]:
    """Return the safetensors files of a legacy directory, relative to the root.

    Prefers ``transformer/`` (the upstream layout); follows an ``*.index.json`` when
    present.

    Raises:
        CheckpointNotFoundError: The directory holds no safetensors weights.
    """
    files = [path for path, _ in storage.walk_files(name)]
    for folder in ("transformer/", ""):
        indexes = [p for p in files if p.startswith(folder) and p.endswith(_INDEX_SUFFIX)]
        if indexes:
            index_path = f"{name}/{indexes[0]}"
            try:
                index = json.loads(storage.read_bytes(index_path))
                shards = sorted(set(index["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as error:
                raise CorruptCheckpointError(
                    f"{storage.path(index_path)}: unreadable safetensors index ({error})",
                    path=storage.path(index_path), file=indexes[0],
                ) from error
            base = indexes[0].rsplit("/", 1)[0] + "/" if "/" in indexes[0] else ""
            return [f"{name}/{base}{shard}" for shard in shards]
        weights = sorted(p for p in files if p.startswith(folder) and
                         p.endswith(".safetensors"))
        if weights:
            return [f"{name}/{path}" for path in weights]
    raise CheckpointNotFoundError(
        f"{storage.path(name)} holds no *.safetensors weights to import",
        path=storage.path(name),
    )


def read_full_weights(storage: Storage, name: str) -> dict[str, torch.Tensor]:
    """Read every tensor of a legacy directory (full, unsharded, as stored)."""
    weights: dict[str, torch.Tensor] = {}
    for relative in find_weight_files(storage, name):
        try:
            if storage.is_local:
                part = load_file(storage.path(relative))
            else:
                part = load_safetensors_bytes(storage.read_bytes(relative))
        except Exception as error:
            raise CorruptCheckpointError(
                f"{storage.path(relative)}: not a readable safetensors file ({error})",
                path=storage.path(name), file=relative,
            ) from error
        duplicated = set(part) & set(weights)
        if duplicated:
            raise CorruptCheckpointError(
                f"{storage.path(relative)}: tensor {sorted(duplicated)[0]!r} appears in two "
                "weight files", path=storage.path(name), file=relative,
            )
        weights.update(part)
    return weights


def load_weights_only(storage: Storage, name: str, model: nn.Module) -> None:
    """Load a legacy directory's weights into ``model`` (plain, DDP or FSDP2).

    Tensors are cast to the dtype of the model's parameters (upstream exports are often
    bf16 while training keeps fp32 masters). Names and shapes must match exactly.

    Raises:
        IncompatibleCheckpointError: Missing/unexpected keys or shapes differ.
    """
    sharded.apply_full_model_state(model, read_full_weights(storage, name))
