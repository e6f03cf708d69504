"""Fixtures of the multi-node suite: one namespace cluster per session, one reference run.

``ns_cluster`` builds two hosts (``host1``, ``host2``: network namespaces on a private
bridge, each with its own hostname and ``slurmd``) plus ``slurmctld`` and ``munged``; it is
torn down after the session, also when tests fail (every process of every host killed,
namespaces, links and hosts files removed). Leftovers of a killed earlier run are removed
before it is built. If this machine cannot build it (not root, no ``ip``/``nsenter``, no
SLURM, the /24 in use), the tests skip, or fail under ``CI=true``
(``tests.conftest.unavailable``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.lingbot.drill import Launch, run_segment
from tests.conftest import unavailable
from tests.multinode.cluster import NamespaceCluster
from tests.multinode.drills import GRACE_S, KILL_WAIT_S, SLURMD_TIMEOUT_S, TRAIN_ARGS, WAIT_S
from tests.slurm.cluster import SlurmUnavailableError

HOSTS = ("host1", "host2")


@pytest.fixture(scope="session")
def ns_cluster() -> Iterator[NamespaceCluster]:
    """The running two-host cluster (partitions ``extra`` and ``own`` over both hosts)."""
    try:
        cluster = NamespaceCluster.start_hosts(
            HOSTS, kill_wait_s=KILL_WAIT_S, slurmd_timeout_s=SLURMD_TIMEOUT_S
        )
    except SlurmUnavailableError as error:
        unavailable(f"multi-host namespace cluster: {error}")
        raise  # unreachable: unavailable() skips or fails
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(ns_cluster: NamespaceCluster) -> Iterator[NamespaceCluster]:
    """The session cluster with every host up and idle; emptied of jobs afterwards."""
    _heal(ns_cluster)
    yield ns_cluster
    ns_cluster.cancel_all()
    _heal(ns_cluster)


def _heal(cluster: NamespaceCluster) -> None:
    """Undo what a drill did to the hosts: links up, dead slurmd restarted, drains lifted."""
    assert cluster.network is not None
    for host in cluster.hosts:
        cluster.network.set_link(host, up=True)
        proc = cluster._daemons.get(f"slurmd-{host}")
        if proc is None or proc.poll() is not None:
            cluster.start_slurmd(host)
    states = cluster.node_states()
    for host in cluster.hosts:
        if not states.get(host, "").startswith("idle"):
            cluster.set_node(host, "RESUME") if "drain" in states.get(host, "") or \
                "down" in states.get(host, "") else None
    cluster.wait_for_nodes("idle", cluster.hosts, WAIT_S)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted single-host run (plain torchrun, 2 ranks) of the drills' command."""
    root = tmp_path_factory.mktemp("multinode-reference") / "run"
    run_segment("reference", 1, Launch(root, nproc=2, shutdown_timeout=GRACE_S,
                                       train_args=TRAIN_ARGS),
                log_dir=root.parent / "logs", timeout=WAIT_S * 2)
    return root
