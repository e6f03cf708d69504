"""This rank's side of a local tier: its own root, its replica roots, its local saves.

A local save (:meth:`LocalSite.save`) is a real resumekit checkpoint of this rank's part
of the state, committed under ``<local_root>/rank_XXXXX/`` by a commit protocol of this
rank alone (:class:`~resumekit.store.coordination.SingleProcess`: staging, manifest with
checksums, atomic rename; its own writer generations): tensors written by this rank
alone (``DTensor`` local shards, :func:`resumekit.tensors.save` ``alone=True``),
the training state, this rank's RNG and data position. The manifest records what it is
(:class:`~resumekit.store.manifest.LocalPart`, with the durable root's writer generation
this run held). The ranks then agree on the outcome (a failure on any rank is one
warning on every rank: the local tier is a cache, training and durable saves go on),
retention keeps the newest ``keep``, and with ``replicas`` each rank's copy goes to its
partner (:mod:`resumekit.local.replicas`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from resumekit.errors import CoordinationError, ResumekitError
from resumekit.local import replicas
from resumekit.local.roots import (
    own_root_name,
    replica_root_name,
    sub_roots,
    unusable_reason,
)
from resumekit.options import LocalTier
from resumekit.runtime.channels import Channel
from resumekit.save_job import SaveJob, StepTarget, write_step
from resumekit.store.catalog import CheckpointEntry, list_checkpoints
from resumekit.store.commit import CommitProtocol
from resumekit.store.coordination import SingleProcess, run_on_every_rank
from resumekit.store.layout import (
    NameFormat,
)
from resumekit.store.manifest import (
    LocalPart,
    Manifest,
    WriterGeneration,
)
from resumekit.store.newest import forget_newest_hint
from resumekit.store.recovery import remove_retired
from resumekit.store.retention import RollingSweep, keep_last, prune
from resumekit.store.storage import Storage
from resumekit.tensors.plans import SavePlans
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["LocalJob", "LocalSite", "LocalSurvey", "fetch_copies", "holdings_of"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class LocalJob:
    """One local save, captured by the manager: this rank's tensors and small files."""

    step: int
    tensors: dict[str, Any]
    train: bytes
    ranks: bytes
    manifest: Manifest


@dataclass
class LocalSurvey:
    """What this rank holds under the local tier, as a restore may use it.

    Attributes:
        own: Usable own copies, by step.
        replicas: Usable replicas kept for other ranks: ``{source rank: {step: entry}}``.
        unusable: ``(sub-root, entry, why)`` of committed copies this run may not use.
    """

    own: dict[int, CheckpointEntry] = field(default_factory=dict)
    replicas: dict[int, dict[int, CheckpointEntry]] = field(default_factory=dict)
    unusable: list[tuple[Storage, CheckpointEntry, str]] = field(default_factory=list)


