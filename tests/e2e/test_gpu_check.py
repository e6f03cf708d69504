"""The GPU check (``benchmarks/gpu_check.py``) in its CPU mode, end to end, so it cannot rot.

The CPU mode runs every check that does not need CUDA on CPU and gloo (1 and 2 ranks, the
LingBot drill on 1 rank); the one CUDA-only check is listed as not applicable. With
``--require-cuda`` on a machine without CUDA it must fail, naming every CUDA path.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_check
from examples.lingbot.config import get_config
from examples.lingbot.errors import ConfigError
from examples.lingbot.train import _with_dtype, build_parser
from resumekit.tensors import raw as raw_tensor_files
from tests.limits import HANG_S, TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    paths = [str(REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def test_the_cpu_mode_runs_every_check_and_lists_the_cuda_only_one_as_not_applicable(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--out", str(out)],
        cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_S, check=False)
    assert completed.returncode == 0, completed.stderr[-6000:]
    document = json.loads(out.read_text())
    assert document["passed"] is True
    assert document["environment"]["mode"] == "cpu"
    checks = {(check["name"], check["ranks"]): check for check in document["checks"]}
    expected = {(name, ranks) for name in gpu_check.WORKER_CHECKS for ranks in (1, 2)}
    expected |= {(name, None) for name in gpu_check.CONTROLLER_CHECKS}
    assert set(checks) == expected
    for key, check in checks.items():
        assert check["device"].startswith("cpu"), key
        if key[0] in ("pinned_staging", "scale_d2h_staging", "scale_process_writer"):
            assert check["status"] == "not_applicable", check
            assert check["reason"].startswith("not applicable on CPU"), check
        else:
            assert check["status"] == "passed", check
            assert check["error"] is None, check
    # Nothing pretends to have run on a GPU: every CUDA path is named as still to run.
    assert document["cuda_paths_not_run"] == list(gpu_check.CUDA_PATHS)
    assert "NO CUDA path was exercised" in completed.stderr
    drill = checks[("lingbot_drill", None)]["figures"]
    assert drill["deterministic"]["identical"] is True
    assert drill["deterministic"]["tensors_compared"] > 0
    assert [set(launch) & {"sigterm_at", "sigkill_at", "resumed_from"}
            for launch in drill["deterministic"]["launches"]] == [
        {"sigterm_at"}, {"sigkill_at"}, {"resumed_from"}]
    assert drill["default_kernels"].startswith("not applicable on CPU")
    files = checks[("sync_save_odirect", 1)]["figures"]["files"]
    assert files and all(f["opened_direct"] and f["stayed_direct"] for f in files)
    assert any(f["bounce_buffer"] for f in files)
    # The scale figures are GPU-only: named in the summary, not measured here.
    for name in ("scale_thread_writer_blocking_over_d2h", "scale_process_writer_blocking_over_d2h",
                 "scale_thread_writer_step_slowdown", "scale_process_writer_step_slowdown",
                 "scale_thread_writer_total_over_sync", "scale_process_writer_total_over_sync"):
        assert name in document["figures"] and document["figures"][name] is None, name
    assert {"scale_d2h_staging", "scale_process_writer"} <= set(gpu_check.CUDA_PATHS)
    async_figures = checks[("async_save_d2h", 2)]["figures"]
    assert set(async_figures) == {"rank0", "rank1"}
    for name in ("async_save_blocking_s", "d2h_copy_same_bytes_s", "sync_save_GBps",
                 "restore_GBps", "disk_write_GBps", "disk_read_GBps"):
        assert document["figures"][name] > 0, name


def test_require_cuda_without_cuda_fails_naming_every_cuda_path(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--require-cuda"],
        cwd=REPO_ROOT, env=_env(CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path)),
        capture_output=True, text=True, timeout=HANG_S, check=False)
    assert completed.returncode == 2, completed.stderr
    assert "CUDA paths could NOT be run" in completed.stderr
    for name, path in gpu_check.CUDA_PATHS.items():
        assert f"{name}: {path}" in completed.stderr
    document = json.loads((tmp_path / gpu_check.JSON_NAME).read_text())  # $OUT wins
    assert document["passed"] is False
    assert [check["name"] for check in document["checks"]] == list(gpu_check.CUDA_PATHS)
    assert {check["status"] for check in document["checks"]} == {"failed"}


def test_a_staging_buffer_off_the_page_boundary_fails_the_check_naming_aligned_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def misaligned(shape: tuple[int, ...], dtype: torch.dtype, *,
                   pin_memory: bool = False) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        raw = torch.empty(nbytes + 2 * raw_tensor_files.ALIGNMENT, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % raw_tensor_files.ALIGNMENT + dtype.itemsize
        return raw[skip:skip + nbytes].view(dtype).view(shape)

    monkeypatch.setattr(raw_tensor_files, "aligned_empty", misaligned)
    state = {"ctx": SimpleNamespace(device=torch.device("cpu"))}
    with pytest.raises(gpu_check.CheckFailed, match=r"aligned_empty\(.*\) starts at .* not on"):
        gpu_check._check_aligned(state)


def test_the_trainer_turns_on_bf16_mixed_precision_for_cuda_and_refuses_it_on_cpu() -> None:
    tiny = get_config("tiny")
    assert tiny.train.mixed_precision is False
    assert _with_dtype(tiny, "bf16", torch.device("cuda", 0)).train.mixed_precision is True
    assert _with_dtype(tiny, "fp32", torch.device("cuda", 0)).train.mixed_precision is False
    assert _with_dtype(tiny, None, torch.device("cpu")) is tiny
    with pytest.raises(ConfigError, match=r"--dtype bf16 .* needs a CUDA device; .* on cpu"):
        _with_dtype(tiny, "bf16", torch.device("cpu"))
    args = build_parser().parse_args(["--save-root", "x", "--device", "cuda", "--dtype",
                                      "bf16", "--deterministic"])
    assert (args.device, args.dtype, args.deterministic) == ("cuda", "bf16", True)
    defaults = build_parser().parse_args(["--save-root", "x"])
    assert (defaults.device, defaults.dtype, defaults.deterministic) == (None, None, False)
