"""A local tier's directory refused on one node's rank is refused on every rank.

Each node checks its own ``LocalTier.root`` as the manager is built; one node's can be a
link while the others' are not. The refusal must reach every rank at once: a rank that
went on alone waited for the refused one in the next process group's creation until the
checkpoint timeout (two hours by default).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

import resumekit
from resumekit.errors import ConfigurationError
from resumekit.runtime import channels
from tests.distributed_harness import run_ranks

#: The gloo groups' timeout in this test: a rank left waiting fails after it, not hours.
GROUP_TIMEOUT = timedelta(seconds=60)


def _build(rank: int, world_size: int, tmp: str) -> str:
    def short_group() -> dist.ProcessGroup:
        group: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        return group

    channels.new_save_group = short_group  # this rank's process only
    local = Path(tmp) / f"node{rank}"
    if rank == 1:  # this node's directory is a link to another place
        (Path(tmp) / "elsewhere").mkdir()
        os.symlink(Path(tmp) / "elsewhere", local)
    try:
        resumekit.CheckpointManager(f"{tmp}/durable", model=nn.Linear(2, 2),
                                    local=resumekit.LocalTier(str(local), save_every=1))
    except ConfigurationError as error:
        return str(error)
    return "built"


@pytest.mark.filterwarnings("ignore::resumekit.ResumekitWarning")
def test_a_local_root_refused_on_one_rank_is_raised_on_every_rank_naming_it(
        tmp_path: Path) -> None:
    results = run_ranks(_build, world_size=2, args=(str(tmp_path),))
    link = str(tmp_path / "node1")
    assert all("symbolic link" in said and link in said for said in results), results
