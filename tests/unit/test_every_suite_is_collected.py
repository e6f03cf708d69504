"""`make test` runs `pytest tests` and `ruff check tests`: no suite directory may be left out.

pytest skips directories matching ``norecursedirs`` while it walks ``tests/``, and ruff
skips its ``exclude`` list; both defaults name ``dist``, so the multi-rank suite in
``tests/dist`` was silently never run by `pytest tests` nor linted by `ruff check tests`
until ``pyproject.toml`` set both lists without it.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import tomllib

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


def test_the_pytest_runs_of_make_test_cover_every_suite_once() -> None:
    recipe, inside = [], False
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("test:"):
            inside = True
        elif inside and not line.startswith("\t"):
            break
        elif inside and "-m pytest" in line:
            recipe.append(line.split())
    *parallel_runs, rest = recipe
    assert parallel_runs and all("-n" in run for run in parallel_runs), recipe
    named = [word for run in parallel_runs for word in run if word.startswith("tests/")]
    assert len(named) == len(set(named))  # no suite in two of the parallel runs
    assert {"tests/unit", "tests/property"} <= set(named)
    assert "tests" in rest and "-n" not in rest
    ignored = {word.removeprefix("--ignore=") for word in rest if word.startswith("--ignore=")}
    assert ignored == set(named)  # the rest of tests/ runs in the last run, nothing twice
