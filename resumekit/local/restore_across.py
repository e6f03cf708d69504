"""A restore across tiers: the newest step every rank can get, from node-local copies.

Run on every rank by :meth:`resumekit.CheckpointManager.restore` before the durable
root's own restore, when the manager has a local tier:

1. the leader reads the durable root's newest writer generation (the fencing reference,
   read before this run claims the root) and its newest restorable step;
2. every rank surveys its node-local copies (own and replicas kept for others) and
   drops those this run may not use (another durable root or world size, a fenced
   writer's copy: :func:`resumekit.local.roots.unusable_reason`), with a warning;
3. the ranks all-gather what they hold, and :func:`resumekit.local.tier_choice.decide` lists
   the steps every rank can get, newest first, not older than the durable root's newest;
4. each candidate in turn: ranks without their own copy fetch it from the partner's
   replica (:func:`resumekit.local.site.fetch_copies`), then every rank verifies and
   reads its copy (the manager's ``read``: checksums, compatibility, tensors read by the
   rank alone); a rank whose own copy fails reads a partner's replica of the same step
   instead when one is kept (a warning names the copy and why); any other failure is a
   warning naming the copy and why, and the next candidate is tried. A copy that does not
   fit the run, and one whose load fails although its files match their checksums (a
   :class:`~resumekit.errors.CheckpointLoadError`: a bug, not damage), are raised on
   every rank instead: no copy is deleted, nothing older is restored in its place;
5. none restored: the durable root's restore runs (the manager), with a warning when a
   candidate failed, and one when the restore is an in-job restart (torchrun's
   ``TORCHELASTIC_RESTART_COUNT``, the most any node counts): that restart missed the
   local tier it exists for.

The choice is logged in one INFO line (step, tier, why) and the manager records the tier
in the lineage of the manifests it writes next (``Lineage.restored_from_tier``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from resumekit.errors import (
    CheckpointLoadError,
    CoordinationError,
    IncompatibleCheckpointError,
    ResumekitError,
)
from resumekit.local.site import LocalSite, LocalSurvey, fetch_copies, holdings_of
from resumekit.local.tier_choice import Candidate, Holdings, Tier, TierChoice, decide
from resumekit.restore.plan import not_damaged
from resumekit.runtime.channels import Channel
from resumekit.store import generations
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.coordination import run_on_every_rank, run_on_leader
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest, WriterGeneration
from resumekit.store.storage import Storage
from resumekit.warnings import LocalTierMissWarning, ResumekitWarning, warn

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
        self.restarts = 0  # torchrun's in-job restarts of this job, the most any node counts

    def run(self, read: ReadCopy) -> TierRestored | None:
        """Restore from the newest usable candidate, or return None (read the durable root).

        Args:
            read: Verifies and reads one rank's copy into the run's state on this rank
                (the manager's); called on every rank, each with its own copy.

        Raises:
            IncompatibleCheckpointError: A copy does not fit the run (never fallen back
                from, as for the durable root).
            CheckpointLoadError: A copy's load failed although its files match their
                checksums (never fallen back from: the copy is kept).
            CoordinationError: A peer died.
        """
        coordinator = self.channel.coordinator
        durable_step = self.prepare()
        gathered = coordinator.all_gather((holdings_of(self.survey), in_job_restarts()))
        self.restarts = max(restarts for _, restarts in gathered)
        choice = self.choice = decide(
            [Holdings.of(own, replicas) for (own, replicas), _ in gathered], durable_step)
        for number, candidate in enumerate(choice.candidates):
            try:
                restored = self._try(candidate, read)
            except (IncompatibleCheckpointError, CheckpointLoadError, CoordinationError):
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
        """Fetch what is missing, then verify and read every rank's copy (raises alike).

        A rank whose own copy fails and whose copy a partner keeps as a replica (the
        candidate's spare) deletes its copy, fetches the replica and reads that instead,
        with a warning; a failure without a spare, or of a spare, gives the step up.
        """
        step = candidate.step
        name = self.name_format.build(step)
        if candidate.fetches:
            fetch_copies(dict(candidate.fetches), step, name, self.site, self.channel)
        manifests: dict[str, Manifest] = {}
        failed = self._read_copies(step, read, manifests, readers=None)
        if failed:
            spares = {rank: candidate.spares.get(rank) for rank in failed}
            if any(holder is None for holder in spares.values()):
                raise ResumekitError(failed[min(failed)], step=step)
            fetches = {rank: holder for rank, holder in spares.items() if holder is not None}
            for rank, holder in sorted(fetches.items()):
                warn(f"{failed[rank]}; rank {rank} reads rank {holder}'s replica of step "
                     f"{step} instead (its own copy is deleted)", ResumekitWarning,
                     stacklevel=4)
            if self.site.rank in fetches:
                self.site.discard(step, f"its copy of step {step} failed to verify; "
                                        f"replaced by rank {fetches[self.site.rank]}'s replica")
            fetch_copies(fetches, step, name, self.site, self.channel)
            failed = self._read_copies(step, read, manifests, readers=set(fetches))
            if failed:
                raise ResumekitError(failed[min(failed)], step=step)
            candidate = Candidate(step, "replica", {**candidate.fetches, **fetches})
        assert self.choice is not None
        return TierRestored(step, candidate.tier, manifests["own"],
                            candidate.why(self.choice.durable_step))

    def _read_copies(self, step: int, read: ReadCopy, manifests: dict[str, Manifest], *,
                     readers: set[int] | None) -> dict[int, str]:
        """Verify and read this rank's copy of ``step`` (if a reader); every rank's failures.

        Returns ``{rank: why}`` for each rank whose copy failed (the same on every rank).
        A copy that does not fit the run, one whose load fails on bytes that match their
        checksums (:class:`~resumekit.errors.CheckpointLoadError`), or any other error, is
        raised on every rank.
        """
        site = self.site

        def read_own() -> str | None:
            if readers is not None and site.rank not in readers:
                return None
            entry = site.entry(step)
            try:
                read(site.own, entry)
            except IncompatibleCheckpointError:
                raise
            except CheckpointLoadError as error:
                raise not_damaged(entry, error, rank=site.rank, node_local=True) from error
            except (ResumekitError, OSError) as error:
                return (f"rank {site.rank}'s copy {entry.path} failed: "
                        f"{type(error).__name__}: {error}")
            assert entry.manifest is not None
            manifests["own"] = entry.manifest
            return None

        outcome = run_on_every_rank(self.channel.coordinator, read_own)
        gathered = self.channel.coordinator.all_gather(outcome)
        return {rank: why for rank, why in enumerate(gathered) if why is not None}

    def tidy(self, restored: int | None) -> None:
        """Delete, on every rank, the node-local copies a run restored at ``restored`` drops.

        See :meth:`resumekit.local.site.LocalSite.tidy`.
        """
        run_on_every_rank(self.channel.coordinator, lambda: self.site.tidy(
            restored, self.survey, with_replicas=self.with_replicas))

    def durable_why(self) -> str:
        """Why the durable root is read (after :meth:`run` returned None, or a step)."""
        return ("a step was asked for" if self.choice is None
                else self.choice.durable_why())

    def say_durable(self, step: int | None) -> None:
        """Log that the durable root was read and why; warn if an in-job restart missed.

        An in-job restart (torchrun ``--max-restarts``) is meant to resume from the local
        tier; when it reads the durable root instead (or starts over), every rank warns,
        naming the restart, the step and why no local copy served.
        """
        what = "a fresh start" if step is None else f"step {step} from the durable tier"
        why = self.durable_why()
        logger.info("resumekit: restore: %s (%s)", what, why)
        if self.restarts and self.choice is not None:
            then = ("starting over from step 0" if step is None
                    else f"restoring step {step} from the durable root")
            warn(f"in-job restart {self.restarts} (torchrun --max-restarts) found no usable "
                 f"node-local copy: {why}; {then}, the steps since are trained again",
                 LocalTierMissWarning, stacklevel=4)


def in_job_restarts(environ: Mapping[str, str] | None = None) -> int:
    """The restart count of this node's worker group under torchrun (0: none, or not torchrun)."""
    raw = (os.environ if environ is None else environ).get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return max(int(raw), 0)
    except ValueError:
        return 0

