"""SIGKILL in the middle of the emergency write: the newest committed step stays, unrewritten.

A real trainer process (``tests/crash/emergency_trainer.py``) commits steps 2 and 4,
completes step 5 and is signalled during step 6; its capture thread copies step 5 and
writes it, and freezes at a settled point of that write (its tensor files written; or
every file written, the manifest not yet published) while step 6 trains on. The test
then sends SIGKILL and checks what a relaunch finds: steps 2 and 4 committed, byte for
byte as before, verifying; step 4 restored with the weights it was saved with; step 5's
staging area never read; and the relaunch saves on.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.crash.emergency_trainer import FREEZES, build, train
from tests.limits import HANG_S

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(HANG_S)


def _committed_bytes(root: Path) -> dict[str, str]:
    """Every file of every committed step, relative path -> sha256."""
    storage = Storage(str(root))
    digests: dict[str, str] = {}
    for entry in list_checkpoints(storage, NameFormat()):
        if entry.status != "committed":
            continue
        directory = root / entry.name
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                digests[str(path.relative_to(root))] = hashlib.sha256(
                    path.read_bytes()).hexdigest()
    return digests


def _read_until(process: subprocess.Popen[bytes], wanted: set[str]) -> list[str]:
    """The trainer's lines until every one of ``wanted`` came (a hang detector bounds it)."""
    assert process.stdout is not None
    lines: list[str] = []
    buffer = b""
    while not wanted <= set(lines):
        readable, _, _ = select.select([process.stdout], [], [], HANG_S)
        assert readable, f"the trainer said nothing for {HANG_S} s; so far {lines}"
        chunk = os.read(process.stdout.fileno(), 4096)
        assert chunk, f"the trainer ended ({process.wait()}) before {wanted}; said {lines}"
        buffer += chunk
        *done, buffer = buffer.split(b"\n")
        lines += [line.decode() for line in done]
    return lines


def _weights_after(steps: int) -> dict[str, torch.Tensor]:
    model, optimizer = build()
    for step in range(1, steps + 1):
        train(model, optimizer, step)
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("freeze", FREEZES)
def test_a_sigkill_mid_emergency_write_leaves_the_newest_commit_loadable_and_unrewritten(
        tmp_path: Path, freeze: str) -> None:
    root = tmp_path / "root"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.crash.emergency_trainer", str(root), freeze],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = _read_until(process, {f"FROZEN {freeze}", "TRAINED 6"})
        before = _committed_bytes(root)  # taken while the write is frozen
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        said = process.stderr.read().decode(errors="replace")
    assert lines[:3] == ["COMMITTED 2", "COMMITTED 4", "SIGNAL 5"], (lines, said)
    assert "emergency save of step 5" in said, said  # the write had started
    assert {path.split("/")[0] for path in before} == {
        entry.name for entry in list_checkpoints(Storage(str(root)), NameFormat())
        if entry.step in (2, 4)}
    staging = [path.name for path in root.iterdir() if ".tmp" in path.name]
    assert staging, "the frozen write left no staging area: it was not mid-write"

    # What a relaunch finds: nothing committed was rewritten or lost; step 5 never read.
    assert _committed_bytes(root) == before
    storage = Storage(str(root))
    entries = {entry.step: entry for entry in list_checkpoints(storage, NameFormat())}
    assert {step for step, entry in entries.items() if entry.status == "committed"} == {2, 4}
    for step in (2, 4):
        verify_checkpoint(storage, entries[step].name)
    model, optimizer = build()
    relaunch = CheckpointManager(root, model=model, optimizer=optimizer, save_every=2)
    assert relaunch.restore() == 4
    for name, value in _weights_after(4).items():
        assert torch.equal(model.state_dict()[name], value), name
    train(model, optimizer, 5)
    # The staging area left behind is swept, and said so; it does not stand in the way.
    with pytest.warns(ResumekitWarning, match=r"swept the abandoned staging area .*"
                                              r"step_0+5\.tmp"):
        relaunch.save(5, blocking=True)
    relaunch.close()
    committed = [entry.step for entry in relaunch.checkpoints() if entry.status == "committed"]
    assert committed[-2:] == [4, 5]
    assert {path: digest for path, digest in _committed_bytes(root).items()
            if path.split("/")[0] in {entries[2].name, entries[4].name}} == before
