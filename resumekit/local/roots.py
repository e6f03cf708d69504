"""A local tier's directory: its sub-roots, and which node-local copies a run may use.

A local tier's directory (``LocalTier.root``, the same path on every node) holds one
resumekit root per rank of the node and per rank whose copies it keeps::

    <local_root>/rank_00003/               rank 3's own copies (a resumekit root)
    <local_root>/replica_of_rank_00007/    rank 7's copies, kept by its partner here

Each checkpoint there records what it is in its manifest (``Manifest.local``, a
:class:`~resumekit.store.manifest.LocalPart`); :func:`unusable_reason` says why a run may
not resume from one; :func:`check_local_root` refuses a local root (or sub-root) that is
a link, or that is or lies inside the durable root. Imports no torch: ``resumekit inspect``
reads local roots too.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from resumekit.errors import ConfigurationError
from resumekit.store import generations
from resumekit.store.manifest import Manifest, WriterGeneration
from resumekit.store.storage import Storage

__all__ = [
    "SubRoot",
    "check_local_root",
    "own_root_name",
    "parse_sub_root",
    "replica_root_name",
    "sub_roots",
    "unusable_reason",
]

SubRootKind = Literal["own", "replica"]

_SUB_ROOT = re.compile(r"(rank|replica_of_rank)_(\d{5,})")


def own_root_name(rank: int) -> str:
    """The sub-root holding ``rank``'s own copies: ``rank_XXXXX``."""
    return f"rank_{rank:05d}"


def replica_root_name(rank: int) -> str:
    """The sub-root holding the replicas of ``rank``'s copies: ``replica_of_rank_XXXXX``."""
    return f"replica_of_rank_{rank:05d}"


@dataclass(frozen=True)
class SubRoot:
    """One sub-root of a local tier's directory.

    Attributes:
        name: Its directory name.
        kind: ``"own"`` (a rank's own copies) or ``"replica"`` (kept for a partner).
        rank: The rank whose copies it holds.
    """

    name: str
    kind: SubRootKind
    rank: int


def parse_sub_root(name: str) -> SubRoot | None:
    """The sub-root ``name`` is, or None when it is not one."""
    match = _SUB_ROOT.fullmatch(name)
    if match is None:
        return None
    return SubRoot(name, "own" if match.group(1) == "rank" else "replica",
                   int(match.group(2)))


def sub_roots(storage: Storage) -> list[SubRoot]:
    """The sub-roots of a local tier's directory, own ones first, each by rank."""
    found = [parse_sub_root(info.name) for info in storage.list_dir() if info.is_dir]
    return sorted((sub for sub in found if sub is not None),
                  key=lambda sub: (sub.kind != "own", sub.rank))


def unusable_reason(manifest: Manifest, *, rank: int, world_size: int, durable_root: str,
                    current: WriterGeneration | None) -> str | None:
    """Why a run may not resume ``rank``'s part from this node-local copy, else None.

    Args:
        manifest: The copy's manifest.
        rank: The rank the copy must hold.
        world_size: The run's world size.
        durable_root: The run's durable root (URL).
        current: The durable root's newest writer generation, read before this run
            claimed it: a copy written under an older generation is a fenced writer's.
    """
    part = manifest.local
    if part is None:
        return "its manifest does not say it is a node-local copy (no 'local' field)"
    mismatch = (
        f"it holds rank {part.rank}'s part, not rank {rank}'s" if part.rank != rank else
        f"it belongs to the run of durable root {part.durable_root}, not {durable_root}"
        if part.durable_root != durable_root else
        f"it was written by a run of world size {part.world_size}; this run has {world_size}"
        if part.world_size != world_size else None)
    if mismatch is not None:
        return mismatch
    written = part.durable_generation
    if written is None:
        return "it records no writer generation of the durable root"
    if current is not None and generations.fenced_by(written, current):
        return (f"it was written by {written.describe()}, which {current.describe()} has "
                "fenced since: a fenced writer's copy is never resumed")
    return None


def check_local_root(local_root: str, durable: Storage) -> None:
    """Refuse a local tier's directory that would reach outside itself (at construction).

    Node-local copies are deleted as the tier's retention and restores decide, so they
    must stay where they are spelt. Refused, each with a
    :class:`~resumekit.errors.ConfigurationError` naming both paths:

    * the local root is, or lies inside, the durable root (spelt so, or through links:
      its real path is compared with the durable root's real path), or the durable root
      lies inside one of its sub-roots;
    * the local root itself is a symbolic link (it resolves to somewhere else than where
      it is spelt under its parent directory);
    * a sub-root already in it (``rank_XXXXX``, ``replica_of_rank_XXXXX``) is a link (to
      another run's copies, say), or is not a directory.

    Links in the path above the local root (``/scratch -> /mnt/nvme0``) are followed: the
    node's own directories are the user's to arrange.

    Args:
        local_root: ``LocalTier.root`` (a local path).
        durable: The run's durable root.

    Raises:
        ConfigurationError: One of the above (``name="local.root"``).
    """
    spelt = Storage(local_root).root  # absolute; the path of a file:// URL
    real = os.path.realpath(spelt)
    if os.path.islink(spelt):
        raise _refusal(f"local.root {spelt} is a symbolic link (to {real}); a local tier's "
                       "directory must be a directory of its own where it is spelt (node-local "
                       "copies are deleted there): pass the directory it points to, or "
                       "another", local_root)
    if durable.is_local:
        durable_spelt = durable.path()
        durable_real = os.path.realpath(durable_spelt)
        how = "" if real == spelt and durable_real == durable_spelt else \
            f" (through links: {spelt} resolves to {real}, {durable_spelt} to {durable_real})"
        if real == durable_real or _inside(real, durable_real):
            where = "is" if real == durable_real else "lies inside"
            raise _refusal(f"local.root must be a node-local directory of its own, not the "
                           f"durable root: {spelt} {where} the durable root "
                           f"{durable_spelt}{how}; its rank_XXXXX/ directories would sit "
                           "among the durable checkpoints", local_root)
        if _inside(durable_real, real):
            first = os.path.relpath(durable_real, real).split(os.sep)[0]
            if parse_sub_root(first) is not None:
                raise _refusal(f"the durable root {durable_spelt} lies inside "
                               f"{os.path.join(spelt, first)}, a sub-root of local.root "
                               f"{spelt}{how}: node-local retention would delete durable "
                               "checkpoints", local_root)
    try:
        names = sorted(os.listdir(spelt))
    except OSError:
        return  # absent (made by the first local save) or unreadable (the save says so)
    for name in names:
        if parse_sub_root(name) is None:
            continue
        path = os.path.join(spelt, name)
        if os.path.islink(path):
            raise _refusal(f"{path} is a symbolic link (to {os.path.realpath(path)}), not a "
                           f"directory of local.root {spelt}: node-local copies are written "
                           "and deleted there, so a link would reach another directory (another "
                           "run's copies?). Remove the link (its target is left as it is), or "
                           "pass another local.root", local_root)
        if not os.path.isdir(path):
            raise _refusal(f"{path} is not a directory: local.root {spelt} keeps each rank's "
                           "copies in a directory of that name. Move it away, or pass another "
                           "local.root", local_root)


def _inside(path: str, directory: str) -> bool:
    """Whether ``path`` lies strictly inside ``directory`` (both real, absolute paths)."""
    return os.path.commonpath([path, directory]) == directory and path != directory


def _refusal(message: str, value: str) -> ConfigurationError:
    return ConfigurationError(message, name="local.root", value=value)
