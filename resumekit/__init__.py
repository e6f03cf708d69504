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

from resumekit import _compat
from resumekit._version import __version__


def _warn_if_torch_unsupported() -> None:
    """Warn (never refuse) when the installed torch is outside the supported releases."""
    # Without importing torch: `import resumekit` stays light (tests/unit/test_cli_imports.py).
    problem = _compat.torch_version_problem(_compat.torch_version())
    if problem is not None:
        from resumekit.warnings import UnsupportedTorchWarning, warn  # noqa: PLC0415 - only to warn

        warn(f"resumekit {__version__}: {problem}", UnsupportedTorchWarning)


_warn_if_torch_unsupported()

if TYPE_CHECKING:
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
        MissingDependencyError,
        PreemptionError,
        ResumekitError,
        ResumeStepError,
        StepCollisionError,
        StorageError,
        UnreadableFormatError,
        UnsafeCheckpointError,
        UnsupportedSchemaError,
        WriterProcessError,
    )
    from resumekit.manager import (
        CheckpointInfo,
        CheckpointManager,
    )
    from resumekit.options import (
        CheckpointOptions,
        LocalTier,
    )
    from resumekit.runtime.distributed import (
        DistributedContext,
        current_context,
        init_distributed,
        meet,
        shutdown,
    )
    from resumekit.runtime.preemption import (
        EXIT_CODE_PREEMPTED,
        EmergencySaveSkippedWarning,
        PreemptionHandler,
        protect_loader_workers,
    )
    from resumekit.runtime.requeue import REQUEUE_SIGNALS, requeue_after_signal, requeue_slurm_job
    from resumekit.runtime.save_clock import CommitClock, SaveEstimate
    from resumekit.state.rng import (
        capture_rng,
        restore_rng,
        select_rank_rng,
    )
    from resumekit.state.sampler import (
        ResumableDistributedSampler,
        SkipAheadSampler,
        wrap_sampler,
    )
    from resumekit.state.train_state import (
        StatefulGroup,
    )
    from resumekit.store.catalog import (
        CheckpointEntry,
        list_checkpoints,
        read_manifest,
        verify_checkpoint,
    )
    from resumekit.store.commit import (
        CommitProtocol,
    )
    from resumekit.store.layout import (
        NameFormat,
    )
    from resumekit.store.manifest import (
        Lineage,
        Manifest,
        SaveReason,
        SaveThroughput,
    )
    from resumekit.store.newest import (
        latest_committed,
    )
    from resumekit.store.retention import (
        RetentionPolicy,
        keep_all,
        keep_best,
        keep_every,
        keep_last,
        keep_steps,
        prune,
    )
    from resumekit.store.storage import (
        Storage,
    )
    from resumekit.tensors import (
        StorageReader,
    )
    from resumekit.tools.importers import (
        ImportResult,
        import_checkpoint,
    )
    from resumekit.warnings import (
        LocalTierMissWarning,
        ResumekitWarning,
        UnsupportedTorchWarning,
    )

