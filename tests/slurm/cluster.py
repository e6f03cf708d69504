"""A throwaway single-node SLURM cluster for the test suite.

``SlurmCluster.start()`` builds everything under one private temp dir (mode 0700): a munge
key and a foreground ``munged`` on its own socket, a generated ``slurm.conf`` with two
partitions on this host (``extra``: preemptible, requeued; ``own``: high tier, never
preempted), and ``slurmctld -D -i`` plus ``slurmd -D``. It returns once ``sinfo`` reports the
node idle. ``close()`` cancels every job, stops the daemons, kills any process that still
carries this cluster's ``SLURM_CONF`` in its environment (job steps, slurmstepd) and
removes the dir.

Every wait here polls a real condition (a job state, a file, a daemon's socket) against a
deadline and fails with what it last saw; nothing sleeps and hopes.

Facts this relies on (Debian slurm-wlm 22.05, see docs/slurm-test-cluster.md): preemption
with ``PreemptMode=REQUEUE`` sends SIGTERM to every process of the job at once and SIGKILL
``KillWait`` seconds later; the requeued job keeps its id, sees ``SLURM_RESTART_COUNT`` and is
held ~120 s (``BeginTime``) until ``release()``; ``GraceTime`` on the preemptible partition
stopped preemption from happening at all, so it is not set.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DAEMONS",
    "PreemptionCycle",
    "SlurmCluster",
    "SlurmClusterError",
    "SlurmTimeoutError",
    "SlurmUnavailableError",
    "find_binary",
    "parse_scontrol_record",
]

#: Programs the cluster needs; ``find_binary`` also looks in the sbin dirs (root's PATH
#: usually has them, a user's often does not).
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "squeue", "scancel")
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")

#: Job states after which a job will not run again on its own.
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
     "DEADLINE"}
)

# AF_UNIX socket paths are limited to 108 bytes; keep ours well below.
_MAX_SOCKET_PATH = 100
_POLL_S = 0.1


class SlurmClusterError(RuntimeError):
    """The test cluster or a command sent to it failed (message names the job / command)."""


class SlurmUnavailableError(SlurmClusterError):
    """The cluster cannot run here: a program is missing or a daemon did not come up."""


class SlurmTimeoutError(SlurmClusterError, TimeoutError):
    """A wait ran past its deadline; the message says what was awaited and what was seen."""


def find_binary(name: str) -> str | None:
    """Return the absolute path of ``name`` on PATH or in the sbin dirs, or None."""
    found = shutil.which(name)
    if found:
        return found
    for directory in _SBIN_DIRS:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][\w/:.]*)=")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line into ``{key: value}``.

    A value runs until the next `` Key=``, so values with ``=`` inside (``TRES=cpu=2,...``)
    stay whole; keys may contain ``/`` and ``:`` (``CPUs/Task``, ``AllocNode:Sid``).
    """
    line = line.strip()
    matches = list(_KEY_RE.finditer(line))
    record: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        record[match.group(1)] = line[match.end():end].strip()
    return record


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return " | ".join(text.strip().splitlines()[-lines:]) or f"(empty log {path})"


