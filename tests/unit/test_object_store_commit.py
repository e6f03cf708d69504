"""Object stores (``memory://``, ``s3://`` on a loopback moto server) as safe as POSIX.

A write error on any writer thread fails the save and commits nothing; the manifest lists
exactly what the ranks report writing, cross-checked with DCP's metadata and the store; the
commit marker is created conditionally, so the second of two writers of one step fails;
every checksum is computed on the way out; errors name the save, the step and the file.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import tensors
from resumekit.errors import IncompleteCheckpointError, StepCollisionError, StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.manifest import FileEntry, Manifest, checksum_chunks
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.storage_backends import S3Endpoint

FAILING_SHARD = "__0_1.distcp"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(params=["memory", "s3"])
def object_root(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(backend, root URL, storage options) of a fresh object-store root."""
    unique = f"objstore-{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        yield "memory", f"memory://{unique}", {}
        Storage(f"memory://{unique}").remove_tree("")
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    yield "s3", f"s3://{endpoint.bucket}/{unique}", dict(endpoint.storage_options)


def _fail_uploads_of(backend: str, monkeypatch: pytest.MonkeyPatch, name: str,
                     error: Callable[[str], BaseException]) -> list[str]:
    """Make every write of a file called ``name`` fail as the backend's client would."""
    failed: list[str] = []
    if backend == "s3":
        import s3fs  # noqa: PLC0415 - the S3 client under test

        original = s3fs.core.S3File._upload_chunk

        def upload(self: Any, final: bool = False) -> Any:
            if self.path.endswith(name):
                failed.append(self.path)
                raise error(self.path)
            return original(self, final)

        monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", upload)
        return failed
    from fsspec.implementations.local import LocalFileSystem  # noqa: PLC0415
    from fsspec.implementations.memory import MemoryFileSystem  # noqa: PLC0415

    filesystem = LocalFileSystem if backend == "local" else MemoryFileSystem
    original_open = filesystem._open

    def open_(self: Any, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        handle = original_open(self, path, mode, **kwargs)
        if "w" in mode and path.endswith(name):
            def write(*_: Any) -> int:
                failed.append(path)
                raise error(path)
            handle.write = write
        return handle

    monkeypatch.setattr(filesystem, "_open", open_)
    return failed


def _connection_lost(path: str) -> BaseException:
    from botocore.exceptions import EndpointConnectionError  # noqa: PLC0415

    return EndpointConnectionError(endpoint_url=f"https://s3.example/{path}")


@pytest.mark.filterwarnings("ignore::resumekit.warnings.ResumekitWarning")
def test_an_upload_failing_on_one_writer_thread_fails_the_save_and_commits_nothing(
    object_root: tuple[str, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, url, options = object_root
    model, optimizer = _model()
    manager = CheckpointManager(url, model=model, optimizer=optimizer, storage_options=options)
    manager.save(1)
    failed = _fail_uploads_of(backend, monkeypatch, FAILING_SHARD,
                              lambda path: OSError(5, "simulated upload failure", path))

    with pytest.raises(StorageError) as caught:
        manager.save(2)
    monkeypatch.undo()

    assert failed, "the injected failure never ran"
    message = str(caught.value)
    assert "step 2" in message and FAILING_SHARD in message and "simulated upload" in message
    assert caught.value.step == 2 and caught.value.errno == 5
    store = Storage(url, options)
    assert [(e.step, e.status) for e in list_checkpoints(store)] == [(1, "committed")]
    verify_checkpoint(store, "step_000000001")
    model, optimizer = _model()
    again = CheckpointManager(url, model=model, optimizer=optimizer, storage_options=options)
    assert again.restore() == 1


@pytest.mark.s3
@pytest.mark.filterwarnings("ignore::resumekit.warnings.ResumekitWarning")
def test_a_lost_connection_and_a_failing_cleanup_raise_the_write_error_naming_step_and_file(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"s3://{s3_endpoint.bucket}/lost-{uuid.uuid4().hex[:8]}"
    options = dict(s3_endpoint.storage_options)
    model, optimizer = _model()
    manager = CheckpointManager(url, model=model, optimizer=optimizer, storage_options=options)
    _fail_uploads_of("s3", monkeypatch, FAILING_SHARD, _connection_lost)

    def unreachable(self: Storage, relative: str) -> None:
        raise _connection_lost(self.path(relative))

    monkeypatch.setattr(Storage, "remove_tree", unreachable)  # the abort fails too
    with pytest.raises(StorageError) as caught:
        manager.save(7)
    monkeypatch.undo()

    message = str(caught.value)
    assert message.startswith(f"save of step 7 to {url} failed writing {FAILING_SHARD}")
    assert "EndpointConnectionError" in message
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "removing the staging area" in notes and "failed too" in notes
    assert latest_committed(Storage(url, options)) is None


@pytest.mark.filterwarnings("ignore::resumekit.warnings.ResumekitWarning")
def test_an_object_store_save_takes_every_checksum_from_the_writers_without_reading_back(
    object_root: tuple[str, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, url, options = object_root
    read_back: list[str] = []
    original = CommitProtocol._describe_file

    def recording(self: CommitProtocol, pending: Any, path: str) -> FileEntry:
        read_back.append(path)
        return original(self, pending, path)

    monkeypatch.setattr(CommitProtocol, "_describe_file", recording)
    model, optimizer = _model()
    manager = CheckpointManager(url, model=model, optimizer=optimizer, storage_options=options)
    manager.save(3)

    assert read_back == []
    store = Storage(url, options)
    manifest = verify_checkpoint(store, "step_000000003")  # re-hashes every stored byte
    paths = {entry.path for entry in manifest.files}
    assert {"tensors/.metadata", "train_state.pt", "tensors/__0_0.distcp"} <= paths
    for entry in manifest.files:
        data = store.read_bytes(f"step_000000003/{manifest.data_path(entry.path)}")
        assert (entry.size, entry.checksum) == (len(data), checksum_chunks([data]))


@pytest.mark.filterwarnings("ignore::resumekit.warnings.ResumekitWarning")
def test_a_listing_that_misses_a_written_shard_does_not_drop_it_from_the_manifest(
    object_root: tuple[str, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, url, options = object_root
    original = Storage.walk_files

    def stale(self: Storage, relative: str = "") -> list[tuple[str, int]]:
        return [(path, size) for path, size in original(self, relative)
                if not path.endswith(FAILING_SHARD)]

    monkeypatch.setattr(Storage, "walk_files", stale)
    model, optimizer = _model()
    manager = CheckpointManager(url, model=model, optimizer=optimizer, storage_options=options)
    with pytest.warns(ResumekitWarning, match=f"missed tensors/{FAILING_SHARD}"):
        manager.save(4)
    monkeypatch.undo()

    store = Storage(url, options)
    manifest = verify_checkpoint(store, "step_000000004")
    assert f"tensors/{FAILING_SHARD}" in {entry.path for entry in manifest.files}
    model, optimizer = _model()
    assert CheckpointManager(url, model=model, optimizer=optimizer,
                             storage_options=options).restore() == 4


def test_a_reported_file_missing_from_the_store_fails_the_commit_naming_step_and_file(
    tmp_path: Any,
) -> None:
    store = Storage(f"memory://objstore-{uuid.uuid4().hex[:10]}")
    protocol = CommitProtocol(store)
    pending = protocol.begin(5)
    store.write_bytes(f"{pending.staging}/tensors/.metadata", b"meta")
    reported = [FileEntry(path="tensors/.metadata", size=4, checksum=checksum_chunks([b"meta"])),
                FileEntry(path="tensors/__1_0.distcp", size=10, checksum=checksum_chunks([b"x"]))]

    with pytest.raises(IncompleteCheckpointError) as caught:
        protocol.publish(pending, Manifest(step=5), described=reported)

    assert caught.value.step == 5 and caught.value.file == "tensors/__1_0.distcp"
    assert "cannot commit step 5" in str(caught.value) and "not in the store" in str(caught.value)
    protocol.abort(pending)
    assert latest_committed(store) is None
    store.remove_tree("")


def test_a_file_the_metadata_references_that_no_rank_reported_fails_the_commit(
    tmp_path: Any,
) -> None:
    store = Storage(tmp_path)
    protocol = CommitProtocol(store)
    pending = protocol.begin(6)
    # On disk, but no rank reported writing it: the listing alone must not vouch for it.
    store.write_bytes(f"{pending.staging}/tensors/__1_0.distcp", b"partial")

    with pytest.raises(IncompleteCheckpointError) as caught:
        protocol.publish(pending, Manifest(step=6),
                         required=["tensors/__1_0.distcp", "tensors/.metadata"])

    assert caught.value.step == 6 and caught.value.file == "tensors/.metadata"
    assert "no rank reported writing it" in str(caught.value)
    protocol.abort(pending)
    assert latest_committed(store) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_writer_that_loses_an_item_without_an_error_writes_no_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resumekit.tensors.raw import CheckedDcpWriter  # noqa: PLC0415

    url = f"memory://objstore-{uuid.uuid4().hex[:10]}"
    original = CheckedDcpWriter.write_data

    def lossy(self: Any, plan: Any, planner: Any) -> Any:
        results = original(self, plan, planner).wait()
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(results[1:])  # one item silently dropped
        return done

    monkeypatch.setattr(CheckedDcpWriter, "write_data", lossy)
    with pytest.raises(StorageError, match="lost 1 item"):
        tensors.save({"a": torch.ones(3), "b": torch.zeros(2)}, url)
    assert not Storage(url).exists(".metadata")
    Storage(url).remove_tree("")


def _stage(store: Storage, step: int, payload: bytes) -> tuple[CommitProtocol, Any]:
    protocol = CommitProtocol(store)
    pending = protocol.begin(step)
    store.write_bytes(f"{pending.staging}/data.bin", payload)
    return protocol, pending


def _same_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both writers share one writer generation (one SLURM allocation), so the fence lets
    both through and only the conditional create of the commit marker tells them apart."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")


@pytest.mark.s3
def test_the_second_of_two_s3_writers_publishing_one_step_fails_and_the_first_stays(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _same_allocation(monkeypatch)
    url = f"s3://{s3_endpoint.bucket}/race-{uuid.uuid4().hex[:8]}"
    first_store, second_store = Storage(url, s3_endpoint.storage_options), Storage(
        url, s3_endpoint.storage_options)
    # Both begin before either commits: each sees step 8 as free.
    first, first_pending = _stage(first_store, 8, b"first writer")
    second, second_pending = _stage(second_store, 8, b"second writer")
    first.publish(first_pending, Manifest(step=8))

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # S3 needs no weaker mode
        with pytest.raises(StepCollisionError) as caught:
            second.publish(second_pending, Manifest(step=8))
    second.abort(second_pending)

    assert caught.value.path == first_store.path("step_000000008")
    assert "another writer committed" in str(caught.value)
    assert "step_000000008" in str(caught.value)
    manifest = verify_checkpoint(first_store, "step_000000008")
    assert manifest.data_dir == first_pending.data_dir
    assert first_store.read_bytes(
        f"step_000000008/{manifest.data_path('data.bin')}") == b"first writer"
    assert not first_store.exists(second_pending.staging)


def test_the_second_of_two_posix_writers_of_one_generation_gets_a_collision_not_a_rename_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _same_allocation(monkeypatch)
    first_store, second_store = Storage(tmp_path), Storage(tmp_path)
    # Both begin before either commits: each sees step 8 as free.
    first, first_pending = _stage(first_store, 8, b"first writer")
    second, second_pending = _stage(second_store, 8, b"second writer")
    first.publish(first_pending, Manifest(step=8))

    with pytest.raises(StepCollisionError) as caught:
        second.publish(second_pending, Manifest(step=8))
    second.abort(second_pending)

    assert caught.value.path == first_store.path("step_000000008")
    assert "another writer committed" in str(caught.value)
    assert "is not committed" in str(caught.value)
    manifest = verify_checkpoint(first_store, "step_000000008")
    assert first_store.read_bytes(
        f"step_000000008/{manifest.data_path('data.bin')}") == b"first writer"
    assert not first_store.exists(second_pending.staging)


@pytest.mark.s3
def test_an_s3_exclusive_write_is_refused_by_the_server_not_by_a_prior_check(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Storage(f"s3://{s3_endpoint.bucket}/cond-{uuid.uuid4().hex[:8]}",
                    s3_endpoint.storage_options)
    assert store.conditional_create
    store.write_bytes_exclusive("marker.json", b"one")
    monkeypatch.setattr(type(store.fs), "exists", lambda *_, **__: False)  # a blind client
    with pytest.raises(FileExistsError):
        store.write_bytes_exclusive("marker.json", b"two")
    monkeypatch.undo()
    assert store.read_bytes("marker.json") == b"one"


def test_a_store_without_conditional_writes_warns_once_naming_it_and_still_refuses_a_late_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _same_allocation(monkeypatch)
    url = f"memory://objstore-{uuid.uuid4().hex[:10]}"
    store = Storage(url)
    assert not store.conditional_create
    first, first_pending = _stage(store, 9, b"first")
    second, second_pending = _stage(store, 9, b"second")
    with pytest.warns(ResumekitWarning, match=f"{url} has no conditional create") as caught:
        first.publish(first_pending, Manifest(step=9))
        with pytest.raises(StepCollisionError, match="another writer committed"):
            second.publish(second_pending, Manifest(step=9))
        third, third_pending = _stage(store, 10, b"third")
        third.publish(third_pending, Manifest(step=10))
    assert len([w for w in caught if "conditional create" in str(w.message)]) == 1
    assert [e.step for e in list_checkpoints(store)] == [9, 10]
    assert store.read_bytes(
        f"step_000000009/{first_pending.data_dir}/data.bin") == b"first"
    store.remove_tree("")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcps_own_format_on_a_local_disk_also_fails_on_any_thread_and_reports_checksums(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(8)}
    written = tensors.save(state, tmp_path / "ok", tensor_format="dcp")
    for file in written:
        data = (tmp_path / "ok" / file.name).read_bytes()
        assert (file.size, file.checksum) == (len(data), checksum_chunks([data]))
    assert {file.name for file in written} == {p.name for p in (tmp_path / "ok").iterdir()}

    failed = _fail_uploads_of("local", monkeypatch, FAILING_SHARD,
                              lambda path: OSError(28, "No space left on device", path))
    with pytest.raises(StorageError, match=FAILING_SHARD) as caught:
        tensors.save(state, tmp_path / "bad", tensor_format="dcp")
    assert failed and caught.value.errno == 28
    assert not (tmp_path / "bad" / ".metadata").exists()


def _answer_409_to_conditional_puts(storage: Storage, monkeypatch: pytest.MonkeyPatch,
                                    times: int) -> list[str]:
    """The S3 client answers the next ``times`` ``PUT If-None-Match`` with S3's 409."""
    import botocore.exceptions  # noqa: PLC0415 - the S3 client's own error

    fs: Any = storage.fs
    fs.connect()
    client = fs.s3
    original = client.put_object
    conflicts: list[str] = []

    async def put_object(**kwargs: Any) -> Any:
        if kwargs.get("IfNoneMatch") == "*" and len(conflicts) < times:
            conflicts.append(kwargs["Key"])
            raise botocore.exceptions.ClientError(
                {"Error": {"Code": "ConditionalRequestConflict",
                           "Message": "A conflicting operation occurred. Please retry."},
                 "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject")
        return await original(**kwargs)

    monkeypatch.setattr(client, "put_object", put_object)
    monkeypatch.setattr("resumekit.store.retry.BACKOFF", __import__("tenacity").wait_none())
    return conflicts


def test_a_409_conflict_on_an_exclusive_create_is_sent_again_and_then_succeeds_or_exists(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    storage = Storage(f"s3://{s3_endpoint.bucket}/conflict-{uuid.uuid4().hex[:8]}",
                      storage_options=dict(s3_endpoint.storage_options))
    conflicts = _answer_409_to_conditional_puts(storage, monkeypatch, times=2)

    with caplog.at_level("WARNING", logger="resumekit"):
        storage.write_bytes_exclusive("marker.json", b"first")
    assert storage.read_bytes("marker.json") == b"first"
    assert len(conflicts) == 2 and conflicts[0].endswith("marker.json")
    assert "409 ConditionalRequestConflict" in caplog.text and "marker.json" in caplog.text

    conflicts.clear()  # the conflicting request won: the retry is told the key exists
    with pytest.raises(FileExistsError):
        storage.write_bytes_exclusive("marker.json", b"second")
    assert storage.read_bytes("marker.json") == b"first"


def test_an_exclusive_create_that_conflicts_every_time_fails_naming_the_key_and_the_409(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = Storage(f"s3://{s3_endpoint.bucket}/conflict-{uuid.uuid4().hex[:8]}",
                      storage_options=dict(s3_endpoint.storage_options))
    conflicts = _answer_409_to_conditional_puts(storage, monkeypatch, times=100)

    with pytest.raises(StorageError) as caught:
        storage.write_bytes_exclusive("manifest.json", b"{}")
    assert "manifest.json" in str(caught.value)
    assert "409 ConditionalRequestConflict" in str(caught.value)
    assert caught.value.attempts == 5 and len(conflicts) == 5
    assert not storage.exists("manifest.json")
