"""``schema_version`` moves whenever a write uses something an older release cannot read.

An older release refuses a manifest whose ``schema_version`` is above its own, cleanly
(nothing set aside); it has no other way to tell a format it does not know from damage. So
every format today's writer emits must be one the current ``SCHEMA_VERSION`` names here:
a new storage descriptor, a new kind of file in a step directory or a new manifest field
fails this test until it is added to the table below, and one that an older release cannot
read is added under a new ``SCHEMA_VERSION`` (and to ``SCHEMA_HISTORY``). Issue 37: the
members' descriptor came in with ``schema_version`` still 1, and the previous release set
aside every checkpoint it met, then started at step 0.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import CheckpointManager
from resumekit.store import generations
from resumekit.store.generations import zombie_reason
from resumekit.store.layout import TENSORS_DIR
from resumekit.store.manifest import SCHEMA_HISTORY, SCHEMA_VERSION, Manifest, WriterGeneration
from resumekit.store.storage import Storage
from resumekit.tensors import metadata_file
from resumekit.tensors.index import read_metadata
from resumekit.tensors.raw.format import TRAILER, TRAILER_MAGIC, trailer_length

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: What the writer of each schema version emits: storage descriptors (up to the first
#: ``;``), kinds of file in a step directory (digits as ``N``), checksum file formats and
#: manifest fields. Add to the row of the current version only what a reader of the
#: version before can read; anything else is a new version.
WRITTEN: dict[int, dict[str, frozenset[str]]] = {
    2: {
        "descriptors": frozenset({"resumekit-raw/1", "resumekit-raw/3",
                                  "resumekit-raw/member", "(none: DCP's own format)"}),
        "files": frozenset({"manifest.json", "train_state.pt", "rank_state/rank_N.pt",
                            "tensors/.metadata", "tensors/__N_N.distcp",
                            "tensors/__N_checksums.json"}),
        "checksum formats": frozenset({"resumekit-raw-checksums/1"}),
        "manifest fields": frozenset({
            "schema_version", "step", "created_at", "captured_at", "world_size", "reason",
            "files", "data_dir", "lineage", "generation", "extras", "metrics", "state",
            "fingerprint", "versions", "tensor_format", "save_throughput", "local",
            # optional advice (the interval in force); readers of 2 ignore it
            "save_interval"}),
    },
    3: {
        # Issue 40: items stored alone record "resumekit-raw/4;<checksum file>", their
        # blocks in the checksum file, whose format readers of 2 do not know.
        "descriptors": frozenset({"resumekit-raw/4", "resumekit-raw/3",
                                  "resumekit-raw/member", "(none: DCP's own format)"}),
        "files": frozenset({"manifest.json", "train_state.pt", "rank_state/rank_N.pt",
                            "tensors/.metadata", "tensors/__N_N.distcp",
                            "tensors/__N_checksums.json"}),
        "checksum formats": frozenset({"resumekit-raw-checksums/2"}),
        "manifest fields": frozenset({
            "schema_version", "step", "created_at", "captured_at", "world_size", "reason",
            "files", "data_dir", "lineage", "generation", "extras", "metrics", "state",
            "fingerprint", "versions", "tensor_format", "save_throughput", "local",
            "save_interval",
            # optional advice for inspect's goodput (issue 38); readers of 3 before it
            # ignore it, as they ignore lineage.started_at
            "save_stalls"}),
        "file checksums": frozenset({"xxh3_128"}),
    },
    4: {
        # Issue 40 item 3: one raw data file per rank, written in parts by several
        # threads, its checksums in its trailer (no checksum file), items stored alone
        # "resumekit-raw/5", regions "resumekit-raw/6;<length>", and the manifest's
        # checksum of parts for it: readers of 3 know none of them.
        "descriptors": frozenset({"resumekit-raw/5", "resumekit-raw/6",
                                  "resumekit-raw/member", "(none: DCP's own format)"}),
        "files": frozenset({"manifest.json", "train_state.pt", "rank_state/rank_N.pt",
                            "tensors/.metadata", "tensors/__N_N.distcp"}),
        "checksum formats": frozenset({"resumekit-raw-trailer/1"}),
        "manifest fields": frozenset({
            "schema_version", "step", "created_at", "captured_at", "world_size", "reason",
            "files", "data_dir", "lineage", "generation", "extras", "metrics", "state",
            "fingerprint", "versions", "tensor_format", "save_throughput", "local",
            "save_interval", "save_stalls"}),
        "file checksums": frozenset({"xxh3_128", "xxh3_128-parts"}),
    },
    5: {
        # Issue 40: the raw format's .metadata laid out by rank ("resumekit-metadata/1"),
        # which readers of 4 unpickle whole and fail on; DCP's own format keeps DCP's pickle.
        "descriptors": frozenset({"resumekit-raw/5", "resumekit-raw/6",
                                  "resumekit-raw/member", "(none: DCP's own format)"}),
        "files": frozenset({"manifest.json", "train_state.pt", "rank_state/rank_N.pt",
                            "tensors/.metadata", "tensors/__N_N.distcp"}),
        "checksum formats": frozenset({"resumekit-raw-trailer/1"}),
        "manifest fields": frozenset({
            "schema_version", "step", "created_at", "captured_at", "world_size", "reason",
            "files", "data_dir", "lineage", "generation", "extras", "metrics", "state",
            "fingerprint", "versions", "tensor_format", "save_throughput", "local",
            "save_interval", "save_stalls"}),
        "file checksums": frozenset({"xxh3_128", "xxh3_128-parts"}),
        "metadata formats": frozenset({metadata_file.FORMAT, "DCP's pickle"}),
    },
}


def _written(root: Path, tensor_format: str) -> dict[str, set[str]]:
    """Save a model with large and small tensors and an optimizer; list what was written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 3))  # 64 KiB alone, the rest packed
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 128)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=None,
                                tensor_format=tensor_format)
    manager.save(1)
    manager.close()
    step = root / "step_000000001"
    found: dict[str, set[str]] = {"descriptors": set(), "files": set(),
                                  "checksum formats": set(), "manifest fields": set(),
                                  "file checksums": set(), "metadata formats": set()}
    for item in read_metadata(step / TENSORS_DIR).storage_data.values():
        descriptors: Any = item.transform_descriptors
        found["descriptors"].update(
            [text.split(";")[0] for text in descriptors] if descriptors
            else ["(none: DCP's own format)"])
    for path in step.rglob("*"):
        if path.is_file():
            found["files"].add(re.sub(r"\d+", "N", path.relative_to(step).as_posix()))
        if path.name == ".metadata":
            found["metadata formats"].add(metadata_file.FORMAT if metadata_file.is_framed(
                path.read_bytes()) else "DCP's pickle")
        if path.name.endswith("_checksums.json"):
            found["checksum formats"].add(json.loads(path.read_text())["format"])
        data = path.read_bytes() if path.suffix == ".distcp" else b""
        if data[-len(TRAILER_MAGIC):] == TRAILER_MAGIC:
            body = TRAILER.unpack(data[-TRAILER.size:])[0]
            start = len(data) - trailer_length(data[-TRAILER.size:], len(data), where="")
            found["checksum formats"].add(json.loads(data[start:start + body])["format"])
    manifest = json.loads((step / "manifest.json").read_text())
    found["manifest fields"].update(manifest)
    found["file checksums"].update(entry["checksum"].split(":")[0]
                                   for entry in manifest["files"])
    return found


