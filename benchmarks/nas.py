"""The NAS stand-in: a filesystem whose every reader and writer shares one bounded bandwidth.

A file-backed loop device formatted ext4 and mounted under the bench
directory, with a block-I/O throttle on the loop device's ``MAJ:MIN``:

* **cgroup v1** (``blkio`` mounted, as on this machine): ``blkio.throttle.read_bps_device``
  and ``write_bps_device`` of the *root* blkio cgroup. Every process of the machine is
  in it, and so is the kernel's writeback (cgroup v1 does not attribute page-cache
  writeback to the writer's cgroup), so buffered and ``O_DIRECT`` reads and writes, from
  the trainer, its writer threads or processes and the flusher alike, share the bound.
  The rule names only the loop device: nothing else on the machine is slowed.
* **cgroup v2** (the ``io`` controller available in the unified hierarchy): ``io.max``
  ``rbps``/``wbps`` in a child cgroup the bench process (and so every process it starts)
  moves into; cgroup v2 charges buffered writeback to the writer's cgroup.

:func:`missing` says why neither works (not root, no loop devices, no throttle). The
bound is checked with ``dd`` before use (:meth:`NasStandIn.verify`: direct write,
buffered write + fsync, cold buffered read, direct read) and reported. Everything is undone
on exit (throttle rule removed, unmounted, loop device detached, backing file deleted,
cgroup removed), also on Ctrl-C and SIGTERM (:meth:`NasStandIn.__enter__` turns SIGTERM
into an exception while the stand-in is up).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.timing import evict

BLKIO_V1 = Path("/sys/fs/cgroup/blkio")
UNIFIED_CANDIDATES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount", "dd", "lsblk")
MB = 1_000_000
# How long freed memory sits before the cold-memory write (the balloon reports free
# pages to the host about every 2 s).
COLD_MEMORY_S = 3.0


class StandInError(RuntimeError):
    """The stand-in could not be set up (the message says which step failed)."""


def _v2_root() -> Path | None:
    """The cgroup v2 mount whose controllers include ``io``, if any."""
    for root in UNIFIED_CANDIDATES:
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "io" in controllers.read_text().split():
            return root
    return None


def throttle_kind() -> str | None:
    """``"v1"`` or ``"v2"``: which cgroup I/O throttle this machine offers, or None."""
    if (BLKIO_V1 / "blkio.throttle.write_bps_device").exists():
        return "v1"
    if _v2_root() is not None:
        return "v2"
    return None


def missing() -> str | None:
    """Why the stand-in cannot run here, or None."""
    if os.geteuid() != 0:
        return "the NAS stand-in needs root (a loop device, a mount, a cgroup I/O throttle)"
    absent = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the NAS stand-in needs {', '.join(absent)} (util-linux, e2fsprogs, coreutils)"
    if not Path("/dev/loop-control").exists():
        return "the NAS stand-in needs loop devices (/dev/loop-control is absent)"
    if throttle_kind() is None:
        return ("the NAS stand-in needs a cgroup I/O throttle: neither cgroup v1 blkio "
                "(blkio.throttle.*) nor a cgroup v2 hierarchy with the io controller")
    return None


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StandInError(f"{' '.join(command)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-400:]}")
    return done.stdout


def _prewrite(path: Path, size_bytes: int) -> None:
    """Write ``size_bytes`` of zeros to ``path`` with ``O_DIRECT`` (whole 16 MiB blocks)."""
    block = 16 << 20
    _run("dd", "if=/dev/zero", f"of={path}", f"bs={block}",
         f"count={max(1, -(-size_bytes // block))}", "oflag=direct", "status=none")


def _dd_rate(output: str) -> float:
    """Bytes per second from dd's last line (``N bytes ... copied, S s, ...``)."""
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", output)
    if match is None:
        raise StandInError(f"cannot read dd's report: {output.strip()[-200:]}")
    return int(match.group(1)) / float(match.group(2))


