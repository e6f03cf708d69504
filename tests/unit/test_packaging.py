"""The wheel and the sdist carry the Apache-2.0 LICENSE and declare it in SPDX form.

The wheel installed into a clean environment, as a user installs it, is tests/install's.
"""

from __future__ import annotations

import re
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import tomllib

from tests.packaging import build_distributions

REPO = Path(__file__).resolve().parents[2]


def _optional_dependencies() -> dict[str, list[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project["optional-dependencies"])


def test_the_wheel_and_the_sdist_include_the_license_and_declare_apache_2(
    tmp_path: Path,
) -> None:
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    build_distributions(tmp_path / "dist", "sdist", "wheel")
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
    # Every extra is published, and only the runtime requirement names torch (an extra that
    # named it could replace the torch already installed).
    assert set(metadata.get_all("Provides-Extra")) == set(_optional_dependencies())
    torch_lines = [r for r in metadata.get_all("Requires-Dist")
                   if re.split(r"[\s<>=!~;(\[]", r, maxsplit=1)[0] == "torch"]
    assert len(torch_lines) == 1 and "extra ==" not in torch_lines[0], torch_lines
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("/LICENSE")]
        handle = archive.extractfile(member)
        assert handle is not None and handle.read().decode() == license_text
