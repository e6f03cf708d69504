"""DCP's save planner, planning a save of an unchanged structure only once per process.

A steady-state save of a sharded run writes the same structure every time: the same
keys, shapes, dtypes and DTensor placements, only other values. Planning it is most of a
small save's cost (on 2 gloo ranks, of a ~100 ms save of the LingBot tiny trainer: each
rank's local plan ~20 ms, the coordinator's global plan ~16 ms, pickling the plans to and
from it ~10 ms). :class:`StructureCachingSavePlanner` is DCP's :class:`DefaultSavePlanner`
with DCP's own plan caching turned on (unchanged local plans travel as empty plans, the
coordinator reuses its global plan and metadata), plus one step DCP does not cache: a rank
whose state has the structure of its previous successful save reuses that save's local
plan instead of building one write item per tensor again.

What "the same structure" means is :func:`structure_key`: every flattened key with its
nesting path, and per value its kind (plain tensor, DTensor, anything else pickled as
bytes), shape, dtype, layout, ``requires_grad``, pinning, and for DTensors the placements,
the mesh and this rank's coordinate in it — every input of DCP's local plan. A value of
any other tensor subclass, or one that plans its own writes, makes the key None: such a
save is planned as DCP always does.

The cache has one slot per process group (its name and ranks), or per named owner whose
saves never overlap (a manager: its background and foreground saves run one at a time on
two groups of the same ranks), and keeps one structure per slot: two states saved in turn
in one slot are each planned in full, which is correct, only not faster. DCP's caches are
class-level dicts without locks, so saves that can run at the same time must never share
a slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

__all__ = ["SLOTS_KEPT", "StructureCachingSavePlanner", "completed_saves", "forget_plans",
           "forget_replay_record", "replay_record", "set_replay_record", "slot_of",
           "structure_key", "touch"]

#: ``slot -> (structure key, local plan, DTensor shard offsets by key)`` of each group's
#: last successful save on this rank.
_LOCAL_PLANS: dict[str, tuple[Hashable, SavePlan, dict[str, Any]]] = {}


#: Slots remembered at most (a process saving to many roots keeps the newest ones).
SLOTS_KEPT = 8

#: ``slot -> record`` of the last planned save, as :mod:`resumekit.tensors.replayed_save` replays it
#: (that module's record type; kept here so that forgetting a slot forgets it too).
_REPLAYS: dict[str, Any] = {}

#: ``slot -> planned saves completed in it`` (never reset: the same on every rank of a
#: group, which runs the same saves in the same order).
_COMPLETED: dict[str, int] = {}

_DCP_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
               "_cached_metadata", "_cached_final_save_plan")


def forget_plans(slots: list[str] | None = None) -> None:
    """Drop remembered plans (this process's), DCP's cached ones included.

    Args:
        slots: Only these slots; None: every slot of this module.
    """
    chosen = None if slots is None else set(slots)
    for slot in [slot for slot in _LOCAL_PLANS if chosen is None or slot in chosen]:
        del _LOCAL_PLANS[slot]
    for slot in [slot for slot in _REPLAYS if chosen is None or slot in chosen]:
        del _REPLAYS[slot]
    for cache in _DCP_CACHES:
        store = getattr(DefaultSavePlanner, cache, None)
        if isinstance(store, dict):
            for slot in [slot for slot in store if str(slot).startswith(_SLOT_PREFIX)
                         and (chosen is None or slot in chosen)]:
                del store[slot]


def completed_saves(slot: str) -> int:
    """How many planned saves completed in ``slot`` in this process (the same on every rank)."""
    return _COMPLETED.get(slot, 0)


def replay_record(slot: str) -> Any:
    """The replay record :func:`set_replay_record` left for ``slot``, or None."""
    return _REPLAYS.get(slot)


def set_replay_record(slot: str, record: Any, *, count: bool = True) -> None:
    """Count a completed planned save in ``slot``; keep ``record`` (None: forget it).

    Args:
        slot: The cache slot.
        record: The record to keep, or None.
        count: Count a completed planned save (or a restored checkpoint the record was
            made from); False only updates the record kept (every rank must count alike).
    """
    if count:
        _COMPLETED[slot] = _COMPLETED.get(slot, 0) + 1
    if record is None:
        _REPLAYS.pop(slot, None)
    else:
        _REPLAYS[slot] = record


def forget_replay_record(slot: str) -> None:
    """Forget ``slot``'s replay record (a replayed save failed: plan the next in full)."""
    _REPLAYS.pop(slot, None)


def touch(slot: str) -> None:
    """Make ``slot`` the newest used; forget the oldest slots beyond :data:`SLOTS_KEPT`.

    Every rank of a group runs the same saves in the same order, so every rank forgets
    the same slots at the same save: no rank ever sends an "unchanged" plan for a slot
    its coordinator has forgotten.
    """
    _SLOTS_USED.pop(slot, None)
    _SLOTS_USED[slot] = None
    if len(_SLOTS_USED) > SLOTS_KEPT:
        oldest = list(_SLOTS_USED)[:len(_SLOTS_USED) - SLOTS_KEPT]
        for name in oldest:
            del _SLOTS_USED[name]
        forget_plans(oldest)


#: The slots in the order they were last used (oldest first).
_SLOTS_USED: dict[str, None] = {}


_SLOT_PREFIX = "resumekit-structure-cached:"


def slot_of(group: dist.ProcessGroup | None, owner: str | None) -> str:
    """The cache slot of saves on ``group`` by ``owner`` (see :func:`_slot`)."""
    return _slot(group, owner)


def _slot(group: dist.ProcessGroup | None, owner: str | None) -> str:
    """The cache slot of saves on ``group``: the same string on every rank of it.

    ``owner`` names one writer whose saves never overlap (a manager's root): its saves
    on two groups of the same ranks (its background group and its main one) share plans.
    Without it, each group has its own slot.
    """
    if not dist.is_initialized():
        return f"{_SLOT_PREFIX}{owner or ''}:no-dist"
    group = group if group is not None else dist.group.WORLD
    if group is None:
        return f"{_SLOT_PREFIX}{owner or ''}:no-group"
    ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
    return f"{_SLOT_PREFIX}{owner if owner is not None else group.group_name}:{ranks}"


def _tensor_key(value: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(value.shape), value.dtype, value.layout, value.requires_grad,
            value.device.type == "cpu" and value.is_pinned())


def _mesh_key(value: DTensor, meshes: dict[int, tuple[Any, ...]]) -> tuple[Any, ...]:
    mesh = value.device_mesh
    found = meshes.get(id(mesh))
    if found is None:
        coordinate = mesh.get_coordinate()
        found = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()),
                 tuple(mesh.mesh.shape), mesh.mesh_dim_names,
                 None if coordinate is None else tuple(coordinate))
        meshes[id(mesh)] = found
    return found


