"""``latest()`` on a local root: the stamped newest-step hint instead of a listing.

The writer of the newest checkpoint stamps the hint with the root directory's stat and its
generation, after the commit and after the save's own prune; every resumekit operation
that changes the root's entries removes the hint first. ``latest()`` trusts it only while
the root's stat is still the stamp (no entry was made, removed or renamed since), the
filesystem counts subdirectories and the hint's generation is the root's newest. Anything
else costs a listing, never another answer: each test compares with the answer of the
full listing (``newest_committed(storage, listing=list_root(storage))``).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from resumekit.errors import ResumekitError
from resumekit.manager import CheckpointManager
from resumekit.store import commit, generations
from resumekit.store.catalog import CheckpointEntry, classify_step, list_root, step_directories
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import GENERATIONS_DIR, MANIFEST_NAME, NEWEST_HINT_FILE, NameFormat
from resumekit.store.manifest import Lineage, Manifest
from resumekit.store.newest import newest_committed
from resumekit.store.recovery import recover_interrupted, set_aside
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning

NAMES = NameFormat()


@contextmanager
def storage_methods_wrapped(names: tuple[str, ...],
                            wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]
                            ) -> Iterator[None]:
    """Replace each named ``Storage`` method by ``wrap(name, original)``; put them back."""
    originals = {name: getattr(Storage, name) for name in names}
    try:
        for name, method in originals.items():
            setattr(Storage, name, wrap(name, method))
        yield
    finally:
        for name, method in originals.items():
            setattr(Storage, name, method)


@contextmanager
def root_listings() -> Iterator[collections.Counter[str]]:
    """Count the listings of a checkpoint root itself (not of its subdirectories)."""
    counts: collections.Counter[str] = collections.Counter()

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Storage, relative: str = "", *args: Any, **kwargs: Any) -> Any:
            if not relative:
                counts[name] += 1
            return method(self, relative, *args, **kwargs)
        return counted

    with storage_methods_wrapped(("list_names", "list_dir"), wrap):
        yield counts


def listing_answer(storage: Storage) -> str | None:
    """The path of the newest restorable checkpoint as the full listing finds it.

    As ``latest()`` does, a checkpoint a fenced writer committed is passed over.
    """
    current = generations.newest_generation(storage) if storage.is_dir() else None

    def fenced(entry: CheckpointEntry) -> bool:
        return entry.manifest is not None and \
            generations.zombie_reason(entry.manifest, current) is not None

    found = newest_committed(storage, NAMES, listing=list_root(storage), skip=fenced)
    return None if found is None else found.path


def latest_path(manager: CheckpointManager) -> str | None:
    found = manager.latest()
    return None if found is None else found.path


def hint(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / NEWEST_HINT_FILE).read_text()))


def copy_as_step(root: Path, source: str, step: int) -> None:
    """Copy a checkpoint directory into the root by hand as committed step ``step``."""
    target = root / NAMES.build(step)
    shutil.copytree(root / source, target)
    manifest = json.loads((target / MANIFEST_NAME).read_text())
    manifest["step"] = step
    (target / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Path, CheckpointManager]]:
    """A local root where steps 10, 20, 30 were saved (keep_last(2): 10 was pruned)."""
    root = tmp_path / "root"
    manager = CheckpointManager(root, retention=keep_last(2))
    for step in (10, 20, 30):
        manager.save(step)
    yield root, manager
    manager.close()


def assert_fast(manager: CheckpointManager, expected_step: int) -> None:
    with root_listings() as listings:
        found = manager.latest()
    assert found is not None and found.step == expected_step
    assert sum(listings.values()) == 0, listings


def test_latest_on_a_local_root_with_a_stamped_hint_lists_nothing_and_returns_the_newest(
        saved: tuple[Path, CheckpointManager]) -> None:
    root, manager = saved
    document = hint(root)
    assert document["step"] == 30 and document["generation"] == 1
    assert document["root_stamp"] == list(manager.storage.root_stamp() or ())  # with the prune
    assert sorted(os.listdir(root)) == [".resumekit-generations", NAMES.build(20),
                                        NAMES.build(30)]
    assert_fast(manager, 30)
    assert latest_path(manager) == listing_answer(manager.storage)


def test_latest_lists_the_generation_records_once_for_the_zombie_and_the_hint_checks(
        saved: tuple[Path, CheckpointManager]) -> None:
    _, manager = saved
    listed: list[str] = []

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Storage, relative: str = "", *args: Any, **kwargs: Any) -> Any:
            if relative == GENERATIONS_DIR:
                listed.append(name)
            return method(self, relative, *args, **kwargs)
        return counted

    with storage_methods_wrapped(("list_names", "list_dir"), wrap):
        assert_fast(manager, 30)
    assert len(listed) == 1, listed


def _hand_copy(root: Path, manager: CheckpointManager,
               monkeypatch: pytest.MonkeyPatch) -> None:
    copy_as_step(root, NAMES.build(30), 40)


def _hand_delete(root: Path, manager: CheckpointManager,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.rmtree(root / NAMES.build(30))


def _hand_rename_in_another_tick(root: Path, manager: CheckpointManager,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A rename changes no link count: only the root's times tell (set a tick apart here).
    before = os.stat(root)
    os.rename(root / NAMES.build(30), root / "moved-away")
    os.utime(root, ns=(before.st_atime_ns, before.st_mtime_ns + 4_000_000))


def _newer_generation(root: Path, manager: CheckpointManager,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    generations.claim(manager.storage, newest_step=30,
                      identity=Lineage(hostname="elsewhere", pid=4242))


def _hint_without_stamp(root: Path, manager: CheckpointManager,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    document = hint(root)
    del document["root_stamp"]
    (root / NEWEST_HINT_FILE).write_text(json.dumps(document))


def _corrupt_hint(root: Path, manager: CheckpointManager,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    (root / NEWEST_HINT_FILE).write_bytes(b'{"step": 30, "root_st')


def _one_link(real: Callable[[Storage], tuple[int, int, int, int, int] | None]
              ) -> Callable[[Storage], tuple[int, int, int, int, int] | None]:
    """``Storage.root_stamp`` on a filesystem that reports one link for directories."""

    def one_link(self: Storage) -> tuple[int, int, int, int, int] | None:
        stamp = real(self)
        return None if stamp is None else (*stamp[:4], 1)
    return one_link


def _no_subdirectory_count(root: Path, manager: CheckpointManager,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    one_link = _one_link(Storage.root_stamp)
    monkeypatch.setattr(Storage, "root_stamp", one_link)
    document = hint(root)  # the stamp as such a filesystem would have it, exactly
    document["root_stamp"] = list(one_link(manager.storage) or ())
    (root / NEWEST_HINT_FILE).write_text(json.dumps(document))


def _root_replaced(root: Path, manager: CheckpointManager,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    moved = root.with_name("moved")
    os.rename(root, moved)
    shutil.copytree(moved, root)  # same names, same times (copystat): another inode
    shutil.copystat(moved, root)
    shutil.rmtree(moved)


@pytest.mark.parametrize("change", [
    _hand_copy, _hand_delete, _hand_rename_in_another_tick, _newer_generation,
    _hint_without_stamp, _corrupt_hint, _no_subdirectory_count, _root_replaced,
], ids=lambda change: change.__name__.strip("_"))
def test_latest_lists_the_root_and_gives_the_listings_answer_when_the_hint_is_in_doubt(
        saved: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch,
        change: Callable[[Path, CheckpointManager, pytest.MonkeyPatch], None]) -> None:
    root, manager = saved
    assert_fast(manager, 30)
    change(root, manager, monkeypatch)
    with root_listings() as listings, warnings.catch_warnings():
        warnings.simplefilter("error")  # the slow path is not worth a warning: same answer
        found = latest_path(manager)
    assert sum(listings.values()) >= 1, listings
    assert found == listing_answer(manager.storage)
    assert found is not None


@contextmanager
def root_changes_while_a_hint_exists(root: Path) -> Iterator[list[str]]:
    """Record each change of the root's entries made while the hint file exists."""
    seen: list[str] = []

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def watched(self: Storage, *relatives: str) -> Any:
            if Path(self.root) == root and any("/" not in path for path in relatives) \
                    and (root / NEWEST_HINT_FILE).exists():
                seen.append(f"{name}{relatives}")
            return method(self, *relatives)
        return watched

    with storage_methods_wrapped(
            ("rename_dir", "exchange_dirs", "remove_tree", "make_dir_exclusive"), wrap):
        yield seen


