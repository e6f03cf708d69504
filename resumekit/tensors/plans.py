"""A save plan remembered between saves of a state whose layout is unchanged.

DCP plans every save afresh: a write item per tensor (for a ``DTensor``, its shard's
shape and offsets worked out from the mesh and placements) on every rank, each rank's
plan pickled to the coordinator, the global plan (deduplication, the metadata, its
validation) made there and each rank's part pickled back, then ``.metadata`` pickled
from the plan and the ranks' write results. For a state of a few hundred tensors that is
most of a small save's CPU time (issue 38.2: 13 of the 36 ms of a local save of the scale
bench's smoke state), and at the 5B shapes on 32 ranks it is rank 0's whole save
coordination (issue 40: seconds), the same on every save when no rank's layout changed.

:class:`SavePlans` remembers, per writer of one root (a channel of the durable root's
saves, a node-local site), the last save's plans, keyed by each rank's **layout**: for
each flattened key, what DCP's planner reads of the value (a ``DTensor``'s dtype, global
shape, mesh and placements, its local shard's layout, ``requires_grad`` and pinning; a
tensor's dtype, shape, layout, ``requires_grad`` and pinning; that a value is not a
tensor), the flattening's mappings, whether the rank coordinates, and the writer, the
rank and the group's size (:func:`layout_key`). Values DCP plans through hooks this key
does not see (``ShardedTensor``, other tensor subclasses, objects with
``__create_write_items__``) are never remembered.

A save of one process by itself and a collective save go the same way
(:class:`MemoSavePlanner`):

1. each rank whose layout equals the one its remembered plan was made for sends, instead
   of its local plan, a marker naming the **round** (a random token the coordinator drew
   when it last planned in full) its remembered plan belongs to; any other rank plans
   in full and sends its plan;
2. the coordinator reuses its remembered metadata only when **every** rank sent a marker
   of the round it remembers, and sends each rank a marker back: each rank writes its
   remembered final plan. When every rank sent its plan it plans in full (DCP's
   :class:`DefaultSavePlanner`), draws a new round and remembers the metadata; each rank
   remembers the final plan it receives with the round. A mix (some ranks' layout
   changed), or a round the coordinator does not remember, is refused with
   :class:`PlanAgain`: every rank forgets and the save is planned again, in full on every
   rank (:func:`resumekit.tensors.save`). A save that fails anywhere forgets everything
   on every rank;
3. ``.metadata``'s pickled bytes are reused (:meth:`SavePlans.metadata_bytes`) only when
   its metadata is the remembered one (the same objects, from a round of markers) and
   every write result records the same file, offset, length and descriptors as the last
   save's: the same metadata, value for value. Otherwise it is pickled afresh.

So a save reuses plans only where every rank's layout is what its plan was made for,
and the files are the same, byte for byte, as those of a save planned in full.

DCP's own plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) is no
substitute: in torch 2.13 it still builds the local plan every time (it saves only the
collective), keeps its plans in class attributes shared by every planner of the process
(the durable root's and a local tier's saves would overwrite each other's), and takes a
local plan for unchanged from its keys, offsets and sizes alone, so a dtype change at the
same shapes would reuse stale metadata (:mod:`resumekit.tensors.save`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from resumekit.errors import ResumekitError

__all__ = ["MemoSavePlanner", "PlanAgain", "PlansPerWriter", "SavePlans", "layout_key"]

_ROUND_BYTES = 16


class PlanAgain(ResumekitError, RuntimeError):
    """The coordinator cannot reuse the ranks' remembered plans: plan the save in full.

    Raised on the coordinating rank when some ranks sent a marker of their remembered
    plan and others their plan (a layout changed on some ranks only), or a marker of a
    round it does not remember. DCP sends it to every rank; :func:`resumekit.tensors.save`
    then forgets and plans that save again, in full on every rank. Never reaches a caller.
    """


@dataclasses.dataclass(frozen=True)
class Unchanged:
    """A local plan's ``planner_data`` in place of the plan: unchanged since round ``token``.

    The sender's layout is the one its remembered final plan of that round was made for.
    """

    token: bytes


@dataclasses.dataclass(frozen=True)
class Planned:
    """A local plan's ``planner_data`` when planned in full.

    DCP's own, and whether the rank can remember the plan (its layout has a key).
    """

    keyed: bool
    planner_data: Any


@dataclasses.dataclass(frozen=True)
class Round:
    """A final plan's ``planner_data``: the round that made it, and the plan's own.

    The round is None where nothing is remembered; a marker (``usable=False``) has no
    plan (the rank writes its remembered one).
    """

    token: bytes | None
    planner_data: Any


@dataclasses.dataclass
class _Written:
    state_dict_metadata: Any
    planner_data: Any
    signature: list[tuple[Any, ...]]
    data: bytes
    extra: Any


class SavePlans:
    """The last save's plans of one writer of one root, and the layout they were made for.

    One per channel of a manager's durable root and per node-local site: never shared
    between roots, tiers, managers or processes. Used by one save at a time (a lock
    guards it anyway).

    Attributes:
        hits: Saves of this rank that wrote its remembered final plan (nothing planned).
        misses: Saves of this rank planned in full (the first, each after a layout
            change on any rank, each after a failed save).
        global_hits: Saves this rank coordinated from the remembered metadata.
        global_misses: Saves this rank coordinated by planning in full.
        replans: Saves this rank coordinated whose ranks' plans could not be reused
            together (:class:`PlanAgain`): planned again, in full.
        metadata_reused: ``.metadata`` files this rank wrote from the remembered bytes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None  # this rank's remembered final plan
        self._final: SavePlan | None = None
        self._token: bytes | None = None
        self._round: bytes | None = None  # the coordinator's remembered round
        self._metadata: Metadata | None = None
        self._written: _Written | None = None
        self.hits = 0
        self.misses = 0
        self.global_hits = 0
        self.global_misses = 0
        self.replans = 0
        self.metadata_reused = 0

    def token_for(self, key: tuple[Any, ...] | None) -> bytes | None:
        """The round of the remembered final plan if it was made for ``key``, else None."""
        with self._lock:
            if key is None or key != self._key or self._final is None:
                return None
            return self._token

    def final_plan(self, token: bytes) -> SavePlan | None:
        """This rank's remembered final plan if it is of round ``token``."""
        with self._lock:
            return self._final if token == self._token else None

    def keep_final(self, key: tuple[Any, ...] | None, final: SavePlan,
                   token: bytes | None) -> None:
        """Remember this rank's final plan of round ``token`` for ``key`` (else forget it)."""
        with self._lock:
            if key is None or token is None:
                self._key = self._final = self._token = None
                self.misses += 1
                return
            self._key, self._final, self._token = key, final, token
            self.misses += 1

    def count_hit(self) -> None:
        """Count a save of this rank that wrote its remembered final plan."""
        with self._lock:
            self.hits += 1

    def coordinates(self, token: bytes) -> bool:
        """Whether this coordinator remembers the metadata of round ``token`` (nothing counted)."""
        with self._lock:
            return self._metadata is not None and self._round == token

    def metadata_of(self, tokens: Sequence[bytes]) -> Metadata | None:
        """A copy of the remembered metadata if every rank's marker names its round.

        A copy: the writer's ``finish`` sets fields of the metadata it is given.
        """
        with self._lock:
            if (self._metadata is None or self._round is None
                    or any(token != self._round for token in tokens)):
                return None
            self.global_hits += 1
            return dataclasses.replace(self._metadata)

    def new_round(self, metadata: Metadata, *, keep: bool) -> bytes | None:
        """Remember the metadata of a save coordinated in full; return its new round.

        None where ``keep`` is false (some rank cannot remember its plan): nothing kept.
        """
        with self._lock:
            self.global_misses += 1
            self._written = None
            if not keep:
                self._round = self._metadata = None
                return None
            self._round = os.urandom(_ROUND_BYTES)
            self._metadata = dataclasses.replace(metadata)
            return self._round

    def refuse(self) -> None:
        """Count a coordinated save planned again (:class:`PlanAgain`) and forget."""
        with self._lock:
            self.replans += 1
        self.forget()

    def forget(self) -> None:
        """Forget everything: the next save is planned in full (after any failed save)."""
        with self._lock:
            self._key = self._final = self._token = None
            self._round = self._metadata = None
            self._written = None

    def metadata_bytes(self, metadata: Metadata, signature: list[tuple[Any, ...]]
                       ) -> tuple[bytes, Any] | None:
        """The last ``.metadata`` bytes, and what the writer kept with them, if still true.

        Only when ``metadata``'s plan part is the remembered objects themselves (a save
        coordinated from memory) and ``signature`` (each write result's name, offsets
        and storage record, in order) equals the last save's: the same metadata, value
        for value. Its version and ``storage_meta`` are the caller's to hold constant.
        """
        with self._lock:
            kept, remembered = self._written, self._metadata
            if (kept is None or remembered is None
                    or metadata.state_dict_metadata is not remembered.state_dict_metadata
                    or kept.state_dict_metadata is not remembered.state_dict_metadata
                    or metadata.planner_data is not kept.planner_data
                    or signature != kept.signature):
                return None
            self.metadata_reused += 1
            return kept.data, kept.extra

    def keep_metadata_bytes(self, metadata: Metadata, signature: list[tuple[Any, ...]],
                            data: bytes, extra: Any) -> None:
        """Remember ``.metadata``'s bytes as pickled from ``metadata`` and its results.

        Only if ``metadata`` is the remembered one (else nothing could reuse them);
        ``extra``: what the writer derived from the same results, kept with them.
        """
        with self._lock:
            remembered = self._metadata
            if (remembered is None
                    or metadata.state_dict_metadata is not remembered.state_dict_metadata):
                self._written = None
                return
            self._written = _Written(metadata.state_dict_metadata, metadata.planner_data,
                                     signature, data, extra)


