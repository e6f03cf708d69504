"""Every private name of torch, s3fs and Lightning that resumekit touches, in one place.

Each name carries one comment: why resumekit needs it and what breaks if it moves. The
canary test (``tests/unit/test_private_names_canary.py``) imports each one and checks the
signature or fields resumekit relies on, so an upgrade of torch fails loudly in one test
rather than silently in a checkpoint. This module imports no torch at import time (the
store, which imports no torch, reaches s3fs through it): torch names are looked up by the
functions that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import os

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadPlanner
    from torch.distributed.tensor import DTensor

__all__ = [
    "dcp_metadata_path",
    "dtensor_over",
    "empty_state_dict_load_planner_class",
    "fsspec_filesystem",
    "load_without_collectives",
    "set_nested",
]


# -- tensors: save and load ----------------------------------------------------------------

def dcp_metadata_path(reader: FileSystemReader, rank: int | None) -> os.PathLike[str]:
    """The path of the ``.metadata`` a DCP filesystem reader reads (a rank's, with ``rank``).

    Args:
        reader: A ``FileSystemReader`` (local or fsspec).
        rank: None for the checkpoint's ``.metadata``.
    """
    # DCP's own rule for where .metadata lies (and a rank's, for saves without collectives).
    # If it moves: every safe metadata read (load, restore, inspect) fails to find the file.
    path: os.PathLike[str] = reader._get_metadata_path(rank)
    return path


def fsspec_filesystem() -> Any:
    """DCP's fsspec ``FileSystem`` (streams, paths) for a reader of an fsspec URL."""
    # DCP's only fsspec filesystem lives in a private module (no public export in 2.13). If
    # it moves: reading checkpoints from object stores (s3://, memory://) fails to start.
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem  # noqa: PLC0415 - when used

    return FileSystem()


def set_nested(root: dict[str, Any], path: Any, value: Any) -> None:
    """Set ``value`` at DCP's flattening ``path`` (an ``OBJ_PATH``) in nested ``root``."""
    # The inverse of DCP's flattening, as DCP's own load_bytes uses it. If it moves: loading
    # a non-tensor value (a learning rate, param_groups) fails.
    from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415 - when used

    set_element(root, path, value)


def empty_state_dict_load_planner_class() -> type[DefaultLoadPlanner]:
    """DCP's load planner that rebuilds the whole state dict from the metadata."""
    # What DCP's format_utils (dcp_to_torch_save) reads a checkpoint with; no public twin.
    # If it moves: read_full_state, export and inspect of whole checkpoints fail.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: PLC0415 - when used

    planner: type[DefaultLoadPlanner] = _EmptyStateDictLoadPlanner
    return planner


def load_without_collectives(state_dict: dict[str, Any], reader: Any,
                             planner: LoadPlanner) -> None:
    """DCP's load into ``state_dict`` itself, in this process only (no process group)."""
    # dcp.load fills a copy of the dict it is given, so an empty dict that a planner fills
    # from the metadata comes back empty; this is the loader under it (and under DCP's own
    # format_utils). If it moves: read_full_state (export, inspect) fails.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: PLC0415 - when used

    _load_state_dict(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def dtensor_over(local: torch.Tensor, like: DTensor) -> DTensor:
    """A ``DTensor`` with ``like``'s mesh, placements and global shape over ``local`` as is.

    Args:
        local: This rank's shard, on any device (a CPU staging buffer).
        like: The ``DTensor`` whose layout the result takes.
    """
    # DTensor.from_local moves the shard to the mesh's device (a CUDA mesh: back to the
    # GPU), so a staged CPU shard is wrapped with the spec directly. If it moves: async
    # saves of DTensor (FSDP2) states fail while staging.
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - when used

    return DTensor(local, like._spec, requires_grad=False)
