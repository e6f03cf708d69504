"""A throwaway multi-host SLURM cluster: one network namespace per host, real daemons.

``NamespaceCluster.start(hosts=("host1", "host2"))`` builds a :class:`HostNetwork` (bridge +
one namespace per host, see ``tests/multinode/netns.py``) and, under one private temp dir:

* one ``munged`` in the root namespace; its socket is a filesystem path, so the daemons and
  job processes of every host reach it;
* ``slurmctld`` in the root namespace, ``SlurmctldHost=<this host>(<bridge address>)``, so
  every host's slurmd and srun reach it over the bridge;
* per host ``slurmd -D -N hostN`` started inside that host's namespace under its own
  hostname (UTS namespace), ``NodeAddr`` = its veth address, its own spool
  (``SlurmdSpoolDir=<dir>/spool/%n``), pid and log files (``%n``);
* per host a private scratch dir ``<dir>/scratch/hostN`` (node-local disk), bind-mounted
  in the host's own mount namespace over ``<dir>/node-local`` (:attr:`node_local`): one
  path, the same on every host, each host seeing only its own files there (what
  ``$SLURM_TMPDIR`` or a local NVMe mount is on a real cluster). Seen from the test (root
  namespace), ``<dir>/node-local`` is empty and ``scratch(host)`` holds host's files. The
  checkpoint root the tests use lives elsewhere on the shared filesystem (the "NAS");
* optional *spare* hosts (``spares=``): in the cluster like the others, with a higher
  ``Weight`` so that SLURM gives them to a job only when a regular host is missing - the
  fresh host a job lands on when one of its hosts is lost (:meth:`lose_host`).

Partitions as in the single-node cluster: ``extra`` (preemptible, requeued) and ``own``
(high tier), both over every host. ``SlurmdTimeout`` is short (``slurmd_timeout_s``) so a
dead or partitioned host is marked DOWN, and its job ``NODE_FAIL``-requeued, within the
test's time; ``ReturnToService=2`` lets a host that comes back rejoin on its own.

``close()`` kills every process in the namespaces (slurmd, slurmstepd, job processes),
stops slurmctld and munged, removes the network and the dir.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.multinode.netns import HostNetwork, NetworkUnavailableError
from tests.slurm.cluster import (
    CLIENTS,
    DAEMONS,
    SlurmCluster,
    SlurmClusterError,
    SlurmTimeoutError,
    SlurmUnavailableError,
    _free_port,
    _node_hardware,
    _tail,
    find_binary,
    parse_scontrol_record,
)

__all__ = ["NamespaceCluster"]

_POLL_S = 0.1


@dataclass
class NamespaceCluster(SlurmCluster):
    """A running multi-host cluster; build it with ``NamespaceCluster.start()``.

    Attributes (beyond :class:`SlurmCluster`'s):
        network: The namespaces and bridge the hosts live in.
        hosts: Host (node) names, in order (the spares last).
        spares: The hosts SLURM allocates only when a regular one is unavailable.
        slurmd_timeout_s: ``SlurmdTimeout``: silence after which a host is marked DOWN.
    """

    network: HostNetwork | None = None
    hosts: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    slurmd_timeout_s: int = 20
    hardware: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start_hosts(
        cls,
        hosts: Sequence[str] = ("host1", "host2"),
        *,
        spares: Sequence[str] = (),
        kill_wait_s: int = 30,
        slurmd_timeout_s: int = 20,
        startup_timeout_s: float = 90.0,
    ) -> NamespaceCluster:
        """Build the network and the daemons; return once every host is idle.

        Raises:
            SlurmUnavailableError: A program is missing, the network cannot be built or a
                daemon did not come up (message: the cause, with the daemon's log tail).
                Everything started is torn down.
        """
        bins: dict[str, str] = {}
        missing = [name for name in (*DAEMONS, *CLIENTS) if find_binary(name) is None]
        if missing:
            raise SlurmUnavailableError(
                f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
            )
        bins = {name: str(find_binary(name)) for name in (*DAEMONS, *CLIENTS)}
        if os.geteuid() != 0:
            raise SlurmUnavailableError(
                f"the namespace cluster needs root (netns, SlurmUser=root); euid {os.geteuid()}"
            )
        hosts = (*hosts, *spares)
        try:
            network = HostNetwork.create(hosts)
        except NetworkUnavailableError as error:
            raise SlurmUnavailableError(f"host network: {error}") from error
        root = Path(tempfile.mkdtemp(prefix="rk-mn-", dir="/tmp"))
        root.chmod(0o700)
        conf_path = root / "slurm.conf"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(conf_path)
        hardware = _node_hardware(bins["slurmd"])
        cluster = cls(
            root=root, conf_path=conf_path, node=hosts[0], cpus=int(hardware["CPUs"]),
            kill_wait_s=kill_wait_s, env=env, bins=bins, network=network,
            hosts=tuple(hosts), spares=tuple(spares), slurmd_timeout_s=slurmd_timeout_s,
            hardware=dict(hardware),
        )
        began = time.monotonic()
        try:
            cluster._boot(hardware, startup_timeout_s)
        except BaseException:
            cluster.close()
            raise
        cluster.timings["start_s"] = time.monotonic() - began
        cluster.timings["network_s"] = network.timings.get("create_s", 0.0)
        return cluster

    def _boot(self, hardware: Mapping[str, str], timeout_s: float) -> None:
        deadline = self._start_controller(
            hardware, timeout_s,
            ("state", "spool", "log", "jobs", "run", "scratch", "node-local"))
        for host in self.hosts:  # node-local disk and a spool of its own per host
            (self.root / "scratch" / host).mkdir()
            (self.root / "spool" / host).mkdir()
        for host in self.hosts:
            self.start_slurmd(host)
        self._poll(self.all_idle, deadline, f"sinfo to report {', '.join(self.hosts)} idle",
                   watch=("slurmctld", *(f"slurmd-{h}" for h in self.hosts)))

    def start_slurmd(self, host: str) -> None:
        """Start ``slurmd -D -N host`` inside ``host``'s namespace, under its hostname, with
        its scratch dir mounted over :attr:`node_local` (every job process inherits it)."""
        assert self.network is not None
        argv = self.network.command(host, [self.bins["slurmd"], "-D", "-N", host,
                                           "-f", str(self.conf_path)],
                                    binds=[(self.scratch(host), self.node_local)])
        self._spawn(f"slurmd-{host}", argv)

    def node_states(self) -> dict[str, str]:
        """``{host: state}`` as ``sinfo -N`` reports it (``idle``, ``alloc``, ``down*`` ...)."""
        result = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states: dict[str, str] = {}
        for line in result.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def all_idle(self) -> bool:
        """Whether every host is idle."""
        states = self.node_states()
        return all(states.get(host) == "idle" for host in self.hosts)

    def wait_for_nodes(self, state: str, hosts: Sequence[str], timeout: float) -> None:
        """Wait until each of ``hosts`` is in ``state`` (``sinfo %T``, e.g. ``idle``)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(h, "").rstrip("*~#") == state for h in hosts):
                return
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"hosts {list(hosts)} not {state} within {timeout:.0f} s: {states}; "
                    f"slurmctld: {self.daemon_log_tail('slurmctld', 5)}"
                )
            time.sleep(_POLL_S)

    def render_conf(self, hardware: Mapping[str, str]) -> str:
        """The ``slurm.conf`` of the namespace cluster."""
        assert self.network is not None
        r = self.root
        node_hw = " ".join(f"{k}={v}" for k, v in hardware.items())
        nodes = ",".join(self.hosts)
        lines = [
            "# Generated by tests/multinode/cluster.py: a throwaway multi-host test cluster.",
            "ClusterName=rkmulti",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}"
            f"({self.network.controller_address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "ReturnToService=2",
            "MinJobAge=600",
            f"KillWait={self.kill_wait_s}",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "MessageTimeout=10",
            # Lowest Weight first: a spare is allocated only when a regular host is not.
            *(f"NodeName={host} NodeAddr={self.network.addresses[host]} "
              f"NodeHostname={host} {node_hw} Weight={100 if host in self.spares else 1} "
              "State=UNKNOWN" for host in self.hosts),
            f"PartitionName=extra Nodes={nodes} Default=YES MaxTime=INFINITE State=UP"
            " PriorityTier=1 PreemptMode=REQUEUE",
            f"PartitionName=own Nodes={nodes} MaxTime=INFINITE State=UP"
            " PriorityTier=10 PreemptMode=OFF",
        ]
        return "\n".join(lines) + "\n"

    def daemon_log_tail(self, name: str, lines: int = 15) -> str:
        """A daemon's log tail; ``slurmd`` means every host's slurmd."""
        if name == "slurmd":
            return " || ".join(
                f"{host}: {_tail(self.root / 'log' / f'slurmd-{host}.log', lines)}"
                for host in self.hosts
            )
        if name.startswith("slurmd-"):
            return _tail(self.root / "log" / f"{name}.log", lines)
        return super().daemon_log_tail(name, lines)

    def close(self) -> None:
        """Kill every host's processes, stop the daemons, remove network and dir."""
        if self._closed:
            return
        ctld = self._daemons.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(SlurmClusterError, subprocess.SubprocessError, OSError):
                ids = self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                if ids:
                    self._run(["scancel", *ids], check=False)
        keep = os.environ.get("RK_MULTINODE_KEEP_LOGS")
        if keep:  # debugging aid: the daemons' logs survive the teardown
            import shutil  # noqa: PLC0415

            shutil.copytree(self.root / "log", keep, dirs_exist_ok=True)
        if self.network is not None:
            self.network.close()  # slurmd, slurmstepd and job processes of every host
        super().close()

    # ------------------------------------------------------------------ hosts

    def scratch(self, host: str) -> Path:
        """``host``'s private scratch dir (node-local disk), as the test sees it."""
        return self.root / "scratch" / host

    @property
    def node_local(self) -> Path:
        """The node-local path: the same on every host, each host's own scratch there."""
        return self.root / "node-local"

    def lose_host(self, host: str) -> list[int]:
        """Lose ``host`` for good: SIGKILL every process of it and remove its node-local
        storage (a new, empty scratch dir replaces it, as on a reimaged node).

        SLURM marks it DOWN after ``SlurmdTimeout`` and requeues its job (``NODE_FAIL``); a
        spare host takes its place in the next allocation. :meth:`start_slurmd` (the
        fixture's heal) brings it back afterwards, empty.

        Returns:
            The pids killed.
        """
        import shutil  # noqa: PLC0415

        killed = self.kill_host(host)
        shutil.rmtree(self.scratch(host))
        self.scratch(host).mkdir()
        return killed

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host`` (slurmd, slurmstepd, torchrun, ranks)."""
        assert self.network is not None
        self._daemons.pop(f"slurmd-{host}", None)
        return self.network.kill_host(host)

    def revive_host(self, host: str, timeout: float = 90.0) -> None:
        """Start ``host``'s slurmd again (after ``kill_host``); return once it is idle and
        the controller has nothing left to deliver (:meth:`wait_agents_idle`).

        When a node fails, slurmctld sends ``REQUEST_TERMINATE_JOB`` for its job to it
        anyway, from an agent thread that keeps reconnecting for up to ``MessageTimeout``.
        If the revived slurmd gets that message only after the requeued job (same job id)
        was started again, its reply counts as the *new* run's epilog on the node: the node
        turns ``idle`` while still allocated to the job, leaves the job's usable nodes, and
        the new run's ``srun`` waits for it forever ("Requested nodes are busy", retried
        every ~2 min). Waiting here until no agent is left makes the old run's terminate
        land while the job is still pending, where it is harmless.
        """
        self.start_slurmd(host)
        self.wait_for_nodes("idle", [host], timeout)
        self.wait_agents_idle(timeout)

    def heal_host(self, host: str, timeout: float = 90.0) -> None:
        """Bring ``host``'s link up (after a partition); return once slurmctld hears from it
        again (``idle``, no ``*``: a node still flagged not-responding makes the next run's
        first ``srun`` wait ~2 min, "Requested nodes are busy") and no agent is left."""
        assert self.network is not None
        self.network.set_link(host, up=True)
        deadline = time.monotonic() + timeout
        while (state := self.node_states().get(host, "")) != "idle":
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"{host} is {state!r}, not idle and responding, {timeout:.0f} s after its "
                    f"link came back; slurmctld: {self.daemon_log_tail('slurmctld', 5)}"
                )
            time.sleep(_POLL_S)
        self.wait_agents_idle(max(deadline - time.monotonic(), 1.0))

    def agents(self) -> dict[str, int]:
        """slurmctld's RPC agents (``sdiag``): ``queue`` (waiting or to retry), ``count``."""
        out = self._run(["sdiag"], check=False).stdout
        found: dict[str, int] = {}
        for line in out.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in {"Agent queue size", "Agent count"} and value.strip().isdigit():
                found["queue" if "queue" in key else "count"] = int(value)
        return found

    def wait_agents_idle(self, timeout: float = 90.0) -> None:
        """Wait until slurmctld has no RPC agent running or queued (``sdiag``)."""
        deadline = time.monotonic() + timeout
        while True:
            agents = self.agents()
            if agents.get("queue") == 0 and agents.get("count") == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"slurmctld still has RPC agents {agents} {timeout:.0f} s on "
                    f"(sdiag); slurmctld: {self.daemon_log_tail('slurmctld', 5)}"
                )
            time.sleep(_POLL_S)

    def allocated_cpus(self) -> dict[str, int]:
        """``{host: CPUAlloc}`` as slurmctld reports it (``scontrol show node``)."""
        out = self._run(["scontrol", "show", "node", "-o"], check=False).stdout
        cpus: dict[str, int] = {}
        for line in out.splitlines():
            record = parse_scontrol_record(line)
            if record.get("NodeName") and record.get("CPUAlloc", "").isdigit():
                cpus[record["NodeName"]] = int(record["CPUAlloc"])
        return cpus

    def set_node(self, host: str, state: str, reason: str = "test") -> None:
        """``scontrol update NodeName=host State=state`` (``DRAIN``, ``RESUME`` ...)."""
        argv = ["scontrol", "update", f"NodeName={host}", f"State={state}"]
        if state.upper() in {"DRAIN", "DOWN"}:
            argv.append(f"Reason={reason}")
        self._run(argv)

    # ------------------------------------------------------------------ jobs

    def submit_nodes(
        self,
        script: Path,
        *,
        nodes: str,
        output: Path,
        env: Mapping[str, str],
        partition: str = "extra",
        job_name: str = "job",
        extra_args: Sequence[str] = (),
    ) -> int:
        """Submit a batch job over ``nodes`` (``"2"`` or ``"1-2"``), one task per node."""
        argv = [
            "sbatch", "--parsable", f"--partition={partition}", f"--job-name={job_name}",
            f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={self.cpus}",
            f"--output={output}", "--open-mode=append", f"--chdir={self.root / 'jobs'}",
            "--requeue", *extra_args, str(script),
        ]
        result = self._run(argv, env=env)
        return int(result.stdout.strip().split(";")[0])

    def preempt(self, cpus: int | None = None, command: str = "true") -> int:
        """Submit an ``own`` job over every host, all CPUs; return its id."""
        script = self.job_file(f"preemptor-{time.monotonic_ns()}.sh")
        script.write_text(f"#!/bin/sh\n{command}\n")
        script.chmod(0o700)
        argv = [
            "sbatch", "--parsable", "--partition=own", "--job-name=preemptor",
            f"--nodes={len(self.hosts)}", "--ntasks-per-node=1",
            f"--cpus-per-task={cpus or self.cpus}", f"--output={self.job_file('pre-%j.out')}",
            "--no-requeue", str(script),
        ]
        return int(self._run(argv).stdout.strip().split(";")[0])

    def update_job(self, job_id: int, *settings: str) -> None:
        """``scontrol update JobId=job_id <settings>`` (e.g. ``NumNodes=1`` while pending)."""
        self._run(["scontrol", "update", f"JobId={job_id}", *settings])

    def resize_pending(self, job_id: int, nodes: int) -> None:
        """Make the pending (requeued) job need ``nodes`` nodes, one task each, all CPUs.

        A job that ran keeps the node count it was given, and its total CPU count: updating
        ``NumNodes`` alone leaves ``NumCPUs`` at the old allocation's, which fewer nodes
        cannot hold, and the job stays pending for good (``Reason=BadConstraints``). So the
        tasks, the node range (``N-N``: a bare ``N`` keeps the old maximum and a growing
        count is refused) and the CPUs are set, in an order each step of which is valid.
        """
        settings = [f"NumNodes={nodes}-{nodes}", f"NumTasks={nodes}",
                    f"NumCPUs={nodes * self.cpus}"]
        current = int(self.job_state(job_id).get("NumTasks", "0") or 0)
        if nodes < current:  # shrinking: fewer tasks first, then fewer nodes
            settings = [settings[1], settings[0], settings[2]]
        for setting in settings:
            self.update_job(job_id, setting)

    def requeue(self, job_id: int) -> None:
        """``scontrol requeue`` a running or finished batch job (keeps its id)."""
        self._run(["scontrol", "requeue", str(job_id)])

    def nodelist(self, job_id: int) -> list[str]:
        """The hosts of the job's current (or last) allocation."""
        raw = self.job_state(job_id).get("NodeList", "")
        if not raw or raw == "(null)":
            return []
        result = self._run(["scontrol", "show", "hostnames", raw])
        return result.stdout.split()

    def job_processes(self, job_id: int) -> list[int]:
        """Live processes (any host) carrying ``SLURM_JOB_ID=job_id``: steps and ranks."""
        marker = f"SLURM_JOB_ID={job_id}".encode()
        found = []
        for pid in self.processes():
            with contextlib.suppress(OSError):
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
        return found

    def job_steps(self, job_id: int) -> list[str]:
        """Step ids (``J.S``, ``J.batch``) the controller still lists for the job."""
        out = self._run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i"], check=False)
        return [s for s in out.stdout.split() if s.startswith(f"{job_id}.")]

    def wait_job_gone(self, job_id: int, timeout: float = 90.0,
                      lost: Sequence[str] = ()) -> None:
        """Wait until no process of the job's previous run is left on any host and every
        host but the ``lost`` ones (down for good, :meth:`lose_host`) is idle: a requeued
        job released earlier finds its old step still holding the nodes ("Requested nodes
        are busy") and srun waits."""
        deadline = time.monotonic() + timeout
        cancelled: set[str] = set()
        while True:
            left, steps = self.job_processes(job_id), self.job_steps(job_id)
            # "*": not responding; the first srun of a run waits for such a node.
            busy = [h for h, st in self.node_states().items() if h not in lost
                    and (st.startswith(("alloc", "mix", "comp")) or st.endswith("*"))]
            # A node that says idle while it still holds CPUs is the half-released state
            # described in revive_host; so is an agent still carrying the old run's RPCs.
            busy += [h for h, n in self.allocated_cpus().items()
                     if n and h not in busy and h not in lost]
            agents = self.agents()
            # slurmctld keeps retrying a lost host (pings, the old run's terminate): its
            # agents never settle, and with no revival of that host there is no race left
            # for them to prevent (see revive_host).
            settled = bool(lost) or agents == {"queue": 0, "count": 0}
            if not left and not steps and not busy and settled:
                return
            # A step record of the lost run that the revived host never reports complete
            # keeps its CPUs "busy" for the next run's srun: cancel it (once per step).
            for step in (s for s in steps if s not in cancelled):
                cancelled.add(step)
                self._run(["scancel", step], check=False)
            if time.monotonic() > deadline:
                raise SlurmTimeoutError(
                    f"job {job_id}: processes {left}, steps {steps} still there, hosts "
                    f"{self.node_states()}, CPUs allocated {self.allocated_cpus()}, "
                    f"slurmctld agents {self.agents()}, {timeout:.0f} s after it was requeued"
                )
            time.sleep(_POLL_S)
