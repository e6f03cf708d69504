"""Simulated hosts on one machine: Linux network namespaces on a private bridge.

``HostNetwork.create(names)`` builds, as root:

* a bridge ``rkmn0`` in the root namespace holding ``<subnet>.1/24`` (the controller's
  address: ``slurmctld`` listens there);
* per host ``hostN``: a network namespace ``rkmn-hostN`` with loopback up and one veth
  end (``eth0``, ``<subnet>.(10+N)/24``) whose peer ``rkmn-vN`` is enslaved to the bridge,
  and ``/etc/netns/rkmn-hostN/hosts`` naming every host (bind-mounted
  over ``/etc/hosts`` for processes started on the host, so ``host1`` resolves there).

The namespaces get **no default route**: a process inside can reach its own loopback, the
other hosts and the controller, and nothing else. Only addresses of the chosen /24 are
used; the /24 is refused if anything on the machine already uses it.

Every name carries the ``rkmn`` prefix, so ``HostNetwork.remove_leftovers()`` can tear down
what a killed previous run left (processes inside the namespaces, the namespaces, veths,
the bridge, the hosts files) before a new network is built. ``close()`` does the same for
this network and is idempotent; the fixture calls it from a finalizer.

A host's processes are started with ``nsenter --net=/run/netns/rkmn-hostN unshare --uts
--mount -- sh -c 'mount --bind <hosts file> /etc/hosts && hostname hostN && exec ...'``: own
network stack, own hostname, own ``/etc/hosts``, otherwise the shared filesystem (plus any
``binds`` given: the namespace cluster mounts each host's scratch dir over one common path,
the node-local disk).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BRIDGE",
    "PREFIX",
    "SUBNET",
    "HostNetwork",
    "NetworkUnavailableError",
    "namespace_pids",
]

PREFIX = "rkmn"
BRIDGE = f"{PREFIX}0"
#: The /24 the test network uses (checked free on this machine before use).
SUBNET = ipaddress.IPv4Network("10.213.47.0/24")
_NETNS_ETC = Path("/etc/netns")
_NETNS_RUN = Path("/run/netns")


class NetworkUnavailableError(RuntimeError):
    """The namespace network cannot be built here (not root, no ``ip``, subnet in use)."""


def _ip(*args: str, check: bool = True, netns: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise NetworkUnavailableError(
            f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}"
        )
    return result


def namespace_pids(netns: str) -> list[int]:
    """Pids of every process whose network namespace is ``netns`` (``ip netns pids``)."""
    result = _ip("netns", "pids", netns, check=False)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def _kill_namespace_processes(netns: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(netns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetworkUnavailableError(
                f"processes {pids} of namespace {netns} survive SIGKILL for {timeout:.0f} s"
            )
        time.sleep(0.05)


def _subnet_users() -> list[str]:
    """Lines of ``ip -o addr`` / ``ip route`` of the root namespace inside ``SUBNET``,
    except our own bridge's."""
    users = []
    for line in _ip("-o", "-4", "addr").stdout.splitlines() + _ip("route").stdout.splitlines():
        if BRIDGE in line.split():
            continue
        for word in line.replace("/", " ").split():
            with contextlib.suppress(ValueError):
                if ipaddress.IPv4Address(word) in SUBNET:
                    users.append(line.strip())
                    break
    return users


