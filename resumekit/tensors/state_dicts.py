"""The model and optimizer views a checkpoint stores, and how they are applied back.

One job: turn a model (plain, DDP, ``torch.compile``-d, activation-checkpointed, FSDP1 or
FSDP2) and its optimizer into the state dicts DCP saves and loads, keyed by DCP's canonical
parameter names, and load such a state back into them. The names are DCP's own: every
state comes from DCP's public state-dict API (``get_state_dict``, ``get_model_state_dict``,
``set_state_dict``), except where a module provably has nothing for DCP to rename. There
the same dictionaries are built directly (``model.state_dict()`` and the optimizer's own
``state_dict()`` under the parameters' own names), because DCP's functions walk the module
tree per parameter on every call; ``docs/design.md`` gives the figure that keeps this
shortcut. Whether DCP would rename anything is asked of the few torch names that decide
it, which live in :mod:`resumekit._compat`.

A model whose state dict is not its parameters (a state-dict hook renames, splits or
fuses parameters, or adds entries no attribute holds: torchtitan's ``FusedQKVLinear``
saves its fused ``wqkv.weight`` as ``wq/wk/wv.weight``) is one DCP's state-dict API cannot
name (its ``get_state_dict`` looks every key up as an attribute and raises). Its
checkpoint holds the model's own state dict, keys and values as the hooks make them, and
the optimizer's state under the parameters' canonical names (as torchtitan keys it); a
load goes back through the model's own ``load_state_dict``, so its load hooks run
(:func:`hooked_state`).

Also here: tied weights (:func:`find_tied`, :func:`untie`, :func:`retie`), zero optimizer
state preallocated from a checkpoint's metadata (:func:`preallocate_optimizer_state`), and
full weights loaded into a sharded model (:func:`apply_full_model_state`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from resumekit import _compat
from resumekit.errors import IncompatibleCheckpointError
from resumekit.tensors.context import directory_str as _directory_str
from resumekit.tensors.context import paused_collection as _collection_paused
from resumekit.tensors.failures import incompatible as _incompatible
from resumekit.tensors.fit import PARAM_NAMES as _PARAM_NAMES
from resumekit.tensors.fit import compare_flat as _compare_flat
from resumekit.tensors.fit import describe as _describe
from resumekit.tensors.fit import flatten_state
from resumekit.tensors.reader import CheckedMetadata as _CheckedMetadata
from resumekit.tensors.reader import make_reader as _make_reader

__all__ = [
    "Optimizers",
    "apply_full_model_state",
    "apply_model_and_optimizer_state",
    "canonical_param_name",
    "find_tied",
    "hooked_state",
    "load_model_state",
    "load_named_optimizer_state",
    "model_and_optimizer_state",
    "model_state_dict",
    "named_state",
    "optimizer_parts",
    "plain_state_dict",
    "preallocate_optimizer_state",
    "retie",
    "untie",
    "without_param_names",
]

Optimizers = torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...]
"""One optimizer, or several that update disjoint parameters of one model (saved as one)."""


def optimizer_parts(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers of ``optimizer``: itself alone, or the tuple it is."""
    return optimizer if isinstance(optimizer, tuple) else (optimizer,)


