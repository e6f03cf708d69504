"""``benchmarks.world --rounds``: a real-rank row's figures are the medians of its rounds.

No rank is run: the rounds are written by the test as :func:`benchmarks.world.real_round`
returns them, so the combination and the summary's ratios are checked value by value
(the smoke run covers the measurement itself, in one round).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.world import TIMED, combine_rounds, main


def _round(world: int, number: int, restore: float, save_steady: float,
           dcp_steady: float, dcp_cached_steady: float) -> dict[str, Any]:
    figures = {key: 0.01 * (number + 1) for key in TIMED}
    figures.update({"restore_cpu_per_rank_s": restore, "save_cpu_rank0_steady_s": save_steady,
                    "dcp_save_cpu_rank0_steady_s": dcp_steady,
                    "dcp_cached_save_cpu_rank0_steady_s": dcp_cached_steady})
    return {"world_size": world, "dcp_first": number % 2 == 1,
            "loadavg_1min": [1.0 + number, 2.0 + number], **figures,
            "metadata_bytes": 100 + number, "dcp_metadata_bytes": 90,
            "metadata_bytes_read_per_rank": 0, "metadata_bytes_read_leader": 100,
            "dcp_metadata_bytes_read_per_rank": 90, "files_per_checkpoint": 2 * world + 3,
            "dcp_files_per_checkpoint": world + 1}


def test_a_row_keeps_every_round_and_its_figures_are_the_rounds_medians() -> None:
    rounds = [_round(32, 0, 0.030, 0.06, 0.10, 0.05),
              _round(32, 1, 0.050, 0.02, 0.10, 0.09),
              _round(32, 2, 0.020, 0.04, 0.10, 0.07)]
    row = combine_rounds(rounds)
    assert [one["dcp_first"] for one in row["rounds"]] == [False, True, False]
    assert [one["loadavg_1min"] for one in row["rounds"]] == [[1.0, 2.0], [2.0, 3.0],
                                                             [3.0, 4.0]]
    for key in TIMED:
        assert [one[key] for one in row["rounds"]] == [one[key] for one in rounds], key
        assert row[key] == statistics.median(one[key] for one in rounds), key
    assert row["restore_cpu_per_rank_s"] == 0.030
    assert row["metadata_bytes"] == 102 and row["files_per_checkpoint"] == 67
    assert "dcp_first" not in row and "loadavg_1min" not in row


def test_a_figure_some_rounds_did_not_measure_is_the_median_of_those_that_did() -> None:
    rounds = [_round(2, number, 0.01, 0.02, 0.03, 0.04) for number in range(3)]
    rounds[1]["save_cpu_rank0_steady_s"] = None
    assert combine_rounds(rounds)["save_cpu_rank0_steady_s"] == 0.02
    for one in rounds:
        one["save_cpu_rank0_steady_s"] = None
    assert combine_rounds(rounds)["save_cpu_rank0_steady_s"] is None


def test_the_summary_s_ratios_are_of_the_medians_with_each_round_s_ratio_beside(
        tmp_path: Path) -> None:
    low = combine_rounds([_round(2, 0, 0.020, 0.06, 0.10, 0.05),
                          _round(2, 1, 0.010, 0.06, 0.10, 0.05),
                          _round(2, 2, 0.040, 0.06, 0.10, 0.05)])
    high = combine_rounds([_round(32, 0, 0.030, 0.06, 0.10, 0.05),
                           _round(32, 1, 0.050, 0.02, 0.10, 0.09),
                           _round(32, 2, 0.020, 0.04, 0.10, 0.07)])
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"real": [low, high], "simulated": [],
                                   "save_cpu_per_gb": None}))
    out = tmp_path / "world.json"
    main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
          "--out", str(out), "--parts", f"{earlier}:real"])
    summary = json.loads(out.read_text())["summary"]
    assert summary["rounds"] == 3
    # the medians: restore 0.030 (W = 32) over 0.020 (W = 2)
    assert summary["restore_cpu_per_rank_w32_vs_w2"] == 0.030 / 0.020
    spread = summary["per_round"]["restore_cpu_per_rank_w32_vs_w2"]
    assert spread["values"] == [0.030 / 0.020, 0.050 / 0.010, 0.020 / 0.040]
    assert spread["min"] == 0.5 and spread["max"] == 5.0 and spread["median"] == 1.5
    # steady save: median 0.04 over DCP at its best, the lower of the medians (0.07 < 0.10)
    assert summary["save_cpu_rank0_w32_vs_dcp"] == 0.04 / 0.07
    assert summary["save_cpu_rank0_w32_vs_dcp_steady"] == summary["save_cpu_rank0_w32_vs_dcp"]
    saves = summary["per_round"]["save_cpu_rank0_w32_vs_dcp"]
    assert saves["values"] == [0.06 / 0.05, 0.02 / 0.09, 0.04 / 0.07]
    assert saves["min"] == 0.02 / 0.09 and saves["max"] == 0.06 / 0.05