@dataclass
class HostNetwork:
    """The bridge and one namespace per host; build it with ``HostNetwork.create``.

    Attributes:
        hosts: Host names, in order (``host1``, ``host2`` ...).
        addresses: Host name -> IPv4 address on the bridge.
        controller_address: The bridge's own address (root namespace).
        timings: Seconds measured (``create_s``).
    """

    hosts: tuple[str, ...]
    addresses: dict[str, str]
    controller_address: str
    timings: dict[str, float] = field(default_factory=dict)
    _closed: bool = False

    @staticmethod
    def netns(host: str) -> str:
        """The namespace name of ``host``."""
        return f"{PREFIX}-{host}"

    @staticmethod
    def veth(host: str) -> str:
        """The root-namespace end of ``host``'s veth pair."""
        return f"{PREFIX}-v{host.removeprefix('host')}"

    @classmethod
    def remove_leftovers(cls) -> list[str]:
        """Remove every ``rkmn`` namespace, veth, bridge and hosts file; return what went."""
        removed = []
        if _NETNS_RUN.exists():
            for entry in sorted(_NETNS_RUN.iterdir()):
                if entry.name.startswith(f"{PREFIX}-"):
                    _kill_namespace_processes(entry.name)
                    _ip("netns", "delete", entry.name, check=False)
                    removed.append(f"netns {entry.name}")
        for line in _ip("-o", "link", "show").stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(PREFIX):
                _ip("link", "delete", name, check=False)
                removed.append(f"link {name}")
        if _NETNS_ETC.exists():
            for entry in _NETNS_ETC.glob(f"{PREFIX}-*"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(f"file {entry}")
        return removed

    @classmethod
    def create(cls, hosts: Sequence[str]) -> HostNetwork:
        """Build the bridge and one namespace per host (leftovers of a killed run removed).

        Raises:
            NetworkUnavailableError: Not root, ``ip``/``unshare`` missing, the subnet is in
                use, or a command failed (everything built so far is removed again).
        """
        if os.geteuid() != 0:
            raise NetworkUnavailableError(f"network namespaces need root; euid is {os.geteuid()}")
        for program in ("ip", "unshare", "nsenter", "mount"):
            if shutil.which(program) is None:
                raise NetworkUnavailableError(
                    f"`{program}` is not installed (iproute2, util-linux)"
                )
        began = time.monotonic()
        cls.remove_leftovers()
        if users := _subnet_users():
            raise NetworkUnavailableError(
                f"subnet {SUBNET} is already used on this machine: {users}; pick another one "
                "in tests/multinode/netns.py (SUBNET)"
            )
        base = SUBNET.network_address
        controller = str(base + 1)
        addresses = {host: str(base + 10 + index) for index, host in enumerate(hosts, 1)}
        network = cls(tuple(hosts), addresses, controller)
        try:
            network._build()
        except BaseException:
            network.close()
            raise
        network.timings["create_s"] = time.monotonic() - began
        return network

    def _build(self) -> None:
        prefix = SUBNET.prefixlen
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{self.controller_address}/{prefix}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{address} {host}\n" for host, address in self.addresses.items()
        ) + f"{self.controller_address} rkmn-controller\n"
        for host, address in self.addresses.items():
            netns, veth = self.netns(host), self.veth(host)
            _ip("netns", "add", netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", f"{veth}p", "netns", netns)
            _ip("link", "set", f"{veth}p", "name", "eth0", netns=netns)
            _ip("addr", "add", f"{address}/{prefix}", "dev", "eth0", netns=netns)
            _ip("link", "set", "eth0", "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            _ip("link", "set", veth, "master", BRIDGE)
            _ip("link", "set", veth, "up")
            etc = _NETNS_ETC / netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(f"{host}\n")

    def command(self, host: str, argv: Sequence[str],
                binds: Sequence[tuple[Path, Path]] = ()) -> list[str]:
        """``argv`` run on ``host``: in its namespace, under its own hostname.

        ``binds``: ``(source, target)`` directories bind-mounted in the host's private mount
        namespace before ``argv`` starts, e.g. the host's own scratch disk over a path that
        is the same on every host (node-local storage: one path, each host its own files).
        """
        import shlex  # noqa: PLC0415

        hosts_file = _NETNS_ETC / self.netns(host) / "hosts"
        mounts = "".join(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))} && "
                         for source, target in binds)
        script = (f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts && {mounts}"
                  f"hostname {shlex.quote(host)} && exec {shlex.join(argv)}")
        # nsenter, not `ip netns exec`: the latter remounts /sys, which hides the cgroup
        # mount slurmd needs. The private mount namespace only swaps /etc/hosts.
        return ["nsenter", f"--net={_NETNS_RUN / self.netns(host)}", "unshare", "--uts",
                "--mount", "--propagation", "private", "--", "sh", "-c", script]

    def pids(self, host: str) -> list[int]:
        """Every process running on ``host`` (in its network namespace)."""
        return namespace_pids(self.netns(host))

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host`` by pid (a node that dies); return the pids.

        torchrun starts each worker in a session of its own, so no process group covers
        them all: every process found in the namespace is signalled, and the lookup is
        repeated until none is left (a dying parent cannot fork a survivor unseen).
        """
        killed: list[int] = []
        for _ in range(20):
            pids = self.pids(host)
            if not pids:
                return killed
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.extend(p for p in pids if p not in killed)
            time.sleep(0.05)
        raise NetworkUnavailableError(f"processes {self.pids(host)} of {host} survive SIGKILL")

    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s veth down (a silent partition: no RST, no FIN) or up again."""
        _ip("link", "set", self.veth(host), "up" if up else "down")

    @contextlib.contextmanager
    def partitioned(self, host: str) -> Iterator[None]:
        """``host`` cut off the bridge for the duration of the block."""
        self.set_link(host, up=False)
        try:
            yield
        finally:
            self.set_link(host, up=True)

    def close(self) -> None:
        """Kill every process in the namespaces, remove namespaces, links, files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            with contextlib.suppress(NetworkUnavailableError):
                _kill_namespace_processes(self.netns(host))
        self.remove_leftovers()
