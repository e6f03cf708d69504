"""A local tier's directory: its sub-roots, and which node-local copies a run may use.

A local tier's directory (``LocalTier.root``, the same path on every node) holds one
resumekit root per rank of the node and per rank whose copies it keeps::

    <local_root>/rank_00003/               rank 3's own copies (a resumekit root)
    <local_root>/replica_of_rank_00007/    rank 7's copies, kept by its partner here

Each checkpoint there records what it is in its manifest (``Manifest.local``, a
:class:`~resumekit.store.manifest.LocalPart`); :func:`unusable_reason` says why a run may
not resume from one. Imports no torch: ``resumekit inspect`` reads local roots too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from resumekit.store import generations
from resumekit.store.manifest import Manifest, WriterGeneration
from resumekit.store.storage import Storage

__all__ = [
    "SubRoot",
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
