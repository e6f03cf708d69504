"""resumekit: preemption-proof checkpoints for PyTorch distributed training.

``__all__`` holds what a trainer calls (about thirty names: the manager and its options,
process groups, preemption and requeue, the samplers, retention policies, the main errors);
everything else is imported from the module that defines it (``resumekit.errors``,
``resumekit.store.catalog``, ...; docs/api.md lists each, by subpackage). A name this
package exported up to 0.3.0 and no longer does still resolves as ``resumekit.<name>``,
with one :class:`~resumekit.warnings.MovedNameWarning` naming its module (``_MOVED``).

The names are imported lazily on first use, so light users do not import torch at all:
the commit store and the command line's ``--help``, ``inspect ROOT``, ``verify`` and
``prune`` (``tests/unit/test_cli_imports.py``, ``tests/unit/test_public_api.py``). Each
module behind it does one job (``docs/design.md``).
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
        CheckpointLoadError,
        CheckpointNotFoundError,
        ConfigurationError,
        CorruptCheckpointError,
        IncompatibleCheckpointError,
        PreemptionError,
        ResumekitError,
    )
    from resumekit.manager import (
        CheckpointManager,
    )
    from resumekit.options import (
        CheckpointOptions,
        LocalTier,
    )
    from resumekit.runtime.distributed import (
        DistributedContext,
        init_distributed,
        meet,
        shutdown,
    )
    from resumekit.runtime.preemption import (
        EXIT_CODE_PREEMPTED,
        PreemptionHandler,
        protect_loader_workers,
    )
    from resumekit.runtime.requeue import (
        requeue_after_signal,
        requeue_slurm_job,
    )
    from resumekit.state.sampler import (
        ResumableDistributedSampler,
        SkipAheadSampler,
        wrap_sampler,
    )
    from resumekit.state.train_state import (
        StatefulGroup,
    )
    from resumekit.store.retention import (
        RetentionPolicy,
        keep_all,
        keep_best,
        keep_every,
        keep_last,
        keep_steps,
    )
    from resumekit.tensors import (
        StorageReader,
    )
    from resumekit.tools.importers import (
        import_checkpoint,
    )
    from resumekit.warnings import (
        ResumekitWarning,
    )

#: What a trainer calls: each name -> the module that defines it (imported on first use).
_EXPORTS: dict[str, str] = {
    "AsyncSaveError": "resumekit.errors",
    "CheckpointLoadError": "resumekit.errors",
    "CheckpointManager": "resumekit.manager",
    "CheckpointNotFoundError": "resumekit.errors",
    "CheckpointOptions": "resumekit.options",
    "ConfigurationError": "resumekit.errors",
    "CorruptCheckpointError": "resumekit.errors",
    "DistributedContext": "resumekit.runtime.distributed",
    "EXIT_CODE_PREEMPTED": "resumekit.runtime.preemption",
    "IncompatibleCheckpointError": "resumekit.errors",
    "LocalTier": "resumekit.options",
    "PreemptionError": "resumekit.errors",
    "PreemptionHandler": "resumekit.runtime.preemption",
    "ResumableDistributedSampler": "resumekit.state.sampler",
    "ResumekitError": "resumekit.errors",
    "ResumekitWarning": "resumekit.warnings",
    "RetentionPolicy": "resumekit.store.retention",
    "SkipAheadSampler": "resumekit.state.sampler",
    "StatefulGroup": "resumekit.state.train_state",
    "StorageReader": "resumekit.tensors",
    "import_checkpoint": "resumekit.tools.importers",
    "init_distributed": "resumekit.runtime.distributed",
    "keep_all": "resumekit.store.retention",
    "keep_best": "resumekit.store.retention",
    "keep_every": "resumekit.store.retention",
    "keep_last": "resumekit.store.retention",
    "keep_steps": "resumekit.store.retention",
    "meet": "resumekit.runtime.distributed",
    "protect_loader_workers": "resumekit.runtime.preemption",
    "requeue_after_signal": "resumekit.runtime.requeue",
    "requeue_slurm_job": "resumekit.runtime.requeue",
    "shutdown": "resumekit.runtime.distributed",
    "wrap_sampler": "resumekit.state.sampler",
}

#: Names ``resumekit`` exported up to 0.3.0 that a trainer does not call: each still
#: resolves as ``resumekit.<name>``, with one :class:`MovedNameWarning` naming its module
#: (the public path now, documented on docs/api.md), until 0.5.0.
_MOVED: dict[str, str] = {
    "CheckpointEntry": "resumekit.store.catalog",
    "CheckpointInfo": "resumekit.manager",
    "CommitClock": "resumekit.runtime.save_clock",
    "CommitProtocol": "resumekit.store.commit",
    "CoordinationError": "resumekit.errors",
    "DistributedSetupError": "resumekit.errors",
    "EmergencySaveSkippedWarning": "resumekit.runtime.preemption",
    "FencedWriterError": "resumekit.errors",
    "ForeignCheckpointError": "resumekit.errors",
    "ImportResult": "resumekit.tools.importers",
    "IncompatibleVersionError": "resumekit.errors",
    "IncompleteCheckpointError": "resumekit.errors",
    "Lineage": "resumekit.store.manifest",
    "LocalTierMissWarning": "resumekit.warnings",
    "Manifest": "resumekit.store.manifest",
    "ManifestError": "resumekit.errors",
    "MissingDependencyError": "resumekit.errors",
    "NameFormat": "resumekit.store.layout",
    "REQUEUE_SIGNALS": "resumekit.runtime.requeue",
    "ResumeStepError": "resumekit.errors",
    "SaveEstimate": "resumekit.runtime.save_clock",
    "SaveReason": "resumekit.store.manifest",
    "SaveThroughput": "resumekit.store.manifest",
    "StepCollisionError": "resumekit.errors",
    "Storage": "resumekit.store.storage",
    "StorageError": "resumekit.errors",
    "UnreadableFormatError": "resumekit.errors",
    "UnsafeCheckpointError": "resumekit.errors",
    "UnsupportedSchemaError": "resumekit.errors",
    "UnsupportedTorchWarning": "resumekit.warnings",
    "WriterProcessError": "resumekit.errors",
    "capture_rng": "resumekit.state.rng",
    "current_context": "resumekit.runtime.distributed",
    "latest_committed": "resumekit.store.newest",
    "list_checkpoints": "resumekit.store.catalog",
    "prune": "resumekit.store.retention",
    "read_manifest": "resumekit.store.catalog",
    "restore_rng": "resumekit.state.rng",
    "select_rank_rng": "resumekit.state.rng",
    "verify_checkpoint": "resumekit.store.catalog",
}

__all__ = [
    "EXIT_CODE_PREEMPTED",
    "AsyncSaveError",
    "CheckpointLoadError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "ConfigurationError",
    "CorruptCheckpointError",
    "DistributedContext",
    "IncompatibleCheckpointError",
    "LocalTier",
    "PreemptionError",
    "PreemptionHandler",
    "ResumableDistributedSampler",
    "ResumekitError",
    "ResumekitWarning",
    "RetentionPolicy",
    "SkipAheadSampler",
    "StatefulGroup",
    "StorageReader",
    "__version__",
    "import_checkpoint",
    "init_distributed",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_steps",
    "meet",
    "protect_loader_workers",
    "requeue_after_signal",
    "requeue_slurm_job",
    "shutdown",
    "wrap_sampler",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'resumekit' has no attribute {name!r}")
    from resumekit.warnings import MovedNameWarning, warn  # noqa: PLC0415 - only to warn

    warn(f"resumekit.{name} moved: import it from its module, `from {home} import {name}` "
         f"(`resumekit.{name}` resolves only to say so, until 0.5.0; see CHANGELOG.md)",
         MovedNameWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)
