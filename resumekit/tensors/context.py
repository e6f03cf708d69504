"""The conditions a tensor save or load runs under: its process group, GC and CRC switches.

Shared by :mod:`resumekit.tensors.save` and :mod:`resumekit.tensors.load`; nothing here
reads or writes a checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import cast

import torch.distributed as dist
from fsspec.core import split_protocol
from torch.serialization import get_crc32_options, set_crc32_options

__all__ = [
    "NO_DIST_WARNING",
    "collection_paused",
    "directory_str",
    "local_path",
    "paused_collection",
    "quiet_no_dist",
    "resolve_group",
    "without_zip_crc32",
]

NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of DCP's warning that it assumes one process."""

_CRC32_LOCK = threading.Lock()
_crc32_users = [0, True]  # saves in flight, the setting to restore when the last one ends


@contextmanager
def without_zip_crc32() -> Generator[None, None, None]:
    """Skip the zip CRC-32 ``torch.save`` computes over every byte DCP writes.

    The commit store hashes every file (XXH3-128, in the manifest) anyway, and the CRC is a
    single-core pass over all the data (its cost: ``docs/performance.md``). Files written
    so still load with ``torch.load``. The switch is process-wide, so overlapping saves
    share it under a counter and the last one out restores the previous setting.
    """
    with _CRC32_LOCK:
        if _crc32_users[0] == 0:
            _crc32_users[1] = get_crc32_options()
            set_crc32_options(False)
        _crc32_users[0] += 1
    try:
        yield
    finally:
        with _CRC32_LOCK:
            _crc32_users[0] -= 1
            if _crc32_users[0] == 0:
                set_crc32_options(bool(_crc32_users[1]))


@contextmanager
def paused_collection(background: bool) -> Generator[None, None, None]:
    """Pause Python's cyclic garbage collector for a foreground save or load.

    Planning, writing and reading create several objects per tensor that all stay alive
    until the end; with thousands of tensors the collector's passes over them cost more
    than the work itself (measured: ``docs/performance.md``, per-tensor overhead). Only on
    the main thread and never for a background save, whose pause would cover the training
    loop; the previous setting is restored, and nothing is collected that would not be
    collected later anyway.
    """
    if (background or threading.current_thread() is not threading.main_thread()
            or not gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def collection_paused() -> contextlib.AbstractContextManager[None]:
    """Pause Python's cyclic garbage collector here, on the main thread only.

    For foreground work that allocates a few objects per tensor (captures, fingerprints):
    as :func:`save` and :func:`load` do for DCP's plan objects. Never on another thread
    (a background save's pause would cover the training loop); the previous setting is
    restored.
    """
    return paused_collection(False)


def resolve_group(
    process_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, bool]:
    """The group to run on and whether to run single-process (``None``: the default group)."""
    group = process_group
    if group is None and dist.is_available() and dist.is_initialized():
        group = cast(dist.ProcessGroup, dist.group.WORLD)
    if group is None or dist.get_world_size(group) == 1:
        return None, True
    return group, False


@contextmanager
def quiet_no_dist(no_dist: bool) -> Generator[None, None, None]:
    """Silence DCP's "assuming single process" warning when single-process is the intent.

    Only on the main thread: ``catch_warnings`` swaps the process-wide filter list, and a
    background save restoring it could drop filters the main thread set meanwhile.
    """
    if not no_dist or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        yield


def directory_str(directory: str | os.PathLike[str]) -> str:
    """``directory`` as a string."""
    return os.fspath(directory)


def local_path(directory: str) -> str | None:
    """The local filesystem path of ``directory``, or ``None`` for a non-local URL."""
    protocol, path = split_protocol(directory)
    if protocol is None:
        return directory
    if protocol in ("file", "local"):
        return str(path)
    return None

