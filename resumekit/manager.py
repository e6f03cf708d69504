"""``CheckpointManager``: the one object a trainer holds.

It orchestrates; every mechanism lives in its own module (commit protocol, catalog,
retention, sharded I/O, RNG, preemption), and so do its helpers: its policy knobs
(:mod:`resumekit.options`), the background save worker (:mod:`resumekit.background`), a
captured save and what follows its commit or failure (:mod:`resumekit.save_job`), its
process-group channels (:mod:`resumekit.runtime.channels`) and what a restore does with
the root's other entries (:mod:`resumekit.restore.entries`), and the restore of one root,
run in order on every rank (:mod:`resumekit.restore_root`). A trainer integrates so::

    ckpt = resumekit.CheckpointManager(root, model=model, optimizer=opt, scheduler=sched,
                                       data=sampler, save_every=100, async_save=True)
    start = ckpt.restore()                  # newest committed checkpoint, or 0
    for step in range(start, num_steps):
        ...train one optimizer step...
        if ckpt.step_end(step + 1):         # saves when due; True after a preemption save
            break
    ckpt.close()

Save path (data flows one way): capture (``TrainState``) -> stage to CPU (async only) ->
``CommitProtocol.begin`` -> DCP write + small per-rank files -> ``publish`` -> retention.
Restore path (``restore_root.RootRestore``): find (``restore_plan.survey`` over the catalog)
-> verify (``verification``: checksums, spread over ranks) -> check compatibility
(``compatibility``) -> read -> apply -> every rank meets on the checkpoint group. What
restore does with every other entry (fall back, set aside, warn, refuse) is decided by
``restore_plan``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from resumekit import tensors
from resumekit.background import BackgroundSave, Boundary, Capture, EmergencyCapture, WriterProcess
from resumekit.background.emergency import optimizer_groups
from resumekit.errors import (
    AsyncSaveError,
    ConfigurationError,
    ResumekitError,
    ResumeStepError,
    StepCollisionError,
)
from resumekit.local.restore_across import TierRestore
from resumekit.local.roots import check_local_root
from resumekit.local.saves import LocalSaves
from resumekit.local.site import LocalJob, LocalSite
from resumekit.options import (
    CheckpointOptions,
    ForeignPolicy,
    MismatchPolicy,
    OptionKeywords,
)
from resumekit.restore_root import RootRestore
from resumekit.runtime import distributed
from resumekit.runtime.channels import Channel, ChannelSet, is_distributed
from resumekit.runtime.preemption import SAVE_TIME_MARGIN, PreemptionHandler
from resumekit.runtime.save_clock import CommitClock, state_bytes
from resumekit.runtime.save_interval import (
    INTERRUPTIONS_EVERY_PRIOR,
    AutoSaveEvery,
    history_interruptions,
)
from resumekit.save_job import SaveJob, StepTarget, apply_retention, lineage, write_step
from resumekit.state import jsonable
from resumekit.state.train_state import (
    Stateful,
    TrainState,
    capturable_model,
    capturable_optimizer,
    dump_plain,
)
from resumekit.store import generations
from resumekit.store.catalog import CheckpointEntry, list_checkpoints
from resumekit.store.coordination import (
    activity,
    run_on_every_rank,
    run_on_leader,
)
from resumekit.store.generations import Fence
from resumekit.store.layout import (
    NameFormat,
)
from resumekit.store.manifest import (
    Manifest,
    SaveInterval,
    SaveReason,
)
from resumekit.store.retention import RollingSweep
from resumekit.store.storage import Storage
from resumekit.tensors import state_dicts
from resumekit.tensors.raw.files import restore_lowered_priorities
from resumekit.tools import weights
from resumekit.warnings import ResumekitWarning, warn

if TYPE_CHECKING:
    from typing import Unpack

__all__ = ["CheckpointInfo", "CheckpointManager", "ForeignPolicy", "MismatchPolicy"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as the manager sees it.

    Attributes:
        step: Its step.
        path: Its directory (or URL).
        manifest: Its manifest.
    """

    step: int
    path: str
    manifest: Manifest


