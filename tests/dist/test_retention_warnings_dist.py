"""After a commit, a retention failure on rank 0 is the same warning on every rank.

Rank 0's ``remove_tree`` fails with ``EBUSY`` (NFS ``.nfsXXXX`` files) while it prunes
after step 2 is committed: ``save(2)`` must return on both ranks, and both must see the
same ``ResumekitWarning`` naming the directory and the error.
"""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from resumekit.errors import StorageError
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints
from resumekit.store.retention import keep_last
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks


def _save_while_rank0_cannot_delete(rank: int, world_size: int, shared: str
                                    ) -> tuple[list[str], int | None]:
    torch.manual_seed(0)
    ckpt = CheckpointManager(Path(shared) / "ckpt", model=nn.Linear(4, 2),
                             retention=keep_last(1))
    ckpt.save(1)
    if rank == 0:
        original = Storage.remove_tree

        def remove_tree(self: Storage, relative: str) -> None:
            if ".old-" in relative:
                error = OSError(errno.EBUSY, os.strerror(errno.EBUSY), self.path(relative))
                raise StorageError(f"cannot delete {self.path(relative)}: {error}",
                                   path=self.path(relative), operation="delete") from error
            original(self, relative)

        Storage.remove_tree = remove_tree  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt.save(2)  # must return on both ranks
    ckpt.close()
    messages = [str(w.message) for w in seen if issubclass(w.category, ResumekitWarning)]
    return messages, ckpt.last_saved_step


def test_a_retention_failure_on_rank_0_warns_identically_on_both_ranks_and_save_returns(
    tmp_path: Path,
) -> None:
    results = run_ranks(_save_while_rank0_cannot_delete, 2, args=(str(tmp_path),))
    (rank0, saved0), (rank1, saved1) = results
    assert saved0 == saved1 == 2
    assert rank0 == rank1
    assert len(rank0) == 1
    assert "step 2 is committed" in rank0[0]
    assert "step_000000001.old-" in rank0[0] and "Device or resource busy" in rank0[0]
    committed = [e.step for e in list_checkpoints(Storage(tmp_path / "ckpt"))
                 if e.status == "committed"]
    assert committed == [2]
