"""What a checkpoint holds, and how it is split into files.

A :class:`TrainState` gathers everything a run needs to continue exactly where it
stopped. Inside a committed step directory it is laid out as::

    manifest.json              the commit marker: files, checksums, lineage, extras
    tensors/                   model + optimizer, sharded (DCP: .metadata + one file per rank)
    train_state.pt             rank 0: step, micro_step, scheduler, world size
    rank_state/rank_00000.pt   per rank: RNG streams, data position

``*.pt`` files hold only tensors and plain containers and are read with
``torch.load(weights_only=True)``: loading a checkpoint never runs code from it.

Per-rank state on a world-size change (resharding):

* tensors reshard through DCP;
* data position: the resumable sampler keeps *global* samples consumed, so every rank
  restores rank 0's data state and the rest of the epoch is re-partitioned over the new
  ranks (no sample repeated or skipped). A user loader whose state is truly per-rank is
  restored only when the world size is unchanged; otherwise rank 0's state is used and a
  warning says so;
* RNG: rank r restores its own streams when the writer had rank r; streams of new ranks
  are derived deterministically (see :func:`resumekit.state.rng.select_rank_rng`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from resumekit import tensors
from resumekit.errors import (
    CheckpointLoadError,
    ConfigurationError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ResumekitError,
    UnreadableFormatError,
)
from resumekit.state import rng as _rng
from resumekit.state.loader import LOADER_STATE_KIND, LoaderPosition
from resumekit.state.sampler import ResumableDistributedSampler, SkipAheadSampler
from resumekit.store.layout import RANK_STATE_DIR, TENSORS_DIR, TRAIN_STATE_FILE, rank_state_file
from resumekit.store.manifest import Manifest
from resumekit.store.retry import read_with_retry
from resumekit.store.storage import Storage
from resumekit.tensors import state_dicts
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "RANK_STATE_DIR",
    "TENSORS_DIR",
    "TRAIN_STATE_FILE",
    "Stateful",
    "StatefulGroup",
    "TrainState",
    "capturable_model",
    "capturable_optimizer",
    "dump_plain",
    "load_plain",
    "rank_state_file",
    "read_plain",
]

@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (schedulers, samplers...)."""

    def state_dict(self) -> dict[str, Any]:
        """Return the object's state."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the object's state."""
        ...


class StatefulGroup:
    """Several named stateful objects saved and restored as one.

    Pass it where the manager takes one stateful object saved once for the whole run,
    ``scheduler=``: rank 0 saves every member's ``state_dict()`` and every rank loads it,
    as Accelerate does for the objects given to ``accelerator.register_for_checkpointing``.
    Hand resumekit the same objects::

        accelerator.register_for_checkpointing(ema)
        extra = StatefulGroup(scheduler=scheduler, ema=ema)
        ckpt = CheckpointManager(root, model=model, optimizer=optimizer, scheduler=extra)

    A checkpoint restores only into a group of the same names: a name missing on
    either side is an error naming it, never a member silently left as it was.

    Args:
        **members: The objects, by name; each has ``state_dict`` and ``load_state_dict``.

    Raises:
        ConfigurationError: No member, or a member without those two methods.
    """

    def __init__(self, **members: Any) -> None:
        if not members:
            raise ConfigurationError("StatefulGroup needs at least one named object",
                                     name="members", value={})
        for name, member in members.items():
            if not isinstance(member, Stateful):
                raise ConfigurationError(
                    f"StatefulGroup member {name!r} ({type(member).__name__}) has no "
                    "state_dict()/load_state_dict()", name=name, value=type(member).__name__)
        self.members: dict[str, Any] = dict(members)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{name: member.state_dict()}`` for every member."""
        return {name: member.state_dict() for name, member in self.members.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load every member from ``state_dict``; the names must be exactly the members'.

        Raises:
            IncompatibleCheckpointError: The saved names differ from the members' (each
                missing or extra name listed); no member was loaded.
        """
        saved = set(state_dict) if isinstance(state_dict, Mapping) else set()
        missing = sorted(set(self.members) - saved)
        extra = sorted(saved - set(self.members))
        if missing or extra or not isinstance(state_dict, Mapping):
            differences = [f"not in the checkpoint: {n}" for n in missing] + [
                f"in the checkpoint, not in the group: {n}" for n in extra]
            raise IncompatibleCheckpointError(
                "the saved state does not fit StatefulGroup("
                f"{', '.join(self.members)}): " + "; ".join(differences or ["not a mapping"]),
                key="scheduler", differences=differences)
        for name, member in self.members.items():
            member.load_state_dict(state_dict[name])


