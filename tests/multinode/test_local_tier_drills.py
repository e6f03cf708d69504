"""The local tier's drills (issue 30): a worker killed, a host lost, a preemption, a corrupt copy.

Each test submits ``examples/lingbot/train_lingbot.sbatch`` once to the namespace cluster
(``tests/multinode/cluster.py``: ``host1`` and ``host2`` plus the spare ``host3``), one
torchrun per node, one rank per node, with the local tier on: ``LOCAL_DIR`` is the
cluster's node-local path (the same path on every host, each host's own disk there),
``LOCAL_EVERY=2``, durable saves every 6 steps, ``MAX_RESTARTS=3`` (torchrun restarts the
worker group in the job). The run is compared, bit for bit, with the uninterrupted
single-host reference of the session (``conftest.reference``: same command, no local tier,
durable saves every 4 steps; saving never changes the numbers).

What each restore read is taken from the trainer's output: the local tier logs
``resumekit: restore: step N from the local|replica tier (why)``; a durable restore logs
``resumekit: restored step N from <path>``. Figures (recovery time from the fault to the
first step trained after the restore, steps lost, bytes written to the durable root) are
printed; ``docs/local-tier.md`` ("Drills") quotes them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from examples.lingbot.drill import compare_runs
from examples.lingbot.train import (
    CHECKPOINT_DIR,
    CHECKPOINT_NAME_FORMAT,
    METRICS_FILE,
    read_metrics,
)
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage
from tests.multinode.cluster import NamespaceCluster
from tests.multinode.drills import (
    NUM_STEPS,
    TRAINER,
    WAIT_S,
    newest_step,
    preempt_at,
    runs_of,
    submit,
    wait_for_output,
    wait_for_step,
    wait_requeued,
)
from tests.slurm.job_processes import find_worker, frozen, wait_while_job_runs

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]

LOCAL_EVERY = 2
LOCAL_KEEP = 2
DURABLE_EVERY = 6

_RESUMED = re.compile(r"lingbot\.train: resumed at step (\d+)")
_FROM_TIER = re.compile(r"resumekit: restore: step (\d+) from the (local|replica) tier \((.*)\)$",
                        re.MULTILINE)
_FROM_DURABLE = re.compile(r"resumekit: restored step (\d+) from (\S+)")
_IN_JOB = re.compile(r"lingbot\.train: in-job restart (\d+) of at most (\S+)")
_PASSED_OVER = re.compile(r"not restoring step (\d+) from the (local|replica) tier: (.*)")
_SPARED = re.compile(r"(rank (\d+)'s copy .*); rank \d+ reads rank (\d+)'s replica of step "
                     r"(\d+) instead")
_LOCAL_COMMIT = re.compile(r"resumekit: committed local step (\d+) under")
#: Rank 0's line once a local step is committed on every rank and rank 0's replication
#: (its own copy sent, its partner's received) is done (rank 1 logs warnings only).
_RANK0_LOCAL_COMMIT = re.compile(r"^\[rank 0\] .*resumekit: committed local step (\d+) under",
                                 re.MULTILINE)
_STAMP = r"^\[rank 0\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_RESUMED_AT = re.compile(_STAMP + r"lingbot\.train: resumed at step (\d+)", re.MULTILINE)
_FIRST_STEP_AT = re.compile(_STAMP + r"lingbot\.train: first step after resuming at step "
                            r"(\d+) done", re.MULTILINE)


def _local_env(cluster: NamespaceCluster, name: str) -> dict[str, str]:
    """The job's settings: local tier on ``cluster.node_local/name``, in-job restarts on."""
    return {"SAVE_INTERVAL": str(DURABLE_EVERY), "LOCAL_EVERY": str(LOCAL_EVERY),
            "LOCAL_KEEP": str(LOCAL_KEEP), "MAX_RESTARTS": "3",
            "LOCAL_DIR": str(cluster.node_local / name)}


def _local_root(cluster: NamespaceCluster, host: str, name: str) -> Path:
    """``host``'s local tier directory of the run, as the test sees it (its scratch disk)."""
    return cluster.scratch(host) / name


def _rank(rank: int) -> str:
    return f"rank_{rank:05d}"


def _committed_steps(root: Path) -> list[int]:
    """Committed step directories of one node-local sub-root (``rank_XXXXX``, replicas)."""
    if not root.is_dir():
        return []
    entries = list_checkpoints(Storage(root), NameFormat(CHECKPOINT_NAME_FORMAT))
    return sorted(e.step for e in entries if e.status == "committed")


