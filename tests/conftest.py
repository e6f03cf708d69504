"""Shared pytest setup.

With ``CI=true`` every suite must run: a test that would skip (SLURM cannot start, no
small filesystem for the disk-full test, ...) fails instead, naming what was missing.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> None:
    """Skip outside CI; fail in CI (a suite that cannot run is a failure there)."""
    if IN_CI:
        pytest.fail(f"CI=true but this suite cannot run: {reason}")
    pytest.skip(reason)


#: Markers of the suites that share one machine-wide cluster per pytest process (a session
#: fixture), in the order `make test` starts them: the longest first. ``multinode``'s
#: network namespaces, bridge and /24 have fixed names: two pytest processes building them
#: at once tear down each other's, so its files go to one worker (``ONE_CLUSTER_DIR``);
#: ``slurm`` starts one private cluster per process.
CLUSTER_MARKERS = ("multinode", "slurm")
#: The files of this directory are one unit of ``--dist loadfile``: they share the one
#: namespace cluster a worker may build at a time (see ``pytest_xdist_make_scheduler``).
ONE_CLUSTER_DIR = "tests/multinode/"


def xdist_scope(nodeid: str, by_file: str) -> str:
    """The ``--dist loadfile`` unit of a test: its file (``by_file``), or the whole
    ``tests/multinode`` directory for the tests there."""
    return ONE_CLUSTER_DIR if nodeid.startswith(ONE_CLUSTER_DIR) else by_file


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (`make test`), with every ``tests/multinode`` file given to one
    worker: two workers building the namespace cluster at once tear down each other's."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneClusterPerWorker(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid, super()._split_scope(nodeid))

    return OneClusterPerWorker(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the cluster suites first, each suite keeping its own order.

    With ``--dist loadfile --no-loadscope-reorder`` (`make test`) the workers take files in
    collection order, so the cluster drills, long and mostly waiting on SLURM and on
    timeouts, start at once while the other workers run the rest.
    """
    def rank(item: pytest.Item) -> int:
        return next((index for index, marker in enumerate(CLUSTER_MARKERS)
                     if item.get_closest_marker(marker) is not None), len(CLUSTER_MARKERS))

    items.sort(key=rank)  # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"CI=true forbids skipping: {report.longrepr}"


# Storage backend fixtures (local, file://, memory://, loopback S3) for every suite.
from tests.storage_backends import (  # noqa: E402
    backend,
    s3_endpoint,
    storage,
    storage_factory,
)

__all__ = ["IN_CI", "backend", "s3_endpoint", "storage", "storage_factory", "unavailable"]


@pytest.fixture
def another_process(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``another_process(pid)``: what this process claims from now on looks like process
    ``pid`` of this host — outside SLURM a zombie writer is always another process, and
    managers of one process share its writer generation."""
    from resumekit.store.manifest import Lineage

    real = Lineage.current

    def become(pid: int) -> None:
        monkeypatch.setattr(Lineage, "current", classmethod(
            lambda cls, **kwargs: real(**kwargs).model_copy(update={"pid": pid})))

    return become
