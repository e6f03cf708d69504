"""LingBot-VA tiny across two hosts under real SLURM: preempted, a node lost, the world shrunk.

Each test submits ``examples/lingbot/train_lingbot.sbatch`` once to the namespace cluster
(``tests/multinode/cluster.py``: ``host1`` and ``host2``, each a network namespace with its
own address, hostname and ``slurmd``), one torchrun per node joined by the c10d rendezvous,
one rank per node. The checkpoint root is on the shared filesystem (the NAS); each run is
compared with an uninterrupted single-host 2-rank run of the same command (``reference``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from examples.lingbot.drill import compare_runs
from examples.lingbot.faults import SLOW_READS_VARIABLE
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
    CKPT_TIMEOUT_S,
    NUM_STEPS,
    TRAIN_TIMEOUT_S,
    TRAINER,
    WAIT_S,
    Run,
    newest_step,
    preempt_at,
    runs_of,
    submit,
    wait_for_output,
    wait_for_run_step,
    wait_requeued,
)
from tests.slurm.job_processes import find_worker, frozen

#: What a host1 rank prints when its peer on host2 is gone (gloo names the peer's address).
LOST_PEER = r"\[rank0\]: ([\w.]+(?:Error|Exception)): (.*)"
_ADDRESS = r"\[(\d+\.\d+\.\d+\.\d+)\]"
#: Drill 2's checkpoint-coordination timeout: below ``SlurmdTimeout`` (20 s), above the
#: training timeout, so that a partition during a save is the checkpoint group's to see.
DRILL2_CKPT_TIMEOUT_S = 15
pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]


def _entries(root: Path) -> list:  # type: ignore[type-arg]
    return list_checkpoints(Storage(root / CHECKPOINT_DIR), NameFormat(CHECKPOINT_NAME_FORMAT))


def _assert_bit_identical(reference: Path, root: Path) -> None:
    steps = [r["step"] for r in read_metrics(root / METRICS_FILE)]
    assert steps == list(range(1, NUM_STEPS + 1))
    comparison = compare_runs(reference, root)
    assert comparison.tensors_compared > 0
    assert comparison.first_metric_difference is None, comparison
    assert comparison.different_tensors == [], comparison
    assert comparison.identical, comparison


def _assert_resumes_from_newest_commit(runs: list[Run]) -> list[int]:
    """Each restart resumed from the newest step committed before it; return steps lost."""
    lost = []
    for index, (earlier, later) in enumerate(pairwise(runs), 1):
        committed = [c for run in runs[:index] for c in run.committed]
        assert later.resumed_from == max(committed), (later, committed)
        if earlier.preempted_at is not None:
            lost.append(earlier.preempted_at - max(committed))
    return lost


def _worker_host(cluster: NamespaceCluster, job_id: int, rank: int) -> str:
    """The host whose namespace holds the live rank-``rank`` worker of the job."""
    pid = find_worker(cluster, job_id, rank=rank, module=TRAINER, timeout=WAIT_S)
    assert cluster.network is not None
    hosts = [h for h in cluster.hosts if pid in cluster.network.pids(h)]
    assert len(hosts) == 1, (pid, hosts)
    return hosts[0]


def test_a_two_host_job_preempted_twice_resumes_under_the_same_id_bit_identical(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    root, output = tmp_path / "run", tmp_path / "job.out"
    began = time.monotonic()
    job_id = submit(cluster, root, output)
    placement = {rank: _worker_host(cluster, job_id, rank) for rank in (0, 1)}
    cycles = [round(preempt_at(cluster, job_id, root, output, restarts=restarts, step=step), 2)
              for restarts, step in ((0, 3), (1, 7))]
    done = cluster.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=WAIT_S)
    elapsed = time.monotonic() - began
    text = output.read_text()
    assert done["JobState"] == "COMPLETED", cluster.describe(job_id)
    assert done["Restarts"] == "2"

    runs = runs_of(text)
    assert [r.restart for r in runs] == [0, 1, 2], text
    assert all((r.nodes, r.nodelist, r.batch_host) == (2, "host[1-2]", "host1") for r in runs)
    assert placement == {0: "host1", 1: "host2"}
    assert [r.preempted_at is not None for r in runs] == [True, True, False], text
    lost = _assert_resumes_from_newest_commit(runs)

    entries = _entries(root)
    assert entries and all(e.status == "committed" for e in entries)
    restart_of = {step: run.restart for run in runs for step in run.committed}
    for entry in entries:
        assert entry.manifest is not None
        assert entry.manifest.world_size == 2
        lineage = entry.manifest.lineage
        assert (lineage.slurm_job_id, lineage.slurm_nodelist) == (str(job_id), "host[1-2]")
        assert lineage.slurm_restart_count == restart_of[entry.step]
        assert lineage.hostname == "host1"  # rank 0 published
        files = {f.path for f in entry.manifest.files}
        # Shards of both ranks, i.e. of both hosts (rank 1 ran on host2).
        assert {"rank_state/rank_00000.pt", "rank_state/rank_00001.pt"} <= files
        assert any(p.startswith("tensors/__1_") for p in files)
        assert any(p.startswith("tensors/__0_") for p in files)
    # Nothing the job needs lives on a host's private scratch disk.
    for host in cluster.hosts:
        assert not any(cluster.scratch(host).iterdir())

    _assert_bit_identical(reference, root)
    print(f"\n[drill 1] preempted twice across 2 hosts: job {job_id}, {elapsed:.1f} s, "
          f"requeue {cycles} s, steps lost per preemption {lost}, resumed from "
          f"{[r.resumed_from for r in runs]}, bit-identical: yes")


def _staging_with_data(checkpoints: Path) -> Path | None:
    for staging in sorted(checkpoints.glob(".checkpoint_step_*.tmp-*")):
        try:
            names = [p.name for p in staging.rglob("*") if p.is_file()]
        except OSError:
            continue
        if any(name != ".writer.json" for name in names):
            return staging
    return None


@contextlib.contextmanager
def _in_a_save(cluster: NamespaceCluster, job_id: int, checkpoints: Path) -> Iterator[int]:
    """Catch the job's next save with shards written but not published; yield its step.

    Rank 0 publishes, so it is frozen (SIGSTOP) for the block: the staging directory cannot
    be committed while the block injects its fault, and rank 0 runs on into the rest of
    the save (its checkpoint-group collectives) once the block ends.
    """
    rank0 = find_worker(cluster, job_id, rank=0, module=TRAINER, timeout=WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, f"no save of job {job_id} caught in the act"
        staging = _staging_with_data(checkpoints)
        if staging is None:
            time.sleep(0.005)
            continue
        with frozen(rank0):
            if not staging.exists():
                continue
            yield int(staging.name.split("_step_")[1].split(".tmp-")[0])
        return


def _whole_or_not_at_all(root: Path, step: int) -> bool:
    """Step ``step``'s save, cut short by a fault: either committed whole (the manifest lists
    both ranks' shards) or not at all (no entry, no published directory). Returns which."""
    published = (root / CHECKPOINT_DIR / CHECKPOINT_NAME_FORMAT.format(step=step)).exists()
    entries = [e for e in _entries(root) if e.step == step]
    if not published:
        assert entries == [], entries  # nothing partial is listed either
        return False
    assert [e.status for e in entries] == ["committed"], entries
    manifest = entries[0].manifest
    assert manifest is not None
    files = {f.path for f in manifest.files}
    assert {"rank_state/rank_00000.pt", "rank_state/rank_00001.pt"} <= files, files
    return True


