"""Convert another tool's checkpoint into one committed resumekit checkpoint.

``resumekit import SRC ROOT`` (:func:`import_checkpoint`) reads a checkpoint written by
torch DCP (``dcp.save``), torchtitan (``step-N``), Accelerate (``save_state``), Lightning
(``.ckpt``), the Hugging Face ``Trainer`` (``checkpoint-N``) or LingBot-VA upstream
(``checkpoint_step_N``), and writes what a :class:`~resumekit.CheckpointManager` save of
the same model and optimizer would have written, through the same commit protocol
(:class:`~resumekit.store.commit.CommitProtocol`) and on-disk layout, with manifest reason
``imported`` and the source in ``lineage.imported_from``. ``CheckpointManager(ROOT,
model=..., optimizer=...).restore()`` then loads it like any other checkpoint.

One small function per format (``_from_dcp``, ``_from_accelerate``, ``_from_lightning``,
``_from_hf_trainer``, ``_from_lingbot``) turns the source into the state dicts
:class:`~resumekit.state.train_state.TrainState` stores: the model keyed by fully qualified
parameter
names, the optimizer in ``torch.distributed.checkpoint.state_dict.get_state_dict`` form
(``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``). Tensors
keep their stored dtype and bytes: nothing is cast, so a restore is bit for bit.

Optimizer state keyed by parameter index (``optimizer.state_dict()``, as Accelerate,
Lightning and the HF Trainer save it) is mapped to names with the order the optimizer
was built in. That order is taken, in this order of preference, from:

1. the ``model`` passed to :func:`import_checkpoint` (its ``named_parameters()``);
2. for the HF Trainer, the architecture named in ``config.json`` built on the ``meta``
   device (no weights, no download; refused for ``auto_map`` remote code);
3. the source's own model state dict when its order survives (Lightning ``.ckpt``,
   ``pytorch_model.bin``, DCP): parameters come in ``named_parameters()`` order there,
   which is the assumption - a model with buffers breaks it, and the counts then differ;
4. safetensors files do not keep the order (keys are sorted): parameters are then matched
   by shape, only where every shape is unique.

The assumption is that the optimizer was built as ``AdamW(model.parameters())`` (one
group) or, for the HF Trainer, with its two groups (weight decay, then no decay, each in
``named_parameters()`` order). Every mapped tensor is checked against its parameter's
shape; a count or shape that does not fit raises, naming the file.

What is not carried over (RNG streams, data position, and the scheduler where the source
has none) is named in one warning: an imported checkpoint is a warm restart, not an exact
replay of the source run.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load as load_safetensors_bytes
from torch import nn

from resumekit import tensors as tensor_io
from resumekit._optional import missing, require
from resumekit.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MissingDependencyError,
    UnsafeCheckpointError,
)
from resumekit.state import jsonable, rng
from resumekit.state.train_state import dump_plain
from resumekit.store.commit import CommitProtocol
from resumekit.store.foreign import FOREIGN_FORMATS, detect_foreign
from resumekit.store.layout import (
    DEFAULT_NAME_FORMAT,
    LEGACY_NAME_FORMAT,
    LIGHTNING_CHECKPOINT_FILE,
    TENSORS_DIR,
    TRAIN_STATE_FILE,
    NameFormat,
    checked_step,
    rank_state_file,
)
from resumekit.store.manifest import FileEntry, Lineage, Manifest, SaveReason
from resumekit.store.storage import Storage
from resumekit.tools import legacy
from resumekit.tools.export import NOT_MODEL_KEYS
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["IMPORT_FORMATS", "ImportResult", "import_checkpoint"]

#: Every value of ``--format`` (``auto`` detects the others from their own files).
IMPORT_FORMATS: tuple[str, ...] = ("auto", *FOREIGN_FORMATS, "lingbot")

_OPTIMIZER_KEYS = ("optimizer", "optim", "opt", "optimizers")
_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_checkpoint` committed.

    Attributes:
        step: The step of the new checkpoint.
        path: Its directory (or URL).
        source: The source as given.
        format: The source format (detected or given).
        tensors: Number of tensors written (model and optimizer).
        carried: What was carried over (``model``, ``optimizer``, ``scheduler``, ``step``).
        not_carried: What the source held or the run needs that was not carried over.
    """

    step: int
    path: str
    source: str
    format: str
    tensors: int
    carried: list[str] = field(default_factory=list)
    not_carried: list[str] = field(default_factory=list)