class CheckpointManager:
    """Save and restore a run's complete state under one root, atomically.

    Args:
        root: Checkpoint root: a local path or an fsspec URL (``s3://bucket/run``).
        model: The model (plain, DDP, ``torch.compile``-d or FSDP2 ``fully_shard``-ed; a
            list of exactly one module is taken as it). Its checkpoint keys are its own
            state-dict keys, state-dict hooks included (docs/concepts.md).
        optimizer: Its optimizer, or several over disjoint parameters of the model,
            saved as one: a list, tuple or dict of optimizers, or an ``Optimizer``
            wrapping them in ``optimizers`` (torchtitan's ``OptimizersContainer``).
            What cannot be captured is refused here (``ConfigurationError``), not at
            the first save.
        scheduler: LR scheduler (or any object with state_dict/load_state_dict).
        data: Data position: the ``DataLoader`` the loop iterates (over a resumable
            sampler; resumekit counts the batches it hands out and saves its generator per
            rank, see :mod:`resumekit.state.loader`), torchdata's ``StatefulDataLoader``, a
            ``ResumableDistributedSampler`` or any stateful object.
        generators: Named ``torch.Generator`` objects to resume (noise, augmentation).
        extras: JSON-able user data saved in the manifest and restored, e.g. a wandb run
            id. The manager keeps this very mapping (``manager.extras is extras``) and
            reads it at every save, so changing the dict passed in is saved; restore
            updates it in place with the checkpoint's values. 0-dim tensors and numpy
            scalars are saved as plain numbers (``tensor(0.5)`` reads back as ``0.5``); a
            value that is not JSON-able (a tensor of several elements, an object) is a
            ``TypeError`` here, not at the first save.
        config: Configuration that must match on resume (recorded as a fingerprint).
        preemption: A :class:`~resumekit.runtime.preemption.PreemptionHandler`; when all ranks
            agree a signal arrived, :meth:`step_end` writes a ``preemption`` checkpoint
            and returns True. Installed here (and removed by :meth:`close`) unless it
            already is. A ``DataLoader`` passed as ``data`` is made to start worker
            processes that ignore the handler's signals (its own ``worker_init_fn`` still
            runs, after): see :func:`~resumekit.runtime.preemption.protect_loader_workers`.
        process_group: Group for checkpoint coordination (default: the checkpoint group
            of :func:`~resumekit.init_distributed`, else a new gloo group).
        options: How it saves and restores (:class:`~resumekit.options.CheckpointOptions`:
            ``save_every``, ``retention``, ``async_save``, ``fallback``, ``read_only``,
            ...); the knobs it leaves unset take their defaults, or the keywords below.
        **knobs: Any field of :class:`~resumekit.options.CheckpointOptions`, as a keyword
            (``save_every=100, async_save=True``); a knob also set in ``options`` is a
            :class:`~resumekit.errors.ConfigurationError`. A new knob is an options field,
            not a parameter here.

    Attributes:
        options: The options in force: ``options`` with the keyword knobs filled in.
            Each knob is also an attribute of the manager (``manager.save_every``).

    Raises:
        ConfigurationError: A knob that cannot work (its ``name`` says which), one
            given twice, ``options`` that are not a ``CheckpointOptions``, or a model or
            optimizer a save could not capture (named, with the forms taken).
        TypeError: A keyword that is neither an object above nor a knob, or ``extras``
            or ``config`` that JSON cannot hold.
    """

    # The step the last restore returned, until the first step_end checks that the loop
    # counts on from it; the step of a ``final`` checkpoint restored or written.
    _resume_guard: int | None
    _final_step: int | None
    _stager: Any = None  # the async staging buffers (tensors.CpuStager), made on demand
    # stage_ahead: the optimizer had no state when the buffers were allocated
    _optimizer_unstaged = False
    stage_ahead: bool

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: (torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
                    | Mapping[str, torch.optim.Optimizer] | None) = None,
        scheduler: Stateful | Any | None = None,
        data: Stateful | Any | None = None,
        generators: Mapping[str, torch.Generator] | None = None,
        extras: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        preemption: PreemptionHandler | None = None,
        process_group: dist.ProcessGroup | None = None,
        options: CheckpointOptions | None = None,
        **knobs: Unpack[OptionKeywords],
    ) -> None:
        self.options = options = CheckpointOptions.resolve(options, knobs)
        tensor_format = options.tensor_format
        self.storage = Storage(root, options.storage_options)
        self.read_only = options.read_only
        self.tensor_format: Literal["raw", "dcp"] = tensors.tensor_format_for(
            self.storage.url_of(), tensor_format or "raw")
        if tensor_format == "raw" and self.tensor_format != "raw":
            self._warn(f"tensor_format='raw' cannot write to {self.storage.path()} (raw "
                       "tensor files need a local filesystem): writing DCP's own format "
                       "there, hashed while it is uploaded; pass tensor_format='dcp' to "
                       "choose it explicitly", stacklevel=3)
        self.name_format = NameFormat(options.name_format)
        captured_model = capturable_model(model)  # refused now, not at the first save
        self.state = TrainState(model=captured_model,
                                optimizer=capturable_optimizer(optimizer, captured_model),
                                scheduler=scheduler,
                                data=data, generators=dict(generators or {}))
        self.extras: MutableMapping[str, Any] = jsonable.live_extras(extras)
        self.save_every, self.interruptions_every = (options.save_every,
                                                     options.interruptions_every)
        self.retention = options.retention
        self.async_save = options.async_save
        self.async_writer = options.async_writer
        self.background_priority = options.background_priority
        self.config: dict[str, Any] = jsonable.plain_json(config or {}, what="config")
        self.on_mismatch = options.on_mismatch
        self.fallback = options.fallback
        self.verify_on_restore = options.verify_on_restore
        self.preemption = preemption
        self._installed_preemption = self._take_preemption(preemption, data)
        self.import_legacy, self.foreign = options.import_legacy, options.foreign
        self.resumed_from: int | None = None
        self.initialized_from: weights.WeightsSource | None = None
        self.last_saved_step: int | None = None
        self._resume_guard = self._final_step = None
        self._clock = CommitClock()  # the inputs of the emergency-save decision
        # save_every="auto" (and LocalTier(save_every="auto")): else None
        self._auto_every, self._local_auto = self._start_auto_every()
        # The background save submitted and not yet waited for here: (step, when training
        # after its capture resumed).
        self._pending_async: tuple[int, float] | None = None
        self._newest_step: int | None = None
        # Closed yet; where retention after a save goes on into older step directories.
        self._closed, self._rolling_sweep = False, RollingSweep()
        # A save training waits for runs at normal priority (wait, finish, the next save,
        # the agreed preemption, the emergency capture): its writers are raised.
        self._background = BackgroundSave(boost=self._raise_writers)
        # async_writer="process": the writer process, started at the first background save
        # or when staging ahead; it maps the stager's shared segments.
        self._writer = (WriterProcess(lambda: [] if self._stager is None
                                      else self._stager.segments())
                        if options.async_save and options.async_writer == "process"
                        else None)
        self._active_tokens: set[str] = set()
        self._fence = Fence()  # this run's writer generation, shared by every channel
        self._local_claimed = False  # the training thread claimed for the local copies
        # close() destroys the groups its channels made, once; a failed constructor too.
        self._channels = ChannelSet(self.storage, self.name_format, self._fence)
        self._emergency: EmergencyCapture | None = None
        try:
            self._open(process_group, options, tensor_format, model)
        except BaseException:
            self._abandon()
            raise

    def _open(self, process_group: dist.ProcessGroup | None, options: CheckpointOptions,
              tensor_format: Literal["raw", "dcp"] | None, model: object) -> None:
        """The constructor's part that opens channels and starts threads (undone on failure)."""
        self._main = self._channels.open(process_group)
        # Background saves run collectives from another thread: they get a group of their
        # own so they never interleave with the coordination of the main thread.
        self._saver = (self._channels.open(own_group=True)
                       if options.async_save and self._distributed else self._main)
        # The node-local tier (LocalTier): this rank's own root and the replicas it keeps.
        self._local = None if options.local is None else LocalSite(
            options.local, durable_root=self.storage.url_of(), name_format=self.name_format,
            tensor_format=tensors.tensor_format_for(options.local.root, tensor_format or "raw"),
            rank=self.rank, world_size=self.world_size)
        if options.local is not None:
            # Each node checks its own directory, and one node's can be refused alone: a
            # refusal on any rank is raised on every rank (else the others wait for it in
            # the next group's creation until the checkpoint timeout).
            local_root = options.local.root
            run_on_every_rank(self._main.coordinator,
                              lambda: check_local_root(local_root, self.storage))
        self._local_saves = LocalSaves(  # staged in step_end, written in the background
            self._channels.open(own_group=True)
            if self._local is not None and self._distributed else self._main,
            boost=self._raise_writers, page_aligned=self.tensor_format == "raw")
        self.restored_from_tier: Literal["local", "replica", "durable"] | None = None
        # At a preemption signal: the last completed step, copied and written at once
        # (resumekit.background.emergency), on a group of its own.
        self._emergency_channel = self._main
        self._emergency_cuda = False
        if (self.preemption is not None and options.capture_at_signal
                and not self.read_only and model is not None):
            self._start_emergency(self.preemption, self.state.optimizer)
        self._prepare_staging(stage_ahead=options.stage_ahead)

    def _abandon(self) -> None:
        """Undo a constructor that failed: stop its threads, destroy the groups it made.

        The constructor's error is the one raised (any other is logged). The ranks may not
        all have failed: the groups are destroyed without meeting on them.
        """
        for error in self._release((self._stop_emergency, self._uninstall_preemption,
                                    self._close_writer), meet=False):
            logger.warning("resumekit: undoing a CheckpointManager whose constructor "
                           "failed: %s: %s", type(error).__name__, error)

    def _release(self, steps: Sequence[Any], *, meet: bool) -> list[BaseException]:
        """Run ``steps`` (each even if one before failed), then destroy the groups made.

        The groups go once no thread uses them; the manager keeps no reference to them
        (a destroyed group's sockets close with its last one). Returns the errors.
        """
        self._closed, errors = True, []
        for step in steps:
            try:
                step()
            except BaseException as error:  # noqa: BLE001 - returned, after the rest
                errors.append(error)
        try:
            self._main = self._channels.close(meet=meet)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
            self._main = self._channels.close(meet=False)  # destroyed: a channel of none
        self._saver = self._emergency_channel = self._main
        if hasattr(self, "_local_saves"):
            self._local_saves.channel = self._main
        return errors

    @staticmethod
    def _take_preemption(preemption: PreemptionHandler | None, data: object) -> bool:
        """Install the handler unless the caller did (True: the manager removes it on close).

        A ``DataLoader`` given as ``data`` has its workers protected: torchrun's agent
        signals process groups and SLURM every process of the step, and a worker that dies
        of the signal takes the loader, and the emergency save, with it.
        """
        if preemption is None:
            return False
        installed_here = not preemption.installed
        if installed_here:
            preemption.install()
        if isinstance(data, DataLoader):
            preemption.protect_loader(data)
        return installed_here

    # -- process groups -----------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return is_distributed()

    @property
    def rank(self) -> int:
        """This process's rank (0 without a process group)."""
        return dist.get_rank() if self._distributed else 0

    @property
    def world_size(self) -> int:
        """Number of ranks (1 without a process group)."""
        return dist.get_world_size() if self._distributed else 1

    # -- finding ------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointEntry]:
        """List the root's entries (committed, partial, corrupt, legacy), oldest first."""
        return list_checkpoints(self.storage, self.name_format)

    def latest(self) -> CheckpointInfo | None:
        """Return the newest committed checkpoint, or None.

        One listing of the root and the manifests of its newest step directories (from
        the top down until one validates): the cost does not grow with the checkpoints
        below it. On a local root nothing changed since the last save (its stat is the
        one stamped in the newest-step hint), it is one ``stat``, the hint and the newest
        manifest, with no listing (:mod:`resumekit.store.commit`). It is the checkpoint
        :meth:`restore` would start from: a checkpoint a fenced writer committed
        (inside the race window of the commit) is passed over with a warning naming it,
        as restore passes it over.
        """
        entry, passed = generations.newest_restorable(self.storage, self.name_format)
        for path, reason in passed.items():
            self._warn(f"latest(): passing over {path}: {reason}; restore() never resumes "
                       "from it", stacklevel=3)
        if entry is None:
            return None
        assert entry.manifest is not None
        return CheckpointInfo(entry.step, entry.path, entry.manifest)

    # -- restoring ----------------------------------------------------------------------
    def restore(self, step: int | None = None) -> int:
        """Restore the newest committed checkpoint (or ``step``); return the step to resume.

        Returns 0 on a fresh start, and says why (logged; a warning when the root holds
        anything that is not a committed checkpoint). Every entry newer than the one
        restored that is not a usable checkpoint is warned about; what is provably broken
        (a garbled, missing or unsafe manifest, one naming another step) is set aside
        under a hidden ``.bad-`` name so that its step can be saved again. Ends with every
        rank meeting on the checkpoint group, so ranks that finished loading early wait
        there (long timeout), never in a training collective. The decisions are
        :mod:`resumekit.restore.plan`'s; this method runs them in order.

        Raises:
            CheckpointNotFoundError: ``step`` was asked for and is not committed.
            IncompatibleCheckpointError: The checkpoint does not fit this run.
            UnsupportedSchemaError: A checkpoint newer than every usable one was written
                by a newer resumekit (never fallen back past, never set aside).
            ForeignCheckpointError: No resumekit checkpoint, but another tool's (and
                ``foreign="error"``): the message gives the ``resumekit import`` command.
            StorageError: Reading failed even after retries (the checkpoint is kept).
            ResumekitError: Every candidate failed and ``fallback`` could not help.
        """
        self._check_open()
        self._local_saves.wait()  # a restore reads the local copies
        for auto in self._autos():
            auto.restart()
        if self._emergency is not None:  # no completed step to copy until the next one
            self._emergency.mark(None)
            self._emergency.set_template(None)
        restore = RootRestore(
            self.storage, self.name_format, self.state, self._main, self.options,
            fingerprint=self._fingerprint(), config_set=bool(self.config), rank=self.rank,
            world_size=self.world_size, newest_step=self._newest_step)
        tiers = (None if self._local is None
                 else TierRestore(self._local, self.storage, self.name_format, self._main))
        entry: CheckpointEntry | None = None
        try:
            if tiers is not None and step is not None:
                tiers.prepare(stacklevel=6)  # only to delete what the run leaves behind
            local = None if tiers is None or step is not None else tiers.run(
                restore.read_alone)
            if local is not None:
                restore.adopt(local.step)
                self.restored_from_tier = local.tier
                manifest: Manifest | None = local.manifest
                reason = f"end of restore from local step {local.step}"
            else:
                restored = restore.run(step)
                entry, manifest, reason = restored.entry, restored.manifest, restored.reason
        finally:
            self._newest_step = restore.newest_step
        if tiers is not None:
            self._after_tier_restore(tiers, local is None, manifest)
        if manifest is not None:
            self.extras.update(manifest.extras)
            self._final_step = manifest.step if manifest.reason == SaveReason.FINAL else None
            self.last_saved_step = manifest.step
            if manifest.save_throughput is not None:  # a requeued process knows its rate
                record = manifest.save_throughput
                self._clock.seed_throughput(manifest.step, record.bytes, record.seconds,
                                            blocking=record.blocking)
        if manifest is not None:
            self.resumed_from = manifest.step
        elif entry is not None:
            self.resumed_from = entry.step
        self._finish_restore(reason)
        if self.resumed_from is None:
            return 0
        self._resume_guard = self.state.step
        return self.state.step

    def _after_tier_restore(self, tiers: TierRestore, durable: bool,
                            manifest: Manifest | None) -> None:
        """Say (and record) the tier a restore read; clear local copies it must not keep."""
        step = None if manifest is None else manifest.step
        if durable:
            self.restored_from_tier = None if manifest is None else "durable"
            tiers.say_durable(step)
        tiers.tidy(step)

    def _warn(self, message: str, *, stacklevel: int = 4) -> None:
        warn(message, ResumekitWarning, stacklevel=stacklevel)

    def _prepare_staging(self, *, stage_ahead: bool | None = None) -> None:
        """Allocate the async staging buffers now (``stage_ahead``), not at the first save.

        An optimizer without state yet is left out (building its state would take an
        optimizer step): its buffers are allocated at the first :meth:`step_end` after
        it has state, so that the first async save of a fresh run does not allocate them
        while training waits.

        Args:
            stage_ahead: Record this setting first (the constructor's argument).
        """
        if stage_ahead is not None:
            self.stage_ahead = stage_ahead
        if (not (self.async_save and self.stage_ahead) or self.read_only
                or self.state.model is None):
            return
        if self._stager is None:
            self._stager = self._new_stager()
        if self._writer is not None and stage_ahead is not None:  # built just now
            self._writer.start()  # it starts up while the buffers are touched
        optimizer = self.state.optimizer
        self._optimizer_unstaged = optimizer is not None and not all(
            part.state for part in state_dicts.optimizer_parts(optimizer))
        if self._optimizer_unstaged:
            tensor_state = state_dicts.model_and_optimizer_state(self.state.model, None)
        else:
            tensor_state = self.state.tensor_state()
            self._set_template(tensor_state)
        self._stager.prepare(tensor_state)

    def _new_stager(self) -> tensors.CpuStager:
        return tensors.CpuStager(page_aligned=self.tensor_format == "raw",
                                 shared=self._writer is not None)

    def _finish_restore(self, reason: str) -> None:
        self._prepare_staging()
        if self._distributed:
            distributed.meet(self._main.group, reason=reason)

    def _fingerprint(self, params: dict[str, list[Any]] | None = None) -> dict[str, Any]:
        """This run's fingerprint; ``params`` those of a capture just taken, if any."""
        return {"config": self.config,
                "params": self.state.fingerprint_params() if params is None else params}

    # -- saving -------------------------------------------------------------------------
    def step_end(self, step: int, *, micro_step: int = 0,
                 metrics: Mapping[str, float] | None = None) -> bool:
        """Call once per optimizer step, after it; saves when due.

        Args:
            step: Optimizer steps completed (the step a resume would start from).
            micro_step: Position inside gradient accumulation, if not at a boundary.
            metrics: Numbers to record with a checkpoint this call saves (e.g.
                ``{"val_loss": 0.31}``), what :func:`~resumekit.store.retention.keep_best` ranks
                by; ignored when it saves nothing.

        Returns:
            True when the run must stop now: every rank agreed on a preemption signal and
            a ``preemption`` checkpoint of ``step`` is committed (or was skipped, with an
            ``EmergencySaveSkippedWarning``, because the grace period would not allow it).
            A ``save_every`` step is always committed before True is returned, also with
            ``async_save``.
        """
        self._check_open()
        self._check_counts_on(step)
        optimizer = self.state.optimizer
        if self._optimizer_unstaged and optimizer is not None and all(
                part.state for part in state_dicts.optimizer_parts(optimizer)):  # each one
            self._prepare_staging()  # the optimizer's buffers, now that it has state
        self._clock.step_started(step)
        for auto in self._autos():
            auto.step_ended(step)
        try:
            if self.preemption is not None and self.preemption.agreed(step):
                self._save_for_preemption(step, micro_step, metrics)
                return True
            if self._scheduled(step) and step != self.last_saved_step:
                began = None if self._auto_every is None else self._auto_every.clock()
                self.save(step, reason=SaveReason.INTERVAL, micro_step=micro_step,
                          metrics=metrics)
                if began is not None:
                    self._choose_interval(step, began)
            if self._local is not None and self._local_due(step):
                began = None if self._local_auto is None else self._local_auto.clock()
                self._clock.hold(lambda: self._save_local(step, micro_step, metrics))
                if began is not None:
                    self._choose_interval(step, began, local=True)
            self._mark_boundary(step, micro_step)
            return False
        finally:
            self._clock.step_returned(step)
            for auto in self._autos():
                auto.step_returned(step)

    def _check_counts_on(self, step: int) -> None:
        """The first ``step_end`` after a restore must be past the step restore returned."""
        restored, self._resume_guard = self._resume_guard, None
        if restored is None or step > restored:
            return
        raise ResumeStepError(
            f"step_end({step}) right after restoring step {restored} from "
            f"{self.storage.path()}: the loop must continue from the step restore() "
            f"returned (for step in range(ckpt.restore(), num_steps): ... "
            f"ckpt.step_end(step + 1)), not count from {step - 1 if step else 0} again - "
            f"it would retrain steps already in the checkpoint",
            name="step", value=step, step=step, restored=restored, path=self.storage.path())

    def _save_local(self, step: int, micro_step: int,
                    metrics: Mapping[str, float] | None) -> None:
        """Stage every rank's own copy of ``step``; commit (and replicate) it in the background.

        Training waits for the previous local save (its buffers are reused) and for the
        staging copy (:class:`~resumekit.local.saves.LocalSaves`).
        """
        local = self._local
        assert local is not None
        self._settle_emergency()
        if not self._local_claimed:  # the copies record the durable claim
            # Every rank claims (a collective), whatever the shared fence says: a background
            # save's thread may have claimed on one rank and not yet on another.
            self._main.protocol.claim(check_held=False)
            self._local_claimed = True
        tensor_state, train, ranks, manifest = self._capture(
            step, SaveReason.INTERVAL, micro_step, jsonable.finite_metrics(metrics, step))
        generation = self._fence.generation
        self._local_saves.submit(step, tensor_state, lambda staged, channel: local.save(
            LocalJob(step, staged, train, ranks, manifest), channel, generation))

    def _scheduled(self, step: int) -> bool:
        if self._auto_every is not None:
            return self._auto_every.due(step)
        return isinstance(self.save_every, int) and step % self.save_every == 0

    # -- save_every="auto" (resumekit.runtime.save_interval) ------------------------------
    def _start_auto_every(self) -> tuple[AutoSaveEvery | None, AutoSaveEvery | None]:
        """The auto intervals' state (durable, local), with the override, history or prior."""
        local = self.options.local
        local_auto = local is not None and local.save_every == "auto"
        if self.save_every != "auto" and not local_auto:
            return None, None
        if self.interruptions_every is not None:
            seconds, source = self.interruptions_every, "interruptions_every= (given)"
        else:
            found, said = history_interruptions(self.storage, self.name_format)
            seconds, source = ((INTERRUPTIONS_EVERY_PRIOR,
                                f"the prior ({said}; interruptions_every= overrides it)")
                               if found is None else (found, said))
        return (AutoSaveEvery(seconds, source) if self.save_every == "auto" else None,
                AutoSaveEvery(seconds, source) if local_auto else None)

    def _autos(self) -> list[AutoSaveEvery]:
        return [auto for auto in (self._auto_every, self._local_auto) if auto is not None]

    def _local_due(self, step: int) -> bool:
        assert self._local is not None
        if self._local_auto is not None:
            return self._local_auto.due(step)
        return self._local.due(step)

    @property
    def local_save_interval(self) -> int | None:
        """The local tier's interval in force (``"auto"``: None before its first choice)."""
        if self._local_auto is not None:
            return self._local_auto.steps
        local = self.options.local
        return local.save_every if local is not None and isinstance(
            local.save_every, int) else None

    @property
    def save_interval(self) -> int | None:
        """The interval in force: ``save_every``, or what ``"auto"`` chose (None before)."""
        if self._auto_every is not None:
            return self._auto_every.steps
        return self.save_every if isinstance(self.save_every, int) else None

    def _interval_record(self) -> SaveInterval:
        """The interval in force, for the manifest (what ``resumekit inspect`` shows)."""
        auto = self._auto_every
        if auto is None:
            return SaveInterval(steps=self.save_interval)
        chosen = auto.chosen
        inputs = ("not chosen yet (the first interval save measures a save's cost); "
                  f"interruptions from {auto.source}") if chosen is None else (
            f"{chosen.inputs}; interruptions from {auto.source}")
        return SaveInterval(steps=auto.steps, auto=True, inputs=inputs)

    def _choose_interval(self, step: int, began: float, *, local: bool = False) -> None:
        """After the interval save of ``step`` (begun at ``began``): the next interval.

        ``local``: the local tier's; its saves write in the background, so the interval
        holds at least the last local write measured (this one is still writing).
        """
        auto = self._local_auto if local else self._auto_every
        assert auto is not None
        blocking = max(0.0, auto.clock() - began)
        overlapped = bool(self.async_save) or local
        write = (self._local_saves.write_seconds if local else
                 self._clock.write_seconds(self._state_nbytes(), blocking=not overlapped))
        proposal = auto.propose(blocking_s=blocking, write_s=write or 0.0,
                                overlapped=overlapped)
        steps = proposal.steps
        if self._distributed:  # every rank saves at the same steps: the largest wish
            wish = torch.tensor([steps], dtype=torch.int64)
            dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=self._main.group)
            steps = int(wish.item())
        if auto.adopt(step, steps, proposal):
            logger.info("resumekit: %ssave_every='auto' saves every %d steps from step %d "
                        "(%s; interruptions from %s)", "local." if local else "", steps,
                        step, proposal.inputs, auto.source)

    def _save_for_preemption(self, step: int, micro_step: int,
                             metrics: Mapping[str, float] | None) -> None:
        handler = self.preemption
        scheduled = self._scheduled(step)
        nbytes = self._state_nbytes()
        # A background save may still be writing and the grace window runs: say now,
        # before waiting for it, whether a save of this step fits after it. Every rank
        # submitted the same saves, so every rank takes this branch alike.
        pending = self._pending_async
        if (handler is not None and pending is not None and handler.seconds_left() is not None
                and self._emergency_save_skipped(step, nbytes, pending, scheduled)):
            self._settle_emergency()
            self._wait_before_stopping()  # the save in flight is the newest committed
            return
        self._settle_emergency()  # the copy of the last completed step, written or not
        self._wait_before_stopping()  # an interval save in flight commits first
        newest = self.last_saved_step
        if step == newest:
            logger.info("resumekit: preempted at step %d, which is already committed", step)
            return
        if scheduled:
            # The save this step was due anyway: only the clock may drop it (with
            # async_save it would otherwise be lost, and the run stop an interval behind).
            logger.info("resumekit: preempted at save_every step %d: saving it blocking "
                        "if the grace period holds it", step)
        if handler is not None and self._emergency_save_skipped(
                step, nbytes, None if newest is None else (newest, None), scheduled):
            return
        self.save(step, reason=SaveReason.PREEMPTION, micro_step=micro_step, blocking=True,
                  metrics=metrics)

    def _wait_before_stopping(self) -> None:
        """:meth:`wait` at an agreed preemption: a failed local save (a cache) only warns."""
        self._background.wait()
        self._pending_async = None
        try:
            self._local_saves.wait()
        except AsyncSaveError as error:
            self._warn(f"{error}; the preemption's save to the durable root goes on", stacklevel=5)

    def _emergency_save_skipped(self, step: int, nbytes: int,
                                newest: tuple[int, float | None] | None,
                                scheduled: bool) -> bool:
        """Ask the handler's rule, fed by the clock (a ``save_every`` step: the clock only).

        ``newest`` is the step that stays newest without this save and, for a background
        save not yet committed, when training after its capture resumed.
        """
        assert self.preemption is not None
        estimate = self._clock.estimate(nbytes)
        since: float | None = None
        if newest is not None and not scheduled:
            resumed = newest[1]
            since = (self._clock.training_seconds_since_commit(step, newest[0])
                     if resumed is None else time.monotonic() - resumed)
        steps = None if scheduled or newest is None else step - newest[0]
        return self.preemption.should_skip_emergency_save(
            since, self._clock.expected_save_seconds(),
            steps_since_last_commit=steps, estimate=estimate,
            newest_step=None if newest is None else newest[0])

    def _raise_writers(self) -> None:
        """Put this process's and the writer process's idle-priority threads back to normal."""
        restore_lowered_priorities(os.getpid())
        pid = None if self._writer is None else self._writer.pid
        if pid is not None:
            restore_lowered_priorities(pid)

    # -- the emergency capture (resumekit.background.emergency) ---------------------------
    def _start_emergency(self, preemption: PreemptionHandler,
                         optimizer: state_dicts.Optimizers | None) -> None:
        """Start the capture thread (and, with several ranks, its own gloo group)."""
        if self._distributed:
            self._emergency_channel = self._channels.open(own_group=True)
        self._emergency = EmergencyCapture(
            preemption, optimizer=optimizer, stager=self._emergency_stager,
            before_copy=self._background.join, agree=self._agree_emergency,
            write=self._write_emergency)

    def _set_template(self, tensor_state: dict[str, Any]) -> None:
        """Give the emergency capture the tensor state just built (live views)."""
        if self._emergency is None:
            return
        self._emergency_cuda = any(
            isinstance(value, torch.Tensor) and value.device.type == "cuda"
            for value in _leaves(tensor_state))
        self._emergency.set_template(tensor_state)

    def _mark_boundary(self, step: int, micro_step: int) -> None:
        """Step ``step`` is complete: record its small state for an emergency capture."""
        capture = self._emergency
        if capture is None:
            return
        optimizer = self.state.optimizer
        if not capture.has_template:
            if optimizer is not None and not all(
                    part.state for part in state_dicts.optimizer_parts(optimizer)):
                return  # building its state would take an optimizer step
            self._set_template(self.state.tensor_state())
        event = None
        if self._emergency_cuda:
            event = torch.cuda.Event()
            event.record()  # the capture's stream waits for the step's kernels
        self.state.step, self.state.micro_step = step, micro_step
        capture.mark(Boundary(
            step=step, micro_step=micro_step,
            train=dump_plain(self.state.train_state(self.world_size),
                             what=f"training state of step {step}"),
            ranks=dump_plain(self.state.rank_state(watch=False),
                             what=f"rank {self.rank} state of step {step}"),
            groups=optimizer_groups(optimizer), captured_at=datetime.now(timezone.utc),
            resumed=time.monotonic(), event=event))

    def _emergency_stager(self) -> tensors.CpuStager:
        """The staging buffers an emergency capture copies into (the async ones, if any)."""
        if self._stager is None:
            self._stager = self._new_stager()
        stager: tensors.CpuStager = self._stager
        return stager

    def _settle_emergency(self) -> None:
        """A settle point of the emergency capture: every rank calls it at the same places."""
        if self._emergency is None:
            return
        outcome = self._emergency.settle()
        if outcome is not None and outcome.committed is not None:
            self.last_saved_step = max(self.last_saved_step or 0, outcome.committed)

    def _agree_emergency(self, capture: Capture | None) -> tuple[int | None, str]:
        """On the capture thread: do all ranks hold a copy of one step that fits? Say it."""
        step = -1 if capture is None else capture.boundary.step
        newest = self._background.committed_newest(self._newest_step, self.last_saved_step)
        why = ""
        if capture is not None and newest is not None and step <= newest:
            why = f"step {step} is already committed"
            step = -1
        nofit = 0
        if capture is not None and step >= 0:
            nbytes = state_bytes(capture.tensors)
            estimate = self._clock.estimate(nbytes)
            left = None if self.preemption is None else self.preemption.seconds_left()
            needed = estimate.seconds
            if left is not None and needed is not None and needed * SAVE_TIME_MARGIN > left:
                nofit = 1
                why = (f"its write ({estimate.describe()}) does not fit the {left:.1f} s "
                       "left of the grace period")
        low = high = step
        if self._distributed:
            ballot = torch.tensor([step, -step, nofit], dtype=torch.int64)
            dist.all_reduce(ballot, op=dist.ReduceOp.MAX,
                            group=self._emergency_channel.group)
            high, negated_low, nofit = (int(value) for value in ballot.tolist())
            low = -negated_low
        if capture is None:
            return None, "this rank holds no copy"
        copied = (f"copied in {capture.copied_in:.2f} s, "
                  f"{capture.copied_at - capture.signal_at:.2f} s after the signal")
        if low != high or low < 0:
            said = (f"not written: {why or 'the ranks hold no copy of one same step'} "
                    f"(ranks hold steps {low}..{high}; -1: none); the agreed preemption "
                    "saves as without it")
        elif nofit:
            why = why or "its write does not fit the grace period on some rank"
            said = f"not written: {why}; the agreed preemption decides"
        else:
            said = ""
        if said:
            logger.warning("resumekit: emergency copy of step %d (%s) %s",
                           capture.boundary.step, copied, said)
            return None, said
        return step, f"step {step} {copied}"

    def _write_emergency(self, capture: Capture) -> None:
        """On the capture thread: write and commit the copy every rank agreed on."""
        boundary = capture.boundary
        contents = {**self.state.contents(), "micro_step": boundary.micro_step}
        source = self.initialized_from
        manifest = Manifest(
            step=boundary.step, world_size=self.world_size, reason=SaveReason.PREEMPTION,
            lineage=lineage(self.resumed_from,
                                   None if source is None else (source.path, source.step),
                                   tier=self.restored_from_tier, started_at=self._clock.started_at),
            extras=jsonable.plain_extras(self.extras), metrics={}, state=contents,
            fingerprint=self._fingerprint(self.state.captured_params),
            captured_at=boundary.captured_at,
            tensor_format=self.tensor_format if capture.tensors else None)
        started = time.monotonic()
        logger.warning("resumekit: emergency save of step %d: copied in %.2f s, writing "
                       "from %.2f s after the signal, while the step in progress runs",
                       boundary.step, capture.copied_in, started - capture.signal_at)
        job = SaveJob(boundary.step, False, capture.tensors, boundary.train, boundary.ranks,
                      manifest, capture.signal_at)
        with activity(f"emergency save of step {boundary.step}", step=boundary.step):
            self._write(job, self._emergency_channel)
        self._newest_step = boundary.step
        self._clock.captured(boundary.step, boundary.resumed)

    def _state_nbytes(self) -> int:
        """Bytes a save of the state would write: the model's and optimizer's tensors."""
        model, optimizer = self.state.model, self.state.optimizer
        return state_bytes([{} if model is None else model.state_dict(),
                            [] if optimizer is None else [
                                list(part.state.values())
                                for part in state_dicts.optimizer_parts(optimizer)]])

    def save(
        self,
        step: int,
        *,
        reason: SaveReason | str = SaveReason.MANUAL,
        replace: bool = False,
        micro_step: int = 0,
        blocking: bool | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Save the full state as checkpoint ``step``.

        Args:
            step: The step to save (must be newer than every committed step).
            reason: Why (recorded in the manifest).
            replace: Atomically replace an existing committed checkpoint of this step.
            micro_step: Position inside gradient accumulation.
            blocking: Override ``async_save`` for this save.
            metrics: Finite numbers recorded in the manifest (``Manifest.metrics``), what
                :func:`~resumekit.store.retention.keep_best` ranks by.

        Raises:
            StepCollisionError: ``step`` is not newer than the newest committed step.
            AsyncSaveError: The previous background save failed.
            ConfigurationError: The manager is ``read_only``, or a metric is not a finite
                number.
        """
        self._check_open()
        entered, recorded = time.monotonic(), jsonable.finite_metrics(metrics, step)
        if self.read_only:
            raise ConfigurationError(
                f"cannot save step {step} under {self.storage.path()}: this manager is "
                "read_only (it restores without claiming the root)",
                name="read_only", value=True)
        self._settle_emergency()
        self._background.wait()
        self._pending_async = None
        if self._newest_step is not None and step <= self._newest_step and not replace:
            raise StepCollisionError(
                f"cannot save step {step} under {self.storage.path()}: step "
                f"{self._newest_step} is already committed (steps only ever increase)",
                step=step, newest=self._newest_step, path=self.storage.path(),
            )
        started = time.monotonic()
        reason = SaveReason(reason)
        self._resume_guard = None  # saving a step: the loop's count is what it saves
        self._final_step = step if reason == SaveReason.FINAL else None
        tensor_state, train, ranks, manifest = self._capture(step, reason, micro_step, recorded)
        run_async = self.async_save if blocking is None else not blocking
        if run_async:
            if self._stager is None:
                self._stager = self._new_stager()
            job = SaveJob(step, replace, self._stager.stage(tensor_state), train, ranks,
                           manifest, started,
                           background=self.background_priority == "idle",
                           writer=self._writer)
            self._newest_step = step
            resumed = self._clock.resumes(entered)  # training after this capture starts now

            def write_in_background() -> None:
                with activity(f"background save of step {step}", step=step):
                    self._write(job, self._saver, blocking=False)
                self._clock.captured(step, resumed)

            self._background.submit(step, write_in_background)
            self._pending_async = (step, resumed)
            return
        with activity(f"save of step {step}", step=step):
            self._write(SaveJob(step, replace, tensor_state, train, ranks, manifest, started,
                                since=entered), self._main)
        self._newest_step = step
        self._clock.blocking_save_took(time.monotonic() - started, held_since=entered)
        self._clock.captured(step, time.monotonic())

    def _capture(self, step: int, reason: SaveReason, micro_step: int,
                 recorded: dict[str, float]) -> tuple[dict[str, Any], bytes, bytes, Manifest]:
        """Capture the state of ``step``: tensors, training and rank state, the manifest."""
        captured_at = datetime.now(timezone.utc)
        self.state.step, self.state.micro_step = step, micro_step
        tensor_state = self.state.tensor_state()
        self._set_template(tensor_state)
        train = dump_plain(self.state.train_state(self.world_size),
                           what=f"training state of step {step}")
        ranks = dump_plain(self.state.rank_state(), what=f"rank {self.rank} state of step {step}")
        source = self.initialized_from
        manifest = Manifest(
            step=step, world_size=self.world_size, reason=reason,
            lineage=lineage(self.resumed_from,
                                   None if source is None else (source.path, source.step),
                                   tier=self.restored_from_tier, started_at=self._clock.started_at),
            extras=jsonable.plain_extras(self.extras), metrics=recorded,
            state=self.state.contents(),
            fingerprint=self._fingerprint(self.state.captured_params),
            captured_at=captured_at,
            tensor_format=self.tensor_format if tensor_state else None,
        )
        return tensor_state, train, ranks, manifest

    def _write(self, job: SaveJob, channel: Channel, *, blocking: bool = True) -> None:
        """Commit ``job`` on ``channel`` (:func:`~resumekit.save_job.write_step`), on the clock."""
        coordinator = channel.coordinator
        target = StepTarget(channel.protocol, coordinator.rank, self.tensor_format,
                            group=channel.group)

        def retain() -> None:
            self.last_saved_step = job.step
            if self.retention is not None:
                apply_retention(
                    job.step, self.storage, self.retention, name_format=self.name_format,
                    protect=() if self.resumed_from is None else (self.resumed_from,),
                    active_tokens=set(self._active_tokens), rolling=self._rolling_sweep,
                    coordinator=coordinator)

        with self._clock.writing(job.step, state_bytes(job.tensors), blocking=blocking,
                                 held_from=job.since, captured=job.started) as timing:
            write_step(job, target, retain=retain, timing=timing,
                       active_tokens=self._active_tokens,
                       describe=lambda manifest: manifest.model_copy(
                           update={"save_interval": self._interval_record()}))
        logger.info("resumekit: committed step %d in %.2fs", job.step,
                    self._clock.last_save_seconds)

    def finish(self, step: int) -> None:
        """Commit the run's last step as a ``final`` checkpoint; call once after the loop.

        ``step_end`` saves only on its interval, so a run whose last step is not a
        multiple of ``save_every`` would otherwise end unsaved. Blocking (waits for a
        background save and the local tier's save in flight first). Nothing is written
        when ``step`` is already committed as ``final`` (a relaunch of a finished run);
        when it is committed for another reason (its ``save_every`` save), it is
        replaced, atomically, by the same state marked ``final``, so that :attr:`finished`
        and the newest manifest's ``reason`` tell a relaunch or a wrapper script that the
        run is done.

        Args:
            step: Optimizer steps completed (the loop's last ``step_end`` step).

        Raises:
            StepCollisionError: A newer step than ``step`` is committed.
        """
        self._check_open()
        self._background.wait()
        self._local_saves.wait()  # the run ends: its last local save committed too
        if self._final_step == step:
            logger.info("resumekit: step %d is already committed as final", step)
            return
        if self._newest_step == step:
            logger.info("resumekit: step %d is committed; re-committing it as final", step)
            self.save(step, reason=SaveReason.FINAL, replace=True, blocking=True)
            return
        self.save(step, reason=SaveReason.FINAL, blocking=True)

    @property
    def finished(self) -> bool:
        """Whether the run is done: a ``final`` checkpoint was restored or committed.

        That is, the checkpoint :meth:`restore` restored, or the last one this manager
        committed, was written by :meth:`finish`. A relaunch of a finished run checks it
        after :meth:`restore` and trains nothing.
        """
        return self._final_step is not None

    def load_weights(self, source: str | os.PathLike[str], step: int | None = None, *,
                     strict: bool = True, name_format: str | None = None,
                     storage_options: dict[str, Any] | None = None) -> int | None:
        """Start a fine-tune: the model's weights only, from another run's checkpoint.

        Call it after :meth:`restore` returned 0. The weights of ``source`` (a root's
        newest committed checkpoint, its ``step``, or one step directory) are read into
        the model, resharded as needed (a checkpoint of N ranks into a model sharded over
        M); the step stays 0, and the optimizer, scheduler, RNG and data position stay as
        they are (fresh); the source's configuration is not compared. Checkpoints this
        run saves record the source in ``lineage.initialized_from``.

        Once this root holds a committed checkpoint of its own (a requeued fine-tune),
        :meth:`restore` resumes from it and this loads nothing (logged)::

            start = ckpt.restore()
            ckpt.load_weights("/ckpt/pretrain")      # only while start == 0
            for step in range(start, num_steps): ...

        Args:
            source: A checkpoint root or step directory (path or fsspec URL).
            step: The step to read from a root (None: its newest committed).
            strict: Every model entry must be in the checkpoint with its shape and dtype,
                and the checkpoint hold no other model tensor; False loads what fits and
                warns, naming what does not.
            name_format: Step directory names of ``source`` (default: this manager's).
            storage_options: fsspec options for ``source`` (default: this root's).

        Returns:
            The step of the checkpoint the weights came from, or None when this run
            resumed its own checkpoint and nothing was loaded.

        Raises:
            ConfigurationError: No model, or this root holds a committed checkpoint that
                :meth:`restore` has not restored (call it first).
            CheckpointNotFoundError: ``source`` holds no committed checkpoint (of ``step``).
            IncompatibleCheckpointError: ``strict`` and the weights do not fit (nothing
                is loaded).
        """
        self._check_open()
        if self.state.model is None:
            raise ConfigurationError("load_weights needs a model (model=...)",
                                     name="model", value=None)
        if self.resumed_from is not None:
            logger.info("resumekit: not loading weights from %s: this run resumed its own "
                        "checkpoint of step %d under %s", os.fspath(source),
                        self.resumed_from, self.storage.path())
            return None
        own = run_on_leader(self._main.coordinator, self.latest)
        if own is not None:
            raise ConfigurationError(
                f"{self.storage.path()} holds committed step {own.step}: call restore() "
                f"before load_weights({os.fspath(source)!r}) - a requeued fine-tune resumes "
                "its own checkpoints", name="source", value=os.fspath(source),
                path=own.path)
        options = self.storage.storage_options if storage_options is None \
            else storage_options
        found: weights.WeightsSource = run_on_leader(
            self._main.coordinator, lambda: weights.resolve_weights_source(
            source, step, name_format=name_format or self.name_format.template,
            storage_options=options or None, verify=self.verify_on_restore))

        def read() -> None:
            assert self.state.model is not None
            weights.load_model_weights(self.state.model, found, strict=strict,
                                       process_group=self._main.group,
                                       storage_options=options or None,
                                       verify=self.verify_on_restore,
                                       read_once=self.options.restore_reads == "once")

        run_on_every_rank(self._main.coordinator, read)
        self.initialized_from = found
        self._finish_restore(f"end of load_weights from {found.path}")
        logger.warning("resumekit: loaded model weights only from %s (step %d); step 0, "
                       "optimizer, scheduler, RNG and data position start fresh",
                       found.path, found.step)
        return found.step

    # -- lifecycle ----------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the background and local saves in flight commit; re-raise an error.

        Idempotent.
        """
        self._background.wait()
        self._pending_async = None
        self._local_saves.wait()

    def close(self) -> None:
        """Wait for the background save and release resources. Idempotent.

        Every rank calls it (it settles the emergency capture and meets the other ranks).
        Once the threads that use them stopped (the emergency capture, the background and
        local saves, the writer process), the process groups the manager made are
        destroyed, each once: a group given as ``process_group``, the checkpoint group of
        :func:`~resumekit.init_distributed` and the default group are left to their owner.

        Raises:
            AsyncSaveError: A background or local save in flight failed (the groups are
                destroyed all the same).
        """
        if self._closed:
            return
        errors = self._release((self._settle_emergency, self._stop_emergency,
                                self._uninstall_preemption, self._background.wait,
                                self._local_saves.close, self._close_writer), meet=True)
        for error in errors[1:]:
            logger.warning("resumekit: closing the CheckpointManager also failed: %s: %s",
                           type(error).__name__, error)
        if errors:
            raise errors[0]

    def _stop_emergency(self) -> None:
        if self._emergency is not None:
            self._emergency.close()

    def _uninstall_preemption(self) -> None:
        if self.preemption is not None and self._installed_preemption:
            self.preemption.uninstall()  # also collects a vote still in flight

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            if self._stager is not None:
                self._stager.close()  # its shared segments' descriptors

    def _check_open(self) -> None:
        if self._closed:
            raise ResumekitError("this CheckpointManager is closed", path=self.storage.path())
        self._background.raise_if_failed()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leaves(tree: Any) -> list[Any]:
    """Every leaf of nested dicts, lists and tuples."""
    if isinstance(tree, Mapping):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]