def _durable_steps(root: Path) -> list[int]:
    return _committed_steps(root / CHECKPOINT_DIR)


def _worker(cluster: NamespaceCluster, job_id: int, rank: int, *,
            not_one_of: Collection[int] = ()) -> int:
    """The live rank-``rank`` worker of the job, not one of ``not_one_of`` (the workers of
    the group that failed: torchrun's ``TORCHELASTIC_RESTART_COUNT`` cannot tell, a node
    restarted for another node's failure does not count the restart)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        pid = find_worker(cluster, job_id, rank=rank, module=TRAINER, timeout=WAIT_S)
        if pid not in not_one_of:
            return pid
        assert time.monotonic() < deadline, f"no new rank {rank} worker besides {not_one_of}"
        time.sleep(0.05)


def _host_of(cluster: NamespaceCluster, pid: int) -> str:
    assert cluster.network is not None
    hosts = [h for h in cluster.hosts if pid in cluster.network.pids(h)]
    assert len(hosts) == 1, (pid, hosts)
    return hosts[0]


@contextmanager
def _all_frozen(*pids: int) -> Iterator[None]:
    """Every one of ``pids`` stopped (SIGSTOP) for the block, continued after it."""
    with ExitStack() as stack:
        for pid in pids:
            stack.enter_context(frozen(pid))
        yield


def _local_step_of(step: int) -> int:
    """The newest local step at or below ``step`` (0: none yet)."""
    return step - step % LOCAL_EVERY


def _committed_local(output: Path, after: int) -> set[int]:
    """Local steps rank 0 logged committed (and replicated) past offset ``after``, and the
    step this run resumed at (its line ends at ``after``): it saves no local copy of the
    step it restored, so no write of it is in flight (CI rehearsals waited for that commit
    line in vain)."""
    text = output.read_text(errors="replace") if output.exists() else ""
    # ``after`` ends this run's own "resumed at step" line: that line counts too (a run
    # resumed at a local step, say 6, and frozen at 7 has no write in flight).
    line_start = text.rfind("\n", 0, after) + 1
    return ({int(s) for s in _RANK0_LOCAL_COMMIT.findall(text, after)}
            | {int(step) for _, step in _RESUMED_AT.findall(text, line_start)})


@contextmanager
def _frozen_settled(cluster: NamespaceCluster, job_id: int, root: Path, output: Path,
                    pids: Collection[int], *, step: int, after: int = 0) -> Iterator[int]:
    """``pids`` frozen once the run reached ``step`` and no local save is in flight.

    Local saves write, commit and replicate in the background (issue 38.2), so the step a
    rank reached says nothing of which local copies exist. Frozen with step ``R`` the
    newest in ``metrics.jsonl`` (rank 0 appends it before its ``step_end``), the newest
    local save any rank can have agreed on is ``L``, the local step at or below ``R``;
    the moment is settled when rank 0 logged ``L`` committed and replicated (past offset
    ``after``: this run's lines). Otherwise the ranks are continued, the test waits for
    that line (an event), and freezes again. Yields ``R``.
    """
    while True:
        wait_for_step(cluster, job_id, root, step)
        with _all_frozen(*pids):
            reached = newest_step(root)
            local = _local_step_of(reached)
            if local and local in _committed_local(output, after):
                yield reached
                return
        # The last step is saved by finish(), not as a local step: no moment is left.
        assert reached < NUM_STEPS, f"the run reached step {reached}, its last, before a " \
                                    "settled moment (a loaded machine: rerun it alone)"
        if local:  # its write is in flight: wait for its commit line, then freeze again
            wait_while_job_runs(cluster, job_id,
                                lambda step=local: step in _committed_local(output, after),
                                what=f"rank 0's commit line of local step {local}",
                                timeout=WAIT_S, poll_s=0.01)
        step = max(reached, LOCAL_EVERY)


@dataclass
class Restore:
    """One restore of the job, as its output tells it."""

    step: int
    tier: str
    why: str
    passed_over: list[tuple[int, str, str]]
    spared: list[tuple[int, int, int, str]]  # (step, rank, holder, why): a replica read instead
    text: str = field(repr=False)


def restores_of(output: str) -> list[Restore]:
    """Every ``resumed at step`` of the job (launches and in-job restarts), with the tier
    the restore read (its log line between the previous resume, or start, and this one)."""
    found, start = [], 0
    for match in _RESUMED.finditer(output):
        text = output[start:match.end()]
        start = match.end()
        step = int(match.group(1))
        tier = _FROM_TIER.findall(text)
        durable = _FROM_DURABLE.findall(text)
        if tier:
            tier_step, name, why = tier[-1]
            assert int(tier_step) == step, text
        else:
            assert durable and int(durable[-1][0]) == step, text
            name, why = "durable", durable[-1][1]
        # Every rank warns: one entry per distinct warning.
        passed = sorted({(int(s), t, e) for s, t, e in _PASSED_OVER.findall(text)})
        spared = sorted({(int(s), int(r), int(h), e) for e, r, h, s in _SPARED.findall(text)})
        found.append(Restore(step, name, why, passed, spared, text))
    return found


@dataclass
class Fault:
    """What a drill did and when: the step reached, the wall-clock time of the fault."""

    reached: int
    at: float = field(default_factory=time.time)


def _stamp(text: str) -> float:
    """A log line's time (``logging``'s asctime, local time, ms) as a Unix time."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()  # noqa: DTZ007


