"""Consolidate a sharded checkpoint's model weights into safetensors files.

A resumekit checkpoint keeps the model sharded the way the ranks held it (DCP: one file
per rank plus ``.metadata``). Inference code wants whole tensors in safetensors files.
:func:`export_checkpoint` produces them **without a process group** and with memory
bounded by the largest tensor, not the model:

1. the tensor index (names, global shapes, dtypes) is read from the checkpoint metadata
   through the allow-list unpickler - no tensor data, no code from the checkpoint;
2. the tensors are packed, in checkpoint order, into output files of at most
   ``max_shard_bytes`` (a tensor larger than that gets a file of its own), so every
   file's safetensors header (names, dtypes, shapes, byte offsets) is known up front;
3. each file is written as header first, then each tensor's bytes streamed in order:
   one tensor is assembled from its shards (:func:`resumekit.tensors.iter_full_tensors`),
   cast if asked, written, and dropped before the next is read.

Peak memory is therefore about one full tensor as stored plus its cast copy (at most
twice the largest tensor), whatever the model's size. Output layouts:

* ``plain``: ``OUT/model.safetensors``, or ``OUT/model-00001-of-0000N.safetensors`` and
  ``OUT/model.safetensors.index.json`` when split (the Hugging Face convention), plus
  ``OUT/config.json`` when a model config is known (transformers' ``from_pretrained``);
* ``diffusers``: ``OUT/transformer/diffusion_pytorch_model.safetensors`` (split the same
  way, with ``diffusion_pytorch_model.safetensors.index.json``) and
  ``OUT/transformer/config.json`` - LingBot-VA's upstream inference layout, which
  :mod:`resumekit.tools.legacy` also imports, and what diffusers'
  ``ModelMixin.from_pretrained(OUT, subfolder="transformer")`` reads. It needs a model
  config: ``model_config=`` (``--model-config FILE.json``) or the manifest's
  ``extras.model_config``; without one the export is refused before anything is written.

The model config, when known, becomes ``config.json`` unchanged plus a ``_resumekit`` key
(step, source directory name). No artifact records a local path.

Plain DCP directories (``dcp.save`` output, torchtitan ``step-N``) export too: their
model tensors are those under ``model`` or, without one, the top-level ones (torchtitan).
:func:`export_torch` writes one ``torch.save`` file instead, as DCP's
``dcp_to_torch_save`` does.

Keys are the model's own parameter names (the checkpoint's ``model.`` prefix removed), so
``model.load_state_dict(safetensors.torch.load_file(...))`` works on the unwrapped model.
Floating-point tensors are cast to ``dtype`` when one is given; integer and boolean
tensors (buffers such as counters) keep theirs. Byte order is the machine's (little-endian
on every platform PyTorch supports), as safetensors requires.

Finding the checkpoint a path points at (:func:`~resumekit.store.targets.open_target`,
:func:`~resumekit.store.targets.select_committed`) is :mod:`resumekit.store.targets`'
job; those names are re-exported here for code that imported them from this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Literal, cast

import torch

from resumekit import tensors as tensor_io
from resumekit.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    ResumekitError,
    StorageError,
)
from resumekit.store.catalog import verify_checkpoint
from resumekit.store.foreign import detect_foreign
from resumekit.store.layout import MANIFEST_NAME, NameFormat
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage
from resumekit.store.targets import (
    DEFAULT_NAME_FORMATS,  # re-exported: its home is targets
    CheckpointTarget,  # re-exported: its home is targets
    open_target,
    select_committed,
    split_parent,
    tensors_url,
)
from resumekit.tensors import (
    read_full_state,  # re-exported: its home is the tensors wing
    state_dicts,
)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_NAME_FORMATS",
    "MODEL_PREFIX",
    "NOT_MODEL_KEYS",
    "SAFETENSORS_DTYPES",
    "CheckpointTarget",
    "ExportLayout",
    "ExportResult",
    "export_checkpoint",
    "export_torch",
    "open_target",
    "parse_dtype",
    "plan_shards",
    "read_full_state",
    "select_committed",
    "tensors_url",
]

ExportLayout = Literal["plain", "diffusers"]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""Largest output file (5 GiB) before the export is split into several files."""

MODEL_PREFIX = "model."
"""Prefix of model tensors in a checkpoint's tensor index (removed on export)."""

