"""A save plan remembered between one process's saves of a state whose layout is unchanged.

DCP plans every save afresh: a write item per tensor (for a ``DTensor``, its shard's
shape and offsets worked out from the mesh and placements), then the global plan and the
``.metadata`` it describes. For a state of a few hundred tensors that planning is most
of a small save's CPU time (issue 38.2: 13 of the 36 ms of a local save of the scale
bench's smoke state), the same every time when the state's layout did not change.

:class:`SavePlans` remembers the last plan of the saves one process makes by itself
(``no_dist``: a node-local copy, :func:`resumekit.tensors.save` ``alone=True``), keyed
by the state's **layout**: for each flattened key, what DCP's planner reads of the value
(a ``DTensor``'s dtype, global shape, mesh and placements, its local shard's layout,
``requires_grad`` and pinning; a tensor's dtype, shape, layout, ``requires_grad`` and
pinning; that a value is not a tensor), the flattening's mappings, and whether this
process coordinates. A save whose layout equals the last one's reuses its plan and
metadata; any difference (a shape, a dtype, a key, a placement) plans in full and
replaces what is remembered. Values DCP plans through hooks this key does not see
(``ShardedTensor``, other tensor subclasses, objects with ``__create_write_items__``)
are never remembered: such a state plans in full every time.

DCP's own plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) is no
substitute: in torch 2.13 it still builds the local plan every time (it saves only the
collective), keeps its plans in class attributes shared by every planner of the process
(the durable root's and a local tier's saves would overwrite each other's), and takes a
local plan for unchanged from its keys, offsets and sizes alone, so a dtype change at the
same shapes would reuse stale metadata (:mod:`resumekit.tensors.save`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

__all__ = ["MemoSavePlanner", "SavePlans", "layout_key"]


class SavePlans:
    """The last save plan of one process's saves by itself, and the layout it was made for.

    One per writer of node-local copies (a :class:`~resumekit.local.site.LocalSite`):
    never shared between roots or processes. Used by one save at a time (a lock guards
    it anyway).

    Attributes:
        hits: Saves that reused the remembered plan.
        misses: Saves planned in full (the first, and each whose layout changed).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._local: SavePlan | None = None
        self._global: tuple[SavePlan, list[SavePlan], Metadata] | None = None
        self.hits = 0
        self.misses = 0

    def local_plan(self, key: tuple[Any, ...] | None) -> SavePlan | None:
        """The remembered local plan if it was made for ``key`` (None: plan in full)."""
        with self._lock:
            if key is None or key != self._key or self._global is None:
                return None
            return self._local

    def global_plan(self, local: SavePlan) -> tuple[list[SavePlan], Metadata] | None:
        """The remembered global plan and metadata of ``local`` (as the writer prepared it).

        Returns:
            A copy of the plans' list and of the metadata (DCP's ``finish`` sets fields of
            the metadata it is given), or None unless ``local`` is the remembered local
            plan as prepared the same way last time.
        """
        with self._lock:
            if self._global is None:
                return None
            prepared, plans, metadata = self._global
            if local.items is not prepared.items or local != prepared:
                return None
            return list(plans), dataclasses.replace(metadata)

    def remember(self, key: tuple[Any, ...] | None, local: SavePlan, prepared: SavePlan,
                 plans: list[SavePlan], metadata: Metadata) -> None:
        """Keep a plan made in full for ``key`` (None: forget instead, nothing to key it by)."""
        with self._lock:
            if key is None:
                self._key = self._local = self._global = None
                return
            self._key, self._local = key, local
            self._global = (prepared, list(plans), dataclasses.replace(metadata))

    def count(self, *, hit: bool) -> None:
        """Count a save as planned from memory or in full."""
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1


def layout_key(state_dict: dict[str, Any], mappings: Any, is_coordinator: bool
               ) -> tuple[Any, ...] | None:
    """What DCP's default save planner reads of a flattened state: equal keys, equal plans.

    Args:
        state_dict: The planner's flattened state dict.
        mappings: The flattening's mappings (``planner_data`` of the plan).
        is_coordinator: Whether this process coordinates the save.

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
    return (is_coordinator, tuple(entries), _frozen(mappings))


def _frozen(mappings: Any) -> Any:
    if isinstance(mappings, dict):
        return tuple((key, tuple(path)) for key, path in mappings.items())
    return None if mappings is None else repr(mappings)


class MemoSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that reuses the plan :class:`SavePlans` remembers.

    The plan of a save whose layout (:func:`layout_key`) equals the last one's is the
    last one's; any other save is planned by :class:`DefaultSavePlanner` in full and
    remembered. For saves of one process by itself (``no_dist``) only: the global plan
    of a collective save depends on every rank's state.

    Args:
        plans: Where plans are remembered.
    """

    def __init__(self, plans: SavePlans) -> None:
        super().__init__()
        self._plans = plans
        self._key: tuple[Any, ...] | None = None
        self._local: SavePlan | None = None
        self._hit = False

    def create_local_plan(self) -> SavePlan:
        """The remembered local plan for this layout, else DCP's (remembered once global)."""
        self._key = layout_key(self.state_dict, self.mappings, self.is_coordinator)
        remembered = self._plans.local_plan(self._key)
        self._hit = remembered is not None
        if remembered is not None:
            self.plan = remembered
            self._local = remembered
            return remembered
        self._local = super().create_local_plan()
        return self._local

    def create_global_plan(self, all_plans: list[SavePlan]
                           ) -> tuple[list[SavePlan], Metadata]:
        """The remembered global plan of the remembered local plan, else DCP's (kept)."""
        if len(all_plans) != 1 or self._local is None:
            raise ValueError("MemoSavePlanner plans the saves of one process by itself "
                             f"(got {len(all_plans)} local plans)")
        if self._hit:
            found = self._plans.global_plan(all_plans[0])
            if found is not None:
                self.global_plan, self.metadata = found
                self._plans.count(hit=True)
                return found
        plans, metadata = super().create_global_plan(all_plans)
        self._plans.remember(self._key, self._local, all_plans[0], plans, metadata)
        self._plans.count(hit=False)
        return plans, metadata