def _node_hardware(slurmd: str) -> dict[str, str]:
    """This host's hardware as slurmd sees it (``slurmd -C``), minus the node name."""
    result = subprocess.run(
        [slurmd, "-C"], capture_output=True, text=True, timeout=60, check=False
    )
    first = result.stdout.splitlines()[0] if result.stdout else ""
    record = parse_scontrol_record(first) if result.returncode == 0 else {}
    wanted = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore",
              "RealMemory")
    if all(key in record for key in wanted):
        return {key: record[key] for key in wanted}
    # Fallback: a flat description slurmd accepts (it may log a topology note).
    meminfo = Path("/proc/meminfo").read_text()
    kib = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))  # type: ignore[union-attr]
    return {"CPUs": str(os.cpu_count() or 1), "RealMemory": str(kib // 1024)}


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    # Daemons die with the test process even if it is SIGKILLed (Linux only, best effort).
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class PreemptionCycle:
    """What one ``preempt_and_requeue`` round saw.

    Attributes:
        job_id: The preempted (and requeued) job; its id never changes.
        preemptor_id: The ``own`` job that took the node.
        restarts: ``Restarts`` of the job once requeued (1 after the first preemption).
        requeue_s: Seconds from submitting the preemptor to seeing the job pending again.
    """

    job_id: int
    preemptor_id: int
    restarts: int
    requeue_s: float


@dataclass
class SlurmCluster:
    """A running single-node cluster; build it with ``SlurmCluster.start()``.

    Attributes:
        root: Private temp dir holding key, socket, conf, state, spool, logs and job files.
        conf_path: The generated ``slurm.conf``.
        node: This host's short name, the one node of the cluster.
        cpus: CPUs of the node; ``preempt()`` asks for all of them by default.
        kill_wait_s: ``KillWait``: seconds between SIGTERM and SIGKILL on preemption, the
            budget for an emergency checkpoint.
        env: Environment for client commands (``SLURM_CONF`` set, the caller's own
            ``SLURM_*`` variables removed); jobs inherit it (sbatch ``--export=ALL``).
        bins: Absolute paths of the SLURM and munge programs, by name.
        extra_conf: Lines appended to the generated ``slurm.conf``.
        timings: Seconds measured by the fixture (``start_s``: until the node was idle).
    """

    root: Path
    conf_path: Path
    node: str
    cpus: int
    kill_wait_s: int
    env: dict[str, str]
    bins: dict[str, str]
    extra_conf: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    _daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _closed: bool = False
    _counter: int = 0

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        *,
        base_dir: Path | None = None,
        kill_wait_s: int = 30,
        startup_timeout_s: float = 60.0,
        extra_conf: Sequence[str] = (),
    ) -> SlurmCluster:
        """Build and start a cluster; return once its node is idle.

        Args:
            base_dir: Where to create the private temp dir (default: the system temp dir,
                or ``/tmp`` if that path is too long for a unix socket).
            kill_wait_s: ``KillWait`` in slurm.conf (SIGTERM to SIGKILL on preemption).
            startup_timeout_s: Deadline for munged's socket and for the node to be idle.
            extra_conf: Further ``slurm.conf`` lines, appended verbatim (e.g.
                ``SchedulerParameters=...``); a later line overrides an earlier one.

        Raises:
            SlurmUnavailableError: A program is missing or a daemon failed to start (the
                message carries the daemon's log tail). Everything started is torn down.
        """
        bins: dict[str, str] = {}
        missing = []
        for name in (*DAEMONS, *CLIENTS):
            path = find_binary(name)
            if path is None:
                missing.append(name)
            else:
                bins[name] = path
        if missing:
            raise SlurmUnavailableError(
                f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
            )
        if os.geteuid() != 0:
            raise SlurmUnavailableError(
                "the test cluster runs its daemons as root (SlurmUser=root); "
                f"euid is {os.geteuid()}"
            )
        parent = base_dir or Path(tempfile.gettempdir())
        if len(str(parent)) > _MAX_SOCKET_PATH - 40:
            parent = Path("/tmp")
        root = Path(tempfile.mkdtemp(prefix="rk-slurm-", dir=parent))
        root.chmod(0o700)
        conf_path = root / "slurm.conf"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(conf_path)
        hardware = _node_hardware(bins["slurmd"])
        cluster = cls(
            root=root,
            conf_path=conf_path,
            node=socket.gethostname().split(".")[0],
            cpus=int(hardware["CPUs"]),
            kill_wait_s=kill_wait_s,
            env=env,
            bins=bins,
            extra_conf=tuple(extra_conf),
        )
        began = time.monotonic()
        try:
            cluster._boot(hardware, startup_timeout_s)
        except BaseException:
            cluster.close()
            raise
        cluster.timings["start_s"] = time.monotonic() - began
        return cluster

    def _boot(self, hardware: Mapping[str, str], timeout_s: float) -> None:
        deadline = self._start_controller(hardware, timeout_s, ("state", "spool", "log", "jobs"))
        self._spawn("slurmd", [self.bins["slurmd"], "-D", "-f", str(self.conf_path)])

        def node_idle() -> bool:
            result = self._run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], check=False)
            states = result.stdout.split()
            return result.returncode == 0 and bool(states) and all(s == "idle" for s in states)

        self._poll(node_idle, deadline, f"sinfo to report node {self.node} idle",
                   watch=DAEMONS)

    def _start_controller(self, hardware: Mapping[str, str], timeout_s: float,
                          subdirs: tuple[str, ...]) -> float:
        """Create ``subdirs``, the munge key and ``slurm.conf``; start munged and slurmctld.

        Returns the deadline of the whole start-up (``timeout_s`` from now).
        """
        for sub in subdirs:
            (self.root / sub).mkdir(mode=0o700)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf_path.write_text(self.render_conf(hardware))
        deadline = time.monotonic() + timeout_s
        munge_socket = self.root / "munge.socket"
        self._spawn(
            "munged",
            [self.bins["munged"], "--foreground", "--force",
             f"--socket={munge_socket}", f"--key-file={key}",
             f"--pid-file={self.root / 'munged.pid'}",
             f"--log-file={self.root / 'log' / 'munged.log'}",
             f"--seed-file={self.root / 'munge.seed'}"],
        )
        self._poll(munge_socket.exists, deadline, "munged to create its socket",
                   watch=("munged",))
        self._spawn("slurmctld", [self.bins["slurmctld"], "-D", "-i", "-f", str(self.conf_path)])
        return deadline

    def render_conf(self, hardware: Mapping[str, str]) -> str:
        """The ``slurm.conf`` text of this cluster (ports are picked free at call time)."""
        r = self.root
        node_hw = " ".join(f"{k}={v}" for k, v in hardware.items())
        lines = [
            "# Generated by tests/slurm/cluster.py: a throwaway single-node test cluster.",
            "ClusterName=rktest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            # Default 3 s: batch jobs (preemptors, released requeued jobs) wait that long
            # for a scheduling pass; 0 makes a preemption round ~1 s instead of ~3 s.
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "ReturnToService=2",
            "MinJobAge=600",
            f"KillWait={self.kill_wait_s}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 {node_hw} State=UNKNOWN",
            f"PartitionName=extra Nodes={self.node} Default=YES MaxTime=INFINITE State=UP"
            " PriorityTier=1 PreemptMode=REQUEUE",
            f"PartitionName=own Nodes={self.node} MaxTime=INFINITE State=UP"
            " PriorityTier=10 PreemptMode=OFF",
            *self.extra_conf,
        ]
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.root / "log" / f"{name}.stdio"
        with log.open("wb") as out:
            self._daemons[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal,  # noqa: PLW1509 - no threads at spawn
            )

    def daemon_log_tail(self, name: str, lines: int = 15) -> str:
        """The last lines of a daemon's log (its own log file, else its stdout/stderr)."""
        own = self.root / "log" / f"{name}.log"
        stdio = self.root / "log" / f"{name}.stdio"
        return _tail(own if own.exists() and own.stat().st_size else stdio, lines)

    def _poll(
        self,
        condition: Callable[[], bool],
        deadline: float,
        what: str,
        watch: Sequence[str] = (),
    ) -> None:
        while True:
            for name in watch:
                proc = self._daemons.get(name)
                if proc is not None and proc.poll() is not None:
                    raise SlurmUnavailableError(
                        f"{name} exited with {proc.returncode} while waiting for {what}: "
                        f"{self.daemon_log_tail(name)}"
                    )
            if condition():
                return
            if time.monotonic() > deadline:
                tails = "; ".join(f"{n}: {self.daemon_log_tail(n, 5)}" for n in watch)
                raise SlurmUnavailableError(f"timed out waiting for {what}; {tails}")
            time.sleep(_POLL_S)

    def close(self) -> None:
        """Cancel every job, kill job processes and daemons, remove the dir. Idempotent.

        ``scancel`` alone is not enough for a fast teardown: even ``--signal=KILL`` cancels
        with SIGTERM first and SIGKILL only after ``KillWait``, and ``slurmd`` does not exit
        on SIGTERM while a job step is still alive. So job processes (slurmstepd and its
        children, recognised by this cluster's ``SLURM_CONF`` in their environment) are
        SIGKILLed directly before the daemons are stopped.
        """
        if self._closed:
            return
        self._closed = True
        ctld = self._daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(SlurmClusterError, subprocess.SubprocessError, OSError):
                ids = self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                if ids:
                    self._run(["scancel", *ids], check=False)
        self._kill_job_processes()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._daemons.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        self._kill_leftovers(spare=set())
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_job_processes(self) -> None:
        """SIGKILL slurmstepd and job processes of this cluster, sparing its daemons."""
        daemon_pids = {proc.pid for proc in self._daemons.values()}
        self._kill_leftovers(spare=daemon_pids)

    def cancel_all(self, timeout: float = 30.0) -> None:
        """Cancel every job now and wait until none is pending, running or completing.

        Job processes are SIGKILLed directly (``scancel`` alone would leave a job that
        handles SIGTERM completing for ``KillWait`` seconds, blocking the node).

        Raises:
            SlurmTimeoutError: Jobs still listed after ``timeout`` seconds.
        """
        ids = [str(i) for i in self.job_ids()]
        if not ids:
            return
        self._run(["scancel", *ids], check=False)
        self._kill_job_processes()
        deadline = time.monotonic() + timeout
        while remaining := self._run(["squeue", "-h", "-o", "%i %T"]).stdout.strip():
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"jobs still listed {timeout:.0f} s after cancelling them: {remaining}"
                )
            time.sleep(_POLL_S)

    def _kill_leftovers(self, spare: set[int]) -> None:
        """SIGKILL this cluster's processes except ``spare`` pids and their direct children."""
        for _ in range(3):
            found = [
                pid for pid in self.processes()
                if pid not in spare and _parent_pid(pid) not in spare
            ]
            if not found:
                return
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ commands

    def _run(
        self,
        argv: list[str],
        *,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        command = [self.bins.get(argv[0], argv[0]), *argv[1:]]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"`{' '.join(argv)}` exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()}"
            )
        return result

    def job_file(self, name: str) -> Path:
        """A path under the cluster's ``jobs/`` dir (scripts and default outputs live there)."""
        return self.root / "jobs" / name

    def submit(
        self,
        script: str | Path,
        *,
        partition: str = "extra",
        cpus: int | None = None,
        requeue: bool = True,
        output: Path | None = None,
        open_mode: str = "append",
        signal_spec: str | None = None,
        job_name: str | None = None,
        workdir: Path | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> int:
        """Submit a batch job with ``sbatch --parsable``; return its id.

        Args:
            script: The batch script's text (``str``), or a ``Path`` to an existing script.
            partition: ``extra`` (preemptible, requeued) or ``own`` (high tier).
            cpus: ``--cpus-per-task`` (default: 1).
            requeue: Pass ``--requeue`` (else ``--no-requeue``).
            output: Job stdout+stderr file (default ``jobs/<name>-%j.out``).
            open_mode: ``--open-mode``; ``append`` keeps every run's output in one file.
            signal_spec: ``--signal`` value, e.g. ``B:USR1@60`` (signal the batch shell 60 s
                before the time limit).
            job_name: ``--job-name``.
            workdir: ``--chdir`` (default: the cluster's ``jobs/`` dir).
            env: Extra environment for the job, on top of ``self.env``.
            extra_args: Further sbatch arguments, verbatim.

        Raises:
            SlurmClusterError: sbatch failed (its stderr is in the message).
        """
        self._counter += 1
        name = job_name or f"job{self._counter}"
        if isinstance(script, Path):
            script_path = script
        else:
            script_path = self.job_file(f"{name}-{self._counter}.sh")
            script_path.write_text(script)
            script_path.chmod(0o700)
        out = output or self.job_file(f"{name}-%j.out")
        argv = [
            "sbatch", "--parsable",
            f"--partition={partition}",
            f"--job-name={name}",
            "--nodes=1", "--ntasks=1",
            f"--cpus-per-task={cpus or 1}",
            f"--output={out}",
            f"--open-mode={open_mode}",
            f"--chdir={workdir or self.root / 'jobs'}",
            "--requeue" if requeue else "--no-requeue",
        ]
        if signal_spec:
            argv.append(f"--signal={signal_spec}")
        argv += [*extra_args, str(script_path)]
        result = self._run(argv, env=env)
        return int(result.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o <id>`` as a dict (``JobState``, ``Restarts``, ``StdOut`` ...).

        Raises:
            SlurmClusterError: scontrol does not know the job.
        """
        result = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        if not lines:
            raise SlurmClusterError(f"scontrol printed nothing for job {job_id}")
        return parse_scontrol_record(lines[0])

    def wait_for(
        self,
        job_id: int,
        predicate: Callable[[dict[str, str]], bool],
        timeout: float,
        what: str = "the condition",
    ) -> dict[str, str]:
        """Poll ``job_state(job_id)`` until ``predicate`` holds; return that state.

        Raises:
            SlurmTimeoutError: Not within ``timeout`` seconds (message: last state seen).
        """
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"job {job_id}: {what} not reached in {timeout:.0f} s; last seen "
                    f"JobState={state.get('JobState')} Reason={state.get('Reason')} "
                    f"Restarts={state.get('Restarts')}; {self._job_context(job_id, state)}"
                )
            time.sleep(_POLL_S)

    def wait_for_state(self, job_id: int, *states: str, timeout: float) -> dict[str, str]:
        """Wait until the job's ``JobState`` is one of ``states``; return its state."""
        return self.wait_for(
            job_id, lambda s: s.get("JobState") in states, timeout, f"JobState in {states}"
        )

    def wait_for_file(
        self, path: Path, timeout: float, job_id: int | None = None
    ) -> Path:
        """Wait until ``path`` exists. With ``job_id``, fail at once if that job ends first.

        Raises:
            SlurmTimeoutError: Not within ``timeout`` seconds.
            SlurmClusterError: The job reached a terminal state without creating the file.
        """
        deadline = time.monotonic() + timeout
        next_check = 0.0
        while not path.exists():
            now = time.monotonic()
            if job_id is not None and now >= next_check:
                next_check = now + 1.0
                state = self.job_state(job_id)
                if state.get("JobState") in TERMINAL_STATES and not path.exists():
                    raise SlurmClusterError(
                        f"job {job_id} ended ({state.get('JobState')}, ExitCode="
                        f"{state.get('ExitCode')}) without creating {path}; "
                        f"{self._job_context(job_id, state)}"
                    )
            if now > deadline:
                context = self._job_context(job_id) if job_id is not None else ""
                raise SlurmTimeoutError(f"{path} did not appear in {timeout:.0f} s; {context}")
            time.sleep(_POLL_S)
        return path

    def output_path(self, job_id: int) -> Path:
        """The job's stdout file (``StdOut`` of ``scontrol show job``)."""
        return Path(self.job_state(job_id)["StdOut"])

    def read_output(self, job_id: int) -> str:
        """The job's output so far (every run's, with ``--open-mode=append``); '' if none."""
        try:
            return self.output_path(job_id).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_output(
        self, job_id: int, pattern: str, timeout: float, min_count: int = 1
    ) -> str:
        """Wait until the job's output matches regex ``pattern`` ``min_count`` times.

        With ``--open-mode=append`` the output holds every run, so ``min_count`` tells the
        n-th run's line from the earlier ones. Returns the output at that moment.

        Raises:
            SlurmTimeoutError: Not within ``timeout`` seconds (message: the output tail).
            SlurmClusterError: The job reached a terminal state first.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            path = Path(state["StdOut"])
            text = path.read_text(errors="replace") if path.exists() else ""
            if len(regex.findall(text)) >= min_count:
                return text
            if state.get("JobState") in TERMINAL_STATES:
                raise SlurmClusterError(
                    f"job {job_id} ended ({state.get('JobState')}) before {pattern!r} appeared "
                    f"{min_count} time(s) in {path}; {self._job_context(job_id, state)}"
                )
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"{pattern!r} not seen {min_count} time(s) in {path} within "
                    f"{timeout:.0f} s; {self._job_context(job_id, state)}"
                )
            time.sleep(_POLL_S)

    def describe(self, job_id: int) -> str:
        """One paragraph for an assertion message: state, output tail, slurmctld/slurmd logs."""
        state = self.job_state(job_id)
        keys = ("JobState", "Reason", "Restarts", "ExitCode", "RunTime", "Partition")
        summary = " ".join(f"{k}={state.get(k)}" for k in keys)
        return (
            f"job {job_id}: {summary}; {self._job_context(job_id, state)}; "
            f"slurmd: {self.daemon_log_tail('slurmd', 5)}"
        )

    def _job_context(self, job_id: int | None, state: Mapping[str, str] | None = None) -> str:
        if job_id is None:
            return ""
        path = Path(state["StdOut"]) if state and state.get("StdOut") else None
        out = _tail(path, 8) if path else "(no StdOut known)"
        return f"output tail: {out}; slurmctld: {self.daemon_log_tail('slurmctld', 5)}"

    def release(self, job_id: int) -> None:
        """Let a requeued job (held ~120 s by ``BeginTime``) start now.

        slurmd refuses to launch a job whose credential was created in the same second as
        (or before) the moment its previous run was killed: the new run fails at once with
        "Killing non-startable batch JobId=N: Job credential revoked" (ExitCode 1:0). The
        ~120 s hold is what normally prevents that. A requeue resets ``SubmitTime`` to the
        requeue instant, which is at or after the kill, so the release waits until the
        clock has passed that second (at most ~1 s) before ``StartTime=now``.
        """
        submitted = self.job_state(job_id).get("SubmitTime", "")
        with contextlib.suppress(ValueError):
            stamp = time.mktime(time.strptime(submitted, "%Y-%m-%dT%H:%M:%S"))
            while (remaining := stamp + 1.0 - time.time()) > 0:
                time.sleep(remaining)
        self._run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def cancel(self, job_id: int, signal_name: str | None = None) -> None:
        """``scancel`` a job, or send it ``signal_name`` (e.g. ``USR1``) with ``--full``."""
        argv = ["scancel"]
        if signal_name:
            argv += ["--full", f"--signal={signal_name}"]
        self._run([*argv, str(job_id)])

    def preempt(self, cpus: int | None = None, command: str = "true") -> int:
        """Submit an ``own`` (high tier) job needing ``cpus`` (default: all); return its id.

        Running ``extra`` jobs in its way are preempted: SIGTERM to all their processes,
        SIGKILL after ``kill_wait_s``, then requeued (held until ``release``).
        """
        return self.submit(
            f"#!/bin/sh\n{command}\n",
            partition="own",
            cpus=cpus or self.cpus,
            requeue=False,
            job_name="preemptor",
        )

    def preempt_and_requeue(
        self,
        job_id: int,
        *,
        when_file: Path | None = None,
        cpus: int | None = None,
        timeout: float = 60.0,
        release: bool = True,
    ) -> PreemptionCycle:
        """One full preemption round of a running ``extra`` job.

        Waits for ``when_file`` (if given; fails early if the job ends first), preempts the
        job, waits until it is pending again with ``Restarts`` one higher, and (if
        ``release``) releases it so it restarts as soon as the preemptor is done.

        Raises:
            SlurmTimeoutError: A step did not happen within ``timeout`` seconds.
        """
        if when_file is not None:
            self.wait_for_file(when_file, timeout, job_id=job_id)
        before = int(self.job_state(job_id).get("Restarts", "0"))
        began = time.monotonic()
        preemptor = self.preempt(cpus=cpus)
        state = self.wait_for(
            job_id,
            lambda s: int(s.get("Restarts", "0")) > before and s.get("JobState") == "PENDING",
            timeout,
            f"requeued (Restarts > {before}, PENDING) after preemptor {preemptor}",
        )
        requeue_s = time.monotonic() - began
        if release:
            self.release(job_id)
        return PreemptionCycle(job_id, preemptor, int(state["Restarts"]), requeue_s)

    def job_ids(self) -> list[int]:
        """Ids of every job squeue still lists (pending, running, completing)."""
        return [int(i) for i in self._run(["squeue", "-h", "-o", "%i"]).stdout.split()]

    def processes(self) -> Iterator[int]:
        """Pids of processes started by this cluster (daemons, slurmstepd, jobs).

        They are recognised by ``SLURM_CONF=<this cluster's conf>`` in their environment:
        slurmd passes it to slurmstepd, sbatch exports it into every job.
        """
        marker = f"SLURM_CONF={self.conf_path}".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        yield int(entry.name)
