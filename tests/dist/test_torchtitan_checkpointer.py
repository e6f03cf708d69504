"""``ResumekitCheckpointer`` in torchtitan's training loop on 2 gloo ranks, under torchrun.

``tests/dist/torchtitan_trainer_runner.py`` builds torchtitan 0.3's components as its
``Trainer`` does (stock llama3 debugmodel FSDP2-sharded, ``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``, ``train_state``) and the checkpointer
from ``ResumekitCheckpointer.Config`` through ``config.build(...)``, then runs
``Trainer.train``'s loop (it says why not the ``Trainer`` itself). Every interrupted run
below ends bit-identical to one uninterrupted run: parameters, Adam state, learning rates,
scheduler, RNG, tokens seen and the next batch.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import distributed_harness as harness
from tests.limits import HANG_S, TEST_HANG_S
from tests.torchtitan_models import llama3

pytestmark = pytest.mark.timeout(TEST_HANG_S)  # hang detectors only

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "tests" / "dist" / "torchtitan_trainer_runner.py"
STEPS, INTERVAL = 8, 4


@pytest.fixture(autouse=True)
def _torchtitan() -> None:
    llama3(n_layers=1)  # skips without torchtitan's model classes (fails under CI=true)


def _launch(folder: Path, tag: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    return harness.launch_torchrun(folder, tag, [str(RUNNER), str(folder / tag)], {
        "TITAN_STEPS": str(STEPS), "TITAN_INTERVAL": str(INTERVAL), **env})


def _run(folder: Path, tag: str, **env: str) -> Path:
    process, out = _launch(folder, tag, **env)
    assert process.wait(timeout=HANG_S) == 0, harness.log_tail(out)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The reference: one run of all the steps."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    out = _run(folder, "run")
    assert [r["steps"] for r in harness.rank_records(out)] == [list(range(1, STEPS + 1))] * 2
    assert harness.committed_steps(folder / "checkpoint") == [(4, "interval"), (8, "final")]
    return harness.final_states(out)


def test_a_run_saved_at_step_4_and_continued_in_a_fresh_process_is_bit_identical(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    first = _run(tmp_path, "first", TITAN_STOP_AFTER="4")
    assert harness.committed_steps(tmp_path / "checkpoint") == [(4, "interval")]
    assert [r["steps"] for r in harness.rank_records(first)] == [[1, 2, 3, 4]] * 2

    second = _run(tmp_path, "second")
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(second)] == [
        (4, [5, 6, 7, 8])] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, harness.final_states(second),
                                                    strict=True)):
        harness.assert_identical(reference, resumed, f"rank {rank}")
    assert harness.committed_steps(tmp_path / "checkpoint") == [(4, "interval"), (8, "final")]


def test_a_sigterm_mid_run_commits_the_agreed_step_exits_75_and_the_relaunch_loses_nothing(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    process, out = _launch(tmp_path, "sigterm", TITAN_PAUSE_AT="5", TITAN_PAUSE_FOR="signal")
    harness.wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)  # the torchrun agent, which signals each rank
    assert process.wait(timeout=HANG_S) != 0
    log = (out / "log").read_text()
    records = harness.rank_records(out)
    assert [r["exit"] for r in records] == [75, 75], log[-6000:]
    agreed = records[0]["steps"][-1]
    assert records[1]["steps"][-1] == agreed >= 5  # no step lost but the one in progress
    committed = harness.committed_steps(tmp_path / "checkpoint")
    assert committed[0] == (4, "interval") and committed[-1] == (agreed, "preemption")
    # The capture at the signal (on by default) may commit step 5, the last step completed
    # when the signal came, before the ranks agree to stop at a newer one.
    assert committed[1:-1] in ([], [(5, "preemption")]), committed

    relaunch = _run(tmp_path, "relaunch")
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(relaunch)] == [
        (agreed, list(range(agreed + 1, STEPS + 1)))] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, harness.final_states(relaunch),
                                                    strict=True)):
        harness.assert_identical(reference, resumed, f"rank {rank}")


def test_a_sigkill_mid_run_resumes_from_the_newest_commit_bit_identical(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    process, out = _launch(tmp_path, "sigkill", TITAN_PAUSE_AT="6")
    harness.wait_paused(process, out)
    for rank in range(2):  # each rank, at once: no handler runs (torchrun then stops)
        os.kill(int((out / f"paused_{rank}").read_text()), signal.SIGKILL)
    assert process.wait(timeout=HANG_S) != 0
    assert harness.committed_steps(tmp_path / "checkpoint") == [(4, "interval")]

    relaunch = _run(tmp_path, "relaunch")
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, harness.final_states(relaunch),
                                                    strict=True)):
        harness.assert_identical(reference, resumed, f"rank {rank}")


def test_torchtitans_own_checkpointer_in_the_same_loop_loses_the_steps_since_its_save_and_rng(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    """The comparison of docs/integrations.md: the same SIGTERM, torchtitan's own line."""
    own = {"TITAN_CHECKPOINTER": "torchtitan"}
    process, out = _launch(tmp_path, "sigterm", TITAN_PAUSE_AT="5", **own)
    harness.wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)  # as above: the agent signals each rank
    assert process.wait(timeout=HANG_S) != 0
    assert not (out / "rank_0.json").exists()  # killed by the signal: no handler, no save
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4"]

    relaunch = _run(tmp_path, "relaunch", **own)
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2  # step 5 trained again
    resumed = harness.final_states(relaunch)
    for rank in range(2):  # the data position is restored; the RNG is not, so it diverges
        assert torch.equal(resumed[rank]["next_batch"], uninterrupted[rank]["next_batch"])
        assert not torch.equal(resumed[rank]["rng"], uninterrupted[rank]["rng"])
        assert any(not torch.equal(resumed[rank]["params"][name], value)
                   for name, value in uninterrupted[rank]["params"].items())