def _await_recovery(cluster: NamespaceCluster, job_id: int, output: Path, fault: Fault,
                    *, restores: int) -> tuple[Restore, dict[str, float]]:
    """Wait for the job's ``restores``-th restore and the first step trained after it.

    The times come from rank 0's log lines (their timestamps), not from when the test
    saw them: ``resumed_s`` (the restore done: "resumed at step") and ``first_step_s``
    (the first optimizer step after it done), seconds after the fault.
    """
    def done() -> bool:
        text = output.read_text(errors="replace") if output.exists() else ""
        return len(_FIRST_STEP_AT.findall(text)) >= restores

    wait_while_job_runs(cluster, job_id, done, what=f"the first step after restore {restores}",
                        timeout=WAIT_S, poll_s=0.05)
    text = output.read_text(errors="replace")
    restore = restores_of(text)[restores - 1]
    resumed_at = _RESUMED_AT.findall(text)[restores - 1]
    first_at = _FIRST_STEP_AT.findall(text)[restores - 1]
    assert int(resumed_at[1]) == int(first_at[1]) == restore.step, (resumed_at, first_at)
    return restore, {"resumed_s": round(_stamp(resumed_at[0]) - fault.at, 2),
                     "first_step_s": round(_stamp(first_at[0]) - fault.at, 2)}


def _assert_bit_identical(reference: Path, root: Path) -> None:
    assert [r["step"] for r in read_metrics(root / METRICS_FILE)] == list(range(1, NUM_STEPS + 1))
    comparison = compare_runs(reference, root)
    assert comparison.tensors_compared > 0
    assert comparison.first_metric_difference is None, comparison
    assert comparison.different_tensors == [], comparison
    assert comparison.identical, comparison


def _durable_bytes(root: Path) -> tuple[int, int]:
    """Bytes and count of the committed checkpoints in the run's durable root."""
    entries = [e for e in list_checkpoints(Storage(root / CHECKPOINT_DIR),
                                           NameFormat(CHECKPOINT_NAME_FORMAT))
               if e.status == "committed" and e.manifest is not None]
    return sum(f.size for e in entries for f in e.manifest.files), len(entries)  # type: ignore[union-attr]


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _wait_done(cluster: NamespaceCluster, job_id: int) -> dict[str, str]:
    done = cluster.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=WAIT_S)
    assert done["JobState"] == "COMPLETED", cluster.describe(job_id)
    return done


# --------------------------------------------------------------------------- (a)


