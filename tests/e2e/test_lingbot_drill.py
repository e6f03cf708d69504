"""The ``make demo`` drill judges what was committed, whatever the emergency-save rule decided.

The drill's first run on a fresh machine failed: SIGTERM at step 2, the ranks agreed at
step 6, resumekit skipped the emergency save (checkpoint 5 was recent), run C resumed from
5 - and the drill compared C as if it switched to one rank at 6 (``FAIL run C: DIFFERS
before the switch (step 6)``). Here the skip is forced, not timed: a grace period of a
nanosecond is over before any save could start, so resumekit's "no time" rule skips the
emergency save on every machine, whatever the load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.lingbot import drill
from examples.lingbot.train import METRICS_FILE, read_metrics
from tests.limits import HANG_S, TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)  # a hang detector: the drill takes ~90 s when idle


def test_the_drill_passes_when_the_emergency_save_is_skipped_and_cuts_run_c_where_it_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "demo"
    # SIGTERM once step 6 is logged: checkpoint 5 is committed, the agreed step is later.
    status = drill.main(["--out", str(out), "--term-at", "6", "--grace-period", "1e-9",
                         "--timeout", str(HANG_S)])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert status == 0, printed[-6000:]
    assert summary["problems"] == []

    reference, term, kill, finish, resumed = summary["segments"]
    assert reference["run"] == "A"
    assert (term["run"], term["interruption"]) == ("B", "sigterm")
    # The save was skipped: the newest checkpoint is older than the step the ranks stopped at.
    assert term["last_step"] >= 6
    assert term["newest_checkpoint"] < term["last_step"]
    assert term["newest_reason"] == "interval"
    log = Path(term["log"]).read_text()
    assert (f"emergency save skipped, newest checkpoint is step {term['newest_checkpoint']}"
            in log)
    assert "note: the emergency save of step" in printed

    # C resumed from that checkpoint, and the drill cut its comparison there.
    assert resumed["run"] == "C"
    assert resumed["resumed_from"] == term["newest_checkpoint"] == summary["switch"]
    records = read_metrics(out / "C" / METRICS_FILE)
    assert [r["world_size"] for r in records] == (
        [2] * summary["switch"] + [1] * (len(records) - summary["switch"]))
    assert summary["replayed"]["C"] == term["last_step"] - summary["switch"]
    assert f"= A to step {summary['switch']}, then close" in printed
    # B, stopped without the emergency save and killed later, is still A in every bit.
    assert summary["comparisons"]["B"]["first_metric_difference"] is None
    assert summary["comparisons"]["B"]["tensors_different"] == 0
    # The kill waited for a step the relaunch logged, not a stale one of the SIGTERM launch.
    assert kill["interruption"] == "sigkill"
    assert kill["signal_at"] > term["last_step"]
    assert finish["returncode"] == 0
