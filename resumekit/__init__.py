"""resumekit: preemption-proof checkpoints for PyTorch distributed training."""

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

__version__ = "0.1.0"

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
