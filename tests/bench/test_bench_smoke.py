"""A smoke run of ``python -m benchmarks.run`` at tiny size: structure, not speed.

No timing is asserted (wall-clock numbers on a shared machine mean nothing); what must
hold is that every part runs, the summary has exactly its keys, the files are written and
the bench directory is cleaned up.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import goodput, peers, report
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
from tests.limits import TEST_HANG_S

TINY = ["--state-mb", "6", "--dist-state-mb", "3", "--rounds", "2", "--overlap-rounds", "2",
        "--load-rounds", "2", "--rss-saves", "3", "--rss-peak-rounds", "1",
        "--poll-steps", "8", "--poll-step-ms", "2", "--dcp-threads", "2",
        "--root-counts", "10", "20",
        "--per-tensor-count", "40", "--per-tensor-rounds", "2", "--first-async-rounds", "2",
        # The goodput part launches the trainer 7 times (~30 s each here): its analysis is
        # tested below on recorded events instead.
        "--only", "saves", "overlap", "loads", "rss", "ranks", "roots", "per_tensor",
        "first_async"]
FIO = shutil.which("fio") is not None
#: The smoke run (the module fixture, in its first test's time) starts seven processes; in
#: `make test` it shares the cores with the other suites' workers.
pytestmark = pytest.mark.timeout(TEST_HANG_S)


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
        "per_tensor_save_vs_dcp", "per_tensor_restore_vs_dcp", "save_vs_disk_best",
        "load_vs_disk_best", "load_vs_disk_best_in_process", "first_async_block_vs_memcpy",
        "peak_rss_sync_vs_state", "peak_rss_async_vs_state", "goodput_under_preemption",
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
            if key == "goodput_under_preemption":  # not in this run's parts
                assert "goodput" not in results["config"]["parts"]
                continue
            if key in ("save_vs_disk_best", "load_vs_disk_best", "load_vs_disk_best_in_process"):
                assert not FIO and "fio is not installed" in notes["fio"]
                continue
            peer = key.removeprefix("save_vs_")
            assert key in ("save_vs_accelerate", "save_vs_lightning"), key
            assert "not installed" in notes[peer]
            continue
        assert isinstance(value, float) and math.isfinite(value), (key, value)
        if key != "rss_growth_frac_20_async_saves":  # may shrink a little
            assert value > 0, (key, value)


def test_every_method_ran_once_per_round(smoke: dict[str, Any]) -> None:
    details = smoke["results"]["details"]
    for part in ("saves", "overlap", "loads", "ranks", "per_tensor", "first_async"):
        for name, samples in details[part]["samples"].items():
            assert len(samples) == 2, (part, name)
            assert all(seconds > 0 for seconds in samples), (part, name)
    assert len(details["rss"]["rss_after_each"]) == 3
    assert {"dcp_default", "dcp_threads_2"} <= set(details["saves"]["samples"])
    if FIO:
        assert {"fio_write_1", "fio_write_4"} <= set(details["saves"]["samples"])
        assert {"fio_read_1", "fio_read_4"} <= set(details["loads"]["samples"])
    assert len(details["rss"]["peak_rss_sync_extra"]) == 1
    per_tensor = smoke["results"]["ratios"]["per_tensor"]
    assert per_tensor["count"] == 40
    assert set(per_tensor["metadata_bytes_per_tensor"]) == {"resumekit", "dcp"}


def test_the_async_peak_counts_the_staging_copy_and_the_sync_peak_does_not(
        smoke: dict[str, Any]) -> None:
    rss = smoke["results"]["details"]["rss"]
    state = smoke["results"]["config"]["shape"]["state_bytes"]
    # One staging copy of the state is allocated and touched inside the async window.
    assert all(extra >= 0.9 * state for extra in rss["peak_rss_async_extra"])


def test_goodput_counts_each_step_once_and_splits_the_lost_time() -> None:
    def event(t: float, kind: str, **fields: Any) -> dict[str, Any]:
        return {"t": t, "kind": kind, **fields}

    first = [event(0, "launch"), event(1, "restore_begin"), event(2, "restore_end"),
             event(3, "step", step=1), event(3.5, "blocked_begin"), event(4, "blocked_end"),
             event(5, "step", step=2), event(6, "step", step=3)]  # then killed
    second = [event(10, "launch"), event(11, "restore_begin"), event(12.5, "restore_end"),
              event(13.5, "step", step=2), event(14.5, "step", step=3),
              event(15, "blocked_begin"), event(15.5, "blocked_end"), event(15.6, "exit")]
    late_rank = [event(0, "launch"), event(1.5, "restore_begin"),
                 event(10, "launch"), event(11, "restore_begin")]
    figures = goodput.analyse(first + second, steps=3, other_ranks=[late_rank])

    assert figures["complete"] and figures["launches"] == 2
    assert figures["total_s"] == pytest.approx((6 - 1.5) + (15.6 - 11))
    assert figures["restore_s"] == pytest.approx(0.5 + 1.5)
    assert figures["useful_s"] == pytest.approx(1 + 1 + 1)  # step 1 once, 2 and 3 redone
    assert figures["replayed_steps"] == 2
    assert figures["replayed_s"] == pytest.approx(1.5 + 1)  # step 2 minus its 0.5 s wait
    assert figures["blocked_by_saves_s"] == pytest.approx(0.5 + 0.5)
    assert figures["goodput"] == pytest.approx(3 / 9.1)


def test_goodput_reports_how_much_longer_each_relaunchs_first_step_took() -> None:
    def event(t: float, kind: str, **fields: Any) -> dict[str, Any]:
        return {"t": t, "kind": kind, **fields}

    first = [event(0, "launch"), event(1, "restore_begin"), event(2, "restore_end"),
             event(5, "step", step=1), event(6, "step", step=2), event(7, "step", step=3),
             event(7.1, "exit")]  # a fresh start: its slow first step is not a relaunch's
    second = [event(10, "launch"), event(11, "restore_begin"), event(12, "restore_end"),
              event(13, "blocked_begin"), event(13.5, "blocked_end"),
              event(14.5, "step", step=4), event(15.5, "step", step=5), event(15.6, "exit")]
    figures = goodput.analyse(first + second, steps=5)
    assert figures["step_s_median"] == pytest.approx(1)
    # 2.5 s after restore, 0.5 s of it blocked: 2 s, 1 s more than the median step.
    assert figures["relaunch_first_step_excess_s"] == pytest.approx(1)


def test_the_preemption_schedule_is_fixed_by_its_seed_and_holds_one_kill() -> None:
    plan = goodput.schedule(600, sigterms=5, seed=16)
    assert plan == goodput.schedule(600, sigterms=5, seed=16)
    assert [kind for _, kind in plan].count("sigkill") == 1 and len(plan) == 6
    steps = [step for step, _ in plan]
    assert steps == sorted(steps) and all(b - a >= 20 for a, b in itertools.pairwise(steps))
    assert steps[0] > 0 and steps[-1] < 600


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
        assert f"`{key}`" in table and str(goal["target"] or "none") in table
    assert "| `save_vs_raw_write` | 0.500 | >= 0.95 | higher | **misses** |" in table
    assert "| `async_total_vs_sync` | 1.000 | <= 1.3 | lower | meets |" in table
    assert ("| `load_vs_disk_best_in_process` | 1.000 | none | higher | informational |"
            in table)


def test_load_vs_disk_best_compares_fio_with_the_fresh_process_restores() -> None:
    loads = {"samples": {"raw_read_cold": [1.0, 1.0], "restore_cold": [4.0, 8.0],
                         "restore_cold_fresh_process": [2.0, 2.5],
                         "restore_cold_no_verify": [1.0, 1.0], "raw_read_warm": [1.0, 1.0],
                         "restore_warm": [1.0, 1.0], "fio_read_1": [2.0, 3.0],
                         "fio_read_4": [1.0, 4.0]}}
    summary = report.summarise({"loads": loads}, state_bytes=10**9)
    ratios = report.ratio_details({"loads": loads}, state_bytes=10**9)

    # Best fio per round: 1.0, 3.0.
    assert ratios["load_vs_disk_best"] == [0.5, 1.2]
    assert summary["load_vs_disk_best"] == pytest.approx(0.85)
    assert ratios["load_vs_disk_best_in_process"] == [0.25, 0.375]
    assert summary["load_vs_disk_best_in_process"] == pytest.approx(0.3125)
    assert report.meets("load_vs_disk_best", 0.85) is False
    assert report.meets("load_vs_disk_best_in_process", 0.3125) is None


def test_each_fresh_process_restore_read_a_cold_checkpoint(smoke: dict[str, Any]) -> None:
    loads = smoke["results"]["details"]["loads"]
    assert len(loads["samples"]["restore_cold_fresh_process"]) == 2
    residency = loads["resident_fraction_before_cold_reads"]
    fresh, in_process = residency["resumekit_fresh_process"], residency["resumekit"]
    assert len(fresh) == 2
    # Where eviction works here (fincore installed, a filesystem that drops clean pages:
    # not tmpfs), the probe's own eviction must work as well as the bench's.
    if all(fraction is not None and fraction < 0.05 for fraction in in_process):
        assert all(fraction is not None and fraction < 0.05 for fraction in fresh)


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


def test_no_sample_starts_with_the_garbage_the_method_before_it_left() -> None:
    import gc  # noqa: PLC0415

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    left_over: list[int] = []

    def litter() -> float:
        left_over.append(gc.get_count()[0])
        for _ in range(500):
            Cycle()  # unreachable cycles: only a collection frees them
        return 1.0

    interleave({"a": litter, "b": litter}, 2)
    assert max(left_over) < 100, left_over  # each sample began right after a collection


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
