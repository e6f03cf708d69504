"""Two ranks agree on what restore does with a broken newest entry and a flaky read.

A garbled newest manifest is set aside once (by rank 0) and warned about on every rank,
both ranks fall back to the same step and both can save that step again; a transient
read error on one rank only is retried there without the other rank noticing.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path
from typing import Any

import tenacity
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from resumekit.manager import CheckpointManager
from resumekit.store import retry
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks


def _manager(root: Path) -> CheckpointManager:
    torch.manual_seed(0)
    # a weight above PREREAD_MAX_BYTES: rank 1 reads it itself (smaller items, stored
    # whole, come read by rank 0 in rank 1's part of .metadata)
    model = nn.Linear(64, 32)
    return CheckpointManager(root, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), retention=None)


def _broken_newest_then_flaky_read(rank: int, world_size: int, shared: str
                                   ) -> dict[str, Any]:
    root = Path(shared) / "ckpt"
    retry.BACKOFF = tenacity.wait_none()
    first = _manager(root)
    first.save(100)
    first.save(200)
    first.close()
    if rank == 0:
        (root / "step_000000200" / "manifest.json").write_bytes(b"{ not json")
    dist.barrier()

    resumed = _manager(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumekitWarning)
        fell_back_to = resumed.restore()
    resumed.save(200)  # the step is free again, on every rank
    resumed.close()
    dist.barrier()

    failed: list[str] = []
    original = FileSystem.create_stream

    def flaky(self: FileSystem, path: Any, mode: str) -> Any:
        if rank == 1 and str(path).endswith(".distcp") and len(failed) < 2:
            failed.append(str(path))
            raise OSError(errno.EIO, "Input/output error", str(path))
        return original(self, path, mode)

    FileSystem.create_stream = flaky  # type: ignore[method-assign]
    try:
        again = _manager(root)
        restored = again.restore()
        again.close()
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]
    return {
        "fell_back_to": fell_back_to,
        "warnings": [str(w.message) for w in caught if issubclass(w.category,
                                                                  ResumekitWarning)],
        "set_aside": sorted(p.name for p in root.iterdir() if ".bad-" in p.name),
        "restored": restored,
        "retried": len(failed),
    }


def test_two_ranks_set_a_broken_newest_aside_once_and_retry_a_flaky_read_alone(
    tmp_path: Path,
) -> None:
    results = run_ranks(_broken_newest_then_flaky_read, 2, args=(str(tmp_path),))
    assert [r["fell_back_to"] for r in results] == [100, 100]
    for result in results:
        assert any("step_000000200" in w and "not valid JSON" in w and "set aside" in w
                   for w in result["warnings"]), result["warnings"]
    assert len(results[0]["set_aside"]) == 1
    assert results[0]["set_aside"] == results[1]["set_aside"]
    assert [r["restored"] for r in results] == [200, 200]
    assert [r["retried"] for r in results] == [0, 2]
