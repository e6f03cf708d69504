"""Two ranks, one of whose loads raises on a good checkpoint: both stop, nothing set aside.

Rank 1's load planner raises an ``AttributeError`` (a bug) while restoring a checkpoint
whose files match their checksums; rank 0's loads fine. Every rank raises the same
``CheckpointLoadError`` naming the checkpoint, its step, rank 1 and the original
exception (none waits for the other), neither falls back to the older step, and both
step directories are left as they were. Before, the failure was taken for damage: the
checkpoint was set aside and restore fell back past it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resumekit.errors import CheckpointLoadError
from resumekit.manager import CheckpointManager
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks

BUG = "'_Plan' object has no attribute 'items'"


def _manager(root: Path) -> CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    return CheckpointManager(root, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), retention=None)


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")
                  if ".resumekit-generations" not in path.parts)


def _one_rank_fails_to_load(rank: int, world_size: int, shared: str, method: str
                            ) -> dict[str, Any]:
    root = Path(shared) / "ckpt"
    writer = _manager(root)
    writer.restore()
    writer.save(1)
    writer.save(2)
    writer.close()
    dist.barrier()
    before = _tree(root)

    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError(BUG)

    original = getattr(_CheckedLoadPlanner, method)
    if rank == 1:
        setattr(_CheckedLoadPlanner, method, broken)
    manager = _manager(root)
    raised: BaseException | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResumekitWarning)
            try:
                manager.restore()
            except Exception as error:  # noqa: BLE001 - returned to the test
                raised = error
    finally:
        setattr(_CheckedLoadPlanner, method, original)
    resumed_from = manager.resumed_from
    manager.close()
    dist.barrier()
    return {
        "type": type(raised).__name__,
        "message": str(raised),
        "fields": dict(getattr(raised, "fields", {})),
        "resumed_from": resumed_from,
        "warnings": [str(w.message) for w in caught],
        "unchanged": _tree(root) == before,
        "names": sorted(path.name for path in root.iterdir()),
    }


@pytest.mark.parametrize("method", ["create_local_plan", "commit_tensor"])
def test_one_ranks_failing_load_of_a_good_checkpoint_stops_every_rank_without_setting_aside(
        tmp_path: Path, method: str) -> None:
    """Rank 1 fails before it reads a byte, or after each tensor it reads (read once)."""
    results = run_ranks(_one_rank_fails_to_load, 2, args=(str(tmp_path), method))
    step_dir = str(tmp_path / "ckpt" / "step_000000002")
    for result in results:
        assert result["type"] == CheckpointLoadError.__name__, result
        message = result["message"]
        assert f"{step_dir} (step 2) failed to load on rank 1" in message, message
        assert f"AttributeError: {BUG}" in message and "nothing was set aside" in message
        assert result["fields"]["step"] == 2 and result["fields"]["rank"] == 1
        assert result["resumed_from"] is None
        assert not [w for w in result["warnings"] if "set aside" in w], result["warnings"]
        assert result["unchanged"], result["names"]
        assert result["names"] == [".resumekit-generations", "step_000000001",
                                   "step_000000002"]
    assert results[0]["message"] == results[1]["message"]
