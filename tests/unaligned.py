"""Bytes that start off a direct-I/O boundary: what makes the raw writer copy them."""

from __future__ import annotations

import torch

from resumekit.tensors.raw.format import ALIGNMENT


def unaligned_bytes(length: int, seed: int) -> torch.Tensor:
    """``length`` random bytes starting 4 bytes past an ``ALIGNMENT`` boundary."""
    storage = torch.randint(0, 256, (length + 2 * ALIGNMENT,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
    skip = (4 - storage.data_ptr()) % ALIGNMENT
    view = storage[skip:skip + length]
    assert view.data_ptr() % ALIGNMENT == 4
    return view
