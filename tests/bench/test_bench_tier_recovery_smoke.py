"""``python -m benchmarks.tier_recovery`` at a tiny size: one job, two in-job restarts.

No speed is asserted (wall-clock figures on a shared machine mean nothing): that the first
restart restores from the local tier and the second, the local tier lost, from the durable
root, each at the step the schedule says, and that the results name both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import nas, tier_recovery
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)

STAND_IN = nas.missing() is None


def test_the_first_restart_reads_the_local_tier_and_the_second_the_durable_root(
        tmp_path: Path) -> None:
    out = tmp_path / "tier_recovery.json"
    (tmp_path / "work").mkdir()
    tier_recovery.main(["--state-mb", "4", "--bandwidth-mbs", "50", "--steps", "6",
                        "--durable-every", "2", "--crash-local", "3", "--crash-durable", "5",
                        "--local", str(tmp_path), "--bench-dir", str(tmp_path / "work"),
                        "--out", str(out), *([] if STAND_IN else ["--no-stand-in"])])
    results = json.loads(out.read_text())
    found = [(r["tiers"], r["restored_step"]) for r in results["recoveries"]]
    # Local copy of step 3 (durable 2); then durable step 4 (local copies of 4-5 lost).
    assert found == [(["local"], 3), (["durable"], 4)], results["recoveries"]
    for recovery in results["recoveries"]:
        assert 0 < recovery["restore_s"] <= recovery["kill_to_restored_s"]
        assert recovery["kill_to_restored_s"] < recovery["kill_to_first_step_s"]
    assert set(results["summary"]) == {"durable_vs_local_restore_s",
                                       "durable_vs_local_kill_to_first_step_s"}
    assert results["state_bytes_per_rank"] > 0
    assert not any(Path(tmp_path).glob("resumekit-recovery-*"))  # the local tier removed
    assert not any((tmp_path / "work").iterdir())  # the bench directory removed
