"""Lightning DDP on 2 CPU processes (gloo) with ``ResumekitCallback``: SIGTERM on one rank
is an agreed emergency save and exit 75 on both, a SIGKILL loses only the steps since the
last commit, and the twice-interrupted run ends bit for bit where the uninterrupted one
ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resumekit.runtime.preemption import EXIT_CODE_PREEMPTED
from resumekit.store.catalog import list_checkpoints
from resumekit.store.manifest import SaveReason
from resumekit.store.storage import Storage
from tests.distributed_harness import free_port
from tests.limits import HANG_S, TEST_HANG_S

WORKER = Path(__file__).with_name("lightning_ddp_worker.py")
REPO = Path(__file__).resolve().parents[2]  # the worker imports tests.lightning_noisy
STEPS = 16  # 64 samples, 2 ranks x 4 a batch: 8 steps an epoch
#: Five launches (nine processes importing Lightning); in `make test` it shares the cores
#: with the other suites' workers.
pytestmark = pytest.mark.timeout(TEST_HANG_S)


def _launch(root: Path, out: Path, action: str, world: int = 2, **extra: str
            ) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
               "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": "resumekit-test",
               "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                           os.environ.get("PYTHONPATH")])),
               **extra}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(root), str(out), str(STEPS), action], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    codes = []
    for proc in procs:
        output, _ = proc.communicate(timeout=HANG_S)
        codes.append(proc.returncode)
        if proc.returncode not in (0, EXIT_CODE_PREEMPTED):
            print(output.decode(errors="replace")[-4000:])
    return codes


def _committed(root: Path) -> dict[int, SaveReason]:
    return {e.step: e.manifest.reason for e in list_checkpoints(Storage(root))
            if e.status == "committed" and e.manifest is not None}


def test_lightning_ddp_after_sigterm_and_sigkill_ends_bit_for_bit_as_uninterrupted(
    tmp_path: Path
) -> None:
    reference = tmp_path / "reference.pt"
    assert _wait(_launch(tmp_path / "ref" / "root", reference, "none")) == [0, 0]

    root = tmp_path / "run" / "root"
    final = tmp_path / "final.pt"
    # SIGTERM reaches rank 1 only: both ranks agree, save one step, and exit 75.
    assert _wait(_launch(root, final, "sigterm:5:1")) == [EXIT_CODE_PREEMPTED] * 2
    committed = _committed(root)
    assert committed == {4: SaveReason.INTERVAL, 5: SaveReason.PREEMPTION}
    # The same checkpoint resumes on one rank: a correct continuation to the last step.
    one = tmp_path / "one" / "root"
    shutil.copytree(root, one)  # the root alone: resumed by naming it (no "last" marker)
    assert _wait(_launch(one, tmp_path / "one.pt", "none", world=1,
                         RESUME_FROM=str(one))) == [0]
    assert max(_committed(one)) == STEPS
    assert {e.manifest.world_size for e in list_checkpoints(Storage(one))
            if e.status == "committed" and e.manifest and e.step > 5} == {1}
    # The relaunch resumes it; rank 0 is SIGKILLed after step 10 (step 8 committed):
    # the job is gone (torchrun's agent would end the other rank: so does the test).
    procs = _launch(root, final, "sigkill:10:0")
    procs[0].communicate(timeout=HANG_S)
    assert procs[0].returncode == -signal.SIGKILL
    if procs[1].poll() is None:
        procs[1].kill()
    procs[1].communicate(timeout=HANG_S)
    assert max(_committed(root)) == 8
    # The last relaunch resumes step 8 and finishes.
    assert _wait(_launch(root, final, "none")) == [0, 0]
    assert max(_committed(root)) == STEPS
    expected = torch.load(reference, weights_only=True)
    got = torch.load(final, weights_only=True)
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
