"""Every private name of torch, s3fs and Lightning resumekit touches; every torch version check.

Each name carries one comment: why resumekit needs it and what breaks if it moves. The
canary test (``tests/unit/test_private_names_canary.py``) imports each one and checks the
signature or fields resumekit relies on, so an upgrade of torch fails loudly in one test
rather than silently in a checkpoint. This module imports no torch at import time (the
store, which imports no torch, reaches s3fs through it): torch names are looked up by the
functions that need them.

One section per library (and per wing of resumekit for torch), each section with the same
title as its section of the canary test. A function here reaches one private name and does
nothing else: deciding what to do when it is gone is the caller's job. The first section
holds the torch releases resumekit supports and the torchrun options that depend on the
release (docs/compatibility.md); nothing else in resumekit compares torch versions.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import os

    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.tensor import DTensor

__all__ = [
    "FQN_MODIFIERS_ATTRIBUTE",
    "FSDP2_LOAD_HOOK_OWNER",
    "SUPPORTED_TORCH",
    "TORCHRUN_OPTION_SINCE",
    "checkpoint_wrapper_prefix",
    "compiled_module_type",
    "dcp_metadata_path",
    "dcp_storage_info",
    "dtensor_over",
    "flat_param_name",
    "lightning_cluster_environment",
    "lightning_combined_loader",
    "lightning_data_fetcher",
    "load_state_dict_hooks",
    "overrides_load_from_state_dict",
    "s3_call",
    "torch_release",
    "torch_version",
    "torch_version_problem",
    "torchrun_takes",
]


# -- torch versions ------------------------------------------------------------------------

SUPPORTED_TORCH = ">=2.9,<2.16"
"""The torch releases resumekit supports: pyproject.toml's requirement, word for word."""
# Why 2.9: DCP's filesystem reader has the metadata-path rule restore reads by
# (``_get_metadata_path``) from 2.9 on; 2.7 and 2.8 fail every restore, 2.6 every save.
# Why <2.16: 2.15.0 is the newest release the suites passed on (docs/compatibility.md).
_FLOOR, _CEILING = (2, 9), (2, 16)

TORCHRUN_OPTION_SINCE: Mapping[str, tuple[int, int]] = MappingProxyType({
    "--signals-to-handle": (2, 10),
    "--shutdown-timeout": (2, 12),
})
"""torchrun's options that older torchrun rejects, and the torch release that added each."""


