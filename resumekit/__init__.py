"""resumekit: preemption-proof checkpoints for PyTorch distributed training.

The public API is re-exported here and imported lazily on first use, so light users
do not import torch at all: the commit store (``catalog``, ``commit``, ``retention``) and
the command line's ``--help``, ``inspect ROOT``, ``verify`` and ``prune``
(``tests/unit/test_cli_imports.py``, ``tests/unit/test_public_api.py``). Each module
behind it does one job (see ``docs/design.md``, which also says what is public).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resumekit._version import __version__

if TYPE_CHECKING:
    from resumekit.catalog import (
        CheckpointEntry,
        latest_committed,
        list_checkpoints,
        read_manifest,
        verify_checkpoint,
    )
    from resumekit.commit import (
        CommitProtocol,
    )
    from resumekit.distributed import (
        DistributedContext,
        init_distributed,
        meet,
        shutdown,
    )
    from resumekit.errors import (
        AsyncSaveError,
        CheckpointNotFoundError,
        ConfigurationError,
        CoordinationError,
        CorruptCheckpointError,
        DistributedSetupError,
        FencedWriterError,
        ForeignCheckpointError,
        IncompatibleCheckpointError,
        IncompatibleVersionError,
        IncompleteCheckpointError,
        ManifestError,
        PreemptionError,
        ResumekitError,
        ResumeStepError,
        StepCollisionError,
        StorageError,
        UnreadableFormatError,
        UnsafeCheckpointError,
        UnsupportedSchemaError,
    )
    from resumekit.importers import (
        ImportResult,
        import_checkpoint,
    )
    from resumekit.layout import (
        NameFormat,
    )
    from resumekit.manager import (
        CheckpointInfo,
        CheckpointManager,
    )
    from resumekit.manifest import (
        Lineage,
        Manifest,
        SaveReason,
    )
    from resumekit.preemption import (
        EXIT_CODE_PREEMPTED,
        PreemptionHandler,
        requeue_after_signal,
        requeue_slurm_job,
    )
    from resumekit.retention import (
        RetentionPolicy,
        keep_all,
        keep_best,
        keep_every,
        keep_last,
        keep_steps,
        prune,
    )
    from resumekit.rng import (
        capture_rng,
        restore_rng,
        select_rank_rng,
    )
    from resumekit.sampler import (
        ResumableDistributedSampler,
        SkipAheadSampler,
        wrap_sampler,
    )
    from resumekit.sharded import (
        StorageReader,
    )
    from resumekit.state import (
        StatefulGroup,
    )
    from resumekit.storage import (
        Storage,
    )
    from resumekit.warnings import (
        ResumekitWarning,
    )

_EXPORTS: dict[str, str] = {
    "AsyncSaveError": "resumekit.errors",
    "CheckpointEntry": "resumekit.catalog",
    "CheckpointInfo": "resumekit.manager",
    "CheckpointManager": "resumekit.manager",
    "CheckpointNotFoundError": "resumekit.errors",
    "CommitProtocol": "resumekit.commit",
    "ConfigurationError": "resumekit.errors",
    "CoordinationError": "resumekit.errors",
    "CorruptCheckpointError": "resumekit.errors",
    "DistributedContext": "resumekit.distributed",
    "DistributedSetupError": "resumekit.errors",
    "EXIT_CODE_PREEMPTED": "resumekit.preemption",
    "FencedWriterError": "resumekit.errors",
    "ForeignCheckpointError": "resumekit.errors",
    "ImportResult": "resumekit.importers",
    "IncompatibleCheckpointError": "resumekit.errors",
    "IncompatibleVersionError": "resumekit.errors",
    "IncompleteCheckpointError": "resumekit.errors",
    "Lineage": "resumekit.manifest",
    "Manifest": "resumekit.manifest",
    "ManifestError": "resumekit.errors",
    "NameFormat": "resumekit.layout",
    "PreemptionError": "resumekit.errors",
    "PreemptionHandler": "resumekit.preemption",
    "ResumableDistributedSampler": "resumekit.sampler",
    "ResumeStepError": "resumekit.errors",
    "ResumekitError": "resumekit.errors",
    "ResumekitWarning": "resumekit.warnings",
    "RetentionPolicy": "resumekit.retention",
    "SaveReason": "resumekit.manifest",
    "SkipAheadSampler": "resumekit.sampler",
    "StatefulGroup": "resumekit.state",
    "StepCollisionError": "resumekit.errors",
    "Storage": "resumekit.storage",
    "StorageError": "resumekit.errors",
    "StorageReader": "resumekit.sharded",
    "UnreadableFormatError": "resumekit.errors",
    "UnsafeCheckpointError": "resumekit.errors",
    "UnsupportedSchemaError": "resumekit.errors",
    "capture_rng": "resumekit.rng",
    "import_checkpoint": "resumekit.importers",
    "init_distributed": "resumekit.distributed",
    "keep_all": "resumekit.retention",
    "keep_best": "resumekit.retention",
    "keep_every": "resumekit.retention",
    "keep_last": "resumekit.retention",
    "keep_steps": "resumekit.retention",
    "latest_committed": "resumekit.catalog",
    "list_checkpoints": "resumekit.catalog",
    "meet": "resumekit.distributed",
    "prune": "resumekit.retention",
    "read_manifest": "resumekit.catalog",
    "requeue_after_signal": "resumekit.preemption",
    "requeue_slurm_job": "resumekit.preemption",
    "restore_rng": "resumekit.rng",
    "select_rank_rng": "resumekit.rng",
    "shutdown": "resumekit.distributed",
    "verify_checkpoint": "resumekit.catalog",
    "wrap_sampler": "resumekit.sampler",
}

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "AsyncSaveError",
    "CheckpointEntry",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommitProtocol",
    "ConfigurationError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DistributedContext",
    "DistributedSetupError",
    "FencedWriterError",
    "ForeignCheckpointError",
    "ImportResult",
    "IncompatibleCheckpointError",
    "IncompatibleVersionError",
    "IncompleteCheckpointError",
    "Lineage",
    "Manifest",
    "ManifestError",
    "NameFormat",
    "PreemptionError",
    "PreemptionHandler",
    "ResumableDistributedSampler",
    "ResumeStepError",
    "ResumekitError",
    "ResumekitWarning",
    "RetentionPolicy",
    "SaveReason",
    "SkipAheadSampler",
    "StatefulGroup",
    "StepCollisionError",
    "Storage",
    "StorageError",
    "StorageReader",
    "UnreadableFormatError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "__version__",
    "capture_rng",
    "import_checkpoint",
    "init_distributed",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_steps",
    "latest_committed",
    "list_checkpoints",
    "meet",
    "prune",
    "read_manifest",
    "requeue_after_signal",
    "requeue_slurm_job",
    "restore_rng",
    "select_rank_rng",
    "shutdown",
    "verify_checkpoint",
    "wrap_sampler",
]



def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resumekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
