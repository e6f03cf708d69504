"""The tensors wing: a model's and optimizer's tensors written to and read from DCP.

It knows tensors, state dicts and DCP; it knows nothing of steps, manifests or commits: the
store hands it an empty staging directory, :func:`save` fills it, :func:`load` reads a
committed one back, and every rank writes only its own shards (a checkpoint written by N
ranks loads on M ranks: DCP reshards on load). The names the layers above use are
re-exported here, so they import them from the wing itself::

    from resumekit import tensors

    state = tensors.model_and_optimizer_state(model, optimizer)  # sharded views, no copy
    tensors.save(state, staging_dir, process_group=checkpoint_group)
    ...
    state = tensors.model_and_optimizer_state(model, optimizer)  # destination tensors
    tensors.load(state, step_dir, process_group=checkpoint_group)  # validated, in place
    tensors.apply_model_and_optimizer_state(model, optimizer, state)

``save`` and ``load`` here are the functions; their modules, whose names they shadow, are
``importlib.import_module("resumekit.tensors.save")`` and ``(".load")``.

Where to start reading: :mod:`resumekit.tensors.save` (the one save path) and
:mod:`resumekit.tensors.load` (the one load path), then :mod:`.state_dicts` (the views of
a model and optimizer a checkpoint stores and how they are applied back), :mod:`.reader`
(the safe readers, :class:`StorageReader`), :mod:`.index` (what a checkpoint holds) and
:mod:`.staging` (:class:`CpuStager`). :mod:`.raw` is the raw tensor format, a storage
layer under DCP with a front door of its own. docs/design.md's module table has one line
per module.

Safety: DCP reads ``.metadata`` with plain :mod:`pickle` and non-tensor values with
``torch.load(weights_only=False)``; both would run code from a tampered checkpoint. This
wing reads metadata with :mod:`resumekit.tensors.safe_pickle` and non-tensor values with
``torch.load(weights_only=True)``.

Process groups: with ``process_group=None`` the save/load is single-process when
``torch.distributed`` is not initialised and uses the default (WORLD) group when it is.
When a group is passed, every DCP collective runs on that group only. A group of one rank
is single-process too: no collective runs, so a background save of a one-GPU run never
shares the training thread's NCCL communicator (NCCL communicators are not thread-safe).

What it may import: torch, ``torch.distributed.checkpoint`` (the only wing that may, with
``_compat``: a contract in pyproject.toml), and of resumekit the runtime and the store
below it, ``errors``, ``warnings`` and ``_compat``. Every private torch name it needs is
a function of ``_compat``.
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
