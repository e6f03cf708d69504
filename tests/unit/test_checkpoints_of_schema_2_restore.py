"""A checkpoint of ``schema_version`` 2 restores and verifies today (issue 40's format change).

The root under ``tests/fixtures/schema_2`` was written by commit 4a6ba1b (``make_fixture.py``
says how): an item stored alone with its block checksums in ``.metadata``
(``resumekit-raw/1``) and packed regions whose checksums are in a checksum file of format
``resumekit-raw-checksums/1``. Each test works on a copy; the fixture is never written to.
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
from tests.fixtures.schema_2 import make_fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema_2"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
REPOSITORY = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "root", tmp_path / "root"))


def _manifest(root: Path) -> dict[str, object]:
    return json.loads((root / "step_000000003" / "manifest.json").read_text())


def test_the_fixture_is_of_schema_2_with_block_checksums_in_its_metadata(tmp_path: Path
                                                                         ) -> None:
    root = _copy(tmp_path)
    assert _manifest(root)["schema_version"] == 2
    metadata = tensor_io.read_metadata(root / "step_000000003" / "tensors")
    heads = {(info.transform_descriptors or ["-"])[0].split(";")[0]
             for info in (metadata.storage_data or {}).values()}
    assert {"resumekit-raw/1", "resumekit-raw/3"} <= heads
    sidecar = json.loads((root / "step_000000003" / "tensors" / "__0_checksums.json"
                          ).read_text())
    assert sidecar["format"] == "resumekit-raw-checksums/1"


def test_a_checkpoint_of_schema_2_restores_bit_for_bit(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    model, optimizer = make_fixture.build()
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                                config={"fixture": "schema_2"}, read_only=True)
    assert manager.restore() in (3, 4)
    manager.close()
    assert make_fixture.digests(model, optimizer) == EXPECTED["tensors"]


def test_resumekit_verify_passes_a_checkpoint_of_schema_2_and_catches_a_flipped_byte(
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


def test_a_flipped_byte_in_a_schema_2_item_stored_alone_fails_its_load_naming_the_key(
        tmp_path: Path) -> None:
    root = _copy(tmp_path)
    tensors = root / "step_000000003" / "tensors"
    metadata = tensor_io.read_metadata(tensors)
    info = next(info for index, info in (metadata.storage_data or {}).items()
                if index.fqn == "model.0.weight")
    assert info.transform_descriptors[0].startswith("resumekit-raw/1;")
    path = tensors / info.relative_path
    damaged = bytearray(path.read_bytes())
    damaged[info.offset + 17] ^= 0x04
    path.write_bytes(bytes(damaged))
    model, _ = make_fixture.build()
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load_subset({"model": model.state_dict()}, tensors)
    assert caught.value.key == "model.0.weight"
