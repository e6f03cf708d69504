"""init_distributed on two real gloo ranks: torchrun, srun, sbatch + torchrun, errors."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resumekit.errors import CoordinationError, DistributedSetupError
from resumekit.runtime.distributed import (
    checkpoint_group,
    current_context,
    init_distributed,
    meet,
    preemption_group,
    shutdown,
)
from resumekit.runtime.launch import slurm_default_port
from tests.distributed_harness import _entry, free_port, run_ranks

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _sum_over(group: dist.ProcessGroup | None, rank: int) -> int:
    value = torch.tensor([rank + 1])
    dist.all_reduce(value, group=group)
    return int(value.item())


def _torchrun_worker_inside_sbatch(rank: int, world_size: int) -> dict[str, object]:
    # The batch step's variables: every torchrun worker inherits SLURM_PROCID=0.
    os.environ.update({
        "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[01-02]",
    })
    context = init_distributed(timeout=timedelta(seconds=30), checkpoint_timeout=600)
    same = init_distributed(timeout=30.0, checkpoint_timeout=timedelta(minutes=10))
    try:
        init_distributed(timeout=31)
        conflict = "no error"
    except DistributedSetupError as error:
        conflict = str(error)
    facts = {
        "rank": context.rank,
        "world_size": context.world_size,
        "local_rank": context.local_rank,
        "launcher": context.launcher,
        "backend": context.backend,
        "device": str(context.device),
        "same_object": same is context and current_context() is context,
        "conflict": conflict,
        "checkpoint_backend": str(dist.get_backend(checkpoint_group())),
        "groups_distinct": len({id(dist.group.WORLD), id(checkpoint_group()),
                                id(preemption_group())}) == 3,
        "sums": [_sum_over(None, rank), _sum_over(checkpoint_group(), rank),
                 _sum_over(preemption_group(), rank)],
    }
    shutdown()
    facts["initialized_after_shutdown"] = dist.is_initialized()
    facts["context_after_shutdown"] = current_context()
    return facts


def _run_requiring_clean_exit(fn: object, world_size: int) -> list[object]:
    """Like run_ranks, but also fail if a rank exits non-zero or aborts after returning."""
    with tempfile.TemporaryDirectory() as out_dir:
        # join=True raises ProcessExitedException on a non-zero exit status or a signal.
        mp.start_processes(
            _entry,
            args=(fn, world_size, (), free_port(), out_dir, False, 120.0, {}),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            status, value = pickle.loads((Path(out_dir) / f"rank{rank}.pkl").read_bytes())
            assert status == "ok", value
            results.append(value)
        return results


def test_torchrun_workers_inside_sbatch_get_their_own_ranks_and_separate_gloo_groups() -> None:
    results = _run_requiring_clean_exit(_torchrun_worker_inside_sbatch, world_size=2)
    for rank, facts in enumerate(results):
        assert isinstance(facts, dict)
        assert facts["rank"] == facts["local_rank"] == rank
        assert (facts["world_size"], facts["launcher"]) == (2, "torchrun")
        assert (facts["backend"], facts["device"]) == ("gloo", "cpu")
        assert facts["same_object"] is True
        assert "already called with different arguments" in str(facts["conflict"])
        assert facts["checkpoint_backend"] == "gloo"
        assert facts["groups_distinct"] is True
        assert facts["sums"] == [3, 3, 3]
        assert facts["initialized_after_shutdown"] is False
        assert facts["context_after_shutdown"] is None


def _join_through_the_agent_store(rank: int, world_size: int) -> int:
    init_distributed(timeout=30)
    total = _sum_over(checkpoint_group(), rank) + _sum_over(None, rank)
    shutdown()
    return total


def test_torchrun_workers_join_through_the_agents_store_again_after_a_restart() -> None:
    # The test process plays torchrun's agent: it serves the store; every worker is a
    # client, and the store (with the first attempt's keys) outlives the worker restart.
    port = free_port()
    agent_store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    for attempt in ("0", "1"):
        env = {
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": attempt,
        }
        assert run_ranks(
            _join_through_the_agent_store, world_size=2, init_group=False, env=env
        ) == [6, 6]
    assert agent_store.check(["resumekit/attempt-1/init/all-arrived"])


def _join_after_a_restart_counted_on_one_node_only(rank: int, world_size: int) -> int:
    # A multi-node in-job restart: the node whose worker failed counts a restart, the node
    # restarted for the membership change does not.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(rank)
    init_distributed(timeout=30, checkpoint_timeout=30)  # split ranks: a 30 s timeout
    total = _sum_over(checkpoint_group(), rank) + _sum_over(None, rank)
    shutdown()
    return total


def test_a_restart_counted_on_one_node_only_still_meets_on_the_store_rank_0_serves() -> None:
    # torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each attempt's rank 0 serves a
    # new store, so the per-node restart counts (0 here, 1 there) must not split the ranks.
    env = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert run_ranks(_join_after_a_restart_counted_on_one_node_only, world_size=2,
                     init_group=False, env=env) == [6, 6]


def _as_srun_task(rank: int, world_size: int, job_id: str) -> tuple[str, int, int]:
    for name in (*TORCHRUN_VARIABLES, "MASTER_PORT"):
        os.environ.pop(name)
    os.environ.update({
        "SLURM_JOB_ID": job_id,
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(world_size),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": str(world_size),
        "SLURM_JOB_NODELIST": "localhost",
    })
    context = init_distributed(timeout=30)
    total = _sum_over(None, rank)
    shutdown()
    return context.launcher, context.rank, total


def _free_port_in_slurm_range() -> int:
    for job_id in range(int(time.time()) % 10000, 10000):
        port = slurm_default_port(str(job_id))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port in the SLURM default range")


def test_srun_tasks_meet_on_the_first_node_at_the_port_derived_from_the_job_id() -> None:
    job_id = str(_free_port_in_slurm_range())
    results = run_ranks(_as_srun_task, world_size=2, args=(job_id,), init_group=False)
    assert results == [("slurm", 0, 3), ("slurm", 1, 3)]


def _start_late(rank: int, world_size: int, late_s: float) -> int:
    if rank == 1:
        time.sleep(late_s)  # a node that boots late; rank 0 is already waiting in init
    init_distributed(timeout=late_s / 2)
    total = _sum_over(None, rank)
    shutdown()
    return total


def test_ranks_starting_two_training_timeouts_apart_still_form_the_group() -> None:
    assert run_ranks(_start_late, world_size=2, args=(4.0,), init_group=False) == [3, 3]


def _start_late_with_a_short_checkpoint_timeout(rank: int, world_size: int, late_s: float) -> int:
    if rank == 1:
        time.sleep(late_s)  # a node that boots late; rank 0 is already waiting in init
    init_distributed(timeout=600, checkpoint_timeout=late_s / 4)
    total = _sum_over(checkpoint_group(), rank)
    shutdown()
    return total


def test_a_short_checkpoint_timeout_does_not_fail_a_start_within_the_training_timeout() -> None:
    # A checkpoint timeout chosen short, to catch a hung peer quickly, bounds the save and
    # restore collectives; the start-up meeting waits for the longer of the two timeouts.
    assert run_ranks(_start_late_with_a_short_checkpoint_timeout, world_size=2, args=(4.0,),
                     init_group=False) == [3, 3]


def _use_occupied_port(rank: int, world_size: int, port: int) -> str:
    os.environ["MASTER_PORT"] = str(port)
    try:
        init_distributed(timeout=5, checkpoint_timeout=5)
    except DistributedSetupError as error:
        return f"{error.variable}|{error}"
    return "no error"


def test_a_rendezvous_port_in_use_is_an_error_naming_master_addr_and_port() -> None:
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        [outcome] = run_ranks(_use_occupied_port, world_size=1, args=(port,), init_group=False)
    variable, message = outcome.split("|", 1)
    assert variable == "MASTER_PORT"
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in message


def _adopt(rank: int, world_size: int) -> tuple[str, int, bool]:
    context = init_distributed(timeout=120)
    total = _sum_over(checkpoint_group(), rank)
    shutdown()
    return context.backend, total, dist.is_initialized()


def test_a_default_group_created_by_the_trainer_is_adopted_and_left_to_it() -> None:
    assert run_ranks(_adopt, world_size=2) == [("gloo", 3, True), ("gloo", 3, True)]


def _miss_the_meeting(rank: int, world_size: int, shared: str) -> str:
    init_distributed(timeout=60, checkpoint_timeout=2)
    outcome = Path(shared) / "outcome"
    if rank == 0:
        try:
            meet(reason="end of restore from step_000000100")
            message = "met"
        except CoordinationError as error:
            message = f"{error.reason}|{error}"
        partial = outcome.with_suffix(".partial")
        partial.write_text(message)
        partial.rename(outcome)
        return message
    deadline = time.monotonic() + 120
    while not outcome.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 1 "never finishes loading" until rank 0 gave up
    return "stayed away"


def test_a_rank_that_never_arrives_makes_meet_fail_with_the_meeting_reason(
    tmp_path: Path,
) -> None:
    results = run_ranks(_miss_the_meeting, world_size=2, args=(str(tmp_path),), init_group=False)
    reason, message = results[0].split("|", 1)
    assert reason == "end of restore from step_000000100"
    assert "did not all meet" in message and "0:00:02" in message


def _join_split_on_the_agent_store(rank: int, world_size: int) -> str:
    # Two "nodes" of one rank each; only node 1 counted the restart.
    os.environ.update({"TORCHELASTIC_RESTART_COUNT": str(rank), "GROUP_RANK": str(rank),
                       "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    try:
        init_distributed(timeout=5, checkpoint_timeout=5)
    except DistributedSetupError as error:
        return str(error)
    shutdown()
    return "met"


def test_a_restart_counted_on_one_node_only_on_the_agents_store_fails_naming_the_cure() -> None:
    # torchrun's agents share one store: the per-node restart counts (0 here, 1 there)
    # split the ranks; the error says why and what to set, within the rendezvous budget.
    port = free_port()
    agent_store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    env = {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    said = run_ranks(_join_split_on_the_agent_store, world_size=2, init_group=False, env=env)
    assert said[0].startswith("only 1 of 2 ranks reached the rendezvous store"), said[0]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" not in said[0]  # attempt 0: no hint
    assert "restart 1 as node 1 counts it" in said[1], said[1]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said[1], said[1]
    del agent_store