NOT_MODEL_KEYS = frozenset({"optimizer", "optim", "opt", "optimizers", "lr_scheduler",
                            "lr_schedulers", "scheduler", "dataloader", "train_state",
                            "extra", "rng"})
"""Top-level keys of a DCP checkpoint without a ``model`` entry (torchtitan keeps the
model's keys at the top level) that are not model weights."""

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""The safetensors name of every dtype an export can write."""

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}

_LAYOUT_FILES: dict[str, tuple[str, str]] = {
    # layout -> (sub-directory, file stem)
    "plain": ("", "model"),
    "diffusers": ("transformer", "diffusion_pytorch_model"),
}
_CONFIG_NAME = "config.json"
_CONFIG_SOURCES = ("extras.model_config", "fingerprint.config.model")


# --------------------------------------------------------------------------- planning


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Return the torch dtype named by ``dtype`` (``bf16``, ``fp32``...); None keeps.

    Raises:
        ConfigurationError: An unknown name, or a dtype safetensors cannot store.
    """
    if dtype is None or dtype == "keep":
        return None
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        found = _DTYPE_NAMES.get(dtype.lower())
        if found is None:
            raise ConfigurationError(
                f"dtype {dtype!r} is not one of {sorted(_DTYPE_NAMES)} or 'keep'",
                name="dtype", value=dtype,
            )
        resolved = found
    if not resolved.is_floating_point or resolved not in SAFETENSORS_DTYPES:
        raise ConfigurationError(
            f"dtype {resolved} cannot be an export dtype (a floating-point safetensors "
            "dtype is needed)", name="dtype", value=str(dtype),
        )
    return resolved


@dataclass(frozen=True)
class _PlannedTensor:
    source: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass
