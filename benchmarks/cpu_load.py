"""A sync save on a CPU-busy host beside a plain 4-thread ``O_DIRECT`` writer (issue 40, item 4).

The incident's hosts had their cores busy with data loading when a checkpoint was written:
a save whose own CPU (hashing, copying, Python) is high then falls behind the disk. Here,
in one run, on the same filesystem, the same bytes are written, alternately, by

* a sync ``CheckpointManager.save`` (raw format, 4 writer threads, fsync), and
* a plain writer: 4 threads, each its own file opened with ``O_DIRECT``, the bytes copied
  through an aligned (``mmap``) buffer, fsync'd: what the disk takes with no checksum, no
  plan and no Python per item,

first on a quiet host, then beside a CPU load: ``stress-ng --cpu N`` where it is installed,
else N Python busy-loop processes started here (the result names which). The load runs
for one short burst (at most :data:`MAX_LOAD_S` seconds, and it ends itself then even if
this process dies); a measurement that outlasts it is refused, not reported. Both sides
see the same load, noise from other processes of the host included, so the ratio of their
medians is what the issue's target (>= 0.7) is about.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from resumekit.manager import CheckpointManager

LOAD_WORKERS = 4
"""CPU-bound load processes beside the save (the issue's ``stress-ng --cpu 4``)."""
MAX_LOAD_S = 90
"""The longest burst of load: the host is shared."""
WRITER_THREADS = 4
BUFFER_BYTES = 8 << 20
ALIGNMENT = 4096
BUSY_LOOP = ("import sys, time\nend = time.monotonic() + float(sys.argv[1])\n"
             "while time.monotonic() < end:\n    pass\n")


class LoadEndedEarly(RuntimeError):
    """The CPU load ended before the measurement beside it did."""


def load_command(workers: int, seconds: float, *, stress_ng: str | None
                 ) -> tuple[str, list[list[str]]]:
    """The load's description and the commands that start it.

    ``stress-ng --cpu N`` (one command) where ``stress_ng`` is its path, else N Python
    busy-loop processes; each ends itself after ``seconds``.
    """
    whole = max(1, int(seconds))
    if stress_ng:
        return (f"stress-ng --cpu {workers}",
                [[stress_ng, "--cpu", str(workers), "--timeout", f"{whole}s", "--quiet"]])
    return (f"{workers} Python busy-loop process(es) (stress-ng not installed)",
            [[sys.executable, "-c", BUSY_LOOP, str(whole)] for _ in range(workers)])


class Load:
    """The processes of a running load."""

    def __init__(self, processes: list[subprocess.Popen[bytes]]) -> None:
        self.processes = processes

    @property
    def pids(self) -> list[int]:
        """The load's processes (stress-ng's own workers are their children)."""
        return [process.pid for process in self.processes]

    def running(self) -> bool:
        """Whether every load process still runs."""
        return all(process.poll() is None for process in self.processes)


@contextlib.contextmanager
def cpu_load(workers: int, seconds: float, *, stress_ng: str | None = None
             ) -> Iterator[Load]:
    """Keep ``workers`` CPU-bound processes running for at most ``seconds``.

    On exit the processes (each in a session of its own, so stress-ng's workers too) are
    ended and waited for.
    """
    _, commands = load_command(workers, seconds, stress_ng=stress_ng)
    started = [subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, start_new_session=True)
               for command in commands]
    try:
        yield Load(started)
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def plain_odirect_write(tensors: Sequence[torch.Tensor], directory: Path,
                        threads: int = WRITER_THREADS) -> bool:
    """Write the tensors' bytes into ``threads`` new files, each from its own thread.

    Each file is opened with ``O_DIRECT`` (where the filesystem refuses it: without), the
    bytes copied through an aligned ``mmap`` buffer in :data:`BUFFER_BYTES` pieces, each
    tensor padded to :data:`ALIGNMENT`, and the file fsync'd. Tensors are dealt to the
    threads in turn.

    Returns:
        Whether every file was written with ``O_DIRECT``.
    """
    with ThreadPoolExecutor(max_workers=threads) as pool:  # a thread's error is raised
        direct = list(pool.map(lambda n: _write_one(tensors[n::threads],
                                                    directory / f"plain_{n}.bin"),
                               range(threads)))
    return all(direct)


