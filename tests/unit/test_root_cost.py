"""What a save, ``latest()``, a restore and retention cost does not grow with the root.

Counts, not timings: the storage operations (:func:`benchmarks.root_cost.count_storage_calls`)
of a steady-state save, of ``latest()`` and of a restore in a root of 10 checkpoints and in
one of 300 (written directly with the manifest API, not saved 300 times) differ by at most
a small constant, on a local disk, ``memory://`` and the loopback S3 server. And reading
from the top down changes no decision: what is newest, what begin refuses, what retention
keeps.
"""

from __future__ import annotations

import collections
import json
import socket
import warnings

import pytest

from benchmarks.root_cost import checkpoint_steps, count_storage_calls, measure, populate
from resumekit.errors import StepCollisionError
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import ATTEMPT_PREFIX, NEWEST_HINT_FILE, NameFormat
from resumekit.store.manifest import MANIFEST_NAME
from resumekit.store.newest import (
    _sorts_by_name,
    latest_committed,
    newest_committed,
    read_newest_hint,
    read_top,
    write_newest_hint,
)
from resumekit.store.retention import RollingSweep, keep_all, keep_last, prune
from resumekit.store.storage import Storage
from resumekit.store.targets import open_target, select_committed
from tests.storage_backends import StorageFactory, save_checkpoint

#: More operations than this between 10 and 300 checkpoints is growth, not noise.
SLACK = 2
NAMES = NameFormat()


def _reads(calls: collections.Counter[str]) -> int:
    return calls["read_bytes"] + calls["read_small"]


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_requests_per_save_latest_and_restore_do_not_grow_with_the_checkpoints_in_the_root(
        storage_factory: StorageFactory) -> None:
    figures = {}
    for count in (10, 300):
        root = storage_factory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # memory://'s weak commit marker, said once
            figures[count] = measure(root.url, count, storage_options=root.storage_options
                                     or None, latest_repeats=1)
    small, large = figures[10], figures[300]
    for key in ("storage_ops_per_save", "storage_ops_per_latest", "storage_ops_per_restore"):
        assert large[key] <= small[key] + SLACK, (key, small, large)
    if small["http_requests_per_save"] is not None:
        assert large["http_requests_per_save"] <= small["http_requests_per_save"] + SLACK, \
            (small, large)


def test_the_newest_committed_checkpoint_is_found_reading_only_the_manifests_above_it(
        storage: Storage) -> None:
    populate(storage, [100 * (i + 1) for i in range(50)])
    # Above the newest: a directory whose manifest is garbage, one that never committed.
    storage.write_bytes(f"{NAMES.build(5200)}/{MANIFEST_NAME}", b"{not json")
    storage.write_bytes(f"{NAMES.build(5300)}/{ATTEMPT_PREFIX}abc/data.bin", b"x")
    with count_storage_calls() as calls:
        found = newest_committed(storage)
    assert found is not None and found.step == 5000
    # One read per directory from the top down (5300, 5200, 5000), plus the newest-step
    # hint on S3 and on local roots (there is none: the root was populated by hand); one
    # listing of the root and the look into the directory that never committed.
    hinted = storage.range_listing or storage.atomic_rename
    assert _reads(calls) + calls["exists"] <= 3 + hinted, calls
    assert calls["list_dir"] + calls["list_names"] <= 3, calls
    top = read_top(storage)
    assert [entry.step for entry in top.above] == [5300, 5200]
    assert [entry.status for entry in top.above] == ["partial", "corrupt"]
    assert latest_committed(storage) == found
    assert newest_committed(storage, below=5000) is not None
    assert newest_committed(storage, below=5000).step == 4900  # type: ignore[union-attr]


def test_begin_refuses_a_step_below_the_newest_even_when_newer_directories_are_not_committed(
        storage: Storage) -> None:
    populate(storage, [100, 200, 300])
    storage.write_bytes(f"{NAMES.build(400)}/{MANIFEST_NAME}", b"{not json")
    protocol = CommitProtocol(storage)
    with pytest.raises(StepCollisionError, match="newest committed checkpoint is step 300"):
        protocol.begin(250)
    with pytest.raises(StepCollisionError, match=r"replace=True"):
        protocol.begin(200)  # below the newest: its own manifest is read, it is committed
    pending = protocol.begin(200, replace=True)
    protocol.abort(pending)


