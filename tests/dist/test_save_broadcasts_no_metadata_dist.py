"""A save does not send ``.metadata`` to every rank (issue 40: costs that grow with W).

``dcp.save`` ends with rank 0's ``finish`` and a broadcast of the global ``Metadata`` it
returns: at the 5B LingBot-VA shapes a pickle of the whole ``.metadata`` (tens to hundreds
of MB as W grows), made on rank 0 and unpickled by every rank at every save, for a return
value resumekit never reads. The writer empties it once written: what is broadcast is an
empty ``Metadata``, while the file on disk keeps every key; a save from remembered plans
(not DCP's loop) broadcasts its outcome only.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from resumekit import CheckpointManager
from resumekit import tensors as tensor_io
from tests.dist.tiny_fsdp2 import stepped_tiny_fsdp2_adamw
from tests.distributed_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saves_recording_broadcast_metadata(rank: int, world_size: int, root: str
                                        ) -> list[tuple[int, int]]:
    """Two saves (the second reuses remembered plans); every broadcast Metadata's size."""
    sent: list[tuple[int, int]] = []
    original = dist.broadcast_object_list

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        objects = kwargs["object_list"] if "object_list" in kwargs else args[0]
        sent.extend((len(found.state_dict_metadata), len(pickle.dumps(found)))
                    for found in objects if isinstance(found, Metadata))
        return result

    dist.broadcast_object_list = recording  # type: ignore[assignment]
    try:
        model, optimizer = stepped_tiny_fsdp2_adamw()
        manager = CheckpointManager(root, model=model, optimizer=optimizer)
        manager.save(1)
        manager.save(2)
        manager.close()
    finally:
        dist.broadcast_object_list = original
    return sent


def test_a_save_broadcasts_an_empty_metadata_and_writes_the_whole_one(
        tmp_path: Path) -> None:
    sent = run_ranks(_saves_recording_broadcast_metadata, world_size=2,
                     args=(str(tmp_path),))
    for rank in range(2):
        # the first save's (DCP's loop); the second, from remembered plans, broadcasts
        # only its outcome (resumekit.tensors.remembered_save): no Metadata at all
        assert len(sent[rank]) == 1, sent[rank]
        assert all(keys == 0 for keys, _ in sent[rank]), sent[rank]
    for step in (1, 2):
        index = tensor_io.read_tensor_index(tmp_path / f"step_{step:09d}" / "tensors")
        assert {"model.0.weight", "model.2.bias", "optimizer.state.0.weight.exp_avg"} <= \
            set(index), sorted(index)
