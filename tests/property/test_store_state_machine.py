"""Hypothesis drives the checkpoint store through random saves, crashes, resumes and prunes.

A model (step -> content version, plus the staging areas dead writers left behind) is
kept next to a real root, on a local directory and on ``memory://`` (the object-store
protocol), and after every rule the invariants hold: the committed steps are exactly the
model's, every one verifies and holds its bytes, ``latest_committed`` is the newest, no
work in progress is listed as committed. Steps only increase (a save of a step not newer
than the newest committed one is a StepCollisionError unless it explicitly replaces an
existing step) and a committed checkpoint disappears only through a prune whose policy
lets it go.

Budget: ``max_examples=60`` runs of up to ``stateful_step_count=25`` rules per root kind
(about 20 s for both on 2 busy cores).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from resumekit.errors import StepCollisionError
from resumekit.store.catalog import list_checkpoints, read_manifest, verify_checkpoint
from resumekit.store.commit import WRITER_FILE, CommitProtocol, PendingCheckpoint
from resumekit.store.manifest import MANIFEST_NAME, Lineage, Manifest
from resumekit.store.newest import latest_committed
from resumekit.store.retention import RetentionPolicy, keep_every, keep_last, prune
from resumekit.store.storage import Storage

BUDGET = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


DEAD_PID = _dead_pid()
# tmpfs when there is one: the model checks logic, not durability, and ext4 fsyncs (5 ms
# each here) would make the local machine 4x slower.
_FAST_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def content(step: int, version: int) -> dict[str, bytes]:
    """The files of ``step`` at ``version``: varied sizes, nested, one empty."""
    seed = f"{step}:{version}".encode()
    return {
        "model.bin": seed * (1 + version % 7),
        "optim/state/adam.bin": seed[::-1] * (3 + step % 5),
        "empty.bin": b"",
    }


# -- retention policies with an independent model ------------------------------------------
@dataclass(frozen=True)
class Policy:
    """A policy expression: ``("last", n)``, ``("every", k)``, ``("|"/"&", a, b)``."""

    tree: tuple[object, ...]

    def build(self) -> RetentionPolicy:
        kind = self.tree[0]
        if kind == "last":
            return keep_last(int(str(self.tree[1])))
        if kind == "every":
            return keep_every(int(str(self.tree[1])))
        left, right = (Policy(part).build() for part in self.tree[1:])  # type: ignore[arg-type]
        return left | right if kind == "|" else left & right

    def expect(self, steps: list[int]) -> set[int]:
        """What the policy should keep, computed without resumekit."""
        kind = self.tree[0]
        if kind == "last":
            return set(sorted(steps)[-int(str(self.tree[1])):])
        if kind == "every":
            return {s for s in steps if s % int(str(self.tree[1])) == 0}
        left, right = (Policy(part).expect(steps) for part in self.tree[1:])  # type: ignore[arg-type]
        return left | right if kind == "|" else left & right


_leaf = st.one_of(
    st.tuples(st.just("last"), st.integers(1, 4)),
    st.tuples(st.just("every"), st.integers(1, 6)),
)
policies = st.recursive(
    _leaf,
    lambda inner: st.tuples(st.sampled_from(["|", "&"]), inner, inner),
    max_leaves=4,
).map(Policy)


class _Crash(Exception):
    """The writer 'dies' here (raised from the on_phase hook)."""


class StoreMachine(RuleBasedStateMachine):
    """One checkpoint root and its model."""

    url_kind = "local"

    def __init__(self) -> None:
        super().__init__()
        if self.url_kind == "local":
            self.local = tempfile.mkdtemp(prefix="resumekit-prop-", dir=_FAST_DIR)
            self.url = self.local
        else:
            self.url = f"memory://resumekit-prop-{uuid.uuid4().hex}"
        self.storage = Storage(self.url)
        self.protocol = CommitProtocol(self.storage)
        self.model: dict[int, int] = {}
        self.abandoned: dict[str, int] = {}  # staging left by a dead writer -> its step
        # Those still holding their dead writer's record: the next begin sweeps them.
        self.dead_writers: set[str] = set()
        self.versions = 0
        self.history: list[int] = []

    def teardown(self) -> None:
        if self.url_kind == "local":
            shutil.rmtree(self.local, ignore_errors=True)
        else:
            self.storage.remove_tree("")

    # -- helpers ------------------------------------------------------------------------
    def _newest(self) -> int | None:
        return max(self.model, default=None)

    def _collides(self, step: int, replace: bool) -> bool:
        newest = self._newest()
        return newest is not None and step <= newest and not (replace and step in self.model)

    def _begun(self) -> None:
        """A begin succeeded: it swept every staging area whose writer is provably dead."""
        for name in self.dead_writers:
            self.abandoned.pop(name, None)
        self.dead_writers = set()

    def _write(self, pending: PendingCheckpoint, files: dict[str, bytes]) -> None:
        for path, data in files.items():
            self.storage.write_bytes(f"{pending.staging}/{path}", data)

    def storage_name(self, step: int) -> str:
        return self.protocol.name_format.build(step)

    def _step_of(self, choice: int | None) -> int:
        newest = self._newest()
        return (newest + 1 if newest is not None else 0) if choice is None else choice

    # -- rules --------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        assert latest_committed(self.storage) is None

    @rule(choice=st.one_of(st.none(), st.integers(0, 30)))
    def save(self, choice: int | None) -> None:
        step = self._step_of(choice)
        self.versions += 1
        if self._collides(step, replace=False):
            with pytest.raises(StepCollisionError):
                self.protocol.begin(step)
            return
        pending = self.protocol.begin(step)
        self._begun()
        self._write(pending, content(step, self.versions))
        manifest = self.protocol.publish(pending, Manifest(step=step, extras={"v": self.versions}))
        assert manifest.step == step
        assert not self.history or step > self.history[-1], "steps went backwards"
        self.history.append(step)
        self.model[step] = self.versions

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def replace(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.model)), label="existing step")
        self.versions += 1
        pending = self.protocol.begin(step, replace=True)
        self._begun()
        assert pending.replaces
        self._write(pending, content(step, self.versions))
        self.protocol.publish(pending, Manifest(step=step, extras={"v": self.versions}))
        self.model[step] = self.versions

    @precondition(lambda self: self.model)
    @rule(choice=st.integers(0, 30))
    def replace_a_missing_older_step(self, choice: int) -> None:
        newest = self._newest()
        assert newest is not None
        step = min(choice, newest)
        if step in self.model:
            return
        with pytest.raises(StepCollisionError):
            self.protocol.begin(step, replace=True)

    @rule(
        choice=st.one_of(st.none(), st.integers(0, 30)),
        replace=st.booleans(),
        phase=st.sampled_from(["write", "hash", "manifest", "publish", "cleanup"]),
        written=st.integers(0, 3),
    )
    def crash_mid_save(self, choice: int | None, replace: bool, phase: str,
                       written: int) -> None:
        step = self._step_of(choice)
        replace = replace and step in self.model
        self.versions += 1
        if self._collides(step, replace):
            with pytest.raises(StepCollisionError):
                self.protocol.begin(step, replace=replace)
            return
        previous = read_manifest(self.storage, self.storage_name(step)).data_dir \
            if replace else None
        pending = self.protocol.begin(step, replace=replace)
        self._begun()
        # The process that began this save is the one that dies: make its record say so.
        record = self.storage.read_bytes(f"{pending.staging}/{WRITER_FILE}")
        self.storage.write_bytes(f"{pending.staging}/{WRITER_FILE}", record.replace(
            f'"pid": {os.getpid()}'.encode(), f'"pid": {DEAD_PID}'.encode()))
        files = content(step, self.versions)
        if phase == "write":
            for path in list(files)[:written]:
                data = files[path]
                self.storage.write_bytes(f"{pending.staging}/{path}", data[: len(data) // 2])
            self._abandon(pending, with_writer_record=True)
            return

        def die(name: str) -> None:
            if name == phase:
                raise _Crash(name)

        dying = CommitProtocol(self.storage, on_phase=die)
        self._write(pending, files)
        dead = Lineage.current().model_copy(update={"pid": DEAD_PID})  # its manifest too
        with pytest.raises(_Crash):
            dying.publish(pending, Manifest(step=step, extras={"v": self.versions},
                                            lineage=dead))
        if phase == "cleanup":  # past the commit point: the new version is committed
            if not replace:
                assert not self.history or step > self.history[-1], "steps went backwards"
                self.history.append(step)
            self.model[step] = self.versions
            # On a rename-capable root the staging area now holds the replaced version,
            # without a writer record: its manifest names the writer of that version, this
            # (live) process, so it is not provably abandoned and stays until that writer
            # is gone (retention never sweeps a live writer's work on this host).
            if replace and not self.storage.atomic_rename:
                self.abandoned[f"{pending.name}/{previous}"] = step  # the replaced data
            return
        # The writer record goes once the manifest is written (phase "manifest"); on a
        # local root the manifest in the staging area then names the (dead) writer.
        self._abandon(pending, with_writer_record=phase in ("hash", "manifest") or (
            phase == "publish" and self.storage.atomic_rename))

    def _abandon(self, pending: PendingCheckpoint, *, with_writer_record: bool) -> None:
        self.abandoned[pending.staging] = pending.step
        if with_writer_record:
            self.dead_writers.add(pending.staging)

    @rule()
    def resume(self) -> None:
        self.storage = Storage(self.url)
        self.protocol = CommitProtocol(self.storage)
        latest = latest_committed(self.storage)
        assert (latest.step if latest else None) == self._newest()

    @rule(policy=policies, protect=st.one_of(st.none(), st.integers(0, 30)))
    def prune(self, policy: Policy, protect: int | None) -> None:
        steps = sorted(self.model)
        keep = policy.expect(steps) | set(steps[-1:]) | ({protect} if protect is not None
                                                         else set())
        report = prune(self.storage, policy.build(), protect=[] if protect is None
                       else [protect], sweep_after=0.0)
        assert report.deleted == [s for s in steps if s not in keep], policy
        assert report.kept == [s for s in steps if s in keep], policy
        for step in report.deleted:
            del self.model[step]
        # Every staging area and replaced data directory a dead writer left is swept,
        # except attempts inside a step directory the prune just deleted (gone with it).
        expected = {name for name, step in self.abandoned.items()
                    if self.storage.atomic_rename or step not in report.deleted}
        assert sorted(report.swept) == sorted(expected)
        self.abandoned = {}
        self.dead_writers = set()

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def committed_is_exactly_the_model_and_verifies(self) -> None:
        entries = list_checkpoints(self.storage)
        committed = {e.step: e for e in entries if e.status == "committed"}
        assert sorted(committed) == sorted(self.model)
        for step, entry in committed.items():
            assert not entry.name.startswith("."), f"{entry.name} listed as committed"
            manifest = verify_checkpoint(self.storage, entry.name)
            assert manifest.extras["v"] == self.model[step]
            on_disk = {
                f.path: self.storage.read_bytes(f"{entry.name}/{manifest.data_path(f.path)}")
                for f in manifest.files
            }
            assert on_disk == content(step, self.model[step])
        for entry in entries:
            if entry.status != "committed":
                assert entry.step not in committed or entry.name != committed[entry.step].name

    @invariant()
    def latest_is_the_newest_committed(self) -> None:
        latest = latest_committed(self.storage)
        assert (latest.step if latest else None) == self._newest()

    @invariant()
    def abandoned_work_is_never_committed(self) -> None:
        names = {e.name: e.status for e in list_checkpoints(self.storage)}
        for name in self.abandoned:
            top = name.split("/")[0]
            if top.startswith("."):
                assert names.get(top) in (None, "partial")
            assert not self.storage.exists(f"{name}/{MANIFEST_NAME}") or \
                self.storage.atomic_rename


StoreMachine.TestCase.settings = BUDGET
TestALocalRootSurvivesRandomSavesCrashesResumesAndPrunes = StoreMachine.TestCase


class MemoryStoreMachine(StoreMachine):
    """The same machine on ``memory://``: the object-store protocol (marker written last)."""

    url_kind = "memory"


MemoryStoreMachine.TestCase.settings = BUDGET
TestAnObjectStoreRootSurvivesRandomSavesCrashesResumesAndPrunes = (
    MemoryStoreMachine.TestCase
)
