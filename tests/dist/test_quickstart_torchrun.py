"""The quickstart's FSDP2 block, run as written under torchrun: preempted, resumed, done.

The block is cut from docs/quickstart.md and run by ``tests/dist/quickstart_runner.py``
(one hook: each rank pauses after a step until it holds the signal). Two ranks on CPU
(gloo), ``num_workers=4``: SIGTERM goes to the torchrun agent, which forwards it to each
rank's process group - DataLoader workers included. Before resumekit made the workers of
its ``data=`` loader ignore the preemption signals they died of it and both ranks raised
``DataLoader worker (pid ...) is killed by signal: Terminated``, nothing saved. Now the
ranks agree on a later step, commit it as ``preemption`` and exit 75; the relaunch runs to
the end and ``finish()`` commits the last step as ``final``; a third launch of the finished
run trains and saves nothing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.distributed_harness import (
    committed_steps,
    launch_torchrun,
    log_tail,
    rank_records,
    wait_paused,
)
from tests.limits import HANG_S, TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)  # hang detectors only: ~1 min when idle

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "tests" / "dist" / "quickstart_runner.py"
PAUSE_AT = 5


def _doc_script(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The python block of "## FSDP2 on a cluster", as ``train.py``, and its constants."""
    page = (REPO_ROOT / "docs" / "quickstart.md").read_text()
    section = page[page.index("## FSDP2 on a cluster\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    code = match.group(1)
    constants = {name: eval(value) for name, value in  # noqa: S307 - our own page
                 re.findall(r"^([A-Z_]+) = (\S+)", code, re.M)}
    script = folder / "train.py"
    script.write_text(code)
    return script, constants


def _launch(folder: Path, tag: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    script, _ = _doc_script(folder)
    return launch_torchrun(folder, tag, [str(RUNNER), str(script), str(folder / tag)], env)


def test_the_quickstart_fsdp2_block_survives_a_sigterm_to_torchrun_with_loader_workers(
    tmp_path: Path,
) -> None:
    _, constants = _doc_script(tmp_path)
    root = tmp_path / constants["ROOT"]
    num_steps = constants["NUM_STEPS"]

    process, out = _launch(tmp_path, "sigterm", QUICKSTART_PAUSE_AT=str(PAUSE_AT))
    wait_paused(process, out)
    os.kill(process.pid, signal.SIGTERM)  # the agent, which signals each rank's group
    assert process.wait(timeout=HANG_S) != 0
    log = (out / "log").read_text()
    records = rank_records(out)
    assert [r["exit"] for r in records] == [75, 75], log[-6000:]
    assert "killed by signal" not in log and "DataLoader worker" not in log, log[-6000:]
    agreed = records[0]["steps"][-1]
    assert records[1]["steps"][-1] == agreed > PAUSE_AT  # more batches after the signal
    assert f"preemption agreed at step {agreed}" in log
    assert committed_steps(root)[-1] == (agreed, "preemption")

    process, out = _launch(tmp_path, "relaunch")
    assert process.wait(timeout=HANG_S) == 0, log_tail(out)
    assert [r["restored"] for r in rank_records(out)] == [agreed, agreed]
    assert [r["exit"] for r in rank_records(out)] == [0, 0]
    finished = committed_steps(root)
    assert finished[-1] == (num_steps, "final")

    # A relaunch of the finished run (a late requeue): restores the final step, trains
    # nothing, saves nothing.
    process, out = _launch(tmp_path, "finished")
    assert process.wait(timeout=HANG_S) == 0, log_tail(out)
    assert [(r["restored"], r["steps"], r["exit"]) for r in rank_records(out)] == [
        (num_steps, [], 0), (num_steps, [], 0)]
    assert committed_steps(root) == finished
