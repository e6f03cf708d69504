"""`make test` runs `pytest tests` and `ruff check tests`: no suite directory may be left out.

pytest skips directories matching ``norecursedirs`` while it walks ``tests/``, and ruff
skips its ``exclude`` list; both defaults name ``dist``, so the multi-rank suite in
``tests/dist`` was silently never run by `pytest tests` nor linted by `ruff check tests`
until ``pyproject.toml`` set both lists without it.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]


def _suites() -> list[Path]:
    return [path for path in (ROOT / "tests").rglob("*") if path.is_dir()
            and path.name != "__pycache__" and any(path.glob("test_*.py"))]


@pytest.mark.parametrize(("tool", "patterns"), [
    ("pytest norecursedirs", SETTINGS["pytest"]["ini_options"].get("norecursedirs")),
    ("ruff exclude", SETTINGS["ruff"].get("exclude")),
])
def test_no_test_directory_matches_a_pattern_the_tool_skips(
        tool: str, patterns: list[str] | None) -> None:
    assert patterns is not None, f"{tool}'s default list would skip tests/dist"
    suites = _suites()
    assert any(path.name == "dist" for path in suites)
    skipped = [str(path.relative_to(ROOT)) for path in suites
               if any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)]
    assert skipped == [], tool


def _recipe(target: str) -> list[list[str]]:
    """The command lines of ``target``'s recipe in the Makefile, split into words."""
    lines, inside = [], False
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{target}:"):
            inside = True
        elif inside and not line.startswith("\t"):
            break
        elif inside:
            lines.append(line.split())
    return lines


def _make_test_pytest_runs() -> list[list[str]]:
    """The pytest runs of `make test`, also those of the targets its recipe makes."""
    runs = []
    for words in _recipe("test"):
        if "-m" in words and "pytest" in words:
            runs.append(words)
        elif words[0] == "$(MAKE)":
            for target in (word for word in words[1:] if not word.startswith("-")):
                runs += [w for w in _recipe(target) if "-m" in w and "pytest" in w]
    return runs


def _covered(run: list[str], suites: list[str]) -> set[str]:
    """The suite directories (``tests/...``) one pytest command line collects."""
    def under(suite: str, folder: str) -> bool:
        return suite == folder or suite.startswith(folder + "/")

    named = [word for word in run if word == "tests" or word.startswith("tests/")]
    ignored = [word.removeprefix("--ignore=") for word in run if word.startswith("--ignore=")]
    return {suite for suite in suites if any(under(suite, folder) for folder in named)
            and not any(under(suite, folder) for folder in ignored)}


def test_the_pytest_runs_of_make_test_cover_every_suite_once() -> None:
    runs = _make_test_pytest_runs()
    suites = [str(path.relative_to(ROOT)) for path in _suites()]
    covered = [_covered(run, suites) for run in runs]
    times = {suite: sum(suite in each for each in covered) for suite in suites}
    assert times == dict.fromkeys(suites, 1), (times, runs)
    fast = next(run for run, each in zip(runs, covered, strict=True) if "tests/unit" in each)
    assert "-n" in fast and "tests/property" in _covered(fast, suites)
    for run, each in zip(runs, covered, strict=True):
        if "-n" in run and each & {"tests/slurm", "tests/multinode"}:
            # Spread by test ("load"), two workers would each build the one machine-wide
            # namespace cluster and tear down the other's (and build each module fixture).
            # Not loadgroup: pytest-xdist's groups are silently ignored on pytest 9.2
            # (pytest-xdist issue 1386); a file to one worker holds on every version.
            assert "--dist" in run and run[run.index("--dist") + 1] == "loadfile", run


def test_every_multi_host_file_goes_to_one_worker_so_one_worker_builds_its_namespaces(
) -> None:
    from tests.conftest import xdist_scope  # noqa: PLC0415

    files = sorted(f"tests/multinode/{path.name}"
                   for path in (ROOT / "tests" / "multinode").glob("test_*.py"))
    assert len(files) >= 2, files
    assert len({xdist_scope(f"{file}::t", file) for file in files}) == 1, files


def test_the_cluster_suites_are_collected_first_multi_host_then_slurm() -> None:
    files = ["tests/bench/test_bench_tensor_format_smoke.py",
             "tests/slurm/test_cluster_preempts_and_requeues.py",
             "tests/multinode/test_lingbot_across_hosts.py",
             "tests/slurm/test_lingbot_preempted_under_slurm.py"]
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         *files], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, check=False)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    order = [line.split("/")[1] for line in completed.stdout.splitlines()
             if line.startswith("tests/")]
    # The file order given on the command line does not matter.
    assert order == ["multinode"] * 4 + ["slurm"] * 6 + ["bench"], order
