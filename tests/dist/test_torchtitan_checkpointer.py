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

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from tests.distributed_harness import free_port, run_ranks
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
    out = folder / tag
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(RUNNER), str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                   "TITAN_STEPS": str(STEPS), "TITAN_INTERVAL": str(INTERVAL), **env,
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                  os.environ.get("PYTHONPATH", "")])}
    with (out / "log").open("wb") as log:
        process = subprocess.Popen(command, cwd=folder, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT)
    return process, out


def _run(folder: Path, tag: str, **env: str) -> Path:
    process, out = _launch(folder, tag, **env)
    assert process.wait(timeout=HANG_S) == 0, (out / "log").read_text()[-6000:]
    return out


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(2)]


def _committed(root: Path) -> list[tuple[int, str]]:
    return [(entry.step, str(entry.manifest.reason.value))
            for entry in list_checkpoints(Storage(root))
            if entry.status == "committed" and entry.manifest is not None]


def _wait_paused(process: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + HANG_S
    while not all((out / f"paused_{rank}").exists() for rank in range(2)):
        assert process.poll() is None, (out / "log").read_text()[-6000:]
        assert time.monotonic() < deadline, (out / "log").read_text()[-6000:]
        time.sleep(0.05)


def _assert_identical(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            _assert_identical(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and torch.equal(left, right), where
    else:
        assert left == right, where


def _final_states(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"state_{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The reference: one run of all the steps."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    out = _run(folder, "run")
    assert [r["steps"] for r in _records(out)] == [list(range(1, STEPS + 1))] * 2
    assert _committed(folder / "checkpoint") == [(4, "interval"), (8, "final")]
    return _final_states(out)


def test_a_run_saved_at_step_4_and_continued_in_a_fresh_process_is_bit_identical(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    first = _run(tmp_path, "first", TITAN_STOP_AFTER="4")
    assert _committed(tmp_path / "checkpoint") == [(4, "interval")]
    assert [r["steps"] for r in _records(first)] == [[1, 2, 3, 4]] * 2

    second = _run(tmp_path, "second")
    assert [(r["restored"], r["steps"]) for r in _records(second)] == [(4, [5, 6, 7, 8])] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, _final_states(second),
                                                    strict=True)):
        _assert_identical(reference, resumed, f"rank {rank}")
    assert _committed(tmp_path / "checkpoint") == [(4, "interval"), (8, "final")]


def test_a_sigterm_mid_run_commits_the_agreed_step_exits_75_and_the_relaunch_loses_nothing(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    process, out = _launch(tmp_path, "sigterm", TITAN_PAUSE_AT="5", TITAN_PAUSE_FOR="signal")
    _wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)  # the torchrun agent, which signals each rank
    assert process.wait(timeout=HANG_S) != 0
    log = (out / "log").read_text()
    records = _records(out)
    assert [r["exit"] for r in records] == [75, 75], log[-6000:]
    agreed = records[0]["steps"][-1]
    assert records[1]["steps"][-1] == agreed >= 5  # no step lost but the one in progress
    committed = _committed(tmp_path / "checkpoint")
    assert committed[0] == (4, "interval") and committed[-1] == (agreed, "preemption")
    # The capture at the signal (on by default) may commit step 5, the last step completed
    # when the signal came, before the ranks agree to stop at a newer one.
    assert committed[1:-1] in ([], [(5, "preemption")]), committed

    relaunch = _run(tmp_path, "relaunch")
    assert [(r["restored"], r["steps"]) for r in _records(relaunch)] == [
        (agreed, list(range(agreed + 1, STEPS + 1)))] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, _final_states(relaunch),
                                                    strict=True)):
        _assert_identical(reference, resumed, f"rank {rank}")


def test_a_sigkill_mid_run_resumes_from_the_newest_commit_bit_identical(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    process, out = _launch(tmp_path, "sigkill", TITAN_PAUSE_AT="6")
    _wait_paused(process, out)
    for rank in range(2):  # each rank, at once: no handler runs (torchrun then stops)
        os.kill(int((out / f"paused_{rank}").read_text()), signal.SIGKILL)
    assert process.wait(timeout=HANG_S) != 0
    assert _committed(tmp_path / "checkpoint") == [(4, "interval")]

    relaunch = _run(tmp_path, "relaunch")
    assert [(r["restored"], r["steps"]) for r in _records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2
    for rank, (reference, resumed) in enumerate(zip(uninterrupted, _final_states(relaunch),
                                                    strict=True)):
        _assert_identical(reference, resumed, f"rank {rank}")


def test_torchtitans_own_checkpointer_in_the_same_loop_loses_the_steps_since_its_save_and_rng(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    """The comparison of docs/integrations.md: the same SIGTERM, torchtitan's own line."""
    own = {"TITAN_CHECKPOINTER": "torchtitan"}
    process, out = _launch(tmp_path, "sigterm", TITAN_PAUSE_AT="5", **own)
    _wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)  # as above: the agent signals each rank
    assert process.wait(timeout=HANG_S) != 0
    assert not (out / "rank_0.json").exists()  # killed by the signal: no handler, no save
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4"]

    relaunch = _run(tmp_path, "relaunch", **own)
    assert [(r["restored"], r["steps"]) for r in _records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2  # step 5 trained again
    resumed = _final_states(relaunch)
    for rank in range(2):  # the data position is restored; the RNG is not, so it diverges
        assert torch.equal(resumed[rank]["next_batch"], uninterrupted[rank]["next_batch"])
        assert not torch.equal(resumed[rank]["rng"], uninterrupted[rank]["rng"])
        assert any(not torch.equal(resumed[rank]["params"][name], value)
                   for name, value in uninterrupted[rank]["params"].items())


def _vote_backend(rank: int, world: int, folder: str) -> tuple[str, bool]:
    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    model = llama3(n_layers=1)
    checkpointer = ResumekitCheckpointer.Config(enable=True, folder="unused").build(
        dataloader=None, model_parts=[model], optimizers=torch.optim.SGD(model.parameters()),
        lr_schedulers=None, states={}, sd_adapter=None, base_folder=folder)
    group = checkpointer.preemption._vote_group()
    checkpointer.close()
    return str(torch.distributed.get_backend(group)), group is torch.distributed.group.WORLD


def test_the_preemption_vote_runs_on_a_gloo_group_of_its_own_not_torchtitans_default_group(
        tmp_path: Path) -> None:
    """On GPUs torchtitan's default group is NCCL, which cannot reduce the CPU ballots."""
    assert run_ranks(_vote_backend, 2, args=(str(tmp_path),)) == [("gloo", False)] * 2


def test_torchtitans_own_checkpointer_after_a_sigkill_resumes_its_last_save_without_the_rng(
        tmp_path: Path, uninterrupted: list[dict[str, Any]]) -> None:
    """The comparison of docs/integrations.md: the same SIGKILL, torchtitan's own line."""
    own = {"TITAN_CHECKPOINTER": "torchtitan"}
    process, out = _launch(tmp_path, "sigkill", TITAN_PAUSE_AT="6", **own)
    _wait_paused(process, out)
    for rank in range(2):
        os.kill(int((out / f"paused_{rank}").read_text()), signal.SIGKILL)
    assert process.wait(timeout=HANG_S) != 0

    relaunch = _run(tmp_path, "relaunch", **own)
    assert [(r["restored"], r["steps"]) for r in _records(relaunch)] == [
        (4, [5, 6, 7, 8])] * 2
    resumed = _final_states(relaunch)
    for rank in range(2):
        assert torch.equal(resumed[rank]["next_batch"], uninterrupted[rank]["next_batch"])
        assert not torch.equal(resumed[rank]["rng"], uninterrupted[rank]["rng"])
