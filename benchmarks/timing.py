"""Interleaved rounds, paired ratios, durability and page-cache helpers, machine facts."""

from __future__ import annotations

import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

#: A measured method: does its work and returns the seconds that count (setup and cleanup
#: it does outside its own clock).
Method = Callable[[], float]


def interleave(methods: Mapping[str, Method], rounds: int,
               progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run every method once per round, interleaved, and collect their seconds.

    Round ``r`` runs the methods in the given order when ``r`` is even and in reverse order
    when it is odd (A B C, C B A, A B C, ...), so neither drift of the machine nor the
    position inside a round favours one method. A full garbage collection runs before
    each sample, outside its time: otherwise the collector, triggered by the allocations
    of whichever method ran before (DCP's saves of 10k tensors leave ~10^5 objects),
    pauses whichever runs next — 0.2-0.3 s at random inside a 0.13 s save.

    Returns:
        ``{name: [seconds of round 0, round 1, ...]}``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            gc.collect()
            seconds = methods[name]()
            samples[name].append(seconds)
            if progress is not None:
                progress(f"round {index + 1}/{rounds} {name}: {seconds:.3f} s")
    return samples


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-round ratios ``numerator[r] / denominator[r]`` of two interleaved series."""
    if len(numerator) != len(denominator):
        raise ValueError("series of different lengths cannot be paired")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (which must not be empty)."""
    return float(statistics.median(values))


def clock(action: Callable[[], Any]) -> float:
    """Seconds ``action()`` takes (monotonic, high resolution)."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def files_under(path: str | os.PathLike[str]) -> list[Path]:
    """Every regular file below ``path`` (or ``path`` itself when it is a file)."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file below ``path`` and every directory holding one, and ``path``."""
    directories = set()
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        directories.add(file.parent)
    root = Path(path)
    directories.add(root if root.is_dir() else root.parent)
    for directory in directories:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: str | os.PathLike[str]) -> None:
    """Drop the page-cache pages of every file below ``path`` (they must be clean).

    ``posix_fadvise(DONTNEED)`` on our own files only: a cold read of them without root,
    and without emptying the cache of everything else running on the machine.
    """
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: str | os.PathLike[str]) -> float | None:
    """Fraction of the bytes below ``path`` in the page cache (``fincore``), if known."""
    files = files_under(path)
    if not files or shutil.which("fincore") is None:
        return None
    result = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
         *map(str, files)],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        return None
    resident = total = 0
    for line in result.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2:
            resident += int(fields[0])
            total += int(fields[1])
    return resident / total if total else None


class FreshDirs:
    """Directories under ``work`` with a new name each time (``<prefix><name>-<n>``)."""

    def __init__(self, work: Path, prefix: str = "") -> None:
        self.work, self.prefix, self.count = work, prefix, 0

    def path(self, name: str) -> Path:
        """The next unused path for ``name``."""
        self.count += 1
        return self.work / f"{self.prefix}{name}-{self.count}"

    def timed_write(self, name: str, write: Callable[[Path], None]) -> Callable[[], float]:
        """A timed method: ``write`` into a fresh directory, which is removed afterwards."""
        def method() -> float:
            target = self.path(name)
            try:
                return clock(lambda: write(target))
            finally:
                remove(target)
        return method


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file or directory tree if it exists."""
    target = Path(path)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    try:
        import psutil  # noqa: PLC0415 - optional (bench extra)
    except ImportError:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.Process().memory_info().rss)


def filesystem_of(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mount point, device and filesystem type holding ``path`` (from /proc/mounts)."""
    target = os.path.realpath(path)
    best: dict[str, Any] = {"mount": None, "device": None, "type": None}
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split()[:4] for line in handle]
    except OSError:
        return best
    length = -1
    for device, mount, fstype, options in mounts:
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > length:
            length = len(mount)
            best = {"mount": mount, "device": device, "type": fstype, "options": options}
    usage = shutil.disk_usage(target)
    best["free_bytes"] = usage.free
    best["total_bytes"] = usage.total
    return best


def machine_facts(bench_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Cores, memory, versions, load and the filesystem of ``bench_dir``."""
    facts: dict[str, Any] = {
        "logical_cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()),
        "bench_dir": os.fspath(bench_dir),
        "bench_filesystem": filesystem_of(bench_dir),
    }
    try:
        import psutil  # noqa: PLC0415 - optional (bench extra)

        facts["physical_cores"] = psutil.cpu_count(logical=False)
        facts["ram_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:
        facts["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = {}
    for name in ("accelerate", "lightning", "xxhash", "numpy"):
        try:
            module = __import__(name)
            versions[name] = str(getattr(module, "__version__", getattr(module, "VERSION", "?")))
        except ImportError:
            versions[name] = None
    facts["versions"] = versions
    return facts


class PeakRss:
    """The highest resident set size of this process while the ``with`` block ran.

    Linux lets a process reset its high-water mark (``/proc/self/clear_refs`` ``5``) and
    read it back (``VmHWM``): exact, free. Where that is refused, a thread samples
    ``/proc/self/statm`` every millisecond (a peak shorter than that can be missed).

    Attributes:
        before: RSS when the block began (bytes).
        peak: The highest RSS during the block (bytes).
        exact: Whether the kernel's high-water mark was used.
    """

    def __init__(self) -> None:
        self.before = 0
        self.peak = 0
        self.exact = False
        self._stop: Any = None
        self._thread: Any = None

    @property
    def extra(self) -> int:
        """Bytes above the RSS the block began with."""
        return max(0, self.peak - self.before)

    def __enter__(self) -> PeakRss:
        self.before = _statm_rss()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.exact = _high_water_mark() is not None
        except OSError:
            self.exact = False
        if not self.exact:
            import threading  # noqa: PLC0415 - only for the fallback

            self._stop = threading.Event()
            self.peak = self.before

            def sample() -> None:
                while not self._stop.wait(0.001):
                    self.peak = max(self.peak, _statm_rss())

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.exact:
            self.peak = max(int(_high_water_mark() or 0), _statm_rss())
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _statm_rss())


def _statm_rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water_mark() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
