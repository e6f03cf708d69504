"""Model weights only, from another run's checkpoint: how a fine-tune starts.

torchtitan calls it ``initial_load_path`` + ``initial_load_model_only``. The weights of a
committed resumekit checkpoint (a root's newest, a given step, or one step directory)
are read into the model - resharded through DCP, so a checkpoint of N ranks loads into
a model sharded over M - and nothing else is touched: no step, optimizer, scheduler, RNG
or data position comes from the source, and its configuration is not compared.
:meth:`resumekit.CheckpointManager.load_weights` uses this only while its own root holds
no committed checkpoint, so a requeued fine-tune resumes its own checkpoints.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resumekit import tensors as tensor_io
from resumekit.errors import CheckpointNotFoundError, IncompatibleCheckpointError
from resumekit.restore.verification import verify_share
from resumekit.store.catalog import list_checkpoints, read_manifest
from resumekit.store.layout import DEFAULT_NAME_FORMAT, TENSORS_DIR, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, Manifest
from resumekit.store.storage import Storage
from resumekit.tensors import state_dicts
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["WeightsSource", "load_model_weights", "resolve_weights_source"]



@dataclass(frozen=True)
class WeightsSource:
    """The committed checkpoint weights are read from.

    Attributes:
        step: Its step.
        path: Its step directory.
        tensors_url: Its tensor directory.
        manifest: Its manifest.
        verified: Its tensor metadata was hashed and its raw tensor files size-checked
            (``resolve_weights_source(verify=True)``): a load that then fails while its
            raw files are checked as they are read is a
            :class:`~resumekit.errors.CheckpointLoadError`, not damage.
    """

    step: int
    path: str
    tensors_url: str
    manifest: Manifest
    verified: bool = False


def resolve_weights_source(source: str | os.PathLike[str], step: int | None = None, *,
                           name_format: str | NameFormat = DEFAULT_NAME_FORMAT,
                           storage_options: Mapping[str, Any] | None = None,
                           verify: bool = True) -> WeightsSource:
    """Find the committed checkpoint ``source`` names, and verify its tensor files.

    Args:
        source: A checkpoint root (its newest committed checkpoint, or ``step``'s) or one
            step directory (holding ``manifest.json``).
        step: The step to read from a root; for a step directory, the step it must be.
        name_format: Step directory names of the root.
        storage_options: fsspec options.
        verify: Hash the checkpoint's tensor metadata (and size-check its raw tensor
            files, which are verified block by block as they are read).

    Raises:
        CheckpointNotFoundError: No committed checkpoint there (or not of ``step``).
        CorruptCheckpointError: A file fails its checksum.
    """
    options = dict(storage_options or {})
    names = name_format if isinstance(name_format, NameFormat) else NameFormat(name_format)
    url = os.fspath(source).rstrip("/")
    given = Storage(url, options)
    if given.is_file(MANIFEST_NAME):
        storage, chosen_name, manifest = _step_directory(given, url, names, step, options)
    else:
        storage, chosen_name, manifest = _newest_in_root(given, names, step)
    tensors = storage.url_of(f"{chosen_name}/{manifest.data_path(TENSORS_DIR)}")
    if verify:
        verify_share(storage, chosen_name, manifest, under=TENSORS_DIR)
    return WeightsSource(manifest.step, storage.path(chosen_name), tensors, manifest,
                         verified=verify)


def _step_directory(given: Storage, url: str, names: NameFormat, step: int | None,
                    options: dict[str, Any]) -> tuple[Storage, str, Manifest]:
    """One step directory: its parent root, its name and manifest (of ``step``, if given)."""
    parent_url, name = posixpath.split(url) if "://" in url else os.path.split(url)
    storage = Storage(parent_url or ".", options)
    entries = [e for e in list_checkpoints(storage, names)
               if e.name == name and e.status == "committed"]
    # A step directory under another name than ``names``: read its manifest.
    manifest = entries[0].manifest if entries else read_manifest(storage, name)
    assert manifest is not None
    if step is not None and manifest.step != step:
        raise CheckpointNotFoundError(
            f"{given.path()} is step {manifest.step}, not step {step}",
            path=given.path(), step=step)
    return storage, name, manifest


def _newest_in_root(storage: Storage, names: NameFormat, step: int | None
                    ) -> tuple[Storage, str, Manifest]:
    """A root's newest committed checkpoint (or ``step``'s): the root, its name, manifest."""
    if not storage.is_dir():
        raise CheckpointNotFoundError(
            f"cannot load weights from {storage.path()}: no such directory",
            path=storage.path())
    committed = [e for e in list_checkpoints(storage, names)
                 if e.status == "committed" and (step is None or e.step == step)]
    if not committed:
        which = "a committed checkpoint" if step is None else \
            f"a committed checkpoint of step {step}"
        raise CheckpointNotFoundError(
            f"cannot load weights from {storage.path()}: it holds no {which}",
            path=storage.path(), step=step)
    entry = committed[-1]
    assert entry.manifest is not None
    return storage, entry.name, entry.manifest


def load_model_weights(model: nn.Module, source: WeightsSource, *, strict: bool = True,
                       process_group: dist.ProcessGroup | None = None,
                       storage_options: Mapping[str, Any] | None = None,
                       verify: bool = True, read_once: bool = False) -> list[str]:
    """Read ``source``'s model tensors into ``model`` (plain, DDP, compiled or FSDP2).

    Args:
        model: The model; FSDP2 shards are read as this rank needs them (resharding).
        source: From :func:`resolve_weights_source`.
        strict: Every model entry must be in the checkpoint with its shape and dtype, and
            the checkpoint may hold no other model tensor. False loads the entries that
            fit and warns, naming every one that does not (a new head, a dropped layer).
        process_group: Group for DCP's collectives (None: WORLD when initialised).
        storage_options: fsspec options.
        verify: Check every byte read from raw tensor files against its checksum.
        read_once: Replicated weights (DDP, HSDP) are read by one rank and sent to the
            others over ``process_group`` (:mod:`resumekit.tensors.shared_reads`).

    Returns:
        The model entries that were not loaded (empty when ``strict``).

    Raises:
        IncompatibleCheckpointError: ``strict`` and the weights do not fit (nothing is
            loaded).
        CheckpointLoadError: The load failed on bytes that were checked against their
            checksums (``source.verified`` and ``verify``): code interpreting them failed.
        UnreadableFormatError: The load failed on bytes nothing checked.
    """
    recorded = source.manifest.state.get("tied")
    tied: dict[str, str] = {str(k): str(v) for k, v in recorded.items()} \
        if isinstance(recorded, dict) else {}
    full = state_dicts.model_state_dict(model)
    target = state_dicts.untie({"model": full}, tied)
    skipped: list[str] = []
    if not strict:
        index = tensor_io.read_tensor_index(source.tensors_url, storage_options=storage_options)
        fits: dict[str, Any] = {}
        for name, value in target["model"].items():
            info = index.get(f"model.{name}")
            if info is not None and isinstance(value, torch.Tensor) and \
                    tuple(value.shape) == info.shape and value.dtype == info.dtype:
                fits[name] = value
            else:
                skipped.append(name if info is None else
                               f"{name} (checkpoint {list(info.shape)} {info.dtype})")
        unexpected = sorted(fqn[len("model."):] for fqn in index
                            if fqn.startswith("model.") and fqn[len("model."):] not in full)
        target = {"model": fits}
        if skipped or unexpected:
            message = (f"loading weights from {source.path} (step {source.step}) with "
                       f"strict=False: {len(skipped)} model entries keep their current "
                       f"values ({', '.join(skipped) or 'none'}); {len(unexpected)} "
                       f"checkpoint tensors are not used ({', '.join(unexpected) or 'none'})")
            warn(message, ResumekitWarning, stacklevel=3)
        _load_model_part(target, source, process_group, storage_options, verify,
                         allow_more=True, read_once=read_once)
        loaded = state_dicts.retie(target, {a: k for a, k in tied.items() if k in fits})
        state_dicts.load_model_state(model, loaded["model"], strict=False, model_keys=full)
        return skipped
    try:
        _load_model_part(target, source, process_group, storage_options, verify,
                         allow_more=False, read_once=read_once)
    except IncompatibleCheckpointError as error:
        raise IncompatibleCheckpointError(
            f"the weights of {source.path} (step {source.step}) do not fit the model "
            f"(nothing was loaded; pass strict=False to load what fits): {error}",
            path=source.path, differences=getattr(error, "differences", None)) from error
    state_dicts.load_model_state(model, state_dicts.retie(target, tied)["model"],
                                 strict=True, model_keys=full)
    return skipped


def _load_model_part(target: dict[str, Any], source: WeightsSource,
                     process_group: dist.ProcessGroup | None,
                     storage_options: Mapping[str, Any] | None, verify: bool, *,
                     allow_more: bool, read_once: bool) -> None:
    verified = source.verified and verify
    if allow_more:
        tensor_io.load_subset(target, source.tensors_url, process_group=process_group,
                              storage_options=storage_options, verify=verify,
                              read_once=read_once, verified=verified)
    else:
        tensor_io.load(target, source.tensors_url, process_group=process_group,
                       storage_options=storage_options, verify=verify, read_once=read_once,
                       verified=verified)
