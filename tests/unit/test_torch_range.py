"""The torch releases resumekit supports: declared once, said the same everywhere, checked.

``resumekit._compat.SUPPORTED_TORCH`` is the range; pyproject.toml requires exactly it, the
README, the FAQ, the quickstart and the compatibility page say it, ``import resumekit``
warns (and goes on) outside it, and the LingBot launchers leave out the torchrun options an
older torch lacks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.lingbot import drill
from resumekit import _compat
from resumekit._version import __version__

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_requires_exactly_the_supported_torch_range() -> None:
    text = (REPO / "pyproject.toml").read_text()
    dependencies = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    assert re.findall(r'^\s*"(torch\b[^"]*)"', dependencies, re.MULTILINE) == [
        f"torch{_compat.SUPPORTED_TORCH}"]


@pytest.mark.parametrize("page", ["README.md", "docs/faq.md", "docs/quickstart.md",
                                  "docs/compatibility.md"])
def test_the_pages_users_read_state_the_supported_range_and_no_other(page: str) -> None:
    text = (REPO / page).read_text()
    assert f"torch{_compat.SUPPORTED_TORCH}" in text
    # No older promise left standing ("PyTorch >= 2.6", "torch>=2.6,<2.15", ...).
    claims = re.findall(r"(?:torch|PyTorch)\s*(?:>=|≥)\s*\d+\.\d+[^\s`)]*", text)
    assert set(claims) == {f"torch{_compat.SUPPORTED_TORCH}"}, claims


def test_the_torch_running_this_suite_is_one_the_range_declares() -> None:
    assert _compat.torch_version_problem(torch.__version__) is None, torch.__version__


@pytest.mark.parametrize(("version", "release"), [
    ("2.15.0+cu132", (2, 15, 0)), ("2.9.1", (2, 9, 1)), ("2.10.0a0+git1234abc", (2, 10, 0)),
    ("2.13.0.dev20260101+cpu", (2, 13, 0)), ("2.12", (2, 12, 0)), (" 2.14.1 ", (2, 14, 1)),
])
def test_torch_release_reads_the_release_numbers_of_any_torch_version(
        version: str, release: tuple[int, int, int]) -> None:
    assert _compat.torch_release(version) == release


def test_torch_release_refuses_what_is_not_a_version() -> None:
    with pytest.raises(ValueError, match="not a torch version"):
        _compat.torch_release("nightly")


@pytest.mark.parametrize("version", ["2.9.0", "2.9.1+cu128", "2.13.0+cpu", "2.15.0+cu132",
                                     "2.15.9", "2.10.0a0+git1"])
def test_every_release_from_2_9_to_2_15_is_supported(version: str) -> None:
    assert _compat.torch_version_problem(version) is None


def test_a_torch_outside_the_range_is_named_with_the_range_and_which_side_it_is_on() -> None:
    older = _compat.torch_version_problem("2.8.0+cpu")
    assert older is not None and "torch 2.8.0+cpu is older than" in older
    assert f"torch{_compat.SUPPORTED_TORCH}" in older and "docs/compatibility.md" in older
    newer = _compat.torch_version_problem("2.16.0")
    assert newer is not None and "torch 2.16.0 is newer than" in newer
    assert _compat.torch_version_problem("3.0.0") is not None
    odd = _compat.torch_version_problem("local-build")
    assert odd is not None and "'local-build'" in odd
    assert _compat.torch_version_problem(None) is None  # no torch: no question of range


@pytest.mark.parametrize(("version", "signals", "shutdown"), [
    ("2.9.1+cu128", False, False), ("2.10.0", True, False), ("2.11.0", True, False),
    ("2.12.0", True, True), ("2.15.0+cu132", True, True),
])
def test_torchrun_takes_each_signal_option_from_the_torch_that_added_it(
        version: str, signals: bool, shutdown: bool) -> None:
    assert _compat.torchrun_takes("--signals-to-handle=SIGTERM", version) is signals
    assert _compat.torchrun_takes("--shutdown-timeout", version) is shutdown
    assert _compat.torchrun_takes("--nproc_per_node=2", version)  # not version-dependent


def _import_resumekit_with_torch(version: str | None) -> subprocess.CompletedProcess[str]:
    """``import resumekit`` in a fresh python whose ``torch`` says ``version`` (None: none)."""
    fake = ("import sys, types\n" + (
        "sys.modules['torch'] = None\n" if version is None else
        f"torch = types.ModuleType('torch'); torch.__version__ = {version!r}\n"
        "sys.modules['torch'] = torch\n") +
        "import resumekit\nprint(resumekit.__version__)\n")
    return subprocess.run([sys.executable, "-W", "default", "-c", fake], capture_output=True,
                          text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_import_resumekit_on_an_unsupported_torch_warns_naming_the_range_and_imports() -> None:
    done = _import_resumekit_with_torch("2.8.0+cpu")
    assert done.returncode == 0 and done.stdout.strip() == __version__  # never a refusal
    (line,) = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert f"UnsupportedTorchWarning: resumekit {__version__}: torch 2.8.0+cpu is older than" \
        in line
    assert f"(torch{_compat.SUPPORTED_TORCH})" in line


@pytest.mark.parametrize("version", ["2.13.0+cpu", None])
def test_import_resumekit_on_a_supported_torch_or_none_says_nothing(
        version: str | None) -> None:
    done = _import_resumekit_with_torch(version)
    assert done.returncode == 0 and done.stdout.strip() == __version__
    assert done.stderr == ""


def test_the_drill_launches_torchrun_with_the_shutdown_timeout_only_where_torchrun_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    launch = drill.Launch(Path("run"), shutdown_timeout=45)
    monkeypatch.setattr(_compat, "torch_version", lambda: "2.12.0")
    assert "--shutdown-timeout=45" in launch.command()
    assert drill.torchrun_options(45) == (["--shutdown-timeout=45"], [])
    monkeypatch.setattr(_compat, "torch_version", lambda: "2.9.1+cu128")
    assert not any(part.startswith("--shutdown-timeout") for part in launch.command())
    assert drill.torchrun_options(45) == ([], ["--shutdown-timeout=45"])


def test_every_release_the_pages_say_was_run_is_a_row_of_the_compatibility_table() -> None:
    page = (REPO / "docs" / "compatibility.md").read_text()
    table = page.split("compat-matrix:begin", 1)[1].split("compat-matrix:end", 1)[0]
    rows = {line.split("|")[1].strip().split("+")[0] for line in table.splitlines()
            if re.match(r"\| \d+\.\d+\.\d+", line) and "passed" in line}
    for name in ("README.md", "docs/faq.md", "docs/compatibility.md", "pyproject.toml"):
        text = (REPO / name).read_text()
        claimed = set(re.findall(r"\b2\.\d+\.\d+\b", text.split("compat-matrix:begin")[0]))
        said_run = {v for v in claimed if v not in {"2.10.0", "2.11.0"}}
        assert said_run <= rows | {"2.6.0", "2.7.0", "2.8.0"}, (name, said_run - rows)
        # A release in the range without a row is said to be not run, never tested.
        for release in ("2.10", "2.11"):
            if not any(row.startswith(release + ".") for row in rows):
                assert "not yet run" in text or "not been run" in text, (name, release)
