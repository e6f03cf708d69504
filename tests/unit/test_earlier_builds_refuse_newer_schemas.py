"""The last code that wrote each earlier ``schema_version`` refuses a root written now.

* ``schema_version`` 2 (0.3.0, commit 4a6ba1b): issue 40 moved block checksums out of
  ``.metadata`` (3): a reader of 2 cannot read them and would take the checkpoint for damage.
* ``schema_version`` 3 (commit 25865c3, never released as 0.4.0, but builds of it ran):
  issue 40 item 3 folded each rank's data files and checksum file into one data file per
  rank, its checksums in a trailer and its manifest checksum one of parts (4): a reader of
  3 would look for checksum files that are not there.
* ``schema_version`` 4 (commit 3d9a61c): issue 40 laid the raw format's ``.metadata`` out
  by rank (5): a reader of 4 would unpickle it whole and fail, taking it for damage.

Each refuses the root by its manifest instead: ``UnsupportedSchemaError`` naming today's
``schema_version`` and its own, nothing set aside, not one byte of a checkpoint changed;
the root then resumes today bit for bit. Each build runs from a ``git archive`` of its
commit, on the program ``tests/fixtures/releases/program.py`` (as
``test_previous_release.py`` runs 0.2).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from resumekit.store.manifest import SCHEMA_VERSION
from tests.conftest import unavailable
from tests.fixtures.releases import program

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPOSITORY = Path(__file__).resolve().parents[2]
BUILDS = {2: "4a6ba1b", 3: "25865c3", 4: "3d9a61c"}
"""The last commit that writes each earlier ``schema_version``."""


def _files(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.parametrize(("schema", "commit"), sorted(BUILDS.items()),
                         ids=[f"schema_{schema}" for schema in sorted(BUILDS)])
def test_a_build_of_an_earlier_schema_refuses_a_root_written_now_and_it_resumes_now(
        schema: int, commit: str, tmp_path: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar",
                              commit, "resumekit"], capture_output=True, check=False)
    if archive.returncode != 0:
        unavailable(f"commit {commit} is not in this clone's history "
                    f"({archive.stderr.decode(errors='replace').strip()}): clone with history")
    tree = tmp_path / "release"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    root = tmp_path / "root"
    expected = program.train(root)
    before = _files(root)
    assert schema < SCHEMA_VERSION
    done = subprocess.run(
        [sys.executable, str(Path(program.__file__).resolve()), "read",
         str(tmp_path / "read.json"), str(root)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"from {tree / 'resumekit' / '__init__.py'}" in done.stderr, done.stderr
    (result,) = json.loads((tmp_path / "read.json").read_text())
    assert result["error"] == "UnsupportedSchemaError", result
    assert (f"schema_version {SCHEMA_VERSION} is newer than this resumekit understands "
            f"({schema})") in result["message"]
    assert "step_000000010 (step 10) was written by a newer resumekit" in result["message"]
    assert not [entry for entry in result["listing"] if ".bad-" in entry]
    after = _files(root)
    assert {path: data for path, data in after.items() if path.startswith("step_")} == {
        path: data for path, data in before.items() if path.startswith("step_")}
    back = program.restored(Path(shutil.copytree(root, tmp_path / "again")))
    assert back["step"] == 10 and "error" not in back, back
    for key, value in expected["model"].items():
        assert torch.equal(back["snapshot"]["model"][key], value), key
    for index, part in expected["optimizer"].items():
        for key, value in part.items():
            assert torch.equal(back["snapshot"]["optimizer"][index][key], value), (index, key)
    assert torch.equal(back["snapshot"]["noise"], expected["noise"])
