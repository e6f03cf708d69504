"""Lightning: ``Trainer(plugins=[ResumekitCheckpointIO(root)])``.

Every checkpoint Lightning saves (``ModelCheckpoint``, ``trainer.save_checkpoint``, the
SLURM plugin's ``hpc_ckpt`` on requeue) becomes a committed resumekit checkpoint of
step ``global_step`` under ``root``: staged, hashed into a manifest and renamed into
place, so a kill at any instant leaves the previous checkpoint loadable; retention runs
after each commit; ``resumekit inspect/verify/list ROOT`` see them. The checkpoint dict
itself is stored as one ``lightning.ckpt`` file, exactly what Lightning's own
``TorchCheckpointIO`` would write, and is read back with ``torch.load(weights_only=True)``
after every file of the step is checked against its checksum: loading never runs code
from the checkpoint.

Resume with ``trainer.fit(model, ckpt_path=root)`` (the newest committed checkpoint; on
a root with none, a warning and a fresh start), a step directory, or the path Lightning
named the file by (``.../epoch=0-step=40.ckpt``: its ``step=N`` picks the step). A run
that did not resume is refused, with :class:`~resumekit.errors.StepCollisionError`, the
save of a step that is not above the newest committed one, as the plain manager refuses
it: it never replaces the checkpoints of an earlier run. Only a step this run committed
itself is saved again (``ModelCheckpoint`` and ``save_last`` at one step).

A checkpoint ``resumekit import`` made of a Lightning ``.ckpt`` loads too: its weights and
optimizer from the resumekit format, the rest of Lightning's dict (loops, callbacks,
schedulers) from the ``lightning.ckpt`` the import keeps beside them.

Retention never deletes a checkpoint the trainer still names: at each save, the steps
of the paths every ``ModelCheckpoint`` state in the checkpoint lists (``best_model_path``,
``best_k_models``, ``kth_best_model_path``, ``last_model_path``) are protected. The score
``ModelCheckpoint`` gave the checkpoint is recorded in the manifest (``metrics``, under its
``monitor`` name), so ``keep_best(k, metric=monitor)`` can rank by it.

Lightning calls ``save_checkpoint`` on global rank 0 only (the state is gathered first),
so this plugin commits from one process; it needs no process group.

:class:`ResumekitCallback` adds what Lightning's own checkpoint lacks: every rank's RNG
streams and the data position (a :class:`~resumekit.state.sampler.ResumableDistributedSampler`),
saved in the checkpoint and restored on resume; SIGTERM/SIGUSR1 turned into the agreed
emergency save of :mod:`resumekit.runtime.preemption` (every rank stops at one step, the step is
committed, the job is requeued where SLURM would not, every rank exits
:data:`~resumekit.runtime.preemption.EXIT_CODE_PREEMPTED`); and ``fit(ckpt_path="last")``
resolving to the newest committed checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from resumekit import tensors as tensor_io
from resumekit._compat import (
    lightning_cluster_environment,
    lightning_combined_loader,
    lightning_data_fetcher,
    lightning_train_source,
)
from resumekit._optional import missing
from resumekit.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    IncompatibleCheckpointError,
    StepCollisionError,
    UnsafeCheckpointError,
)
from resumekit.runtime.preemption import (
    EXIT_CODE_PREEMPTED,
    PreemptionHandler,
    protect_loader_workers,
)
from resumekit.runtime.requeue import requeue_after_signal
from resumekit.state.rng import capture_rng, restore_rng, select_rank_rng
from resumekit.state.train_state import dump_plain
from resumekit.store.catalog import CheckpointEntry, list_checkpoints, verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import (
    DEFAULT_NAME_FORMAT,
    LIGHTNING_CHECKPOINT_FILE,
    TENSORS_DIR,
    NameFormat,
)
from resumekit.store.manifest import MANIFEST_NAME, Lineage, Manifest, SaveReason
from resumekit.store.retention import RetentionPolicy, keep_last, prune
from resumekit.store.storage import Storage
from resumekit.tools.weights import load_model_weights, resolve_weights_source
from resumekit.warnings import ResumekitWarning, warn

try:
    import lightning
    from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.utilities.data import extract_batch_size
except ImportError as error:
    raise missing("lightning", extra="lightning", feature="resumekit.integrations.lightning",
                  error=error) from error

__all__ = ["LAST_MARKER", "ResumekitCallback", "ResumekitCheckpointIO"]

logger = logging.getLogger("resumekit")

_DEFAULT_RETENTION = keep_last(3)
_STEP_IN_NAME = re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)")
_NAMED_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")
"""Keys of a ``ModelCheckpoint`` state naming one checkpoint path each."""
LAST_MARKER = "last.ckpt"
"""The file :class:`ResumekitCallback` writes in each ``ModelCheckpoint`` folder: it names
the root, so Lightning's ``ckpt_path="last"`` (which lists that folder for ``last*.ckpt``)
finds it and the plugin resumes from the root's newest committed checkpoint."""
_MARKER_KIND = "resumekit-last"
_STATE_VERSION = 1
_PREEMPTED_PREFIX = "preempted"


