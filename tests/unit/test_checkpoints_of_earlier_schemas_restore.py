"""Checkpoints of every earlier ``schema_version`` restore and verify today.

Each root under ``tests/fixtures/schema_<N>`` was written by an earlier commit (its
``make_fixture.py`` says which, and how):

* ``schema_2`` (commit 4a6ba1b): an item stored alone with its block checksums in
  ``.metadata`` (``resumekit-raw/1``), packed regions (``resumekit-raw/3``) whose checksums
  are in a checksum file of format ``resumekit-raw-checksums/1``;
* ``schema_3`` (commit 25865c3): an item stored alone with its block checksums in the rank's
  checksum file (``resumekit-raw/4;__0_checksums.json``, ``resumekit-raw-checksums/2``),
  packed regions and four data files, each with a whole-file checksum in the manifest;
* ``schema_4`` (commit 3d9a61c): one data file per rank, its checksums in its trailer
  (``resumekit-raw/5`` alone, ``resumekit-raw/6`` packed regions), no checksum file, its
  manifest checksum one of parts, and ``.metadata`` one pickle of the whole metadata
  (before it was laid out by rank).

Each test works on a copy; a fixture is never written to.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from resumekit import CheckpointManager
from resumekit import tensors as tensor_io
from resumekit.errors import CorruptCheckpointError
from resumekit.tensors import metadata_file

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPOSITORY = Path(__file__).resolve().parents[2]
STEP = "step_000000003"


@dataclass(frozen=True)
class Schema:
    """One earlier schema's fixture and what its format looks like on disk."""

    version: int
    heads: frozenset[str]  # the descriptors' heads found in .metadata
    checksum_file_format: str | None  # None: no checksum file (a trailer, schema 4)
    alone_descriptor: str  # the start of an item stored alone's descriptor
    data_files: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"schema_{self.version}"

    @property
    def root(self) -> Path:
        return FIXTURES / self.name

    @property
    def maker(self) -> ModuleType:
        return importlib.import_module(f"tests.fixtures.{self.name}.make_fixture")


SCHEMAS = [
    Schema(2, frozenset({"resumekit-raw/1", "resumekit-raw/3"}), "resumekit-raw-checksums/1",
           "resumekit-raw/1;", tuple(f"__0_{number}.distcp" for number in range(4))),
    Schema(3, frozenset({"resumekit-raw/4", "resumekit-raw/3"}), "resumekit-raw-checksums/2",
           "resumekit-raw/4;__0_checksums.json",
           tuple(f"__0_{number}.distcp" for number in range(4))),
    Schema(4, frozenset({"resumekit-raw/5", "resumekit-raw/6"}), None, "resumekit-raw/5",
           ("__0_0.distcp",)),
]


@pytest.fixture(params=SCHEMAS, ids=[schema.name for schema in SCHEMAS])
def schema(request: pytest.FixtureRequest) -> Schema:
    return request.param  # type: ignore[no-any-return]


def _copy(schema: Schema, tmp_path: Path) -> Path:
    return Path(shutil.copytree(schema.root / "root", tmp_path / "root"))


def test_each_fixture_is_of_its_schema_with_its_descriptors_and_checksum_file(
        schema: Schema, tmp_path: Path) -> None:
    root = _copy(schema, tmp_path)
    manifest = json.loads((root / STEP / "manifest.json").read_text())
    assert manifest["schema_version"] == schema.version
    metadata = tensor_io.read_metadata(root / STEP / "tensors")
    heads = {(info.transform_descriptors or ["-"])[0].split(";")[0]
             for info in (metadata.storage_data or {}).values()}
    assert schema.heads <= heads
    if schema.checksum_file_format is None:
        assert not (root / STEP / "tensors" / "__0_checksums.json").exists()
        assert not metadata_file.is_framed((root / STEP / "tensors" / ".metadata").read_bytes())
    else:
        sidecar = json.loads((root / STEP / "tensors" / "__0_checksums.json").read_text())
        assert sidecar["format"] == schema.checksum_file_format
    assert sorted(path.name for path in (root / STEP / "tensors").glob("*.distcp")
                  ) == list(schema.data_files)


def test_a_checkpoint_of_an_earlier_schema_restores_bit_for_bit(schema: Schema,
                                                                  tmp_path: Path) -> None:
    root = _copy(schema, tmp_path)
    model, optimizer = schema.maker.build()
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                                config={"fixture": schema.name}, read_only=True)
    assert manager.restore() in (3, 4)
    manager.close()
    expected = json.loads((schema.root / "expected.json").read_text())
    assert schema.maker.digests(model, optimizer) == expected["tensors"]


def test_resumekit_verify_passes_a_checkpoint_of_an_earlier_schema_and_catches_a_flipped_byte(
        schema: Schema, tmp_path: Path) -> None:
    root = _copy(schema, tmp_path)
    command = [sys.executable, "-m", "resumekit", "verify", str(root), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          cwd=REPOSITORY)
    assert done.returncode == 0, done.stdout + done.stderr
    data = root / STEP / "tensors" / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[100] ^= 0x01
    data.write_bytes(bytes(damaged))
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          cwd=REPOSITORY)
    assert done.returncode != 0 and "__0_0.distcp" in done.stdout + done.stderr


def test_a_flipped_byte_in_an_earlier_schemas_item_stored_alone_fails_its_load_naming_the_key(
        schema: Schema, tmp_path: Path) -> None:
    root = _copy(schema, tmp_path)
    tensors = root / STEP / "tensors"
    metadata = tensor_io.read_metadata(tensors)
    info = next(info for index, info in (metadata.storage_data or {}).items()
                if index.fqn == "model.0.weight")
    assert info.transform_descriptors[0].startswith(schema.alone_descriptor)
    path = tensors / info.relative_path
    damaged = bytearray(path.read_bytes())
    damaged[info.offset + 17] ^= 0x04
    path.write_bytes(bytes(damaged))
    model, _ = schema.maker.build()
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load_subset({"model": model.state_dict()}, tensors)
    assert caught.value.key == "model.0.weight"
