"""Reading torchrun / SLURM / single-process launches from the environment (one process)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from resumekit.errors import DistributedSetupError, ResumekitError
from resumekit.runtime.distributed import (
    before_meet,
    checkpoint_group,
    current_context,
    init_distributed,
    meet,
    shutdown,
)
from resumekit.runtime.launch import (
    DEFAULT_SLURM_PORT_BASE,
    LaunchEnvironment,
    detect_launch,
    expand_nodelist,
    slurm_default_port,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29500",
}
SRUN = {
    "SLURM_JOB_ID": "111859",
    "SLURM_PROCID": "6",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}
LAUNCH_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
)


def test_torchrun_variables_give_rank_local_rank_and_store_address() -> None:
    assert detect_launch(TORCHRUN) == LaunchEnvironment(
        "torchrun", 5, 8, 1, 4, "node01", 29500, node_rank=1, num_nodes=2
    )


def test_torchrun_workers_use_the_agents_store_and_know_their_restart_attempt() -> None:
    env = {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    launch = detect_launch(env)
    assert (launch.agent_store, launch.restart_count) == (True, 2)
    assert (detect_launch(TORCHRUN).agent_store, detect_launch(TORCHRUN).restart_count) == (
        False, 0,
    )


def test_torchrun_inside_sbatch_wins_over_the_slurm_procid_every_worker_shares() -> None:
    # sbatch + torchrun: the batch step's SLURM_PROCID=0 is seen by every torchrun worker.
    env = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", **TORCHRUN}
    launch = detect_launch(env)
    assert (launch.launcher, launch.rank, launch.local_rank) == ("torchrun", 5, 1)


def test_srun_variables_give_rank_and_the_first_node_as_store_host() -> None:
    launch = detect_launch(SRUN)
    assert launch == LaunchEnvironment(
        "slurm", 6, 8, 2, 4, "gpu07", slurm_default_port("111859"), node_rank=1, num_nodes=2
    )


def test_srun_prefers_the_step_variables_over_the_job_ones() -> None:
    env = {
        **SRUN,
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_NODELIST": "gpu[08,11]",
        "SLURM_STEP_TASKS_PER_NODE": "5,3",
        "MASTER_PORT": "23456",
    }
    assert detect_launch(env) == LaunchEnvironment(
        "slurm", 6, 8, 2, 3, "gpu08", 23456, node_rank=1, num_nodes=2
    )


def test_torchrun_across_nodes_gives_the_node_rank_and_count_from_its_group_variables() -> None:
    # torchrun --nnodes=3 --nproc_per_node=2, this agent got group rank 2 of 3.
    env = {**TORCHRUN, "RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "3"}
    launch = detect_launch(env)
    assert (launch.node_rank, launch.num_nodes) == (2, 3)


def test_torchrun_without_group_variables_derives_the_node_from_the_local_world_size() -> None:
    env = {**TORCHRUN, "RANK": "7", "LOCAL_RANK": "3"}  # 8 ranks, 4 per node
    launch = detect_launch(env)
    assert (launch.node_rank, launch.num_nodes) == (1, 2)


def test_srun_across_three_nodes_meets_on_the_first_node_of_the_compact_node_list() -> None:
    # srun --nodes=3 --ntasks-per-node=1 on host[1-3]: the task on host3.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "1(x3)",
           "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "host[1-3]"}
    launch = detect_launch(env)
    assert launch == LaunchEnvironment(
        "slurm", 2, 3, 0, 1, "host1", slurm_default_port("7"), node_rank=2, num_nodes=3
    )


def test_srun_without_a_node_count_takes_it_from_the_node_list() -> None:
    env = {k: v for k, v in SRUN.items()}
    assert detect_launch(env).num_nodes == 2  # gpu[07-08]


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({**TORCHRUN, "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"}, "GROUP_RANK"),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "9"}, "GROUP_WORLD_SIZE"),
        ({**TORCHRUN, "GROUP_RANK": "one"}, "GROUP_RANK"),
        ({**SRUN, "SLURM_NNODES": "1"}, "SLURM_NODEID"),
        ({**SRUN, "SLURM_NNODES": "0"}, "SLURM_NNODES"),
    ],
)
def test_an_inconsistent_node_rank_or_count_is_an_error_naming_the_variable(
    env: dict[str, str], variable: str
) -> None:
    with pytest.raises(DistributedSetupError, match=variable) as caught:
        detect_launch(env)
    assert caught.value.variable == variable


def test_master_addr_in_the_environment_overrides_the_slurm_node_list() -> None:
    assert detect_launch({**SRUN, "MASTER_ADDR": "10.0.0.7"}).master_addr == "10.0.0.7"


def test_the_slurm_default_port_is_derived_from_the_job_id_below_the_ephemeral_range() -> None:
    assert slurm_default_port("111859") == DEFAULT_SLURM_PORT_BASE + 1859
    assert all(15000 <= slurm_default_port(str(job)) < 25000 for job in (0, 9999, 10**9 + 7))


def test_no_launcher_variables_mean_a_single_process() -> None:
    assert detect_launch({"HOME": "/root", "SLURM_JOB_ID": "5"}).launcher == "single"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node-[1,3]-ib", ["node-1-ib", "node-3-ib"]),
    ],
)
def test_a_slurm_node_list_expands_to_host_names(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist", ["", "node[01-04", "node01]", "node[4-1]", "node[a-b]", "a,,b"]
)
def test_a_malformed_node_list_is_an_error_naming_the_variable(nodelist: str) -> None:
    with pytest.raises(DistributedSetupError, match="SLURM_JOB_NODELIST") as caught:
        expand_nodelist(nodelist)
    assert caught.value.variable == "SLURM_JOB_NODELIST"


@pytest.mark.parametrize(
    ("change", "variable"),
    [
        ({"RANK": None}, "RANK"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE"),
        ({"RANK": "five"}, "RANK"),
        ({"WORLD_SIZE": "8.0"}, "WORLD_SIZE"),
        ({"RANK": "8"}, "RANK"),
        ({"RANK": "-1"}, "RANK"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK"),
        ({"RANK": "0", "LOCAL_RANK": "1"}, "LOCAL_RANK"),
        ({"LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE"),
        ({"MASTER_PORT": None}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    ],
)
def test_a_bad_torchrun_environment_is_an_error_naming_the_variable(
    change: dict[str, str | None], variable: str
) -> None:
    env = {**TORCHRUN}
    for name, value in change.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    with pytest.raises(DistributedSetupError, match=variable) as caught:
        detect_launch(env)
    assert caught.value.variable == variable


@pytest.mark.parametrize(
    ("change", "variable"),
    [
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID"),
        ({"SLURM_NTASKS": "eight"}, "SLURM_NTASKS"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID"),
        ({"SLURM_TASKS_PER_NODE": "4x2"}, "SLURM_TASKS_PER_NODE"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": None}, "MASTER_PORT"),
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST"),
    ],
)
def test_a_bad_slurm_environment_is_an_error_naming_the_variable(
    change: dict[str, str | None], variable: str
) -> None:
    env = {**SRUN}
    for name, value in change.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    with pytest.raises(DistributedSetupError, match=variable) as caught:
        detect_launch(env)
    assert caught.value.variable == variable


def test_a_setup_error_survives_pickling_with_its_variable() -> None:
    with pytest.raises(DistributedSetupError) as caught:
        detect_launch({"WORLD_SIZE": "2"})
    copy = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copy, ResumekitError)
    assert (copy.variable, str(copy)) == ("RANK", str(caught.value))


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert current_context() is None
    yield
    shutdown()


@pytest.mark.parametrize("timeout", [0, -1.0, timedelta(0), timedelta(seconds=-5)])
def test_a_timeout_that_is_not_positive_is_refused(single_process: None, timeout: object) -> None:
    with pytest.raises(DistributedSetupError, match="timeout") as caught:
        init_distributed(timeout)  # type: ignore[arg-type]
    assert caught.value.variable == "timeout"
    with pytest.raises(DistributedSetupError, match="checkpoint_timeout"):
        init_distributed(checkpoint_timeout=timeout)  # type: ignore[arg-type]
    assert current_context() is None


def test_a_timeout_that_is_not_a_number_is_refused(single_process: None) -> None:
    with pytest.raises(DistributedSetupError, match="timeout"):
        init_distributed("10 minutes")  # type: ignore[arg-type]


def test_a_single_process_gets_a_context_without_any_process_group(single_process: None) -> None:
    context = init_distributed(timeout=30, device="cpu")
    assert (context.rank, context.world_size, context.launcher) == (0, 1, "single")
    assert context.device == torch.device("cpu")
    assert context.checkpoint_group is None and checkpoint_group() is None
    assert not context.is_distributed and context.is_leader
    assert not torch.distributed.is_initialized()
    reasons: list[str] = []
    with before_meet(reasons.append):
        meet(reason="end of restore")
    assert reasons == ["end of restore"]


def test_a_second_call_with_the_same_arguments_returns_the_same_context(
    single_process: None,
) -> None:
    first = init_distributed(timedelta(seconds=30), device="cpu")
    assert init_distributed(30.0, device="cpu") is first
    assert current_context() is first


def test_a_second_call_with_other_arguments_is_an_error(single_process: None) -> None:
    init_distributed(timeout=30, device="cpu")
    with pytest.raises(DistributedSetupError, match="already called with different arguments"):
        init_distributed(timeout=60, device="cpu")


def test_shutdown_forgets_the_context_and_may_be_called_twice(single_process: None) -> None:
    init_distributed(device="cpu")
    shutdown()
    shutdown()
    assert current_context() is None


def test_asking_for_nccl_without_cuda_is_an_error_naming_the_backend(
    single_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(DistributedSetupError, match="nccl") as caught:
        init_distributed(backend="nccl")
    assert caught.value.variable == "backend"
    assert current_context() is None