def test_every_schema_version_up_to_the_current_one_says_what_it_added() -> None:
    assert sorted(SCHEMA_HISTORY) == list(range(1, SCHEMA_VERSION + 1))
    assert SCHEMA_VERSION in WRITTEN, (
        f"SCHEMA_VERSION is {SCHEMA_VERSION}: list in WRITTEN what its writer emits")


def test_every_format_the_writer_emits_is_one_the_current_schema_version_names(
        tmp_path: Path) -> None:
    found: dict[str, set[str]] = {}
    for tensor_format in ("raw", "dcp"):
        for kind, emitted in _written(tmp_path / tensor_format, tensor_format).items():
            found.setdefault(kind, set()).update(emitted)
        manifest = tmp_path / tensor_format / "step_000000001" / "manifest.json"
        assert json.loads(manifest.read_text())["schema_version"] == SCHEMA_VERSION
    for kind, emitted in found.items():
        unnamed = emitted - WRITTEN[SCHEMA_VERSION][kind]
        assert not unnamed, (
            f"the writer emits {kind} that schema_version {SCHEMA_VERSION} does not name: "
            f"{sorted(unnamed)}. If a reader of schema_version {SCHEMA_VERSION} can read "
            f"them, add them to WRITTEN[{SCHEMA_VERSION}]; if not, raise SCHEMA_VERSION "
            "(resumekit/store/manifest.py) and say what it adds in SCHEMA_HISTORY")
        assert WRITTEN[SCHEMA_VERSION][kind] == emitted, (
            f"WRITTEN[{SCHEMA_VERSION}] names {kind} the writer no longer emits: "
            f"{sorted(WRITTEN[SCHEMA_VERSION][kind] - emitted)}")


def test_a_claim_by_a_release_that_reads_an_older_schema_fences_no_checkpoint_it_could_not_see(
) -> None:
    """The previous release claims a root of schema 2 seeing no checkpoint (it takes each
    for a newer resumekit's, not one); that claim must not make today's checkpoints read
    as a fenced writer's commits."""
    writer = WriterGeneration(number=1, token="a", newest_step=None,
                              reads_schema=SCHEMA_VERSION)
    older_release = WriterGeneration(number=2, token="b", newest_step=None)  # records none
    now = WriterGeneration(number=2, token="b", newest_step=None,
                           reads_schema=SCHEMA_VERSION)
    written_now = Manifest(step=10, generation=writer)
    written_before = Manifest(step=10, generation=writer, schema_version=1)
    assert zombie_reason(written_now, older_release) is None
    assert zombie_reason(written_before, older_release) is not None  # it saw that one
    assert zombie_reason(written_now, now) is not None


def test_a_claim_records_the_newest_schema_version_its_writer_reads(tmp_path: Path) -> None:
    claimed = generations.claim(Storage(tmp_path), newest_step=None)
    assert claimed.reads_schema == SCHEMA_VERSION
    assert generations.newest_generation(Storage(tmp_path)) == claimed
