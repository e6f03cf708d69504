"""The Accelerate example of docs/integrations.md, run unchanged under real torchrun launches.

The block is cut from the page and run by ``tests/dist/accelerate_drill.py`` (hooks only:
pause at a step, record what happened). One uninterrupted 2-process run with synchronous
saves is the reference; another is sent SIGTERM (an agreed ``preemption`` checkpoint,
exit 75), relaunched, SIGKILLed between two checkpoints (async saves) and relaunched:
everything ends bit for bit equal. The preemption checkpoint also resumes on 1 process,
and a fine-tune starts from the reference run's weights. This replaces
``test_accelerate_resume.py``, which ran the former snippet (batches drawn from the
sampler by hand, no prepared DataLoader) in the test harness rather than under torchrun.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.lingbot.drill import kill_tree
from resumekit.store.catalog import read_manifest
from resumekit.store.storage import Storage
from tests.distributed_harness import free_port, wait_paused
from tests.limits import HANG_S, TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)

REPO_ROOT = Path(__file__).resolve().parents[2]
DRILL = REPO_ROOT / "tests" / "dist" / "accelerate_drill.py"
NUM_STEPS = 10
LAUNCH_TIMEOUT_S = HANG_S  # a hang detector


def _doc_script(folder: Path) -> Path:
    """The first python block of the "## Accelerate" section, written to ``train.py``."""
    page = (REPO_ROOT / "docs" / "integrations.md").read_text()
    section = page[page.index("## Accelerate\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    script = folder / "train.py"
    script.write_text(match.group(1))
    return script


@dataclass
class Launch:
    """One torchrun launch of the script in ``folder`` (its root: ``folder/run``)."""

    folder: Path
    nproc: int = 2

    def start(self, tag: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.folder / tag
        out.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(self.nproc), "--master-addr", "127.0.0.1", "--master-port",
                   str(free_port()), str(DRILL), str(_doc_script(self.folder)), str(out)]
        environment = {**os.environ, **env, "OMP_NUM_THREADS": "1",
                       "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU, also on a GPU machine
                       "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                      os.environ.get("PYTHONPATH", "")])}
        log = (out / "log").open("wb")
        process = subprocess.Popen(command, cwd=self.folder, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT)
        return process, out

    def run(self, tag: str, **env: str) -> tuple[int, list[dict[str, Any]], str]:
        process, out = self.start(tag, **env)
        code = process.wait(timeout=LAUNCH_TIMEOUT_S)
        return code, self.records(out), (out / "log").read_text()

    def records(self, out: Path) -> list[dict[str, Any]]:
        return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(self.nproc)]


def _newest(root: Path) -> tuple[int, str]:
    storage = Storage(root)
    names = sorted((p.name for p in root.iterdir() if p.name.startswith("step_")),
                   reverse=True)
    manifest = read_manifest(storage, names[0])
    return manifest.step, str(manifest.reason.value)


def _assert_same(got: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key, value in expected.items():
            _assert_same(got[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == expected, where


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("reference")
    code, records, log = Launch(folder).run("uninterrupted", DRILL_SYNC="1")
    assert code == 0, log
    return folder, records


def test_the_documented_accelerate_run_preempted_then_killed_ends_bit_identical_on_two_ranks(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    launch = Launch(tmp_path)
    # SIGTERM to the torchrun agent while every rank waits at step 1: the ranks agree on
    # step 1 itself (the first vote blocks: nothing measured yet), commit a preemption
    # checkpoint of it and exit 75.
    process, out = launch.start("sigterm", DRILL_PAUSE_AT="1")
    wait_paused(process, out, 2)
    os.kill(process.pid, signal.SIGTERM)
    assert process.wait(timeout=LAUNCH_TIMEOUT_S) != 0
    term = launch.records(out)
    assert [r["exit"] for r in term] == [75, 75], (out / "log").read_text()
    assert _newest(tmp_path / "run") == (1, "preemption")
    shutil.copytree(tmp_path / "run", tmp_path / "one_rank" / "run")  # for the 1-rank test
    # Relaunched: resumes at 1 (mid-epoch 0), commits 3 and 6 in the background, and is
    # SIGKILLed at step 7 (mid-epoch 1), after the commit of 6 - steps past it are lost.
    process, out = launch.start("sigkill", DRILL_PAUSE_AT="7")
    wait_paused(process, out, 2)
    kill_tree(process.pid)
    assert process.wait(timeout=LAUNCH_TIMEOUT_S) == -signal.SIGKILL
    assert _newest(tmp_path / "run") == (6, "interval")
    code, final, log = launch.run("relaunch")
    assert code == 0, log
    for rank, (got, expected) in enumerate(zip(final, reference[1], strict=True)):
        assert got["restored"] == 6
        assert got["positions"][0] == (7, 1, 36)  # epoch 1 went on where it stopped
        assert got["final"]["step"] == expected["final"]["step"] == NUM_STEPS
        _assert_same(got["final"], expected["final"], f"rank {rank}")
    assert _newest(tmp_path / "run") == (NUM_STEPS, "final")


def test_the_preemption_checkpoint_of_two_ranks_resumes_on_one_rank_in_the_same_order(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.getbasetemp()
    copies = sorted(folder.glob("*/one_rank/run"))
    if not copies:  # the 2-rank test did not run first: make the checkpoint here
        launch = Launch(tmp_path_factory.mktemp("preempted"))
        process, out = launch.start("sigterm", DRILL_PAUSE_AT="1")
        wait_paused(process, out, 2)
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=LAUNCH_TIMEOUT_S)
        copies = [launch.folder / "run"]
    one = tmp_path_factory.mktemp("one")
    shutil.copytree(copies[0], one / "run")
    code, records, log = Launch(one, nproc=1).run("resume")
    assert code == 0, log
    assert "was written by 2 rank(s), this run has 1" in log  # said, never silent
    (record,) = records
    assert record["restored"] == 1
    # Step 2 on one process: 2 micro-batches of 3 samples after the 12 consumed on two.
    assert record["positions"][0] == (2, 0, 18)
    assert record["final"]["step"] == NUM_STEPS


def test_a_fine_tune_starts_from_the_reference_runs_weights_on_two_ranks(
    reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    # A requeue of the fine-tune resuming its own checkpoint (load_weights loads nothing
    # then) is tested with FSDP2 in tests/dist/test_any_trainer_dist.py.
    folder, records = reference
    code, tuned, log = Launch(tmp_path).run("tune", INIT_FROM=str(folder / "run"))
    assert code == 0, log
    for record, source in zip(tuned, records, strict=True):
        assert record["restored"] == 0 and record["loaded"] == NUM_STEPS
        _assert_same(record["model_after_load"], source["final"]["model"], "loaded")
        assert record["final"]["step"] == NUM_STEPS
