"""Each warning resumekit gives is printed once per rank, not as a warning plus a log line.

Finding 6 of the "any trainer" issue: with logging left unconfigured (Python's last-resort
handler prints WARNING records to stderr), every resumekit warning appeared twice per rank.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.limits import HANG_S

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
from resumekit.restore.compatibility import check_compatibility
from resumekit.store.manifest import Manifest
check_compatibility(Manifest(step=3, world_size=2, fingerprint={"params": {}}),
                    "/root/step_3", fingerprint={"config": {}, "params": {}}, world_size=4,
                    on_mismatch="error")
"""


def _stderr_of(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, check=True, timeout=HANG_S)
    return done.stderr


def test_a_world_size_warning_is_printed_once_with_logging_unconfigured() -> None:
    stderr = _stderr_of(SCRIPT)
    assert stderr.count("was written by 2 rank(s), this run has 4") == 1, stderr
    assert "ResumekitWarning" in stderr


def test_logging_capture_warnings_routes_it_into_the_log_once() -> None:
    stderr = _stderr_of("import logging; logging.basicConfig(); "
                        "logging.captureWarnings(True)\n" + SCRIPT)
    assert stderr.count("was written by 2 rank(s), this run has 4") == 1, stderr
    assert "WARNING:py.warnings" in stderr
