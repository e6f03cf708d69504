"""`make test`'s scheduling: every tests/multinode file goes to the same pytest worker."""

from __future__ import annotations

from tests.conftest import xdist_scope


def test_every_multinode_file_is_one_unit_of_loadfile_and_other_files_stay_their_own() -> None:
    across = "tests/multinode/test_lingbot_across_hosts.py::test_x"
    drills = "tests/multinode/test_local_tier_drills.py::test_y"
    assert xdist_scope(across, "tests/multinode/test_lingbot_across_hosts.py") == \
        xdist_scope(drills, "tests/multinode/test_local_tier_drills.py")
    assert xdist_scope("tests/slurm/test_a.py::t", "tests/slurm/test_a.py") == \
        "tests/slurm/test_a.py"
