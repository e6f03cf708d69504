"""Every private name of torch, s3fs and Lightning that resumekit touches, in one place.

Each name carries one comment: why resumekit needs it and what breaks if it moves. The
canary test (``tests/unit/test_private_names_canary.py``) imports each one and checks the
signature or fields resumekit relies on, so an upgrade of torch fails loudly in one test
rather than silently in a checkpoint. This module imports no torch at import time (the
store, which imports no torch, reaches s3fs through it): torch names are looked up by the
functions that need them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

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