@dataclass
class _Source:
    """A foreign checkpoint read into resumekit's form."""

    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    step: int | None = None
    not_carried: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    """JSON data the source holds that resumekit keeps as ``extras`` (torchtitan's
    ``train_state`` beyond its step); the caller's ``extras`` win over it."""
    lightning: dict[str, Any] | None = None
    """A Lightning ``.ckpt``'s dict without its weights and optimizer states: kept as
    ``lightning.ckpt`` so that ``ResumekitCheckpointIO`` resumes the run (loops,
    callbacks) where Lightning left it."""


# --------------------------------------------------------------------------- entry point


def import_checkpoint(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    format: str = "auto",
    step: int | None = None,
    model: nn.Module | None = None,
    name_format: str = DEFAULT_NAME_FORMAT,
    config: Mapping[str, Any] | None = None,
    extras: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ImportResult:
    """Convert the checkpoint at ``src`` into one committed checkpoint under ``root``.

    Runs in one process (no process group). The result restores with
    ``CheckpointManager(root, model=..., optimizer=...).restore()``: weights and optimizer
    moments equal the source's bit for bit.

    Args:
        src: The foreign checkpoint: a directory (DCP, torchtitan ``step-N``, Accelerate,
            HF ``checkpoint-N``, LingBot ``checkpoint_step_N``) or a Lightning ``.ckpt``
            file. Recorded in the manifest as given.
        root: The resumekit checkpoint root to write into (created if needed).
        format: ``auto`` (detect from the source's own files) or one of
            :data:`IMPORT_FORMATS`.
        step: The step of the new checkpoint. Required when the source records none
            (Accelerate, plain DCP); overrides (with a warning) the one it records.
        model: The model the checkpoint belongs to, used only for its parameter order
            (``named_parameters()``) when the source keys optimizer state by index.
        name_format: Step-directory names of ``root`` (as for the manager).
        config: The run configuration the manager will be built with (its fingerprint).
        extras: JSON user data stored in the manifest (``manager.extras`` after restore).
        storage_options: fsspec options for ``src`` and ``root``.

    Returns:
        What was committed.

    Raises:
        ConfigurationError: Unknown format, no step known, or the source is ambiguous.
        CheckpointNotFoundError: ``src`` does not exist or holds no checkpoint of the
            format.
        IncompatibleCheckpointError: The optimizer state cannot be mapped to the
            parameters (counts or shapes differ).
        StepCollisionError: ``root`` already holds a committed checkpoint at this step or
            newer.
    """
    options = dict(storage_options or {})
    given = os.fspath(src)
    if format not in IMPORT_FORMATS:
        raise ConfigurationError(
            f"format {format!r} is not one of {', '.join(IMPORT_FORMATS)}",
            name="format", value=format,
        )
    if step is not None and step < 0:
        raise ConfigurationError(f"step must be >= 0, got {step}", name="step", value=step)
    jsonable.check_depth(config or {}, what="config")
    jsonable.check_depth(extras or {}, what="extras")
    parent, name = _split(given, options)
    if not parent.exists(name):
        raise CheckpointNotFoundError(f"{parent.path(name)} does not exist",
                                      path=parent.path(name))
    form = _detect(parent, name) if format == "auto" else format
    reader = _READERS[form]
    source = reader(parent, name, model)
    final_step = _final_step(source.step, step, parent.path(name), form)
    carried = ["model"] + (["optimizer"] if source.optimizer is not None else []) + (
        ["scheduler"] if source.scheduler is not None else []) + (
        ["step"] if source.step is not None and step is None else []) + (
        [f"extras {sorted(source.extras)}"] if source.extras else [])
    not_carried = [*source.not_carried, "RNG streams", "data position"]
    if source.scheduler is None:
        not_carried.append("LR scheduler")
    committed = _write(
        Storage(os.fspath(root), options), NameFormat(name_format), source, final_step,
        imported_from={"path": given, "format": form}, config=config,
        extras={**source.extras, **dict(extras or {})},
    )
    message = (
        f"imported {form} checkpoint {given} as step {final_step} ({committed}): carried "
        f"over {', '.join(carried)}; NOT carried over: {', '.join(not_carried)} - a resume "
        "from it continues training but does not replay the source run exactly"
    )
    warn(message, ResumekitWarning, stacklevel=2)
    tensors = len(tensor_io.flatten_state({"model": source.model,
                                    "optimizer": source.optimizer or {}}))
    return ImportResult(step=final_step, path=committed, source=given, format=form,
                        tensors=tensors, carried=carried, not_carried=not_carried)


def _split(url: str, options: dict[str, Any]) -> tuple[Storage, str]:
    trimmed = url.rstrip("/") or url
    if "://" in trimmed:
        protocol, rest = trimmed.split("://", 1)
        head, _, tail = rest.rpartition("/")
        return Storage(f"{protocol}://{head}", options), tail
    absolute = os.path.abspath(trimmed)
    return Storage(os.path.dirname(absolute), options), os.path.basename(absolute)


def _detect(parent: Storage, name: str) -> str:
    found = detect_foreign(parent, name)
    if found is not None:
        return found.format
    if parent.is_dir(name) and NameFormat(LEGACY_NAME_FORMAT).parse(name) is not None:
        return "lingbot"
    raise CheckpointNotFoundError(
        f"{parent.path(name)} is not a checkpoint resumekit can import: no DCP .metadata, "
        "Accelerate optimizer.bin/random_states_*.pkl, HF trainer_state.json, Lightning "
        ".ckpt or LingBot checkpoint_step_N found (pass --format to say which it is)",
        path=parent.path(name),
    )


def _final_step(recorded: int | None, given: int | None, where: str, form: str) -> int:
    if given is None:
        if recorded is None:
            raise ConfigurationError(
                f"{where}: this {form} checkpoint records no step; pass the step it was taken "
                "after with --step N (import_checkpoint(..., step=N))",
                name="step", value=None, path=where,
            )
        return checked_step(recorded, source=where, key="step")  # the name's, too
    if recorded is not None and recorded != given:
        message = (f"{where} records step {recorded}; importing it as step {given} as "
                   "asked (--step)")
        warn(message, ResumekitWarning, stacklevel=3)
    return given


# --------------------------------------------------------------------------- writing


def _write(storage: Storage, name_format: NameFormat, source: _Source, step: int, *,
           imported_from: dict[str, str], config: Mapping[str, Any] | None,
           extras: Mapping[str, Any] | None) -> str:
    """Commit ``source`` as checkpoint ``step``: the files a single-process save writes."""
    tensors: dict[str, Any] = {"model": source.model}
    if source.optimizer is not None:
        tensors["optimizer"] = source.optimizer
    train = dump_plain({"step": step, "micro_step": 0, "world_size": 1,
                        "scheduler": source.scheduler},
                       what=f"training state of imported step {step}")
    ranks = dump_plain({"rng": _fresh_rng(), "data": None},
                       what=f"rank 0 state of imported step {step}")
    params: dict[str, Any] = {key: [list(value.shape), str(value.dtype).removeprefix("torch.")]
              for key, value in source.model.items() if isinstance(value, torch.Tensor)}
    manifest = Manifest(
        step=step, world_size=1, reason=SaveReason.IMPORTED,
        lineage=Lineage.current().model_copy(update={"imported_from": imported_from}),
        extras=json.loads(json.dumps(dict(extras or {}))),
        state={"model": True, "optimizer": source.optimizer is not None,
               "scheduler": source.scheduler is not None, "data": False,
               "generators": [], "micro_step": 0,
               **({"lightning_file": LIGHTNING_CHECKPOINT_FILE}
                  if source.lightning is not None else {})},
        fingerprint={"config": json.loads(json.dumps(dict(config or {}))), "params": params},
    )
    protocol = CommitProtocol(storage, name_format)
    pending = protocol.begin(step)
    try:
        written = tensor_io.save(tensors, storage.url_of(f"{pending.staging}/{TENSORS_DIR}"),
                               storage_options=storage.storage_options or None)
        storage.write_bytes(f"{pending.staging}/{TRAIN_STATE_FILE}", train)
        storage.write_bytes(f"{pending.staging}/{rank_state_file(0)}", ranks)
        if source.lightning is not None:
            storage.write_bytes(f"{pending.staging}/{LIGHTNING_CHECKPOINT_FILE}", dump_plain(
                source.lightning, what=f"Lightning trainer state of imported step {step}"))
        described = [FileEntry(path=f"{TENSORS_DIR}/{file.name}", size=file.size,
                               checksum=file.checksum) for file in written]
        protocol.publish(pending, manifest, described=described)
    except BaseException:
        protocol.abort(pending)
        raise
    protocol.record_newest(pending)
    return storage.path(pending.name)


def _fresh_rng() -> dict[str, Any]:
    """RNG streams of a fresh start seeded with 0 (the source's streams are not kept)."""
    with _rng_preserved():
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        return rng.capture_rng()


@contextmanager
def _rng_preserved() -> Iterator[None]:
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


# --------------------------------------------------------------------------- reading files


def _load_pickle(storage: Storage, relative: str) -> Any:
    """``torch.load(weights_only=True)`` of a source file: never runs code from it."""
    where = storage.path(relative)
    data = storage.read_bytes(relative)
    try:
        return torch.load(_bytes_io(data), weights_only=True, map_location="cpu")
    except Exception as error:
        raise UnsafeCheckpointError(
            f"{where} cannot be read safely with torch.load(weights_only=True) (it holds "
            f"objects that would need unrestricted unpickling, or is corrupt): {error}",
            path=where, file=relative,
        ) from error


def _bytes_io(data: bytes) -> Any:
    import io  # noqa: PLC0415 - tiny helper

    return io.BytesIO(data)


def _load_weights(storage: Storage, name: str, stems: Sequence[str]
                  ) -> tuple[dict[str, torch.Tensor], bool]:
    """Read model weights saved as ``<stem>.safetensors`` (maybe split) or ``<stem>.bin``.

    Returns:
        ``(weights, ordered)``: ordered is False for safetensors (its keys are sorted).
    """
    files = {info.name for info in storage.list_dir(name) if not info.is_dir}
    for stem in stems:
        if f"{stem}.safetensors" in files:
            relative = f"{name}/{stem}.safetensors"
            try:
                return dict(load_safetensors_bytes(storage.read_bytes(relative))), False
            except Exception as error:
                raise CorruptCheckpointError(
                    f"{storage.path(relative)}: not a readable safetensors file ({error})",
                    path=storage.path(name), file=relative,
                ) from error
        if f"{stem}.safetensors.index.json" in files:
            return legacy.read_full_weights(storage, name), False
        for suffix in (".bin", ".pt", ".pth"):
            if f"{stem}{suffix}" in files:
                loaded = _load_pickle(storage, f"{name}/{stem}{suffix}")
                if not isinstance(loaded, Mapping):
                    raise CorruptCheckpointError(
                        f"{storage.path(f'{name}/{stem}{suffix}')}: expected a state dict",
                        path=storage.path(name), file=f"{stem}{suffix}")
                return dict(loaded), True
    raise CheckpointNotFoundError(
        f"{storage.path(name)} holds no model weights ({' or '.join(stems)} as "
        ".safetensors or .bin)", path=storage.path(name),
    )


# --------------------------------------------------------------------------- optimizer keys


def _by_index(optimizer: Mapping[str, Any]) -> bool:
    state = optimizer.get(_STATE, {})
    groups = optimizer.get(_GROUPS, [])
    keys = [*state, *(p for group in groups for p in group.get(_PARAMS, []))]
    return bool(keys) and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit())
                              for k in keys)


