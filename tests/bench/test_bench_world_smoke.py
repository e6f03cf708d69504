"""A smoke run of ``python -m benchmarks.world`` at tiny size: structure, not speed.

No timing is compared: the contract keys exist, every CPU figure was measured, the files
and ``.metadata`` bytes are what the layouts say, and the non-leading restoring ranks
opened no ``.metadata`` while DCP's ranks each read theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.world import TIMED, main
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)  # a hang detector: ranks are slow on a busy host

CONTRACT = ("restore_cpu_per_rank_w32_vs_w2", "restore_cpu_per_rank_w1024_vs_w8",
            "metadata_bytes_vs_dcp_w256", "files_per_checkpoint_w32",
            "save_cpu_rank0_w32_vs_dcp", "save_vs_odirect_under_cpu_load")


def test_a_tiny_run_writes_every_contract_key_with_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "world.json"
    # W = 1,024 runs resumekit's restore only (--others-max 256: the full bench's path above
    # its own others_max), all the contract's w1024 ratio needs; DCP's side and the earlier
    # restores are measured at W = 8 and 256, whose figures are checked below.
    main(["--real", "2,3", "--fake", "8,256,1024", "--config", "tiny", "--repeats", "2",
          "--rounds", "1", "--save-mb", "8", "--load-mb", "0", "--others-max", "256",
          "--out", str(out)])
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert all(key in summary for key in CONTRACT), sorted(summary)
    assert summary["save_vs_odirect_under_cpu_load"] is None
    assert summary["save_vs_odirect_under_cpu_load_reason"] == "not run (--load-mb 0)"
    assert report["save_under_cpu_load"] is None
    for key in CONTRACT[:-1]:
        assert isinstance(summary[key], (int, float)) and summary[key] > 0, (key, summary)
    for row in report["real"]:
        world = row["world_size"]
        assert row["files_per_checkpoint"] == 2 * world + 3, row  # a data file, a rank state
        assert row["dcp_files_per_checkpoint"] == world + 1, row
        # schema 5: each rank opens .metadata once, for its part (rank 0 with the head)
        assert row["metadata_bytes_read_per_rank"] == row["metadata_bytes"], row
        assert row["metadata_bytes_read_leader"] == row["metadata_bytes"], row
        assert row["dcp_metadata_bytes_read_per_rank"] == row["dcp_metadata_bytes"], row
        assert all(row[key] > 0 for key in ("save_cpu_rank0_s", "dcp_save_cpu_rank0_s",
                                            "restore_cpu_per_rank_s",
                                            "dcp_restore_cpu_per_rank_s")), row
    assert summary["files_per_checkpoint_w32"] == 2 * 3 + 3
    # rank 0's steady-state save (the 2nd) over DCP at its best; the first save apart
    low, high = report["real"]
    best = min(high["dcp_save_cpu_rank0_steady_s"], high["dcp_cached_save_cpu_rank0_steady_s"])
    assert summary["save_cpu_rank0_w32_vs_dcp"] == high["save_cpu_rank0_steady_s"] / best
    assert summary["save_cpu_rank0_w32_vs_dcp_reason"] is None
    best_first = min(high["dcp_save_cpu_rank0_first_s"],
                     high["dcp_cached_save_cpu_rank0_first_s"])
    assert summary["save_cpu_rank0_first_w32_vs_dcp"] == (
        high["save_cpu_rank0_first_s"] / best_first)
    assert summary["save_cpu_rank0_all_saves_w32_vs_dcp_default"] == (
        high["save_cpu_rank0_s"] / high["dcp_save_cpu_rank0_s"])
    # one round: each row's figure is its one round's, and the per-round ratios say so
    assert summary["rounds"] == 1
    for row in (low, high):
        (one,) = row["rounds"]
        assert one["dcp_first"] is False and len(one["loadavg_1min"]) == 2
        assert all(row[key] == one[key] for key in TIMED), row
    spread = summary["per_round"]["restore_cpu_per_rank_w32_vs_w2"]
    assert spread["values"] == [summary["restore_cpu_per_rank_w32_vs_w2"]]
    assert spread["min"] == spread["max"] == spread["median"] == spread["values"][0]
    small, large, largest = report["simulated"]
    assert small["not_run"] is None and large["not_run"] is None
    assert "others_max (256)" in largest["not_run"] and largest["dcp_metadata_bytes"] is None
    assert largest["world_size"] == 1024 and largest["restore_cpu_per_rank_s"] > 0
    assert 0 < small["dcp_metadata_bytes"] < large["dcp_metadata_bytes"]
    assert small["metadata_bytes"] < large["metadata_bytes"]
    assert summary["metadata_bytes_vs_dcp_w256"] == (
        large["metadata_bytes"] / large["dcp_metadata_bytes"])
    assert large["load_items"] > 0 and large["restore_cpu_per_rank_s"] > 0
    # a restoring rank receives the skeleton and its part, not the whole file
    assert 0 < large["metadata_bytes_received_per_rank"] < large["metadata_bytes"]
    assert large["restore_cpu_per_rank_whole_s"] > 0
    assert summary["restore_cpu_per_rank_w1024_vs_w8"] is not None
    provenance = report["provenance"]
    assert [p["worlds"] for p in provenance["simulated"]] == [[8, 256, 1024]]
    assert [p["worlds"] for p in provenance["real"]] == [[2, 3]]
    assert provenance["save_cpu_per_gb"]["date"]
    assert report["save_cpu_per_gb"]["bytes"] >= 8 << 20
    assert out.with_suffix(".png").stat().st_size > 10_000
