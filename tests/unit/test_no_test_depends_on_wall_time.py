"""No test depends on wall time: every limit on a wait is a hang detector (issue 36 item 2).

``make test`` on a loaded machine failed a test whose ``pytest --collect-only`` subprocess
had 120 s. The suites' limits now come from ``tests/limits.py``, far above any load; this
test finds a numeric limit written into a test again, outside the tests whose subject is
a timeout (listed here with the reason).
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from tests.limits import COLLECTIVE_HANG_S, HANG_S, TEST_HANG_S

TESTS = Path(__file__).resolve().parents[1]
# Cluster suites model SLURM's own timeouts (KillWait, GraceTime) on purpose.
SKIPPED = ("slurm", "multinode", "fixtures")
LIMIT = re.compile(r"(?<![-\w])(?:timeout|group_timeout_s|checkpoint_timeout)\s*=\s*([0-9][0-9_.]*)"
                   r"|mark\.timeout\(\s*([0-9][0-9_.]*)")
# file -> why its short limits are the subject of the test, not a deadline for the machine
SUBJECT_IS_A_TIMEOUT = {
    "storage_backends.py": "one poll of the S3 endpoint (retried until HANG_S), and the "
                           "wait after terminate() before kill()",
    "dist/test_replicas_dist.py": "a peer that stops answering raises after the timeout",
    "dist/test_restore_reads_once_dist.py": "a rank that fails: its peer's wait ends by it",
    "dist/test_init_distributed.py": "the training and checkpoint timeouts themselves",
    "unit/test_preemption.py": "a hanging scontrol is an error after its timeout",
    "unit/test_distributed_env.py": "one process: the values are checked, no collective waits",
}


def _short_limits() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        relative = path.relative_to(TESTS).as_posix()
        if relative.split("/")[0] in SKIPPED or path == Path(__file__).resolve():
            continue
        for match in LIMIT.finditer(path.read_text()):
            seconds = float((match.group(1) or match.group(2)).replace("_", ""))
            if seconds < COLLECTIVE_HANG_S:
                found.setdefault(relative, []).append(match.group(0))
    return found


def test_no_test_outside_the_timeout_tests_writes_a_short_limit() -> None:
    unexplained = {path: limits for path, limits in _short_limits().items()
                   if path not in SUBJECT_IS_A_TIMEOUT}
    assert unexplained == {}, ("use tests.limits.HANG_S (a hang detector) or wait on an "
                               f"event: {unexplained}")


def test_every_listed_timeout_test_still_has_its_short_limit() -> None:
    # A file that lost its short limits is no longer an exception: take it off the list.
    assert set(SUBJECT_IS_A_TIMEOUT) <= set(_short_limits())


def test_the_per_test_limit_and_the_hang_limits_are_far_above_any_load() -> None:
    pytest_options = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
    assert pytest_options["tool"]["pytest"]["ini_options"]["timeout"] == TEST_HANG_S
    assert TEST_HANG_S > HANG_S >= 3600 and COLLECTIVE_HANG_S >= 600


def test_the_finder_sees_a_short_subprocess_limit() -> None:
    short = 120  # the limit that failed under load, written as the suites once did
    assert LIMIT.search(f"subprocess.run(cmd, timeout={short}, check=False)")
    assert LIMIT.search("pytestmark = pytest.mark.timeout(300)")
    assert not LIMIT.search("drill.Launch(root, shutdown_timeout=45)")
    assert not LIMIT.search('"--shutdown-timeout=45" in launch.command()')