def _optimizer_by_fqn(
    optimizer: Mapping[str, Any], names: Sequence[str], shapes: Mapping[str, Sequence[int]],
    *, where: str, hint: str,
) -> dict[str, Any]:
    """Re-key an ``optimizer.state_dict()`` (by index) by parameter name.

    ``names`` are the parameters in the order the optimizer's groups list them (index
    ``i`` of the concatenated groups is ``names[i]``).
    """
    groups = list(optimizer.get(_GROUPS, []))
    order = [int(p) for group in groups for p in group.get(_PARAMS, [])]
    if len(order) != len(names):
        raise IncompatibleCheckpointError(
            f"{where}: the optimizer holds {len(order)} parameters but {len(names)} "
            f"parameter names were found ({hint}); nothing was imported",
            path=where, differences=[f"optimizer parameters: {len(order)}",
                                     f"model parameters: {len(names)}"],
        )
    by_index = dict(zip(order, names, strict=True))
    problems: list[str] = []
    state: dict[str, Any] = {}
    for index, values in optimizer.get(_STATE, {}).items():
        fqn = by_index.get(int(index))
        if fqn is None:
            problems.append(f"state of parameter {index} has no parameter in any group")
            continue
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and list(value.shape) != list(shapes[fqn]):
                problems.append(f"{fqn}.{key}: optimizer has {list(value.shape)}, parameter "
                                f"has {list(shapes[fqn])}")
        state[fqn] = dict(values)
    if problems:
        raise IncompatibleCheckpointError(
            f"{where}: the optimizer state does not fit the parameters in the order assumed "
            f"({hint}; nothing was imported): " + "; ".join(problems[:10]),
            path=where, differences=problems,
        )
    param_groups = [{**{k: v for k, v in group.items() if k != _PARAMS},
                     _PARAMS: [by_index[int(p)] for p in group.get(_PARAMS, [])]}
                    for group in groups]
    return {_STATE: state, _GROUPS: param_groups}


