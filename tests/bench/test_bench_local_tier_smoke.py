"""The local-tier benchmark runs end to end at a tiny size and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import local_tier


def test_the_local_tier_benchmark_reports_each_save_and_the_ratios(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    (tmp_path / "fast").mkdir()
    out = tmp_path / "result.json"
    local_tier.main(["--mb", "1", "--rounds", "2", "--durable", str(tmp_path / "disk"),
                     "--local", str(tmp_path / "fast"), "--out", str(out)])
    result = json.loads(out.read_text())
    locals_ = {f"local on {tmp_path / 'fast'}", f"local on {tmp_path / 'disk'}"}
    assert set(result["median_seconds"]) == {"durable", *locals_}
    assert all(len(times) == 2 for times in result["all_seconds"].values())
    assert set(result["paired_durable_over_local"]) == locals_
    assert all(ratio > 0 for ratio in result["durable_over_local"].values())
    assert list(tmp_path.glob("*/rk-tier-*")) == []  # its directories are removed
