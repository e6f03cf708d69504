"""A restore across tiers: the newest step every rank can get, from node-local copies.

Run on every rank by :meth:`resumekit.CheckpointManager.restore` before the durable
root's own restore, when the manager has a local tier:

1. the leader reads the durable root's newest writer generation (the fencing reference,
   read before this run claims the root) and its newest restorable step;
2. every rank surveys its node-local copies (own and replicas kept for others) and
   drops those this run may not use (another durable root or world size, a fenced
   writer's copy: :func:`resumekit.store.local_roots.unusable_reason`), with a warning;
3. the ranks all-gather what they hold, and :func:`resumekit.restore.tiers.decide` lists
   the steps every rank can get, newest first, not older than the durable root's newest;
4. each candidate in turn: ranks without their own copy fetch it from the partner's
   replica (:func:`resumekit.tiers.local.fetch_copies`), then every rank verifies and
   reads its copy (the manager's ``read``: checksums, compatibility, tensors read by the
   rank alone); a failure on any rank is a warning naming the copy and why, and the next
   candidate is tried;
5. none restored: the durable root's restore runs (the manager), with a warning when a
   candidate failed.

The choice is logged in one INFO line (step, tier, why) and the manager records the tier
in the lineage of the manifests it writes next (``Lineage.restored_from_tier``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from resumekit.errors import CoordinationError, IncompatibleCheckpointError, ResumekitError
from resumekit.restore.tiers import Candidate, Holdings, Tier, TierChoice, decide
from resumekit.runtime.channels import Channel
from resumekit.store import generations
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.coordination import run_on_every_rank, run_on_leader
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest, WriterGeneration
from resumekit.store.storage import Storage
from resumekit.tiers.local import LocalSite, LocalSurvey, fetch_copies, holdings_of
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["TierRestore", "TierRestored"]

logger = logging.getLogger("resumekit")

ReadCopy = Callable[[Storage, CheckpointEntry], None]


@dataclass(frozen=True)
class TierRestored:
    """A restore from the local tier: the step, the tier, this rank's copy's manifest."""

    step: int
    tier: Tier
    manifest: Manifest
    why: str


class TierRestore:
    """Choose and read the newest step every rank can get from the local tier.

    Args:
        site: This rank's side of the local tier.
        durable: The durable root.
        name_format: Its step directory names.
        channel: The manager's main channel.
    """

    def __init__(self, site: LocalSite, durable: Storage, name_format: NameFormat,
                 channel: Channel) -> None:
        self.site, self.durable, self.name_format = site, durable, name_format
        self.channel = channel
        self.survey = LocalSurvey()
        self.choice: TierChoice | None = None
        self.with_replicas = False

    def run(self, read: ReadCopy) -> TierRestored | None:
        """Restore from the newest usable candidate, or return None (read the durable root).

        Args:
            read: Verifies and reads one rank's copy into the run's state on this rank
                (the manager's); called on every rank, each with its own copy.

        Raises:
            IncompatibleCheckpointError: A copy does not fit the run (never fallen back
                from, as for the durable root).
            CoordinationError: A peer died.
        """
        coordinator = self.channel.coordinator
        durable_step = self.prepare()
        gathered = coordinator.all_gather(holdings_of(self.survey))
        choice = self.choice = decide(
            [Holdings.of(own, replicas) for own, replicas in gathered], durable_step)
        for number, candidate in enumerate(choice.candidates):
            try:
                restored = self._try(candidate, read)
            except (IncompatibleCheckpointError, CoordinationError):
                raise
            except (ResumekitError, OSError) as error:
                left = choice.candidates[number + 1:]
                then = (f"trying step {left[0].step} next" if left
                        else "restoring from the durable root instead")
                warn(f"not restoring step {candidate.step} from the {candidate.tier} tier: "
                     f"{error}; {then}", ResumekitWarning, stacklevel=4)
                continue
            logger.info("resumekit: restore: step %d from the %s tier (%s)", restored.step,
                        restored.tier, restored.why)
            return restored
        return None

    def prepare(self, *, stacklevel: int = 5) -> int | None:
        """Read the durable baseline and survey this rank's copies (every rank).

        Copies this run may not use are each named in a warning (and deleted by
        :meth:`tidy`). Returns the durable root's newest restorable step.
        """
        current, durable_step = run_on_leader(self.channel.coordinator,
                                              self._durable_newest)
        self.with_replicas = self.site.keeps_replicas(self.channel)
        found: list[LocalSurvey] = []  # kept here: only the outcome is all-gathered
        run_on_every_rank(self.channel.coordinator, lambda: found.append(
            self.site.survey(current, with_replicas=self.with_replicas)))
        self.survey = found[0]
        for _, entry, why in self.survey.unusable:
            warn(f"not restoring from node-local {entry.path}: {why}; it is deleted",
                 ResumekitWarning, stacklevel=stacklevel)
        return durable_step

    def _durable_newest(self) -> tuple[WriterGeneration | None, int | None]:
        """The durable root's newest claim and newest restorable step (on the leader)."""
        current = generations.newest_generation(self.durable)
        entry, _ = generations.newest_restorable(self.durable, self.name_format)
        return current, None if entry is None else entry.step

    def _try(self, candidate: Candidate, read: ReadCopy) -> TierRestored:
        """Fetch what is missing, then verify and read every rank's copy (raises alike)."""
        site, coordinator = self.site, self.channel.coordinator
        step = candidate.step
        if candidate.fetches:
            name = self.name_format.build(step)
            fetch_copies(dict(candidate.fetches), step, name, site, self.channel)

        manifests: list[Manifest] = []

        def read_own() -> None:
            entry = site.entry(step)
            try:
                read(site.own, entry)
            except IncompatibleCheckpointError:
                raise
            except (ResumekitError, OSError) as error:
                raise ResumekitError(
                    f"rank {site.rank}'s copy {entry.path} failed: {type(error).__name__}: "
                    f"{error}", path=entry.path, rank=site.rank, step=step) from error
            assert entry.manifest is not None
            manifests.append(entry.manifest)

        run_on_every_rank(coordinator, read_own)
        assert self.choice is not None
        return TierRestored(step, candidate.tier, manifests[0],
                            candidate.why(self.choice.durable_step))

    def tidy(self, restored: int | None) -> None:
        """Delete, on every rank, the node-local copies a run restored at ``restored`` drops.

        See :meth:`resumekit.tiers.local.LocalSite.tidy`.
        """
        run_on_every_rank(self.channel.coordinator, lambda: self.site.tidy(
            restored, self.survey, with_replicas=self.with_replicas))

    def durable_why(self) -> str:
        """Why the durable root is read (after :meth:`run` returned None, or a step)."""
        return ("a step was asked for" if self.choice is None
                else self.choice.durable_why())
