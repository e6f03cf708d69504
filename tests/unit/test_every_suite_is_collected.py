"""`make test` runs `pytest tests`: no suite directory under tests/ may be left out of it.

pytest skips directories matching ``norecursedirs`` while it walks ``tests/``, and its
default list names ``dist``: the multi-rank suite in ``tests/dist`` was silently never run
by `pytest tests` until ``pyproject.toml`` set the list without it.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_no_test_directory_matches_a_pattern_pytest_does_not_recurse_into() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]
    patterns = options.get("norecursedirs")
    assert patterns is not None, "pytest's default norecursedirs would skip tests/dist"
    suites = [path for path in (ROOT / "tests").rglob("*") if path.is_dir()
              and path.name != "__pycache__" and any(path.glob("test_*.py"))]
    assert any(path.name == "dist" for path in suites)
    skipped = [str(path.relative_to(ROOT)) for path in suites
               if any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)]
    assert skipped == []