class _NothingToResume(dict[str, Any]):
    """The checkpoint of a root with none: Lightning starts the run fresh.

    It is false, so each of Lightning's restore steps (``if not checkpoint: return``)
    skips it, and holds only the version key Lightning's migration reads first.
    """

    def __bool__(self) -> bool:
        return False


class ResumekitCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that commits each checkpoint atomically under ``root``.

    Args:
        root: Checkpoint root: a local path or an fsspec URL.
        retention: Which committed checkpoints to keep after each save (default
            ``keep_last(3)``; None keeps all), besides those the trainer still names
            (never deleted). ``ModelCheckpoint(save_top_k=...)`` still removes what it
            ranks out, through :meth:`remove_checkpoint`. ``keep_best(k, metric=...)``
            ranks by the score ``ModelCheckpoint`` recorded under its ``monitor``.
        name_format: Step directory names.
        storage_options: fsspec options (e.g. ``endpoint_url``).
    """

    def __init__(self, root: str | os.PathLike[str], *,
                 retention: RetentionPolicy | None = _DEFAULT_RETENTION,
                 name_format: str = DEFAULT_NAME_FORMAT,
                 storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.storage = Storage(root, storage_options)
        self.name_format = NameFormat(name_format)
        self.retention = retention
        # One writer, one protocol: its writer generation is claimed once and kept.
        self._protocol = CommitProtocol(self.storage, self.name_format)
        # The run in progress (reset at teardown): the steps it committed, the one it
        # resumed from.
        self._written: set[int] = set()
        self._resumed_from: int | None = None
        # File names the trainer's ModelCheckpoint states named at the last save.
        self._named: set[str] = set()

    # -- saving -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Commit ``checkpoint`` as step ``checkpoint["global_step"]``.

        A second save of the same step (``ModelCheckpoint`` and ``trainer.save_checkpoint``
        at one step) replaces the first atomically.

        Args:
            checkpoint: Lightning's checkpoint dict.
            path: The file name Lightning chose; recorded in the manifest
                (``state.lightning_name``) so :meth:`load_checkpoint` and
                :meth:`remove_checkpoint` can be given it.
            storage_options: Not supported (pass them to the constructor).

        Raises:
            TypeError: ``storage_options`` were given, or the dict holds objects that
                cannot be read back without running code (nothing is written).
            StepCollisionError: The step is not above the newest committed one and this
                run did not commit it itself (a run that started over on a root holding
                an earlier run's checkpoints); nothing is replaced.
        """
        if storage_options is not None:
            raise TypeError("ResumekitCheckpointIO takes storage_options in its constructor, "
                            "not in save_checkpoint")
        step = int(checkpoint.get("global_step", 0))
        name = os.path.basename(os.fspath(path))
        committed = self._committed()
        self._refuse_an_earlier_runs_step(step, committed)
        data = dump_plain(checkpoint, what=f"Lightning checkpoint {name} (step {step})")
        replaced = next((e for e in committed if e.step == step), None)
        protocol = self._protocol
        pending = protocol.begin(step, replace=replaced is not None)
        if replaced is not None:
            logger.info("resumekit: Lightning saved step %d again (%s): replacing it", step,
                        name)
        reason = SaveReason.PREEMPTION if name.startswith(("hpc_ckpt", _PREEMPTED_PREFIX)) \
            else SaveReason.INTERVAL
        weights = checkpoint.get("state_dict")
        params: dict[str, Any] = {key: [list(value.shape), str(value.dtype).removeprefix("torch.")]
                  for key, value in (weights.items() if isinstance(weights, Mapping) else ())
                  if isinstance(value, torch.Tensor)}
        earlier = replaced.manifest.metrics if replaced and replaced.manifest else {}
        manifest = Manifest(
            step=step, world_size=1, reason=reason, lineage=Lineage.current(
                resumed_from_step=self._resumed_from),
            state={"format": "lightning", "file": LIGHTNING_CHECKPOINT_FILE,
                   "lightning_name": name, "epoch": int(checkpoint.get("epoch", 0))},
            fingerprint={"config": {}, "params": params},
            metrics={**earlier, **_scores_of(checkpoint, name, step)},
        )
        try:
            self.storage.write_bytes(f"{pending.staging}/{LIGHTNING_CHECKPOINT_FILE}", data)
            protocol.publish(pending, manifest)
        except BaseException:
            protocol.abort(pending)
            raise
        self._written.add(step)
        self._named = _paths_named(checkpoint)
        logger.info("resumekit: committed Lightning checkpoint %s as step %d under %s",
                    name, step, self.storage.path())
        if self.retention is not None:
            # ``committed`` was listed before this save: its own name stands for ``step``.
            named = self._steps_named(self._named - {name}, committed)
            prune(self.storage, self.retention, name_format=self.name_format,
                  protect=named | {step})

    def _refuse_an_earlier_runs_step(self, step: int,
                                     committed: list[CheckpointEntry]) -> None:
        """Raise unless ``step`` is above the newest committed one or this run wrote it.

        Raises:
            StepCollisionError: Naming the root, the newest committed step and how to
                resume the run that wrote it.
        """
        newest = committed[-1].step if committed else None
        if newest is None or step > newest or step in self._written:
            return
        root = self.storage.path()
        how = (f"this run resumed from step {self._resumed_from}" if self._resumed_from
               is not None else "this run did not resume from it")
        raise StepCollisionError(
            f"cannot save step {step} under {root}: it holds committed checkpoints of an "
            f"earlier run, the newest step {newest} ({how}); nothing was replaced. To "
            f"continue that run, resume it: trainer.fit(..., ckpt_path={root!r}); to start "
            "over, give this run another root (or move the old checkpoints out of this one)",
            step=step, newest=newest, path=root)

    def teardown(self) -> None:
        """End of a ``fit``/``validate``/...: the next save belongs to a new run."""
        self._written, self._resumed_from, self._named = set(), None, set()

    # -- loading ------------------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read back the checkpoint ``path`` names, after verifying its files.

        Args:
            path: The root (newest committed; none there: a warning and an empty
                checkpoint, so Lightning starts fresh), a step directory of it, or a file
                name Lightning used (its recorded name, or ``step=N`` in it).
            map_location: As for ``torch.load``.
            weights_only: Ignored: always ``True`` (resumekit never unpickles code).

        Raises:
            CheckpointNotFoundError: No committed checkpoint matches ``path``.
            CorruptCheckpointError: A file fails its checksum.
            UnsafeCheckpointError: The dict holds objects ``weights_only`` refuses.
            IncompatibleCheckpointError: The step holds no Lightning trainer state (written
                by ``CheckpointManager``, or imported from another format).
        """
        path = self._root_if_marker(path)
        if self._is_root(path) and not self._committed():
            message = (f"no committed checkpoint under {self.storage.path()}: Lightning "
                       "starts fresh (nothing to resume from)")
            warn(message, ResumekitWarning, stacklevel=2)
            self._written, self._resumed_from = set(), None
            return _NothingToResume({"pytorch-lightning_version": lightning.__version__})
        entry = self._find(path)
        assert entry.manifest is not None
        verify_checkpoint(self.storage, entry.name, manifest=entry.manifest)
        loaded = self._read_dict(entry, map_location)
        if entry.manifest.state.get("format") != "lightning":
            loaded = self._with_tensors(entry, loaded)
        logger.info("resumekit: Lightning resumes from step %d (%s)", entry.step, entry.path)
        self._written, self._resumed_from = set(), entry.step
        return loaded

    def _read_dict(self, entry: CheckpointEntry, map_location: Any | None
                   ) -> dict[str, Any]:
        """``torch.load(weights_only=True)`` of the verified ``lightning.ckpt`` of ``entry``."""
        assert entry.manifest is not None
        relative = f"{entry.name}/{entry.manifest.data_path(LIGHTNING_CHECKPOINT_FILE)}"
        source = self.storage.path(relative)
        try:
            data = self.storage.read_bytes(relative)
        except FileNotFoundError:
            raise IncompatibleCheckpointError(
                f"{source} does not exist: step {entry.step} holds no Lightning "
                "trainer state (it was written by CheckpointManager, or imported from "
                "another format or by an older resumekit); load its weights with "
                "CheckpointManager.load_weights, or import the Lightning .ckpt again",
                path=source) from None
        try:
            loaded: dict[str, Any] = torch.load(io.BytesIO(data), map_location=map_location,
                                                weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"{source} cannot be read with weights_only=True: {error}", path=source,
                file=source) from error
        return loaded

    def _with_tensors(self, entry: CheckpointEntry, rest: dict[str, Any]) -> dict[str, Any]:
        """Lightning's dict of an imported ``.ckpt``: ``rest`` plus the resumekit tensors.

        The weights and the optimizer (keyed by parameter name, in the order of its
        groups) come back as Lightning saved them: ``state_dict`` and, keyed by index,
        ``optimizer_states``; their tensors are read onto the CPU (Lightning moves them
        where the model and optimizer are).
        """
        assert entry.manifest is not None
        tensors = tensor_io.read_full_state(
            self.storage.url_of(f"{entry.name}/{entry.manifest.data_path(TENSORS_DIR)}"),
            self.storage.storage_options or None)
        loaded = {**rest, "state_dict": dict(tensors.get("model", {}))}
        optimizer = tensors.get("optimizer")
        if isinstance(optimizer, Mapping):
            groups = list(optimizer.get("param_groups", []))
            index = {fqn: i for i, fqn in enumerate(
                fqn for group in groups for fqn in group.get("params", []))}
            loaded["optimizer_states"] = [{
                "state": {index[fqn]: value
                          for fqn, value in optimizer.get("state", {}).items()},
                "param_groups": [{**group, "params": [index[fqn] for fqn in group["params"]]}
                                 for group in groups],
            }]
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the committed checkpoint Lightning names (``ModelCheckpoint`` top-k).

        The newest committed checkpoint, and one the trainer still names under another
        file name (``last.ckpt`` saved at the same step, another ``ModelCheckpoint``'s
        best), are never deleted (a warning says so).
        """
        try:
            entry = self._find(path, root_means_newest=False)
        except CheckpointNotFoundError:
            logger.info("resumekit: Lightning removed %s, which is no committed checkpoint",
                        os.fspath(path))
            return
        drop = entry.step
        others = self._named - {os.path.basename(os.fspath(path))}
        if drop in self._steps_named(others, self._committed()):
            message = (f"Lightning asked to remove {entry.path} (step {drop}) as "
                       f"{os.path.basename(os.fspath(path))}; it is kept: the trainer still "
                       f"names it ({', '.join(sorted(others))})")
            warn(message, ResumekitWarning, stacklevel=2)
            return
        policy = RetentionPolicy(lambda steps: set(steps) - {drop},
                                 f"all but step {drop} (removed by Lightning)")
        prune(self.storage, policy, name_format=self.name_format)
        if self.storage.exists(f"{entry.name}/{MANIFEST_NAME}"):
            message = (f"Lightning asked to remove {entry.path} (step {drop}); it is kept: "
                       "the newest committed checkpoint is never deleted")
            warn(message, ResumekitWarning, stacklevel=2)

    def _root_if_marker(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """The root, when ``path`` is the :data:`LAST_MARKER` file naming this root.

        Raises:
            CheckpointNotFoundError: The marker names another root.
        """
        given = os.fspath(path)
        if os.path.basename(given) != LAST_MARKER or not os.path.isfile(given):
            return path
        try:
            with open(given, encoding="utf-8") as handle:
                marker = json.load(handle)
        except (OSError, ValueError):
            return path  # a real Lightning file: matched by its name as before
        if not isinstance(marker, dict) or marker.get("kind") != _MARKER_KIND:
            return path
        if marker.get("root") != self.storage.path():
            raise CheckpointNotFoundError(
                f"{given} names the checkpoint root {marker.get('root')!r}, not this "
                f"plugin's {self.storage.path()}: ckpt_path='last' resumes only the root "
                "the marker names; pass that root as ckpt_path, or give the plugin it",
                path=given)
        logger.info("resumekit: %s names %s: resuming its newest committed checkpoint",
                    given, self.storage.path())
        return self.storage.path()

    # -- finding ------------------------------------------------------------------------
    def _committed(self) -> list[CheckpointEntry]:
        if not self.storage.is_dir():
            return []
        return [e for e in list_checkpoints(self.storage, self.name_format)
                if e.status == "committed"]

    def _is_root(self, path: str | os.PathLike[str]) -> bool:
        given = os.fspath(path).rstrip("/")
        return Storage(given, self.storage.storage_options).path() == self.storage.path()

    def _find(self, path: str | os.PathLike[str], *,
              root_means_newest: bool = True) -> CheckpointEntry:
        given = os.fspath(path).rstrip("/")
        committed = self._committed()
        if root_means_newest and committed and self._is_root(given):
            return committed[-1]
        found = _match(os.path.basename(given), committed)
        if found is not None:
            return found
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {self.storage.path()} matches {given} "
            f"(committed steps: {[e.step for e in committed] or 'none'})",
            path=self.storage.path())

    def _steps_named(self, names: set[str], committed: list[CheckpointEntry]) -> set[int]:
        """The committed steps the file names ``names`` resolve to."""
        return {found.step for found in (_match(name, committed) for name in names)
                if found is not None}