_EXPORTS: dict[str, str] = {
    "AsyncSaveError": "resumekit.errors",
    "CheckpointEntry": "resumekit.store.catalog",
    "CheckpointInfo": "resumekit.manager",
    "CheckpointManager": "resumekit.manager",
    "CheckpointNotFoundError": "resumekit.errors",
    "CheckpointOptions": "resumekit.options",
    "CommitClock": "resumekit.runtime.save_clock",
    "CommitProtocol": "resumekit.store.commit",
    "ConfigurationError": "resumekit.errors",
    "CoordinationError": "resumekit.errors",
    "CorruptCheckpointError": "resumekit.errors",
    "DistributedContext": "resumekit.runtime.distributed",
    "DistributedSetupError": "resumekit.errors",
    "EXIT_CODE_PREEMPTED": "resumekit.runtime.preemption",
    "FencedWriterError": "resumekit.errors",
    "ForeignCheckpointError": "resumekit.errors",
    "ImportResult": "resumekit.tools.importers",
    "IncompatibleCheckpointError": "resumekit.errors",
    "IncompatibleVersionError": "resumekit.errors",
    "IncompleteCheckpointError": "resumekit.errors",
    "Lineage": "resumekit.store.manifest",
    "LocalTier": "resumekit.options",
    "SaveEstimate": "resumekit.runtime.save_clock",
    "SaveThroughput": "resumekit.store.manifest",
    "Manifest": "resumekit.store.manifest",
    "ManifestError": "resumekit.errors",
    "MissingDependencyError": "resumekit.errors",
    "NameFormat": "resumekit.store.layout",
    "PreemptionError": "resumekit.errors",
    "PreemptionHandler": "resumekit.runtime.preemption",
    "protect_loader_workers": "resumekit.runtime.preemption",
    "EmergencySaveSkippedWarning": "resumekit.runtime.preemption",
    "REQUEUE_SIGNALS": "resumekit.runtime.requeue",
    "ResumableDistributedSampler": "resumekit.state.sampler",
    "ResumeStepError": "resumekit.errors",
    "ResumekitError": "resumekit.errors",
    "ResumekitWarning": "resumekit.warnings",
    "LocalTierMissWarning": "resumekit.warnings",
    "RetentionPolicy": "resumekit.store.retention",
    "SaveReason": "resumekit.store.manifest",
    "SkipAheadSampler": "resumekit.state.sampler",
    "StatefulGroup": "resumekit.state.train_state",
    "StepCollisionError": "resumekit.errors",
    "Storage": "resumekit.store.storage",
    "StorageError": "resumekit.errors",
    "StorageReader": "resumekit.tensors",
    "UnreadableFormatError": "resumekit.errors",
    "UnsafeCheckpointError": "resumekit.errors",
    "UnsupportedSchemaError": "resumekit.errors",
    "UnsupportedTorchWarning": "resumekit.warnings",
    "WriterProcessError": "resumekit.errors",
    "capture_rng": "resumekit.state.rng",
    "current_context": "resumekit.runtime.distributed",
    "import_checkpoint": "resumekit.tools.importers",
    "init_distributed": "resumekit.runtime.distributed",
    "keep_all": "resumekit.store.retention",
    "keep_best": "resumekit.store.retention",
    "keep_every": "resumekit.store.retention",
    "keep_last": "resumekit.store.retention",
    "keep_steps": "resumekit.store.retention",
    "latest_committed": "resumekit.store.newest",
    "list_checkpoints": "resumekit.store.catalog",
    "meet": "resumekit.runtime.distributed",
    "prune": "resumekit.store.retention",
    "read_manifest": "resumekit.store.catalog",
    "requeue_after_signal": "resumekit.runtime.requeue",
    "requeue_slurm_job": "resumekit.runtime.requeue",
    "restore_rng": "resumekit.state.rng",
    "select_rank_rng": "resumekit.state.rng",
    "shutdown": "resumekit.runtime.distributed",
    "verify_checkpoint": "resumekit.store.catalog",
    "wrap_sampler": "resumekit.state.sampler",
}

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "REQUEUE_SIGNALS",
    "AsyncSaveError",
    "CheckpointEntry",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CommitClock",
    "CommitProtocol",
    "ConfigurationError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DistributedContext",
    "DistributedSetupError",
    "EmergencySaveSkippedWarning",
    "FencedWriterError",
    "ForeignCheckpointError",
    "ImportResult",
    "IncompatibleCheckpointError",
    "IncompatibleVersionError",
    "IncompleteCheckpointError",
    "Lineage",
    "LocalTier",
    "LocalTierMissWarning",
    "Manifest",
    "ManifestError",
    "MissingDependencyError",
    "NameFormat",
    "PreemptionError",
    "PreemptionHandler",
    "ResumableDistributedSampler",
    "ResumeStepError",
    "ResumekitError",
    "ResumekitWarning",
    "RetentionPolicy",
    "SaveEstimate",
    "SaveReason",
    "SaveThroughput",
    "SkipAheadSampler",
    "StatefulGroup",
    "StepCollisionError",
    "Storage",
    "StorageError",
    "StorageReader",
    "UnreadableFormatError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "UnsupportedTorchWarning",
    "WriterProcessError",
    "__version__",
    "capture_rng",
    "current_context",
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
    "protect_loader_workers",
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
