"""A smoke run of ``python -m benchmarks.replicas`` at tiny size: structure, not speed.

No timing is asserted: every method ran in every round, the node's disk is its own copies
and its replicas of ``keep`` steps, the JSON is written and the local roots are removed.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.replicas import main


def test_a_tiny_run_times_every_method_and_measures_the_disk_of_keep_steps(
        tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "replicas.json"
    work.mkdir()
    assert main(["--mb", "2", "--rounds", "2", "--chunk-mb", "1", "--dir", str(work),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for method in ("replicate", "local_copy", "local_copy_hashed"):
        assert len(report[f"{method}_seconds"]) == 2
    step = report["megabytes_per_rank_step"] * 1e6
    assert step > 2 * (1 << 20)
    # own copies and replicas, keep=2 of each, plus a few hundred bytes of manifests
    assert 0 <= report["node_bytes"] - report["node_bytes_expected"] < 20_000
    assert report["held"] == {"1": [3, 4]}
    assert not any(work.iterdir())