def _names_by_shape(optimizer: Mapping[str, Any], model_state: Mapping[str, Any],
                    *, where: str) -> list[str]:
    """Parameter names in optimizer index order, from shapes alone, where they are unique."""
    candidates: dict[tuple[int, ...], list[str]] = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            candidates.setdefault(tuple(value.shape), []).append(key)
    groups = optimizer.get(_GROUPS, [])
    order = [int(p) for group in groups for p in group.get(_PARAMS, [])]
    state = {int(k): v for k, v in optimizer.get(_STATE, {}).items()}
    names: list[str] = []
    for index in order:
        shapes = {tuple(v.shape) for v in state.get(index, {}).values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0}
        matches = candidates.get(next(iter(shapes)), []) if len(shapes) == 1 else []
        if len(matches) != 1 or len(order) != sum(map(len, candidates.values())):
            raise ConfigurationError(
                f"{where}: the model weights are stored in safetensors, which does not keep "
                "the parameter order, and the optimizer's parameters cannot be told apart by "
                f"shape (parameter {index}: {len(matches)} weights of its shape); import "
                "with the model: resumekit import ... --model MODULE:FACTORY, or from Python "
                "resumekit.import_checkpoint(src, root, model=model, ...)",
                name="model", value=None, path=where,
            )
        names.append(matches[0])
    return names


