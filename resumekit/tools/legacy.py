"""Start from a weights-only checkpoint written by a trainer without resumekit.

LingBot-VA's upstream trainer writes ``checkpoint_step_N/transformer/
diffusion_pytorch_model.safetensors`` (optionally split, with a
``diffusion_pytorch_model.safetensors.index.json``) and nothing else: no optimizer,
scheduler, RNG or data position. Importing one loads the weights into the (possibly
sharded) model and sets the step to N; everything else starts fresh, and the manager
warns loudly. A legacy directory is never chosen over a committed resumekit checkpoint.

:func:`load_weights_only` reads on each rank only the bytes of the rank's own shards (a
safetensors file is a JSON header of byte ranges, then the tensors' raw bytes), one
tensor at a time, so a rank's memory grows by about one tensor's piece, not by the file
(8 ranks of LingBot-VA would otherwise hold 8 copies of ~10 GB of bf16 at once).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from resumekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
)
from resumekit.store.manifest import safe_relative_path
from resumekit.store.storage import Storage, parse_json
from resumekit.tensors import state_dicts

__all__ = ["find_weight_files", "load_weights_only", "read_full_weights"]

_INDEX_SUFFIX = ".safetensors.index.json"


def find_weight_files(storage: Storage, name: str) -> list[str]:
    """Return the safetensors files of a legacy directory, relative to the root.

    Prefers ``transformer/`` (the upstream layout); follows an ``*.index.json`` when
    present.

    Raises:
        CheckpointNotFoundError: The directory holds no safetensors weights.
    """
    files = [path for path, _ in storage.walk_files(name)]
    for folder in ("transformer/", ""):
        indexes = [p for p in files if p.startswith(folder) and p.endswith(_INDEX_SUFFIX)]
        if indexes:
            index_path = f"{name}/{indexes[0]}"
            try:
                index = storage.read_json(index_path)
                shards = sorted(set(index["weight_map"].values()))
            except UnsafeCheckpointError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise CorruptCheckpointError(
                    f"{storage.path(index_path)}: unreadable safetensors index ({error})",
                    path=storage.path(index_path), file=indexes[0],
                ) from error
            for shard in shards:
                _check_shard_name(storage.path(index_path), shard)
            base = indexes[0].rsplit("/", 1)[0] + "/" if "/" in indexes[0] else ""
            return [f"{name}/{base}{shard}" for shard in shards]
        weights = sorted(p for p in files if p.startswith(folder) and
                         p.endswith(".safetensors"))
        if weights:
            return [f"{name}/{path}" for path in weights]
    raise CheckpointNotFoundError(
        f"{storage.path(name)} holds no *.safetensors weights to import",
        path=storage.path(name),
    )


def _check_shard_name(index: str, shard: object) -> None:
    """Refuse a weight file an index names outside its folder (``..``, absolute, NUL).

    Raises:
        UnsafeCheckpointError: Naming the index file and the entry.
    """
    try:
        if not isinstance(shard, str):
            raise UnsafeCheckpointError(f"{shard!r} is not a file name", path=index)
        safe_relative_path(shard)
    except UnsafeCheckpointError:
        raise UnsafeCheckpointError(
            f"{index}: the safetensors index names the weight file {shard!r}, which is not "
            "a file beside it (absolute, '..', a backslash or a NUL byte); nothing was read",
            path=index, file=shard) from None


def read_full_weights(storage: Storage, name: str) -> dict[str, torch.Tensor]:
    """Read every tensor of a legacy directory (full, unsharded, as stored)."""
    weights: dict[str, torch.Tensor] = {}
    for relative in find_weight_files(storage, name):
        try:
            if storage.is_local:
                part = load_file(storage.path(relative))
            else:
                part = load_safetensors_bytes(storage.read_bytes(relative))
        except Exception as error:
            raise CorruptCheckpointError(
                f"{storage.path(relative)}: not a readable safetensors file ({error})",
                path=storage.path(name), file=relative,
            ) from error
        duplicated = set(part) & set(weights)
        if duplicated:
            raise CorruptCheckpointError(
                f"{storage.path(relative)}: tensor {sorted(duplicated)[0]!r} appears in two "
                "weight files", path=storage.path(name), file=relative,
            )
        weights.update(part)
    return weights


def load_weights_only(storage: Storage, name: str, model: nn.Module) -> None:
    """Load a legacy directory's weights into ``model`` (plain, DDP or FSDP2).

    Tensors are cast to the dtype of the model's parameters (upstream exports are often
    bf16 while training keeps fp32 masters). Names and shapes must match exactly, and
    are checked (from the files' headers) before anything is read or copied. Each rank
    reads only its own shards' bytes, one tensor at a time.

    Raises:
        IncompatibleCheckpointError: Missing/unexpected keys or shapes differ.
        CorruptCheckpointError: A weight file is not a readable safetensors file.
    """
    stored = _stored_tensors(storage, name)
    expected: dict[str, Any] = dict(state_dicts.model_and_optimizer_state(model, None)["model"])
    differences = [f"missing: {key}" for key in expected if key not in stored]
    differences += [f"unexpected: {key}" for key in stored if key not in expected]
    for key, want in expected.items():
        have = stored.get(key)
        if have is None:
            continue
        if not isinstance(want, torch.Tensor):
            differences.append(f"{key}: model has non-tensor {type(want).__name__}, "
                               f"weights have tensor {have.shape} {have.dtype}")
        elif tuple(want.shape) != have.shape:
            differences.append(f"{key}: model has tensor {tuple(want.shape)} {want.dtype}, "
                               f"weights have tensor {have.shape} {have.dtype}")
    if differences:
        shown = "; ".join(differences[:8])
        more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
        raise IncompatibleCheckpointError(
            f"the weights of {storage.path(name)} do not fit the model "
            f"({len(differences)} differences, nothing loaded): {shown}{more}",
            path=storage.path(name), differences=differences,
        )
    by_file: dict[str, list[str]] = {}
    for key in expected:
        by_file.setdefault(stored[key].file, []).append(key)
    with torch.no_grad():
        for relative, keys in by_file.items():
            with storage.open(relative, "rb") as stream:
                for key in sorted(keys, key=lambda k: stored[k].begin):
                    _load_piece(stream, stored[key], expected[key], storage.path(relative))
    # The state dict's tensors are the model's own (FSDP2: its sharded parameters), so
    # they hold the weights already; loading it back is a check that they are and copies
    # them in where a module hands out copies.
    state_dicts.apply_model_and_optimizer_state(model, None, {"model": expected})


@dataclass(frozen=True)
class _Stored:
    """A tensor in a safetensors file: its file, dtype, shape and byte range."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


def _stored_tensors(storage: Storage, name: str) -> dict[str, _Stored]:
    """Every tensor of a legacy directory's weight files, from their headers only."""
    found: dict[str, _Stored] = {}
    for relative in find_weight_files(storage, name):
        for key, entry in _read_header(storage, relative).items():
            if key in found:
                raise CorruptCheckpointError(
                    f"{storage.path(relative)}: tensor {key!r} appears in two weight files",
                    path=storage.path(name), file=relative,
                )
            found[key] = entry
    return found


def _read_header(storage: Storage, relative: str) -> dict[str, _Stored]:
    where = storage.path(relative)
    size = storage.size(relative)
    try:
        with storage.open(relative, "rb") as stream:
            head = stream.read(8)
            if len(head) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if not 2 <= length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} in a file of {size} bytes")
            header = parse_json(stream.read(length), source=where)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        entries: dict[str, _Stored] = {}
        for key, value in header.items():
            if key == "__metadata__":
                continue
            dtype = _DTYPES.get(value["dtype"])
            if dtype is None:
                raise ValueError(f"{key}: unknown dtype {value['dtype']!r}")
            shape = tuple(int(dim) for dim in value["shape"])
            begin, end = (int(offset) + 8 + length for offset in value["data_offsets"])
            if not 8 + length <= begin <= end <= size or \
                    end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{key}: bytes {begin}-{end} do not hold {shape} of {dtype}")
            entries[key] = _Stored(relative, dtype, shape, begin, end)
    except UnsafeCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as error:
        raise CorruptCheckpointError(
            f"{where}: not a readable safetensors file ({error})", path=where, file=relative,
        ) from error
    return entries


