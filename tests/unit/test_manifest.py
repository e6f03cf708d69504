"""The manifest: its fields, lineage from the environment, JSON round trip, refusals."""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timedelta, timezone

import pytest
import xxhash

from resumekit.errors import ManifestError, UnsafeCheckpointError, UnsupportedSchemaError
from resumekit.store.manifest import (
    CHECKSUM_ALGORITHM,
    SCHEMA_VERSION,
    FileEntry,
    Lineage,
    Manifest,
    SaveReason,
    checksum_chunks,
    parse_manifest,
    safe_relative_path,
)

SOURCE = "/ckpt/step_000001000/manifest.json"


def _full_manifest() -> Manifest:
    return Manifest(
        step=1000,
        world_size=8,
        reason=SaveReason.PREEMPTION,
        files=[
            FileEntry(path="model/__0_0.distcp", size=1234, checksum=checksum_chunks([b"a"])),
            FileEntry(path="optim.bin", size=0, checksum=checksum_chunks([])),
        ],
        lineage=Lineage(hostname="node7", pid=4242, slurm_job_id="111882",
                        slurm_restart_count=3, resumed_from_step=750, launcher="slurm"),
        extras={"wandb_run": "abc123", "nested": {"list": [1, 2.5, None, True]}},
        state={"model": True, "optimizer": True},
        fingerprint={"lr": 3e-5, "warmup": 200},
    )


def _document(**changes: object) -> bytes:
    document = json.loads(_full_manifest().to_json())
    document.update(changes)
    return json.dumps(document).encode()


def test_a_manifest_records_every_documented_field() -> None:
    manifest = _full_manifest()
    document = json.loads(manifest.to_json())
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["step"] == 1000
    assert document["world_size"] == 8
    assert document["reason"] == "preemption"
    assert document["files"][0] == {
        "path": "model/__0_0.distcp", "size": 1234, "checksum": checksum_chunks([b"a"]),
    }
    assert document["lineage"] == {
        "hostname": "node7", "pid": 4242, "slurm_job_id": "111882",
        "slurm_restart_count": 3, "slurm_nodelist": None, "resumed_from_step": 750,
        "launcher": "slurm", "imported_from": None, "initialized_from": None,
        "restored_from_tier": None, "started_at": None,
    }
    assert document["save_stalls"] is None  # set by a manager's save (issue 38)
    assert document["local"] is None  # a checkpoint of the whole run, not a node-local copy
    assert document["extras"]["wandb_run"] == "abc123"
    assert datetime.fromisoformat(document["created_at"]).tzinfo is not None
    assert set(document["versions"]) >= {"resumekit", "python"}
    assert manifest.total_bytes == 1234


def test_a_manifest_round_trips_through_json_unchanged() -> None:
    manifest = _full_manifest()
    assert parse_manifest(manifest.to_json(), source=SOURCE) == manifest


def test_created_at_is_the_current_utc_time() -> None:
    before = datetime.now(timezone.utc)
    created = Manifest(step=1).created_at
    after = datetime.now(timezone.utc)
    assert created.utcoffset() == timedelta(0)
    assert before <= created <= after


def test_lineage_records_slurm_job_and_restart_count_when_present(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "111882")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    lineage = Manifest(step=5).lineage
    assert lineage.slurm_job_id == "111882"
    assert lineage.slurm_restart_count == 2
    assert lineage.hostname == socket.gethostname()
    assert lineage.pid == os.getpid()


def test_a_first_slurm_run_has_restart_count_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "111321")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    lineage = Lineage.current(resumed_from_step=200, launcher="slurm")
    assert (lineage.slurm_job_id, lineage.slurm_restart_count) == ("111321", 0)
    assert lineage.resumed_from_step == 200
    assert lineage.launcher == "slurm"


def test_lineage_records_the_node_list_of_the_allocation_that_wrote_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "111882")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "host[1-2]")
    assert Lineage.current().slurm_nodelist == "host[1-2]"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert Lineage.current().slurm_nodelist is None  # a stale variable outside a job


def test_lineage_outside_slurm_has_no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    lineage = Lineage.current()
    assert lineage.slurm_job_id is None
    assert lineage.slurm_restart_count is None


