"""replayed_save.seed: the record a restored checkpoint's metadata makes, and its refusals."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

from resumekit.tensors import replayed_save, save_planner
from resumekit.tensors.raw import MEMBER_DESCRIPTORS

PROPERTIES = TensorProperties.create_from_tensor(torch.zeros(2))
DESCRIPTOR = "resumekit-raw/3;4096;__0_checksums"  # any non-empty descriptor list


def _metadata(*, second_rank: int = 1, descriptors: list[str] | None = None,
              member: tuple[str, ...] | None = MEMBER_DESCRIPTORS) -> Metadata:
    """``w`` (4 floats) sharded over two ranks, ``step`` (bytes) on rank 0.

    ``step`` is a packed member after the first, described by ``member``.
    """
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2])),
              ChunkStorageMetadata(offsets=torch.Size([2]), sizes=torch.Size([2]))]
    described = [DESCRIPTOR] if descriptors is None else descriptors
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(PROPERTIES, torch.Size([4]), chunks),
                             "step": BytesStorageMetadata()},
        planner_data={"w": ("w",), "step": ("step",)},
        storage_data={
            MetadataIndex("w", torch.Size([0]), 0): _StorageInfo("__0_0.distcp", 0, 8,
                                                                 described),
            MetadataIndex("step"): _StorageInfo("__0_0.distcp", 4096, 40, member),
            MetadataIndex("w", torch.Size([2]), 1): _StorageInfo(
                f"__{second_rank}_0.distcp", 0, 8, described),
        })


def _seeded(metadata: Metadata, rank: int, slot: str) -> replayed_save.Replay | None:
    replayed_save.seed(slot, metadata, b"metadata bytes", rank=rank, world_size=2)
    record: replayed_save.Replay | None = save_planner.replay_record(slot)
    return record


def test_each_rank_gets_its_own_files_items_in_order_and_the_coordinator_the_metadata(
) -> None:
    zero = _seeded(_metadata(), 0, "seed-test:0")
    one = _seeded(_metadata(), 1, "seed-test:1")
    assert zero is not None and one is not None
    assert zero.key is None and one.key is None  # checked against the first save's state
    assert [name for name, _ in zero.jobs] == ["__0_0.distcp"]
    assert [(item.index.fqn, item.type) for item in zero.jobs[0][1]] == [
        ("w", WriteItemType.SHARD), ("step", WriteItemType.BYTE_IO)]
    assert zero.byte_lengths == {MetadataIndex("step"): 40}
    assert zero.shards == {"w": torch.Size([0])} and one.shards == {"w": torch.Size([2])}
    assert one.prefix == "__1_" and [name for name, _ in one.jobs] == ["__1_0.distcp"]
    assert zero.metadata_bytes == b"metadata bytes" and one.metadata_bytes is None
    assert zero.references == ("__0_0.distcp", "__0_checksums", "__1_0.distcp")
    assert zero.number == one.number == 1


@pytest.mark.parametrize(("metadata", "reason"), [
    (_metadata(second_rank=2), "__2_0.distcp is not a data file of one of this group's 2 "
                               "ranks"),
    (_metadata(descriptors=[], member=None), "not stored as raw tensor files"),
    # written before packed members were described: a save in full writes them described
    (_metadata(member=None), "step is a packed member without a descriptor"),
])
def test_a_checkpoint_the_group_cannot_replay_is_counted_but_keeps_no_record(
        metadata: Metadata, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    slot = f"seed-test:refused:{reason}"
    with caplog.at_level(logging.DEBUG, logger="resumekit.tensors.replayed_save"):
        assert _seeded(metadata, 0, slot) is None
    assert save_planner.completed_saves(slot) == 1  # the ranks still vote in step
    assert reason in caplog.text and "planned in full" in caplog.text


def test_metadata_that_names_its_save_is_not_replayed() -> None:
    metadata = _metadata()
    metadata.storage_meta = StorageMeta(checkpoint_id="somewhere")
    assert _seeded(metadata, 0, "seed-test:named") is None
