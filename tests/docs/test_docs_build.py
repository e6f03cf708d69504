"""The documentation site builds with ``mkdocs build --strict``, and strict means strict.

The first test is the build ``make docs-build`` runs. The second is its negative control: a
copy of the site with one broken API cross-reference, one link to a missing page and one
page left out of the nav must fail, naming each of the three, so a configuration change
that quietly stops catching them fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import unavailable
from tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec(
        "mkdocstrings_handlers.python"
    ) is None:
        unavailable("mkdocs / mkdocstrings[python] not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent, env=env, capture_output=True, text=True, timeout=HANG_S, check=False,
    )


def test_the_site_builds_in_strict_mode_without_a_single_warning(tmp_path: Path) -> None:
    result = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stderr, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="resumekit.CheckpointManager"' in api  # at its public path
    # The Google-style "Raises:" entry of CheckpointManager.save was parsed into a table
    # row (its reST literal became <code>), not pasted as raw docstring text.
    assert "<code>step</code> is not newer than the newest committed step" in api
    assert "``step`` is not newer" not in api


def test_a_broken_reference_a_missing_page_and_a_page_outside_the_nav_each_fail_the_build(
    tmp_path: Path,
) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with (tmp_path / "docs" / "api.md").open("a") as api:
        api.write("\nSee [the manager][resumekit.manager.NoSuchManager] "
                  "and [the old guide](no-such-page.md).\n")
    (tmp_path / "docs" / "stray-notes.md").write_text("# Notes nobody linked\n")

    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")

    assert result.returncode != 0
    warnings = _warnings(result.stderr)
    for culprit in ("resumekit.manager.NoSuchManager", "no-such-page.md", "stray-notes.md"):
        assert any(culprit in warning for warning in warnings), (culprit, result.stderr[-4000:])


def _warnings(log: str) -> list[str]:
    """Split mkdocs' log into messages and keep the warnings (some span several lines)."""
    messages = re.split(r"^(?=(?:DEBUG|INFO|WARNING|ERROR)\b)", log, flags=re.M)
    return [message for message in messages if message.startswith("WARNING")]
