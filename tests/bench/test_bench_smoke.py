"""A smoke run of ``python -m benchmarks.run`` at tiny size: structure, not speed.

No timing is asserted (wall-clock numbers on a shared machine mean nothing); what must
hold is that every part runs, the summary has exactly its keys, the files are written and
the bench directory is cleaned up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import peers, report
from benchmarks.run import main
from benchmarks.timing import interleave, paired_ratios
from benchmarks.workload import (
    BYTES_PER_PARAM,
    build_model,
    build_optimizer,
    shape_for,
    state_tensors,
    train_step,
)

TINY = ["--state-mb", "6", "--dist-state-mb", "3", "--rounds", "2", "--overlap-rounds", "2",
        "--load-rounds", "2", "--rss-saves", "3",
        "--poll-steps", "8", "--poll-step-ms", "2", "--dcp-threads", "2",
        "--root-counts", "10", "20"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("bench")
    bench_dir, out = base / "work", base / "out"
    results = main([*TINY, "--bench-dir", str(bench_dir), "--out", str(out)])
    return {"results": results, "bench_dir": bench_dir, "out": out}


def test_the_summary_has_exactly_the_agreed_keys(smoke: dict[str, Any]) -> None:
    assert list(smoke["results"]["summary"]) == list(report.TARGETS)
    assert set(report.TARGETS) == {
        "save_vs_raw_write", "save_vs_torch_save", "save_vs_dcp_save", "save_vs_accelerate",
        "save_vs_lightning", "async_block_vs_memcpy", "async_total_vs_sync",
        "overlap_step_slowdown", "load_vs_raw_read", "reshard_load_vs_load",
        "poll_overhead_frac", "rss_growth_frac_20_async_saves",
        "save_requests_at_1000_vs_10", "latest_seconds_at_1000_vs_10",
        "s3_save_requests_at_1000_vs_10", "s3_latest_seconds_at_1000_vs_10",
    }


def test_every_ratio_is_a_finite_number_or_names_the_missing_peer(
        smoke: dict[str, Any]) -> None:
    results = smoke["results"]
    notes = results["details"]["saves"]["notes"]
    for key, value in results["summary"].items():
        if value is None and key.startswith("s3_"):  # no loopback S3 here: said why
            assert "skipped" in results["details"]["roots"]["s3"], key
            continue
        if value is None:
            peer = key.removeprefix("save_vs_")
            assert key in ("save_vs_accelerate", "save_vs_lightning"), key
            assert "not installed" in notes[peer]
            continue
        assert isinstance(value, float) and math.isfinite(value), (key, value)
        if key != "rss_growth_frac_20_async_saves":  # may shrink a little
            assert value > 0, (key, value)


def test_every_method_ran_once_per_round(smoke: dict[str, Any]) -> None:
    details = smoke["results"]["details"]
    for part in ("saves", "overlap", "loads", "ranks"):
        for name, samples in details[part]["samples"].items():
            assert len(samples) == 2, (part, name)
            assert all(seconds > 0 for seconds in samples), (part, name)
    assert len(details["rss"]["rss_after_each"]) == 3
    assert {"dcp_default", "dcp_threads_2"} <= set(details["saves"]["samples"])


def test_the_json_and_png_are_written_and_the_bench_directory_is_left_empty(
        smoke: dict[str, Any]) -> None:
    written = json.loads((smoke["out"] / "latest.json").read_text())
    assert written["summary"] == smoke["results"]["summary"]
    machine = written["machine"]
    for fact in ("logical_cores", "ram_bytes", "torch", "python", "bench_filesystem"):
        assert machine[fact], fact
    assert machine["bench_filesystem"]["type"]
    assert (smoke["out"] / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert machine["bench_dir_removed"] is True
    assert list(Path(smoke["bench_dir"]).iterdir()) == []


def test_the_markdown_table_names_every_figure_and_its_target() -> None:
    results = {"summary": dict.fromkeys(report.TARGETS, 1.0), "config": {"rounds": 5},
               "machine": {"logical_cores": 2, "torch": "x", "load_average_at_start": [1.0],
                           "load_average_at_end": [1.0]}}
    results["summary"]["save_vs_raw_write"] = 0.5
    table = report.markdown(results)
    for key, goal in report.TARGETS.items():
        assert f"`{key}`" in table and str(goal["target"]) in table
    assert "| `save_vs_raw_write` | 0.500 | >= 0.95 | higher | **misses** |" in table
    assert "| `async_total_vs_sync` | 1.000 | <= 1.3 | lower | meets |" in table


def test_rounds_alternate_direction_so_no_method_always_goes_first() -> None:
    order: list[str] = []

    def method(name: str):
        def run() -> float:
            order.append(name)
            return 1.0
        return run

    samples = interleave({"a": method("a"), "b": method("b"), "c": method("c")}, 3)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert samples == {"a": [1.0] * 3, "b": [1.0] * 3, "c": [1.0] * 3}
    assert paired_ratios([2.0, 6.0], [1.0, 3.0]) == [2.0, 2.0]


def test_the_model_is_sized_to_the_requested_state(tmp_path: Path) -> None:
    shape = shape_for(1_500_000_000)
    assert abs(shape.state_bytes - 1_500_000_000) / 1_500_000_000 < 0.05
    assert shape.params * BYTES_PER_PARAM == shape.state_bytes


def test_a_raw_write_reads_back_into_the_same_tensors(tmp_path: Path) -> None:
    model = build_model(shape_for(100_000))
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    before = [t.clone() for t in state_tensors(model, optimizer)]
    peers.raw_write(model, optimizer, tmp_path / "raw.bin")
    with torch.no_grad():
        for tensor in state_tensors(model, optimizer):
            tensor.zero_()
    peers.raw_read(model, optimizer, tmp_path / "raw.bin")
    after = state_tensors(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
