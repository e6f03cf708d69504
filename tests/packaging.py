"""Building resumekit's wheel and sdist the way a release does, from a copy of the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.limits import HANG_S

REPO = Path(__file__).resolve().parents[1]


def build_distributions(out: Path, *kinds: str) -> Path:
    """Build ``kinds`` (``"wheel"``, ``"sdist"``) of a copy of the checkout into ``out``.

    The copy holds what a release builds from (pyproject.toml, README.md, LICENSE and the
    package), so no build/ or egg-info lands in the checkout. Built without isolation:
    the dev extra declares the build backend (setuptools >= 77) and ``build``.

    Returns:
        ``out``.
    """
    project = out.parent / f"{out.name}-project"
    project.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "resumekit", project / "resumekit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "build", "--no-isolation",
                    *(f"--{kind}" for kind in kinds), "--outdir", str(out), str(project)],
                   check=True, capture_output=True, timeout=HANG_S)
    return out
