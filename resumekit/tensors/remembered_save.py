"""A save whose every rank writes its remembered plan: one agreement instead of a round.

DCP's save loop (``dcp.save``) runs two rounds of object collectives on every save: the
plans (each rank's pickled to the coordinator, the global plan made there, each rank's
part pickled back: a gather and a scatter, each with a size exchange before it) and the
write results (gathered to the coordinator, which writes ``.metadata``, then the outcome
broadcast). When every rank's layout is unchanged (:mod:`resumekit.tensors.plans`) the
first round carries nothing but markers, yet rank 0 still receives, unpickles, answers
and pickles back one per rank: the part of a save's coordination that grows with the
world size.

:func:`save_remembered` replaces that round with **one all-reduce of four integers**:
each rank's remembered round (a number drawn from its token), and whether it can write
its remembered plan (its layout unchanged; on the coordinator, the metadata of that
round remembered too). Every rank learns at once whether all of them can:

* yes: each writes its remembered final plan; the write results (or each rank's error)
  are gathered to the coordinator (one gather of frames), which writes ``.metadata``
  (the remembered bytes where its results are the same,
  :meth:`~resumekit.tensors.plans.SavePlans.metadata_bytes`) and broadcasts the
  outcome (one framed broadcast): a failure anywhere is raised on every rank as DCP
  raises it (:class:`~torch.distributed.checkpoint.api.
  CheckpointException`, each rank's error with its traceback), so the caller's handling
  is the same;
* no (a layout changed on some rank, a rank remembers nothing, or a rank's set-up
  failed): nothing was written; every rank forgets its plans and the caller runs DCP's
  save loop, which plans in full on every rank (one round, not a refused one first).
  Where some ranks could and others not, that is said at info (a cache miss: the save is
  whole either way) and counted as a replan on the coordinator.

Only DCP's public planner and storage-writer interfaces are used, called in DCP's
order (set-up, local plan, ``prepare_local_plan`` — which makes the directory and refuses
an existing checkpoint —, finish plan, write, finish), so the files are the same, byte for
byte, as those DCP's loop writes from the same plans.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from resumekit.store.coordination import ProcessGroupCoordinator, picklable_error
from resumekit.tensors.plans import MemoSavePlanner, Round, SavePlans, Unchanged
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["save_remembered"]

logger = logging.getLogger("resumekit")

_NOTHING = -1
"""The round number of a rank that cannot write a remembered plan."""


def save_remembered(state_dict: Mapping[str, Any], writer: StorageWriter,
                    planner: MemoSavePlanner, plans: SavePlans,
                    group: dist.ProcessGroup | None, *, where: str) -> bool:
    """Write ``state_dict`` from the remembered plans if every rank can; say whether it did.

    Collective over ``group`` (at least two ranks, each calling it with its own process's
    :class:`SavePlans` of the same root).

    Args:
        state_dict: What ``dcp.save`` would be given (``Stateful`` values are asked for
            their ``state_dict()``, as DCP does).
        writer: This save's storage writer (new for this save).
        planner: This save's planner over ``plans``.
        plans: This rank's remembered plans of the root.
        group: The process group (None: the default group).
        where: The checkpoint directory (for what is said).

    Returns:
        True when the save is written (``.metadata`` too); False when some rank could not
        write a remembered plan: nothing was written and every rank forgot its plans.

    Raises:
        CheckpointException: A rank's write, or the coordinator's ``.metadata``, failed
            (raised on every rank, with every failing rank's error).
    """
    rank = dist.get_rank(group)
    coordinator = rank == 0
    token = _prepare(state_dict, writer, planner, plans, rank, where=where)
    agreed, some = _agree(token, group)
    if agreed is None:
        if some:  # a layout changed on some ranks only (as DCP's loop's PlanAgain says)
            logger.info("tensor save into %s: planned again in full, as the remembered "
                        "plans are not reusable on every rank (a rank's state changed its "
                        "layout: a key, dtype or shape)", where)
            if coordinator:
                plans.refuse()  # counted, and forgotten
        plans.forget()
        return False
    metadata = plans.metadata_of([agreed] * dist.get_world_size(group)) if coordinator \
        else None
    local: Any
    try:  # whatever fails here is this rank's answer in the gather: no rank is left waiting
        final = planner.finish_plan(SavePlan([], planner_data=Round(agreed, None),
                                             usable=False))
        future = writer.write_data(final, planner)
        future.wait()
        local = future.value()
    except BaseException as error:  # noqa: BLE001 - raised on every rank below
        local = _wrapped(error)
    # one gather of frames on gloo (the Coordinator's): gather_object all-gathers the
    # sizes first, an O(W) collective on every rank
    ranks = ProcessGroupCoordinator(group)
    gathered = ranks.gather(local)
    outcome: CheckpointException | None = None
    if gathered is not None:
        failures = {index: value for index, value in enumerate(gathered) if _is_failure(value)}
        if not failures:
            try:
                if metadata is None:  # never: the agreement says rank 0 remembers it
                    raise RuntimeError("the coordinator agreed to a remembered round whose "
                                       "metadata it no longer holds")
                writer.finish(metadata=metadata, results=gathered)
            except BaseException as error:  # noqa: BLE001 - raised on every rank below
                failures[rank] = _wrapped(error)
        if failures:
            outcome = CheckpointException("write", failures)
    # one collective on gloo (a frame carries size and pickle: the Coordinator's), not
    # broadcast_object_list's two
    told = ranks.broadcast(outcome)
    if isinstance(told, CheckpointException):
        raise told
    return True


def _prepare(state_dict: Mapping[str, Any], writer: StorageWriter,
             planner: MemoSavePlanner, plans: SavePlans, rank: int, *, where: str
             ) -> bytes | None:
    """DCP's local step; this rank's remembered round if it can write it, else None.

    A failure here is no answer of its own: the rank says it cannot (warned, naming
    ``where`` and the error), and DCP's loop, run next on every rank, raises it where it
    belongs, or saves in full if it does not recur.
    """
    coordinator = rank == 0
    try:
        planner.set_up_planner(
            state_dict={key: value.state_dict() if isinstance(value, Stateful) else value
                        for key, value in state_dict.items()},
            storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        local = planner.create_local_plan()
        if not isinstance(local.planner_data, Unchanged):
            return None
        token = local.planner_data.token
        if coordinator and not plans.coordinates(token):
            return None
        writer.prepare_local_plan(local)  # the directory made, a checkpoint there refused
        return token
    except Exception as error:  # noqa: BLE001 - DCP's loop raises it on every rank
        warn(f"tensor save into {where}: rank {rank} could not set up its remembered save "
             f"plan ({type(error).__name__}: {error}); the save is planned in full on every "
             "rank instead", ResumekitWarning)
        return None


def _agree(token: bytes | None, group: dist.ProcessGroup | None
           ) -> tuple[bytes | None, bool]:
    """The round every rank can write (or None), and whether any rank could write its own.

    One all-reduce (MIN) of four integers: the round's number and its negation (equal
    rounds everywhere when the lowest is minus the highest), and whether the rank can,
    and its negation.
    """
    number = _NOTHING if token is None else int.from_bytes(token[:7], "little")
    able = 1 if token is not None else 0
    votes = torch.tensor([number, -number, able, -able], dtype=torch.int64,
                         device=_device_of(group))
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    lowest, minus_highest, every, minus_some = (int(value) for value in votes.tolist())
    if every != 1 or lowest != -minus_highest:
        return None, minus_some == -1
    return token, True


def _device_of(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wrapped(error: BaseException) -> tuple[BaseException, traceback.StackSummary]:
    """An error as DCP gathers it: the exception and its traceback's summary.

    Each frame's code object (kept by Python 3.13 and later) is dropped: it does not
    pickle, and the summary is sent to rank 0 (DCP's own wrapper does the same). An
    exception that does not pickle is sent as a ``CoordinationError`` quoting it
    (:func:`~resumekit.store.coordination.picklable_error`): else this rank would fail
    before the gather and leave rank 0 waiting in it.
    """
    summary = traceback.extract_tb(error.__traceback__)
    for frame in summary:
        if getattr(frame, "_code", None) is not None:
            object.__setattr__(frame, "_code", None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (picklable_error(error, rank), summary)


def _is_failure(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 2
            and isinstance(value[0], BaseException)
            and isinstance(value[1], traceback.StackSummary))
