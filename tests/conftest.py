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


#: Markers of the suites that share one machine-wide cluster per pytest process (its
#: session fixture), in the order `make test` starts them: the longest first.
#: ``multinode``'s network namespaces, bridge and /24 have fixed names (two sessions
#: would tear down each other's); ``slurm``'s cluster is one per session, started once.
CLUSTER_MARKERS = ("multinode", "slurm")


def xdist_group_of(item: pytest.Item) -> str | None:
    """The pytest-xdist group ``item`` must run in under ``--dist loadgroup``, or None.

    A test of a machine-wide cluster runs in that cluster's group (one worker, one at a
    time); a test using a module-scoped fixture of its module runs in the module's group,
    so that the fixture (a reference run, a benchmark) is built once, not once per worker.
    """
    for marker in CLUSTER_MARKERS:
        if item.get_closest_marker(marker) is not None:
            return marker
    # _fixtureinfo: pytest's own record of the fixtures a test uses (no public accessor).
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return None
    for definitions in info.name2fixturedefs.values():
        definition = definitions[-1]  # the one this test gets (the closest override)
        if definition.scope == "module" and definition.baseid == item.nodeid.split("::")[0]:
            return module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns the marks into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test's xdist group (``xdist_group_of``); put the cluster suites first.

    With ``--dist loadgroup --no-loadscope-reorder`` (`make test`) the workers take work in
    collection order, so the cluster drills, long and mostly waiting on SLURM and on
    timeouts, start at once while the other workers run the rest.
    """
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def rank(item: pytest.Item) -> int:
        return next((index for index, marker in enumerate(CLUSTER_MARKERS)
                     if item.get_closest_marker(marker) is not None), len(CLUSTER_MARKERS))

    items.sort(key=rank)  # stable: every suite keeps its own order


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