class _PlannedFile:
    tensors: list[_PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


def _output_dtype(stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    if wanted is not None and stored.is_floating_point:
        return wanted
    return stored


def plan_shards(
    index: Mapping[str, tensor_io.TensorInfo],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[list[tuple[str, str, tuple[int, ...], torch.dtype, int]]]:
    """Pack the model tensors of a tensor index into output files.

    Tensors keep checkpoint order; a file is closed when the next tensor would take it
    past ``max_shard_bytes`` (a tensor larger than the limit gets a file of its own).

    Args:
        index: :func:`resumekit.tensors.read_tensor_index` output.
        dtype: Output dtype of floating-point tensors (None keeps the stored one).
        max_shard_bytes: Largest file payload before splitting.

    Returns:
        One list per file of ``(checkpoint name, output name, shape, output dtype,
        output bytes)``.

    Raises:
        ConfigurationError: ``max_shard_bytes`` is not positive, or a tensor's dtype has
            no safetensors name.
    """
    return [
        [(t.source, t.name, t.shape, t.dtype, t.nbytes) for t in planned.tensors]
        for planned in _plan(index, dtype, max_shard_bytes)
    ]


def _tied_names(manifest: Manifest | None) -> dict[str, str]:
    """``{alias: kept}``: model entries the checkpoint stored once (tied weights)."""
    tied = None if manifest is None else manifest.state.get("tied")
    return {str(k): str(v) for k, v in tied.items()} if isinstance(tied, dict) else {}


def _add_tied(files: list[_PlannedFile], manifest: Manifest | None) -> None:
    """Write each tied alias next to the tensor it shares, under its own name.

    A tied checkpoint stores ``lm_head.weight`` once, as ``transformer.wte.weight``; the
    export lists both names, so ``load_state_dict(..., strict=True)`` finds every key.
    """
    tied = _tied_names(manifest)
    for planned in files:
        by_name = {tensor.name: tensor for tensor in planned.tensors}
        for alias, kept in tied.items():
            tensor = by_name.get(kept)
            if tensor is not None and alias not in by_name:
                planned.tensors.append(_PlannedTensor(tensor.source, alias, tensor.shape,
                                                      tensor.dtype, tensor.nbytes))


def _plan(
    index: Mapping[str, tensor_io.TensorInfo], dtype: torch.dtype | None, max_shard_bytes: int,
    names: Mapping[str, str] | None = None,
) -> list[_PlannedFile]:
    if max_shard_bytes < 1:
        raise ConfigurationError(
            f"max_shard_bytes must be >= 1, got {max_shard_bytes}",
            name="max_shard_bytes", value=max_shard_bytes,
        )
    files: list[_PlannedFile] = [_PlannedFile()]
    if names is None:
        names = {fqn: fqn[len(MODEL_PREFIX):] for fqn in index if fqn.startswith(MODEL_PREFIX)}
    for fqn, info in index.items():
        if fqn not in names:
            continue
        out_dtype = _output_dtype(info.dtype, dtype)
        if out_dtype not in SAFETENSORS_DTYPES:
            raise ConfigurationError(
                f"tensor {fqn!r} has dtype {out_dtype}, which safetensors cannot store",
                name="dtype", value=str(out_dtype),
            )
        numel = 1
        for size in info.shape:
            numel *= size
        planned = _PlannedTensor(fqn, names[fqn], info.shape, out_dtype,
                                 numel * out_dtype.itemsize)
        current = files[-1]
        if current.tensors and current.nbytes + planned.nbytes > max_shard_bytes:
            current = _PlannedFile()
            files.append(current)
        current.tensors.append(planned)
    return [planned for planned in files if planned.tensors]


def _header(planned: _PlannedFile, metadata: Mapping[str, str]) -> bytes:
    document: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for tensor in planned.tensors:
        document[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(document, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded


def _file_names(layout: str, count: int) -> list[str]:
    _, stem = _LAYOUT_FILES[layout]
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# --------------------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        step: The checkpoint step exported.
        source: The checkpoint directory read.
        out: The directory holding the weight files (``OUT/transformer`` for diffusers).
        files: Weight files written, relative to ``out``, in order.
        index: The ``*.safetensors.index.json`` written (relative to ``out``), if split.
        config: The ``config.json`` written (whenever a model config is known), relative
            to ``out``.
        config_source: Where the config came from (``model_config`` or the file name of
            ``--model-config``, ``extras.model_config``, ``fingerprint.config.model``), or
            None when none is known (then no ``config.json`` is written).
        tensors: Number of tensors written.
        total_bytes: Tensor bytes written (headers excluded).
        largest_tensor_bytes: The largest tensor as stored in the checkpoint: the unit
            the export's memory use is bounded by.
        weight_map: ``{tensor name: file}`` of every tensor written.
    """

    step: int
    source: str
    out: str
    files: list[str]
    index: str | None
    config: str | None
    config_source: str | None
    tensors: int
    total_bytes: int
    largest_tensor_bytes: int
    weight_map: dict[str, str]


def _config_for(manifest: Manifest) -> tuple[dict[str, Any], str | None]:
    roots: dict[str, Any] = {"extras": manifest.extras, "fingerprint": manifest.fingerprint}
    for source in _CONFIG_SOURCES:
        value: Any = roots
        for part in source.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, dict) and value:
            return dict(value), source
    return {}, None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


@dataclass(frozen=True)
class _Source:
    """The DCP tensor directory an export reads, and what is known about it."""

    url: str
    step: int
    name: str  # the checkpoint directory's own name (recorded in artifacts: no path)
    path: str
    manifest: Manifest | None  # None: a plain DCP directory (no resumekit manifest)
    names: dict[str, str]  # tensor FQN in the checkpoint -> name in the export


def _plain_dcp(url: str, options: Mapping[str, Any]) -> bool:
    storage = Storage(url, dict(options))
    return storage.is_dir() and storage.exists(tensor_io.METADATA_FILE) \
        and not storage.exists(MANIFEST_NAME)


def _model_names(metadata: Any, index: Mapping[str, tensor_io.TensorInfo]) -> dict[str, str]:
    """Model tensors of a DCP checkpoint and their export names.

    Under a top-level ``model`` entry (resumekit, ``dcp.save({"model": ...})``) the
    ``model.`` prefix is removed; without one (torchtitan puts the model's keys at the top
    level), every top-level tensor that is not optimizer, scheduler, data-loader or
    training state is a model weight.
    """
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def top(fqn: str) -> str:
        path = paths.get(fqn)
        return str(path[0]) if isinstance(path, tuple) and path else fqn.split(".", 1)[0]

    if any(top(fqn) == "model" for fqn in index):
        return {fqn: fqn[len(MODEL_PREFIX):] for fqn in index
                if top(fqn) == "model" and fqn.startswith(MODEL_PREFIX)}
    return {fqn: fqn for fqn in index if top(fqn) not in NOT_MODEL_KEYS}


def _resolve(root_or_dir: str | os.PathLike[str], step: int | None, *,
             storage_options: Mapping[str, Any] | None, name_format: str | NameFormat | None,
             verify: bool) -> _Source:
    url = os.fspath(root_or_dir)
    options = dict(storage_options or {})
    if _plain_dcp(url, options):
        parent_url, name = split_parent(url)
        found = detect_foreign(Storage(parent_url, options), name)
        recorded = None if found is None else found.step
        path = Storage(url, options).path()
        if step is not None and recorded is not None and step != recorded:
            raise CheckpointNotFoundError(f"{path} is step {recorded}, not step {step}",
                                          path=path, step=step)
        manifest = None
        resolved_step = recorded if recorded is not None else (step or 0)
        source = url
    else:
        target = open_target(url, storage_options=storage_options, name_format=name_format)
        entry = select_committed(target, step)
        assert entry.manifest is not None  # committed entries carry their manifest
        manifest = entry.manifest
        if verify:
            verify_checkpoint(target.storage, entry.name, manifest=manifest)
        source, name, path, resolved_step = (tensors_url(target.storage, entry), entry.name,
                                             entry.path, entry.step)
    metadata = tensor_io.read_metadata(source, storage_options)  # read once, for both
    names = _model_names(metadata, tensor_io.tensor_index_of(metadata))
    if not names:
        raise CheckpointNotFoundError(
            f"{path} (step {resolved_step}) holds no model tensors to export",
            path=path, step=resolved_step,
        )
    return _Source(source, resolved_step, name.rsplit("/", 1)[-1], path, manifest, names)


def _read_model_config(model_config: str | os.PathLike[str] | Mapping[str, Any] | None
                       ) -> tuple[dict[str, Any], str] | None:
    if model_config is None:
        return None
    if isinstance(model_config, Mapping):
        return dict(model_config), "model_config"
    path = os.fspath(model_config)
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except OSError as error:
        raise ConfigurationError(f"--model-config {path}: cannot be read ({error})",
                                 name="model_config", value=path) from error
    except ValueError as error:
        raise ConfigurationError(f"--model-config {path}: not valid JSON ({error})",
                                 name="model_config", value=path) from error
    if not isinstance(document, dict) or not document:
        raise ConfigurationError(f"--model-config {path}: expected a non-empty JSON object",
                                 name="model_config", value=path)
    return document, os.path.basename(path)


def export_checkpoint(
    root_or_dir: str | os.PathLike[str],
    step: int | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    layout: ExportLayout = "plain",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    out_storage_options: Mapping[str, Any] | None = None,
    name_format: str | NameFormat | None = None,
    overwrite: bool = False,
    verify: bool = False,
    model_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write a checkpoint's model weights as consolidated safetensors files.

    Needs no process group: any single process can export a checkpoint written by any
    number of ranks. Memory is bounded by the largest tensor (see the module docstring).
    No artifact records a local path: the source is named by its directory name only.

    Args:
        root_or_dir: A checkpoint root, one checkpoint directory, or a plain DCP
            directory (one holding ``.metadata``: ``dcp.save`` output, torchtitan
            ``step-N``) - path or fsspec URL.
        step: The step to export; None exports the newest committed checkpoint of a root
            (or the directory given).
        out: Output directory (path or fsspec URL); created if needed.
        dtype: Cast floating-point tensors to ``"bf16"``, ``"fp16"``, ``"fp32"`` (or a
            torch dtype); None or ``"keep"`` writes them as stored.
        layout: ``"plain"`` (``model.safetensors``, plus ``config.json`` when a model
            config is known) or ``"diffusers"``
            (``transformer/diffusion_pytorch_model.safetensors`` + ``config.json``, which
            needs a model config).
        max_shard_bytes: Split into several files (plus an index) above this size.
        progress: Called as ``progress(done, total)`` after each tensor: tensor bytes
            written so far and in all.
        storage_options: fsspec options for reading the checkpoint.
        out_storage_options: fsspec options for ``out`` (default: ``storage_options``).
        name_format: Step-name template of the root (detected when None).
        overwrite: Replace existing exported weights in ``out``; otherwise they are an
            error. Old files of the same layout are removed first.
        verify: Re-hash the checkpoint's files against its manifest before exporting.
        model_config: The model's config (a dict or a JSON file) for ``config.json``;
            default: the manifest's ``extras.model_config`` (or
            ``fingerprint.config.model``).

    Returns:
        What was written.

    Raises:
        CheckpointNotFoundError: No committed checkpoint of ``step``, or it holds no
            model tensors.
        UnsafeCheckpointError: The checkpoint's metadata would run code, or its manifest
            lists a path outside its directory (nothing is written).
        ConfigurationError: A bad ``dtype``, ``layout``, ``max_shard_bytes`` or
            ``model_config``; ``layout="diffusers"`` without any model config; or ``out``
            already holds an export and ``overwrite`` is False (nothing is written).
        CorruptCheckpointError: A shard is unreadable, or fails verification.
        StorageError: An output file could not be written (naming it and the cause; a
            full disk also the free space and the bytes the export needs,
            ``needed_bytes``). Whatever the export wrote is removed first, whatever the
            error.
    """
    if out is None:
        raise ConfigurationError("export needs an output directory (out)", name="out",
                                 value=None)
    if layout not in _LAYOUT_FILES:
        raise ConfigurationError(
            f"layout {layout!r} is not one of {sorted(_LAYOUT_FILES)}", name="layout",
            value=layout,
        )
    wanted = parse_dtype(dtype)
    given_config = _read_model_config(model_config)
    source = _resolve(root_or_dir, step, storage_options=storage_options,
                      name_format=name_format, verify=verify)
    config, config_source = given_config if given_config is not None else (
        _config_for(source.manifest) if source.manifest is not None else ({}, None))
    if layout == "diffusers" and config_source is None:
        raise ConfigurationError(
            f"--layout diffusers needs the model's config for config.json, and {source.path} "
            "records none (no extras.model_config in its manifest): pass --model-config "
            "FILE.json (model_config=...), or save with extras={'model_config': ...}",
            name="model_config", value=None, path=source.path,
        )
    index = tensor_io.read_tensor_index(source.url, storage_options=storage_options)
    files = _plan(index, wanted, max_shard_bytes, source.names)
    _add_tied(files, source.manifest)
    subdir, stem = _LAYOUT_FILES[layout]
    options = dict(storage_options or {}) if out_storage_options is None \
        else dict(out_storage_options)
    out_url = os.fspath(out)
    base = Storage(out_url, options)
    out_store = base if not subdir else Storage(_join(out_url, subdir), options)
    _clear_previous(out_store, stem, overwrite, config=config_source is not None)
    names = _file_names(layout, len(files))
    metadata = {"format": "pt", "resumekit_step": str(source.step),
                "resumekit_source": source.name}
    weight_map: dict[str, str] = {}
    order = [tensor for planned in files for tensor in planned.tensors]
    stream = tensor_io.iter_full_tensors(source.url, [t.source for t in order],
                                       storage_options=storage_options)
    largest = max(index[fqn].nbytes for fqn in source.names)
    total = sum(planned.nbytes for planned in files)
    written = 0

    def advance(count: int) -> None:
        nonlocal written
        written += count
        if progress is not None:
            progress(written, total)

    index_name: str | None = None
    config_name: str | None = None
    with _removed_if_failed(out_store, sum(
            len(_header(planned, metadata)) + planned.nbytes for planned in files),
    ) as written_names:
        for planned, name in zip(files, names, strict=True):
            written_names.append(name)
            _write_file(out_store, name, planned, metadata=metadata, stream=stream,
                        progress=advance)
            weight_map.update({tensor.name: name for tensor in planned.tensors})
        if len(files) > 1:
            index_name = f"{stem}.safetensors.index.json"
            document = {"metadata": {"total_size": total, "resumekit_step": source.step},
                        "weight_map": weight_map}
            written_names.append(index_name)
            out_store.write_bytes(index_name, _json_bytes(document))
        if config_source is not None:
            config["_resumekit"] = {"step": source.step, "source": source.name,
                                    "config_source": config_source}
            config_name = _CONFIG_NAME
            written_names.append(config_name)
            out_store.write_bytes(config_name, _json_bytes(config))
    return ExportResult(
        step=source.step, source=source.path, out=out_store.path(), files=names,
        index=index_name, config=config_name, config_source=config_source,
        tensors=len(order), total_bytes=total, largest_tensor_bytes=largest,
        weight_map=weight_map,
    )


def export_torch(
    root_or_dir: str | os.PathLike[str],
    step: int | None = None,
    out: str | os.PathLike[str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    name_format: str | NameFormat | None = None,
    overwrite: bool = False,
    verify: bool = False,
) -> ExportResult:
    """Write a checkpoint as one ``torch.save`` file, as ``dcp_to_torch_save`` would.

    The file holds the checkpoint's whole nested state dict (``{"model": ...,
    "optimizer": ...}`` for a resumekit checkpoint), every tensor whole and as stored,
    readable with ``torch.load(path, weights_only=True)``. The whole state is held in
    memory once. Written under a temporary name and renamed into place (local paths).

    Args:
        root_or_dir: As for :func:`export_checkpoint` (plain DCP directories included).
        step: The step to export (None: the newest committed).
        out: The output file (``FILE.pt``; a local path).
        storage_options: fsspec options for reading the checkpoint.
        name_format: Step-name template of the root (detected when None).
        overwrite: Replace an existing ``out``.
        verify: Re-hash the checkpoint's files against its manifest first.

    Returns:
        What was written (``files`` is the one file, ``out`` its directory).

    Raises:
        ConfigurationError: No ``out``, or it exists and ``overwrite`` is False.
        CheckpointNotFoundError: No committed checkpoint of ``step``.
        StorageError: ``out`` could not be written (naming it and the cause; a full disk
            also the free space and at least the bytes it needs, its tensors',
            ``needed_bytes``). The partial file is removed first.
    """
    if out is None:
        raise ConfigurationError("export --format torch needs an output file (--out FILE.pt)",
                                 name="out", value=None)
    target = os.path.abspath(os.fspath(out))
    if os.path.isdir(target):
        raise ConfigurationError(
            f"{target} is a directory; --format torch writes one file (--out FILE.pt)",
            name="out", value=target)
    if os.path.exists(target) and not overwrite:
        raise ConfigurationError(
            f"{target} already exists; pass overwrite=True (--overwrite) to replace it",
            name="out", value=target)
    source = _resolve(root_or_dir, step, storage_options=storage_options,
                      name_format=name_format, verify=verify)
    state = read_full_state(source.url, storage_options)
    if source.manifest is not None and isinstance(state.get("model"), dict):
        state = state_dicts.retie(state, _tied_names(source.manifest))
    tensors = tensor_io.flatten_state(state)
    sizes = [v.numel() * v.element_size() for v in tensors.values()
             if isinstance(v, torch.Tensor)]
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(target)}.tmp-"
                                        f"{secrets.token_hex(4)}")
    store = Storage(directory)
    try:
        with store.open(os.path.basename(temporary), "wb") as handle:
            kept = _KeptWriteError(handle)
            try:
                torch.save(state, cast(IO[bytes], kept))
            except RuntimeError as error:
                if kept.error is None:
                    raise
                raise kept.error from error  # torch's report drops the write's cause
        os.replace(temporary, target)
    except BaseException as error:
        left = _remove_written(store, [os.path.basename(temporary)])
        failure = _export_failure(error, target, directory, sum(sizes), left, at_least=True)
        if failure is error:
            raise
        raise failure from error
    return ExportResult(
        step=source.step, source=source.path, out=directory,
        files=[os.path.basename(target)], index=None, config=None, config_source=None,
        tensors=len(sizes), total_bytes=sum(sizes), largest_tensor_bytes=max(sizes, default=0),
        weight_map={},
    )


class _KeptWriteError:
    """A file for ``torch.save`` that keeps the ``OSError`` of a failed write.

    torch's archive writer reports a failed write as a ``RuntimeError`` of its own
    (``[enforce fail at inline_container.cc] ...``) without the cause, such as ``ENOSPC``.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


@contextlib.contextmanager
def _removed_if_failed(store: Storage, needed: int) -> Iterator[list[str]]:
    """Track the files an export writes to ``store``; if it fails, remove them.

    The block appends each name before writing it; the error raised names the last one
    (see :func:`_export_failure`).
    """
    names: list[str] = []
    try:
        yield names
    except BaseException as error:
        left = _remove_written(store, names)
        where = store.path(names[-1]) if names else store.path()
        failure = _export_failure(error, where, store.path(), needed, left, at_least=False)
        if failure is error:
            raise
        raise failure from error


def _remove_written(store: Storage, names: list[str]) -> list[str]:
    """Remove what a failed export wrote (``names``, and their temporaries' leftovers).

    Returns:
        The paths that could not be removed (each also logged by the error it names).
    """
    left: list[str] = []
    for name in names:
        try:
            store.remove_file(name)
        except StorageError:
            left.append(store.path(name))
    return left


def _export_failure(error: BaseException, where: str, out: str, needed: int,
                    left: list[str], *, at_least: bool) -> BaseException:
    """The error to raise for an export that failed writing ``where`` (and cleaned up).

    An ``OSError`` becomes a :class:`StorageError` naming the file, the cause and, for a
    full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``), the free space and the bytes the export
    needs; any other error is returned unchanged, with a note of files it could not remove.
    """
    remains = (f"; could not remove {', '.join(left)}" if left else
               f"; nothing of it was left in {out}")
    if not isinstance(error, OSError) or isinstance(error, ResumekitError):
        if left:
            error.add_note(f"the export{remains}")
        return error
    code = error.errno
    detail = f"{type(error).__name__}: {error}"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        reason = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file is too large "
                  "for the filesystem", errno.EDQUOT: "the disk quota is exhausted"}[code]
        free = ""
        if "://" not in out:
            with contextlib.suppress(OSError):
                free = f"; {shutil.disk_usage(out).free} bytes free"
        detail = f"{reason} ({os.strerror(code)}{free}) [errno {code}]"
    amount = f"at least {needed}" if at_least else f"{needed}"
    failure = StorageError(
        f"cannot export to {where}: {detail}; the export needs {amount} bytes{remains}",
        path=where, file=os.path.basename(where), operation="export", errno=code,
        needed_bytes=needed, left=left)
    failure.strerror = os.strerror(code) if isinstance(code, int) else None
    failure.filename = where
    return failure


def _join(url: str, name: str) -> str:
    if "://" in url:
        return posixpath.join(url.rstrip("/"), name)
    return os.path.join(url, name)


def _json_bytes(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, indent=2, sort_keys=False).encode("utf-8") + b"\n"


def _clear_previous(out_store: Storage, stem: str, overwrite: bool, *,
                    config: bool = False) -> None:
    """Refuse (or, with ``overwrite``, remove) files a previous export left in ``out``."""
    listing = [info.name for info in out_store.list_dir() if not info.is_dir]
    previous = [
        name for name in listing
        if name.startswith(stem)
        and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json"))
    ] + [name for name in listing if config and name == _CONFIG_NAME]
    if previous and not overwrite:
        raise ConfigurationError(
            f"{out_store.path(previous[0])} already exists; pass overwrite=True "
            f"(--overwrite) to replace the export in {out_store.path()}",
            name="out", value=out_store.path(),
        )
    for name in previous:
        out_store.remove_file(name)


def _write_file(
    out_store: Storage,
    name: str,
    planned: _PlannedFile,
    *,
    metadata: Mapping[str, str],
    stream: Any,
    progress: Callable[[int], None] | None,
) -> None:
    """Write one safetensors file: header, then each tensor's bytes in planned order.

    Locally the file is written under a hidden temporary name and renamed into place, so
    a crash never leaves a truncated file under the final name; an object store makes the
    object visible only when its upload completes.
    """
    temporary = f".{name}.tmp-{secrets.token_hex(4)}" if out_store.is_local else name
    try:
        with out_store.open(temporary, "wb") as handle:
            handle.write(_header(planned, metadata))
            for tensor_plan in planned.tensors:
                fqn, tensor = next(stream)
                if fqn != tensor_plan.source:
                    raise CorruptCheckpointError(
                        f"expected tensor {tensor_plan.source!r} from the checkpoint, "
                        f"read {fqn!r}", file=name, key=fqn,
                    )
                if tuple(tensor.shape) != tensor_plan.shape:
                    raise CorruptCheckpointError(
                        f"tensor {fqn!r} has shape {tuple(tensor.shape)}, its metadata says "
                        f"{tensor_plan.shape}", file=name, key=fqn,
                    )
                converted = tensor if tensor.dtype == tensor_plan.dtype \
                    else tensor.to(tensor_plan.dtype)
                del tensor  # the stored copy is no longer needed once converted
                payload = _tensor_bytes(converted)
                if payload.nbytes != tensor_plan.nbytes:
                    raise CorruptCheckpointError(
                        f"tensor {fqn!r} has {payload.nbytes} bytes, {tensor_plan.nbytes} "
                        "planned", file=name, key=fqn,
                    )
                handle.write(payload)
                del payload, converted
                if progress is not None:
                    progress(tensor_plan.nbytes)
        if temporary != name:
            out_store.fs.mv(out_store.path(temporary), out_store.path(name))
    except BaseException:
        if temporary != name:
            out_store.remove_file(temporary)
        raise