def torch_release(version: str) -> tuple[int, int, int]:
    """The release numbers of a torch version string.

    ``"2.15.0+cu132"`` -> ``(2, 15, 0)``; pre-releases and local builds count as their
    release (``"2.10.0a0+git1234"`` -> ``(2, 10, 0)``).

    Raises:
        ValueError: ``version`` does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def torch_version() -> str | None:
    """The installed torch's version, without importing torch; None when there is none."""
    loaded = sys.modules.get("torch")
    if loaded is not None and isinstance(getattr(loaded, "__version__", None), str):
        return str(loaded.__version__)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    # torch writes its version into torch/version.py at build time; reading that file costs
    # far less than importing torch (seconds) or importlib.metadata. If it moves: the
    # package metadata is read instead.
    for location in spec.submodule_search_locations:
        try:
            text = (Path(location) / "version.py").read_text()
        except OSError:
            continue
        match = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", text,
                          re.MULTILINE)
        if match:
            return match.group(1)
    metadata = importlib.import_module("importlib.metadata")
    try:
        return str(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None


def torch_version_problem(version: str | None) -> str | None:
    """Why ``version`` of torch is outside the supported range; None when it is inside.

    Args:
        version: A torch version string (:func:`torch_version`); None (no torch) is no
            problem of range.
    """
    if version is None:
        return None
    try:
        release = torch_release(version)
    except ValueError:
        return f"torch {version!r} is not a version resumekit can compare with {SUPPORTED_TORCH}"
    if _FLOOR <= release[:2] < _CEILING:
        return None
    side = "older than" if release[:2] < _FLOOR else "newer than"
    return (f"torch {version} is {side} the releases resumekit supports (torch"
            f"{SUPPORTED_TORCH}): it may fail or write checkpoints the supported torch "
            "releases cannot read; see docs/compatibility.md")


def torchrun_takes(option: str, version: str) -> bool:
    """Whether the torchrun of torch ``version`` accepts ``option`` (``--name``).

    Options not in :data:`TORCHRUN_OPTION_SINCE` are taken to exist in every supported torch.
    """
    since = TORCHRUN_OPTION_SINCE.get(option.split("=", 1)[0])
    return since is None or torch_release(version)[:2] >= since


# -- s3fs ----------------------------------------------------------------------------------

def s3_call(fs: Any, method: str, **kwargs: Any) -> dict[str, Any]:
    """One S3 API request (a botocore client method) through an ``S3FileSystem``.

    Args:
        fs: The ``s3fs.S3FileSystem`` of the storage.
        method: The botocore client method, e.g. ``"list_objects_v2"``.
        **kwargs: The request's parameters.

    Returns:
        The response dict botocore returns.
    """
    # s3fs's one request path (its credentials, endpoint, retries); its public listing has
    # no MaxKeys/StartAfter. If it moves: Storage.is_dir and the S3 listing after a name fail.
    # (fsspec is looked up here, not imported with this module: `import resumekit` imports
    # this module for its torch version check, and imports nothing heavy.)
    asyn = importlib.import_module("fsspec.asyn")
    response: dict[str, Any] = asyn.sync(fs.loop, fs._call_s3, method, **kwargs)
    return response


# -- Lightning -----------------------------------------------------------------------------

def lightning_cluster_environment(trainer: Any) -> Any | None:
    """The cluster environment Lightning's signal connector reads; None if it moved.

    Args:
        trainer: The ``lightning.pytorch.Trainer``.
    """
    # A single-device strategy has no public cluster_environment, but Lightning's SIGUSR1
    # handler reads this one. If it moves: the callback cannot see SLURM auto_requeue.
    connector = getattr(trainer, "_accelerator_connector", None)
    return getattr(connector, "cluster_environment", None)


def lightning_combined_loader(fit_loop: Any) -> Any | None:
    """The fit loop's ``CombinedLoader`` (its ``limits`` end an epoch); None if it moved.

    Args:
        fit_loop: ``trainer.fit_loop``.
    """
    # Lightning 2.x keeps the train epoch's batch limit here. If it moves: a mid-epoch
    # resume ends its epochs early (the callback warns that it cannot give the full length).
    return getattr(fit_loop, "_combined_loader", None)


def lightning_train_source(fit_loop: Any) -> Any | None:
    """The fit loop's train data source (``dataloader()`` makes the loaders); None if moved.

    Args:
        fit_loop: ``trainer.fit_loop``.
    """
    # Lightning 2.x asks this _DataLoaderSource for the train loaders (a LightningModule's
    # or DataModule's train_dataloader(), or the loaders given to fit()) and iterates them
    # at once, before any callback hook sees them. If it moves: the callback cannot make the
    # train loaders' workers ignore the preemption signals (it warns).
    source = getattr(fit_loop, "_data_source", None)
    return source if callable(getattr(source, "dataloader", None)) else None


def lightning_data_fetcher(fit_loop: Any) -> Any | None:
    """The fit loop's data fetcher (its ``length`` counts the epoch); None if it moved.

    Args:
        fit_loop: ``trainer.fit_loop``.
    """
    # Lightning 2.x's fetcher counts the epoch to its own length. If it moves: after a
    # mid-epoch resume Lightning's done-check may stop at the short length it counted.
    return getattr(fit_loop, "_data_fetcher", None)


# --------------------------------------------------------------------- tensors: raw format


def dcp_storage_info() -> type[Any]:
    """DCP's ``torch.distributed.checkpoint.filesystem._StorageInfo``, the class itself.

    The one private torch name of the raw tensor format (:mod:`resumekit.tensors.raw`).
    """
    # .metadata pickles every item's place as it; if it moves, no old checkpoint unpickles.
    module = importlib.import_module("torch.distributed.checkpoint.filesystem")
    return cast("type[Any]", module._StorageInfo)


# -- tensors: state-dict views -------------------------------------------------------------
# resumekit.tensors.state_dicts takes ``model.state_dict()`` itself where DCP's state-dict
# API (``get_state_dict``) would rename nothing, because DCP walks the module tree once per
# parameter on every call. These are the names that decide "DCP renames something here";
# DCP itself decides with them, and exports none of them. (Looked up through importlib,
# as every torch name here: the store, which imports no torch, imports this module.)


def checkpoint_wrapper_prefix() -> str:
    """The key prefix of activation checkpointing's wrapper, which DCP strips from names."""
    # Why: a key carrying it is one DCP renames. If it moves: ImportError on the first
    # capture of a model's state (never a silently wrong name).
    module = importlib.import_module("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    return str(module._CHECKPOINT_PREFIX)


def flat_param_name() -> str:
    """The name of FSDP1's flat parameter, whose keys DCP's state-dict API refuses."""
    # Why: a key carrying it is one DCP raises for, so its error must stand. If it moves:
    # ImportError on the first capture of a model's state.
    return str(importlib.import_module("torch.distributed.checkpoint.state_dict")._FLAT_PARAM)


FQN_MODIFIERS_ATTRIBUTE = "_fqn_modifiers"
"""The method by which a module tells DCP's state-dict API to rename its children."""
# Why: a module having it is one DCP renames for. If DCP renames the protocol: a module
# using the new name would be captured under its own names (the canary fails first).


def compiled_module_type() -> type | None:
    """``torch.compile``'s module wrapper class, whose ``_orig_mod.`` DCP strips from names.

    None while ``torch._dynamo`` is not imported: no instance of it can exist before its
    module is, and importing it costs seconds.
    """
    # Why: torch exports no public name for the wrapper's class. If it moves: compiled
    # models would be captured under ``_orig_mod.`` names (the canary fails first).
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return compiled if isinstance(compiled, type) else None


def compiled_inner_module(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper (:func:`compiled_module_type`) wraps."""
    # Why: the wrapper exports it only as ``_orig_mod``. If it moves: AttributeError on the
    # first capture of a compiled model with state-dict hooks (the canary fails first).
    return module._orig_mod


def extra_state_key_suffix() -> str:
    """The last atom of a module's extra-state key (``get_extra_state``) in a state dict."""
    # Why: such a key names no attribute, yet DCP accepts it; telling it from a key a
    # state-dict hook made needs the name. If it moves: AttributeError on the first capture
    # of a model with state-dict hooks (the canary fails first).
    return str(importlib.import_module("torch.nn.modules.module")._EXTRA_STATE_KEY_SUFFIX)


FSDP2_LOAD_HOOK_OWNER = "FSDPParam."
"""The qualified-name prefix of the load post-hook FSDP2 puts on each module it shards."""
# Why: that hook only re-derives FSDP2's sharded views, so a load into the very memory of
# the parameters may skip it. If it moves: such loads copy through DCP again (slower,
# never wrong), and the canary fails.



def load_state_dict_hooks(module: Any) -> tuple[Mapping[int, Any], Mapping[int, Any]]:
    """A module's own ``load_state_dict`` pre-hooks and post-hooks, by handle id."""
    # Why: nn.Module has no public way to ask whether a load would run anyone's hook, and a
    # load whose hooks may do more than copy is never skipped. If they move: AttributeError
    # on the first restore (the canary fails first).
    return module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks


def overrides_load_from_state_dict(module_type: type) -> bool:
    """Whether a module class loads its state with code of its own, not ``nn.Module``'s."""
    # Why: ``_load_from_state_dict`` is the per-module load step torch documents for
    # overriding; a class that overrides it may do more than copy, so its load is never
    # skipped. If it moves: AttributeError on the first restore (the canary fails first).
    own = importlib.import_module("torch.nn").Module._load_from_state_dict
    return bool(module_type._load_from_state_dict is not own)  # type: ignore[attr-defined]

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




def dtensor_over(local: torch.Tensor, like: DTensor) -> DTensor:
    """A ``DTensor`` with ``like``'s mesh, placements and global shape over ``local`` as is.

    Args:
        local: This rank's shard, on any device (a CPU staging buffer).
        like: The ``DTensor`` whose layout the result takes.
    """
    # DTensor.from_local moves the shard to the mesh's device (a CUDA mesh: back to the
    # GPU), so a staged CPU shard is wrapped with the spec directly. If it moves: async
    # saves of DTensor (FSDP2) states fail while staging.
    dtensor_class: Any = type(like)
    wrapped: DTensor = dtensor_class(local, like._spec, requires_grad=False)
    return wrapped
