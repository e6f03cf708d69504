"""torchtitan's own ``Trainer``, its checkpointer resumekit's by one config line, on 2 gloo ranks.

``tests/dist/torchtitan_real_trainer_runner.py`` runs ``torchtitan.train.main``'s path
(``ConfigManager`` -> ``config.build()`` -> ``Trainer.train()`` -> ``close()``) under
torchrun on CPU, with the shims its docstring lists (each with the error it avoids);
``tests/dist/torchtitan_trainer_config.py`` is the ``--module`` config: torchtitan's
``llama3_debugmodel()`` (2 of its layers, FSDP2 over the 2 ranks) with
``checkpoint=ResumekitCheckpointer.Config(...)``. The trainer's forward, backward, loss,
gradient clipping, ``OptimizersContainer``, ``LRSchedulersContainer``, data loader and
``train_state`` are torchtitan's.

One run of 10 steps uninterrupted; one run SIGTERMed mid-training (every rank exits 75 from
the agreed preemption save), relaunched, SIGKILLed (the torchrun agent and every worker, by
pid: torchrun puts workers in sessions of their own) and relaunched to the end. Its final
parameters, Adam state, learning rates, scheduler, RNG, train state, data position and the
losses it logged are bit-identical to the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests import distributed_harness as harness
from tests.limits import HANG_S, TEST_HANG_S
from tests.torchtitan_models import llama3

pytestmark = pytest.mark.timeout(TEST_HANG_S)  # hang detectors only

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "tests" / "dist" / "torchtitan_real_trainer_runner.py"
CONFIG = ["--module", "tests.dist.torchtitan_trainer_config", "--config",
          "resumekit_debugmodel"]
STEPS, INTERVAL = 10, 3
LOSS = re.compile(r"step:\s*(\d+)\s+\S*loss:\s*([0-9.]+)")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer folder (``hf_assets_path``), after checking torchtitan imports."""
    llama3(n_layers=1)  # skips without torchtitan's model classes (fails under CI=true)
    folder = tmp_path_factory.mktemp("assets")
    from tests.dist.torchtitan_real_trainer_runner import write_tokenizer

    write_tokenizer(folder)
    return folder


def _launch(folder: Path, tag: str, assets: Path,
            **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    return harness.launch_torchrun(folder, tag, [str(RUNNER), *CONFIG], {
        "TITAN_OUT": str(folder / tag), "TITAN_ASSETS": str(assets),
        "TITAN_STEPS": str(STEPS), "TITAN_INTERVAL": str(INTERVAL), **env})


def _run(folder: Path, tag: str, assets: Path, **env: str) -> Path:
    process, out = _launch(folder, tag, assets, **env)
    assert process.wait(timeout=HANG_S) == 0, harness.log_tail(out)
    return out


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + HANG_S
    while Path(f"/proc/{pid}").exists() and \
            Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"pid {pid} outlived its SIGKILL"
        time.sleep(0.05)


def _losses(out: Path) -> dict[int, str]:
    """The loss torchtitan logged at each step (both ranks log the same global loss)."""
    losses: dict[int, set[str]] = {}
    for step, loss in LOSS.findall(re.sub(r"\x1b\[[0-9;]*m", "", (out / "log").read_text())):
        losses.setdefault(int(step), set()).add(loss)
    assert all(len(values) == 1 for values in losses.values()), losses
    return {step: values.pop() for step, values in losses.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory,
                  assets: Path) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The reference: torchtitan's trainer through all the steps in one launch."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    out = _run(folder, "run", assets)
    assert [(r["restored"], r["steps"], r["exit"]) for r in harness.rank_records(out)] == [
        (0, list(range(1, STEPS + 1)), 0)] * 2
    assert harness.committed_steps(folder / "checkpoint") == [
        (3, "interval"), (6, "interval"), (9, "interval"), (10, "final")]
    losses = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return harness.final_states(out), losses


def test_torchtitans_trainer_sigtermed_then_sigkilled_and_relaunched_ends_bit_identical(
        tmp_path: Path, assets: Path,
        uninterrupted: tuple[list[dict[str, Any]], dict[int, str]]) -> None:
    reference, reference_losses = uninterrupted
    root = tmp_path / "checkpoint"

    # 1. SIGTERM to the torchrun agent (it signals each worker) while the workers wait
    # before step 5: they train step 5, agree on it, commit it and exit 75.
    process, out = _launch(tmp_path, "sigterm", assets, TITAN_PAUSE_AT="4",
                           TITAN_PAUSE_FOR="signal")
    harness.wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=HANG_S) != 0
    records = harness.rank_records(out)
    assert [r["exit"] for r in records] == [75, 75], harness.log_tail(out)
    agreed = records[0]["steps"][-1]
    assert records[1]["steps"] == records[0]["steps"] == list(range(1, agreed + 1))
    assert 5 <= agreed < 9, harness.log_tail(out)  # no step lost but the one in progress
    # The capture at the signal (on by default) may also commit step 4, the last step
    # completed when the signal came, before the ranks agree on a newer one.
    committed = [entry for entry in harness.committed_steps(root) if entry != (4, "preemption")]
    assert committed == [(3, "interval")] + [(6, "interval")] * (agreed > 6) + [
        (agreed, "preemption")], harness.committed_steps(root)

    # 2. Relaunched: resumes at the agreed step; SIGKILLed, every process of the tree,
    # while the workers wait before step 9 (steps 7 and 8 trained, not committed).
    process, out = _launch(tmp_path, "sigkill", assets, TITAN_PAUSE_AT="8")
    workers = harness.wait_paused(process, out)
    for pid in [process.pid, *workers]:  # no handler runs anywhere
        os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=HANG_S) == -signal.SIGKILL
    for pid in workers:
        _wait_gone(pid)
    assert not (out / "rank_0.json").exists() and not (out / "rank_1.json").exists()
    committed = harness.committed_steps(root)
    assert committed[-1] == (6, "interval") if agreed < 6 else (agreed, "preemption")
    newest = committed[-1][0]

    # 3. Relaunched to the end: from the newest commit, bit-identical.
    out = _run(tmp_path, "relaunch", assets)
    assert [(r["restored"], r["steps"]) for r in harness.rank_records(out)] == [
        (newest, list(range(newest + 1, STEPS + 1)))] * 2
    for rank, (expected, resumed) in enumerate(zip(reference, harness.final_states(out),
                                                   strict=True)):
        harness.assert_identical(expected, resumed, f"rank {rank}")
    losses = _losses(out)
    assert losses == {step: reference_losses[step] for step in range(newest + 1, STEPS + 1)}
    assert harness.committed_steps(root)[-2:] == [(9, "interval"), (10, "final")]
