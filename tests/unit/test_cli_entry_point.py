"""The real entry points: ``python -m resumekit`` and the ``resumekit`` console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.limits import HANG_S
from tests.unit.test_cli_support import write_checkpoints


def test_python_dash_m_resumekit_inspects_a_root_as_json(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_checkpoints(root, [10, 20])
    done = subprocess.run([sys.executable, "-m", "resumekit", "inspect", str(root), "--json"],
                          capture_output=True, text=True, timeout=HANG_S, check=False)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["resume_from"] == 20
    assert "\x1b[" not in done.stdout  # no colour codes when piped


def test_the_console_script_exits_1_with_one_line_when_a_file_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_checkpoints(root, [10])
    state = root / "step_000000010" / "train_state.pt"
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")
    script = Path(sys.executable).with_name("resumekit")
    done = subprocess.run([str(script), "verify", str(root)], capture_output=True, text=True,
                          timeout=HANG_S, check=False)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("resumekit: error: "), done.stderr
    assert str(state) in lines[0] and "fails its checksum" in lines[0]
    assert done.stdout.startswith("FAILED  step 10")
