"""A checkpoint writer for the crash tests to SIGKILL at chosen or random instants.

``python -m tests.crash.writer`` starts a small fork server. It imports the store
once (``resumekit.store.commit`` pulls in ``torch.distributed``, which takes seconds), then for
every line ``run <json plan>`` on its stdin forks a *worker* that saves a sequence of
checkpoints under ``plan["root"]`` through :class:`~resumekit.store.commit.CommitProtocol`,
replaces some of them and prunes old ones, exactly as a trainer would. A worker is a
real process that the test kills with SIGKILL, either

* itself, at a planned instrumented point (``"kill": {"cycle", "category", "occurrence"}``):
  every storage call, every chunk of every data file, every protocol phase and the return
  of ``publish``/``prune`` is a numbered point; or
* from the outside, at a random instant (the test's choice), which lands inside system
  calls (``write``, ``fsync``, ``rename``, ``rmtree``) as well.

Every message is one line written with one ``os.write`` to stdout (atomic on a pipe, never
buffered), so whatever a worker reported before it died reaches the test intact:

``Y <cycle>``                    a save cycle starts (cycle 0 starts with recovery)
``P <category> <step>``          the worker entered a phase
``B <step> <version> <replace>`` ``begin`` is about to be called
``C <step> <version>``           ``publish`` returned: the step is committed
``S <protect>``                  ``prune`` is about to be called, protecting ``protect``
``D <step,step,...>``            ``prune`` returned, having deleted these steps
``K <category> <occurrence>``    the worker kills itself now
``T <json>``                     the worker finished: its points per category and cycle
``X <pid> <status>``             (server) a worker ended with this wait status
``W <pid>``                      (server) a worker was forked

Content is a pure function of (step, version, path), so the test knows what every
committed checkpoint must hold.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from resumekit.errors import StorageError
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest
from resumekit.store.newest import latest_committed
from resumekit.store.recovery import recover_interrupted
from resumekit.store.retention import RetentionPolicy, keep_every, keep_last, prune
from resumekit.store.storage import Storage

#: What every worker keeps; the test predicts deletions from the same policy.
POLICY: RetentionPolicy = keep_last(2) | keep_every(5)
#: A step is replaced (version 1) right after it is first published when divisible by 3.
REPLACE_EVERY = 3
#: Where a kill can be planned; the test reports its distribution over these.
CATEGORIES = ("recover", "stage", "write", "hash", "fsync", "manifest", "publish",
              "cleanup", "prune")

_FILES = (
    # (path, smallest size, largest size)
    ("model/weights.bin", 48_000, 400_000),
    ("model/layers/block_0.bin", 1_000, 90_000),
    ("optim/adam/exp_avg.bin", 20_000, 200_000),
    ("rng/rank_0.bin", 1, 5_000),
    ("data_position.json", 0, 0),
    ("empty.bin", 0, 0),
)


def expected_files(step: int, version: int) -> dict[str, bytes]:
    """Return the exact files a worker writes for ``step`` at ``version``."""
    files = {}
    for path, low, high in _FILES:
        rng = random.Random(f"{step}/{version}/{path}")
        if path.endswith(".json"):
            files[path] = json.dumps({"step": step, "version": version, "sample": step * 7})\
                .encode()
        else:
            files[path] = rng.randbytes(rng.randint(low, high))
    return files


def emit(*parts: object) -> None:
    """Write one message line to stdout in a single system call."""
    os.write(1, (" ".join(str(part) for part in parts) + "\n").encode())


class KillSwitch:
    """Numbers every instrumented point of a worker and SIGKILLs it at the planned one.

    The plan kills at the ``occurrence``-th point (0-based) of ``category`` (and of
    ``operation``, when the plan names one: ``"rename_dir"``, ``"write_chunk"``, ...)
    counted from the start of save cycle ``cycle``; without a plan it only reports phase
    changes.
    """

    def __init__(self, plan: dict[str, Any] | None) -> None:
        self.plan = plan
        self.cycle = 0
        self.phase = "recover"
        self.step = -1
        self._reported = ""
        self._seen = 0
        self.counts: dict[str, list[int]] = {}

    def enter(self, phase: str) -> None:
        """Enter a protocol or worker phase (the ``on_phase`` hook lands here)."""
        self.phase = phase
        self.point(phase)

    def point(self, operation: str) -> None:
        """One instrumented point: report a phase change, kill if this is the planned one."""
        category = self.phase
        if operation.startswith("fsync") and category in ("hash", "manifest"):
            category = "fsync"
        if category != self._reported:
            emit("P", category, self.step)
            self._reported = category
        per_cycle = self.counts.setdefault(category, [])
        per_cycle.extend([0] * (self.cycle + 1 - len(per_cycle)))
        per_cycle[self.cycle] += 1
        plan = self.plan
        if plan is None or self.cycle < plan["cycle"] or category != plan["category"]:
            return
        if plan.get("operation", operation) != operation:
            return
        if self._seen == plan["occurrence"]:
            emit("K", category, self._seen)
            os.kill(os.getpid(), signal.SIGKILL)
        self._seen += 1


class InstrumentedStorage(Storage):
    """Local storage whose every call is an instrumented point of a :class:`KillSwitch`.

    Args:
        url: The checkpoint root.
        switch: Where calls are counted.
        exchange: False makes ``exchange_dirs`` fail as on a filesystem without
            ``RENAME_EXCHANGE`` (NFS), so replacements take the two-rename path.
    """

    def __init__(self, url: str, switch: KillSwitch, *, exchange: bool) -> None:
        super().__init__(url)
        self._switch = switch
        self._exchange = exchange

    def exists(self, relative: str = "") -> bool:
        self._switch.point("exists")
        return super().exists(relative)

    def list_dir(self, relative: str = "") -> list[Any]:
        self._switch.point("list_dir")
        return super().list_dir(relative)

    def walk_files(self, relative: str = "") -> list[tuple[str, int]]:
        self._switch.point("walk_files")
        return super().walk_files(relative)

    @contextmanager
    def open(self, relative: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        self._switch.point("open")
        with super().open(relative, mode) as handle:
            yield handle

    def write_bytes(self, relative: str, data: bytes, *, durable: bool = False) -> None:
        self._switch.point("write_bytes")
        super().write_bytes(relative, data, durable=durable)

    def make_dirs(self, relative: str = "") -> None:
        self._switch.point("make_dirs")
        super().make_dirs(relative)

    def make_dir_exclusive(self, relative: str) -> None:
        self._switch.point("make_dir_exclusive")
        super().make_dir_exclusive(relative)

    def remove_tree(self, relative: str) -> None:
        self._switch.point("remove_tree")
        if ".old-" in relative:  # a retired copy: one point per file, so a kill lands inside
            for path, _ in super().walk_files(relative):
                self._switch.point("unlink")
                os.unlink(self.path(f"{relative}/{path}"))
        super().remove_tree(relative)

    def remove_file(self, relative: str) -> None:
        self._switch.point("remove_file")
        super().remove_file(relative)

    def fsync_file(self, relative: str) -> None:
        self._switch.point("fsync_file")
        super().fsync_file(relative)

    def fsync_dir(self, relative: str = "") -> None:
        self._switch.point("fsync_dir")
        super().fsync_dir(relative)

    def rename_dir(self, source: str, target: str) -> None:
        self._switch.point("rename_dir")
        super().rename_dir(source, target)

    def exchange_dirs(self, first: str, second: str) -> None:
        self._switch.point("exchange_dirs")
        if not self._exchange:
            raise StorageError(f"no RENAME_EXCHANGE here for {self.path(first)} (simulated)",
                               path=self.path(first), operation="exchange")
        super().exchange_dirs(first, second)


def save(protocol: CommitProtocol, switch: KillSwitch, rng: random.Random, step: int,
         version: int, *, replace: bool) -> None:
    """Save ``expected_files(step, version)`` as checkpoint ``step``, chunk by chunk."""
    switch.step = step
    emit("B", step, version, int(replace))
    pending = protocol.begin(step, replace=replace)
    switch.enter("write")
    for path, data in expected_files(step, version).items():
        with protocol.storage.open(f"{pending.staging}/{path}", "wb") as handle:
            offset = 0
            while offset < len(data):
                size = rng.randint(1, 64_000)
                switch.point("write_chunk")
                handle.write(data[offset:offset + size])
                handle.flush()
                offset += size
    protocol.publish(pending, Manifest(step=step, extras={"version": version}))
    switch.point("published")
    emit("C", step, version)


def work(plan: dict[str, Any]) -> None:
    """Resume from the newest checkpoint under ``plan["root"]``, save ``plan["cycles"]`` more."""
    root = plan["root"]
    rng = random.Random(plan["seed"])
    switch = KillSwitch(plan.get("kill"))
    storage = InstrumentedStorage(root, switch, exchange=plan["exchange"])
    name_format = NameFormat()
    protocol = CommitProtocol(storage, name_format, on_phase=switch.enter)
    emit("Y", 0)
    switch.enter("recover")
    recover_interrupted(storage, name_format)
    newest = latest_committed(storage, name_format)
    resumed = newest.step if newest is not None else 0
    step = resumed
    for cycle in range(plan["cycles"]):
        if cycle:
            switch.cycle = cycle
            emit("Y", cycle)
        step += 1
        save(protocol, switch, rng, step, 0, replace=False)
        if step % REPLACE_EVERY == 0:
            save(protocol, switch, rng, step, 1, replace=True)
        switch.enter("prune")
        emit("S", resumed)
        report = prune(storage, POLICY, name_format=name_format, protect=[resumed],
                       sweep_after=float(plan.get("sweep_after", 0.0)))
        switch.point("pruned")
        emit("D", ",".join(str(s) for s in report.deleted) or "-")
    emit("T", json.dumps(switch.counts, separators=(",", ":")))


def serve() -> None:
    """Fork one worker per ``run <json>`` line on stdin; report each one's wait status."""
    emit("R")
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command != "run":
            continue
        plan = json.loads(argument)
        gate_read, gate_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(gate_write)
                os.read(gate_read, 1)  # "W <pid>" comes before anything the worker says
                work(plan)
            except BaseException:  # noqa: BLE001 - reported through the exit status
                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            os._exit(code)
        os.close(gate_read)
        emit("W", pid)
        os.write(gate_write, b"go")
        os.close(gate_write)
        _, status = os.waitpid(pid, 0)
        emit("X", pid, status)


if __name__ == "__main__":
    serve()
