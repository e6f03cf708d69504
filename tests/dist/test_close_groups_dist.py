"""``CheckpointManager.close`` destroys the process groups it made, once, on 2 gloo ranks.

A manager makes gloo groups of its own: the main channel's (without
:func:`~resumekit.init_distributed`'s checkpoint group or a ``process_group``), the background
saves', the local tier's and the emergency capture's. A group left alive keeps its sockets
and its threads until the interpreter's static destructors tear them down at exit, racing
(issue 38: a rare ``terminate called without an active exception`` at shutdown), and a
process that opens manager after manager grows its socket count. ``close`` destroys each
after the threads that use it stopped; a constructor that fails destroys them too. A group
the caller passed, and :func:`~resumekit.init_distributed`'s, stay the caller's.

Each group a manager makes is recorded, by a weak reference, by wrapping
``torch.distributed.new_group`` (the real one runs): a group destroyed and no longer
referenced is freed, with its sockets and threads; one ``torch.distributed`` still knows
(not destroyed) stays referenced by its registry.
"""

from __future__ import annotations

import gc
import os
import stat
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import resumekit
from resumekit.local.replicas import NODE_NAME_ENV
from resumekit.runtime.distributed import current_context
from tests.distributed_harness import run_ranks
from tests.limits import HANG_S

OPENINGS = 5


def _open_sockets() -> int:
    """The socket descriptors this process holds (``/proc/self/fd``)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode):
                count += 1
        except FileNotFoundError:  # the listing's own descriptor, closed since
            pass
    return count


def _record_new_groups() -> list[weakref.ref[dist.ProcessGroup]]:
    """Record every group made from here on (the real ``new_group`` makes it), weakly."""
    made: list[weakref.ref[dist.ProcessGroup]] = []
    real = dist.new_group

    def recording(*args: Any, **kwargs: Any) -> dist.ProcessGroup:
        group: dist.ProcessGroup = real(*args, **kwargs)
        made.append(weakref.ref(group))
        return group

    dist.new_group = recording  # this rank's process only
    return made


def _alive(made: list[weakref.ref[dist.ProcessGroup]]) -> int:
    """How many of the groups recorded still exist (not destroyed, or still referenced)."""
    gc.collect()
    return sum(ref() is not None for ref in made)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``torch.distributed`` still knows ``group`` (it was not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except KeyError:
        return False
    return True


def _manager(root: str, rank: int, tmp: str, **knobs: Any) -> resumekit.CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 8)).square().mean()
    loss.backward()
    optimizer.step()  # the optimizer has state: the emergency capture takes its template
    # Durable saves every 2 steps: the first save of a run is a local one, whose claim on the
    # main channel every rank makes (a background save's claim on its own channel, racing
    # it, would leave a rank that saw the fence claimed skip it: another issue's).
    return resumekit.CheckpointManager(
        root, model=model, optimizer=optimizer, save_every=2, async_save=True,
        preemption=resumekit.PreemptionHandler(grace_period=600, poll_every=1),
        capture_at_signal=True, local=resumekit.LocalTier(f"{tmp}/node{rank}", save_every=1),
        **knobs)


def _open_and_close(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ[NODE_NAME_ENV] = f"node{rank}"
    made = _record_new_groups()
    sockets, alive, per_manager = [], [], []
    for opening in range(OPENINGS):
        before = len(made)
        ckpt = _manager(f"{tmp}/durable{opening}", rank, f"{tmp}/local{opening}")
        ckpt.restore()
        ckpt.step_end(1)  # a local save, a capture template
        ckpt.step_end(2)  # a background save, a local save
        ckpt.close()
        ckpt.close()  # idempotent: nothing destroyed twice
        per_manager.append(len(made) - before)
        alive.append(_alive(made))
        sockets.append(_open_sockets())
    dist.barrier()  # the default group still works
    return {"sockets": sockets, "alive": alive, "per_manager": per_manager}


def test_a_manager_opened_and_closed_five_times_destroys_its_groups_and_keeps_no_socket(
        tmp_path: Path) -> None:
    for rank, facts in enumerate(run_ranks(_open_and_close, world_size=2,
                                           args=(str(tmp_path),))):
        # main, background saves, local tier, emergency capture
        assert facts["per_manager"] == [4] * OPENINGS, (rank, facts)
        assert facts["alive"] == [0] * OPENINGS, (rank, facts)
        assert facts["sockets"] == [facts["sockets"][0]] * OPENINGS, (rank, facts)


def _given_groups_survive(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ[NODE_NAME_ENV] = f"node{rank}"
    mine = dist.new_group(backend="gloo")
    made = _record_new_groups()
    with _manager(f"{tmp}/given", rank, tmp, process_group=mine) as ckpt:
        ckpt.restore()
        ckpt.step_end(1)
        ckpt.step_end(2)
    given_alive = _registered(mine)
    dist.barrier(group=mine)  # still usable
    dist.destroy_process_group(mine)
    return {"given_alive": given_alive, "made": len(made),
            "made_alive": _alive(made)}


def _init_distributed_groups_survive(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ[NODE_NAME_ENV] = f"node{rank}"
    resumekit.init_distributed(timeout=HANG_S)
    context = current_context()
    assert context is not None and context.checkpoint_group is not None
    made = _record_new_groups()
    with _manager(f"{tmp}/init", rank, tmp) as ckpt:
        ckpt.restore()
        ckpt.step_end(1)
        ckpt.step_end(2)
    facts = {"checkpoint_alive": _registered(context.checkpoint_group),
             "default_alive": dist.is_initialized(), "made": len(made),
             "made_alive": _alive(made)}
    resumekit.shutdown()  # meets on the checkpoint group: it still works
    return facts


def test_close_leaves_the_group_passed_in_and_init_distributeds_groups_to_their_owner(
        tmp_path: Path) -> None:
    for facts in run_ranks(_given_groups_survive, world_size=2, args=(str(tmp_path),)):
        # the main channel is the group given: background saves, local tier, emergency
        assert facts == {"given_alive": True, "made": 3, "made_alive": 0}
    for facts in run_ranks(_init_distributed_groups_survive, world_size=2,
                           args=(str(tmp_path),), init_group=False):
        assert facts == {"checkpoint_alive": True, "default_alive": True, "made": 3,
                         "made_alive": 0}


def _constructor_fails(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ[NODE_NAME_ENV] = f"node{rank}"
    made = _record_new_groups()
    sockets = _open_sockets()
    handler = resumekit.PreemptionHandler(grace_period=600)
    model = nn.Linear(8, 8)
    with pytest.raises(resumekit.ConfigurationError, match=r"local\.root"):
        resumekit.CheckpointManager(  # the local root inside the durable root: refused
            f"{tmp}/durable", model=model, async_save=True, preemption=handler,
            local=resumekit.LocalTier(f"{tmp}/durable/node{rank}", save_every=1))
    return {"made": len(made), "made_alive": _alive(made),
            "sockets_grew": _open_sockets() - sockets, "installed": handler.installed}


def test_a_constructor_that_fails_destroys_the_groups_it_made_and_removes_its_handler(
        tmp_path: Path) -> None:
    for facts in run_ranks(_constructor_fails, world_size=2, args=(str(tmp_path),)):
        # main and background saves made before the local root was refused
        assert facts == {"made": 2, "made_alive": 0, "sockets_grew": 0, "installed": False}