def _match(name: str, committed: list[CheckpointEntry]) -> CheckpointEntry | None:
    """The checkpoint a file name stands for.

    Its step directory, the newest step that recorded it (``last.ckpt`` names a newer
    step each time), or ``step=N`` in it.
    """
    for entry in reversed(committed):
        recorded = entry.manifest.state.get("lightning_name") if entry.manifest else None
        if name in (entry.name, recorded):
            return entry
    match = _STEP_IN_NAME.search(name)
    if match is not None:
        for entry in committed:
            if entry.step == int(match.group(1)):
                return entry
    return None


def _callback_states(checkpoint: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The ``ModelCheckpoint``-like states in Lightning's dict (``best_k_models`` held)."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return []
    return [state for state in callbacks.values()
            if isinstance(state, Mapping) and isinstance(state.get("best_k_models"), Mapping)]


def _paths_named(checkpoint: Mapping[str, Any]) -> set[str]:
    """File names of every checkpoint a ``ModelCheckpoint`` state still names."""
    names: set[str] = set()
    for state in _callback_states(checkpoint):
        paths = [state.get(key) for key in _NAMED_PATHS] + list(state["best_k_models"])
        names |= {os.path.basename(os.fspath(p)) for p in paths if isinstance(p, str) and p}
    return names


def _scores_of(checkpoint: Mapping[str, Any], name: str, step: int) -> dict[str, float]:
    """The scores ``ModelCheckpoint`` gave the file ``name``, by ``monitor`` name.

    A score that is not a finite number (NaN, an infinity) has no JSON form: it is left
    out, with a log line.
    """
    scores: dict[str, float] = {}
    for state in _callback_states(checkpoint):
        monitor = state.get("monitor")
        for path, score in state["best_k_models"].items():
            if not isinstance(monitor, str) or not isinstance(path, str) \
                    or os.path.basename(path) != name:
                continue
            value = float(score.item() if isinstance(score, torch.Tensor) else score)
            if math.isfinite(value):
                scores[monitor] = value
            else:
                logger.warning("resumekit: %s of step %d is %s: not recorded in its manifest "
                               "(keep_best does not rank it)", monitor, step, value)
    return scores


class ResumekitCallback(Callback):
    """What makes a Lightning run resume exactly, and stop cleanly when preempted.

    Use it with :class:`ResumekitCheckpointIO` (it refuses to run without it)::

        Trainer(plugins=[ResumekitCheckpointIO(root), SLURMEnvironment(auto_requeue=False)],
                callbacks=[ResumekitCallback(data=lambda trainer: trainer.datamodule.sampler),
                           ModelCheckpoint(every_n_train_steps=500, save_top_k=-1)],
                use_distributed_sampler=False)

    * **RNG streams.** Every checkpoint holds every rank's python, numpy, torch (and CUDA)
      RNG state (gathered to rank 0, where Lightning saves); on resume each rank gets its
      own back (a rank the saved run did not have gets one derived from rank 0's, with a
      warning), right before the first training step, so the draws continue as if the
      run had not stopped.
    * **Data position.** ``data`` returns the object that holds it (a
      :class:`~resumekit.state.sampler.ResumableDistributedSampler` in the train
      ``DataLoader``); it must exist once the ``setup`` hooks ran (build it in
      ``LightningDataModule.setup`` / ``LightningModule.setup``). After each training
      batch the callback calls ``data.advance(batch size)``; its ``state_dict()`` is saved,
      and loaded back before Lightning draws the first batch of the resumed run.
    * **Preemption.** For the duration of training the callback's
      :class:`~resumekit.runtime.preemption.PreemptionHandler` replaces Lightning's own SIGTERM
      handler (which signals the other ranks from inside the handler and does not save).
      After each optimizer step the ranks vote; once they agreed, every rank takes part in
      ``trainer.save_checkpoint`` (a step directory with reason ``preemption``, unless the
      newest commit already holds the step), the SLURM job is requeued if the signal was
      one SLURM does not requeue after (SIGUSR1), and every rank raises
      ``SystemExit(EXIT_CODE_PREEMPTED)``: the process exits 75. Lightning's SLURM
      auto-requeue must be off (``SLURMEnvironment(auto_requeue=False)``): it would save
      from inside its own SIGUSR1 handler; a trainer with it on is refused. The train
      ``DataLoader`` workers ignore the handler's signals (the loaders the fit loop makes
      get a ``worker_init_fn`` that ignores them, then runs their own): a scheduler or
      torchrun's agent signals them too, and a dead worker would stop the run before the
      save.
    * **``ckpt_path="last"``.** At the start of training rank 0 writes a small
      :data:`LAST_MARKER` file naming the root into each ``ModelCheckpoint`` folder, where
      Lightning looks for ``last*.ckpt``; the plugin resolves it to the newest committed
      checkpoint of the root (a marker naming another root is refused).

    Args:
        data: ``trainer -> object`` with ``state_dict``, ``load_state_dict`` and
            ``advance(n)``, or None (no data position is saved).
        preemption: The handler (default: a new ``PreemptionHandler()``: SIGTERM and
            SIGUSR1, votes ``"auto"``), or None to leave the signals alone.
        requeue: Requeue the SLURM job after an emergency save caused by SIGUSR1
            (:func:`~resumekit.runtime.requeue.requeue_after_signal`).
        init_weights: A fine-tune's start: another run's root (written by this plugin or
            by ``CheckpointManager(model=<the LightningModule>)``) whose newest committed
            checkpoint's weights are loaded into the module when the run did not resume
            (``fit`` without a checkpoint, or ``ckpt_path`` a root with none). A run that
            resumed its own checkpoint loads nothing from it (logged), so a requeued
            fine-tune never starts over.

    Raises:
        ConfigurationError: At ``setup``: the trainer has no :class:`ResumekitCheckpointIO`,
            or Lightning's SLURM auto-requeue is on while ``preemption`` is used.
    """

    def __init__(self, *, data: Callable[[Trainer], Any] | None = None,
                 preemption: PreemptionHandler | bool | None = True,
                 requeue: bool = True,
                 init_weights: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.init_weights = init_weights
        self._data_of = data
        self.preemption: PreemptionHandler | None = (
            PreemptionHandler() if preemption is True else
            None if preemption is False or preemption is None else preemption)
        self.requeue = requeue
        self._trainer: Trainer | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._last_voted: int | None = None
        self._shortened_epoch = False

    # -- setup and teardown -------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check the trainer: the plugin is there, Lightning's SLURM requeue is off."""
        self._trainer = trainer
        _plugin_of(trainer)
        environment = lightning_cluster_environment(trainer)
        if self.preemption is not None and environment is None:
            warn("resumekit cannot see this Lightning's cluster environment: check yourself "
                 "that SLURMEnvironment(auto_requeue=False) is set (resumekit makes the "
                 "emergency save and requeue itself)", ResumekitWarning, stacklevel=2)
        if self.preemption is not None and isinstance(environment, SLURMEnvironment) \
                and environment.auto_requeue:
            raise ConfigurationError(
                "ResumekitCallback makes the emergency save and requeue itself: turn "
                "Lightning's off with Trainer(plugins=[..., SLURMEnvironment("
                "auto_requeue=False)]) (its SIGUSR1 handler saves from inside the signal "
                "handler), or pass ResumekitCallback(preemption=None)",
                name="SLURMEnvironment.auto_requeue", value=True)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Protect the train loaders' workers; a fine-tune: load ``init_weights``."""
        if self.preemption is not None:
            self._protect_train_loaders(trainer)
        if self.init_weights is None:
            return
        io = _plugin_of(trainer)
        if io._resumed_from is not None:
            logger.info("resumekit: resumed step %d of %s: init_weights %s not loaded",
                        io._resumed_from, io.storage.path(), os.fspath(self.init_weights))
            return
        source = ResumekitCheckpointIO(self.init_weights, retention=None,
                                       storage_options=io.storage.storage_options or None)
        committed = source._committed()
        if not committed:
            raise CheckpointNotFoundError(
                f"init_weights: no committed checkpoint under {source.storage.path()}",
                path=source.storage.path())
        entry = committed[-1]
        assert entry.manifest is not None
        if entry.manifest.state.get("format") == "lightning":
            weights = source.load_checkpoint(source.storage.path())["state_dict"]
            pl_module.load_state_dict(weights)
            source._resumed_from = None
        else:
            load_model_weights(pl_module, resolve_weights_source(
                self.init_weights, storage_options=io.storage.storage_options or None))
        message = (f"fine-tune of {io.storage.path()} starts from the weights of step "
                   f"{entry.step} of {source.storage.path()}")
        logger.warning("resumekit: %s", message)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write the ``last`` markers; install the preemption handler (after Lightning's).

        After a mid-epoch resume, also give Lightning the full epoch length (see
        :meth:`_give_lightning_the_full_epoch`).
        """
        self._last_voted = trainer.global_step
        if self._shortened_epoch:
            self._give_lightning_the_full_epoch(trainer)
        if trainer.is_global_zero:
            self._write_markers(trainer)
        if self.preemption is not None and not self.preemption.installed:
            self.preemption.install()
            logger.info("resumekit: %s now handled by resumekit's PreemptionHandler (agreed "
                        "emergency save, exit %d), not by Lightning's handler, until "
                        "training ends", "/".join(s.name for s in self.preemption.signals),
                        EXIT_CODE_PREEMPTED)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give the signals back to Lightning; warn of a signal that came too late to stop."""
        if self.preemption is not None and self.preemption.requested \
                and self.preemption.agreed_step is None:
            names = ", ".join(r.name for r in self.preemption.received) or "a request"
            message = (f"{names} arrived but training ended at step {trainer.global_step} "
                       "before the ranks agreed to stop: no emergency save was made and "
                       "the process exits as a finished run would")
            warn(message, ResumekitWarning, stacklevel=2)
        self._uninstall()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        """Give the signals back to Lightning."""
        self._uninstall()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Give the signals back to Lightning."""
        self._uninstall()

    def _protect_train_loaders(self, trainer: Trainer) -> None:
        """Make the workers of every train ``DataLoader`` ignore the preemption signals.

        Lightning makes the train loaders and starts their workers (``iter``) before any
        hook after this one: the callback wraps the fit loop's data source, so that each
        loader it makes (every reload too) gets its ``worker_init_fn`` wrapped by
        :func:`~resumekit.runtime.preemption.protect_loader_workers`.
        """
        assert self.preemption is not None
        source = lightning_train_source(trainer.fit_loop)
        if source is None:
            warn("resumekit cannot reach this Lightning's train data source: make the train "
                 "DataLoader's workers ignore the preemption signals yourself (resumekit."
                 "protect_loader_workers(loader, callback.preemption.signals) where you "
                 "build it), or a preemption signal may kill them before the emergency save",
                 ResumekitWarning, stacklevel=2)
            return
        make = source.dataloader
        if isinstance(make, _ProtectedSource):
            make = make.make
        source.dataloader = _ProtectedSource(make, self.preemption.signals)

    def _uninstall(self) -> None:
        if self.preemption is not None and self.preemption.installed:
            self.preemption.uninstall()

    def _write_markers(self, trainer: Trainer) -> None:
        io = _plugin_of(trainer)
        text = json.dumps({"kind": _MARKER_KIND, "root": io.storage.path()})
        for callback in trainer.checkpoint_callbacks:
            folder = getattr(callback, "dirpath", None)
            if not isinstance(callback, ModelCheckpoint) or not folder:
                continue
            marker = os.path.join(os.fspath(folder), LAST_MARKER)
            if os.path.exists(marker) and not _is_marker(marker):
                logger.warning("resumekit: %s is not resumekit's marker: left as it is "
                               "(ckpt_path='last' may resolve to it)", marker)
                continue
            os.makedirs(os.fspath(folder), exist_ok=True)
            with open(marker, "w", encoding="utf-8") as handle:
                handle.write(text)

    # -- the state in the checkpoint ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG (gathered; called on every rank) and the data position."""
        trainer = self._trainer
        own = capture_rng()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
            rng = dict(enumerate(gathered))
        else:
            rng = {0: own}
        data = self._data(required=False)
        at_epoch_end = bool(trainer is not None and
                            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return {"version": _STATE_VERSION, "rng": rng, "at_epoch_end": at_epoch_end,
                "data": None if data is None else data.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the data position now (before Lightning draws a batch); keep the RNG.

        Raises:
            IncompatibleCheckpointError: The state is from a newer layout.
            ConfigurationError: The checkpoint holds a data position and ``data`` gives
                no object to load it into (or the other way round: a warning).
        """
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise IncompatibleCheckpointError(
                f"ResumekitCallback state version {version!r} is not {_STATE_VERSION} "
                "(written by another resumekit)", key="callbacks.ResumekitCallback")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        rng = select_rank_rng(state_dict["rng"], rank)
        saved = state_dict.get("data")
        data = self._data(required=saved is not None)
        if saved is not None and data is not None:
            data.load_state_dict(saved)
            if state_dict.get("at_epoch_end") and hasattr(data, "set_epoch") \
                    and getattr(data, "consumed", None) == getattr(data, "dataset_len", -1):
                # Saved at the last batch: Lightning resumes with the next epoch.
                data.set_epoch(int(saved["epoch"]) + 1)
        elif data is not None:
            message = ("the checkpoint holds no data position (saved without "
                       "ResumekitCallback(data=...)): the data starts where the sampler is")
            warn(message, ResumekitWarning, stacklevel=2)
        if state_dict.get("at_epoch_end"):
            # The resumed run starts a new epoch, like the saved run did after the save:
            # its DataLoader iterator (which draws a seed) is made after this point.
            restore_rng(rng)
        else:
            # Mid-epoch: Lightning makes a new iterator the saved run did not; restore after.
            self._pending_rng = rng
            self._shortened_epoch = saved is not None and data is not None

    def _data(self, *, required: bool) -> Any | None:
        if self._data_of is None or self._trainer is None:
            if required:
                raise ConfigurationError(
                    "the checkpoint holds a data position but ResumekitCallback was given "
                    "no data=: pass data=lambda trainer: <the ResumableDistributedSampler "
                    "of the train DataLoader>", name="data", value=None)
            return None
        data = self._data_of(self._trainer)
        if data is None or not all(hasattr(data, name) for name in
                                   ("state_dict", "load_state_dict", "advance")):
            raise ConfigurationError(
                f"ResumekitCallback(data=...) returned {type(data).__name__}, not an object "
                "with state_dict, load_state_dict and advance (a ResumableDistributedSampler "
                "built in a setup() hook)", name="data", value=type(data).__name__)
        return data

    # -- each step ----------------------------------------------------------------------
    def _give_lightning_the_full_epoch(self, trainer: Trainer) -> None:
        """After a mid-epoch resume, make Lightning count the whole epoch, not its rest.

        Lightning counts an epoch's batches when it builds the loader: after a mid-epoch
        resume that is the rest the sampler still yields. Counted so, it resets its batch
        counters (the rest is shorter than what it already counted) and ends later epochs
        early. Given the full length (its ``max_batches``, the limit of its combined
        loader, for a fractional ``val_check_interval`` its ``val_check_batch``), its
        counters continue where the saved run's were, and the epoch ends where the
        sampler's does. Lightning 2.6 keeps the limit on its fit loop's combined loader and
        the length its fetcher counts to on the loop's data fetcher (both private: reached
        through :mod:`resumekit._compat`); a Lightning without them, or several train
        loaders, is warned about.
        """
        self._shortened_epoch = False
        loader = trainer.train_dataloader
        combined = lightning_combined_loader(trainer.fit_loop)
        fetcher = lightning_data_fetcher(trainer.fit_loop)
        data = self._data(required=False)
        if not isinstance(loader, torch.utils.data.DataLoader) or combined is None \
                or fetcher is None \
                or len(getattr(combined, "limits", None) or ()) != 1 or data is None:
            message = ("after the mid-epoch resume Lightning expects the short epoch it "
                       f"counted ({trainer.num_training_batches} batches): resumekit can "
                       "give it the full length only for one DataLoader on Lightning 2.x")
            warn(message, ResumekitWarning, stacklevel=2)
            return
        position = data.state_dict()
        data.load_state_dict({**position, "consumed": 0})
        length = len(loader)
        data.load_state_dict(position)
        limit = trainer.limit_train_batches
        batches = min(length, int(limit)) if isinstance(limit, int) else int(length * limit)
        trainer.fit_loop.max_batches = batches
        combined.limits = [batches]
        if getattr(fetcher, "length", None) is not None:
            fetcher.length = batches  # counted from the saved run's batches on
        interval = trainer.val_check_interval
        if isinstance(interval, float) and trainer.val_check_batch is not None \
                and math.isfinite(trainer.val_check_batch):
            trainer.val_check_batch = max(1, int(batches * interval))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Restore the RNG of a mid-epoch checkpoint before the first training step."""
        if self._pending_rng is not None:
            rng, self._pending_rng = self._pending_rng, None
            restore_rng(rng)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Count the batch into the data position; after an optimizer step, vote."""
        data = self._data(required=False)
        if data is not None:
            data.advance(extract_batch_size(batch))
        step = trainer.global_step
        if self.preemption is None or step == self._last_voted:
            return  # accumulating gradients: stop only at an optimizer step
        self._last_voted = step
        if self.preemption.agreed(step):
            self._emergency_save(trainer, step)

    def _emergency_save(self, trainer: Trainer, step: int) -> None:
        """Commit ``step`` on every rank's behalf, requeue if needed, exit 75."""
        assert self.preemption is not None
        io = _plugin_of(trainer)
        committed = io._committed()
        newest = committed[-1].step if committed else None
        since = None if newest is None else step - newest
        if not self.preemption.should_skip_emergency_save(None, 0.0,
                                                          steps_since_last_commit=since):
            folder = os.fspath(trainer.default_root_dir)
            trainer.save_checkpoint(os.path.join(folder, f"{_PREEMPTED_PREFIX}-step={step}.ckpt"))
        logger.warning("resumekit: preempted at step %d (committed under %s): exiting %d",
                       step, io.storage.path(), EXIT_CODE_PREEMPTED)
        self._uninstall()
        if self.requeue:
            requeue_after_signal(self.preemption)
        raise SystemExit(EXIT_CODE_PREEMPTED)


class _ProtectedSource:
    """A Lightning data source's ``dataloader``: its loaders, with protected workers."""

    def __init__(self, make: Callable[[], Any], signals: tuple[int, ...]) -> None:
        self.make = make
        self.signals = signals

    def __call__(self) -> Any:
        loaders = self.make()
        for loader in _data_loaders(loaders):
            protect_loader_workers(loader, self.signals)
        return loaders


def _data_loaders(loaders: Any) -> list[torch.utils.data.DataLoader[Any]]:
    """The ``DataLoader`` objects in what a ``train_dataloader()`` returned."""
    if isinstance(loaders, torch.utils.data.DataLoader):
        return [loaders]
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif hasattr(loaders, "flattened"):  # Lightning's CombinedLoader
        loaders = list(loaders.flattened)
    if isinstance(loaders, (list, tuple)):
        return [found for item in loaders for found in _data_loaders(item)]
    return []


def _plugin_of(trainer: Trainer) -> ResumekitCheckpointIO:
    """The trainer's :class:`ResumekitCheckpointIO`, also inside ``AsyncCheckpointIO``.

    Raises:
        ConfigurationError: The trainer saves through another ``CheckpointIO``.
    """
    io: Any = trainer.strategy.checkpoint_io
    inner = getattr(io, "checkpoint_io", None)  # a wrapping plugin (AsyncCheckpointIO)
    for candidate in (io, inner):
        if isinstance(candidate, ResumekitCheckpointIO):
            return candidate
    raise ConfigurationError(
        "ResumekitCallback needs Trainer(plugins=[ResumekitCheckpointIO(root)]) (or "
        f"AsyncCheckpointIO(ResumekitCheckpointIO(root))): the trainer saves through "
        f"{type(io).__name__}", name="plugins", value=type(io).__name__)


def _is_marker(path: str) -> bool:
    """Whether the file ``path`` is a :data:`LAST_MARKER` written by the callback."""
    try:
        with open(path, encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("kind") == _MARKER_KIND