def _parameter_names(model: nn.Module | None, ordered: Mapping[str, Any] | None,
                     count: int) -> list[str] | None:
    """Parameter names in ``named_parameters()`` order, from the model or an ordered dict."""
    if model is not None:
        every = [name for name, _ in model.named_parameters()]
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        return trainable if len(trainable) == count else every
    if ordered is not None:
        return [k for k, v in ordered.items() if isinstance(v, torch.Tensor)]
    return None


def _map_optimizer(optimizer: Mapping[str, Any], model_state: Mapping[str, Any], *,
                   model: nn.Module | None, ordered: bool, where: str) -> dict[str, Any]:
    count = sum(len(g.get(_PARAMS, [])) for g in optimizer.get(_GROUPS, []))
    names = _parameter_names(model, model_state if ordered else None, count)
    hint = ("order of model.named_parameters()" if model is not None else
            "order of the source's model state dict; a model with buffers or tied weights "
            "breaks it: import from Python with model=")
    if names is None:
        names = _names_by_shape(optimizer, model_state, where=where)
        hint = "matched by shape"
    shapes = {k: list(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    if model is not None:
        shapes.update({n: list(p.shape) for n, p in model.named_parameters()})
    missing = [n for n in names if n not in shapes]
    if missing:
        raise IncompatibleCheckpointError(
            f"{where}: parameters {missing[:5]} of the model are not in the source's weights",
            path=where, differences=[f"missing: {n}" for n in missing])
    return _optimizer_by_fqn(optimizer, names, shapes, where=where, hint=hint)


# --------------------------------------------------------------------------- formats


def _from_dcp(storage: Storage, name: str, model: nn.Module | None) -> _Source:
    """Plain ``dcp.save`` or torchtitan ``step-N``: model at ``model`` or the top level.

    torchtitan's checkpointer writes the model's own state-dict keys at the top level (a
    fused ``wqkv`` saved as ``wq/wk/wv`` by its hooks), ``optimizer`` in its containers'
    flat form keyed by parameter name (``state.<name>.<entry>``, ``param_groups.<name>.
    <hyperparameter>``: the fused parameter's own name), ``lr_scheduler``
    (``{"last_epoch": N}``, what its ``LRSchedulersContainer`` loads), ``train_state``
    (``step``, ``ntokens_seen``) and ``dataloader``. The scheduler entry becomes the
    checkpoint's scheduler state, ``train_state``'s step the step (checked against the
    directory's) and its other entries ``extras["train_state"]``; the data loader's
    state (per-rank pickles of torchtitan's loader) is not carried.
    """
    where = storage.path(name)
    full = tensor_io.read_full_state(storage.url_of(name), storage.storage_options or None)
    if isinstance(full.get("model"), Mapping):
        weights = dict(full["model"])
    else:  # torchtitan: the model's keys at the top level, next to optimizer & co.
        weights = {k: v for k, v in full.items()
                   if k not in NOT_MODEL_KEYS and isinstance(v, torch.Tensor)}
    if not weights:
        raise CheckpointNotFoundError(f"{where} holds no model tensors (top-level keys: "
                                      f"{sorted(full)})", path=where)
    optimizer: dict[str, Any] | None = None
    key = next((k for k in _OPTIMIZER_KEYS if isinstance(full.get(k), Mapping)), None)
    if key is not None:
        raw = dict(full[key])
        if _STATE not in raw and any(k.startswith((f"{_STATE}.", f"{_GROUPS}."))
                                     for k in raw):
            raw = _unflatten_optimizer(raw, _flat_parameter_names(raw) or list(weights),
                                       where=where)
        optimizer = _map_optimizer(raw, weights, model=model, ordered=True, where=where) \
            if _by_index(raw) else raw
    found = detect_foreign(storage, name)
    step = None if found is None else found.step
    scheduler, step, extras = _torchtitan_progress(full, step, where=where)
    carried = {key, "lr_scheduler" if scheduler is not None else None,
               "train_state" if "train_state" in full else None}
    not_carried = [f"the {k!r} entry" for k in sorted(full)
                   if k in NOT_MODEL_KEYS and k not in carried]
    return _Source(weights, optimizer, scheduler, step, not_carried, extras=extras)


def _flat_parameter_names(flat: Mapping[str, Any]) -> list[str]:
    """The parameter names of a flat optimizer state, in the order its groups list them.

    Each ``param_groups.<name>.<hyperparameter>`` key ends in one hyperparameter (a Python
    name, no dot), so what lies between is exactly a parameter's name, whatever the
    model's state dict calls its tensors (a fused parameter torchtitan saves split).
    """
    names: dict[str, None] = {}
    for key in flat:
        kind, _, rest = key.partition(".")
        if kind == _GROUPS and "." in rest:
            names.setdefault(rest.rsplit(".", 1)[0])
    return list(names)


def _torchtitan_progress(full: Mapping[str, Any], step: int | None, *, where: str
                         ) -> tuple[dict[str, Any] | None, int | None, dict[str, Any]]:
    """The ``lr_scheduler`` and ``train_state`` torchtitan writes: (scheduler, step, extras)."""
    scheduler = full.get("lr_scheduler")
    scheduler = dict(scheduler) if isinstance(scheduler, Mapping) and scheduler else None
    train = full.get("train_state")
    if not isinstance(train, Mapping):
        return scheduler, step, {}
    recorded = train.get("step")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        if step is not None and recorded != step:
            raise CorruptCheckpointError(
                f"{where}: its train_state records step {recorded}, its name step {step}",
                path=where, key="train_state.step")
        step = recorded
    rest = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            for k, v in train.items() if k != "step"}
    try:
        extras = {"train_state": json.loads(json.dumps(rest))} if rest else {}
    except (TypeError, ValueError):
        extras = {}
    return scheduler, step, extras


def _unflatten_optimizer(flat: Mapping[str, Any], names: Sequence[str], *, where: str
                         ) -> dict[str, Any]:
    """Undo ``StateDictOptions(flatten_optimizer_state_dict=True)`` (torchtitan).

    Keys are ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``;
    parameters with equal hyperparameters form one group, in model order.
    """
    by_length = sorted(names, key=len, reverse=True)

    def split(rest: str) -> tuple[str, str]:
        for fqn in by_length:
            if rest.startswith(f"{fqn}."):
                return fqn, rest[len(fqn) + 1:]
        raise CorruptCheckpointError(
            f"{where}: optimizer entry {rest!r} names no parameter of the model",
            path=where, key=rest)

    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn, leaf = split(rest)
        (state if kind == _STATE else hyper).setdefault(fqn, {})[leaf] = value
    groups: list[dict[str, Any]] = []
    for fqn in names:
        if fqn not in hyper:
            continue
        for group in groups:
            if {k: v for k, v in group.items() if k != _PARAMS} == hyper[fqn]:
                group[_PARAMS].append(fqn)
                break
        else:
            groups.append({**hyper[fqn], _PARAMS: [fqn]})
    return {_STATE: {fqn: state[fqn] for fqn in names if fqn in state}, _GROUPS: groups}


def _from_accelerate(storage: Storage, name: str, model: nn.Module | None) -> _Source:
    """``Accelerator.save_state``: model.safetensors, optimizer.bin, scheduler.bin."""
    where = storage.path(name)
    files = {info.name for info in storage.list_dir(name) if not info.is_dir}
    extra_models = sorted(f for f in files if re.fullmatch(r"(model|pytorch_model)_\d+\..+", f))
    if extra_models:
        raise ConfigurationError(
            f"{where} holds several models ({extra_models[0]} ...); resumekit imports "
            "a checkpoint of one model", name="src", value=where, path=where)
    weights, ordered = _load_weights(storage, name, ("model", "pytorch_model"))
    optimizer = None
    if "optimizer.bin" in files:
        raw = _load_pickle(storage, f"{name}/optimizer.bin")
        optimizer = _map_optimizer(raw, weights, model=model, ordered=ordered,
                                   where=storage.path(f"{name}/optimizer.bin"))
    scheduler = _load_pickle(storage, f"{name}/scheduler.bin") \
        if "scheduler.bin" in files else None
    not_carried = [f for f in sorted(files) if f.startswith(("sampler", "custom_checkpoint"))]
    return _Source(weights, optimizer, scheduler, None, not_carried)


def _from_lightning(storage: Storage, name: str, model: nn.Module | None) -> _Source:
    """A Lightning ``.ckpt``: state_dict, optimizer_states, lr_schedulers, global_step."""
    relative = name
    if storage.is_dir(name):
        found = sorted(i.name for i in storage.list_dir(name) if i.name.endswith(".ckpt"))
        if len(found) != 1:
            raise ConfigurationError(
                f"{storage.path(name)} holds {len(found)} .ckpt files ({', '.join(found)}); "
                "pass the one to import", name="src", value=storage.path(name))
        relative = f"{name}/{found[0]}"
    where = storage.path(relative)
    checkpoint = _load_pickle(storage, relative)
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"),
                                                             Mapping):
        raise CorruptCheckpointError(f"{where} is not a Lightning checkpoint (no state_dict)",
                                     path=where, file=relative)
    weights = dict(checkpoint["state_dict"])
    optimizers = list(checkpoint.get("optimizer_states") or [])
    schedulers = list(checkpoint.get("lr_schedulers") or [])
    if len(optimizers) > 1 or len(schedulers) > 1:
        raise ConfigurationError(
            f"{where} holds {len(optimizers)} optimizers and {len(schedulers)} schedulers; "
            "resumekit imports one of each", name="src", value=where, path=where)
    optimizer = _map_optimizer(optimizers[0], weights, model=model, ordered=True,
                               where=where) if optimizers else None
    step = checkpoint.get("global_step")
    not_carried = ["epoch and batch position (loops: the epoch's data restarts)",
                   "callbacks' state (both kept in lightning.ckpt for a resume through "
                   "resumekit.integrations.lightning.ResumekitCheckpointIO)"]
    rest = {key: value for key, value in checkpoint.items() if key not in
            ("state_dict", "optimizer_states")}
    return _Source(weights, optimizer, schedulers[0] if schedulers else None,
                   None if step is None else checked_step(step, source=where, key="global_step"),
                   not_carried, lightning=rest)


