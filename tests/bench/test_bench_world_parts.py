"""``benchmarks.world --parts``: a partial rerun keeps each part's date and commit apart.

The earlier output here is written by the test (rows of a run before the bench stamped
its rows, and rows of a stamped run); no figure is measured, only carried and labelled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.world import main


def _row(world: int, **extra: object) -> dict[str, object]:
    return {"world_size": world, "save_cpu_rank0_s": 1.0, "dcp_save_cpu_rank0_s": 2.0,
            "restore_cpu_per_rank_s": 0.5 * world, "dcp_restore_cpu_per_rank_s": 0.25 * world,
            "metadata_bytes": 10, "dcp_metadata_bytes": 9, "files_per_checkpoint": 2 * world + 3,
            **extra}


def test_rows_taken_from_an_earlier_run_keep_their_stamp_and_say_where_they_came_from(
        tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    stamp = {"date": "2026-12-01T00:00:00+00:00", "commit": "a" * 40, "dirty": False}
    earlier.write_text(json.dumps({
        "real": [_row(2, measured=stamp), _row(32, measured=stamp)],
        "simulated": [_row(8)], "save_cpu_per_gb": {"save_cpu_s_per_gb": 0.5}}))
    out = tmp_path / "world.json"
    main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
          "--out", str(out),
          "--parts", f"{earlier}:real"])
    report = json.loads(out.read_text())
    assert [row["world_size"] for row in report["real"]] == [2, 32]
    assert report["simulated"] == [] and report["save_cpu_per_gb"] is None
    (kept,) = report["provenance"]["real"]
    assert kept["commit"] == "a" * 40 and kept["date"] == stamp["date"]
    assert kept["taken_from"] == str(earlier) and kept["worlds"] == [2, 32]
    assert report["summary"]["restore_cpu_per_rank_w32_vs_w2"] == 16.0


def test_rows_of_an_unstamped_earlier_run_are_marked_as_such(tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    simulated = [_row(w, restore_cpu_per_rank_before_s=1.0) for w in (8, 16)]
    earlier.write_text(json.dumps({"real": [], "simulated": simulated,
                                   "save_cpu_per_gb": None}))
    out = tmp_path / "world.json"
    main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
          "--out", str(out),
          "--parts", f"{earlier}:simulated"])
    (marked,) = json.loads(out.read_text())["provenance"]["simulated"]
    assert "before the bench stamped its rows" in marked["note"]
    assert marked["worlds"] == [8, 16]


def test_two_runs_figures_for_one_world_size_are_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        path.write_text(json.dumps({"real": [_row(2)], "simulated": [],
                                    "save_cpu_per_gb": None}))
    with pytest.raises(SystemExit):
        main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
              "--out", str(tmp_path / "w.json"), "--parts", f"{first}:real", f"{second}:real"])


def test_an_unknown_part_is_refused(tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"real": [], "simulated": [], "save_cpu_per_gb": None}))
    with pytest.raises(SystemExit):
        main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
              "--out", str(tmp_path / "w.json"), "--parts", f"{earlier}:reel"])



def test_the_save_under_cpu_load_is_taken_from_an_earlier_run_with_its_stamp(
        tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    stamp = {"date": "2026-12-06T16:00:00+00:00", "commit": "b" * 40, "dirty": False}
    loaded = {"ratio_under_load": 0.75, "quiet_ratio": 0.9, "odirect": True,
              "filesystem": "ext4", "load": "stress-ng --cpu 4", "measured": stamp}
    earlier.write_text(json.dumps({"real": [], "simulated": [], "save_cpu_per_gb": None,
                                   "save_under_cpu_load": loaded}))
    out = tmp_path / "world.json"
    main(["--real", "", "--fake", "", "--save-mb", "0", "--load-mb", "0", "--no-plot",
          "--out", str(out), "--parts", f"{earlier}:save_under_cpu_load"])
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["save_vs_odirect_under_cpu_load"] == 0.75
    assert summary["save_vs_odirect_under_cpu_load_reason"] is None
    assert summary["save_vs_odirect_quiet"] == 0.9
    assert summary["save_vs_odirect_under_cpu_load_load"] == "stress-ng --cpu 4"
    kept = report["provenance"]["save_under_cpu_load"]
    assert kept["commit"] == "b" * 40 and kept["taken_from"] == str(earlier)
