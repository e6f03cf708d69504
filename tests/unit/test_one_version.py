"""One version story (issue 36): the package version is one number, every place says it,
and every release the code and the docs name agrees with it.

Before, the package said 0.1.0 (``--version``, every manifest) while the docs and the
deprecation warnings spoke of 0.2, 0.3 and "removed in 0.4". Here: ``pyproject.toml`` and
``resumekit/_version.py`` agree; ``--version``, manifests and ``inspect`` say the version;
every "removed in 0.N" / "until 0.N" of the code and the docs names a later release than
the current one, and every release they name as done is not later than it; the docs'
versions page names the current version. (0.2's module paths, whose warnings this test also
read, are gone: issue 41, CHANGELOG.md.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
import torch

from resumekit import CheckpointManager
from resumekit._version import __version__
from resumekit.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPOSITORY = Path(__file__).resolve().parents[2]
CURRENT = tuple(int(part) for part in __version__.split("."))
#: Phrases that promise a later release: "removed in 0.4", "until 0.4", "go in 0.4".
LATER = re.compile(r"\b(?:removed|go|goes|gone|dropped) in (?:resumekit )?(\d+)\.(\d+)"
                   r"|\buntil (?:resumekit )?(\d+)\.(\d+)")
#: Phrases that name a release as done: "in resumekit 0.3", "Version 0.3 grouped", "since 0.3".
DONE = re.compile(r"\b(?:[Vv]ersion|in resumekit|since resumekit|since) (\d+)\.(\d+)\b"
                  r"|\bresumekit (\d+)\.(\d+)\.(\d+)\b")


def _texts() -> dict[str, str]:
    """The code, the docs and the README, whitespace joined and Python's implicit string
    concatenations undone (``"removed " "in 0.4"``), so a phrase split over lines is found."""
    paths = [*sorted((REPOSITORY / "resumekit").rglob("*.py")),
             *sorted((REPOSITORY / "docs").glob("*.md")), REPOSITORY / "README.md"]
    texts = {}
    for path in paths:
        text = re.sub(r"\s+", " ", path.read_text())
        texts[path.relative_to(REPOSITORY).as_posix()] = re.sub(r"\" f?\"", "", text)
    return texts


def _named(pattern: re.Pattern[str], text: str) -> list[tuple[tuple[int, ...], str]]:
    found = []
    for match in pattern.finditer(text):
        numbers = tuple(int(group) for group in match.groups() if group is not None)
        found.append((numbers, match.group(0)))
    return found


def test_pyproject_and_the_package_say_one_version() -> None:
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_resumekit_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"resumekit {__version__}"


def test_a_manifest_records_the_writers_version_and_inspect_shows_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manager = CheckpointManager(tmp_path, model=torch.nn.Linear(2, 2), retention=None)
    manager.save(3)
    manager.close()
    manifest = json.loads((tmp_path / "step_000000003" / "manifest.json").read_text())
    assert manifest["versions"]["resumekit"] == __version__
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)["checkpoints"]
    assert entry["resumekit_version"] == __version__
    assert main(["inspect", str(tmp_path / "step_000000003")]) == 0
    assert f"resumekit {__version__}" in capsys.readouterr().out


def test_every_release_the_code_and_the_docs_name_agrees_with_the_version() -> None:
    texts = _texts()
    wrong = []
    for where, text in texts.items():
        for numbers, phrase in _named(LATER, text):
            if numbers[:2] <= CURRENT[:2]:
                wrong.append(f"{where}: {phrase!r} promises a release this one ({__version__}) "
                             "already is or is past")
        for numbers, phrase in _named(DONE, text):
            if numbers > CURRENT[:len(numbers)]:
                wrong.append(f"{where}: {phrase!r} names as done a release after this one "
                             f"({__version__})")
    assert not wrong, "\n".join(wrong)


def test_the_versions_page_names_the_current_version() -> None:
    page = (REPOSITORY / "docs" / "versions.md").read_text()
    assert f"**resumekit {__version__}**" in page
    assert f"| the package version (`{__version__}`) |" in page
