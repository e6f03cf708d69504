"""The tensors wing's front door: the save and load paths and the state-dict views, re-exported.

It knows tensors of models and optimizers, nothing about steps, manifests or commits: the
commit store hands it an empty staging directory, :func:`save` fills it, :func:`load` reads
one back. Every rank writes only its own shards, and a checkpoint written by N ranks loads
on M ranks (DCP reshards on load).

Typical use::

    state = model_and_optimizer_state(model, optimizer)      # sharded views, no copy
    save(state, staging_dir, process_group=checkpoint_group)
    ...
    state = model_and_optimizer_state(model, optimizer)      # destination tensors
    load(state, step_dir, process_group=checkpoint_group)    # validated, then in place
    apply_model_and_optimizer_state(model, optimizer, state)

Where things are: :mod:`resumekit.tensors.state_dicts` (the views and how they are applied
back), :mod:`resumekit.tensors.save` (the one save path),
:mod:`resumekit.tensors.load` (the one load path), :mod:`resumekit.tensors.reader` (safe
DCP readers, :class:`StorageReader`), :mod:`resumekit.tensors.index` (what a checkpoint
holds), :mod:`resumekit.tensors.staging` (:class:`CpuStager`). Their names are re-exported
here for callers.

Safety: DCP reads ``.metadata`` with plain :mod:`pickle` and non-tensor values with
``torch.load(weights_only=False)``; both would run code from a tampered checkpoint. This
wing reads metadata with :mod:`resumekit.tensors.safe_pickle` and non-tensor values with
``torch.load(weights_only=True)``.

Process groups: with ``process_group=None`` the save/load is single-process when
``torch.distributed`` is not initialised and uses the default (WORLD) group when it is.
When a group is passed, every DCP collective runs on that group only. A group of one rank
is single-process too: no collective runs, so a background save of a one-GPU run never
shares the training thread's NCCL communicator (NCCL communicators are not thread-safe).
"""


from __future__ import annotations

from resumekit.tensors.context import collection_paused
from resumekit.tensors.fit import flatten_state
from resumekit.tensors.index import (
    METADATA_FILE,
    TensorInfo,
    files_verified_on_read,
    read_metadata,
    read_tensor_index,
    tensor_index_of,
)
from resumekit.tensors.load import iter_full_tensors, load, load_subset, read_full_state
from resumekit.tensors.raw import WrittenFile
from resumekit.tensors.reader import CheckedMetadata, StorageReader
from resumekit.tensors.save import (
    DEFAULT_SYNC_FILES,
    DEFAULT_THREAD_COUNT,
    TENSOR_FORMATS,
    TensorFormat,
    save,
    step_files,
    tensor_format_for,
)
from resumekit.tensors.staging import CpuStager
from resumekit.tensors.state_dicts import (
    apply_full_model_state,
    apply_model_and_optimizer_state,
    canonical_param_name,
    find_tied,
    model_and_optimizer_state,
    model_state_dict,
    named_state,
    plain_state_dict,
    retie,
    untie,
)

__all__ = [
    "DEFAULT_SYNC_FILES",
    "DEFAULT_THREAD_COUNT",
    "METADATA_FILE",
    "TENSOR_FORMATS",
    "CheckedMetadata",
    "CpuStager",
    "StorageReader",
    "TensorFormat",
    "TensorInfo",
    "WrittenFile",
    "apply_full_model_state",
    "apply_model_and_optimizer_state",
    "canonical_param_name",
    "collection_paused",
    "files_verified_on_read",
    "find_tied",
    "flatten_state",
    "iter_full_tensors",
    "load",
    "load_subset",
    "model_and_optimizer_state",
    "model_state_dict",
    "named_state",
    "plain_state_dict",
    "read_full_state",
    "read_metadata",
    "read_tensor_index",
    "retie",
    "save",
    "step_files",
    "tensor_format_for",
    "tensor_index_of",
    "untie",
]
