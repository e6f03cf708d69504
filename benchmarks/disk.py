"""The disk's best: ``fio`` with direct I/O in 4 MiB blocks, 1 and 4 jobs, same bytes.

``fio`` is an OS package (``make bench`` installs it with apt-get where it can); without
it the disk figures are skipped with a note saying so. Each measurement writes (or reads
back) ``total_bytes`` split evenly over the jobs, one file per job, ``--direct=1
--bs=4M --end_fsync=1``; its seconds are ``total_bytes`` at the bandwidth fio reports.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

BLOCK = 4 << 20


def missing() -> str | None:
    """Why fio cannot run here, or None."""
    if shutil.which("fio") is None:
        return ("fio is not installed (make bench installs it from the OS packages where "
                "it can: apt-get install -y fio); save_vs_disk_best and load_vs_disk_best "
                "are not measured")
    return None


def fio(directory: Path, rw: str, jobs: int, total_bytes: int) -> dict[str, Any]:
    """One fio run; ``{"seconds": ..., "bytes_per_s": ..., "io_bytes": ...}``."""
    directory.mkdir(parents=True, exist_ok=True)
    per_job = -(-total_bytes // jobs // BLOCK) * BLOCK
    command = ["fio", "--name=resumekit-bench", f"--directory={directory}", f"--rw={rw}",
               f"--bs={BLOCK}", "--direct=1", "--ioengine=psync", f"--numjobs={jobs}",
               f"--size={per_job}", "--end_fsync=1", "--group_reporting",
               "--filename_format=$jobname.$jobnum", "--output-format=json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    report = json.loads(done.stdout[done.stdout.index("{"):])
    side = report["jobs"][0]["read" if rw == "read" else "write"]
    rate = float(side["bw_bytes"])
    return {"seconds": total_bytes / rate, "bytes_per_s": rate,
            "io_bytes": int(side["io_bytes"])}
