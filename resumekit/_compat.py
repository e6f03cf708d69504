"""Every private name of torch, s3fs and Lightning that resumekit touches, in one place.

Each name carries one comment: why resumekit needs it and what breaks if it moves. The
canary test (``tests/unit/test_private_names_canary.py``) imports each one and checks the
signature or fields resumekit relies on, so an upgrade of torch fails loudly in one test
rather than silently in a checkpoint. This module imports no torch at import time (the
store, which imports no torch, reaches s3fs through it): torch names are looked up by the
functions that need them.

One section per library (and per wing of resumekit for torch), each section with the same
title as its section of the canary test. A function here reaches one private name and does
nothing else: deciding what to do when it is gone is the caller's job.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any, cast

import fsspec.asyn

__all__ = [
    "dcp_storage_info",
    "lightning_cluster_environment",
    "lightning_combined_loader",
    "lightning_data_fetcher",
    "s3_call",
]


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
    response: dict[str, Any] = fsspec.asyn.sync(fs.loop, fs._call_s3, method, **kwargs)
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
