"""What a checkpoint holds, from its ``.metadata`` alone: the tensor index, the raw files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.tensors.context import directory_str
from resumekit.tensors.raw import raw_files
from resumekit.tensors.reader import CheckedMetadata, make_reader

__all__ = ["METADATA_FILE", "TensorInfo", "files_verified_on_read", "read_metadata",
           "read_tensor_index", "tensor_index_of"]

METADATA_FILE = DCP_METADATA_FILE
"""The file DCP writes last, describing every tensor and where its chunks live."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its metadata describes it.

    Attributes:
        fqn: Fully qualified name as flattened by DCP (``"model.layers.0.weight"``,
            ``"optimizer.state.layers.0.weight.exp_avg"``).
        shape: Global (unsharded) shape.
        dtype: Element type.
        nbytes: Size of the full tensor in bytes.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def read_tensor_index(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, TensorInfo]:
    """List the tensors of a checkpoint from its metadata, reading no tensor data.

    The metadata pickle is read with an allow-list unpickler: nothing in it can run code.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        storage_options: fsspec options for URLs.

    Returns:
        ``{fqn: TensorInfo}`` for every tensor, in the checkpoint's order. Non-tensor
        values (learning rates, step counters stored as Python objects) are not listed.

    Raises:
        CheckpointNotFoundError: No metadata file.
        UnsafeCheckpointError: The metadata references a disallowed global.
        CorruptCheckpointError: The metadata is unreadable.
    """
    return _tensor_index(read_metadata(directory, storage_options))


def read_metadata(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Metadata:
    """Read a checkpoint's DCP ``.metadata`` with the allow-list unpickler.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL (the tensors directory).
        storage_options: fsspec options for URLs.

    Raises:
        CheckpointNotFoundError: No metadata file.
        UnsafeCheckpointError: The metadata references a disallowed global.
        CorruptCheckpointError: The metadata is unreadable.
    """
    return make_reader(directory_str(directory), storage_options).read_metadata()


def tensor_index_of(metadata: Metadata) -> dict[str, TensorInfo]:
    """Return ``{fqn: TensorInfo}`` of the tensors ``metadata`` describes.

    The index :func:`read_tensor_index` returns, for a caller that also needs the metadata.
    """
    return _tensor_index(metadata)


def files_verified_on_read(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *,
    metadata: CheckedMetadata | None = None,
) -> set[str]:
    """Name the data files whose every byte :func:`load` checks against a checksum.

    Those are the raw tensor files (:mod:`resumekit.tensors.raw`); their ranks'
    small checksum files are not (they are hashed whole like any other file), nor are
    files in DCP's own format (earlier versions, fsspec URLs). Reads only the metadata.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        storage_options: fsspec options for URLs.
        metadata: ``directory``'s ``.metadata``, already read and checked (nothing is read).

    Returns:
        File names relative to ``directory``.
    """
    if metadata is not None:
        return set(metadata.raw_files())
    parsed = make_reader(directory_str(directory), storage_options).read_metadata()
    return raw_files(parsed.storage_data or {})


def _tensor_index(metadata: Metadata) -> dict[str, TensorInfo]:
    index: dict[str, TensorInfo] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape = tuple(int(size) for size in entry.size)
        dtype = entry.properties.dtype
        numel = 1
        for size in shape:
            numel *= size
        index[fqn] = TensorInfo(fqn, shape, dtype, numel * dtype.itemsize)
    return index


