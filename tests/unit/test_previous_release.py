"""Today's roots and the previous release's code (commit b0a6499), both ways round (issue 37).

The previous release is run from a checkout of its commit (``git archive`` of its
``resumekit/`` into a temporary directory, ``PYTHONPATH`` naming it, this venv), on the same
program (``tests/fixtures/releases/program.py``):

* a root written now is refused by it cleanly: ``UnsupportedSchemaError`` naming
  today's ``schema_version``, nothing set aside, not one byte of the root changed (before
  ``schema_version`` 2 it set every checkpoint aside and the run started at step 0);
* a root it wrote resumes now bit for bit (tensors, optimizer, scheduler, random streams);
* checkpoints it set aside because it could not read them (schema 4's raw format, written
  by its build and recorded as ``schema_version`` 1, as checkpoints before version 2 were)
  are put back now, with a warning, and resume bit for bit;
* today's format recorded as version 1 is refused by it as unsafe, nothing set aside.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from resumekit.store.manifest import SCHEMA_VERSION
from tests.conftest import unavailable
from tests.fixtures.releases import program

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPOSITORY = Path(__file__).resolve().parents[2]
PROGRAM = Path(program.__file__).resolve()
SCHEMA_4_BUILD = "3d9a61c"
"""The last build writing ``schema_version`` 4 (tests/fixtures/schema_4 is its)."""


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout of the previous release's package (``resumekit/`` of its commit)."""
    return _checkout(program.PREVIOUS_RELEASE, tmp_path_factory)