def test_no_resumekit_operation_changes_the_root_while_the_hint_is_there(
        saved: tuple[Path, CheckpointManager]) -> None:
    root, manager = saved
    with root_changes_while_a_hint_exists(root) as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.save(40)  # stages, commits, prunes 20
        manager.save(40, replace=True)  # swaps in
        assert hint(root)["step"] == 40
        prune(Storage(root), keep_last(1))  # as ``resumekit prune`` does
        manager.save(50)
        # a replacement cut between its two renames, put back by the next reader
        os.rename(root / NAMES.build(50), root / NAMES.retired_name(50, "cut"))
        assert (root / NEWEST_HINT_FILE).exists()
        recover_interrupted(Storage(root), NAMES)
        manager.save(60)
        (root / NAMES.build(60) / MANIFEST_NAME).write_bytes(b"{broken")
        restorer = CheckpointManager(root, retention=None)
        assert restorer.restore() == 50  # sets 60 aside
        restorer.close()
    assert seen == []
    aside = [name for name in os.listdir(root) if name.startswith(f".{NAMES.build(60)}.bad-")]
    assert sorted(os.listdir(root)) == sorted([".resumekit-generations", NAMES.build(50),
                                               *aside]) and len(aside) == 1


def test_a_root_without_a_subdirectory_count_gets_no_stamped_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Storage, "root_stamp", _one_link(Storage.root_stamp))
    manager = CheckpointManager(tmp_path / "root", retention=None)
    manager.save(10)
    assert not (tmp_path / "root" / NEWEST_HINT_FILE).exists()
    found = manager.latest()
    assert found is not None and found.step == 10