def _local_piece(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor to fill, and the offsets and sizes of its piece of the global one."""
    if isinstance(target, DTensor):
        # DTensor's own answer to DCP's question "which piece of the global tensor is
        # this rank's?" (its one chunk: a rank holds one shard or one replica).
        (chunk,) = target.__create_chunk_list__()
        return target.to_local(), tuple(chunk.offsets), tuple(chunk.sizes)
    return target, (0,) * target.dim(), tuple(target.shape)


def _load_piece(stream: IO[bytes], stored: _Stored, target: torch.Tensor, where: str) -> None:
    """Read this rank's piece of one stored tensor and copy it (cast) into ``target``."""
    local, offsets, sizes = _local_piece(target)
    if local.numel() == 0:
        return
    shape = stored.shape
    partial = [dim for dim in range(len(shape)) if offsets[dim] != 0 or sizes[dim] != shape[dim]]
    row = math.prod(shape[1:]) * stored.dtype.itemsize
    if not partial or partial == [0]:  # the whole tensor, or a range of rows: one range
        first = offsets[0] if shape else 0
        begin = stored.begin + first * row
        piece = _read_range(stream, begin, math.prod(sizes) * stored.dtype.itemsize, where)
        values = piece.view(stored.dtype).reshape(sizes)
    else:  # another placement: read the tensor, then narrow it
        whole = _read_range(stream, stored.begin, stored.end - stored.begin, where)
        values = whole.view(stored.dtype).reshape(shape)
        for dim in partial:
            values = values.narrow(dim, offsets[dim], sizes[dim])
    local.copy_(values)  # casts to the model's dtype


def _read_range(stream: IO[bytes], begin: int, count: int, where: str) -> torch.Tensor:
    buffer = torch.empty(count, dtype=torch.uint8)
    view = memoryview(cast(Any, buffer.numpy())).cast("B")
    stream.seek(begin)
    got = 0
    readinto = getattr(stream, "readinto", None)
    while got < count:
        if readinto is not None:
            n = readinto(view[got:])
        else:
            chunk = stream.read(count - got)
            n = len(chunk)
            view[got:got + n] = chunk
        if not n:
            raise CorruptCheckpointError(
                f"{where} ends early: {count} bytes wanted at offset {begin}",
                path=where, file=where,
            )
        got += n
    return buffer