def test_a_future_schema_version_is_refused_naming_the_file() -> None:
    with pytest.raises(UnsupportedSchemaError) as caught:
        parse_manifest(_document(schema_version=SCHEMA_VERSION + 1), source=SOURCE)
    assert caught.value.path == SOURCE
    assert caught.value.schema_version == SCHEMA_VERSION + 1
    assert SOURCE in str(caught.value)
    assert isinstance(caught.value, ManifestError)


def test_unknown_fields_of_the_same_schema_version_are_ignored() -> None:
    manifest = _full_manifest()
    document = json.loads(manifest.to_json())
    document["added_by_a_patch_release"] = {"x": 1}
    document["lineage"]["cluster"] = "extra"
    assert parse_manifest(json.dumps(document).encode(), source=SOURCE) == manifest


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'"manifest"', "expected a JSON object"),
        (b'{"step": 1}', "schema_version"),
        (b'{"schema_version": "1", "step": 1}', "schema_version"),
        (b'{"schema_version": true, "step": 1}', "schema_version"),
    ],
)
def test_unreadable_manifests_are_manifest_errors_naming_the_file(
    raw: bytes, match: str
) -> None:
    with pytest.raises(ManifestError, match=match) as caught:
        parse_manifest(raw, source=SOURCE)
    assert caught.value.path == SOURCE
    assert SOURCE in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"step": -1}, "step"),
        ({"step": "many"}, "step"),
        ({"world_size": 0}, "world_size"),
        ({"reason": "boredom"}, "reason"),
        ({"files": 5}, "files"),
        ({"files": [{"path": "a.bin", "size": -3, "checksum": "x"}]}, "files.0.size"),
        ({"files": [{"path": "a.bin", "size": 3}]}, "files.0.checksum"),
        ({"lineage": 7}, "lineage"),
    ],
)
def test_invalid_fields_are_manifest_errors_naming_the_key(
    changes: dict[str, object], key: str
) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(_document(**changes), source=SOURCE)
    assert caught.value.key == key
    assert key in str(caught.value)
    assert caught.value.path == SOURCE


@pytest.mark.parametrize(
    "unsafe",
    ["../x", "/etc/passwd", "a/../../x", "a/./b", "a//b", "", ".", "..", "C:/x", "c:x",
     "a\\..\\x", "model/.."],
)
def test_a_manifest_listing_a_path_outside_its_directory_is_unsafe(unsafe: str) -> None:
    files = [{"path": unsafe, "size": 1, "checksum": checksum_chunks([b"x"])}]
    with pytest.raises(UnsafeCheckpointError) as caught:
        parse_manifest(_document(files=files), source=SOURCE)
    assert caught.value.path == SOURCE
    assert caught.value.file == unsafe
    assert SOURCE in str(caught.value)


@pytest.mark.parametrize("unsafe", ["../elsewhere", "/abs", "attempt-1/../.."])
def test_a_manifest_whose_data_directory_escapes_is_unsafe(unsafe: str) -> None:
    with pytest.raises(UnsafeCheckpointError) as caught:
        parse_manifest(_document(data_dir=unsafe), source=SOURCE)
    assert caught.value.file == unsafe


@pytest.mark.parametrize("safe", ["a.bin", "model/__0_0.distcp", "a/b/c/d.pt", ".metadata",
                                  "..hidden", "dir.with.dots/x"])
def test_ordinary_relative_paths_are_safe(safe: str) -> None:
    assert safe_relative_path(safe) == safe


def test_data_paths_are_relative_to_the_step_directory() -> None:
    assert Manifest(step=1).data_path("model.bin") == "model.bin"
    assert Manifest(step=1, data_dir="attempt-ab12").data_path("m/x.bin") == "attempt-ab12/m/x.bin"


def test_checksums_are_xxh3_128_and_independent_of_chunking() -> None:
    data = bytes(range(256)) * 100
    whole = checksum_chunks([data])
    assert whole == f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128(data).hexdigest()}"
    assert checksum_chunks(data[i:i + 7] for i in range(0, len(data), 7)) == whole
    flipped = bytearray(data)
    flipped[1234] ^= 0x80
    assert checksum_chunks([bytes(flipped)]) != whole