class _Killed(BaseException):
    """The process dies here (nothing after it runs; not an Exception: never handled)."""


def test_a_crash_after_the_commit_rename_before_the_hint_leaves_no_stale_stamped_hint(
        saved: tuple[Path, CheckpointManager]) -> None:
    root, manager = saved
    assert hint(root)["step"] == 30

    def kill(phase: str) -> None:
        if phase == "cleanup":  # after the rename and the fsync of the root
            raise _Killed

    protocol = CommitProtocol(Storage(root), on_phase=kill)
    pending = protocol.begin(40)
    with pytest.raises(_Killed):
        protocol.publish(pending, Manifest(step=40))
    assert (root / NAMES.build(40) / MANIFEST_NAME).exists()
    assert not (root / NEWEST_HINT_FILE).exists()
    found = manager.latest()
    assert found is not None and found.step == 40


def test_a_save_killed_before_it_writes_the_hint_leaves_latest_finding_its_checkpoint(
        saved: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch) -> None:
    root, manager = saved
    assert hint(root)["step"] == 30

    def killed(*args: Any, **kwargs: Any) -> bool:
        raise _Killed

    monkeypatch.setattr(commit, "write_stamped_hint", killed)
    with pytest.raises(_Killed):
        manager.save(40)
    assert not (root / NEWEST_HINT_FILE).exists()
    found = manager.latest()
    assert found is not None and found.step == 40


def test_a_hint_that_cannot_be_written_is_warned_about_and_the_save_succeeds(
        saved: tuple[Path, CheckpointManager], monkeypatch: pytest.MonkeyPatch) -> None:
    root, manager = saved
    real = Storage.write_bytes

    def disk_full(self: Storage, relative: str, data: bytes, **kwargs: Any) -> None:
        if relative == NEWEST_HINT_FILE:
            raise OSError(28, "No space left on device")
        real(self, relative, data, **kwargs)

    monkeypatch.setattr(Storage, "write_bytes", disk_full)
    with pytest.warns(ResumekitWarning, match="newest-step.json"):
        manager.save(40)
    assert not (root / NEWEST_HINT_FILE).exists()
    found = manager.latest()
    assert found is not None and found.step == 40


def test_a_step_directory_above_the_committed_step_leaves_no_stamped_hint(
        saved: tuple[Path, CheckpointManager]) -> None:
    root, manager = saved
    assert hint(root)["step"] == 30
    (root / NAMES.build(900)).mkdir()  # by hand: not a checkpoint, but above the next save
    manager.save(40)
    assert not (root / NEWEST_HINT_FILE).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = manager.latest()
    assert found is not None and found.step == 40
    assert found.path == listing_answer(manager.storage)


def test_restore_setting_a_broken_newest_aside_removes_the_hint_and_still_lists_the_root(
        saved: tuple[Path, CheckpointManager]) -> None:
    root, _ = saved
    assert hint(root)["step"] == 30
    (root / NAMES.build(30) / MANIFEST_NAME).write_bytes(b"{garbage")
    restorer = CheckpointManager(root, retention=None)
    with root_listings() as listings, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert restorer.restore() == 20
    assert sum(listings.values()) >= 1  # restore's survey sees everything
    assert not (root / NEWEST_HINT_FILE).exists()
    assert not (root / NAMES.build(30)).exists()
    assert latest_path(restorer) == listing_answer(restorer.storage)
    restorer.close()


