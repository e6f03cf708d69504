"""One conformance suite for the store, run against every storage backend.

Each test takes the ``storage`` fixture, parametrised over a local path, ``file://``,
``memory://`` and ``s3://`` on a real loopback S3 endpoint (see tests/storage_backends.py):
the same save / list / latest / verify / prune / replace / collision / bad-input behaviour
must hold whether the commit point is a POSIX rename or the manifest written last.
"""

from __future__ import annotations

import json

import pytest

from resumekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    StepCollisionError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store.catalog import list_checkpoints, read_manifest, verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import GENERATIONS_DIR, LEGACY_NAME_FORMAT, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, SCHEMA_VERSION, Manifest
from resumekit.store.newest import latest_committed
from resumekit.store.retention import keep_last, keep_steps, prune
from resumekit.store.storage import Storage
from tests.storage_backends import (
    POSIX_BACKENDS,
    StorageFactory,
    data_file,
    default_files,
    save_checkpoint,
)

NAME_1 = "step_000000001"
NAME_2 = "step_000000002"


def _statuses(store: Storage) -> dict[str, str]:
    return {entry.name: entry.status for entry in list_checkpoints(store)}


def _committed_steps(store: Storage) -> list[int]:
    return [entry.step for entry in list_checkpoints(store) if entry.status == "committed"]


# -- the Storage layer itself -----------------------------------------------------------


def test_written_bytes_read_back_and_report_their_size(storage: Storage) -> None:
    storage.write_bytes("a/b/c.bin", b"0123456789")
    assert storage.read_bytes("a/b/c.bin") == b"0123456789"
    assert b"".join(storage.iter_chunks("a/b/c.bin", chunk_size=3)) == b"0123456789"
    assert storage.size("a/b/c.bin") == 10
    assert storage.is_file("a/b/c.bin")
    assert storage.is_dir("a/b")
    assert not storage.is_file("a/b")
    assert storage.exists("a/b/c.bin")
    assert not storage.exists("a/b/nothing.bin")


def test_an_exclusive_write_creates_once_and_refuses_a_second_without_touching_it(
    storage: Storage,
) -> None:
    storage.write_bytes_exclusive("step_1/manifest.json", b"first")
    with pytest.raises(FileExistsError):
        storage.write_bytes_exclusive("step_1/manifest.json", b"second")
    assert storage.read_bytes("step_1/manifest.json") == b"first"
    assert storage.conditional_create == (storage.is_local or storage.url.startswith("s3://"))


def test_listing_a_directory_gives_sorted_children_and_an_absent_one_is_empty(
    storage: Storage,
) -> None:
    storage.write_bytes("d/z.bin", b"z")
    storage.write_bytes("d/a.bin", b"aa")
    storage.write_bytes("d/m/inner.bin", b"i")
    listing = storage.list_dir("d")
    assert [(info.name, info.is_dir) for info in listing] == [
        ("a.bin", False), ("m", True), ("z.bin", False),
    ]
    assert listing[0].size == 2
    assert listing[1].size == 0
    assert storage.list_dir("absent") == []


def test_walking_files_gives_every_file_below_a_directory_with_its_size(
    storage: Storage,
) -> None:
    storage.write_bytes("w/top.bin", b"123")
    storage.write_bytes("w/x/y/deep.bin", b"12345")
    assert storage.walk_files("w") == [("top.bin", 3), ("x/y/deep.bin", 5)]
    assert storage.walk_files("nowhere") == []


def test_removing_a_tree_deletes_everything_below_it_and_an_absent_one_is_fine(
    storage: Storage,
) -> None:
    storage.write_bytes("t/1.bin", b"1")
    storage.write_bytes("t/sub/2.bin", b"2")
    storage.write_bytes("keep.bin", b"k")
    storage.remove_tree("t")
    storage.remove_tree("t")
    storage.remove_file("never-written.bin")
    assert not storage.exists("t/1.bin")
    assert not storage.exists("t/sub/2.bin")
    assert storage.read_bytes("keep.bin") == b"k"


