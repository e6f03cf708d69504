"""resumekit: preemption-proof checkpoints for PyTorch distributed training.

The public API is re-exported here; modules behind it each do one job (see
``docs/concepts.md`` and the architecture notes in ``docs/design.md``).
"""

from resumekit._version import __version__
from resumekit.catalog import (
    CheckpointEntry,
    latest_committed,
    list_checkpoints,
    read_manifest,
    verify_checkpoint,
)
from resumekit.commit import CommitProtocol
from resumekit.distributed import DistributedContext, init_distributed, meet, shutdown
from resumekit.errors import (
    AsyncSaveError,
    CheckpointNotFoundError,
    ConfigurationError,
    CoordinationError,
    CorruptCheckpointError,
    DistributedSetupError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    PreemptionError,
    ResumekitError,
    StepCollisionError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.layout import NameFormat
from resumekit.manager import CheckpointInfo, CheckpointManager
from resumekit.manifest import Lineage, Manifest, SaveReason
from resumekit.preemption import EXIT_CODE_PREEMPTED, PreemptionHandler, requeue_slurm_job
from resumekit.retention import (
    RetentionPolicy,
    keep_all,
    keep_every,
    keep_last,
    keep_steps,
    prune,
)
from resumekit.rng import capture_rng, restore_rng, select_rank_rng
from resumekit.sampler import ResumableDistributedSampler, SkipAheadSampler, wrap_sampler
from resumekit.storage import Storage
from resumekit.warnings import ResumekitWarning

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
    "IncompatibleCheckpointError",
    "IncompleteCheckpointError",
    "Lineage",
    "Manifest",
    "ManifestError",
    "NameFormat",
    "PreemptionError",
    "PreemptionHandler",
    "ResumableDistributedSampler",
    "ResumekitError",
    "ResumekitWarning",
    "RetentionPolicy",
    "SaveReason",
    "SkipAheadSampler",
    "StepCollisionError",
    "Storage",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "__version__",
    "capture_rng",
    "init_distributed",
    "keep_all",
    "keep_every",
    "keep_last",
    "keep_steps",
    "latest_committed",
    "list_checkpoints",
    "meet",
    "prune",
    "read_manifest",
    "requeue_slurm_job",
    "restore_rng",
    "select_rank_rng",
    "shutdown",
    "verify_checkpoint",
    "wrap_sampler",
]
