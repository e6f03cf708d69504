"""A real SIGTERM on a bandwidth-bounded store, with a real SIGKILL when the grace ends.

The trainer (``tests/e2e/grace_drill.py``) saves about 12.6 MB of state through a writer
bounded to 4.2 MB/s (a save's writes take about 3 s) and arms a watchdog that kills it
when the grace period ends. With a window that holds the saves, no preemption loses a
step, and a relaunch decides from the rate its restored checkpoint recorded. With a window
that holds the save in flight but not a new one after it, the trainer says so at the
signal with the numbers, lets the save in flight commit, starts nothing that would be cut,
and leaves no staging directory; the checkpoint it kept restores. A requeued process whose
recorded rate says its first save would be cut does not start it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from resumekit.runtime.preemption import SAVE_TIME_MARGIN
from tests.limits import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[2]
BANDWIDTH = 4.2e6  # bytes/s: about 3 s for the drill's state


def _drill(root: Path, grace: float, *signal_after: int) -> list[dict[str, Any]]:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "tests.e2e.grace_drill", str(root),
               "--bandwidth", str(BANDWIDTH), "--grace", str(grace)]
    for steps in signal_after:
        command += ["--signal-after", str(steps)]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=environment,
                               capture_output=True, text=True, timeout=HANG_S, check=False)
    # -9: the watchdog killed it at the end of the grace period (a save was cut).
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-4000:])
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    records: list[dict[str, Any]] = report["records"]
    return records


def test_when_the_saves_fit_the_grace_window_no_sigterm_loses_a_step(tmp_path: Path) -> None:
    # Signalled at step 7 (the save of step 5 may still be writing), then, relaunched, two
    # steps after the restore: a 30 s window holds either.
    first, second = _drill(tmp_path, 30.0, 7, 2)
    for record in (first, second):
        assert record["stopped_at"] - record["signalled_after"] in (0, 1), record
        assert record["newest_committed"] == record["stopped_at"], record
        assert record["skipped"] == [] and record["staging_left"] == [], record
    assert second["restored"] == first["newest_committed"]
    # The relaunch knew its root's rate before saving anything: from the manifest.
    assert any(f"step {second['restored']}, recorded before this restart" in line
               for line in second["log"]), second["log"]


def test_when_a_new_save_would_be_cut_it_is_not_started_and_the_save_in_flight_commits(
    tmp_path: Path,
) -> None:
    # 5.5 s of grace: the save of step 10 in flight (about 3 s) fits, a save of step 11
    # after it (3 s more, x SAVE_TIME_MARGIN) does not. Then a relaunch only restores.
    preempted, relaunched = _drill(tmp_path, 5.5, 11, 0)
    assert preempted["stopped_at"] == preempted["signalled_after"] == 11, preempted
    [warning] = preempted["skipped"]
    assert warning.startswith("skipping the emergency save at step 11: a save would write "
                              "12.6 MB at the measured "), warning
    for words in ("MB/s (the background save of step 5, which overlapped training: a lower "
                  "bound", "after the in-flight save of step 10 (about",
                  f"x {SAVE_TIME_MARGIN} margin =",
                  "s left of the 5.5 s grace period, so it is not started",
                  "the in-flight save of step 10 is left to complete and stays the newest "
                  "checkpoint"):
        assert words in warning, (words, warning)
    assert any(warning in line for line in preempted["log"])  # and the log line
    assert preempted["newest_committed"] == 10  # the save in flight committed
    assert preempted["staging_left"] == []
    assert relaunched["restored"] == 10 and relaunched["newest_committed"] == 10


def test_a_requeued_process_does_not_start_a_save_its_recorded_rate_says_would_be_cut(
    tmp_path: Path,
) -> None:
    # The first job commits steps 5 and 7; the requeued one is signalled 2 steps after its
    # restore with 2.5 s left: a 3 s save would be cut by the kill. Before the rate was
    # recorded, a fresh process knew no save time, started the save and was killed in it
    # (exit -9, a staging directory of step 9 left).
    _drill(tmp_path, 30.0, 7)
    [requeued] = _drill(tmp_path, 2.5, 2)
    assert (requeued["restored"], requeued["stopped_at"]) == (7, 9), requeued
    [warning] = requeued["skipped"]
    assert "step 7, recorded before this restart" in warning, warning
    assert "step 7 stays the newest checkpoint" in warning, warning
    assert requeued["newest_committed"] == 7 and requeued["staging_left"] == []