def test_retention_reads_no_manifest_below_the_newest_when_it_deletes_nothing(
        storage: Storage) -> None:
    populate(storage, [10 * (i + 1) for i in range(200)])
    with count_storage_calls() as calls:
        report = prune(storage, keep_all(), scope="top")
    assert report.deleted == [] and len(report.kept) == 200
    assert _reads(calls) <= 1, calls


def test_retention_keeps_what_the_policy_keeps_when_an_unfinished_save_sits_among_the_newest(
        storage_factory: StorageFactory) -> None:
    storage = storage_factory()
    for step in (100, 200, 300):
        save_checkpoint(storage, step)
    # A save of step 250 that never committed (object store: data, no manifest; POSIX: a
    # visible directory without a manifest). Judged by name, keep_last(3) would keep
    # 200, 250, 300 and delete 100, a checkpoint the policy keeps.
    storage.write_bytes(f"{NAMES.build(250)}/{ATTEMPT_PREFIX}dead/data.bin", b"x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = prune(storage, keep_last(3), errors="report", scope="top")
    assert report.deleted == [] and report.kept == [100, 200, 300]
    assert storage.exists(f"{NAMES.build(100)}/{MANIFEST_NAME}")
    report = prune(storage, keep_last(2), errors="report", scope="top")
    assert report.deleted == [100] and report.kept == [200, 300]


def test_the_populated_roots_are_what_a_long_run_keeps() -> None:
    steps = checkpoint_steps(1000)
    assert len(steps) == 1000 and steps == sorted(steps)
    assert steps[-4] % 100 == 0 and steps[-3:] == [steps[-4] + 10, steps[-4] + 20,
                                                     steps[-4] + 30]


# ------------------------------------------------------------ the newest-step hint (S3)


def _s3(storage_factory: StorageFactory) -> Storage:
    storage = storage_factory()
    if not storage.range_listing:
        pytest.skip("the newest-step hint is written on S3 roots only")
    return storage


@pytest.mark.parametrize("backend", ["s3"])
def test_a_commit_on_s3_writes_the_newest_step_hint_and_latest_lists_only_names_after_it(
        storage_factory: StorageFactory) -> None:
    storage = _s3(storage_factory)
    populate(storage, [100 * (i + 1) for i in range(30)])
    save_checkpoint(storage, 3100)
    assert read_newest_hint(storage) == 3100
    listed: list[list[tuple[str, bool]]] = []
    original = Storage.list_names

    def spy(self: Storage, relative: str = "", *, after: str | None = None
            ) -> list[tuple[str, bool]]:
        result = original(self, relative, after=after)
        listed.append(result)
        return result

    Storage.list_names = spy  # type: ignore[method-assign]
    try:
        found = latest_committed(storage)
    finally:
        Storage.list_names = original  # type: ignore[method-assign]
    assert found is not None and found.step == 3100
    assert [len(names) for names in listed] == [0]  # nothing after step 3100's name


@pytest.mark.parametrize("backend", ["s3"])
def test_a_lagging_hint_only_lists_more_and_a_wrong_one_falls_back_to_the_full_listing(
        storage_factory: StorageFactory) -> None:
    storage = _s3(storage_factory)
    for step in (100, 200):
        save_checkpoint(storage, step)
    assert read_newest_hint(storage) == 200
    # A crash after the commit point of step 300, before its hint: the hint lags.
    populate(storage, [300])
    assert read_newest_hint(storage) == 200
    assert latest_committed(storage).step == 300  # type: ignore[union-attr]
    # A hint naming a step that is not committed (deleted by hand): the full listing.
    write_newest_hint(storage, NAMES, 900)
    assert latest_committed(storage).step == 300  # type: ignore[union-attr]
    # A hint naming a committed step below one that is not committed above it.
    storage.write_bytes(f"{NAMES.build(400)}/{ATTEMPT_PREFIX}dead/data.bin", b"x")
    write_newest_hint(storage, NAMES, 300)
    assert latest_committed(storage).step == 300  # type: ignore[union-attr]
    # Garbage, or another name format's hint: ignored.
    storage.write_bytes(NEWEST_HINT_FILE, b"{not json")
    assert read_newest_hint(storage) is None
    assert latest_committed(storage).step == 300  # type: ignore[union-attr]
    write_newest_hint(storage, NameFormat("ckpt-{step:06d}"), 100)
    assert read_newest_hint(storage) is None


def test_names_sort_by_step_only_for_a_zero_padded_format_below_its_last_leading_zero(
        ) -> None:
    assert _sorts_by_name(NAMES, 10**7)
    assert not _sorts_by_name(NAMES, 10**8)  # step_100000000 has no leading zero left
    assert not _sorts_by_name(NameFormat("checkpoint_step_{step}"), 5)
    assert _sorts_by_name(NameFormat("ckpt-{step:06d}-x"), 99_999)


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_retention_after_saves_reaches_staging_abandoned_under_an_old_checkpoint_in_turn(
        storage_factory: StorageFactory) -> None:
    storage = storage_factory()
    populate(storage, [10 * (i + 1) for i in range(20)])
    # A crashed replace of step 50, long ago, by a process of this host that is gone.
    dead = f"{NAMES.build(50)}/{ATTEMPT_PREFIX}deadbeef0000"
    storage.write_bytes(f"{dead}/.writer.json", json.dumps(
        {"host": socket.gethostname(), "pid": 2**22 + 12345, "token": "deadbeef0000",
         "started": 0.0}).encode())
    storage.write_bytes(f"{dead}/tensors/.metadata", b"half written")
    rolling = RollingSweep(per_prune=2)
    swept_at = None
    for prune_number in range(1, 13):
        with count_storage_calls() as calls:
            report = prune(storage, keep_all(), scope="top", rolling=rolling,
                           sweep_after=0.0, errors="report")
        assert _reads(calls) <= 1 + rolling.per_prune + 1, calls  # constant
        if report.swept:
            assert report.swept == [dead]
            swept_at = prune_number
            break
    assert swept_at is not None and swept_at <= 20 // rolling.per_prune + 1
    assert not storage.exists(dead)
    assert read_top(storage).newest.step == 200  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["local", "file"])