ChunksByLayout = dict[tuple[Any, ...], list[ChunkStorageMetadata]]


def dtensor_chunks(value: DTensor, memo: ChunksByLayout) -> list[ChunkStorageMetadata]:
    """``value.__create_chunk_list__()``, worked out once per layout in ``memo``.

    A ``DTensor``'s local chunk depends only on its global shape, its placements and
    its mesh (this rank's coordinate in it): tensors that share those share it, and DCP's
    ~45 µs per tensor is paid once per layout.
    """
    layout = (tuple(value.shape), tuple(value.placements), id(value.device_mesh))
    chunks = memo.get(layout)
    if chunks is None:
        chunks = memo[layout] = value.__create_chunk_list__()
    return chunks


def structure_key(state_dict: dict[str, Any], mappings: dict[str, Any] | None,
                  is_coordinator: bool) -> Hashable | None:
    """Everything DCP's local save plan of the flattened ``state_dict`` depends on.

    Args:
        state_dict: The flattened state (DCP's ``flatten_state_dict``).
        mappings: Its flattening map (each key's nesting path), part of the plan.
        is_coordinator: Whether this rank coordinates (part of the plan's inputs).

    Returns:
        A hashable key, or None when some value is a tensor subclass other than
        DTensor or plans its own writes (``__create_write_items__``): then nothing is
        cached.
    """
    meshes: dict[int, tuple[Any, ...]] = {}
    leaves: list[tuple[Any, ...]] = []
    for fqn, value in state_dict.items():
        kind = type(value)
        if kind is DTensor:
            local = value._local_tensor
            leaves.append((fqn, "dtensor", tuple(value.shape), _tensor_key(local),
                           tuple(value.placements), _mesh_key(value, meshes)))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            leaves.append((fqn, "tensor", _tensor_key(value)))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            leaves.append((fqn, "bytes"))
    paths = () if mappings is None else tuple(sorted(mappings.items()))
    return (is_coordinator, tuple(leaves), paths)


class StructureCachingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with DCP's plan caching and a remembered local plan.

    Args:
        group: The process group the save runs on (None: the default group or none).
        owner: Names a writer whose saves never run at the same time (see
            :func:`resumekit.tensors.sharded.save`'s ``plan_owner``); None: plans are the group's.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, owner: str | None = None
                 ) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = _slot(group, owner)
        self._structure: Hashable | None = None
        self.structure: Hashable | None = None
        """The structure key of the state this planner planned (None: not cacheable)."""
        self._planned: SavePlan | None = None
        self._shards: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, without rebuilding a flattened state that holds no ``ShardedTensor``.

        DCP flattens the state, then walks the flattened state once more to split
        ``ShardedTensor`` values, building a new dictionary of the very same entries when
        there is none (a third of a small save's planning); that walk runs only for a
        state that has one.
        """
        if not (self.flatten_state_dict and self.flatten_sharded_tensors):
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        flat, self.mappings = flatten_state_dict(state_dict)
        if any(isinstance(value, ShardedTensor) for value in flat.values()):
            flat = _flatten_sharded_tensors(flat)
        self.state_dict = flat
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """This rank's plan: an empty one when the structure is that of its last save."""
        key = structure_key(self.state_dict, getattr(self, "mappings", None),
                            self.is_coordinator)
        self.structure = key
        remembered = _LOCAL_PLANS.get(self._cached_plans_key)
        if key is not None and remembered is not None and remembered[0] == key:
            self.plan, self._shards = remembered[1], remembered[2]
            return SavePlan([], usable=False)  # DCP: "unchanged, use the cached plans"
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        self._structure, self._planned = key, plan
        self._shards = {item.index.fqn: item.index.offset for item in plan.items
                        if type(self.state_dict.get(item.index.fqn)) is DTensor}
        return plan

    @property
    def slot(self) -> str:
        """The cache slot this planner's saves use."""
        return self._cached_plans_key

    @property
    def shards(self) -> dict[str, Any]:
        """This rank's DTensor shard offsets by key, of the plan in use."""
        return self._shards

    @shards.setter
    def shards(self, shards: dict[str, Any]) -> None:
        self._shards = shards

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The value ``index`` names; this rank's shard of a DTensor without a dispatch.

        DCP finds a DTensor's shard by computing its chunk list and returning
        ``to_local()`` (an autograd call) when the offsets match; the plan was made from
        this structure, so the shard it names is the local tensor itself.
        """
        value = self.state_dict.get(index.fqn)
        if type(value) is DTensor and index.offset is not None and \
                self._shards.get(index.fqn) == index.offset:
            return value._local_tensor
        return super().lookup_object(index)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's final plan (its cached one when unchanged); remember this rank's plan."""
        finished = super().finish_plan(new_plan)
        if self._planned is not None:
            _LOCAL_PLANS.pop(self._cached_plans_key, None)
            if self._structure is not None:
                _LOCAL_PLANS[self._cached_plans_key] = (self._structure, self._planned,
                                                        self._shards)
            self._planned = None
        touch(self._cached_plans_key)
        return finished