def _from_hf_trainer(storage: Storage, name: str, model: nn.Module | None) -> _Source:
    """HF ``Trainer`` ``checkpoint-N``: model.safetensors, optimizer.pt, scheduler.pt."""
    where = storage.path(name)
    files = {info.name for info in storage.list_dir(name) if not info.is_dir}
    weights, ordered = _load_weights(storage, name, ("model", "pytorch_model"))
    optimizer = None
    if "optimizer.pt" in files:
        raw = _load_pickle(storage, f"{name}/optimizer.pt")
        reference = model if model is not None \
            else _hf_meta_model(storage, name, weights)
        optimizer = _hf_optimizer(raw, weights, reference, ordered=ordered,
                                  where=storage.path(f"{name}/optimizer.pt"))
    scheduler = _load_pickle(storage, f"{name}/scheduler.pt") \
        if "scheduler.pt" in files else None
    step = None
    if "trainer_state.json" in files:
        state_file = f"{name}/trainer_state.json"
        try:
            recorded = storage.read_json(state_file)["global_step"]
        except UnsafeCheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptCheckpointError(
                f"{where}/trainer_state.json: no readable global_step ({error})",
                path=where, file="trainer_state.json") from error
        step = checked_step(recorded, source=storage.path(state_file), key="global_step")
    not_carried = ["trainer_state.json (epoch, log history, best metric)"]
    return _Source(weights, optimizer, scheduler, step, not_carried)


