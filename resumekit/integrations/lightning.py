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
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from resumekit import sharded
from resumekit.catalog import CheckpointEntry, list_checkpoints, verify_checkpoint
from resumekit.commit import CommitProtocol
from resumekit.errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    StepCollisionError,
    UnsafeCheckpointError,
)
from resumekit.layout import (
    DEFAULT_NAME_FORMAT,
    LIGHTNING_CHECKPOINT_FILE,
    TENSORS_DIR,
    NameFormat,
)
from resumekit.manifest import MANIFEST_NAME, Lineage, Manifest, SaveReason
from resumekit.retention import RetentionPolicy, keep_last, prune
from resumekit.state import dump_plain
from resumekit.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

try:
    import lightning
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "resumekit.integrations.lightning needs Lightning: install the 'lightning' package"
    ) from error

__all__ = ["ResumekitCheckpointIO"]

logger = logging.getLogger("resumekit")

_DEFAULT_RETENTION = keep_last(3)
_STEP_IN_NAME = re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)")
_NAMED_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")
"""Keys of a ``ModelCheckpoint`` state naming one checkpoint path each."""


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
        reason = SaveReason.PREEMPTION if name.startswith("hpc_ckpt") else \
            SaveReason.INTERVAL
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
        tensors = sharded.read_full_state(
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