def _vote_backend(rank: int, world: int, folder: str) -> tuple[str, bool, bool]:
    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    model = llama3(n_layers=1)
    checkpointer = ResumekitCheckpointer.Config(enable=True, folder="unused").build(
        dataloader=None, model_parts=[model], optimizers=torch.optim.SGD(model.parameters()),
        lr_schedulers=None, states={}, sd_adapter=None, base_folder=folder)
    group = checkpointer.preemption._vote_group()
    backend = str(torch.distributed.get_backend(group))
    checkpointer.close()
    try:  # the checkpointer made the group: its close destroyed it
        torch.distributed.get_process_group_ranks(group)
        destroyed = False
    except KeyError:
        destroyed = True
    return backend, group is torch.distributed.group.WORLD, destroyed


def test_the_preemption_vote_runs_on_a_gloo_group_of_its_own_not_torchtitans_default_group(
        tmp_path: Path) -> None:
    """On GPUs torchtitan's default group is NCCL, which cannot reduce the CPU ballots.

    The checkpointer made that group: its close destroys it (issue 38).
    """
    assert harness.run_ranks(_vote_backend, 2, args=(str(tmp_path),)) == [
        ("gloo", False, True)] * 2


def _recording_vote_groups() -> list[torch.distributed.ProcessGroup]:
    """The vote groups the checkpointer makes in this rank's process, as it makes them."""
    from resumekit.integrations import torchtitan

    made: list[torch.distributed.ProcessGroup] = []
    real = torchtitan.new_save_group

    def recorded() -> torch.distributed.ProcessGroup:
        made.append(real())
        return made[-1]

    torchtitan.new_save_group = recorded  # this rank's process only
    return made


def _destroyed(group: torch.distributed.ProcessGroup) -> bool:
    try:
        torch.distributed.get_process_group_ranks(group)
    except KeyError:
        return True
    return False


def _vote_group_of_a_failed_build(rank: int, world: int, folder: str) -> tuple[str, bool]:
    from resumekit.errors import ConfigurationError
    from resumekit.integrations import torchtitan

    made = _recording_vote_groups()
    model = llama3(n_layers=1)
    refused = ""
    try:  # the local tier's directory is the durable root: refused on every rank
        torchtitan.ResumekitCheckpointer.Config(
            enable=True, folder="checkpoint", local_folder=f"{folder}/checkpoint",
            local_interval=1).build(
            dataloader=None, model_parts=[model],
            optimizers=torch.optim.SGD(model.parameters()), lr_schedulers=None, states={},
            sd_adapter=None, base_folder=folder)
    except ConfigurationError as error:
        refused = type(error).__name__
    return refused, _destroyed(made[0])  # its failed construction destroyed it


def test_a_checkpointer_whose_construction_fails_destroys_the_vote_group_it_made(
        tmp_path: Path) -> None:
    assert harness.run_ranks(_vote_group_of_a_failed_build, 2, args=(str(tmp_path),)) == [
        ("ConfigurationError", True)] * 2


def _close_whose_manager_fails(rank: int, world: int, folder: str) -> tuple[str, bool]:
    from resumekit.integrations import torchtitan

    made = _recording_vote_groups()
    model = llama3(n_layers=1)
    checkpointer = torchtitan.ResumekitCheckpointer.Config(
        enable=True, folder="checkpoint").build(
        dataloader=None, model_parts=[model], optimizers=torch.optim.SGD(model.parameters()),
        lr_schedulers=None, states={}, sd_adapter=None, base_folder=folder)
    real_close = checkpointer.manager.close
    barrier = torch.distributed.barrier

    def failing_barrier(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the vote group's meeting failed")

    def peer_died() -> None:  # what a close whose peer died raises: the meeting would too
        real_close()
        torch.distributed.barrier = failing_barrier
        raise RuntimeError("the manager's close failed: peer 1 is gone")

    checkpointer.manager.close = peer_died  # type: ignore[method-assign]
    raised = ""
    try:
        checkpointer.close()
    except RuntimeError as error:
        raised = str(error)
    finally:
        torch.distributed.barrier = barrier
    return raised, _destroyed(made[0])


def test_a_close_whose_manager_fails_raises_that_failure_and_destroys_the_vote_group(
        tmp_path: Path) -> None:
    # The vote group's meeting would fail on the same dead peer; its error must not take
    # the place of the manager's, and the group goes all the same.
    assert harness.run_ranks(_close_whose_manager_fails, 2, args=(str(tmp_path),)) == [
        ("the manager's close failed: peer 1 is gone", True)] * 2


def test_torchtitans_own_checkpointer_after_a_sigkill_resumes_its_last_save_without_the_rng(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    """The comparison of docs/integrations.md: the same SIGKILL, torchtitan's own line."""
    own = {"TITAN_CHECKPOINTER": "torchtitan"}
    process, out = _launch(tmp_path, "sigkill", TITAN_PAUSE_AT="6", **own)
    harness.wait_paused(process, out)
    for rank in range(2):
        os.kill(int((out / f"paused_{rank}").read_text()), signal.SIGKILL)
    assert process.wait(timeout=HANG_S) != 0

    relaunch = _run(tmp_path, "relaunch", **own)
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2
    resumed = harness.final_states(relaunch)
    for rank in range(2):
        assert torch.equal(resumed[rank]["next_batch"], uninterrupted[rank]["next_batch"])
        assert not torch.equal(resumed[rank]["rng"], uninterrupted[rank]["rng"])
