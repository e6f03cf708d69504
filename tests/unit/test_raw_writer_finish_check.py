"""The raw writer's ``finish`` refuses to write ``.metadata`` for an item a writer lost.

The check compares each item of the global metadata with the write results by name and
offsets (issue 40 made it compare plain pairs, not ``MetadataIndex`` objects): a result
for every chunk and value passes, one missing chunk or value is named in the error.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from resumekit.errors import StorageError
from resumekit.tensors.raw.writer import _check_every_item_stored


def _metadata() -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size((row, 0)), torch.Size((2, 3)))
              for row in (0, 2, 4)]
    return Metadata(state_dict_metadata={
        "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                         torch.Size((6, 3)), chunks),
        "step": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(()),
                                      [ChunkStorageMetadata(torch.Size(()), torch.Size(()))]),
        "lr": BytesStorageMetadata()})


def _results(skip: set[MetadataIndex]) -> list[list[WriteResult]]:
    indices = [MetadataIndex("model.w", torch.Size((row, 0))) for row in (0, 2, 4)]
    indices += [MetadataIndex("step", torch.Size(())), MetadataIndex("lr")]
    return [[WriteResult(index=index, size_in_bytes=4,
                         storage_data=_StorageInfo("__0_0.distcp", 4 * number, 4))]
            for number, index in enumerate(indices) if index not in skip]


def test_every_chunk_and_value_with_a_result_passes_the_check() -> None:
    _check_every_item_stored(_metadata(), _results(set()), "/ckpt/step_1/tensors")


@pytest.mark.parametrize(("lost", "named"), [
    (MetadataIndex("model.w", torch.Size((2, 0))), r"model\.w\[2, 0\]"),
    (MetadataIndex("step", torch.Size(())), r"step\[\]"),
    (MetadataIndex("lr"), r"lr\[\]"),
])
def test_a_chunk_or_value_without_a_result_is_named_and_nothing_is_written(
        lost: MetadataIndex, named: str) -> None:
    with pytest.raises(StorageError, match=rf"/ckpt/step_1/tensors lost 1 item.*{named}"):
        _check_every_item_stored(_metadata(), _results({lost}), "/ckpt/step_1/tensors")
