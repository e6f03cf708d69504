"""Which tier a restore reads from: node-local copies, partners' replicas, the durable root.

The decision only; it reads nothing and imports no torch. Its inputs are what every rank
found it can use (gathered by the manager's local tier, :mod:`resumekit.local`): the
steps of its own node-local copies, the steps of the replicas it keeps for other ranks,
and the durable root's newest restorable step. Its answer is every step that all ranks
can get, newest first, each from the cheapest source (a rank's own copy, else the
replica of the lowest rank that keeps one), as long as it is at least as new as the
durable root's newest: the restore tries them in that order and falls back to the
durable root when none restores. A step every rank holds itself is the ``"local"`` tier;
one some rank must fetch from a partner is the ``"replica"`` tier. Each candidate also
names, for every rank reading its own copy, a partner keeping a replica of that copy (its
*spare*): a rank whose own copy fails to verify reads the spare of the same step before
the restore gives the step up for an older one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Candidate", "Holdings", "Tier", "TierChoice", "decide"]

Tier = Literal["local", "replica", "durable"]


@dataclass(frozen=True)
class Holdings:
    """What one rank can offer a restore.

    Attributes:
        own: Steps of its own node-local copies that this run may use.
        replicas: For each rank whose copies it keeps, the steps it keeps (usable ones).
    """

    own: frozenset[int] = frozenset()
    replicas: Mapping[int, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, own: Collection[int], replicas: Mapping[int, Collection[int]] | None = None
           ) -> Holdings:
        """Build holdings from any collections of steps."""
        return cls(frozenset(own), {source: frozenset(steps)
                                    for source, steps in (replicas or {}).items()})


@dataclass(frozen=True)
class Candidate:
    """A step every rank can get, and from where.

    Attributes:
        step: The step.
        tier: ``"local"`` when every rank holds its own copy, ``"replica"`` when some
            rank fetches its copy from a partner.
        fetches: ``{rank: holder}``: each rank without its own copy, and the rank whose
            replica it fetches.
        spares: ``{rank: holder}``: each rank reading its own copy whose copy of this step
            is also kept as a replica, and the (lowest) rank keeping it.
    """

    step: int
    tier: Tier
    fetches: Mapping[int, int] = field(default_factory=dict)
    spares: Mapping[int, int] = field(default_factory=dict)

    def why(self, durable_step: int | None) -> str:
        """One line: where each rank's copy comes from, and how it compares with durable."""
        if self.fetches:
            sources = ", ".join(f"rank {rank} from rank {holder}'s replica"
                                for rank, holder in sorted(self.fetches.items()))
            held = f"{sources}, every other rank from its own copy"
        else:
            held = "every rank holds its own copy"
        if durable_step is None:
            durable = "the durable root holds no restorable checkpoint"
        elif durable_step == self.step:
            durable = f"the durable root's newest is the same step {durable_step}"
        else:
            durable = f"newer than the durable root's newest (step {durable_step})"
        return f"{held}; {durable}"


@dataclass(frozen=True)
class TierChoice:
    """The candidates of a restore across tiers, newest first, and the durable baseline.

    Attributes:
        candidates: Steps every rank can get, at least as new as ``durable_step``, newest
            first (empty: restore from the durable root).
        durable_step: The durable root's newest restorable step (None: none).
        newest_local: The newest step any rank holds a usable copy of (own or replica),
            for the account of a durable restore.
    """

    candidates: tuple[Candidate, ...]
    durable_step: int | None
    newest_local: int | None

    def durable_why(self) -> str:
        """Why the durable root is read (no candidate, or every candidate failed)."""
        durable = ("the durable root holds no restorable checkpoint"
                   if self.durable_step is None
                   else f"the durable root's newest restorable is step {self.durable_step}")
        if self.newest_local is None:
            return f"no rank holds a usable node-local copy; {durable}"
        if self.candidates:
            return f"no node-local step could be restored; {durable}"
        return (f"no step at least as new as the durable root's is held by every rank "
                f"(newest node-local copy: step {self.newest_local}); {durable}")


def decide(holdings: Sequence[Holdings], durable_step: int | None) -> TierChoice:
    """The steps a restore tries before the durable root, newest first.

    A step is a candidate when every rank can get its copy of it, its own or a replica
    another rank keeps of it, and it is not older than ``durable_step`` (equal is a
    candidate: a local read is the cheaper one). A rank with its own copy never fetches
    (the lowest rank keeping its replica of that step is its spare); one without fetches
    from the lowest rank keeping its replica of that step.

    Args:
        holdings: Each rank's holdings, indexed by rank (its length is the world size).
        durable_step: The durable root's newest restorable step (None: none).

    Returns:
        The choice: candidates newest first, possibly none.
    """
    world = len(holdings)
    keepers: dict[int, dict[int, list[int]]] = {}  # rank -> step -> ranks keeping its copy
    for holder, held in enumerate(holdings):
        for source, steps in held.replicas.items():
            if 0 <= source < world and source != holder:
                for step in steps:
                    keepers.setdefault(source, {}).setdefault(step, []).append(holder)
    steps_anywhere = set().union(*(held.own for held in holdings)) if holdings else set()
    for per_step in keepers.values():
        steps_anywhere |= per_step.keys()
    candidates: list[Candidate] = []
    for step in sorted(steps_anywhere, reverse=True):
        if durable_step is not None and step < durable_step:
            break
        fetches: dict[int, int] = {}
        spares: dict[int, int] = {}
        for rank, held in enumerate(holdings):
            holders = keepers.get(rank, {}).get(step)
            if step in held.own:
                if holders:
                    spares[rank] = min(holders)
                continue
            if not holders:
                break
            fetches[rank] = min(holders)
        else:
            candidates.append(Candidate(step, "replica" if fetches else "local", fetches,
                                        spares))
    return TierChoice(tuple(candidates), durable_step,
                      max(steps_anywhere) if steps_anywhere else None)