def test_a_host_that_dies_mid_step_or_mid_save_or_is_cut_off_costs_only_uncommitted_steps(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    root, output = tmp_path / "run", tmp_path / "job.out"
    checkpoints = root / CHECKPOINT_DIR
    began_all = time.monotonic()
    # The checkpoint timeout is set below SlurmdTimeout, so that a partition during a save
    # is seen by the ranks (the checkpoint group's timeout) before SLURM marks host2 DOWN.
    job_id = submit(cluster, root, output, env={"CKPT_TIMEOUT_S": str(DRILL2_CKPT_TIMEOUT_S)})
    figures: dict[str, dict[str, object]] = {}
    assert cluster.network is not None
    network = cluster.network
    host2 = network.addresses["host2"]

    def lost(kind: str, restarts: int, offset: int, began: float, reached: int,
             **extra: object) -> str:
        match, detect_s = wait_for_output(cluster, output, LOST_PEER, after=offset)
        error = f"{match.group(1)}: {match.group(2)}"
        figures[kind] = {"detect_s": round(detect_s, 2), "reached": reached,
                         "error": error[:200], **extra}
        return error

    def requeued(kind: str, restarts: int, began: float) -> None:
        state = wait_requeued_or_requeue(cluster, job_id, restarts)
        figures[kind].update(requeued_after_s=round(time.monotonic() - began, 1),
                             requeued_by=state)

    # --- run 0: every process of host2 SIGKILLed in the middle of a training step --------
    wait_for_run_step(cluster, job_id, root, output, restarts=0, step=5)
    offset, reached, began = len(output.read_text()), newest_step(root), time.monotonic()
    killed = cluster.kill_host("host2")
    error = lost("dead host mid-step", 0, offset, began, reached, killed=len(killed))
    assert re.search(_ADDRESS, error) and host2 in error, error  # names the lost peer
    requeued("dead host mid-step", 0, began)
    cluster.revive_host("host2")
    cluster.wait_job_gone(job_id)
    cluster.release(job_id)

    # --- run 1: host2 killed while a checkpoint is being written -----------------------------
    cluster.wait_for_output(job_id, r"lingbot\.train: resumed at step", WAIT_S, min_count=1)
    with _in_a_save(cluster, job_id, checkpoints) as save_step:
        offset, reached = len(output.read_text()), newest_step(root)
        killed = cluster.kill_host("host2")
        began = time.monotonic()
    error = lost("dead host mid-save", 1, offset, began, reached, killed=len(killed),
                 save_step=save_step)
    assert host2 in error or "rank 1" in error or "host2" in error, error
    requeued("dead host mid-save", 1, began)
    figures["dead host mid-save"]["committed"] = _whole_or_not_at_all(root, save_step)
    cluster.revive_host("host2")
    cluster.wait_job_gone(job_id)
    cluster.release(job_id)

    # --- run 2: host2 cut off (veth down: no RST, no FIN) in the middle of a step -----------
    wait_for_run_step(cluster, job_id, root, output, restarts=2, step=9)
    offset, reached, began = len(output.read_text()), newest_step(root), time.monotonic()
    with network.partitioned("host2"):
        lost("partition mid-step", 2, offset, began, reached)
    requeued("partition mid-step", 2, began)
    cluster.heal_host("host2")
    cluster.wait_job_gone(job_id)
    cluster.release(job_id)

    # --- run 3: host2 cut off while a checkpoint is being written ----------------------------
    cluster.wait_for_output(job_id, r"lingbot\.train: resumed at step", WAIT_S, min_count=3)
    with _in_a_save(cluster, job_id, checkpoints) as save_step:
        offset, reached = len(output.read_text()), newest_step(root)
        network.set_link("host2", up=False)
        began = time.monotonic()
    try:
        error = lost("partition mid-save", 3, offset, began, reached, save_step=save_step)
    finally:
        network.set_link("host2", up=True)
    # A timeout fired in host1's rank (the checkpoint group's, unless the save had all it
    # needed from rank 1 already and the next training step's timed out), before SLURM's.
    assert re.search("timed out|timeout", error, re.IGNORECASE), error
    requeued("partition mid-save", 3, began)
    figures["partition mid-save"]["committed"] = _whole_or_not_at_all(root, save_step)
    cluster.heal_host("host2")
    cluster.wait_job_gone(job_id)
    cluster.release(job_id)

    done = cluster.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=WAIT_S)
    assert done["JobState"] == "COMPLETED", cluster.describe(job_id)
    runs = runs_of(output.read_text())
    assert [r.restart for r in runs] == [0, 1, 2, 3, 4]
    _assert_resumes_from_newest_commit(runs)
    lost_steps = {}
    for kind, later in zip(figures, runs[1:], strict=True):
        assert later.resumed_from is not None
        lost_steps[kind] = figures[kind]["reached"] - later.resumed_from  # type: ignore[operator]
        figures[kind]["resumed_from"] = later.resumed_from
    assert all(e.status == "committed" for e in _entries(root))
    _assert_bit_identical(reference, root)
    print(f"\n[drill 2] node loss: job {job_id}, {time.monotonic() - began_all:.1f} s; "
          f"training timeout {TRAIN_TIMEOUT_S} s, checkpoint timeout {DRILL2_CKPT_TIMEOUT_S} s, "
          f"SlurmdTimeout {cluster.slurmd_timeout_s} s")
    for kind, figure in figures.items():
        print(f"[drill 2] {kind}: detected after {figure['detect_s']} s by host1's rank "
              f"({figure['error'][:160]}); steps lost {lost_steps[kind]} (reached "  # type: ignore[index]
              f"{figure['reached']}, resumed from {figure['resumed_from']}); requeued after "
              f"{figure['requeued_after_s']} s by {figure['requeued_by']}"
              + (f"; the save of step {figure['save_step']} was "
                 + ("committed whole" if figure["committed"] else "never committed")
                 if "save_step" in figure else ""))
    print(f"[drill 2] resumed from {[r.resumed_from for r in runs]}; bit-identical: yes")


