"""A smoke run of ``python -m benchmarks.world_leader`` at tiny size: structure, not speed.

No timing is compared: every rank's request made from the shapes is the one resumekit's
planner makes (checked by the bench on one rank), every part equals the baseline's, and
every CPU figure was measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.world_fake import lingbot_params
from benchmarks.world_leader import main, requests_of
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)


def test_a_tiny_run_measures_rank_0_at_each_world_size_with_parts_equal_to_the_baselines(
        tmp_path: Path) -> None:
    out = tmp_path / "leader.json"
    main(["--worlds", "8,64", "--config", "tiny", "--baseline", "", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [row["world_size"] for row in report["rows"]] == [8, 64]
    for row in report["rows"]:
        assert row["parts_equal_baseline"] is True
        assert all(row[key] > 0 for key in (
            "parse_cpu_s", "index_cpu_s", "answers_cpu_s", "answers_baseline_cpu_s",
            "part_bytes_mean")), row
        assert row["leader_cpu_s"] == pytest.approx(
            row["parse_cpu_s"] + row["index_cpu_s"] + row["requests_cpu_s"]
            + row["answers_cpu_s"])
        assert row["measured"]["date"]
    small, large = report["rows"]
    assert small["metadata_bytes"] < large["metadata_bytes"]


def test_each_ranks_request_asks_for_its_own_dim_0_shard_of_every_sharded_tensor() -> None:
    params = lingbot_params("tiny")
    requests = requests_of(params, 4)
    param = max(params, key=lambda p: p.shape[0])
    name, length = f"model.{param.fqn}", param.shape[0]
    assert length >= 8
    shards = [request[name][0] for request in requests]  # type: ignore[index]
    starts = [offsets[0] for offsets, _ in shards]
    assert starts == [rank * -(-length // 4) for rank in range(4)]
    assert sum(sizes[0] for _, sizes in shards) == length
    assert all(sizes[1:] == param.shape[1:] for _, sizes in shards)
    assert all(len(request) == len(requests[0]) for request in requests)


def test_with_replicas_rank_0_answers_each_shard_layout_once(tmp_path: Path) -> None:
    out = tmp_path / "leader.json"
    main(["--worlds", "8,16", "--replicas", "2", "--config", "tiny", "--baseline", "",
          "--out", str(out)])
    report = json.loads(out.read_text())
    for row in report["rows"]:
        assert row["parts_equal_baseline"] is True
        assert row["replicas"] == 2
        # the W - 1 requests rank 0 receives hold W / 2 distinct shard layouts
        assert row["answers_distinct"] == row["world_size"] // 2, row