def test_in_job_restart_after_a_worker_sigkill_resumes_from_the_local_tier_else_durable(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    """(a) torchrun restarts the worker group on the same nodes after rank 1 is SIGKILLed:
    the restart resumes from the local tier, losing at most ``LOCAL_EVERY`` steps. Later in
    the same job every node-local copy is removed and rank 1 killed again: that restart
    falls back to the durable root, with a warning. No requeue, one allocation throughout;
    the finished run is bit-identical to the reference."""
    name = "drill-a"
    root, output = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(cluster, root, output, env=_local_env(cluster, name))
    rank0, rank1 = (_worker(cluster, job_id, rank) for rank in (0, 1))
    placement = {0: _host_of(cluster, rank0), 1: _host_of(cluster, rank1)}
    assert placement == {0: "host1", 1: "host2"}

    # --- fault 1: rank 1's worker SIGKILLed; local copies of step 2 (at least) exist ------
    # Rank 0 logs the steps: frozen, the step reached is exact; and no local save of a
    # step at or below it is still writing.
    with _frozen_settled(cluster, job_id, root, output, [rank0], step=3) as reached:
        own = {h: _committed_steps(_local_root(cluster, h, name) / _rank(r))
               for r, h in placement.items()}
        durable_at_first = _durable_steps(root)
        first = Fault(reached)
        os.kill(rank1, signal.SIGKILL)
    # The restarted workers are found while they restore, and the next fault waits for
    # its step from then on: a tiny run is done seconds after its restore.
    restarted = {rank: _worker(cluster, job_id, rank, not_one_of=(rank0, rank1))
                 for rank in (0, 1)}
    # The restarted group's lines come after its "resumed at step" line.
    resumed, _ = wait_for_output(cluster, output, _RESUMED.pattern, after=0)
    # Restarted in the job, on the same hosts: no requeue.
    assert {r: _host_of(cluster, pid) for r, pid in restarted.items()} == placement

    # --- fault 2: every node-local copy gone (both hosts), rank 1 SIGKILLed again --------
    # As early as the durable step is there (a tiny run ends seconds after its restore).
    with _frozen_settled(cluster, job_id, root, output, restarted.values(),
                         step=DURABLE_EVERY + 1, after=resumed.end()) as reached2:
        durable_then = _durable_steps(root)
        for rank, host in placement.items():
            wiped = _local_root(cluster, host, name)
            assert _committed_steps(wiped / _rank(rank)), wiped  # there was a copy to lose
            for path in wiped.iterdir():
                shutil.rmtree(path)
        second = Fault(reached2)
        os.kill(restarted[1], signal.SIGKILL)

    local_restore, local_times = _await_recovery(cluster, job_id, output, first, restores=1)
    newest_local = max(set(own["host1"]) & set(own["host2"]))
    assert local_restore.tier == "local", local_restore.text
    assert local_restore.step >= newest_local, (local_restore, own)
    assert reached - local_restore.step <= LOCAL_EVERY, (reached, local_restore)
    assert local_restore.step > max(durable_at_first, default=0)  # newer than durable

    durable_restore, durable_times = _await_recovery(cluster, job_id, output, second,
                                                     restores=2)
    assert durable_restore.tier == "durable", durable_restore.text
    assert durable_restore.step == max(durable_then), (durable_restore, durable_then)
    # Why durable, at INFO, and that the restart missed its promise, as a warning (both
    # the library's).
    assert f"restore: step {durable_restore.step} from the durable tier (" in \
        durable_restore.text, durable_restore.text
    assert re.search(r"LocalTierMissWarning: in-job restart 2 \(torchrun --max-restarts\) found "
                     r"no usable node-local copy: .*; restoring step "
                     rf"{durable_restore.step} from the durable root",
                     output.read_text()), output.read_text()[-3000:]

    done = _wait_done(cluster, job_id)
    text = output.read_text()
    assert done["Restarts"] == "0", cluster.describe(job_id)  # never requeued
    runs = runs_of(text)
    assert len(runs) == 1 and runs[0].nodelist == "host[1-2]", text
    assert [int(n) for n, _ in _IN_JOB.findall(text)] == [1, 2], text
    _assert_bit_identical(reference, root)

    durable_bytes, durable_count = _durable_bytes(root)
    per_checkpoint = durable_bytes / durable_count
    # One local step on host1: rank 0's own copy and the replica of rank 1's it keeps.
    host1 = _local_root(cluster, "host1", name)
    local_step = sum(_tree_bytes(sub / CHECKPOINT_NAME_FORMAT.format(step=NUM_STEPS - 2))
                     for sub in (host1 / _rank(0), host1 / f"replica_of_{_rank(1)}"))
    print(f"\n[local-tier a] job {job_id}: in-job restart 1 (rank 1 SIGKILLed at step {reached}) "
          f"resumed from the local tier at step {local_restore.step}: steps lost "
          f"{reached - local_restore.step}; first step after the restore "
          f"{local_times['first_step_s']} s after the kill (resumed line at "
          f"{local_times['resumed_s']} s)")
    print(f"[local-tier a] in-job restart 2 (local copies removed, rank 1 SIGKILLed at step "
          f"{reached2}) resumed from the durable root at step {durable_restore.step}: steps "
          f"lost {reached2 - durable_restore.step}; first step after the restore "
          f"{durable_times['first_step_s']} s after the kill (resumed line at "
          f"{durable_times['resumed_s']} s)")
    print(f"[local-tier a] durable root: {durable_count} checkpoints, {durable_bytes} bytes "
          f"({per_checkpoint:.0f} per checkpoint); per 100 steps at <= {LOCAL_EVERY} steps "
          f"lost per crash: {100 / DURABLE_EVERY * per_checkpoint / 1e6:.2f} MB with the local "
          f"tier (durable every {DURABLE_EVERY}) vs {100 / LOCAL_EVERY * per_checkpoint / 1e6:.2f}"
          f" MB without (durable every {LOCAL_EVERY}); node-local writes per node per 100 "
          f"steps: {100 / LOCAL_EVERY * local_step / 1e6:.2f} MB (own copy and partner's "
          f"replica, {local_step} bytes a step); bit-identical: yes")


# --------------------------------------------------------------------------- (b)


def test_local_tier_host_lost_with_its_disk_requeues_onto_a_fresh_host_from_the_replica(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    """(b) host2 is lost with its node-local disk; SLURM requeues the job (NODE_FAIL) onto
    host1 and the spare host3, which never ran it: rank 1 (now on host3) gets its copy of
    the newest local step from rank 0's replica (host1), no step older than the local
    interval is lost, and the run is bit-identical to the reference."""
    name = "drill-b"
    root, output = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(cluster, root, output, env=_local_env(cluster, name))
    rank0 = _worker(cluster, job_id, 0)
    assert _host_of(cluster, rank0) == "host1"
    assert _host_of(cluster, _worker(cluster, job_id, 1)) == "host2"
    # Step 9: local steps 6 and 8 are held (own and partner's replica), durable step 6.
    replicas = _local_root(cluster, "host1", name) / f"replica_of_{_rank(1)}"
    with _frozen_settled(cluster, job_id, root, output, [rank0],
                         step=DURABLE_EVERY + 3) as reached:
        held = _committed_steps(replicas)
        own0 = _committed_steps(_local_root(cluster, "host1", name) / _rank(0))
        durable_then = _durable_steps(root)
        fault = Fault(reached)
        killed = cluster.lose_host("host2")
    assert killed and held and not any(cluster.scratch("host2").iterdir())
    state = wait_requeued(cluster, job_id, 0)
    requeued_s = time.time() - fault.at
    cluster.wait_job_gone(job_id, lost=["host2"])
    cluster.release(job_id)
    restore, times = _await_recovery(cluster, job_id, output, fault, restores=1)

    done = _wait_done(cluster, job_id)
    text = output.read_text()
    runs = runs_of(text)
    assert [r.restart for r in runs] == [0, 1], text
    assert runs[1].nodelist == "host[1,3]", runs[1]  # the spare, not the lost host
    assert done["Restarts"] == "1", state
    expected = max(set(held) & set(own0))
    assert restore.tier == "replica", restore.text
    assert restore.step == expected and restore.step > max(durable_then, default=0), \
        (restore, held, own0, durable_then)
    assert "rank 1 from rank 0's replica" in restore.why, restore.why
    assert reached - restore.step <= LOCAL_EVERY, (reached, restore)
    # host3 now holds rank 1's own copies; nothing came back on the lost host.
    assert _committed_steps(_local_root(cluster, "host3", name) / _rank(1))
    assert not any(cluster.scratch("host2").iterdir())
    _assert_bit_identical(reference, root)
    print(f"\n[local-tier b] job {job_id}: host2 lost with its disk at step {reached}; "
          f"requeued after {requeued_s:.1f} s (SlurmdTimeout {cluster.slurmd_timeout_s} s); "
          f"run 1 on host[1,3] resumed at step {restore.step} from the replica tier "
          f"({restore.why}); steps lost {reached - restore.step}; first step after the "
          f"restore {times['first_step_s']} s after the loss (this includes SLURM's "
          f"detection and the test's release); durable newest was "
          f"{max(durable_then, default=None)}; bit-identical: yes")


# --------------------------------------------------------------------------- (c)


def test_local_tier_preemption_saves_to_the_durable_root_and_the_requeue_resumes_from_it(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    """(c) A preemption's emergency save goes to the durable root, never only to the local
    tier. The requeued job (same hosts, local copies still there) resumes from the newest
    step every rank can get: the durable emergency checkpoint, newer than any local copy
    (a local step as new as the durable one would win the tie: a local read is cheaper)."""
    name = "drill-c"
    root, output = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(cluster, root, output, env=_local_env(cluster, name))
    at = DURABLE_EVERY + 3  # odd: not a local step; the emergency save is the newest
    began = time.monotonic()
    preempt_at(cluster, job_id, root, output, restarts=0, step=at)
    _wait_done(cluster, job_id)
    text = output.read_text()
    runs = runs_of(text)
    assert [r.restart for r in runs] == [0, 1], text
    # The ranks count the signal at their next vote: with poll_every="auto" and local
    # saves making every other step longer, that can be a step or two after ``at``.
    stopped = runs[0].preempted_at
    assert stopped is not None and at <= stopped <= at + 2, runs[0]
    assert stopped in runs[0].committed, runs[0]
    entries = {e.step: e for e in list_checkpoints(Storage(root / CHECKPOINT_DIR),
                                                    NameFormat(CHECKPOINT_NAME_FORMAT))}
    assert entries[stopped].manifest is not None
    assert entries[stopped].manifest.reason == "preemption"
    local0 = [int(s) for s in _LOCAL_COMMIT.findall(runs[0].text)]
    assert local0 and max(local0) < stopped, local0
    [restore] = restores_of(text)
    assert (restore.tier, restore.step) == ("durable", stopped), restore.text
    # The local copies were there and usable, only older: said why durable was read.
    assert f"step {max(local0)}" in restore.text, restore.text
    _assert_bit_identical(reference, root)
    print(f"\n[local-tier c] job {job_id}: preempted at step {stopped} (emergency save to the "
          f"durable root; newest local step {max(local0)}); the requeue resumed from the "
          f"durable root at step {restore.step}: steps lost 0; {time.monotonic() - began:.1f} s; "
          "bit-identical: yes")


# --------------------------------------------------------------------------- (d)


def _flip_a_byte(step_dir: Path) -> Path:
    """Flip one byte in the middle of the largest tensor file of a local copy (same size:
    only the checksums can tell)."""
    files = [p for p in (step_dir / "tensors").rglob("*")
             if p.is_file() and not p.name.startswith(".")]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def test_local_tier_corrupted_copy_is_passed_over_with_a_warning_for_the_partners_replica(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    """(d) One byte of rank 1's newest own local copy is flipped, then rank 1 is killed: the
    in-job restart's restore finds the checksum mismatch, says so in a warning naming the
    copy, and takes the next candidate: the partner's replica of the same step (no step
    lost to the corruption); the run ends bit-identical."""
    name = "drill-d"
    root, output = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(cluster, root, output, env=_local_env(cluster, name))
    rank0, rank1 = (_worker(cluster, job_id, rank) for rank in (0, 1))
    roots = {rank: _local_root(cluster, host, name) / _rank(rank)
             for rank, host in ((0, "host1"), (1, "host2"))}
    with _frozen_settled(cluster, job_id, root, output, [rank0, rank1],
                         step=2 * LOCAL_EVERY + 1) as reached:
        own = {rank: set(_committed_steps(path)) for rank, path in roots.items()}
        kept = set(_committed_steps(_local_root(cluster, "host1", name)
                                    / f"replica_of_{_rank(1)}"))
        durable_then = max(_durable_steps(root), default=None)
        common = sorted(own[0] & own[1])
        assert common, own
        bad = common[-1]
        assert bad in kept, (bad, kept)  # host1 keeps rank 1's replica of it
        corrupted = _flip_a_byte(roots[1] / CHECKPOINT_NAME_FORMAT.format(step=bad))
        fault = Fault(reached)
        os.kill(rank1, signal.SIGKILL)
    restore, times = _await_recovery(cluster, job_id, output, fault, restores=1)
    if durable_then is not None and durable_then > bad:
        expected = (durable_then, "durable")  # the durable root is newer than any copy
    else:
        expected = (bad, "replica")
    assert (restore.step, restore.tier) == expected, (restore, own, durable_then)
    assert restore.passed_over == [], restore.text  # no step given up
    assert [(s, r, h) for s, r, h, _ in restore.spared] == [(bad, 1, 0)], restore.text
    why = restore.spared[0][3]
    assert CHECKPOINT_NAME_FORMAT.format(step=bad) in why, why
    assert re.search("checksum|Corrupt", why), why
    _wait_done(cluster, job_id)
    _assert_bit_identical(reference, root)
    print(f"\n[local-tier d] job {job_id}: rank 1's local copy of step {bad} corrupted "
          f"({corrupted.name}, one byte), rank 1 SIGKILLed at step {reached}: its copy "
          f"failed with a warning ({why[:140]}); resumed at step {restore.step} from the "
          f"{restore.tier} tier (rank 0's replica); steps lost {reached - restore.step}; "
          f"first step after the restore {times['first_step_s']} s after the kill; "
          f"bit-identical: yes")
