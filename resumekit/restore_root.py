"""A restore of one root, run in order on every rank: what ``CheckpointManager.restore`` does.

The decisions (which entry, fall back past which, set aside what, warn about what) are
:mod:`resumekit.restore.plan`'s and :mod:`resumekit.restore.entries`'s; this module runs
them: survey the root (the leader lists it), claim the writer generation, verify the
newest committed checkpoint (checksums, spread over ranks), check that it fits the run,
read it into the run's state, and fall back past one that cannot be read, or import a
legacy weights-only directory, or account for a fresh start. The manager applies the
:class:`Restored` outcome to itself and meets every rank on the checkpoint group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resumekit import tensors as tensor_io
from resumekit.errors import IncompatibleCheckpointError, ResumekitError
from resumekit.options import CheckpointOptions
from resumekit.restore import plan as restore_plan
from resumekit.restore.compatibility import check_compatibility
from resumekit.restore.entries import EntryKeeper
from resumekit.restore.plan import Survey
from resumekit.restore.verification import (
    PrereadMetadata,
    preread_metadata,
    refuse_links_share,
    share_metadata,
    verify_share,
)
from resumekit.runtime.channels import Channel
from resumekit.state.train_state import TrainState, read_plain
from resumekit.store.aside import refuse_fresh_start_beside
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.coordination import SingleProcess, run_on_every_rank, run_on_leader
from resumekit.store.layout import TENSORS_DIR, TRAIN_STATE_FILE, NameFormat, rank_state_file
from resumekit.store.manifest import Manifest, SaveReason
from resumekit.store.storage import Storage
from resumekit.tools import legacy
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["Restored", "RootRestore"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class Restored:
    """What a restore of one root found and read.

    Attributes:
        entry: The entry read: a committed checkpoint, a legacy directory (weights
            only), or None on a fresh start.
        manifest: The committed checkpoint's manifest (None for legacy and fresh).
    """

    entry: CheckpointEntry | None
    manifest: Manifest | None

    @property
    def reason(self) -> str:
        """The reason every rank meets on the checkpoint group after it."""
        if self.entry is None:
            return "fresh start"
        if self.manifest is not None:
            return f"end of restore from step {self.entry.step}"
        return f"end of legacy import from {self.entry.name}"


class RootRestore:
    """Restore the newest committed checkpoint of one root (or a step) into a run's state.

    Args:
        storage: The root.
        name_format: Its step directory names.
        state: The run's state, read into in place.
        channel: The main channel (its coordinator, group and writer generation).
        options: The manager's options (``fallback``, ``verify_on_restore``,
            ``on_mismatch``, ``import_legacy``, ``foreign``, ``read_only``,
            ``restore_reads``).
        fingerprint: This run's fingerprint, compared with the checkpoint's.
        config_set: Whether the run has a configuration (an imported checkpoint that
            records none is then named in the warning).
        rank: This process's rank.
        world_size: Number of ranks.
        newest_step: The newest committed step the manager knows of.

    Attributes:
        newest_step: The newest committed step left under the root as the restore goes
            (a checkpoint set aside on the way is not one): the manager keeps it, also
            when the restore raises.
    """

    def __init__(self, storage: Storage, name_format: NameFormat, state: TrainState,
                 channel: Channel, options: CheckpointOptions, *,
                 fingerprint: dict[str, Any], config_set: bool, rank: int, world_size: int,
                 newest_step: int | None) -> None:
        self.storage, self.name_format, self.state = storage, name_format, state
        self.channel, self.options = channel, options
        self.fingerprint, self.config_set = fingerprint, config_set
        self.rank, self.world_size = rank, world_size
        self.newest_step = newest_step
        self._preread: PrereadMetadata | None = None

    @property
    def _entries(self) -> EntryKeeper:
        """The root's entries as a restore handles them (claim, set aside, leftovers)."""
        return EntryKeeper(self.storage, self.name_format, self.channel,
                           self.options.read_only)

    def run(self, step: int | None = None) -> Restored:
        """Find, verify, check and read; fall back, import legacy or start fresh.

        Args:
            step: The step to restore (None: the newest committed).

        Raises:
            The errors of :meth:`resumekit.CheckpointManager.restore`.
        """
        whole: list[PrereadMetadata] = []  # the leader's own read, never sent
        found, claimed, self._preread = run_on_leader(
            self.channel.coordinator, lambda: self._lead(step, whole))
        if whole:
            self._preread = whole[0]
        if step is None and not any(e.status == "committed" for e in found.entries):
            self._refuse_fresh_start(found.entries)  # before a claim records an empty root
        entries = self._entries.claim_generation(found.entries, claimed)
        committed = restore_plan.candidates(entries, step, root=self.storage.path())
        if step is None and not self.options.fallback:
            restore_plan.refuse_broken_newest(entries)
        restored = self._newest_committed(
            entries, committed, explicit=step is not None,
            more=None if found.complete else lambda: self._entries.survey_below(found))
        if restored is not None:
            self._entries.report_leftovers(entries, above=restored.step)
            if step is not None:
                self._say_newer_committed(entries, restored)
            return Restored(restored, restored.manifest)
        self._refuse_fresh_start(entries)  # nothing committed
        imported = self._import_newest_legacy(entries)
        if imported is not None:
            self._entries.report_leftovers(entries, above=imported.step)
            return Restored(imported, None)
        self._account_for_fresh_start(found, entries)
        return Restored(None, None)

    def _lead(self, step: int | None, whole: list[PrereadMetadata]
              ) -> tuple[Survey, tuple[str, Any] | None, PrereadMetadata | None]:
        """The leader's start of :meth:`run`, sent to every rank in one broadcast.

        The survey; the writer generation's claim (not when the root holds nothing
        committed and no step was asked for: the fresh start is refused first); and,
        over a group, ``.metadata`` of the checkpoint the restore will try first (the
        newest committed, or the asked-for step), so that neither needs a broadcast of
        its own. Their failures travel as outcomes, raised on every rank where they
        were before. ``whole`` gets the leader's whole ``.metadata``.
        """
        found = restore_plan.survey(self.storage, self.name_format,
                                    recover=not self.options.read_only, whole=step is not None)
        if step is None and not any(e.status == "committed" for e in found.entries):
            return found, None, None
        claimed = self._entries.claim_on_leader(found.entries)
        if claimed[0] != "ok" or self.channel.coordinator.world_size == 1:
            return found, claimed, None
        zombies = claimed[1][1]
        committed = [e for e in found.entries if e.status == "committed"
                     and e.name not in zombies and (step is None or e.step == step)]
        first = max(committed, key=lambda e: e.step, default=None)
        if first is None or first.manifest is None:
            return found, claimed, None
        read = preread_metadata(self.storage, first.name, first.manifest,
                                verify=self.options.verify_on_restore)
        whole.append(read)
        return found, claimed, read.for_ranks()

    def _say_newer_committed(self, entries: list[CheckpointEntry],
                             restored: CheckpointEntry) -> None:
        """Warn now when an asked-for step has newer committed steps above it.

        Steps only ever increase: the run's next saves (``restored.step`` + 1 onwards)
        would be refused until they pass the newest, a ``StepCollisionError`` many steps
        into the rolled-back run. A read-only manager never saves: nothing to say.
        """
        newer = sorted((e for e in entries if e.status == "committed" and e.step > restored.step),
                       key=lambda e: e.step)
        if not newer or self.options.read_only:
            return
        steps = ", ".join(str(e.step) for e in newer)
        names = ", ".join(e.name for e in newer)
        _warn(f"restored step {restored.step} of {self.storage.path()}, which also holds "
              f"the newer committed step{'s' if len(newer) > 1 else ''} {steps} ({names}): "
              f"steps only ever increase, so every save up to step {newer[-1].step} would "
              "be refused (StepCollisionError). To train on from step "
              f"{restored.step}, move {names} out of the root, or save into a new root "
              f"(restore from this one with read_only=True, save with a manager on the "
              "new root)", stacklevel=5)

    def _refuse_fresh_start(self, entries: list[CheckpointEntry]) -> None:
        """Nothing committed: never start at step 0 past a newer resumekit's checkpoint.

        Nor beside copies an earlier restore set aside
        (:func:`~resumekit.store.aside.refuse_fresh_start_beside`).
        """
        restore_plan.refuse_newer_schema(entries, below=None)
        if any(e.defect == "set-aside" for e in entries):
            run_on_leader(self.channel.coordinator, lambda: refuse_fresh_start_beside(
                self.storage, self.name_format, -1))

    def _newest_committed(
            self, entries: list[CheckpointEntry], committed: list[CheckpointEntry], *,
            explicit: bool, more: Callable[[], list[CheckpointEntry]] | None = None
    ) -> CheckpointEntry | None:
        """Load the newest of ``committed`` that restores, falling back past bad ones.

        ``more`` reads the entries below those listed, when only the top of the root was
        (the first fallback past the listed ones calls it; ``entries`` grows in place).

        Returns:
            The entry restored, or None when ``committed`` is empty.
        """
        remaining = {e.step for e in entries if e.status == "committed"}
        if remaining:
            self.newest_step = max(remaining)
        may_fall_back = self.options.fallback and not explicit
        failures: list[str] = []
        for entry in restore_plan.fallback_order(entries, committed, more):
            if not explicit:
                restore_plan.refuse_newer_schema(entries, below=entry)
            try:
                self._restore_entry(entry)
            except IncompatibleCheckpointError:
                raise
            except (ResumekitError, FileNotFoundError) as error:
                what, freed = self._entries.unusable_committed(
                    entry, error, may_fall_back=may_fall_back)
                failures.append(f"step {entry.step}: {what}")
                if freed:
                    remaining.discard(entry.step)
                self.newest_step = max(remaining, default=None)
                continue
            self.newest_step = max(remaining, default=None)
            return entry
        if failures:
            raise ResumekitError(
                f"no checkpoint under {self.storage.path()} could be restored: "
                + "; ".join(failures) + ". Tensors are read into the model and optimizer "
                "in place, so they may now hold part of a checkpoint: build them again "
                "before using them (a fresh start from them would not be one)",
                path=self.storage.path(),
            )
        return None

    def _import_newest_legacy(self, entries: list[CheckpointEntry]) -> CheckpointEntry | None:
        """Load the weights of the newest weights-only ``checkpoint_step_N``, if allowed."""
        legacy_entries = [e for e in entries if e.status == "legacy"]
        if not (self.options.import_legacy and legacy_entries
                and self.state.model is not None):
            return None
        entry = legacy_entries[-1]
        legacy.load_weights_only(self.storage, entry.name, self.state.model)
        self.state.step = entry.step
        self.newest_step = None
        _warn(f"imported weights only from legacy {entry.path} (step {entry.step}): "
              "optimizer, scheduler, RNG and data position start fresh - this is NOT "
              "an exact resume")
        return entry

    def _account_for_fresh_start(self, found: Survey, entries: list[CheckpointEntry]) -> None:
        """Nothing to restore: refuse (or warn about) another tool's checkpoint, say why."""
        ignored = restore_plan.foreign_instead(found, self.storage, policy=self.options.foreign)
        if ignored is not None:
            _warn(ignored)
        self._entries.report_leftovers(entries, above=-1, foreign=False, stacklevel=6)
        if self.channel.coordinator.rank == 0:
            said, warnings_ = restore_plan.fresh_start_account(
                found, self.storage, self.name_format,
                import_legacy=self.options.import_legacy,
                has_model=self.state.model is not None)
            logger.info("resumekit: %s", said)
            for message in warnings_:
                _warn(message)

    def _restore_entry(self, entry: CheckpointEntry) -> None:
        """Verify, check and load one committed checkpoint on every rank.

        ``.metadata`` is read and checked on group rank 0 only and sent to the others
        (:func:`~resumekit.restore.verification.share_metadata`); its failure is every
        rank's.
        """
        manifest = entry.manifest
        assert manifest is not None
        ranks = self.channel.coordinator
        verify = self.options.verify_on_restore
        preread, self._preread = self._preread, None  # the first entry's only
        metadata = share_metadata(self.storage, entry.name, manifest, ranks, verify=verify,
                                  preread=preread)
        def check_share() -> None:
            if verify:
                verify_share(self.storage, entry.name, manifest, rank=ranks.rank,
                             world_size=ranks.world_size, metadata=metadata)
            else:
                refuse_links_share(self.storage, entry.name, manifest, rank=ranks.rank,
                                   world_size=ranks.world_size)

        # Where the tensors' load exchanges the metadata parts over the group, a rank's
        # failed check travels in that exchange, which raises it on every rank before a
        # byte is read: no agreement of its own (one all-gather fewer per restore).
        failure: BaseException | None = None
        if metadata is not None and metadata.exchanged and self.state.model is not None:
            try:
                check_share()
            except Exception as error:  # noqa: BLE001 - every rank's, in the load
                failure = error
        else:
            run_on_every_rank(ranks, check_share)
        check_compatibility(manifest, entry.path, fingerprint=self.fingerprint,
                            world_size=self.world_size, on_mismatch=self.options.on_mismatch,
                            stacklevel=5)
        fresh: list[str] = run_on_every_rank(ranks, lambda: self._read_entry(
            self.storage, entry.name, manifest, metadata=metadata, failure=failure))
        if fresh:
            recorded = bool((manifest.fingerprint or {}).get("config"))
            _warn(restore_plan.imported_warning(
                entry, fresh, config_unrecorded=self.config_set and not recorded),
                stacklevel=6)
        logger.info("resumekit: restored step %d from %s", manifest.step, entry.path)

    def read_alone(self, storage: Storage, entry: CheckpointEntry) -> None:
        """Verify, check and read this rank's node-local copy ``entry`` by this rank alone.

        The local tier's read (:mod:`resumekit.local.restore_across` calls it on every rank, each
        with its own copy, and agrees on the outcome): every file checked against the
        copy's manifest, its fit with the run checked, its tensors (this rank's shards)
        read without a collective, then the training state and this rank's RNG and data
        position. A failure raises on this rank only.
        """
        manifest = entry.manifest
        assert manifest is not None
        verify = self.options.verify_on_restore
        metadata = share_metadata(storage, entry.name, manifest, SingleProcess(),
                                  verify=verify)
        if verify:
            verify_share(storage, entry.name, manifest, metadata=metadata)
        else:
            refuse_links_share(storage, entry.name, manifest)
        check_compatibility(manifest, entry.path, fingerprint=self.fingerprint,
                            world_size=self.world_size, on_mismatch=self.options.on_mismatch,
                            stacklevel=6)
        self._read_entry(storage, entry.name, manifest, alone=True, metadata=metadata)

    def adopt(self, step: int) -> None:
        """A restore from another tier read ``step``: take the durable root over as ``run`` does.

        Surveys the durable root (recovering an interrupted replacement), claims this
        run's writer generation, notes the newest committed step (the next durable save
        must be newer) and reports what lies above ``step``.
        """
        found: Survey = run_on_leader(self.channel.coordinator, lambda: restore_plan.survey(
            self.storage, self.name_format, recover=not self.options.read_only,
            whole=False))
        entries = self._entries.claim_generation(found.entries)
        committed = {e.step for e in entries if e.status == "committed"}
        self.newest_step = max(committed, default=None)
        self._entries.report_leftovers(entries, above=step)

    def _read_entry(self, storage: Storage, name: str, manifest: Manifest, *,
                    alone: bool = False, metadata: tensor_io.CheckedMetadata | None = None,
                    failure: BaseException | None = None) -> list[str]:
        """Read step directory ``name`` into the run's state; return the parts left fresh.

        A checkpoint converted by ``resumekit import`` holds what the source tool saved
        (weights, maybe optimizer and scheduler), never its RNG streams or a data
        position: those parts start fresh, and are returned to be named in one warning.
        Anything else missing from one of resumekit's own checkpoints stays an error.
        ``alone``: a node-local copy of this rank's part, read by this rank alone.
        ``metadata``: the tensors' ``.metadata``, already read and checked. With
        ``verify_on_restore`` every file was checked against its checksum first
        (:meth:`_restore_entry`, :meth:`read_alone`): a load failing on them raises a
        :class:`~resumekit.errors.CheckpointLoadError` (no damage, never set aside).
        ``failure``: this rank's failed check of its share of the files, raised on every
        rank by the tensors' load (in its exchange of the metadata parts).
        """
        imported = manifest.reason == SaveReason.IMPORTED
        with_optimizer = not imported or manifest.state.get("optimizer") is not False
        tied = _tied_of(manifest)
        source = storage.url_of(f"{name}/{manifest.data_path(TENSORS_DIR)}")
        options = storage.storage_options or None
        tensors = self.state.load_target(tied, optimizer=with_optimizer, source=source,
                                         storage_options=options, metadata=metadata)
        if failure is not None and (alone or not tensors):
            raise failure  # no collective of the load to carry it: the caller agrees
        if tensors and alone:
            tensor_io.load(tensors, source, verify=self.options.verify_on_restore,
                         storage_options=options, alone=True, metadata=metadata,
                         verified=self.options.verify_on_restore)
            self.state.apply_tensor_state(tensors, tied)
        elif tensors:
            # Each rank plans its own reads (DCP's load plans need no coordination); one
            # all-gather of the outcome replaces DCP's three, and every rank raises alike.
            run_on_every_rank(self.channel.coordinator, functools.partial(
                tensor_io.load, tensors, source, process_group=self.channel.group,
                verify=self.options.verify_on_restore, storage_options=options,
                plan_locally=True, read_once=self.options.restore_reads == "once",
                metadata=metadata, verified=self.options.verify_on_restore,
                failure=failure))
            self.state.apply_tensor_state(tensors, tied)
        train = read_plain(storage, name, manifest, TRAIN_STATE_FILE)
        with_scheduler = not imported or train.get("scheduler") is not None
        self.state.apply_train_state(train, source=storage.path(
            f"{name}/{manifest.data_path(TRAIN_STATE_FILE)}"), scheduler=with_scheduler,
            verified=self.options.verify_on_restore)
        saved_world = int(train.get("world_size", manifest.world_size))
        wanted = {self.rank} if alone else {0, self.rank} & set(range(saved_world))
        saved = {r: read_plain(storage, name, manifest, rank_state_file(r))
                 for r in sorted(wanted)}
        with_data = not imported or saved[min(saved)].get("data") is not None
        self.state.apply_rank_state(saved, self.rank, saved_world_size=saved_world,
                                    world_size=self.world_size, rng=not imported,
                                    data=with_data)
        if not imported:
            return []
        return [part for part, missing in (
            ("data position", self.state.data is not None and not with_data),
            ("scheduler", self.state.scheduler is not None and not with_scheduler),
            ("optimizer", self.state.optimizer is not None and not with_optimizer),
            ("RNG", True)) if missing]


def _tied_of(manifest: Manifest) -> dict[str, str]:
    """The model entries a checkpoint stored once (``state.tied``: ``{alias: kept}``)."""
    tied = manifest.state.get("tied")
    if not isinstance(tied, dict):
        return {}
    return {str(alias): str(kept) for alias, kept in tied.items()}


def _warn(message: str, *, stacklevel: int = 5) -> None:
    warn(message, ResumekitWarning, stacklevel=stacklevel)