def wait_requeued_or_requeue(cluster: NamespaceCluster, job_id: int, restarts: int) -> str:
    """SLURM requeues a job whose node failed (NODE_FAIL, ``--requeue``); a job whose ranks
    all exited first (a partition healed before ``SlurmdTimeout``) ends FAILED and is
    requeued here, as an operator (or a requeue-on-failure wrapper) would. Returns which."""
    state = cluster.wait_for(
        job_id, lambda s: s.get("JobState") in {"PENDING", "FAILED", "COMPLETED"}
        and (s.get("JobState") != "PENDING" or int(s.get("Restarts", "0")) > restarts),
        WAIT_S, "requeued or ended")
    if state["JobState"] == "PENDING":
        return f"slurm ({state.get('Reason')})"
    cluster.requeue(job_id)
    wait_requeued(cluster, job_id, restarts)
    return f"scontrol requeue after {state['JobState']}"


def test_a_job_requeued_onto_one_host_reshards_and_grows_back_onto_two(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    root, output = tmp_path / "run", tmp_path / "job.out"
    began = time.monotonic()
    job_id = submit(cluster, root, output)
    # The requeued job is given one node instead of two (as after a node loss, or a smaller
    # allocation on a busy cluster), then two again: the pending job is resized before its
    # release (cluster.resize_pending: tasks, node range and total CPUs together).
    preempt_at(cluster, job_id, root, output, restarts=0, step=3,
               before_release=lambda: cluster.resize_pending(job_id, nodes=1))
    preempt_at(cluster, job_id, root, output, restarts=1, step=7,
               before_release=lambda: cluster.resize_pending(job_id, nodes=2))
    done = cluster.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=WAIT_S)
    assert done["JobState"] == "COMPLETED", cluster.describe(job_id)
    text = output.read_text()
    runs = runs_of(text)
    assert [(r.nodes, r.nodelist) for r in runs] == [(2, "host[1-2]"), (1, "host1"),
                                                     (2, "host[1-2]")], text
    _assert_resumes_from_newest_commit(runs)
    first, second = runs[1].resumed_from, runs[2].resumed_from
    assert first is not None and second is not None

    records = read_metrics(root / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    sizes = [r["world_size"] for r in records]
    assert sizes == [2] * first + [1] * (second - first) + [2] * (NUM_STEPS - second)
    # Data position is global: after S steps of 8 samples, S*8 into the 64-sample epochs,
    # whatever the world size was. A save at an epoch's last step records that epoch as
    # done (consumed 64: the sampler's "epoch over"; the trainer moves to the next epoch).
    for run in runs[1:]:
        assert run.resumed_from is not None
        epoch, consumed = divmod(run.resumed_from * 8, 64)
        expected = {(epoch, consumed)} if consumed else {(epoch, 0), (epoch - 1, 64)}
        assert (run.resumed_epoch, run.resumed_consumed) in expected, run.text
    # RNG: shrinking drops rank 1's streams; growing gives the new rank 1 derived ones, said.
    assert "draws new streams derived from rank 0" in runs[2].text, runs[2].text
    # Tensors resharded 2 -> 1 -> 2; each checkpoint's lineage names its allocation.
    by_step = {e.step: e.manifest for e in _entries(root) if e.manifest is not None}
    assert by_step[first].world_size == 2 and by_step[first].lineage.slurm_nodelist == "host[1-2]"
    assert by_step[second].world_size == 1 and by_step[second].lineage.slurm_nodelist == "host1"
    assert by_step[NUM_STEPS].world_size == 2
    # Before the first shrink the history is the reference's, bit for bit; after it the run
    # is a correct continuation, not a replay (docs/concepts.md, resharding policy).
    comparison = compare_runs(reference, root, steps=range(1, first + 1))
    assert comparison.first_metric_difference is None, comparison
    print(f"\n[drill 3] world 2 -> 1 -> 2: job {job_id}, {time.monotonic() - began:.1f} s, "
          f"resumed at {first} on host1 alone and "
          f"at {second} on host[1-2]; world sizes {sizes}; final loss "
          f"{comparison.final_loss:.6f}, largest final weight difference from the reference "
          f"{comparison.max_weight_difference:.3g}")


def test_one_hosts_slow_reads_beyond_the_training_timeout_are_absorbed_by_the_meeting(
    cluster: NamespaceCluster, reference: Path, tmp_path: Path
) -> None:
    root, output = tmp_path / "run", tmp_path / "job.out"
    delay = TRAIN_TIMEOUT_S * 1.5
    job_id = submit(cluster, root, output, env={SLOW_READS_VARIABLE: f"host2={delay}"})
    preempt_at(cluster, job_id, root, output, restarts=0, step=5)
    done = cluster.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=WAIT_S)
    assert done["JobState"] == "COMPLETED", cluster.describe(job_id)
    runs = runs_of(output.read_text())
    assert [r.restart for r in runs] == [0, 1]
    restored = runs[1].text
    # host2's rank (rank 1) sat in its first read for longer than the training timeout...
    assert "delaying the first storage read on host2" in restored, restored
    assert "delaying the first storage read on host1" not in restored, restored
    # ...and the first training collective after the restore still succeeded: no timeout.
    assert "Timed out" not in restored and "Traceback" not in restored, restored
    assert runs[1].resumed_from is not None and runs[1].exit_status == 0
    _assert_bit_identical(reference, root)
    print(f"\n[drill 4] host2 reads delayed {delay:.0f} s > training timeout "
          f"{TRAIN_TIMEOUT_S} s: absorbed by the checkpoint-group meeting "
          f"(timeout {CKPT_TIMEOUT_S} s); resumed at {runs[1].resumed_from}; bit-identical: yes")
