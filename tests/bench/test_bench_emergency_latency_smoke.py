"""``python -m benchmarks.emergency_latency`` at a tiny size: it runs, and its figures add up.

No speed is asserted (wall-clock figures on a shared machine mean nothing); only what holds
by construction: the write starts after the capture's copy, so the seconds from the signal
to the write cover the copy on every rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import emergency_latency
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)


def test_every_configuration_commits_the_copy_and_reports_each_ratio(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    assert emergency_latency.main(["--layers", "2", "--width", "64", "--rounds", "1",
                                   "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["configs"]) == set(emergency_latency.CONFIGS)
    for config, figures in results["configs"].items():
        assert {row["rank"] for row in figures["rows"]} == {0, 1}, config
        for row in figures["rows"]:
            assert 0 < row["capture_copy_s"] <= row["signal_to_write_s"], (config, row)
            assert row["held_copy_s"] > 0 and row["first_copy_s"] > 0, (config, row)
        for over in emergency_latency.OVER:
            [worst] = figures[f"signal_to_write_over_{over}_copy_worst_rank"]
            assert math.isfinite(worst) and worst > 0, (config, over)
        assert figures["median_over_capture_copy"] >= 1.0, config