def test_retention_on_a_posix_root_reads_no_older_step_directory_for_staging(
        storage_factory: StorageFactory) -> None:
    storage = storage_factory()
    populate(storage, [10 * (i + 1) for i in range(20)])
    rolling = RollingSweep(per_prune=2)
    for _ in range(3):  # staging on POSIX is a hidden entry of the root: the listing has it
        with count_storage_calls() as calls:
            report = prune(storage, keep_all(), scope="top", rolling=rolling,
                           sweep_after=0.0, errors="report")
        assert report.deleted == [] and _reads(calls) <= 1, calls
    assert rolling.below is None  # never moved down


def test_opening_one_checkpoint_and_choosing_the_newest_do_not_read_the_whole_root(
        storage_factory: StorageFactory) -> None:
    # What `resumekit inspect ROOT/step_X`, `verify ROOT` and `export ROOT` do first.
    counted = {}
    for count in (10, 300):
        storage = storage_factory()
        populate(storage, [10 * (i + 1) for i in range(count)])
        one = storage.url_of(NAMES.build(50))
        with count_storage_calls() as calls:
            newest = select_committed(open_target(storage.url_of(),
                                                  storage_options=storage.storage_options))
            single = open_target(one, storage_options=storage.storage_options)
        assert newest.step == 10 * count and single.entry is not None
        assert single.entry.status == "committed" and single.entry.step == 50
        counted[count] = sum(calls.values())
    assert counted[300] <= counted[10] + SLACK, counted