def read_plain(storage: Storage, name: str, manifest: Manifest, path: str) -> Any:
    """Read the plain-data file ``path`` (e.g. ``train_state.pt``) of checkpoint ``name``.

    The one way resumekit opens a checkpoint's ``.pt`` files: relative to the manifest's
    data directory, with ``torch.load(weights_only=True)``, errors naming the file.
    """
    relative = f"{name}/{manifest.data_path(path)}"
    source = storage.path(relative)
    return load_plain(read_with_retry(source, lambda: storage.read_bytes(relative)),
                      source=source)


def dump_plain(value: Any, *, what: str) -> bytes:
    """Serialise plain data (tensors, numbers, strings, containers) with ``torch.save``.

    What could not be read back safely is refused at save time: a value made only of
    :func:`_surely_safe` types is (``torch.load(weights_only=True)`` reads each of them
    back); anything else is read back once here, as the restore would.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    if _surely_safe(value, depth=0):
        return data
    try:  # refuse, at save time, what could not be read back safely
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:
        raise TypeError(
            f"{what} holds objects that cannot be restored safely (only tensors, numbers, "
            f"strings and containers are allowed): {error}"
        ) from error
    return data


_SAFE_ATOMS = (str, int, float, bool, type(None), bytes)
_SAFE_DEPTH = 32


def _surely_safe(value: Any, *, depth: int) -> bool:
    """Whether ``value`` is built only of what ``weights_only`` loading always accepts.

    Exactly ``dict`` (``str``/``int`` keys), ``list``, ``tuple``, ``str``, ``int``,
    ``float``, ``bool``, ``None``, ``bytes`` and plain CPU ``torch.Tensor`` (no
    subclass), nested at most 32 deep: a short list, far inside the types the
    ``weights_only`` unpickler allows. False means only "not sure"; the caller then
    reads the bytes back to decide.
    """
    kind = type(value)
    if kind in _SAFE_ATOMS:
        return True
    if depth > _SAFE_DEPTH:
        return False
    if kind is torch.Tensor:
        return (value.device.type == "cpu" and value.layout is torch.strided
                and not value.is_quantized and not vars(value))  # no attributes of its own
    if kind is list or kind is tuple:
        return all(_surely_safe(item, depth=depth + 1) for item in value)
    if kind is dict:
        return all(type(key) in (str, int) and _surely_safe(item, depth=depth + 1)
                   for key, item in value.items())
    return False


def load_plain(data: bytes, *, source: str) -> Any:
    """Read data written by :func:`dump_plain` without executing code from it.

    Raises:
        UnreadableFormatError: ``torch.load`` refused or failed on it (damage, or what
            another torch version wrote: restore tells them apart by the versions).
    """
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:
        raise UnreadableFormatError(
            f"{source} cannot be read safely: {error}", path=source, file=source
        ) from error


def _load_scheduler(scheduler: Stateful, state: Any, *, source: str, verified: bool) -> None:
    """``scheduler.load_state_dict(state)``; its failure on verified bytes is no damage."""
    try:
        scheduler.load_state_dict(state)
    except (KeyError, TypeError, ValueError) as error:
        if not verified or isinstance(error, ResumekitError):
            raise
        cause = (f"{type(scheduler).__name__}.load_state_dict raised "
                 f"{type(error).__name__}: {error}")
        raise CheckpointLoadError(
            f"restoring the scheduler from {source} failed: {cause}. The file matches the "
            "checksum recorded when it was written, so this is not damage but the "
            "scheduler failing on what it saved; nothing was set aside",
            path=source, step=None, rank=None, cause=cause, file=source,
        ) from error


@dataclass
class TrainState:
    """Everything one rank contributes to, and restores from, a checkpoint.

    Attributes:
        model: The model (plain, DDP or FSDP2-sharded); a list or tuple of exactly one
            module is taken as that module.
        optimizer: Its optimizer; its state is saved sharded like the parameters. Also
            several optimizers over disjoint parameters of the model, saved as one: a
            list, tuple or dict of them, or an ``Optimizer`` wrapping them in its
            ``optimizers`` attribute (torchtitan's ``OptimizersContainer``). Held as
            the optimizer itself or a tuple of the optimizers (see
            :func:`capturable_optimizer`).
        scheduler: A learning-rate scheduler (anything with state_dict/load_state_dict).
        data: The data position: the ``DataLoader`` the loop iterates (adopted as a
            :class:`~resumekit.state.loader.LoaderPosition`: its generator and the batches it
            hands out are saved), a :class:`~resumekit.state.sampler.ResumableDistributedSampler`
            or any object with state_dict/load_state_dict.
        generators: Named ``torch.Generator`` objects whose streams must resume too.
        step: Optimizer steps taken.
        micro_step: Position inside gradient accumulation (0 at a step boundary).
        tied: Model entries the last capture stored once: ``{alias: kept name}``.
        captured_params: :meth:`fingerprint_params` of the model as the last
            :meth:`tensor_state` captured it (taken from that capture, not a second one).
    """

    model: nn.Module | None = None
    optimizer: state_dicts.Optimizers | None = None
    scheduler: Stateful | None = None
    data: Stateful | None = None
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    step: int = 0
    micro_step: int = 0
    tied: dict[str, str] = field(default_factory=dict)
    captured_params: dict[str, list[Any]] = field(default_factory=dict)
    # (step, data position) when the position was last seen to move (or was restored or
    # taken at construction); None once the "position never moves" warning was given.
    _data_mark: tuple[int, tuple[int, int]] | None = field(default=None, init=False,
                                                            repr=False)

    def __post_init__(self) -> None:
        self.model = capturable_model(self.model)
        self.optimizer = capturable_optimizer(self.optimizer, self.model)
        if isinstance(self.data, DataLoader):
            self.data = LoaderPosition(self.data)
        for what, value in (("scheduler", self.scheduler), ("data", self.data)):
            _refuse_unsaveable(what, value)
        self._data_mark = _marked(self.step, self.data)

    # -- capture ------------------------------------------------------------------------
    def tensor_state(self) -> dict[str, Any]:
        """Return the sharded tensor state (model, optimizer) to write through DCP.

        Tied weights (two names over one tensor, nanoGPT's ``lm_head.weight`` and
        ``transformer.wte.weight``) are written once, under the first name; the others
        are recorded in :attr:`tied` (and so in the manifest's ``state.tied``).
        """
        if self.model is None:
            self.tied = {}
            self.captured_params = {}
            return {}
        with tensors.collection_paused():  # as in fingerprint_params
            state = state_dicts.model_and_optimizer_state(self.model, self.optimizer)
            self.captured_params = _params_of(state["model"])
            self.tied = state_dicts.find_tied(state["model"])
            return state_dicts.untie(state, self.tied)

    def load_target(self, tied: Mapping[str, str], *, optimizer: bool = True,
                    source: str | None = None,
                    storage_options: Mapping[str, Any] | None = None,
                    metadata: tensors.CheckedMetadata | None = None) -> dict[str, Any]:
        """Return the destination tensors for loading a checkpoint that stored ``tied`` once.

        Args:
            tied: The checkpoint's ``{alias: kept name}`` (its manifest's ``state.tied``).
            optimizer: Include the optimizer (False for a checkpoint that holds none, or
                for weights only).
            source: The checkpoint's ``tensors/`` directory: an optimizer that never
                stepped gets its state shaped from the checkpoint's metadata
                (:func:`resumekit.tensors.state_dicts.preallocate_optimizer_state`) instead of by
                DCP's zero-learning-rate step.
            storage_options: fsspec options for ``source``.
            metadata: ``source``'s ``.metadata``, already read and checked (a restore
                reads it on one rank): nothing is read.
        """
        if self.model is None:
            return {}
        if optimizer and source is not None and self.optimizer is not None:
            state_dicts.preallocate_optimizer_state(self.model, self.optimizer, source,
                                                    storage_options=storage_options,
                                                    metadata=metadata)
        state = state_dicts.model_and_optimizer_state(
            self.model, self.optimizer if optimizer else None)
        return state_dicts.untie(state_dicts.without_param_names(state), tied)

    def train_state(self, world_size: int) -> dict[str, Any]:
        """Return the global, rank-0 part: step, accumulation position, scheduler."""
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "world_size": world_size,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def rank_state(self, *, watch: bool = True) -> dict[str, Any]:
        """Return this rank's part: RNG streams and data position.

        With ``watch`` (a save), warns once (:class:`~resumekit.warnings.ResumekitWarning`)
        when a resumable sampler's position has not moved while steps have since it was
        last seen moving (built, restored or saved): the loop does not call
        ``sampler.advance()``, and a resume would retrain the data it already consumed.
        Without it (the step-boundary snapshot of an emergency capture) nothing is checked.
        """
        if watch:
            self._watch_data_position()
        return {
            "rng": _rng.capture_rng(self.generators),
            "data": None if self.data is None else self.data.state_dict(),
        }

    def contents(self) -> dict[str, Any]:
        """Describe what this state holds (recorded in the manifest)."""
        return {
            "model": self.model is not None,
            "optimizer": self.optimizer is not None,
            "scheduler": self.scheduler is not None,
            "data": self.data is not None,
            "generators": sorted(self.generators),
            "micro_step": self.micro_step,
            **({"tied": dict(self.tied)} if self.tied else {}),
        }

    def fingerprint_params(self) -> dict[str, list[Any]]:
        """Return ``{parameter name: [global shape, dtype]}`` of the model.

        Names are the canonical ones DCP stores tensors under (``get_model_state_dict``):
        no ``module.`` (DDP) or ``_orig_mod.`` (``torch.compile``), so a checkpoint of a
        wrapped model fits the same model unwrapped, and the other way round.
        """
        if self.model is None:
            return {}
        # Two lists per tensor: without the pause, the collector's passes over the
        # process (triggered by those allocations) cost more than building them.
        with tensors.collection_paused():
            return _params_of(state_dicts.model_state_dict(self.model))

    # -- apply --------------------------------------------------------------------------
    def apply_tensor_state(self, state: dict[str, Any],
                           tied: Mapping[str, str] | None = None) -> None:
        """Load sharded model/optimizer state (already read through DCP) into the objects.

        Args:
            state: As read into :meth:`load_target`'s tensors (with or without
                ``"optimizer"``; without, the optimizer is left as it is).
            tied: The aliases the checkpoint stored once; they get their kept tensor.
        """
        if self.model is not None:
            optimizer = self.optimizer if "optimizer" in state else None
            with tensors.collection_paused():  # as in fingerprint_params
                state_dicts.apply_model_and_optimizer_state(self.model, optimizer,
                                                        state_dicts.retie(state, tied or {}))

    def apply_train_state(self, state: Mapping[str, Any], *, source: str,
                          scheduler: bool = True, verified: bool = False) -> None:
        """Restore step, accumulation position and scheduler from the rank-0 part.

        Args:
            state: The rank-0 part, as read.
            source: Its file, for errors.
            scheduler: Restore the scheduler (False leaves it as it is: the caller has
                decided, and said, that it starts fresh).
            verified: ``source`` matched its checksum before it was read: the
                scheduler's own ``load_state_dict`` raising a ``KeyError``,
                ``TypeError`` or ``ValueError`` on it is then a
                :class:`~resumekit.errors.CheckpointLoadError` (not damage), not a
                :class:`~resumekit.errors.CorruptCheckpointError`.
        """
        try:
            self.step = int(state["step"])
            self.micro_step = int(state.get("micro_step", 0))
            if self.scheduler is not None and scheduler:
                if state.get("scheduler") is None:
                    raise IncompatibleCheckpointError(
                        f"{source} holds no scheduler state but a scheduler was given",
                        path=source, key="scheduler",
                    )
                _load_scheduler(self.scheduler, state["scheduler"], source=source,
                                verified=verified)
        except IncompatibleCheckpointError as error:  # a fit refused (StatefulGroup), named
            if error.fields.get("path") is not None:
                raise
            raise IncompatibleCheckpointError(f"{source}: {error.message}", **{
                **error.fields, "path": source}) from error
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptCheckpointError(
                f"{source}: unreadable training state ({error!r})", path=source, file=source
            ) from error

    def apply_rank_state(
        self,
        saved: Mapping[int, Mapping[str, Any]],
        rank: int,
        *,
        saved_world_size: int,
        world_size: int,
        rng: bool = True,
        data: bool = True,
    ) -> None:
        """Restore RNG streams and data position, applying the resharding policy.

        Args:
            saved: Per-rank states read from the checkpoint, by writer rank (at least
                rank 0's and, when it exists, ``rank``'s own).
            rank: This process's rank.
            saved_world_size: World size of the writer.
            world_size: World size now.
            rng: Restore the RNG streams (False keeps this process's: the caller has
                decided, and said, that they start fresh).
            data: Restore the data position (False: likewise).
        """
        if rng:
            _rng.restore_rng(_rng.select_rank_rng(
                {r: s["rng"] for r, s in saved.items()}, rank), self.generators)
        if self.data is None or not data:
            return
        same_world = saved_world_size == world_size and rank in saved
        source = saved[rank] if same_world else saved[0]
        if source.get("data") is None:
            raise IncompatibleCheckpointError(
                "the checkpoint holds no data position but a data object was given",
                key="data",
            )
        if not same_world and not _keeps_global_position(self.data):
            warn(
                f"world size changed {saved_world_size} -> {world_size}: the data object "
                f"{_data_name(self.data)} restores rank 0's position on every rank; "
                "use ResumableDistributedSampler for an exact re-partition",
                ResumekitWarning,
                stacklevel=3,
            )
        if isinstance(self.data, LoaderPosition):
            # A loader's generator is per rank: rank r takes the one rank r wrote; a rank
            # the writer did not have keeps its fresh one (seeded from its own rank).
            own = saved.get(rank, {}).get("data")
            self.data.load_state_dict(dict(source["data"]),
                                      generator=None if own is None else dict(own))
        else:
            self.data.load_state_dict(_sampler_part(source["data"]))
        self._data_mark = _marked(self.step, self.data)

    def _watch_data_position(self) -> None:
        mark, now = self._data_mark, _position_of(self.data)
        if mark is None or now is None:
            return
        since, position = mark
        if now != position or self.step <= since:
            self._data_mark = (self.step, now)
            return
        self._data_mark = None
        warn(
            f"the data position has not moved from step {since} to step {self.step} "
            f"(epoch {now[0]}, {now[1]} samples consumed): the loop does not call "
            f"{type(self.data).__name__}.advance() after each batch, so this checkpoint "
            "records the old position and a resume retrains the data since it",
            ResumekitWarning, stacklevel=4)


_SUPPORTED_OPTIMIZERS = (
    "resumekit takes a torch.optim.Optimizer whose state_dict() has 'state' and "
    "'param_groups', several of them as a list, tuple or dict, or an Optimizer that wraps "
    "several in its 'optimizers' attribute (torchtitan's OptimizersContainer)")


def capturable_model(model: Any) -> nn.Module | None:
    """``model`` as a checkpoint captures it, refused here if it cannot be.

    A module is taken as it is (plain, DDP, ``torch.compile``-d, FSDP2); a list or tuple
    of exactly one module (torchtitan's ``model_parts`` without pipeline parallelism) is
    taken as that module.

    Raises:
        ConfigurationError: Anything else, named, with the forms taken.
    """
    if model is None or isinstance(model, nn.Module):
        return model
    if isinstance(model, (list, tuple)) and len(model) == 1 and isinstance(model[0], nn.Module):
        return model[0]
    kind = type(model).__name__
    detail = (f"a {kind} of {len(model)} modules (pipeline-parallel model parts are not "
              "supported)" if isinstance(model, (list, tuple)) else f"a {kind}")
    raise ConfigurationError(
        f"model= cannot be checkpointed: it is {detail}; resumekit takes a torch.nn.Module "
        "(plain, DDP, torch.compile-d or FSDP2 fully_shard-ed), or a list of exactly one",
        name="model", value=kind)


def capturable_optimizer(optimizer: Any, model: nn.Module | None
                         ) -> state_dicts.Optimizers | None:
    """``optimizer`` as a checkpoint captures it, refused here if it cannot be.

    One ``torch.optim.Optimizer`` is taken as it is; several (a list, tuple or dict of
    them, or an ``Optimizer`` holding them in its ``optimizers`` attribute, as
    torchtitan's ``OptimizersContainer`` does, whose own ``state_dict()`` is a flat form
    DCP cannot load) become a tuple of the optimizers inside, saved as one optimizer
    (each parameter's state under its name, every group). One optimizer alone inside a
    container is taken alone: its checkpoint is a plain optimizer's.

    Checked here, when the manager is built, not at the first save: each is an
    ``Optimizer`` whose ``state_dict()`` (called once, for an optimizer that overrides
    it) has ``state`` and ``param_groups``; each parameter it updates is one of the
    model's, and in one optimizer only.

    Raises:
        ConfigurationError: What resumekit cannot capture, naming the object (and the
            optimizer and group at fault) and the forms it takes.
    """
    if optimizer is None:
        return None
    parts = _optimizer_parts(optimizer, "optimizer")
    if model is not None:
        owners: dict[int, str] = {}
        params = {id(param) for param in model.parameters()}
        for where, part in parts:
            for number, group in enumerate(part.param_groups):
                for param in group["params"]:
                    at = f"{where} ({type(part).__name__}) param_groups[{number}]"
                    if id(param) not in params:
                        raise ConfigurationError(
                            f"{at} updates a tensor of shape {list(param.shape)} that is not "
                            "a parameter of model=: build the optimizer from the model's "
                            "parameters after wrapping it (DDP, fully_shard)",
                            name="optimizer", value=type(part).__name__)
                    if id(param) in owners and owners[id(param)] != where:
                        raise ConfigurationError(
                            f"{at} updates a parameter {owners[id(param)]} updates too: "
                            "several optimizers are saved as one only when each updates "
                            "its own parameters", name="optimizer",
                            value=type(part).__name__)
                    owners[id(param)] = where
    if len(parts) == 1:
        return parts[0][1]
    return tuple(part for _, part in parts)


def _optimizer_parts(value: Any, where: str) -> list[tuple[str, torch.optim.Optimizer]]:
    """``[(where, optimizer)]`` inside ``value``; ConfigurationError for anything else."""
    kind = type(value).__name__
    if isinstance(value, torch.optim.Optimizer):
        inner = getattr(value, "optimizers", None)
        if (type(value).state_dict is not torch.optim.Optimizer.state_dict
                and isinstance(inner, (list, tuple)) and inner):
            return _optimizer_parts(list(inner), f"{where}.optimizers")
        if type(value).state_dict is not torch.optim.Optimizer.state_dict:
            _refuse_unusual_state(value, where)
        return [(where, value)]
    if isinstance(value, Mapping) and value:
        return [part for name, item in value.items()
                for part in _optimizer_parts(item, f"{where}[{name!r}]")]
    if isinstance(value, (list, tuple)) and value:
        parts = [part for number, item in enumerate(value)
                 for part in _optimizer_parts(item, f"{where}[{number}]")]
        seen: set[int] = set()
        for name, part in parts:
            if id(part) in seen:
                raise ConfigurationError(f"{name} ({type(part).__name__}) is listed twice",
                                         name="optimizer", value=type(part).__name__)
            seen.add(id(part))
        return parts
    empty = isinstance(value, (list, tuple, Mapping))
    raise ConfigurationError(
        f"{where} cannot be checkpointed: it is {'an empty ' if empty else 'a '}{kind}; "
        f"{_SUPPORTED_OPTIMIZERS}", name="optimizer", value=kind)


def _refuse_unusual_state(optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse an optimizer whose own ``state_dict()`` is not torch's form."""
    kind = type(optimizer).__name__
    try:
        state = optimizer.state_dict()
    except Exception as error:
        raise ConfigurationError(
            f"{where} ({kind}) cannot be checkpointed: its state_dict() raised {error!r}; "
            f"{_SUPPORTED_OPTIMIZERS}", name="optimizer", value=kind) from error
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if (not isinstance(state, Mapping) or not isinstance(state.get("state"), Mapping)
            or not isinstance(groups, list)
            or not all(isinstance(group, Mapping) and "params" in group for group in groups)):
        keys = sorted(map(str, state))[:5] if isinstance(state, Mapping) else []
        raise ConfigurationError(
            f"{where} ({kind}) cannot be checkpointed: its state_dict() is not torch's form "
            f"('state' and 'param_groups'; it has {keys or type(state).__name__}); "
            f"{_SUPPORTED_OPTIMIZERS}", name="optimizer", value=kind)


def _refuse_unsaveable(what: str, value: Any) -> None:
    """Refuse a scheduler or data object that a save could not capture."""
    if value is None or isinstance(value, Stateful):
        return
    kind = type(value).__name__
    if what == "data" and isinstance(value, Sampler):
        hint = ("use resumekit.ResumableDistributedSampler(dataset, ...) in place of "
                "torch's DistributedSampler (same epoch order, a position that survives "
                "a resume), or resumekit.wrap_sampler(sampler) for any other sampler")
    else:
        hint = "give it state_dict() and load_state_dict() methods"
    raise ConfigurationError(
        f"{what}={kind} cannot be checkpointed: it has no state_dict()/load_state_dict(); "
        f"{hint}", name=what, value=kind)


def _position_of(data: Any) -> tuple[int, int] | None:
    """``(epoch, consumed)`` of one of resumekit's samplers; None for other objects."""
    if isinstance(data, (ResumableDistributedSampler, SkipAheadSampler)):
        return (data.epoch, data.consumed)
    return None


def _marked(step: int, data: Any) -> tuple[int, tuple[int, int]] | None:
    position = _position_of(data)
    return None if position is None else (step, position)


def _params_of(model_state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{name: [global shape, dtype name]}`` of the tensors of a model state dict."""
    names: dict[torch.dtype, str] = {}
    params: dict[str, list[Any]] = {}
    for name, value in model_state.items():
        if isinstance(value, torch.Tensor):
            dtype = value.dtype
            text = names.get(dtype)
            if text is None:
                text = names[dtype] = str(dtype).removeprefix("torch.")
            params[name] = [[*value.shape], text]
    return params


def _keeps_global_position(data: Any) -> bool:
    if isinstance(data, LoaderPosition):
        return data.keeps_global_position
    return isinstance(data, ResumableDistributedSampler)


def _sampler_part(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The data state for a sampler: a ``data=loader`` checkpoint's sampler part."""
    if saved.get("kind") == LOADER_STATE_KIND and isinstance(saved.get("sampler"), Mapping):
        return dict(saved["sampler"])
    return dict(saved)


def _data_name(data: Any) -> str:
    """The name of the user's data object (the loader, not resumekit's adapter)."""
    return type(data.loader if isinstance(data, LoaderPosition) else data).__name__
