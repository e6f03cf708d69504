"""The public module path ``resumekit.export``.

Consolidating a sharded checkpoint into safetensors or one torch file, without a process group.
The code lives in ``resumekit.tools.export`` (docs/design.md); this path is kept for good.
"""

from resumekit.tools.export import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_NAME_FORMATS,
    MODEL_PREFIX,
    NOT_MODEL_KEYS,
    SAFETENSORS_DTYPES,
    CheckpointTarget,
    ExportLayout,
    ExportResult,
    export_checkpoint,
    export_torch,
    open_target,
    parse_dtype,
    plan_shards,
    read_full_state,
    select_committed,
    tensors_url,
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
