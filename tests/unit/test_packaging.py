"""The wheel and the sdist carry the Apache-2.0 LICENSE and declare it in SPDX form."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_and_the_sdist_include_the_license_and_declare_apache_2(
    tmp_path: Path,
) -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    project = tmp_path / "project"  # build a copy: no build/ or egg-info in the checkout
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "resumekit", project / "resumekit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                    "--outdir", str(tmp_path / "dist"), str(project)],
                   check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("resumekit-*.whl")
    (sdist,) = (tmp_path / "dist").glob("resumekit-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (licensed,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert archive.read(licensed).decode() == license_text
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("/LICENSE")]
        handle = archive.extractfile(member)
        assert handle is not None and handle.read().decode() == license_text