class PlansPerWriter:
    """One :class:`SavePlans` per writer of a root (a manager's channel), made at its first.

    Held by the manager, dropped with it; :meth:`clear` when its channels close (no
    reference to their groups is kept).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: list[tuple[object, SavePlans]] = []

    def of(self, writer: object) -> SavePlans:
        """The plans of ``writer``'s saves (the same object each time it is asked)."""
        with self._lock:
            for known, plans in self._known:
                if known is writer:
                    return plans
            plans = SavePlans()
            self._known.append((writer, plans))
            return plans

    def clear(self) -> None:
        """Forget every writer and its plans."""
        with self._lock:
            self._known.clear()


def layout_key(state_dict: dict[str, Any], mappings: Any, is_coordinator: bool,
               context: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """What DCP's default save planner reads of a flattened state: equal keys, equal plans.

    Args:
        state_dict: The planner's flattened state dict.
        mappings: The flattening's mappings (``planner_data`` of the plan).
        is_coordinator: Whether this process coordinates the save.
        context: What else the plan depends on (the writer, the rank, the group's size).

    Returns:
        The key, or None for a state this key cannot describe (never remembered).
    """
    entries: list[tuple[Any, ...]] = []
    for fqn, value in state_dict.items():
        kind = type(value)
        if kind is DTensor:
            local = value.to_local()  # the shard itself under no_grad: no autograd node
            if type(local) is not torch.Tensor:
                return None
            entries.append((fqn, "d", value.dtype, tuple(value.shape), value.device_mesh,
                            tuple(value.placements), local.dtype, tuple(local.shape),
                            local.layout, local.requires_grad, local.is_pinned()))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            entries.append((fqn, "t", value.dtype, tuple(value.shape), value.layout,
                            value.requires_grad, value.is_pinned()))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None  # a ShardedTensor, another subclass: planned through its own hooks
        else:
            entries.append((fqn, "b"))
    return (is_coordinator, context, tuple(entries), _frozen(mappings))


def _frozen(mappings: Any) -> Any:
    if isinstance(mappings, dict):
        return tuple((key, tuple(path)) for key, path in mappings.items())
    return None if mappings is None else repr(mappings)


class MemoSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that reuses the plans :class:`SavePlans` remembers.

    Every rank of a save uses one, each with its own process's :class:`SavePlans` of the
    same root (see the module docstring for the protocol). A save whose every rank's
    layout (:func:`layout_key`) is unchanged writes the remembered plans and metadata;
    any other is planned by :class:`DefaultSavePlanner` in full and remembered.

    Args:
        plans: Where plans are remembered.
        context: What the plan depends on besides the state (see :func:`layout_key`).
    """

    def __init__(self, plans: SavePlans, context: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self._plans = plans
        self._context = context
        self._key: tuple[Any, ...] | None = None

    def create_local_plan(self) -> SavePlan:
        """A marker of the remembered plan's round for this layout, else DCP's plan."""
        self._key = layout_key(self.state_dict, self.mappings, self.is_coordinator,
                               self._context)
        token = self._plans.token_for(self._key)
        if token is not None:
            self.plan = SavePlan([], planner_data=Unchanged(token), usable=False)
            return self.plan
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(
            plan, planner_data=Planned(self._key is not None, plan.planner_data))
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]
                           ) -> tuple[list[SavePlan], Metadata]:
        """The remembered metadata when every rank sent a marker of its round, else DCP's.

        Raises:
            PlanAgain: Some ranks sent markers and others plans, or a marker names a
                round not remembered here (every rank plans the save again, in full).
        """
        tokens = [plan.planner_data.token for plan in all_plans
                  if isinstance(plan.planner_data, Unchanged)]
        if tokens and len(tokens) == len(all_plans):
            metadata = self._plans.metadata_of(tokens)
            if metadata is not None:
                markers = [SavePlan([], planner_data=Round(tokens[0], None), usable=False)
                           for _ in all_plans]
                self.global_plan, self.metadata = markers, metadata
                return markers, metadata
        if tokens:
            self._plans.refuse()
            raise PlanAgain(
                f"{len(tokens)} of {len(all_plans)} ranks sent a marker of a remembered "
                "save plan that cannot be reused with the others' plans; planning in full")
        planned = [plan.planner_data for plan in all_plans]
        if not all(isinstance(data, Planned) for data in planned):
            raise ValueError("MemoSavePlanner coordinates the plans of MemoSavePlanners "
                             "only (a rank planned with another planner)")
        plans, metadata = super().create_global_plan([
            dataclasses.replace(plan, planner_data=data.planner_data)
            for plan, data in zip(all_plans, planned, strict=True)])
        token = self._plans.new_round(metadata, keep=all(data.keyed for data in planned))
        finals = [dataclasses.replace(plan, planner_data=Round(token, plan.planner_data))
                  for plan in plans]
        self.global_plan = finals
        return finals, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's remembered final plan for a marker, else ``new_plan`` (remembered)."""
        data = new_plan.planner_data
        if not isinstance(data, Round):
            raise ValueError("MemoSavePlanner finishes the plans of a MemoSavePlanner "
                             f"coordinator only (got planner_data {type(data).__name__})")
        if not new_plan.usable:
            final = self._plans.final_plan(data.token) if data.token is not None else None
            if final is None:  # never: the coordinator matched this rank's own marker
                raise ResumekitError("the coordinator reused a save plan of a round this "
                                     "rank does not remember")
            self._plans.count_hit()
            self.plan = final
            return final
        final = dataclasses.replace(new_plan, planner_data=data.planner_data)
        self._plans.keep_final(self._key, final, data.token)
        self.plan = final
        return final
