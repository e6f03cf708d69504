"""A restore reads ``.metadata``'s head on one rank and sends it to the others, on 2 gloo ranks.

``.metadata`` is laid out by rank (``schema_version`` 5): rank 0 reads its head and its
own part through one open, each other rank its own part (one open each); no rank reads
the whole file.

Opens are counted with an audit hook (``sys.addaudithook``: every ``open``, ``io.open``
and ``os.open`` of the process raises the ``open`` event), so a read through any layer
(DCP's file system, fsspec, resumekit's storage) is seen, not resumekit's own bookkeeping.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resumekit import CheckpointManager
from resumekit.tensors import metadata_file
from tests.dist.tiny_fsdp2 import tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor().clone() for key, value in model.state_dict().items()}


def _metadata_opens() -> tuple[list[str], list[bool]]:
    """A list each open of a file named ``.metadata`` is added to while the flag is set.

    The hook lives as long as this rank's process (audit hooks cannot be removed).
    """
    opened: list[str] = []
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, Path)):
            path = str(args[0] if not isinstance(args[0], bytes) else args[0].decode())
            if path.endswith(".metadata"):
                opened.append(path)

    sys.addaudithook(hook)
    return opened, active


def _flip_in_part(target: Path, rank: int) -> None:
    """Change one byte in the middle of writing rank ``rank``'s part of ``target``."""
    data = bytearray(target.read_bytes())
    length, expected = metadata_file.read_head_length(bytes(data), str(target))
    head = metadata_file.parse_head(
        bytes(data[metadata_file.FRAME_BYTES:metadata_file.FRAME_BYTES + length]), expected,
        str(target))
    offset, size, _ = head.parts[rank]
    data[head.base + offset + size // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _restore(rank: int, world_size: int, root: str, corrupt: bool | str, verify: bool
             ) -> dict[str, Any]:
    model, optimizer = tiny_fsdp2_adamw()
    manager = CheckpointManager(root, model=model, optimizer=optimizer)
    _train(model, optimizer, seed=1)
    manager.save(1)
    at_1 = _weights(model)
    _train(model, optimizer, seed=2)
    manager.save(2)
    at_2 = _weights(model)
    manager.close()
    dist.barrier()
    target = Path(root) / "step_000000002" / "tensors" / ".metadata"
    if corrupt == "part 1" and rank == 0:  # in rank 1's part: only rank 1 reads it
        _flip_in_part(target, 1)
    elif corrupt and rank == 0:  # one byte changed, the size kept: only the checksum tells
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    dist.barrier()
    model, optimizer = tiny_fsdp2_adamw()
    _train(model, optimizer, seed=9)
    manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                verify_on_restore=verify)
    opened, active = _metadata_opens()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = manager.restore()
    active[0] = False
    manager.close()
    expected = at_1 if step == 1 else at_2
    got = _weights(model)
    return {"step": step, "opened": list(opened), "target": str(target),
            "warnings": [str(w.message) for w in caught],
            "same": all(torch.equal(expected[key], got[key]) for key in expected)}


@pytest.mark.parametrize("verify", [True, False])
def test_rank_0_opens_the_metadata_once_for_its_head_and_part_rank_1_once_for_its_part(
        tmp_path: Path, verify: bool) -> None:
    results = run_ranks(_restore, world_size=2, args=(str(tmp_path), False, verify))
    for rank, result in enumerate(results):
        assert result["step"] == 2 and result["same"], (rank, result)
    target = results[0]["target"]
    assert results[0]["opened"] == [target], results[0]["opened"]  # head and part, one open
    assert results[1]["opened"] == [target], results[1]["opened"]  # its part


def test_a_corrupt_metadata_read_by_rank_0_is_named_on_both_ranks_which_fall_back_together(
        tmp_path: Path) -> None:
    results = run_ranks(_restore, world_size=2, args=(str(tmp_path), True, True))
    target = results[0]["target"]
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        named = [w for w in result["warnings"]
                 if target in w and "fails its checksum" in w and "step 2" in w]
        assert named, (rank, result["warnings"])
    step_1 = target.replace("step_000000002", "step_000000001")
    for result in results:  # the head or a part of step 2, then step 1's
        assert set(result["opened"]) <= {target, step_1}, result["opened"]
        assert result["opened"][-1] == step_1, result["opened"]



def test_a_damaged_part_read_by_rank_1_alone_is_named_on_both_ranks_which_fall_back_together(
        tmp_path: Path) -> None:
    results = run_ranks(_restore, world_size=2, args=(str(tmp_path), "part 1", True))
    target = results[0]["target"]
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["same"], (rank, result)
        named = [w for w in result["warnings"] if target in w and "step 2" in w
                 and "rank 1's part fails its checksum" in w and "set aside" in w]
        assert named, (rank, result["warnings"])
    assert (tmp_path / "step_000000002").exists() is False  # set aside, as a damaged file
