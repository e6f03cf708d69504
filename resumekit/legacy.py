"""The public module path ``resumekit.legacy``.

Importing weights-only ``checkpoint_step_N`` directories. The code lives in
``resumekit.tools.legacy`` (docs/design.md); this path is kept for good.
"""

from resumekit.tools.legacy import (
    find_weight_files,
    load_weights_only,
    read_full_weights,
)

__all__ = [
    "find_weight_files",
    "load_weights_only",
    "read_full_weights",
]
