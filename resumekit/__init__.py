"""resumekit: preemption-proof checkpoints for PyTorch distributed training."""

from resumekit._version import __version__
from resumekit.errors import (
    AsyncSaveError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedSetupError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    ResumekitError,
    StepCollisionError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)

__all__ = [
    "AsyncSaveError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedSetupError",
    "IncompatibleCheckpointError",
    "IncompleteCheckpointError",
    "ManifestError",
    "ResumekitError",
    "StepCollisionError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "__version__",
]
