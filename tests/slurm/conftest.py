"""The ``slurm_cluster`` fixture: one throwaway single-node SLURM cluster per test session.

Started on first use, torn down after the session even when tests fail (every job
cancelled, daemons and leftover job processes killed, the temp dir removed). If the
programs are missing or a daemon does not come up, the tests using it skip, or fail under
``CI=true`` (``tests.conftest.unavailable``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import unavailable
from tests.slurm.cluster import SlurmCluster, SlurmUnavailableError

#: Seconds between SIGTERM and SIGKILL on preemption (slurm.conf ``KillWait``): the budget a
#: preempted trainer has for its emergency checkpoint.
KILL_WAIT_S = 30


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running cluster: partitions ``extra`` (preemptible, requeue) and ``own`` (high tier)."""
    try:
        cluster = SlurmCluster.start(kill_wait_s=KILL_WAIT_S)
    except SlurmUnavailableError as error:
        unavailable(f"SLURM test cluster: {error}")
        raise  # unreachable: unavailable() skips or fails
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session cluster, emptied of jobs after each test (a failed test leaves some)."""
    yield slurm_cluster
    slurm_cluster.cancel_all()
