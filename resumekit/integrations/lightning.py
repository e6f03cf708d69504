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

Resume with ``trainer.fit(model, ckpt_path=root)`` (the newest committed checkpoint),
a step directory, or the path Lightning named the file by (``.../epoch=0-step=40.ckpt``:
its ``step=N`` picks the step).

Lightning calls ``save_checkpoint`` on global rank 0 only (the state is gathered first),
so this plugin commits from one process; it needs no process group.
"""

from __future__ import annotations

import io
import logging
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from resumekit.catalog import CheckpointEntry, list_checkpoints, verify_checkpoint
from resumekit.commit import CommitProtocol
from resumekit.errors import CheckpointNotFoundError, UnsafeCheckpointError
from resumekit.layout import DEFAULT_NAME_FORMAT, LIGHTNING_CHECKPOINT_FILE, NameFormat
from resumekit.manifest import MANIFEST_NAME, Lineage, Manifest, SaveReason
from resumekit.retention import RetentionPolicy, keep_last, prune
from resumekit.state import dump_plain
from resumekit.storage import Storage
from resumekit.warnings import ResumekitWarning

try:
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "resumekit.integrations.lightning needs Lightning: install the 'lightning' package"
    ) from error

__all__ = ["ResumekitCheckpointIO"]

logger = logging.getLogger("resumekit")

_DEFAULT_RETENTION = keep_last(3)
_STEP_IN_NAME = re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)")


class ResumekitCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that commits each checkpoint atomically under ``root``.

    Args:
        root: Checkpoint root: a local path or an fsspec URL.
        retention: Which committed checkpoints to keep after each save (default
            ``keep_last(3)``; None keeps all). ``ModelCheckpoint(save_top_k=...)`` still
            removes what it ranks out, through :meth:`remove_checkpoint`.
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
            StepCollisionError: A newer step is already committed.
        """
        if storage_options is not None:
            raise TypeError("ResumekitCheckpointIO takes storage_options in its constructor, "
                            "not in save_checkpoint")
        step = int(checkpoint.get("global_step", 0))
        name = os.path.basename(os.fspath(path))
        data = dump_plain(checkpoint, what=f"Lightning checkpoint {name} (step {step})")
        committed = {e.step for e in self._committed()}
        protocol = self._protocol
        pending = protocol.begin(step, replace=step in committed)
        if step in committed:
            logger.info("resumekit: Lightning saved step %d again (%s): replacing it", step,
                        name)
        reason = SaveReason.PREEMPTION if name.startswith("hpc_ckpt") else \
            SaveReason.INTERVAL
        weights = checkpoint.get("state_dict")
        params: dict[str, Any] = {key: [list(value.shape), str(value.dtype).removeprefix("torch.")]
                  for key, value in (weights.items() if isinstance(weights, Mapping) else ())
                  if isinstance(value, torch.Tensor)}
        manifest = Manifest(
            step=step, world_size=1, reason=reason, lineage=Lineage.current(),
            state={"format": "lightning", "file": LIGHTNING_CHECKPOINT_FILE,
                   "lightning_name": name, "epoch": int(checkpoint.get("epoch", 0))},
            fingerprint={"config": {}, "params": params},
        )
        try:
            self.storage.write_bytes(f"{pending.staging}/{LIGHTNING_CHECKPOINT_FILE}", data)
            protocol.publish(pending, manifest)
        except BaseException:
            protocol.abort(pending)
            raise
        logger.info("resumekit: committed Lightning checkpoint %s as step %d under %s",
                    name, step, self.storage.path())
        if self.retention is not None:
            prune(self.storage, self.retention, name_format=self.name_format)

    # -- loading ------------------------------------------------------------------------
    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Read back the checkpoint ``path`` names, after verifying its files.

        Args:
            path: The root (newest committed), a step directory of it, or a file name
                Lightning used (its recorded name, or ``step=N`` in it).
            map_location: As for ``torch.load``.
            weights_only: Ignored: always ``True`` (resumekit never unpickles code).

        Raises:
            CheckpointNotFoundError: No committed checkpoint matches ``path``.
            CorruptCheckpointError: A file fails its checksum.
            UnsafeCheckpointError: The dict holds objects ``weights_only`` refuses.
        """
        entry = self._find(path)
        assert entry.manifest is not None
        verify_checkpoint(self.storage, entry.name, manifest=entry.manifest)
        relative = f"{entry.name}/{entry.manifest.data_path(LIGHTNING_CHECKPOINT_FILE)}"
        source = self.storage.path(relative)
        try:
            loaded: dict[str, Any] = torch.load(io.BytesIO(self.storage.read_bytes(relative)),
                                                map_location=map_location, weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"{source} cannot be read with weights_only=True: {error}", path=source,
                file=source) from error
        logger.info("resumekit: Lightning resumes from step %d (%s)", entry.step, entry.path)
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the committed checkpoint Lightning names (``ModelCheckpoint`` top-k).

        The newest committed checkpoint is never deleted (a warning says so).
        """
        try:
            entry = self._find(path, root_means_newest=False)
        except CheckpointNotFoundError:
            logger.info("resumekit: Lightning removed %s, which is no committed checkpoint",
                        os.fspath(path))
            return
        drop = entry.step
        policy = RetentionPolicy(lambda steps: set(steps) - {drop},
                                 f"all but step {drop} (removed by Lightning)")
        prune(self.storage, policy, name_format=self.name_format)
        if self.storage.exists(f"{entry.name}/{MANIFEST_NAME}"):
            message = (f"Lightning asked to remove {entry.path} (step {drop}); it is kept: "
                       "the newest committed checkpoint is never deleted")
            logger.warning("resumekit: %s", message)
            warnings.warn(message, ResumekitWarning, stacklevel=2)

    # -- finding ------------------------------------------------------------------------
    def _committed(self) -> list[CheckpointEntry]:
        if not self.storage.is_dir():
            return []
        return [e for e in list_checkpoints(self.storage, self.name_format)
                if e.status == "committed"]

    def _find(self, path: str | os.PathLike[str], *,
              root_means_newest: bool = True) -> CheckpointEntry:
        given = os.fspath(path).rstrip("/")
        committed = self._committed()
        name = os.path.basename(given)
        is_root = Storage(given, self.storage.storage_options).path() == self.storage.path()
        if is_root and root_means_newest and committed:
            return committed[-1]
        for entry in committed:
            recorded = entry.manifest.state.get("lightning_name") if entry.manifest else None
            if name in (entry.name, recorded):
                return entry
        match = _STEP_IN_NAME.search(name)
        if match is not None:
            for entry in committed:
                if entry.step == int(match.group(1)):
                    return entry
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {self.storage.path()} matches {given} "
            f"(committed steps: {[e.step for e in committed] or 'none'})",
            path=self.storage.path())
