"""A smoke run of ``python -m benchmarks.tensor_format`` at tiny size: structure, not speed.

No timing is asserted; what must hold is that both formats are saved and restored in every
round, each figure is a paired ratio of them, the JSON is written and the work directory
is removed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.tensor_format import FIGURES, main


def test_a_tiny_run_measures_every_figure_for_both_formats_and_cleans_up(
    tmp_path: Path,
) -> None:
    bench_dir, out = tmp_path / "work", tmp_path / "out"
    results = main(["--state-mb", "4", "--rounds", "2", "--bench-dir", str(bench_dir),
                    "--out", str(out)])
    measured = results["measured"]
    for figure, numerator, denominator in FIGURES:
        assert len(measured["samples"][numerator]) == len(measured["samples"][denominator]) == 2
        row = measured["figures"][figure]
        assert all(math.isfinite(ratio) and ratio > 0 for ratio in row["ratios"])
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    assert set(measured["checkpoint_bytes"]) == {"raw", "dcp"}
    assert all(size > 4_000_000 * 0.9 for size in measured["checkpoint_bytes"].values())
    assert json.loads((out / "tensor_format.json").read_text())["measured"]["figures"]
    assert results["machine"]["bench_dir_removed"]
    assert not any(bench_dir.iterdir())