def _write_one(tensors: Sequence[torch.Tensor], path: Path) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        fd, direct = os.open(path, flags, 0o644), False
    buffer = mmap.mmap(-1, BUFFER_BYTES)  # anonymous: page-aligned
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    view = memoryview(buffer)
    try:
        for tensor in tensors:
            source, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            for start in range(0, length, BUFFER_BYTES):
                piece = min(BUFFER_BYTES, length - start)
                ctypes.memmove(address, source + start, piece)
                padded = -(-piece // ALIGNMENT) * ALIGNMENT
                view[piece:padded] = bytes(padded - piece)
                data = view[:padded]
                while data:
                    data = data[os.write(fd, data):]
                del data
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        buffer.close()
    return direct


def tensors_of(megabytes: int) -> list[torch.Tensor]:
    """``megabytes`` of fp32 tensors of 16 MiB (at least one)."""
    return [torch.randn(4 << 20, generator=torch.Generator().manual_seed(n))
            for n in range(max(1, megabytes // 16))]


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` lies on (``/proc/mounts``), or ``"unknown"``."""
    resolved, best, kind = str(path.resolve()), "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and (resolved == fields[1] or resolved.startswith(
                    fields[1].rstrip("/") + "/")) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def measure(megabytes: int, repeats: int, *, workers: int = LOAD_WORKERS,
            stress_ng: str | None = None, directory: str | None = None,
            max_load_s: float = MAX_LOAD_S, stamp: dict[str, Any] | None = None,
            bursts: int = 1) -> dict[str, Any]:
    """The sync save's and the plain writer's throughput, quiet and under load, alternated.

    ``bursts`` times: a quiet phase, then a loaded one beside a load of its own (one
    burst of at most ``max_load_s``). In each phase each side runs ``repeats`` times, the
    first side alternating per repeat; a phase's figures are medians of GB/s (bytes
    written / wall seconds) and a burst's ratios those of its medians (the save's over
    the plain writer's, both under the same load). The top-level figures are the medians
    over the bursts of the bursts' own, each burst's kept in ``bursts`` (with the
    1-minute load average at its start and end).

    Raises:
        LoadEndedEarly: A load's burst ended before the measurement under it did.
    """
    tensors = tensors_of(megabytes)
    total = sum(t.numel() * t.element_size() for t in tensors)
    model = nn.Module()
    for number, tensor in enumerate(tensors):
        model.register_parameter(f"p{number}", nn.Parameter(tensor, requires_grad=False))
    tool, _ = load_command(workers, max_load_s, stress_ng=stress_ng)
    gb = total / 1e9

    def rates(walls: list[float]) -> float:
        return _median([gb / wall for wall in walls])

    measured: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-cpu-load-",
                                     dir=directory) as root_name:
        root = Path(root_name)
        plain_root, saves = root / "plain", root / "saves"
        direct = [True]

        def save() -> float:
            # A new root each time, removed after: the save writes, commits and fsyncs
            # as a trainer's does; removing the previous step (a retention policy's
            # work, slow on a filesystem mounted with discard) is left out of the time,
            # as the plain writer's removal of its previous files is.
            shutil.rmtree(saves, ignore_errors=True)
            manager = CheckpointManager(saves, model=model, retention=None)
            gc.collect()
            start = time.perf_counter()
            manager.save(1)
            wall = time.perf_counter() - start
            manager.close()
            return wall

        save()  # warm-up: the first save's imports and allocations

        def plain() -> float:
            shutil.rmtree(plain_root, ignore_errors=True)
            plain_root.mkdir()
            start = time.perf_counter()
            direct[0] &= plain_odirect_write(tensors, plain_root)
            return time.perf_counter() - start

        def phase() -> tuple[list[float], list[float]]:
            saves: list[float] = []
            plains: list[float] = []
            for repeat in range(repeats):
                for side in ((save, plain) if repeat % 2 == 0 else (plain, save)):
                    (saves if side is save else plains).append(side())
            return saves, plains

        for _ in range(bursts):
            load_before = os.getloadavg()[0]
            quiet_save, quiet_plain = phase()
            started = time.perf_counter()
            with cpu_load(workers, max_load_s, stress_ng=stress_ng) as load:
                time.sleep(0.5)  # the load's processes reach their loops
                loaded_save, loaded_plain = phase()
                if not load.running():
                    raise LoadEndedEarly(
                        f"the load ({tool}, at most {max_load_s:.0f} s) ended before the "
                        f"measurement beside it ({time.perf_counter() - started:.0f} s): "
                        "use fewer --load-mb or repeats")
            measured.append({
                "quiet_save_gb_s": rates(quiet_save), "quiet_plain_gb_s": rates(quiet_plain),
                "loaded_save_gb_s": rates(loaded_save),
                "loaded_plain_gb_s": rates(loaded_plain),
                "quiet_ratio": rates(quiet_save) / rates(quiet_plain),
                "ratio_under_load": rates(loaded_save) / rates(loaded_plain),
                "load_seconds": time.perf_counter() - started,
                "loadavg_1min": [load_before, os.getloadavg()[0]],
                "walls_s": {"quiet_save": quiet_save, "quiet_plain": quiet_plain,
                            "loaded_save": loaded_save, "loaded_plain": loaded_plain}})
        filesystem = filesystem_of(root)

    def over_bursts(key: str) -> float:
        return _median([burst[key] for burst in measured])

    ratios = [burst["ratio_under_load"] for burst in measured]
    return {
        "bytes": total, "repeats": repeats, "load": tool, "load_workers": workers,
        "load_seconds": sum(burst["load_seconds"] for burst in measured),
        "filesystem": filesystem, "odirect": direct[0],
        "writer_threads": WRITER_THREADS,
        **{key: over_bursts(key) for key in (
            "quiet_save_gb_s", "quiet_plain_gb_s", "loaded_save_gb_s", "loaded_plain_gb_s",
            "quiet_ratio", "ratio_under_load")},
        "ratio_under_load_per_burst": ratios,
        "ratio_under_load_min": min(ratios), "ratio_under_load_max": max(ratios),
        "walls_s": {key: [wall for burst in measured for wall in burst["walls_s"][key]]
                    for key in ("quiet_save", "quiet_plain", "loaded_save", "loaded_plain")},
        "bursts": measured,
        "measured": stamp,
    }


def summary(row: dict[str, Any] | None, skipped: str | None = None) -> dict[str, Any]:
    """The contract key ``save_vs_odirect_under_cpu_load`` (null with the reason): the
    median over the bursts of each burst's ratio, the bursts' ratios beside it."""
    if row is None:
        return {"save_vs_odirect_under_cpu_load": None,
                "save_vs_odirect_under_cpu_load_reason": skipped or "not run"}
    if not row["odirect"]:
        return {"save_vs_odirect_under_cpu_load": None,
                "save_vs_odirect_under_cpu_load_reason": (
                    f"the target filesystem ({row['filesystem']}) refused O_DIRECT: the "
                    "plain writer went through the page cache, no O_DIRECT baseline")}
    ratios = row.get("ratio_under_load_per_burst")
    return {"save_vs_odirect_under_cpu_load": row["ratio_under_load"],
            "save_vs_odirect_under_cpu_load_reason": None,
            "save_vs_odirect_quiet": row["quiet_ratio"],
            "save_vs_odirect_under_cpu_load_load": row["load"],
            # the key above is the median over the bursts of each burst's ratio
            "save_vs_odirect_under_cpu_load_per_burst": ratios,
            "save_vs_odirect_under_cpu_load_min": min(ratios) if ratios else None,
            "save_vs_odirect_under_cpu_load_max": max(ratios) if ratios else None}


def which_stress_ng() -> str | None:
    """``stress-ng``'s path, if installed."""
    return shutil.which("stress-ng")
