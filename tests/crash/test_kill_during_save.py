"""SIGKILL a real checkpoint writer at hundreds of instants; nothing committed is ever lost.

A fork server (``tests/crash/writer.py``) forks workers that resume from the newest
checkpoint and save, replace and prune a sequence of multi-file checkpoints through the
commit protocol. The test kills them two ways, mixed:

* planned kills: a worker kills itself at the n-th instrumented point of a phase (every
  storage call, data chunk, protocol phase, the return of ``publish`` and ``prune``),
  the phase chosen uniformly so rare phases are hit as often as long ones;
* outside kills: the test sends SIGKILL a random delay after a worker reports entering a
  phase (chosen uniformly), so kills also land inside ``write``, ``fsync``, ``rename``
  and ``rmtree`` system calls; a smaller run on the real disk (ext4 here, where fsync
  takes milliseconds) aims them at the fsync, rename and delete phases.

After every kill the test checks the root against a model built from what the worker
reported before it died (which ``publish`` and ``prune`` calls returned): every step
known committed is still there unless a prune that was allowed to delete it had started,
nothing else appeared except the step being saved, every committed checkpoint verifies
and holds exactly the bytes written for its step and version, the newest is the one
``latest_committed`` names, and no visible step directory is anything but committed.

``RESUMEKIT_CRASH_SEED`` picks another seed (the failure message names the one used).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from resumekit.errors import ResumekitError
from resumekit.store.catalog import list_checkpoints, read_manifest, verify_checkpoint
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.manifest import MANIFEST_NAME
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from tests.crash.writer import CATEGORIES, POLICY, expected_files
from tests.limits import HANG_S

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("RESUMEKIT_CRASH_SEED", "20240611"))
MESSAGE_TIMEOUT = HANG_S  # a hang detector


@dataclass
class Model:
    """What must (``required``) and may (``optional``) be committed, step -> versions."""

    required: dict[int, set[int]] = field(default_factory=dict)
    optional: dict[int, set[int]] = field(default_factory=dict)
    resumed: int | None = None
    deletable: set[int] = field(default_factory=set)

    def newest(self) -> int:
        return max(self.required, default=0)


@dataclass
class Outcome:
    """How one worker ended."""

    killed: bool
    category: str | None
    counts: dict[str, list[int]] | None
    in_replace: bool


@dataclass(frozen=True)
class OutsideKill:
    """Send SIGKILL ``delay`` seconds after the worker reports entering ``category``
    in save cycle ``cycle`` or later: the phase picks where, the delay the instant."""

    cycle: int
    category: str
    delay: float


class WriterServer:
    """The fork server process and the lines it (and its workers) print."""

    def __init__(self, log: Path) -> None:
        self._stderr = log.open("wb")
        self._log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.crash.writer"],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next() == ["R"]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._lines.put(raw.decode().rstrip("\n"))
        self._lines.put(None)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        self.process.stdin.flush()

    def next(self) -> list[str]:
        try:
            line = self._lines.get(timeout=MESSAGE_TIMEOUT)
        except queue.Empty:
            pytest.fail(f"the writer said nothing for {MESSAGE_TIMEOUT} s; {self.stderr()}")
        if line is None:
            pytest.fail(f"the fork server died; {self.stderr()}")
        return line.split(" ")

    def stderr(self) -> str:
        self._stderr.flush()
        return "its stderr:\n" + self._log.read_text()[-4000:]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=MESSAGE_TIMEOUT)
        self._stderr.close()


class CrashRig:
    """Runs workers on one root, applies their reports to the model, checks the root."""

    def __init__(self, server: WriterServer, root: Path) -> None:
        self.server = server
        self.root = root
        self.storage = Storage(str(root))
        self.name_format = NameFormat()
        self.model = Model()
        self.lagging_reads = 0

    # -- one worker ---------------------------------------------------------------------
    def run(self, plan: dict[str, Any], outside: OutsideKill | None = None) -> Outcome:
        """Run one worker to its end, killing it from here when ``outside`` says so."""
        self.server.send(f"run {json.dumps({**plan, 'root': str(self.root)})}")
        kind, pid = self.server.next()
        assert kind == "W"
        category = None
        counts = None
        in_replace = False
        cycle = 0
        while True:
            message = self.server.next()
            kind = message[0]
            if kind == "Y":
                cycle = int(message[1])
            elif kind in ("P", "K"):
                category = message[1]
                if (kind == "P" and outside is not None and cycle >= outside.cycle
                        and category == outside.category):
                    time.sleep(outside.delay)  # the random kill instant itself, not a wait
                    with contextlib.suppress(ProcessLookupError):  # it finished first
                        os.kill(int(pid), signal.SIGKILL)
                    outside = None
            elif kind == "T":
                counts = json.loads(message[1])
            elif kind == "X":
                status = int(message[2])
                break
            else:
                in_replace = self._apply(message, in_replace)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            return Outcome(True, category, counts, in_replace)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
            f"worker {pid} failed (status {status}); {self.server.stderr()}"
        )
        return Outcome(False, None, counts, in_replace)

    def _apply(self, message: list[str], in_replace: bool) -> bool:
        model = self.model
        kind = message[0]
        if kind == "B":
            step, version, replace = int(message[1]), int(message[2]), message[3] == "1"
            if replace:
                assert step in model.required, f"replacing step {step}, never committed"
                model.required[step] = model.required[step] | {version}
                return True
            assert step > model.newest(), (
                f"a new worker saves step {step}, not newer than the newest committed "
                f"step {model.newest()}"
            )
            model.optional[step] = {version}
            return False
        if kind == "C":
            step, version = int(message[1]), int(message[2])
            model.optional.pop(step, None)
            model.required[step] = {version}
            return False
        if kind == "S":
            protect = int(message[1])
            steps = sorted(model.required)
            keep = POLICY.keep(steps) | {steps[-1], protect}
            model.deletable = {s for s in steps if s not in keep}
            for step in model.deletable:
                model.optional[step] = model.required.pop(step)
            return in_replace
        if kind == "D":
            deleted = set() if message[1] == "-" else {int(s) for s in message[1].split(",")}
            assert deleted == model.deletable, (
                f"prune deleted {sorted(deleted)}, the policy {POLICY} allowed exactly "
                f"{sorted(model.deletable)}"
            )
            for step in deleted:
                model.optional.pop(step)
            model.deletable = set()
            return in_replace
        raise AssertionError(f"unexpected message {message}")

    # -- the check after every worker ----------------------------------------------------
    def check(self, context: str) -> None:
        """Compare the root with the model, then make the model what the root holds."""
        model = self.model
        entries = list_checkpoints(self.storage, self.name_format)
        names = {info.name for info in self.storage.list_dir()}
        effective: dict[int, str] = {}
        for entry in entries:
            if entry.name.startswith("."):
                assert entry.status == "partial", f"{context}: {entry.name} is {entry.status}"
                continue
            assert entry.status == "committed", (
                f"{context}: visible {entry.name} is {entry.status}: {entry.problem}"
            )
            effective[entry.step] = entry.name
        restorable: dict[int, str] = {}
        for name in sorted(names):
            hidden = self.name_format.parse_hidden(name)
            if hidden is None or hidden[1].kind != "old" or hidden[1].name in names:
                continue
            try:
                read_manifest(self.storage, name)
            except ResumekitError:
                continue
            assert hidden[0] not in restorable, f"{context}: two restorable copies of {name}"
            restorable[hidden[0]] = name
        effective.update(restorable)

        allowed = {**model.optional, **model.required}
        versions: dict[int, int] = {}
        for step, name in sorted(effective.items()):
            manifest = verify_checkpoint(self.storage, name)
            version = manifest.extras["version"]
            assert isinstance(version, int)
            assert step in allowed, (
                f"{context}: step {step} is committed but was never saved (or was deleted)"
            )
            assert version in allowed[step], (
                f"{context}: step {step} holds version {version}, expected {allowed[step]}"
            )
            on_disk = {
                path: self.storage.read_bytes(f"{name}/{path}")
                for path, _ in self.storage.walk_files(name) if path != MANIFEST_NAME
            }
            assert on_disk == expected_files(step, version), (
                f"{context}: {name} does not hold what was written for step {step}"
            )
            versions[step] = version
        lost = sorted(set(model.required) - set(effective))
        assert not lost, f"{context}: committed steps {lost} were lost"

        newest = max(effective, default=None)
        latest = latest_committed(self.storage, self.name_format)
        if newest is not None and (latest is None or latest.step != newest):
            # Only the two-rename replacement leaves the newest under a hidden name,
            # and recover_interrupted (run by every writer first) renames it back.
            assert newest in restorable, (
                f"{context}: latest_committed is {latest and latest.step}, newest is {newest}"
            )
            self.lagging_reads += 1
        assert newest is None or newest >= model.newest()
        model.required = {step: {version} for step, version in versions.items()}
        model.optional = {}
        model.deletable = set()


def _typical(counts: list[dict[str, list[int]]], category: str) -> int:
    per_cycle = [n for run in counts for n in run.get(category, []) if n]
    per_cycle.sort()
    return max(1, per_cycle[len(per_cycle) // 2]) if per_cycle else 1


@pytest.fixture
def memory_backed_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A directory on tmpfs when there is one (``/dev/shm``), else ``tmp_path``.

    SIGKILL does not lose the page cache, so a kill test gains nothing from a disk but
    waits on its fsyncs (5 ms each on this machine's ext4, 5x the whole suite's time).
    The protocol makes the same system calls in the same order on either.
    """
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    directory = Path(tempfile.mkdtemp(prefix="resumekit-crash-", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One fork server for the module: it pays the store's import time once."""
    server = WriterServer(tmp_path_factory.mktemp("crash") / "writer.log")
    yield server
    server.close()


@pytest.fixture
def rig(server: WriterServer, memory_backed_dir: Path) -> CrashRig:
    return CrashRig(server, memory_backed_dir / "root")


def kill_many(rig: CrashRig, seed: int, planned_kills: int, outside_kills: int,
              categories: tuple[str, ...], max_delay: float) -> str:
    """Kill workers until both counts are reached, checking the root after each one.

    Planned kills pick a phase uniformly and an occurrence within its typical count per
    cycle (measured by a first, clean run). Outside kills pick a phase uniformly and a
    delay uniformly in ``[0, max_delay)`` after the worker enters it.

    Returns:
        A one-line summary: kill counts by phase.
    """
    rng = random.Random(seed)
    first = rig.run({"seed": rng.randrange(2**32), "cycles": 4, "exchange": True})
    rig.check(f"seed {seed}, first clean run")
    assert first.counts is not None
    counts = [first.counts]
    planned: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    replaces = 0
    attempts = 0
    while sum(planned.values()) < planned_kills or sum(outside.values()) < outside_kills:
        attempts += 1
        assert attempts < 3 * (planned_kills + outside_kills), "kills keep missing"
        plan: dict[str, Any] = {"seed": rng.randrange(2**32), "exchange": rng.random() < 0.5,
                                "cycles": 3}
        category = rng.choice(categories)
        cycle = 0 if category == "recover" else rng.randrange(2)
        from_outside = sum(outside.values()) < outside_kills and (
            sum(planned.values()) >= planned_kills or rng.random() < 0.4
        )
        if from_outside:
            result = rig.run(plan, OutsideKill(cycle, category, rng.uniform(0, max_delay)))
        else:
            plan["kill"] = {"cycle": cycle, "category": category,
                            "occurrence": rng.randrange(_typical(counts, category))}
            result = rig.run(plan)
        if result.counts is not None:
            counts.append(result.counts)
        rig.check(f"seed {seed}, worker {attempts} ({plan}), killed in {result.category}")
        if result.killed:
            assert result.category is not None
            (outside if from_outside else planned)[result.category] += 1
            replaces += result.in_replace

    rig.run({"seed": rng.randrange(2**32), "cycles": 2, "exchange": True})
    rig.check(f"seed {seed}, final clean run")
    leftovers = [info.name for info in rig.storage.list_dir()
                 if info.name.startswith(".") and info.name != GENERATIONS_DIR]
    assert not leftovers, f"seed {seed}: the sweep left {leftovers}"
    assert {c for c in planned if planned[c]} >= set(categories) or not planned_kills, (
        f"seed {seed}: no planned kill in some phase: {planned}"
    )
    total = planned + outside
    return (f"{sum(total.values())} kills ({sum(planned.values())} planned, "
            f"{sum(outside.values())} from outside, {replaces} during a replacement, "
            f"{rig.lagging_reads} left the newest hidden until recovery); "
            "by phase (planned/outside): " + ", ".join(
                f"{c} {planned[c]}/{outside[c]}" for c in CATEGORIES))


def test_a_writer_killed_at_any_instant_never_loses_a_committed_checkpoint(
    rig: CrashRig,
) -> None:
    summary = kill_many(rig, SEED, planned_kills=150, outside_kills=90,
                        categories=CATEGORIES, max_delay=0.004)
    print(f"\ntmpfs: {summary}")


def test_kills_inside_real_fsyncs_and_renames_on_disk_never_lose_a_checkpoint(
    server: WriterServer, tmp_path: Path,
) -> None:
    rig = CrashRig(server, tmp_path / "root")
    summary = kill_many(rig, SEED + 1, planned_kills=0, outside_kills=24,
                        categories=("fsync", "manifest", "publish", "cleanup", "prune"),
                        max_delay=0.012)
    print(f"\ndisk: {summary}")


def test_a_kill_after_the_second_rename_never_lets_the_retired_copy_come_back(
    rig: CrashRig,
) -> None:
    # Die just after rename 2 of the replacement of step 3 (and the root's fsync: the old
    # copy goes only once the new one is durable), before the retired copy loses its
    # manifest: the new version is committed and the old one is still whole beside it.
    kill = {"cycle": 2, "category": "cleanup", "operation": "remove_file", "occurrence": 0}
    result = rig.run({"seed": 3, "cycles": 3, "exchange": False, "kill": kill})
    assert result.killed and result.in_replace
    rig.check("killed after the second rename")
    hidden = [info.name for info in rig.storage.list_dir() if ".old-" in info.name]
    assert len(hidden) == 1 and rig.storage.exists(f"{hidden[0]}/{MANIFEST_NAME}")
    assert rig.model.required == {1: {0}, 2: {0}, 3: {1}}

    # The next writer deletes it before it saves; the one after prunes step 3 (the
    # first protects the step it resumed from), and nothing of step 3 may come back.
    rig.run({"seed": 4, "cycles": 3, "exchange": False})
    rig.check("after the next writer")
    assert not [info.name for info in rig.storage.list_dir() if ".old-" in info.name]
    rig.run({"seed": 5, "cycles": 3, "exchange": False})
    rig.check("after the writer that pruned step 3")
    assert 3 not in rig.model.required
    assert sorted(rig.model.required) == [5, 6, 8, 9]  # 6: protected as resumed


def test_a_kill_between_the_two_renames_of_a_replacement_keeps_the_old_version(
    rig: CrashRig,
) -> None:
    # Without RENAME_EXCHANGE a replacement retires the old directory, then renames the
    # new one in. Cycle 2 publishes step 3 (rename 0) and replaces it (rename 1 retires
    # the old directory, rename 2 brings the new one in): die just before rename 2.
    kill = {"cycle": 2, "category": "publish", "operation": "rename_dir", "occurrence": 2}
    result = rig.run({"seed": 1, "cycles": 3, "exchange": False, "kill": kill})
    assert result.killed and result.in_replace
    rig.check("killed between the renames")
    hidden = [info.name for info in rig.storage.list_dir() if ".old-" in info.name]
    assert len(hidden) == 1 and hidden[0].startswith(".step_000000003.old-")
    assert rig.lagging_reads == 1, "the newest checkpoint should be hidden until recovery"
    assert rig.model.required == {1: {0}, 2: {0}, 3: {0}}

    rig.run({"seed": 2, "cycles": 1, "exchange": False})
    rig.check("after the next writer recovered")
    assert rig.model.required == {3: {0}, 4: {0}}


def test_a_prune_killed_inside_the_deletion_of_a_retired_copy_leaves_it_to_the_next_start(
    rig: CrashRig,
) -> None:
    # Cycle 2's prune deletes step 1: it renames it to .step_000000001.old-<token>, removes
    # its manifest, then its files one by one; die after the first file went.
    kill = {"cycle": 2, "category": "prune", "operation": "unlink", "occurrence": 1}
    result = rig.run({"seed": 6, "cycles": 3, "exchange": False, "kill": kill})
    assert result.killed
    rig.check("killed inside the deletion of a retired copy")
    hidden = [info.name for info in rig.storage.list_dir() if ".old-" in info.name]
    assert len(hidden) == 1 and hidden[0].startswith(".step_000000001.old-")
    assert not rig.storage.exists(f"{hidden[0]}/{MANIFEST_NAME}")
    assert rig.storage.walk_files(hidden[0])  # half deleted

    # The next writer finishes the deletion before it saves: its prune's age rule would
    # wait an hour (sweep_after), so only the start can have removed it.
    rig.run({"seed": 7, "cycles": 1, "exchange": False, "sweep_after": 3600.0})
    rig.check("after the next writer started")
    assert not [info.name for info in rig.storage.list_dir() if ".old-" in info.name]