def _checkout(commit: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``resumekit/`` of ``commit``, from this clone's history, in a temporary directory."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", commit,
                              "resumekit"], capture_output=True, check=False)
    if archive.returncode != 0:
        unavailable(f"commit {commit} (an earlier build) is not in this clone's history "
                    f"({archive.stderr.decode(errors='replace').strip()}): clone with history")
    tree = tmp_path_factory.mktemp(f"resumekit-{commit}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _run_previous(tree: Path, *args: str, cwd: Path) -> str:
    """Run the program with the previous release's code; return what it printed on stderr."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(PROGRAM), *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"from {tree / 'resumekit' / '__init__.py'}" in done.stderr, done.stderr
    return done.stderr


def _files(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(root.rglob("*")) if path.is_file()}


def _same(got: Any, expected: Any, where: str) -> None:
    """Bit for bit: tensors equal with their dtype, everything else equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert sorted(got, key=str) == sorted(expected, key=str), where
        for key, value in expected.items():
            _same(got[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
            _same(mine, theirs, f"{where}[{index}]")
    else:
        assert got == expected, where


@pytest.fixture(scope="module")
def rounds(previous: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every root of the module, written and read by the previous release in two runs."""
    work = tmp_path_factory.mktemp("releases")
    written_then = work / "written-then"
    _run_previous(previous, "write", str(written_then), str(work / "then.pt"), cwd=work)
    now = work / "written-now"
    expected_now = program.train(now)
    mixed = work / "mixed"  # the previous release's steps 5 and 10, then today's 15
    shutil.copytree(written_then, mixed)
    expected_mixed = program.train(mixed, (15,))
    # A raw format the previous release cannot read, recorded as schema_version 1, as the
    # members' descriptor was before version 2 (issue 37): schema 4's (one data file per
    # rank, its trailer), written by its build (SCHEMA_4_BUILD). Today's own format
    # (schema 5: .metadata laid out by rank) is refused by the previous release's safe
    # unpickler before any descriptor is read, so nothing would be set aside.
    before_schema_2 = work / "before-schema-2"
    _run_previous(_checkout(SCHEMA_4_BUILD, tmp_path_factory), "write", str(before_schema_2),
                  str(work / "schema-4.pt"), cwd=work)
    for manifest in before_schema_2.glob("step_*/manifest.json"):
        document = json.loads(manifest.read_text())
        assert document["schema_version"] == 4
        manifest.write_text(json.dumps({**document, "schema_version": 1}, indent=2))
    # Today's format mislabelled the same way: nothing the previous release can set aside.
    today_as_1 = work / "today-as-schema-1"
    shutil.copytree(now, today_as_1)
    for manifest in today_as_1.glob("step_*/manifest.json"):
        document = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**document, "schema_version": 1}, indent=2))
    files = {root.name: _files(root) for root in (now, mixed, today_as_1)}
    _run_previous(previous, "read", str(work / "read.json"), str(now), str(mixed),
                  str(before_schema_2), str(today_as_1), cwd=work)
    read = {Path(result["root"]).name: result
            for result in json.loads((work / "read.json").read_text())}
    return {"read": read, "files": files, "now": now, "mixed": mixed,
            "expected_now": expected_now, "expected_mixed": expected_mixed,
            "written_then": written_then,
            "expected_then": torch.load(work / "then.pt", weights_only=False),
            "expected_schema_4": torch.load(work / "schema-4.pt", weights_only=False),
            "before_schema_2": before_schema_2, "today_as_1": today_as_1}


@pytest.mark.parametrize("name", ["written-now", "mixed"])
def test_the_previous_release_refuses_a_root_written_now_and_it_resumes_now_bit_for_bit(
        rounds: dict[str, Any], name: str, tmp_path: Path) -> None:
    result = rounds["read"][name]
    assert result["error"] == "UnsupportedSchemaError", result
    assert f"schema_version {SCHEMA_VERSION} is newer than this resumekit understands (1)" \
        in result["message"]
    newest = 10 if name == "written-now" else 15
    assert f"step_0000000{newest} (step {newest}) was written by a newer resumekit" \
        in result["message"]
    assert not [entry for entry in result["listing"] if ".bad-" in entry]
    root = rounds["now"] if name == "written-now" else rounds["mixed"]
    files = _files(root)
    claims = [path for path in files if path.startswith(".resumekit-generations/0")]
    kept = {path: data for path, data in files.items() if path.startswith("step_")}
    assert kept == {path: data for path, data in rounds["files"][root.name].items()
                    if path.startswith("step_")}  # not one byte of a checkpoint changed
    assert len(claims) == (3 if name == "mixed" else 2)  # it claimed the root, seeing nothing
    back = program.restored(Path(shutil.copytree(root, tmp_path / "root")))
    assert back["step"] == newest and "error" not in back, back
    assert back["warnings"] == []
    expected = rounds["expected_now"] if name == "written-now" else rounds["expected_mixed"]
    _same(back["snapshot"], expected, "restored")


def test_a_root_the_previous_release_wrote_resumes_now_bit_for_bit(
        rounds: dict[str, Any], tmp_path: Path) -> None:
    root = Path(shutil.copytree(rounds["written_then"], tmp_path / "root"))
    result = program.restored(root)
    assert result["step"] == 10 and "error" not in result, result
    assert result["warnings"] == []
    _same(result["snapshot"], rounds["expected_then"], "restored")


def test_checkpoints_the_previous_release_set_aside_are_put_back_and_resume_bit_for_bit(
        rounds: dict[str, Any], tmp_path: Path) -> None:
    said = rounds["read"]["before-schema-2"]  # issue 37's finding, as it was
    assert said["error"] == "ResumekitError" and "could be restored" in said["message"]
    assert re.search(  # what it cannot read: the members' descriptor, or (schema 3) the
        # items stored alone's descriptor or their checksum file, or (schema 4) the
        # descriptors of one data file per rank with its trailer
        r"unreadable (storage descriptor 'resumekit-raw/(member|4;|5|6;)"
        r"|checksum file \(unknown format 'resumekit-raw-checksums/2'\))",
        said["message"]), said["message"]
    aside = [entry for entry in said["listing"] if ".bad-" in entry]
    assert sorted(entry.split(".bad-")[0] for entry in aside) == [
        ".step_000000005", ".step_000000010"]
    root = Path(shutil.copytree(rounds["before_schema_2"], tmp_path / "root"))
    result = program.restored(root)
    assert result["step"] == 10 and "error" not in result, result
    assert len(result["warnings"]) == 2, result["warnings"]
    for entry in aside:
        assert any(str(root / entry) in warning and "an older resumekit" in warning
                   for warning in result["warnings"]), (entry, result["warnings"])
    assert not [entry for entry in result["listing"] if ".bad-" in entry]
    assert {"step_000000005", "step_000000010"} <= set(result["listing"])
    _same(result["snapshot"], rounds["expected_schema_4"], "restored")


def test_todays_metadata_mislabelled_as_schema_1_is_refused_by_the_previous_release_untouched(
        rounds: dict[str, Any]) -> None:
    # Schema 5's .metadata is laid out by rank; its first pickle names a resumekit function
    # that the previous release's safe unpickler does not allow: refused as unsafe before
    # any descriptor is read, so no step is set aside as unreadable (as schema 4's were).
    said = rounds["read"]["today-as-schema-1"]
    assert said["error"] == "UnsafeCheckpointError", said
    assert "metadata_file.stock_reader_refused" in said["message"], said["message"]
    assert not [entry for entry in said["listing"] if ".bad-" in entry], said["listing"]
    root = rounds["today_as_1"]
    kept = {path: data for path, data in _files(root).items() if path.startswith("step_")}
    assert kept == {path: data for path, data in rounds["files"][root.name].items()
                    if path.startswith("step_")}
