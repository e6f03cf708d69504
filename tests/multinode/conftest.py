"""Fixtures of the multi-node suite: one namespace cluster per session, one reference run.

The reference run starts first, in the background, and runs while the cluster boots (mostly
waiting on its daemons); the first drill waits for both.

``ns_cluster`` builds two hosts (``host1``, ``host2``: network namespaces on a private
bridge, each with its own hostname, ``slurmd`` and node-local disk) and one spare
(``host3``: allocated only when ``host1`` or ``host2`` is missing, the fresh host a job
lost a host is requeued onto) plus ``slurmctld`` and ``munged``; it is
torn down after the session, also when tests fail (every process of every host killed,
namespaces, links and hosts files removed). Leftovers of a killed earlier run are removed
before it is built. If this machine cannot build it (not root, no ``ip``/``nsenter``, no
SLURM, the /24 in use), the tests skip, or fail under ``CI=true``
(``tests.conftest.unavailable``).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from examples.lingbot.drill import Launch, Segment, run_segment
from tests.conftest import unavailable
from tests.multinode.cluster import NamespaceCluster
from tests.multinode.drills import GRACE_S, KILL_WAIT_S, SLURMD_TIMEOUT_S, TRAIN_ARGS, WAIT_S
from tests.slurm.cluster import SlurmClusterError, SlurmUnavailableError

HOSTS = ("host1", "host2")
#: Hosts SLURM allocates only when one of ``HOSTS`` is missing (higher ``Weight``).
SPARES = ("host3",)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Path, Future[Segment]]]:
    """An uninterrupted single-host run (plain torchrun, 2 ranks) of the drills' command,
    started in the background: its root and the launch under way."""
    root = tmp_path_factory.mktemp("multinode-reference") / "run"
    with ThreadPoolExecutor(max_workers=1) as pool:  # on exit, waits for the launch
        yield root, pool.submit(
            run_segment, "reference", 1,
            Launch(root, nproc=2, shutdown_timeout=GRACE_S, train_args=TRAIN_ARGS),
            log_dir=root.parent / "logs", timeout=WAIT_S * 2)


@pytest.fixture(scope="session")
def ns_cluster(reference_run: tuple[Path, Future[Segment]]) -> Iterator[NamespaceCluster]:
    """The running two-host cluster and its spare (partitions ``extra`` and ``own`` over
    all three).

    It asks for ``reference_run`` so that the reference launch starts before the boot.
    """
    try:
        cluster = NamespaceCluster.start_hosts(
            HOSTS, spares=SPARES, kill_wait_s=KILL_WAIT_S, slurmd_timeout_s=SLURMD_TIMEOUT_S
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
        state = states.get(host, "")
        if not state.startswith("idle") and ("drain" in state or "down" in state):
            try:
                cluster.set_node(host, "RESUME")
            except SlurmClusterError as error:
                # A host whose slurmd just came back may leave DOWN by itself between the
                # read and the update: slurmctld then refuses RESUME; idle is checked below.
                if "Invalid node state" not in str(error):
                    raise
    cluster.wait_for_nodes("idle", cluster.hosts, WAIT_S)


@pytest.fixture(scope="session")
def reference(reference_run: tuple[Path, Future[Segment]]) -> Path:
    """The reference run's root, once it has finished (its failure fails the drills)."""
    root, launch = reference_run
    launch.result()
    return root