class LocalSite:
    """This rank's view of the local tier.

    Args:
        tier: The tier's options.
        durable_root: URL of the run's durable root (recorded in each copy).
        name_format: Step directory names (the durable root's).
        tensor_format: How tensors are written (``"raw"`` unless the run asked for DCP).
        rank: This rank.
        world_size: The run's world size.
    """

    def __init__(self, tier: LocalTier, *, durable_root: str, name_format: NameFormat,
                 tensor_format: Literal["raw", "dcp"], rank: int, world_size: int) -> None:
        self.tier, self.durable_root, self.name_format = tier, durable_root, name_format
        self.tensor_format = tensor_format
        self.rank, self.world_size = rank, world_size
        # Every node-local root is confined to the local root's parent: nothing is ever
        # deleted, renamed or written through a link on the way to a copy (the local root
        # or a sub-root that is one: another run's directory), checked at each operation.
        self.base = Storage(tier.root)
        self._above = os.path.dirname(self.base.root)  # (a file:// URL's path)
        self.base.confined_to = self._above
        self.own = Storage(os.path.join(tier.root, own_root_name(rank)),
                           confined_to=self._above)
        # This rank alone commits here: its own coordinator and writer generations.
        self.protocol = CommitProtocol(self.own, name_format, SingleProcess())
        self._rolling = RollingSweep()
        # This rank's last save plan, reused while the state's layout is unchanged.
        self.plans = SavePlans()
        self._partners: replicas.Partners | None = None  # made at the first replication
        self._said_no_replicas = False

    def replica_root(self, rank: int) -> Storage:
        """The root under which this rank keeps ``rank``'s replicas."""
        return Storage(os.path.join(self.tier.root, replica_root_name(rank)),
                       confined_to=self._above)

    def _linked(self, storage: Storage, what: str) -> bool:
        """Whether ``storage`` (a sub-root) is reached through a link; warn if it is.

        Construction refuses such a sub-root (:func:`check_local_root`); one made since
        is left as it is, its target never read, written or deleted.
        """
        link = storage.root_link()
        if link is None:
            return False
        warn(f"not {what} {storage.path()}: {link} is a symbolic link (to "
             f"{os.path.realpath(link)}), made after this manager was built; node-local "
             "copies are never read, written or deleted through a link (remove the link; its "
             "target is left as it is)", ResumekitWarning, stacklevel=5)
        return True

    def due(self, step: int) -> bool:
        """Whether ``step`` is on a fixed local interval (``"auto"``: the manager decides)."""
        every = self.tier.save_every
        return isinstance(every, int) and step % every == 0

    # -- saving -------------------------------------------------------------------------
    def save(self, job: LocalJob, channel: Channel, generation: WriterGeneration | None
             ) -> bool:
        """Commit this rank's copy of ``job`` on every rank, then replicate it.

        A failure on any rank (a full ``/dev/shm``, an unwritable directory) is one
        warning on every rank naming the rank, step and cause, and the step is not
        replicated; a broken process group still raises.

        Args:
            job: The save.
            channel: The manager's main channel (every rank agrees on it).
            generation: The durable root's writer generation this run holds.

        Returns:
            Whether every rank committed its copy.
        """
        part = LocalPart(rank=self.rank, world_size=self.world_size,
                         node=replicas.node_name(), durable_root=self.durable_root,
                         durable_generation=generation)
        manifest = job.manifest.model_copy(update={"local": part})
        try:
            name: str = run_on_every_rank(channel.coordinator,
                                          lambda: self._commit(job, manifest))
        except CoordinationError:
            raise
        except (ResumekitError, OSError) as error:
            warn(f"local save of step {job.step} under {self.tier.root} failed: "
                 f"{type(error).__name__}: {error}; training goes on, and the durable "
                 "root's saves are not affected", ResumekitWarning, stacklevel=4)
            return False
        self._replicate(name, channel)
        logger.info("resumekit: committed local step %d under %s", job.step,
                    self.own.path())
        return True

    def _commit(self, job: LocalJob, manifest: Manifest) -> str:
        try:
            return self._write(job, manifest)
        except (ResumekitError, OSError) as error:
            raise ResumekitError(f"rank {self.rank} ({self.own.path()}): "
                                 f"{type(error).__name__}: {error}",
                                 rank=self.rank, step=job.step, path=self.own.path()
                                 ) from error

    def _write(self, job: LocalJob, manifest: Manifest) -> str:
        """Commit this rank's copy (:func:`~resumekit.save_job.write_step`), alone."""
        storage = self.own

        def retain() -> None:
            report = prune(storage, keep_last(self.tier.keep), name_format=self.name_format,
                           errors="report", scope="top", rolling=self._rolling)
            for line in report.problems:
                warn(f"local step {job.step} is committed, but retention under "
                     f"{storage.path()} did not complete: {line}", ResumekitWarning,
                     stacklevel=7)

        saved = SaveJob(job.step, False, job.tensors, job.train, job.ranks, manifest,
                        time.monotonic())
        target = StepTarget(self.protocol, self.rank, self.tensor_format, alone=True,
                            name_failures=False, plans=self.plans)
        return write_step(saved, target, retain=retain).name

    def _replicate(self, name: str, channel: Channel) -> None:
        """Send this rank's copy ``name`` to its partner (collective), if replicas are on."""
        if not self.tier.replicas:
            return
        if channel.group is None:
            self._say_no_replicas("the run has one rank")
            return
        partners = self.partners(channel)
        if partners is None or partners.partner is None:
            self._say_no_replicas("every rank runs on one node, so a replica could not "
                                  "survive the loss of that node")
            return
        try:
            replicas.replicate(self.own, name, partners, self.replica_root,
                               group=channel.group, keep=self.tier.keep,
                               name_format=self.name_format)
        except CoordinationError:
            raise
        except ResumekitError as error:
            warn(f"replicating local {name} to partner ranks failed: {error}; the own "
                 "copies stand", ResumekitWarning, stacklevel=5)

    def partners(self, channel: Channel) -> replicas.Partners | None:
        """Who keeps whose replicas (a collective the first time; None on one rank)."""
        if channel.group is None:
            return None
        if self._partners is None:
            self._partners = replicas.Partners.of(channel.group)
        return self._partners

    def keeps_replicas(self, channel: Channel) -> bool:
        """Whether this rank surveys and tidies its node's replica roots: its lowest rank.

        Every rank of a node sees the same replica roots (one directory per node); one
        of them reads them for a restore and deletes what the run must not keep.
        """
        partners = self.partners(channel)
        if partners is None:
            return True
        return partners.nodes.index(partners.nodes[self.rank]) == self.rank

    def _say_no_replicas(self, why: str) -> None:
        if not self._said_no_replicas:
            self._said_no_replicas = True
            warn(f"local tier under {self.tier.root}: replicas=True, but no copy is "
                 f"replicated: {why}. Each rank keeps only its own copies (pass "
                 "replicas=False to say so)", ResumekitWarning, stacklevel=6)

    # -- restoring ----------------------------------------------------------------------
    def survey(self, current: WriterGeneration | None, *, with_replicas: bool
               ) -> LocalSurvey:
        """The committed copies this rank holds, usable by this run or not (and why).

        Args:
            current: The durable root's newest writer generation, read before this run
                claimed it (fencing).
            with_replicas: Also the node's replica roots (:meth:`keeps_replicas`).
        """
        found = LocalSurvey()
        if not self.base.is_dir():
            return found
        for sub in sub_roots(self.base):
            if sub.rank != self.rank if sub.kind == "own" else not with_replicas:
                continue  # another rank of this node reads it
            storage = self.own if sub.kind == "own" else self.replica_root(sub.rank)
            if self._linked(storage, "restoring from"):
                continue
            for entry in list_checkpoints(storage, self.name_format):
                if entry.status != "committed" or entry.manifest is None:
                    continue
                why = unusable_reason(entry.manifest, rank=sub.rank,
                                      world_size=self.world_size,
                                      durable_root=self.durable_root, current=current)
                if why is not None:
                    found.unusable.append((storage, entry, why))
                elif sub.kind == "own":
                    found.own[entry.step] = entry
                else:
                    found.replicas.setdefault(sub.rank, {})[entry.step] = entry
        return found

    def tidy(self, restored: int | None, survey: LocalSurvey, *, with_replicas: bool
             ) -> None:
        """Delete the copies a run restored at ``restored`` must not keep (this rank).

        Copies this run may not use (``survey.unusable``: each was named in a warning)
        and every step directory newer than ``restored`` (a timeline the run left: its
        steps are saved again as training replays them). Each deletion is logged.

        Args:
            restored: The step the run restored (None: a fresh start).
            survey: This rank's survey made before the restore.
            with_replicas: Also the node's replica roots (:meth:`keeps_replicas`).
        """
        above = -1 if restored is None else restored
        doomed: list[tuple[Storage, str, str]] = [
            (storage, entry.name, why) for storage, entry, why in survey.unusable
            if storage.root_link() is None]
        newer_committed: dict[str, set[str]] = {}
        replica_roots = sorted({sub.rank for sub in sub_roots(self.base) if sub.kind
                                == "replica"}) if with_replicas and self.base.is_dir() else []
        for storage in [self.own, *(self.replica_root(source) for source in replica_roots)]:
            if not storage.is_dir() or self._linked(storage, "deleting copies under"):
                continue
            for entry in list_checkpoints(storage, self.name_format):
                if entry.step > above and entry.status in ("committed", "partial",
                                                           "corrupt"):
                    doomed.append((storage, entry.name,
                                   f"newer than the step restored ({restored})"))
                    if entry.status == "committed":
                        newer_committed.setdefault(storage.path(), set()).add(entry.name)
        done: set[tuple[str, str]] = set()
        committed: list[str] = []  # committed copies of the timeline left: said in a warning
        for storage, name, why in doomed:
            if (storage.path(), name) in done or not storage.exists(name):
                continue
            done.add((storage.path(), name))
            forget_newest_hint(storage)
            remove_retired(storage, name)
            logger.info("resumekit: deleted node-local %s: %s", storage.path(name), why)
            if name in newer_committed.get(storage.path(), ()):
                committed.append(storage.path(name))
        if committed:
            warn(f"rank {self.rank} deleted {len(committed)} committed node-local "
                 f"cop{'y' if len(committed) == 1 else 'ies'} newer than the step restored "
                 f"({restored}), a timeline this run left (training saves those steps "
                 f"again): {', '.join(committed)}", ResumekitWarning, stacklevel=6)

    def discard(self, step: int, why: str) -> None:
        """Delete this rank's own copy of ``step`` (one that failed to verify), logged."""
        name = self.entry(step).name
        forget_newest_hint(self.own)
        remove_retired(self.own, name)
        logger.info("resumekit: deleted node-local %s: %s", self.own.path(name), why)

    def entry(self, step: int) -> CheckpointEntry:
        """This rank's own committed copy of ``step`` (after a fetch, if it needed one).

        Raises:
            ResumekitError: There is none (the fetch did not leave one).
        """
        for entry in list_checkpoints(self.own, self.name_format):
            if entry.step == step and entry.status == "committed":
                return entry
        raise ResumekitError(f"rank {self.rank} holds no committed copy of step {step} "
                             f"under {self.own.path()}", path=self.own.path(), step=step)


def fetch_copies(fetches: dict[int, int], step: int, name: str, site: LocalSite,
                 channel: Channel) -> None:
    """Have each rank of ``fetches`` get its copy of ``step`` from its holder (collective).

    Raises:
        ResumekitError: A transfer failed (on every rank).
    """
    needs = {rank: (step, name) for rank in fetches}
    replicas.fetch(needs, dict(fetches), site.own, site.replica_root, group=channel.group)


def holdings_of(survey: LocalSurvey) -> tuple[list[int], dict[int, list[int]]]:
    """A survey as the plain steps the ranks gather for the decision."""
    return (sorted(survey.own),
            {source: sorted(steps) for source, steps in survey.replicas.items()})

