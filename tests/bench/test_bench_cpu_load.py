"""``benchmarks.cpu_load``: the save beside a CPU load and a plain O_DIRECT writer.

No timing is compared: the plain writer writes exactly the tensors' bytes, the load is
the tool the result names and ends with the measurement (or the measurement is refused
when it ended first), and the contract key is null with the reason where there is no
O_DIRECT baseline. The loads started here are one Python busy loop for well under a
second (the host is shared), or ``/bin/true`` standing in for stress-ng.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_load
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)


def test_the_plain_writer_writes_each_thread_s_tensors_padded_to_alignment(
        tmp_path: Path) -> None:
    tensors = [torch.arange(n * 1000 + 7, dtype=torch.float32) for n in range(1, 7)]
    direct = cpu_load.plain_odirect_write(tensors, tmp_path, threads=4)
    if cpu_load.filesystem_of(tmp_path) == "tmpfs":
        assert not direct
    for number in range(4):
        expected = b"".join(
            bytes(t.numpy().tobytes()) + bytes(-t.nbytes % cpu_load.ALIGNMENT)
            for t in tensors[number::4])
        assert (tmp_path / f"plain_{number}.bin").read_bytes() == expected


def test_the_plain_writer_uses_o_direct_on_a_disk_filesystem(tmp_path: Path) -> None:
    if cpu_load.filesystem_of(tmp_path) not in {"ext4", "xfs", "btrfs"}:
        pytest.skip(f"{tmp_path} is on {cpu_load.filesystem_of(tmp_path)}")
    assert cpu_load.plain_odirect_write([torch.ones(5000)], tmp_path, threads=1)


def test_the_load_is_stress_ng_where_installed_else_named_python_busy_loops() -> None:
    tool, commands = cpu_load.load_command(4, 60, stress_ng="/usr/bin/stress-ng")
    assert tool == "stress-ng --cpu 4"
    assert commands == [["/usr/bin/stress-ng", "--cpu", "4", "--timeout", "60s", "--quiet"]]
    tool, commands = cpu_load.load_command(3, 60, stress_ng=None)
    assert tool.startswith("3 Python busy-loop") and "stress-ng not installed" in tool
    assert len(commands) == 3 and all(command[-1] == "60" for command in commands)


def test_the_load_s_processes_run_inside_the_block_and_are_ended_after_it() -> None:
    with cpu_load.cpu_load(1, 60, stress_ng=None) as load:
        assert load.running()
        (pid,) = load.pids
        assert Path(f"/proc/{pid}").exists()
    assert not load.running()
    assert not Path(f"/proc/{pid}").exists()  # ended and reaped


def test_a_load_that_ended_before_the_measurement_is_refused(tmp_path: Path) -> None:
    true = shutil.which("true")
    assert true is not None
    with pytest.raises(cpu_load.LoadEndedEarly, match="ended before the measurement"):
        cpu_load.measure(8, 1, workers=1, stress_ng=true, directory=str(tmp_path))


def test_a_measurement_reports_both_sides_quiet_and_loaded(tmp_path: Path) -> None:
    started = time.perf_counter()
    row = cpu_load.measure(8, 1, workers=1, stress_ng=None, directory=str(tmp_path),
                           max_load_s=120)
    assert row["load_seconds"] < time.perf_counter() - started
    assert row["bytes"] == 16 << 20 and row["load"].startswith("1 Python busy-loop")
    assert {key: len(walls) for key, walls in row["walls_s"].items()} == {
        "quiet_save": 1, "quiet_plain": 1, "loaded_save": 1, "loaded_plain": 1}
    assert row["ratio_under_load"] == row["loaded_save_gb_s"] / row["loaded_plain_gb_s"]
    assert row["quiet_ratio"] == row["quiet_save_gb_s"] / row["quiet_plain_gb_s"]
    assert list(tmp_path.iterdir()) == []  # every save and plain file removed
    summary = cpu_load.summary(row)
    if row["odirect"]:
        assert summary["save_vs_odirect_under_cpu_load"] == row["ratio_under_load"]
        assert summary["save_vs_odirect_under_cpu_load_reason"] is None


def test_without_an_o_direct_baseline_the_key_is_null_with_the_reason() -> None:
    row = {"odirect": False, "filesystem": "tmpfs", "ratio_under_load": 0.9}
    summary = cpu_load.summary(row)
    assert summary["save_vs_odirect_under_cpu_load"] is None
    assert "tmpfs" in summary["save_vs_odirect_under_cpu_load_reason"]
    skipped = cpu_load.summary(None, "not run (--load-mb 0)")
    assert skipped == {"save_vs_odirect_under_cpu_load": None,
                       "save_vs_odirect_under_cpu_load_reason": "not run (--load-mb 0)"}


def test_each_burst_is_kept_and_the_key_is_the_median_of_the_bursts_ratios(
        tmp_path: Path) -> None:
    row = cpu_load.measure(8, 1, workers=1, stress_ng=None, directory=str(tmp_path),
                           max_load_s=120, bursts=3)
    bursts = row["bursts"]
    assert len(bursts) == 3
    ratios = [burst["loaded_save_gb_s"] / burst["loaded_plain_gb_s"] for burst in bursts]
    assert row["ratio_under_load_per_burst"] == [b["ratio_under_load"] for b in bursts] == ratios
    assert row["ratio_under_load"] == statistics.median(ratios)
    assert row["ratio_under_load_min"] == min(ratios)
    assert row["ratio_under_load_max"] == max(ratios)
    assert row["quiet_ratio"] == statistics.median(b["quiet_ratio"] for b in bursts)
    assert all(len(burst["loadavg_1min"]) == 2 for burst in bursts)
    assert {key: len(walls) for key, walls in row["walls_s"].items()} == {
        "quiet_save": 3, "quiet_plain": 3, "loaded_save": 3, "loaded_plain": 3}
    assert row["load_seconds"] == sum(burst["load_seconds"] for burst in bursts)
    if row["odirect"]:
        summary = cpu_load.summary(row)
        assert summary["save_vs_odirect_under_cpu_load"] == statistics.median(ratios)
        assert summary["save_vs_odirect_under_cpu_load_per_burst"] == ratios
        assert summary["save_vs_odirect_under_cpu_load_min"] == min(ratios)
