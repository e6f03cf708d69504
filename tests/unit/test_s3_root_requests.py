"""On S3, ``latest()`` asks the server for the same requests and names in a root of any size.

Counted on the loopback moto server as the S3 client sends them: the HTTP requests of one
``latest()`` and the names the server's listings return. ``Storage.is_dir`` of a prefix is
one request for one key (s3fs's ``isdir`` lists every page of the directory, which in a
checkpoint root grows with its checkpoints).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec.asyn

from benchmarks.root_cost import populate
from resumekit.manager import CheckpointManager
from resumekit.store.storage import Storage
from tests.storage_backends import S3Endpoint, save_checkpoint


@dataclass
class Traffic:
    """What one S3 client sent and was answered while a block ran."""

    requests: list[str] = field(default_factory=list)
    listed_names: int = 0


@contextmanager
def s3_traffic(storage: Storage) -> Iterator[Traffic]:
    """Record every request of the S3 client of ``storage`` and the names listed back."""
    events = fsspec.asyn.sync(storage.fs.loop, storage.fs.set_session).meta.events
    traffic = Traffic()

    def sent(request: Any, **_: Any) -> None:
        traffic.requests.append(f"{request.method} {request.url}")

    def listed(parsed: dict[str, Any], **_: Any) -> None:
        traffic.listed_names += len(parsed.get("Contents", [])) + len(
            parsed.get("CommonPrefixes", []))

    events.register("before-send.s3", sent)
    events.register("after-call.s3.ListObjectsV2", listed)
    try:
        yield traffic
    finally:
        events.unregister("before-send.s3", sent)
        events.unregister("after-call.s3.ListObjectsV2", listed)


def _root(endpoint: S3Endpoint) -> Storage:
    return Storage(f"s3://{endpoint.bucket}/rk-{uuid.uuid4().hex[:12]}",
                   endpoint.storage_options)


def test_latest_on_s3_sends_the_same_requests_and_lists_the_same_names_at_10_and_300_checkpoints(
        s3_endpoint: S3Endpoint) -> None:
    seen: dict[int, Traffic] = {}
    for count in (10, 300):
        storage = _root(s3_endpoint)
        populate(storage, [100 * (i + 1) for i in range(count - 1)])
        save_checkpoint(storage, 100 * count)  # a real commit: it writes the newest hint
        manager = CheckpointManager(storage.url, storage_options=storage.storage_options)
        try:
            with s3_traffic(manager.storage) as traffic:
                found = manager.latest()
        finally:
            manager.close()
        assert found is not None and found.step == 100 * count
        seen[count] = traffic
    small, large = seen[10], seen[300]
    assert len(large.requests) == len(small.requests), (small.requests, large.requests)
    # The generation records and the names after the hint: none of them a checkpoint
    # below the newest (the root's full listing held 10 and 300 of them).
    assert large.listed_names == small.listed_names < 10, (small, large)


def test_is_dir_on_s3_is_one_request_whatever_the_prefix_holds(
        s3_endpoint: S3Endpoint) -> None:
    storage = _root(s3_endpoint)
    storage.fs.pipe({storage.path(f"many/step_{i:04d}/manifest.json"): b"{}"
                     for i in range(1100)})  # more than one listing page (1000 keys)
    storage.write_bytes("file.json", b"{}")
    storage.write_bytes("nested/deeper/only.bin", b"x")
    answers = {}
    for relative in ("", "many", "nested", "nested/deeper", "file.json", "absent",
                     "many/step_0001/manifest.json"):
        with s3_traffic(storage) as traffic:
            answers[relative] = storage.is_dir(relative)
        assert len(traffic.requests) == 1, (relative, traffic.requests)
        assert traffic.listed_names <= 1, (relative, traffic)
    assert answers == {"": True, "many": True, "nested": True, "nested/deeper": True,
                       "file.json": False, "absent": False,
                       "many/step_0001/manifest.json": False}
    # The same answers as s3fs's own isdir (which lists the whole prefix).
    for relative, answer in answers.items():
        storage.fs.invalidate_cache()
        assert storage.fs.isdir(storage.path(relative)) is answer, relative


def test_is_dir_on_s3_of_a_bucket_root_says_whether_the_bucket_exists(
        s3_endpoint: S3Endpoint) -> None:
    options = s3_endpoint.storage_options
    assert Storage(f"s3://{s3_endpoint.bucket}", options).is_dir()
    missing = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", options)
    assert not missing.is_dir()
    assert not Storage(f"{missing.url}/some/root", options).is_dir()


def test_latest_of_an_absent_s3_root_is_none_and_creates_nothing(
        s3_endpoint: S3Endpoint) -> None:
    storage = _root(s3_endpoint)
    manager = CheckpointManager(storage.url, storage_options=storage.storage_options)
    try:
        assert manager.latest() is None
    finally:
        manager.close()
    assert not storage.is_dir()
