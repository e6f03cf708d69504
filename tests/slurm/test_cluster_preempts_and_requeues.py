"""A real SLURM cluster preempts a requeueable job, and the job comes back under its own id.

The job runs a small Python program behind the batch-script pattern that keeps the script
alive while its child finishes (``trap ... TERM; child & pid=$!; while kill -0 ...``). On
its first run the program waits for SIGTERM and records it; on a restart it records
``SLURM_RESTART_COUNT`` and finishes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import (
    SlurmCluster,
    SlurmUnavailableError,
    parse_scontrol_record,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

# The job's program. argv[1]: a directory for its marker files; argv[2]: the restart count
# on which to finish. Once its SIGTERM handler is installed it prints "run <n> started" and
# writes started.<n> (a SIGTERM before that would kill it unrecorded), then blocks in
# signal.pause() until the signal comes.
PROGRAM = r'''
import json, os, signal, sys
from pathlib import Path

out = Path(sys.argv[1])
finish_on = int(sys.argv[2])
raw = os.environ.get("SLURM_RESTART_COUNT")
restart = int(raw) if raw is not None else 0
record = {"restart_count_env": raw, "job_id": os.environ.get("SLURM_JOB_ID")}

def on_term(signum, frame):
    tmp = out / f"preempted.{restart}.tmp"
    tmp.write_text(json.dumps({**record, "signal": signum}))
    tmp.rename(out / f"preempted.{restart}")
    print(f"program: got signal {signum} on run {restart}", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
print(f"program: run {restart} started (SLURM_RESTART_COUNT={raw})", flush=True)
if restart >= finish_on:
    (out / "finished").write_text(json.dumps(record))
    sys.exit(0)
(out / f"started.{restart}").write_text(json.dumps(record))
while True:
    signal.pause()
'''

BATCH = """#!/bin/bash
trap 'echo "batch: SIGTERM received, waiting for the program"' TERM
{python} {program} {out} {finish_on} & pid=$!
while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done
echo "batch: program exited rc=$rc"
exit $rc
"""


def _submit(slurm: SlurmCluster, tmp_path: Path, finish_on: int) -> int:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    return slurm.submit(
        BATCH.format(python=sys.executable, program=program, out=tmp_path, finish_on=finish_on),
        partition="extra",
        cpus=slurm.cpus,
        requeue=True,
        output=tmp_path / "job.out",
        open_mode="append",
        job_name="preemptible",
    )


def test_a_preempted_requeueable_job_gets_sigterm_and_completes_on_its_restart_under_the_same_id(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job_id = _submit(slurm, tmp_path, finish_on=1)
    # Printed once the SIGTERM handler is installed: preempting earlier would kill it unrecorded.
    slurm.wait_for_output(job_id, r"program: run 0 started", timeout=30)

    submitted = time.monotonic()
    preemptor = slurm.preempt()
    slurm.wait_for_file(tmp_path / "preempted.0", timeout=30, job_id=job_id)
    preemption_latency = time.monotonic() - submitted

    requeued = slurm.wait_for(
        job_id,
        lambda s: s["JobState"] == "PENDING" and s["Restarts"] == "1",
        timeout=30,
        what="pending again after preemption",
    )
    requeue_latency = time.monotonic() - submitted
    slurm.release(job_id)
    done = slurm.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=60)
    restart_latency = time.monotonic() - submitted
    print(
        f"cluster start {slurm.timings['start_s']:.1f} s; preemptor submit -> SIGTERM seen "
        f"{preemption_latency:.1f} s, -> requeued {requeue_latency:.1f} s, "
        f"-> completed after release {restart_latency:.1f} s; held by {requeued['Reason']}"
    )

    assert done["JobState"] == "COMPLETED", slurm.describe(job_id)
    markers = {p.name for p in tmp_path.iterdir()}
    assert {"started.0", "preempted.0", "finished"} <= markers, slurm.describe(job_id)
    output = (tmp_path / "job.out").read_text()
    first = json.loads((tmp_path / "preempted.0").read_text())
    second = json.loads((tmp_path / "finished").read_text())
    assert done["ExitCode"] == "0:0"
    assert done["Restarts"] == "1"
    assert first["signal"] == 15
    assert first["restart_count_env"] is None
    assert second["restart_count_env"] == "1"
    assert first["job_id"] == second["job_id"] == str(job_id)
    assert requeued["Reason"] == "BeginTime"
    assert "DUE TO PREEMPTION" in output
    assert "batch: SIGTERM received, waiting for the program" in output
    assert output.count("batch: program exited rc=0") == 2
    assert slurm.wait_for_state(preemptor, "COMPLETED", timeout=30)["ExitCode"] == "0:0"


def test_a_job_preempted_twice_restarts_each_time_with_a_higher_restart_count(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    job_id = _submit(slurm, tmp_path, finish_on=2)
    cycles = [
        slurm.preempt_and_requeue(job_id, when_file=tmp_path / f"started.{run}", timeout=30)
        for run in range(2)
    ]
    done = slurm.wait_for_state(job_id, "COMPLETED", "FAILED", "CANCELLED", timeout=60)
    assert done["JobState"] == "COMPLETED", slurm.describe(job_id)
    print("requeue latencies: " + ", ".join(f"{c.requeue_s:.1f} s" for c in cycles))

    assert [c.restarts for c in cycles] == [1, 2]
    assert done["Restarts"] == "2"
    seen = [json.loads((tmp_path / f"preempted.{run}").read_text()) for run in range(2)]
    assert [s["restart_count_env"] for s in seen] == [None, "1"]
    assert {s["signal"] for s in seen} == {15}
    assert json.loads((tmp_path / "finished").read_text())["restart_count_env"] == "2"


def test_closing_a_cluster_kills_a_job_that_ignores_sigterm_and_removes_its_dir(
    slurm_cluster: SlurmCluster,  # the session cluster proves the programs are here
) -> None:
    with SlurmCluster.start(kill_wait_s=600) as cluster:
        up = cluster.job_file("up")
        job_id = cluster.submit(
            f"#!/bin/bash\ntrap '' TERM\nsleep 3600 & pid=$!\ntouch {up}\n"
            "while kill -0 $pid 2>/dev/null; do wait $pid; done\n",
            cpus=1,
        )
        cluster.wait_for_file(up, timeout=30, job_id=job_id)
        pids = list(cluster.processes())
        assert len(pids) > len(("munged", "slurmctld", "slurmd"))
    alive = [pid for pid in pids if _is_running(pid)]
    assert alive == []
    assert not cluster.root.exists()


def test_a_daemon_that_cannot_start_is_reported_with_its_log_and_nothing_is_left_behind(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    with pytest.raises(SlurmUnavailableError, match=r"slurmctld exited .*NoSuchOption"):
        SlurmCluster.start(base_dir=tmp_path, extra_conf=["NoSuchOption=1"])
    assert list(tmp_path.iterdir()) == []


def test_an_scontrol_record_keeps_values_with_equals_signs_and_keys_with_slashes() -> None:
    record = parse_scontrol_record(
        "JobId=7 JobName=a b JobState=PENDING Reason=BeginTime Restarts=1 "
        "TRES=cpu=2,mem=100M,node=1 CPUs/Task=2 AllocNode:Sid=vm:3 StdOut=/tmp/o.7"
    )
    assert record == {
        "JobId": "7",
        "JobName": "a b",
        "JobState": "PENDING",
        "Reason": "BeginTime",
        "Restarts": "1",
        "TRES": "cpu=2,mem=100M,node=1",
        "CPUs/Task": "2",
        "AllocNode:Sid": "vm:3",
        "StdOut": "/tmp/o.7",
    }


def _is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