def test_reading_a_missing_file_raises_file_not_found(storage: Storage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("missing.bin")


# -- save, list, latest, verify ---------------------------------------------------------


def test_a_saved_checkpoint_lists_as_committed_and_verifies(storage: Storage) -> None:
    written = save_checkpoint(storage, 1)
    assert _statuses(storage) == {NAME_1: "committed"}
    verified = verify_checkpoint(storage, NAME_1)
    assert verified == written
    assert sorted(entry.path for entry in verified.files) == ["model/shard_0.bin", "optim.bin"]
    for path, data in default_files(1).items():
        assert storage.read_bytes(data_file(storage, NAME_1, path)) == data
    assert read_manifest(storage, NAME_1).total_bytes == sum(map(len,
                                                                  default_files(1).values()))


def test_latest_committed_is_the_highest_step_by_number(storage: Storage) -> None:
    for step in (9, 10, 100):
        save_checkpoint(storage, step)
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 100
    assert [entry.step for entry in list_checkpoints(storage)] == [9, 10, 100]


def test_legacy_names_sort_numerically_not_lexicographically(storage: Storage) -> None:
    legacy = NameFormat(LEGACY_NAME_FORMAT)
    for step in (200, 900, 1000):
        save_checkpoint(storage, step, name_format=legacy)
    names = [entry.name for entry in list_checkpoints(storage, legacy)]
    assert names == ["checkpoint_step_200", "checkpoint_step_900", "checkpoint_step_1000"]
    latest = latest_committed(storage, legacy)
    assert latest is not None
    assert latest.name == "checkpoint_step_1000"


def test_an_empty_or_absent_root_has_no_checkpoints(storage: Storage) -> None:
    assert list_checkpoints(storage) == []
    assert latest_committed(storage) is None


def test_a_save_in_progress_is_partial_and_never_the_latest(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    protocol = CommitProtocol(storage)
    pending = protocol.begin(2)
    storage.write_bytes(f"{pending.staging}/model.bin", b"half written")
    statuses = [(e.step, e.status) for e in list_checkpoints(storage)]
    assert (2, "partial") in statuses
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 1
    protocol.publish(pending, Manifest(step=2))
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 2


def test_an_aborted_save_leaves_no_trace(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    protocol = CommitProtocol(storage)
    pending = protocol.begin(2)
    storage.write_bytes(f"{pending.staging}/model.bin", b"never published")
    protocol.abort(pending)
    assert _statuses(storage) == {NAME_1: "committed"}
    assert [info.name for info in storage.list_dir() if info.name != GENERATIONS_DIR] == [NAME_1]
    verify_checkpoint(storage, NAME_1)


def test_the_manifest_records_step_world_size_reason_and_extras(storage: Storage) -> None:
    save_checkpoint(storage, 3, manifest=Manifest(step=0, world_size=4, reason="preemption",
                                                   extras={"wandb": "run-7"}))
    manifest = read_manifest(storage, "step_000000003")
    assert manifest.step == 3
    assert manifest.world_size == 4
    assert manifest.reason.value == "preemption"
    assert manifest.extras == {"wandb": "run-7"}
    assert manifest.schema_version == SCHEMA_VERSION


# -- collision and replace --------------------------------------------------------------


@pytest.mark.parametrize("step", [2, 1])
def test_saving_a_step_that_is_not_newer_raises_a_collision_and_keeps_the_old(
    storage: Storage, step: int
) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    before = read_manifest(storage, NAME_2)
    with pytest.raises(StepCollisionError) as caught:
        CommitProtocol(storage).begin(step)
    assert caught.value.step == step
    assert caught.value.newest == 2
    assert f"step {step}" in str(caught.value)
    assert read_manifest(storage, NAME_2) == before
    verify_checkpoint(storage, NAME_1)
    verify_checkpoint(storage, NAME_2)
    assert _committed_steps(storage) == [1, 2]


def test_replace_true_on_an_older_step_that_does_not_exist_is_still_a_collision(
    storage: Storage,
) -> None:
    save_checkpoint(storage, 5)
    with pytest.raises(StepCollisionError):
        CommitProtocol(storage).begin(3, replace=True)
    assert _committed_steps(storage) == [5]


def test_replace_true_swaps_in_the_new_content(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 1, {"model.bin": b"replacement"}, replace=True)
    manifest = verify_checkpoint(storage, NAME_1)
    assert [entry.path for entry in manifest.files] == ["model.bin"]
    assert storage.read_bytes(data_file(storage, NAME_1, "model.bin")) == b"replacement"
    assert _statuses(storage) == {NAME_1: "committed"}
    # Nothing of the replaced checkpoint is left behind.
    assert [path for path, _ in storage.walk_files()
            if not path.startswith(GENERATIONS_DIR)] == sorted(
        [f"{NAME_1}/{MANIFEST_NAME}", data_file(storage, NAME_1, "model.bin")]
    )


def test_an_aborted_replacement_leaves_the_old_checkpoint_verifying(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    before = read_manifest(storage, NAME_1)
    protocol = CommitProtocol(storage)
    pending = protocol.begin(1, replace=True)
    assert pending.replaces
    storage.write_bytes(f"{pending.staging}/model.bin", b"replacement in progress")
    # Until publish the old checkpoint is the one that lists and verifies.
    assert verify_checkpoint(storage, NAME_1) == before
    protocol.abort(pending)
    assert verify_checkpoint(storage, NAME_1) == before
    assert _statuses(storage) == {NAME_1: "committed"}


# -- retention --------------------------------------------------------------------------


def test_prune_deletes_what_the_policy_drops_but_never_the_newest_or_protected(
    storage: Storage,
) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(storage, step)
    before = storage.walk_files()
    dry = prune(storage, keep_steps(2), protect=[1], dry_run=True)
    assert dry.dry_run
    assert (dry.deleted, dry.kept) == ([3], [1, 2, 4])
    assert storage.walk_files() == before
    report = prune(storage, keep_steps(2), protect=[1])
    assert (report.deleted, report.kept) == ([3], [1, 2, 4])
    assert _committed_steps(storage) == [1, 2, 4]
    assert [info.name for info in storage.list_dir() if info.name != GENERATIONS_DIR] == [
        "step_000000001", "step_000000002", "step_000000004",
    ]
    for name in ("step_000000001", "step_000000002", "step_000000004"):
        verify_checkpoint(storage, name)


def test_a_new_save_after_prune_continues_from_the_newest(storage: Storage) -> None:
    for step in (1, 2):
        save_checkpoint(storage, step)
    prune(storage, keep_last(1))
    save_checkpoint(storage, 3)
    assert _committed_steps(storage) == [2, 3]


# -- bad input --------------------------------------------------------------------------


def test_a_truncated_data_file_is_incomplete_naming_the_file(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    target = data_file(storage, NAME_2, "model/shard_0.bin")
    storage.write_bytes(target, storage.read_bytes(target)[:-5])
    with pytest.raises(IncompleteCheckpointError) as caught:
        verify_checkpoint(storage, NAME_2)
    assert caught.value.file == "model/shard_0.bin"
    assert caught.value.step == 2
    assert "shard_0.bin" in str(caught.value)
    verify_checkpoint(storage, NAME_1)


def test_a_missing_data_file_is_incomplete_naming_the_file(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    storage.remove_file(data_file(storage, NAME_1, "optim.bin"))
    with pytest.raises(IncompleteCheckpointError, match=r"optim\.bin.*missing") as caught:
        verify_checkpoint(storage, NAME_1)
    assert caught.value.file == "optim.bin"


def test_one_flipped_byte_is_corrupt_naming_the_file(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    target = data_file(storage, NAME_2, "optim.bin")
    data = bytearray(storage.read_bytes(target))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(target, bytes(data))
    with pytest.raises(CorruptCheckpointError) as caught:
        verify_checkpoint(storage, NAME_2)
    assert not isinstance(caught.value, ManifestError)
    assert caught.value.file == "optim.bin"
    assert "optim.bin" in str(caught.value)
    assert "step 2" in str(caught.value)
    verify_checkpoint(storage, NAME_1)


def test_a_missing_manifest_is_partial_and_read_manifest_names_it(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    storage.remove_file(f"{NAME_2}/{MANIFEST_NAME}")
    assert _statuses(storage) == {NAME_1: "committed", NAME_2: "partial"}
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 1
    with pytest.raises(ManifestError, match=MANIFEST_NAME) as caught:
        read_manifest(storage, NAME_2)
    assert caught.value.path.endswith(f"{NAME_2}/{MANIFEST_NAME}")
    verify_checkpoint(storage, NAME_1)


def test_a_garbled_manifest_is_corrupt_and_read_manifest_names_it(storage: Storage) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    storage.write_bytes(f"{NAME_2}/{MANIFEST_NAME}", b'{"schema_version": 1, "step": ')
    entries = {entry.name: entry for entry in list_checkpoints(storage)}
    assert entries[NAME_2].status == "corrupt"
    assert entries[NAME_2].problem is not None
    assert "not valid JSON" in entries[NAME_2].problem
    with pytest.raises(ManifestError, match="not valid JSON") as caught:
        read_manifest(storage, NAME_2)
    assert caught.value.path.endswith(f"{NAME_2}/{MANIFEST_NAME}")
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 1
    verify_checkpoint(storage, NAME_1)


def test_a_manifest_from_a_future_version_is_refused_naming_the_file(
    storage: Storage,
) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    document = json.loads(storage.read_bytes(f"{NAME_2}/{MANIFEST_NAME}"))
    document["schema_version"] = SCHEMA_VERSION + 1
    storage.write_bytes(f"{NAME_2}/{MANIFEST_NAME}", json.dumps(document).encode())
    assert _statuses(storage) == {NAME_1: "committed", NAME_2: "corrupt"}
    with pytest.raises(UnsupportedSchemaError) as caught:
        read_manifest(storage, NAME_2)
    assert caught.value.schema_version == SCHEMA_VERSION + 1
    assert caught.value.path.endswith(f"{NAME_2}/{MANIFEST_NAME}")
    assert caught.value.path in str(caught.value)
    verify_checkpoint(storage, NAME_1)


@pytest.mark.parametrize("unsafe", ["../x", "/etc/passwd"])
def test_a_manifest_listing_a_path_outside_its_directory_is_unsafe(
    storage: Storage, unsafe: str
) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    document = json.loads(storage.read_bytes(f"{NAME_2}/{MANIFEST_NAME}"))
    document["files"][0]["path"] = unsafe
    storage.write_bytes(f"{NAME_2}/{MANIFEST_NAME}", json.dumps(document).encode())
    with pytest.raises(UnsafeCheckpointError) as caught:
        read_manifest(storage, NAME_2)
    assert caught.value.file == unsafe
    assert caught.value.path.endswith(f"{NAME_2}/{MANIFEST_NAME}")
    with pytest.raises(UnsafeCheckpointError):
        verify_checkpoint(storage, NAME_2)
    # One hostile checkpoint does not hide the good ones.
    assert _statuses(storage) == {NAME_1: "committed", NAME_2: "corrupt"}
    verify_checkpoint(storage, NAME_1)


def test_a_manifest_whose_step_disagrees_with_its_directory_is_corrupt(
    storage: Storage,
) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    document = json.loads(storage.read_bytes(f"{NAME_2}/{MANIFEST_NAME}"))
    document["step"] = 7
    storage.write_bytes(f"{NAME_2}/{MANIFEST_NAME}", json.dumps(document).encode())
    entries = {entry.name: entry for entry in list_checkpoints(storage)}
    assert entries[NAME_2].status == "corrupt"
    assert "step 7" in str(entries[NAME_2].problem)


def test_reading_a_checkpoint_that_does_not_exist_raises_not_found_naming_it(
    storage: Storage,
) -> None:
    save_checkpoint(storage, 1)
    with pytest.raises(CheckpointNotFoundError, match="step_000000042"):
        read_manifest(storage, "step_000000042")
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(storage, "step_000000042")


def test_a_root_that_is_a_file_is_a_storage_error_naming_it(
    storage_factory: StorageFactory,
) -> None:
    parent = storage_factory()
    parent.write_bytes("root-is-a-file", b"not a directory")
    store = Storage(parent.url_of("root-is-a-file"), parent.storage_options)
    with pytest.raises(StorageError) as caught:
        list_checkpoints(store)
    assert caught.value.path == store.path()
    assert store.path() in str(caught.value)
    with pytest.raises(StorageError, match="root-is-a-file"):
        CommitProtocol(store).begin(1)
    with pytest.raises(StorageError, match="root-is-a-file"):
        prune(store, keep_last(1))
    assert parent.read_bytes("root-is-a-file") == b"not a directory"


def test_the_backends_publish_with_the_protocol_mode_they_support(
    storage: Storage, backend: str
) -> None:
    pending = CommitProtocol(storage).begin(1)
    if backend in POSIX_BACKENDS:
        assert storage.atomic_rename
        assert pending.staging.startswith(".step_000000001.tmp-")
        assert pending.data_dir == "."
    else:
        assert not storage.atomic_rename
        assert pending.staging == f"{NAME_1}/attempt-{pending.token}"
        assert pending.data_dir == f"attempt-{pending.token}"


def test_a_directory_in_place_of_the_manifest_is_corrupt_and_hides_nothing(
    storage: Storage,
) -> None:
    save_checkpoint(storage, 1)
    save_checkpoint(storage, 2)
    storage.remove_file(f"{NAME_2}/{MANIFEST_NAME}")
    storage.write_bytes(f"{NAME_2}/{MANIFEST_NAME}/inner.json", b"{}")
    assert _statuses(storage) == {NAME_1: "committed", NAME_2: "corrupt"}
    with pytest.raises(ManifestError, match=MANIFEST_NAME):
        read_manifest(storage, NAME_2)
    verify_checkpoint(storage, NAME_1)


def _second_client(store: Storage) -> Storage:
    """The same root through a separate filesystem object (its own listing cache)."""
    return Storage(store.url, {**store.storage_options, "skip_instance_cache": True})


def test_changes_by_another_client_are_seen_at_once(storage: Storage) -> None:
    other = _second_client(storage)
    storage.write_bytes("d/a.bin", b"a")
    storage.write_bytes("d/gone.bin", b"g")
    assert [info.name for info in storage.list_dir("d")] == ["a.bin", "gone.bin"]
    assert storage.size("d/a.bin") == 1
    assert storage.exists("d/gone.bin")
    other.write_bytes("d/new.bin", b"nn")
    other.write_bytes("d/a.bin", b"aaaa")
    other.remove_file("d/gone.bin")
    assert storage.exists("d/new.bin")
    assert storage.is_file("d/new.bin")
    assert storage.size("d/new.bin") == 2
    assert storage.size("d/a.bin") == 4
    assert storage.read_bytes("d/a.bin") == b"aaaa"
    assert not storage.exists("d/gone.bin")
    assert storage.walk_files("d") == [("a.bin", 4), ("new.bin", 2)]


def test_checkpoints_saved_and_pruned_by_another_client_are_seen_at_once(
    storage: Storage,
) -> None:
    other = _second_client(storage)
    save_checkpoint(storage, 1)
    assert _committed_steps(storage) == [1]
    verify_checkpoint(storage, NAME_1)
    save_checkpoint(other, 2)
    latest = latest_committed(storage)
    assert latest is not None
    assert latest.step == 2
    verify_checkpoint(storage, NAME_2)
    prune(other, keep_last(1))
    assert _committed_steps(storage) == [2]
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(storage, NAME_1)
    with pytest.raises(StepCollisionError):
        CommitProtocol(storage).begin(2)


def test_a_root_whose_fsspec_backend_is_missing_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fsspec

    from resumekit.errors import ConfigurationError

    def missing(url: str, **options: object) -> None:  # as fsspec's registry raises it
        raise ImportError("Install s3fs to access S3") from ModuleNotFoundError(
            "No module named 's3fs'", name="s3fs")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(ConfigurationError, match=r"pip install 'resumekit\[s3\]'") as caught:
        Storage("s3://bucket/run")
    assert "s3://bucket/run" in str(caught.value)
    with pytest.raises(ConfigurationError, match="install the fsspec backend for gcs://"):
        Storage("gcs://bucket/run")
