"""Every private name of torch, s3fs and Lightning that resumekit touches, in one place.

Each name carries one comment: why resumekit needs it and what breaks if it moves. The
canary test (``tests/unit/test_private_names_canary.py``) imports each one and checks the
signature or fields resumekit relies on, so an upgrade of torch fails loudly in one test
rather than silently in a checkpoint. This module imports no torch at import time (the
store, which imports no torch, reaches s3fs through it): torch names are looked up by the
functions that need them.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

# --------------------------------------------------------------------- tensors: raw format


def dcp_storage_info() -> type[Any]:
    """DCP's ``torch.distributed.checkpoint.filesystem._StorageInfo``, the class itself.

    The one private torch name of the raw tensor format (:mod:`resumekit.tensors.raw`).
    """
    # .metadata pickles every item's place as it; if it moves, no old checkpoint unpickles.
    module = importlib.import_module("torch.distributed.checkpoint.filesystem")
    return cast("type[Any]", module._StorageInfo)