#: Keys of a model config that count modules to build (layers, experts): each one stored
#: holds at least one tensor, so the count cannot exceed the tensors of the weight files.
_MODULE_COUNT = re.compile(r"^(n|num|encoder|decoder)_(\w+_)?(layers?|experts)$")
#: Keys that size a tensor dimension: it cannot exceed the elements of the weight files.
_DIMENSION = re.compile(r"_size$")


def _check_config_sizes(config: Mapping[str, Any], weights: Mapping[str, Any],
                        source: str) -> None:
    """Refuse a ``config.json`` that declares more than its weight files hold.

    Building the architecture on the meta device costs no memory, but time grows with
    the modules it declares; a config of a million layers would build for hours before
    anything is checked. Declared layer and expert counts must not exceed the number
    of stored tensors, declared dimensions (``*_size``) not their elements.

    Raises:
        CorruptCheckpointError: Naming the config file, the key, its value and what the
            weights hold.
    """
    tensors = [value for value in weights.values() if isinstance(value, torch.Tensor)]
    elements = sum(value.numel() for value in tensors)
    pending: list[tuple[str, Any]] = list(config.items())
    while pending:
        key, value = pending.pop()
        if isinstance(value, Mapping):  # sub-configs (text_config, vision_config)
            pending.extend((f"{key}.{k}", v) for k, v in value.items())
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        last = key.rsplit(".", 1)[-1]
        if _MODULE_COUNT.search(last) and value > len(tensors):
            held = f"{len(tensors)} tensors"
        elif _DIMENSION.search(last) and value > elements:
            held = f"{elements} elements"
        else:
            continue
        raise CorruptCheckpointError(
            f"{source}: {key} is {value}, more than the weight files hold ({held}); "
            "refused before building the model", path=source, key=key, value=value)


