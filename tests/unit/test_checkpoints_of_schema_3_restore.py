"""A checkpoint of ``schema_version`` 3 restores and verifies today (issue 40 item 3's change).

The root under ``tests/fixtures/schema_3`` was written by commit 25865c3 (``make_fixture.py``
says how): an item stored alone with its block checksums in the rank's checksum file
(``resumekit-raw/4;__0_checksums.json``, ``resumekit-raw-checksums/2``), packed regions
(``resumekit-raw/3``) and four data files, each with a whole-file checksum in the manifest.
Each test works on a copy; the fixture is never written to.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from resumekit import CheckpointManager
from resumekit import tensors as tensor_io
from resumekit.errors import CorruptCheckpointError
from tests.fixtures.schema_3 import make_fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema_3"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
REPOSITORY = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "root", tmp_path / "root"))


def _manifest(root: Path) -> dict[str, object]:
    return json.loads((root / "step_000000003" / "manifest.json").read_text())


def test_the_fixture_is_of_schema_3_with_a_checksum_file_and_four_data_files(tmp_path: Path
                                                                               ) -> None:
    root = _copy(tmp_path)
    assert _manifest(root)["schema_version"] == 3
    metadata = tensor_io.read_metadata(root / "step_000000003" / "tensors")
    heads = {(info.transform_descriptors or ["-"])[0].split(";")[0]
             for info in (metadata.storage_data or {}).values()}
    assert {"resumekit-raw/4", "resumekit-raw/3"} <= heads
    sidecar = json.loads((root / "step_000000003" / "tensors" / "__0_checksums.json"
                          ).read_text())
    assert sidecar["format"] == "resumekit-raw-checksums/2"
    assert sorted(path.name for path in (root / "step_000000003" / "tensors").glob(
        "*.distcp")) == [f"__0_{number}.distcp" for number in range(4)]


def test_a_checkpoint_of_schema_3_restores_bit_for_bit(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    model, optimizer = make_fixture.build()
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                                config={"fixture": "schema_3"}, read_only=True)
    assert manager.restore() in (3, 4)
    manager.close()
    assert make_fixture.digests(model, optimizer) == EXPECTED["tensors"]


def test_resumekit_verify_passes_a_checkpoint_of_schema_3_and_catches_a_flipped_byte(
        tmp_path: Path) -> None:
    root = _copy(tmp_path)
    command = [sys.executable, "-m", "resumekit", "verify", str(root), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          cwd=REPOSITORY)
    assert done.returncode == 0, done.stdout + done.stderr
    data = root / "step_000000003" / "tensors" / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[100] ^= 0x01
    data.write_bytes(bytes(damaged))
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          cwd=REPOSITORY)
    assert done.returncode != 0 and "__0_0.distcp" in done.stdout + done.stderr


def test_a_flipped_byte_in_a_schema_3_item_stored_alone_fails_its_load_naming_the_key(
        tmp_path: Path) -> None:
    root = _copy(tmp_path)
    tensors = root / "step_000000003" / "tensors"
    metadata = tensor_io.read_metadata(tensors)
    info = next(info for index, info in (metadata.storage_data or {}).items()
                if index.fqn == "model.0.weight")
    assert info.transform_descriptors[0] == "resumekit-raw/4;__0_checksums.json"
    path = tensors / info.relative_path
    damaged = bytearray(path.read_bytes())
    damaged[info.offset + 17] ^= 0x04
    path.write_bytes(bytes(damaged))
    model, _ = make_fixture.build()
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load_subset({"model": model.state_dict()}, tensors)
    assert caught.value.key == "model.0.weight"