def model_and_optimizer_state(
    model: nn.Module,
    optimizer: Optimizers | None = None,
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """Return the model's (and optimizer's) state as DCP can save and load it.

    Keys are fully qualified parameter names, the same for a plain module, DDP and FSDP2,
    so a checkpoint moves between them. With FSDP2 the values stay sharded ``DTensor``s
    (each rank holds its shards, no gather, no copy). Tensors keep their dtype.

    Args:
        model: The module (plain, DDP-wrapped or ``fully_shard``-ed).
        optimizer: Its optimizer, a tuple of optimizers (each updating its own
            parameters: their states and groups are saved as one optimizer's), or
            ``None`` to capture the model alone. An optimizer that has not stepped yet
            gets its state initialised (DCP needs destination tensors to load into) by a
            zero-learning-rate step on zero gradients.
        options: DCP ``StateDictOptions``; the default keeps tensors sharded and in place.

    Returns:
        ``{"model": ...}`` plus ``"optimizer"`` when an optimizer is given.
    """
    if optimizer is None:
        with _collection_paused(False):  # see collection_paused
            return {"model": model_state_dict(model, options=options)}
    if options is None:
        with _collection_paused(False):
            named = named_state(model, optimizer)
        if named is not None:
            return {"model": named[0], "optimizer": named[1]}
        hooked = hooked_state(model)
        if hooked is not None:  # keys DCP cannot name: the optimizer's names are DCP's
            return {"model": hooked,
                    "optimizer": get_optimizer_state_dict(model, optimizer)}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def named_state(model: nn.Module, optimizer: Optimizers
                ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """DCP's ``get_state_dict(model, optimizer)``, without its walks, where it is the same.

    With default options DCP's function builds a name map of the whole module tree (one
    walk per parameter) on every call, then returns ``model.state_dict()`` under
    canonical names without meta tensors, and the optimizer's ``state_dict()`` with each
    parameter id replaced by the canonical name ``model.named_parameters()`` gives it
    (only ``state`` and ``param_groups``); what that costs is in ``docs/performance.md``
    (per-tensor figure). Where every canonical name is the module's own name, that is
    what this returns directly: no module renames (no DDP, FSDP1, ``torch.compile`` or
    ``_fqn_modifiers``; FSDP2's ``fully_shard`` renames nothing), no activation
    checkpointing prefix or ``_flat_param`` key, no ``state_dict`` replaced on the
    instances, every parameter's name a key of the state dict (activation
    checkpointing's wrapper names its parameters with a prefix its state dict strips),
    an optimizer that has state (DCP would initialise it by a step) and whose every
    parameter is one of the model's. Anything else: None (ask DCP). A model whose state
    dict has keys of a state-dict hook's own (see :func:`hooked_state`) is taken here too
    (DCP would raise for it), its optimizer keyed by the parameters' canonical names.
    """
    parts = optimizer_parts(optimizer)
    if "state_dict" in vars(model) or any("state_dict" in vars(part) or not part.state
                                           for part in parts):
        return None
    state = _state_under_own_names(model, _renamers())
    if state is None:
        return None
    names = {id(param): name for name, param in model.named_parameters()}
    if any(name not in state for name in names.values()):
        if not _hook_made(model, state):
            return None  # a name the state dict renames (activation checkpointing's wrapper)
        # A state-dict hook's own keys: the optimizer keeps the parameters' names.
        names = {key: _without_checkpoint_prefix(name) for key, name in names.items()}
    optimizer_state: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in parts:  # several optimizers: DCP's merge, each one's state and groups
        stored = part.state_dict()
        params = [param for group in part.param_groups for param in group["params"]]
        if any(id(param) not in names for param in params):
            return None
        name_of = {number: names[id(param)] for number, param in enumerate(params)}
        optimizer_state["state"].update(
            (name_of[number], value) for number, value in stored["state"].items())
        optimizer_state["param_groups"].extend(
            {**group, "params": [name_of[number] for number in group["params"]]}
            for group in stored["param_groups"])
    return state, optimizer_state


def model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None
                     ) -> dict[str, Any]:
    """``get_model_state_dict(model, options=options)``, without its walks where it is the same.

    DCP's ``get_model_state_dict`` maps every key to its canonical name by walking the
    module tree once per parameter (and once more per parameter to build a mapping only
    optimizers use), on every call. For a module it provably changes nothing for (a
    plain module, or one ``fully_shard`` alone wraps: FSDP2 renames nothing), the result
    is ``model.state_dict()`` itself, taken here directly under the rules of
    :func:`named_state`; anything else goes through DCP's function.

    Args:
        model: The module.
        options: DCP ``StateDictOptions``; only the default (``None``) takes the shortcut.
    """
    if options is None:
        own = _state_under_own_names(model, _renamers())
        if own is not None:
            return own
        hooked = hooked_state(model)
        if hooked is not None:
            return hooked
    return get_model_state_dict(model, options=options)


def hooked_state(model: nn.Module) -> dict[str, Any] | None:
    """The model's own state dict where a state-dict hook made keys DCP cannot name, or None.

    DCP's ``get_state_dict`` / ``get_model_state_dict`` look each key of
    ``model.state_dict()`` up as an attribute path of the module tree, to rename it; a key
    a hook made (``wq.weight`` of a module whose parameter is ``wqkv.weight``, a tensor a
    hook adds) is no attribute, and DCP raises ``AttributeError``. For such a model the
    checkpoint holds the state dict as the model makes it: the module inside any DDP or
    ``torch.compile`` wrapper (whose names DCP strips, so its own keys are the canonical
    ones), its ``state_dict()`` under ``no_grad``, without meta tensors. With FSDP2 the
    values are what the hooks return (torchtitan's gathers its fused parameter to a
    replicated ``DTensor``; DCP saves one copy of it).

    Returns:
        That state, or None: every key names a parameter, buffer or extra state (DCP's
        rules stand), or a module inside the wrappers renames for DCP (FSDP1,
        ``_fqn_modifiers``, a nested DDP: DCP decides, and raises if it cannot).
    """
    inner = _own_keys_root(model)
    if inner is None:
        return None
    with torch.no_grad():
        state = inner.state_dict()
    if not state or not _hook_made(inner, state):
        return None
    for key in [key for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.is_meta]:
        del state[key]
    return state


def _own_keys_root(model: nn.Module) -> nn.Module | None:
    """The module inside DDP and ``torch.compile`` wrappers, if nothing in it renames for DCP."""
    compiled = _compat.compiled_module_type()
    inner = model
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        elif compiled is not None and isinstance(inner, compiled):
            inner = _compat.compiled_inner_module(inner)
        else:
            break
    if any(_is_wrapper(module, _renamers()) for module in inner.modules()):
        return None
    return inner


def _hook_made(model: nn.Module, keys: Iterable[str]) -> bool:
    """Whether a key names no parameter, buffer or extra state of ``model`` (a hook's own).

    Names are compared without activation checkpointing's prefix, which its wrapper's own
    hook strips from the state dict's keys.
    """
    known = {_without_checkpoint_prefix(name)
             for name, _ in model.named_parameters(remove_duplicate=False)}
    known.update(_without_checkpoint_prefix(name)
                 for name, _ in model.named_buffers(remove_duplicate=False))
    extra = _compat.extra_state_key_suffix()
    return any(key not in known and key.rsplit(".", 1)[-1] != extra for key in keys)


def _without_checkpoint_prefix(name: str) -> str:
    """``name`` without activation checkpointing's wrapper atom (DCP's canonical name)."""
    return name.replace(_compat.checkpoint_wrapper_prefix(), "")


def _renamers() -> tuple[type, ...]:
    """The wrapper types whose modules DCP renames (all but FSDP2's, which renames nothing)."""
    return tuple(kind for kind in _wrapper_types() if kind is not FSDPModule)


def _wrapper_types() -> tuple[type, ...]:
    """The module classes DCP's state-dict API renames or gathers for.

    ``torch.compile``'s wrapper class is only looked up if ``torch._dynamo`` is imported:
    no instance of it can exist before its module is.
    """
    types: tuple[type, ...] = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    compiled = _compat.compiled_module_type()
    return types if compiled is None else (*types, compiled)


def _is_wrapper(module: nn.Module, types: tuple[type, ...]) -> bool:
    """Whether DCP's state-dict API renames or gathers anything for ``module``."""
    return isinstance(module, types) or hasattr(module, _compat.FQN_MODIFIERS_ATTRIBUTE)


def plain_state_dict(model: nn.Module) -> dict[str, Any] | None:
    """``model.state_dict()`` where it equals DCP's ``get_model_state_dict(model)``, else None.

    With default options DCP's function returns ``model.state_dict()`` (taken under
    ``no_grad``), with each key replaced by its canonical name, and raises for an empty
    state or a ``_flat_param`` key. The canonical name differs from the key only through
    DDP's ``module``, FSDP1's wrapper, ``torch.compile``'s ``_orig_mod``, activation
    checkpointing's prefix or a module's ``_fqn_modifiers``; FSDP2 is left to DCP too.
    So the state is returned (without meta tensors, which DCP drops) when no module is
    any of these, no key carries the checkpointing prefix or ``_flat_param``, no value is
    a ``DTensor`` and the state is not empty; otherwise None (the caller asks DCP).
    """
    state = _state_under_own_names(model, _wrapper_types())
    if state is None or any(isinstance(value, DTensor) for value in state.values()):
        return None
    return state


def _state_under_own_names(model: nn.Module, renamers: tuple[type, ...]
                           ) -> dict[str, Any] | None:
    """``model.state_dict()`` as DCP's ``get_model_state_dict`` returns it, or None.

    None when some module is one of ``renamers`` or has ``_fqn_modifiers``, the state is
    empty, or a key carries activation checkpointing's prefix or ``_flat_param`` (DCP
    renames or refuses those); otherwise the state without meta tensors (DCP drops them).
    """
    if any(_is_wrapper(module, renamers) for module in model.modules()):
        return None
    with torch.no_grad():
        state = model.state_dict()
    if not state or _renamed(state):
        return None
    for key in [key for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.is_meta]:
        del state[key]
    return state


def _renamed(names: Iterable[str]) -> bool:
    """Whether a name carries activation checkpointing's prefix or FSDP1's ``_flat_param``.

    DCP strips the first from a name and refuses the second.
    """
    prefix, flat = _compat.checkpoint_wrapper_prefix(), _compat.flat_param_name()
    return any(prefix in name or flat in name for name in names)


def _loads_by_itself(model: nn.Module) -> bool:
    """Whether ``model.load_state_dict`` would only copy each value into its tensor.

    True when every module loads with nn.Module's own code (no overridden
    ``_load_from_state_dict`` or ``set_extra_state``), has no load pre-hook, and no load
    post-hook but FSDP2's own (``FSDPParam`` re-derives its sharded views from the
    parameter: nothing to do when the values already are that memory). A hook of anyone
    else may do more than copy, so it is never skipped.
    """
    for module in model.modules():
        kind = type(module)
        pre_hooks, post_hooks = _compat.load_state_dict_hooks(module)
        if (pre_hooks
                or _compat.overrides_load_from_state_dict(kind)
                or kind.set_extra_state is not nn.Module.set_extra_state):
            return False
        for hook in post_hooks.values():
            if not getattr(hook, "__qualname__", "").startswith(
                    _compat.FSDP2_LOAD_HOOK_OWNER):
                return False
    return True


def apply_model_and_optimizer_state(
    model: nn.Module,
    optimizer: Optimizers | None,
    state: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load ``state`` (as built by :func:`model_and_optimizer_state`) into the objects.

    The whole state is checked against the model and optimizer first; nothing is copied
    unless every key is present on both sides with the same shape and dtype.

    Args:
        model: The module to load into.
        optimizer: Its optimizer (or tuple of them), or ``None`` to load the model alone.
        state: ``{"model": ..., "optimizer": ...}``.
        options: The ``StateDictOptions`` the state was captured with.

    Raises:
        IncompatibleCheckpointError: A key is missing or unexpected, or a tensor's shape
            or dtype differs; ``differences`` lists every problem, by key.
    """
    if (optimizer is None and options is None and set(state) == {"model"}
            and isinstance(state["model"], Mapping) and _loads_by_itself(model)):
        own = plain_state_dict(model)  # a plain module: no capture through DCP needed
        if own is not None and _same_memory(state["model"], own):
            return  # read into the model's own tensors: nothing left to copy
    expected = model_and_optimizer_state(model, optimizer, options=options)
    for part in expected:
        if part not in state:
            raise IncompatibleCheckpointError(
                f"state to apply has no {part!r} entry (it has {sorted(state)})",
                path=None,
                differences=[f"missing: {part}"],
            )
    differences = _compare_flat(
        flatten_state({part: state[part] for part in expected}), flatten_state(expected)
    )
    if differences:
        raise _incompatible("the state to apply", differences)
    strict = options if options is not None else StateDictOptions(strict=True)
    inner = _own_keys_root(model) if options is None else None
    if inner is not None and _hook_made(inner, expected["model"]):
        # Keys a state-dict hook made (see hooked_state): the model's own load_state_dict,
        # whose load hooks turn them back into its parameters.
        with torch.no_grad():
            inner.load_state_dict(dict(state["model"]), strict=True)
        if optimizer is not None and not load_named_optimizer_state(
                model, optimizer, state["optimizer"]):
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=strict)
        return
    if (options is None and _loads_by_itself(model)
            and _same_memory(state["model"], expected["model"])):
        # The load wrote into the model's own tensors (the usual restore): copying each
        # into itself would change nothing, and costs a first dispatch of ``copy_`` per
        # shape of sharded parameter in a fresh process. Only the optimizer is applied.
        if optimizer is not None and not load_named_optimizer_state(
                model, optimizer, state["optimizer"]):
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=strict)
        return
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
        options=strict,
    )


def load_model_state(model: nn.Module, state: Mapping[str, Any], *, strict: bool,
                     model_keys: Iterable[str]) -> None:
    """DCP's ``set_model_state_dict(model, state)``, or the model's own load for hook keys.

    Where the model's state dict has keys a state-dict hook made (``model_keys``, as
    :func:`model_state_dict` returned them; see :func:`hooked_state`), DCP cannot name
    them: ``state`` goes to the ``load_state_dict`` of the module inside any DDP or
    ``torch.compile`` wrapper, so the model's load hooks turn it back into its
    parameters. Anything else is DCP's.

    Args:
        model: The module to load into.
        state: ``{canonical name: tensor}``, read into tensors like the model's.
        strict: Every key of the model must be in ``state`` and no other.
        model_keys: The keys of the model's own state (:func:`model_state_dict`).
    """
    inner = _own_keys_root(model)
    if inner is not None and _hook_made(inner, model_keys):
        with torch.no_grad():
            inner.load_state_dict(dict(state), strict=strict)
        return
    set_model_state_dict(model, dict(state), options=StateDictOptions(strict=strict))


def load_named_optimizer_state(model: nn.Module, optimizer: Optimizers,
                               state: Mapping[str, Any]) -> bool:
    """DCP's strict ``set_optimizer_state_dict``, without its walks, where it is the same.

    DCP's function builds the name maps of the whole module tree on every call, then
    hands the optimizer's ``load_state_dict`` the state under canonical names: for each
    of the optimizer's groups, its parameters' names, each parameter that requires a
    gradient with its stored state, and the other entries of the stored group that
    holds the parameter. Where every canonical name is
    the parameter's own name (the rules of :func:`named_state`) and no parameter has
    two names (tied weights: DCP maps them its own way), that same dictionary is built
    here and loaded. Anything else (a state keyed otherwise, a missing entry, a group
    without parameters, a parameter the model does not name) returns False and loads
    nothing: the caller asks DCP, which loads it or says what is wrong.

    Args:
        model: The module the optimizer updates.
        optimizer: The optimizer to load into, or a tuple of them (each takes the state
            of its own parameters and the stored groups that hold them).
        state: ``{"state": {name: ...}, "param_groups": [...]}`` as :func:`named_state`
            (and DCP's ``get_optimizer_state_dict``) returns it.

    Returns:
        Whether the state was loaded.
    """
    stored, stored_groups = state.get("state"), state.get("param_groups")
    if (set(state) != {"state", "param_groups"} or not isinstance(stored, Mapping)
            or not isinstance(stored_groups, list)
            or not all(isinstance(group, Mapping) and isinstance(group.get("params"), list)
                       for group in stored_groups)):
        return False
    names = _own_names(model)
    if names is None:
        return False
    holders = _groups_holding(stored_groups)
    plans: list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []
    for part in optimizer_parts(optimizer):
        plan = _named_load(part, names, stored, stored_groups, holders)
        if plan is None:
            return False
        plans.append((part, plan))
    with torch.no_grad():
        for part, plan in plans:
            part.load_state_dict(plan)
    return True


def _named_load(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                stored: Mapping[str, Any], stored_groups: list[Mapping[str, Any]],
                holders: Mapping[str, list[Mapping[str, Any]]]) -> dict[str, Any] | None:
    """The state dict :func:`load_named_optimizer_state` hands ``optimizer``, or None."""
    loaded: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    index_of: dict[int, int] = {}  # id(stored group) -> the optimizer's group it fills
    for group in optimizer.param_groups:
        if not group["params"]:
            return None
        params: list[str] = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                return None
            params.append(name)
            if param.requires_grad:
                if name not in stored:
                    return None
                loaded[name] = stored[name]
            for stored_group in holders.get(name, ()):
                index_of[id(stored_group)] = len(groups)
        groups.append({"params": params})
    for stored_group in stored_groups:
        if id(stored_group) in index_of:
            groups[index_of[id(stored_group)]].update(
                (key, value) for key, value in stored_group.items() if key != "params")
    return {"state": loaded, "param_groups": groups}


def _groups_holding(groups: list[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """``{parameter name: the stored groups that list it}``."""
    holders: dict[str, list[Mapping[str, Any]]] = {}
    for group in groups:
        for name in group["params"]:
            holders.setdefault(name, []).append(group)
    return holders


def _own_names(model: nn.Module) -> dict[int, str] | None:
    """``{id(parameter): name}`` where each name is DCP's canonical one, else None.

    None when a module is one DCP renames for, a parameter has two names (tied
    weights), or a name carries activation checkpointing's prefix or ``_flat_param``.
    """
    if any(_is_wrapper(module, _renamers()) for module in model.modules()):
        return None
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in names:
            return None
        names[id(param)] = name
    return None if _renamed(names.values()) else names


def _same_memory(given: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether every entry of ``given`` is a tensor over the very memory of ``live``'s.

    Same keys, and for each the same storage address, offset, shape, stride and dtype
    (for a ``DTensor``, of its local shard, with the same placements): loading ``given``
    into the model would copy every tensor onto itself.
    """
    if given.keys() != live.keys():
        return False
    for key, entry in given.items():
        value, have = entry, live[key]
        if not (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)):
            return False
        if isinstance(value, DTensor) != isinstance(have, DTensor):
            return False
        if isinstance(value, DTensor) and isinstance(have, DTensor):
            if value.placements != have.placements or value.shape != have.shape:
                return False
            value, have = value.to_local(), have.to_local()
        if (value.untyped_storage().data_ptr() != have.untyped_storage().data_ptr()
                or value.storage_offset() != have.storage_offset()
                or value.shape != have.shape or value.stride() != have.stride()
                or value.dtype != have.dtype or value.device != have.device):
            return False
    return True


def preallocate_optimizer_state(
    model: nn.Module,
    optimizer: Optimizers,
    directory: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: _CheckedMetadata | None = None,
) -> bool:
    """Give an optimizer that never stepped the state a checkpoint holds, as zeros.

    DCP needs destination tensors for the optimizer state it loads; for an optimizer
    without state its ``get_state_dict`` makes them by running a whole optimizer step at
    learning rate 0 on zero gradients. In a relaunched process that step is the first
    dispatch of every optimizer op on every parameter (for FSDP2's ``DTensor``s: sharding
    propagation of each), the larger part of a small model's restore. The checkpoint's
    metadata already says what each parameter's state is: here each stored tensor of a
    parameter's shape becomes a zero tensor like the parameter (same placement, the
    stored dtype), each stored scalar a zero scalar, and nothing else runs. The load
    then overwrites every value, and the first training step does the ops once.

    Only a layout this covers completely is preallocated: every parameter of the
    optimizer that requires a gradient has stored state, under its canonical name (see
    :func:`canonical_param_name`), and every stored entry is a tensor of that
    parameter's shape or a scalar. Anything else (an optimizer keeping state of another
    shape, a checkpoint without optimizer state, names that do not match) leaves the
    optimizer untouched, and DCP's own initialisation runs as before: the same result,
    at the cost of that step.

    Args:
        model: The module the optimizer updates.
        optimizer: The optimizer (or tuple of them); one that already has state is left
            as it is.
        directory: The checkpoint's ``tensors/`` directory (local path or fsspec URL).
        storage_options: fsspec options for URLs.
        metadata: ``directory``'s ``.metadata``, already read and checked (nothing is read).

    Returns:
        Whether the state was preallocated.

    Raises:
        CheckpointNotFoundError: ``directory`` holds no DCP metadata.
        UnsafeCheckpointError: The metadata would execute code.
    """
    parts = optimizer_parts(optimizer)
    if any(part.state for part in parts):
        return False
    reader = _make_reader(_directory_str(directory), storage_options, metadata=metadata)
    read = reader.read_metadata()
    stored: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, path in (read.planner_data or {}).items():
        if len(path) != 4 or tuple(path[:2]) != ("optimizer", "state"):
            continue
        entry = read.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            return False  # a non-tensor value: DCP's initialisation makes its placeholder
        stored.setdefault(str(path[2]), {})[str(path[3])] = entry
    names = {id(param): canonical_param_name(name)
             for name, param in model.named_parameters(remove_duplicate=False)}
    plan: list[tuple[torch.optim.Optimizer, torch.Tensor,
                     dict[str, TensorStorageMetadata]]] = []
    for part in parts:
        for group in part.param_groups:
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                entries = stored.get(names.get(id(param), ""))
                if not entries or not all(tuple(entry.size) in ((), tuple(param.shape))
                                          for entry in entries.values()):
                    return False
                plan.append((part, param, entries))
    if not plan:
        return False
    for part, param, entries in plan:
        part.state[param] = {
            name: (torch.zeros((), dtype=entry.properties.dtype) if tuple(entry.size) == ()
                   else _zeros_like(param, entry.properties.dtype))
            for name, entry in entries.items()}
    return True


def _zeros_like(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped and placed like ``param``; a ``DTensor`` without a sharding dispatch.

    A ``DTensor``'s zeros are its local shard's zeros (the stored dtype) under its mesh,
    placements, global shape and stride, through DTensor's public ``from_local`` with
    ``run_check=False``: no collective and no sharding propagation of ``zeros_like``.
    """
    with torch.no_grad():
        if isinstance(param, DTensor):
            return DTensor.from_local(torch.zeros_like(param.to_local(), dtype=dtype),
                                      param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


def without_param_names(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optimizer": ...}``) whose optimizer groups lack ``param_names``.

    The destination of a restore: a group's ``param_names`` is never read from a
    checkpoint (see :data:`resumekit.tensors.fit.PARAM_NAMES`), so a checkpoint restores
    into an optimizer built with names (torchtitan's) or without, whichever wrote it.
    """
    optimizer = state.get("optimizer")
    if not isinstance(optimizer, Mapping) or not isinstance(
            optimizer.get("param_groups"), list):
        return dict(state)
    groups = [{key: value for key, value in group.items() if key != _PARAM_NAMES}
              if isinstance(group, Mapping) else group for group in optimizer["param_groups"]]
    return {**state, "optimizer": {**optimizer, "param_groups": groups}}


def find_tied(model_state: Mapping[str, Any]) -> dict[str, str]:
    """Name the tensors of a model state dict that are another tensor of it (tied weights).

    nanoGPT ties ``lm_head.weight`` to ``transformer.wte.weight``: the model's state dict
    lists both names over one storage. Two entries are tied when they view the same
    memory the same way (storage, offset, shape, stride, dtype; for a ``DTensor`` its
    local shard, with the same placements). The first name in state-dict order is kept.

    Args:
        model_state: ``{name: tensor}`` as ``get_model_state_dict`` returns it.

    Returns:
        ``{alias: kept name}``, empty when nothing is tied.
    """
    with torch.no_grad():
        return _find_tied(model_state)


def _find_tied(model_state: Mapping[str, Any]) -> dict[str, str]:
    seen: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    plain = (torch.Tensor, nn.Parameter)
    key: tuple[Any, ...]
    for name, value in model_state.items():
        if type(value) in plain:
            # The address of its first element stands for (storage, offset): the same
            # memory viewed the same way, without a storage object per tensor.
            if value.numel() == 0:
                continue
            key = (value.data_ptr(), value.shape, value.stride(), value.dtype,
                   value.device)
            kept = seen.get(key)
            if kept is None:
                seen[key] = name
            else:
                tied[name] = kept
            continue
        if not isinstance(value, torch.Tensor):
            continue
        # A DTensor's local shard itself: ``to_local()`` under no_grad (entered once, for
        # the whole state: a context per tensor cost as much as the rest of the loop) hands
        # it out as it is (with grad mode on it is a view through an autograd call).
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.numel() == 0:
            continue
        key = (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype,
               local.device, tuple(value.placements) if isinstance(value, DTensor) else None,
               tuple(value.shape))
        kept = seen.get(key)
        if kept is None:
            seen[key] = name
        else:
            tied[name] = kept
    return tied


def untie(state: Mapping[str, Any], tied: Mapping[str, str]) -> dict[str, Any]:
    """Return ``state`` (``{"model": ..., ...}``) without the model entries in ``tied``.

    The copy is shallow: tensors are the same objects, so a load into it lands in the
    model. Only aliases whose kept name is present are dropped.
    """
    model = state.get("model")
    if not tied or not isinstance(model, Mapping):
        return dict(state)
    kept = {k: v for k, v in model.items() if not (k in tied and tied[k] in model)}
    return {**state, "model": kept}


def retie(state: Mapping[str, Any], tied: Mapping[str, str]) -> dict[str, Any]:
    """Undo :func:`untie`: every alias in ``tied`` reads its kept name's tensor again."""
    model = state.get("model")
    if not tied or not isinstance(model, Mapping):
        return dict(state)
    full = dict(model)
    for alias, kept in tied.items():
        if kept in full:
            full[alias] = full[kept]
    return {**state, "model": full}


# The wrapper atoms of the parameter names older resumekit versions wrote into fingerprints:
# fixed history, not DCP's rules, so they do not follow torch. Where the same function names
# a live model's parameters (preallocate_optimizer_state), a name it gets wrong matches no
# stored entry, and DCP's own initialisation runs instead: slower, never wrong.
_WRAPPER_ATOMS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def canonical_param_name(name: str) -> str:
    """A parameter name as DCP's ``get_state_dict`` writes it, without wrapper atoms.

    ``module.`` (DDP), ``_orig_mod.`` (``torch.compile``) and the FSDP1 / activation
    checkpointing wrapper atoms are removed, so ``module._orig_mod.0.weight`` becomes
    ``0.weight``. Used for fingerprints written before they held canonical names.
    """
    atoms = [atom for atom in name.split(".") if atom not in _WRAPPER_ATOMS]
    return ".".join(atoms) if atoms else name


def apply_full_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load full (unsharded) weights, as every rank holds them, into a model.

    For importing weights-only checkpoints (safetensors exports, legacy directories):
    each tensor is cast to the dtype of the model's own tensor of that name (exports are
    often bf16 while training keeps fp32 masters) and, for FSDP2, sharded like it.
    Everything is checked before anything is copied.

    Args:
        model: The module (plain, DDP or FSDP2) to load into.
        state: ``{fully qualified name: full tensor}``, the same on every rank.

    Raises:
        IncompatibleCheckpointError: A name is missing or unexpected, a value is not a
            tensor, or a shape differs; ``differences`` lists every problem, by name.
    """
    expected: dict[str, Any] = dict(get_model_state_dict(model))
    differences = [f"missing: {key}" for key in expected if key not in state]
    differences += [f"unexpected: {key}" for key in state if key not in expected]
    cast_state: dict[str, Any] = {}
    for key, want in expected.items():
        if key not in state:
            continue
        have: Any = state[key]
        if not isinstance(want, torch.Tensor):  # a module's non-tensor extra state
            cast_state[key] = have
        elif isinstance(have, torch.Tensor) and tuple(have.shape) == tuple(want.shape):
            cast_state[key] = have.detach().to(dtype=want.dtype)
        else:
            differences.append(
                f"{key}: model has {_describe(want)}, weights have {_describe(have)}"
            )
    if differences:
        raise _incompatible("the weights to load", differences)
    set_model_state_dict(
        model, cast_state, options=StateDictOptions(full_state_dict=True, strict=True)
    )