#: What transformers is for here, in the one-line error or warning when it is missing.
_HF_FEATURE = "naming an HF Trainer checkpoint's optimizer state by its model's architecture"


def _hf_meta_model(storage: Storage, name: str, weights: Mapping[str, Any]
                   ) -> nn.Module | None:
    """The architecture of ``config.json`` built on the meta device, for its names only."""
    try:
        config = storage.read_json(f"{name}/config.json")
        named = str(config["architectures"][0])
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - then shapes are all there is
        return None
    try:
        transformers = require("transformers", extra="hf", feature=_HF_FEATURE)
    except MissingDependencyError as error:
        warn(f"{storage.path(f'{name}/config.json')} names {named}, but {error}; the "
             "optimizer state is matched by the weight files' order or shapes instead",
             ResumekitWarning, stacklevel=4)
        return None
    try:
        architecture = getattr(transformers, named)
    except Exception:  # noqa: BLE001 - not a transformers architecture: shapes, then
        return None
    if "auto_map" in config:  # remote code: never run code from a checkpoint
        return None
    _check_config_sizes(config, weights, storage.path(f"{name}/config.json"))
    parsed = architecture.config_class.from_dict(config)
    with torch.device("meta"):
        built: nn.Module = architecture(parsed)
    return built


def _hf_optimizer(optimizer: Mapping[str, Any], weights: Mapping[str, Any],
                  model: nn.Module | None, *, ordered: bool, where: str) -> dict[str, Any]:
    """The Trainer's two groups: weight-decay parameters, then the rest, in model order."""
    groups = list(optimizer.get(_GROUPS, []))
    if model is None or len(groups) != 2:
        return _map_optimizer(optimizer, weights, model=model, ordered=ordered, where=where)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    decay_names = set(_hf_decay_names(model))
    decay = [n for n in trainable if n in decay_names]
    no_decay = [n for n in trainable if n not in decay_names]
    sizes = [len(g.get(_PARAMS, [])) for g in groups]
    if sizes != [len(decay), len(no_decay)]:
        raise IncompatibleCheckpointError(
            f"{where}: optimizer groups of {sizes} parameters do not match the Trainer's "
            f"weight-decay / no-decay split of the model ({len(decay)}, {len(no_decay)}); "
            "import from Python with the model built the way the trainer built it",
            path=where, differences=[f"group sizes {sizes}"])
    names = decay + no_decay
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    missing = [n for n in names if n not in weights]
    if missing:
        raise IncompatibleCheckpointError(
            f"{where}: parameters {missing[:5]} are not in the checkpoint's weights",
            path=where, differences=[f"missing: {n}" for n in missing])
    return _optimizer_by_fqn(optimizer, names, shapes, where=where,
                             hint="HF Trainer groups: weight decay, then no decay")


def _hf_decay_names(model: nn.Module) -> list[str]:
    try:
        trainer: Any = require("transformers", extra="hf", feature=_HF_FEATURE).Trainer
    except ImportError as error:  # transformers is there, its Trainer does not import
        if isinstance(error, MissingDependencyError):
            raise
        raise missing("transformers", extra="hf", feature=_HF_FEATURE, error=error) from error
    # The Trainer's own rule (it does not use ``self``): what its optimizer decays.
    return list(trainer.get_decay_parameter_names(cast(Any, None), model))


def _from_lingbot(storage: Storage, name: str, model: nn.Module | None) -> _Source:
    """LingBot-VA upstream ``checkpoint_step_N``: weights only (see resumekit.tools.legacy)."""
    del model
    weights = legacy.read_full_weights(storage, name)
    step = NameFormat(LEGACY_NAME_FORMAT).parse(name.rsplit("/", 1)[-1])
    return _Source(dict(weights), None, None, step, ["optimizer state (the source has none)"])


_READERS = {
    "dcp": _from_dcp,
    "torchtitan": _from_dcp,
    "accelerate": _from_accelerate,
    "lightning": _from_lightning,
    "hf-trainer": _from_hf_trainer,
    "lingbot": _from_lingbot,
}