# ------------------------------------------------------------------------ property test


class StampedHintMachine(RuleBasedStateMachine):
    """Saves, crashes before the hint, hand copies and deletions, set-asides, claims.

    After each, ``latest()`` answers what the full listing answers; after a plain save
    with nothing above it, it answers without listing the root.
    """

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="stamped-hint-")
        self.root = Path(self.directory) / "root"
        self.manager = CheckpointManager(self.root, retention=keep_last(3))
        self.storage = Storage(self.root)
        self.others = 0
        self.high = 0

    def teardown(self) -> None:
        self.manager.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _step_dirs(self) -> list[tuple[int, str]]:
        return step_directories(list_root(self.storage), NAMES) if self.root.exists() else []

    def _next_step(self) -> int:
        """Above every step directory and every step this run saved or tried to save."""
        found = self._step_dirs()
        self.high = max(self.high, found[0][0] if found else 0) + 10
        return self.high

    def _fresh_manager(self) -> None:
        self.manager.close()
        self.manager = CheckpointManager(self.root, retention=keep_last(3))

    @rule()
    def save(self) -> None:
        step = self._next_step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.manager.save(step)
        with root_listings() as listings:
            found = self.manager.latest()
        assert found is not None and found.step == step
        assert sum(listings.values()) == 0, listings

    @rule()
    def crash_before_the_hint(self) -> None:
        def killed(*args: Any, **kwargs: Any) -> bool:
            raise _Killed

        with pytest.MonkeyPatch.context() as patch, pytest.raises(_Killed), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patch.setattr(commit, "write_stamped_hint", killed)
            self.manager.save(self._next_step())
        self._fresh_manager()  # the process died

    @precondition(lambda self: self.root.exists())
    @rule(above=st.integers(1, 3), pick=st.integers(0, 10))
    def copy_by_hand(self, above: int, pick: int) -> None:
        # a broken newest stays where it is when a fresh start beside set-aside copies
        # is refused
        committed = [name for step, name in self._step_dirs()
                     if classify_step(self.storage, step, NAMES).status == "committed"]
        if committed:
            copy_as_step(self.root, committed[pick % len(committed)],
                         self._next_step() + above)

    @precondition(lambda self: self.root.exists())
    @rule(pick=st.integers(0, 10))
    def delete_by_hand(self, pick: int) -> None:
        found = self._step_dirs()
        if found:
            shutil.rmtree(self.root / found[pick % len(found)][1])

    @precondition(lambda self: self.root.exists())
    @rule(pick=st.integers(0, 10))
    def set_aside_as_restore_does(self, pick: int) -> None:
        found = self._step_dirs()
        if found:
            step, _ = found[pick % len(found)]
            entry: CheckpointEntry = classify_step(self.storage, step, NAMES)
            aside, why_not = set_aside(self.storage, NAMES, entry)
            assert aside is not None, why_not

    @precondition(lambda self: self.root.exists())
    @rule()
    def break_the_newest_and_restore(self) -> None:
        found = self._step_dirs()
        if found:
            (self.root / found[0][1] / MANIFEST_NAME).write_bytes(b"{broken")
        self._fresh_manager()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self.manager.restore()
            except ResumekitError as error:  # nothing left but what restores set aside
                assert str(error).startswith("refusing to start fresh at step 0"), error
                assert any(".bad-" in path.name for path in self.root.iterdir())

    @precondition(lambda self: self.root.exists())
    @rule()
    def another_run_claims_the_root(self) -> None:
        self.others += 1
        newest = newest_committed(self.storage, NAMES, listing=list_root(self.storage))
        generations.claim(self.storage, newest_step=None if newest is None else newest.step,
                          identity=Lineage(hostname="elsewhere", pid=self.others))
        self._fresh_manager()  # this run is fenced now; a new one claims at its first save

    @invariant()
    def latest_is_the_listings_answer(self) -> None:
        if not self.root.exists():
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert latest_path(self.manager) == listing_answer(self.storage)


StampedHintMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_latest_with_a_stamped_hint_always_gives_the_listings_answer = StampedHintMachine.TestCase