class NasStandIn:
    """A bounded-bandwidth filesystem at ``mount`` (a context manager; see the module).

    Args:
        work: Directory for the backing file and the mount point.
        size_bytes: Size of the filesystem.
        bandwidth: Bytes per second, for reads and for writes, shared by every process.

    Attributes:
        mount: Where the filesystem is mounted (valid inside the ``with`` block).
        device: The loop device; ``majmin`` its ``MAJ:MIN``.
        kind: ``"v1"`` or ``"v2"`` (the throttle used).
        measured: What :meth:`verify` measured (bytes per second per access kind).
        host_reference: What :meth:`verify` measured outside the stand-in.
    """

    def __init__(self, work: Path, size_bytes: int, bandwidth: float) -> None:
        self.work = work
        self.size_bytes = size_bytes
        self.bandwidth = bandwidth
        self.mount = work / "nas"
        self.backing = work / "nas.img"
        self.device: str | None = None
        self.majmin: str | None = None
        self.kind: str | None = None
        self.measured: dict[str, float] = {}
        self.host_reference: dict[str, float] = {}
        self._mounted = False
        self._cgroup: Path | None = None
        self._previous_cgroup: Path | None = None
        self._previous_sigterm: Any = None

    # -- set up and tear down ---------------------------------------------------------
    def __enter__(self) -> NasStandIn:
        why = missing()
        if why is not None:
            raise StandInError(why)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}: tearing the NAS stand-in down")

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _set_up(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        # The backing file is written out in full first (zeros, O_DIRECT: seconds for
        # gigabytes here), so that no block of it is ever allocated or converted from an
        # unwritten extent during a run, and the loop device reads and writes it with
        # direct I/O: one copy of the data in the page cache (the stand-in filesystem's),
        # not a second one of the backing file that would outlive the benchmark's evictions
        # and take memory from the trainers. (fallocate + direct I/O made a first write
        # into each block several times slower than the bound.)
        _prewrite(self.backing, self.size_bytes)
        self.device = _run("losetup", "--find", "--show", "--direct-io=on",
                           str(self.backing)).strip()
        self.majmin = _run("lsblk", "-ndo", "MAJ:MIN", self.device).strip()
        _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
             self.device)
        self.mount.mkdir(parents=True, exist_ok=True)
        _run("mount", "-o", "noatime", self.device, str(self.mount))
        self._mounted = True
        # Writeback throttling (wbt) shrinks the writeback queue when completions are slow,
        # which the bandwidth bound makes them: it would hold buffered writes far below
        # the bound. Off on the loop device only (the device goes away on close).
        wbt = Path("/sys/block") / Path(self.device).name / "queue" / "wbt_lat_usec"
        if wbt.exists():
            wbt.write_text("0")
        self.kind = throttle_kind()
        if self.kind == "v1":
            self._write_v1(int(self.bandwidth))
        else:
            self._enter_v2(int(self.bandwidth))

    def _write_v1(self, bandwidth: int) -> None:
        for name in ("read", "write"):
            (BLKIO_V1 / f"blkio.throttle.{name}_bps_device").write_text(
                f"{self.majmin} {bandwidth}\n")

    def _enter_v2(self, bandwidth: int) -> None:
        root = _v2_root()
        assert root is not None
        mine = Path(Path("/proc/self/cgroup").read_text().split("0::", 1)[1].split()[0])
        self._previous_cgroup = root / mine.relative_to("/")
        with contextlib.suppress(OSError):
            (root / "cgroup.subtree_control").write_text("+io")
        self._cgroup = root / f"resumekit-nas-{os.getpid()}"
        self._cgroup.mkdir()
        (self._cgroup / "io.max").write_text(f"{self.majmin} rbps={bandwidth} "
                                             f"wbps={bandwidth}\n")
        (self._cgroup / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """Undo every step that was done (idempotent); errors are collected, then raised."""
        problems: list[str] = []

        def attempt(what: str, action: Any) -> None:
            try:
                action()
            except (OSError, StandInError) as error:
                problems.append(f"{what}: {error}")

        if self.kind == "v1" and self.majmin is not None:
            attempt("throttle rule", lambda: self._write_v1(0))
        if self._cgroup is not None:
            cgroup, self._cgroup = self._cgroup, None
            if self._previous_cgroup is not None:
                previous = self._previous_cgroup
                attempt("leave cgroup",
                        lambda: (previous / "cgroup.procs").write_text(str(os.getpid())))
            attempt("cgroup rmdir", cgroup.rmdir)
        if self._mounted:
            self._mounted = False
            attempt("umount", lambda: _run("umount", str(self.mount)))
        if self.device is not None:
            device, self.device = self.device, None
            attempt("losetup -d", lambda: _run("losetup", "-d", device))
        attempt("backing file", lambda: self.backing.unlink(missing_ok=True))
        with contextlib.suppress(OSError):
            self.mount.rmdir()
        self.kind = None if self.majmin is None else self.kind
        self.majmin = None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if problems:
            raise StandInError("tearing the NAS stand-in down: " + "; ".join(problems))

    # -- checks -----------------------------------------------------------------------
    def verify(self, probe_bytes: int) -> dict[str, float]:
        """Measure the bound with ``dd`` in 4 MiB blocks: every access kind, in bytes/s.

        ``direct_write`` (``oflag=direct``), ``buffered_write`` (through the page cache,
        ``conv=fsync``: the writeback is throttled too), ``buffered_read`` (after the
        file's pages are evicted) and ``direct_read`` (``iflag=direct``).

        ``buffered_write`` is taken with page-cache memory the kernel has just freed.
        ``buffered_write_cold_memory`` is the same write into memory left free for a few
        seconds first: on a VM whose balloon reports free pages to the host (as here),
        the host takes such memory back, and the guest's first touch of each page faults
        in the host, which caps a buffered write below any bound, on every filesystem.
        :attr:`host_reference` holds that write on the bench directory's own filesystem
        (no stand-in, no throttle) to tell the two apart.
        """
        count = max(1, probe_bytes // (4 << 20))
        target = self.mount / "dd-probe"
        host = self.work / "dd-probe-host"
        write = ("dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}")
        read = ("dd", f"if={target}", "of=/dev/null", "bs=4M")
        try:
            self.host_reference = {"buffered_write_cold_memory": _dd(
                "dd", "if=/dev/zero", f"of={host}", "bs=4M", f"count={count}", "conv=fsync")}
            host.unlink()
            self.measured["direct_write"] = _dd(*write, "oflag=direct")
            target.unlink()
            time.sleep(COLD_MEMORY_S)  # the freed page cache goes back to the host
            self.measured["buffered_write_cold_memory"] = _dd(*write, "conv=fsync")
            target.unlink()  # its page cache is freed; the next write takes it again
            self.measured["buffered_write"] = _dd(*write, "conv=fsync")
            evict(target)
            self.measured["buffered_read"] = _dd(*read)
            self.measured["direct_read"] = _dd(*read, "iflag=direct")
        finally:
            target.unlink(missing_ok=True)
            host.unlink(missing_ok=True)
        return dict(self.measured)


def _dd(*command: str) -> float:
    """Run dd; its bytes per second (dd reports on stderr)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StandInError(f"{' '.join(command)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-400:]}")
    return _dd_rate(done.stderr)


__all__ = ["MB", "NasStandIn", "StandInError", "missing", "throttle_kind"]
