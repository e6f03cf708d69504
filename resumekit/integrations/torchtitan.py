"""torchtitan: ``checkpoint=ResumekitCheckpointer.Config(...)`` in the trainer's config.

torchtitan (0.3) builds its checkpointer from its config: the trainer's ``checkpoint``
field is typed :class:`torchtitan.components.checkpointer.BaseCheckpointManager.Config`,
and the trainer calls ``config.checkpoint.build(dataloader=..., model_parts=...,
optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
base_folder=config.dump_folder)``, which constructs the class that declares the config
(torchtitan's ``Configurable``). :class:`ResumekitCheckpointer` is such a class, so the
switch is one line of a torchtitan config function (a ``config_registry`` module named by
``--module``)::

    from resumekit.integrations.torchtitan import ResumekitCheckpointer
    ...
    checkpoint=ResumekitCheckpointer.Config(interval=10, keep_latest_k=3),  # was
    # checkpoint=CheckpointManager.Config(interval=10, keep_latest_k=3),

or, over an existing config, ``config.checkpoint =
ResumekitCheckpointer.Config.from_torchtitan(config.checkpoint)``. The trainer is not
changed: it calls the same ``load(step)``, ``save(curr_step, last_step)``,
``maybe_wait_for_staging()`` and ``close()``.

What the checkpointer does with them: the trainer's model (its one model part), its
``OptimizersContainer``, its ``LRSchedulersContainer``, its data loader and every rank's
RNG streams are one :class:`~resumekit.CheckpointManager` checkpoint under
``<dump_folder>/<folder>``, committed atomically every ``interval`` steps (a kill at any
instant leaves the previous checkpoint loadable; a committed step is never overwritten);
``train_state`` (the trainer's ``step`` and ``ntokens_seen``) is the checkpoint's step and
``extras["train_state"]``, as ``resumekit import`` stores a torchtitan checkpoint, so an
imported torchtitan run resumes here. SIGTERM/SIGUSR1 become the agreed preemption save
of :mod:`resumekit.runtime.preemption`: every rank stops at one step, that step is
committed, the SLURM job is requeued where SLURM would not, and every rank exits
:data:`~resumekit.runtime.preemption.EXIT_CODE_PREEMPTED` (75) from ``save()``. The last
step is committed as a ``final`` checkpoint (the full state: a model-only copy is
``resumekit export``'s job). ``docs/integrations.md`` maps every torchtitan field.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch import nn

from resumekit._optional import missing
from resumekit.errors import ConfigurationError
from resumekit.manager import CheckpointManager
from resumekit.options import LocalTier
from resumekit.runtime import distributed
from resumekit.runtime.channels import is_distributed, new_save_group
from resumekit.runtime.preemption import EXIT_CODE_PREEMPTED, PreemptionHandler
from resumekit.runtime.requeue import requeue_after_signal
from resumekit.store.retention import keep_last

try:
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.tools import filesystem
except ImportError as error:
    # resumekit[torchtitan] installs torchtitan with its own requirements (its trainer's:
    # datasets, tensorboard, ...); pyproject.toml's test-models extra says why the tests
    # install it without them.
    raise missing("torchtitan", extra="torchtitan", feature="resumekit.integrations.torchtitan",
                  error=error) from error

__all__ = ["TRAIN_STATE", "ResumekitCheckpointer"]

logger = logging.getLogger("resumekit")

TRAIN_STATE = "train_state"
"""The key of the trainer's own state in ``states`` and in the checkpoint's ``extras``."""

_UNSUPPORTED = {
    "initial_load_in_hf": "loading Hugging Face safetensors: convert them once with "
                          "`resumekit import`, then name that root in initial_load_path",
    "last_save_in_hf": "a final Hugging Face export: `resumekit export` writes the final "
                       "checkpoint's weights as safetensors",
    "create_seed_checkpoint": "a seed checkpoint: start from initial_load_path "
                              "(model-only) instead",
}


def _vote_group() -> tuple[dist.ProcessGroup | None, bool]:
    """A gloo group for the preemption vote (its ballots are CPU tensors), and whether new.

    torchtitan's default group is NCCL on GPUs, which cannot reduce CPU tensors; the
    preemption handler would take it as the vote's group unless given another. The group
    of :func:`resumekit.init_distributed`, if the job made one, else a new gloo group
    (True: the checkpointer destroys it when it closes).
    """
    if not is_distributed():
        return None, False
    group = distributed.preemption_group()
    return (group, False) if group is not None else (new_save_group(), True)


class ResumekitCheckpointer(BaseCheckpointManager):  # type: ignore[misc]
    """A torchtitan checkpointer that commits resumekit checkpoints.

    Built by torchtitan's trainer from :class:`ResumekitCheckpointer.Config` (its
    ``checkpoint`` field), with the keywords its own ``CheckpointManager`` takes.

    Args:
        config: The ``checkpoint`` section of the trainer's config.
        dataloader: The trainer's data loader (saved per rank), or None.
        model_parts: The model parts; resumekit checkpoints exactly one (no pipeline
            parallelism).
        optimizers: torchtitan's ``OptimizersContainer``.
        lr_schedulers: torchtitan's ``LRSchedulersContainer``.
        states: Other state to save (the trainer passes ``{"train_state": trainer}``):
            each object's ``state_dict()`` must be JSON-able; it is kept in the
            checkpoint's ``extras`` under its key (``train_state``'s ``step`` is the
            checkpoint's step).
        sd_adapter: torchtitan's Hugging Face state-dict adapter; unused (the options
            that need it are refused).
        base_folder: The trainer's ``dump_folder``; the root is ``base_folder/folder``.

    Raises:
        ConfigurationError: A field resumekit does not support (``initial_load_in_hf``,
            ``last_save_in_hf``, ``create_seed_checkpoint``, ``exclude_from_loading``),
            several model parts, or what :class:`~resumekit.CheckpointManager` refuses.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint fields, plus resumekit's (docs/integrations.md maps them)."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: blocking saves; ``async``: written by a background thread;
        ``async_with_pinned_mem``: written by a writer process (``async_writer="process"``)."""

        preemption: bool = True
        """Turn SIGTERM/SIGUSR1 into the agreed preemption save and exit 75."""

        preemption_poll_every: int = 0
        """Vote on a preemption every this many steps (one small all-reduce); 0: ``"auto"``,
        as often as keeps the votes under 0.5% of the step time, at least once a second."""

        requeue: bool = True
        """After a preemption save caused by SIGUSR1 (a SLURM time-limit warning), requeue
        the job (``scontrol requeue``); SLURM requeues a SIGTERM preemption itself."""

        local_folder: str | None = None
        """A node-local root (``$SLURM_TMPDIR/ckpt``): resumekit's local tier."""

        local_interval: int = 0
        """Save to the local tier every this many steps (with ``local_folder``)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ConfigurationError(
                    f"checkpoint.async_mode={self.async_mode!r} is not one of 'disabled', "
                    "'async', 'async_with_pinned_mem'", name="checkpoint.async_mode",
                    value=self.async_mode)
            if self.local_folder is not None and self.local_interval < 1:
                raise ConfigurationError(
                    f"checkpoint.local_folder={self.local_folder!r} needs "
                    "checkpoint.local_interval >= 1", name="checkpoint.local_interval",
                    value=self.local_interval)

        @classmethod
        def from_torchtitan(cls, config: Any, **fields: Any) -> ResumekitCheckpointer.Config:
            """This config with every field ``config`` (torchtitan's own) shares with it.

            Args:
                config: A ``CheckpointManager.Config`` (or any ``BaseCheckpointManager.Config``).
                **fields: Fields to set besides (``preemption=False``, ``local_folder=...``).

            Returns:
                The config that builds a :class:`ResumekitCheckpointer`.
            """
            names = {field.name for field in dataclasses.fields(cls) if field.init}
            shared = {field.name: getattr(config, field.name)
                      for field in dataclasses.fields(config)
                      if field.init and field.name in names}
            return cls(**{**shared, **fields})

    def __init__(self, config: ResumekitCheckpointer.Config, *, dataloader: Any,
                 model_parts: list[nn.Module], optimizers: Any, lr_schedulers: Any,
                 states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        for name, what in _UNSUPPORTED.items():
            if getattr(config, name):
                raise ConfigurationError(
                    f"checkpoint.{name}=True is not supported by ResumekitCheckpointer "
                    f"({what})", name=f"checkpoint.{name}", value=True)
        if config.exclude_from_loading:
            raise ConfigurationError(
                f"checkpoint.exclude_from_loading={config.exclude_from_loading!r} is not "
                "supported by ResumekitCheckpointer: a resume restores the whole state (use "
                "initial_load_path with initial_load_model_only for the weights alone)",
                name="checkpoint.exclude_from_loading", value=config.exclude_from_loading)
        if len(model_parts) != 1:
            raise ConfigurationError(
                f"ResumekitCheckpointer checkpoints one model part, not {len(model_parts)} "
                "(pipeline parallelism is not supported)", name="model_parts",
                value=len(model_parts))
        self.folder = str(filesystem.join(base_folder, config.folder))
        self.interval = config.interval
        self.load_only = config.load_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.requeue = config.requeue
        self.states = states
        self.extras: dict[str, Any] = {}
        self._record_states()
        vote, made = (_vote_group() if config.preemption and not config.load_only
                      else (None, False))
        self._made_vote_group = vote if made else None  # destroyed by close
        try:
            self.preemption = (
                PreemptionHandler(poll_every=config.preemption_poll_every or "auto",
                                  group=vote)
                if config.preemption and not config.load_only else None)
            local = (None if config.local_folder is None
                     else LocalTier(root=config.local_folder, save_every=config.local_interval))
            self.manager = CheckpointManager(
                self.folder, model=model_parts[0], optimizer=optimizers,
                scheduler=lr_schedulers, data=dataloader, extras=self.extras,
                preemption=self.preemption, save_every=config.interval,
                retention=keep_last(config.keep_latest_k) if config.keep_latest_k else None,
                async_save=config.async_mode != "disabled",
                async_writer=("process" if config.async_mode == "async_with_pinned_mem"
                              else "thread"),
                read_only=config.load_only, local=local)
        except BaseException:
            # No close will come: the group made here goes now, without meeting on it (the
            # ranks may not all have failed), as a failed CheckpointManager's groups do.
            self._destroy_vote_group(meet=False)
            raise
        if config.last_save_model_only:
            logger.info("resumekit: the last step is committed as a full 'final' checkpoint "
                        "(last_save_model_only: `resumekit export` writes the weights alone)")

    # -- torchtitan's interface (BaseCheckpointManager calls these when enabled) ----------
    def _load(self, step: int = -1) -> bool:
        """Restore the newest committed checkpoint (or ``step``); else the initial load.

        Returns:
            Whether anything was loaded (False: a fresh start).
        """
        restored = self.manager.restore(None if step == -1 else step)
        if self.manager.resumed_from is not None:
            self._apply_states(restored)
            return True
        if not self.initial_load_path:
            return False
        if self.initial_load_model_only:
            self.manager.load_weights(self.initial_load_path)
            return True
        state = self.manager.state
        source = CheckpointManager(
            self.initial_load_path, model=state.model, optimizer=state.optimizer,
            scheduler=state.scheduler, data=state.data, extras=self.extras, read_only=True)
        try:
            restored = source.restore()
        finally:
            source.close()
        if source.resumed_from is None:
            raise ConfigurationError(
                f"checkpoint.initial_load_path={self.initial_load_path!r} holds no committed "
                "resumekit checkpoint (`resumekit import` converts a torchtitan one)",
                name="checkpoint.initial_load_path", value=self.initial_load_path)
        self._apply_states(restored)
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Commit ``curr_step`` when due; the last step as ``final``; exit 75 when preempted.

        Returns:
            Whether ``curr_step`` is committed (or, asynchronously, being written).
        """
        if self.load_only:
            return False
        self._record_states()
        manager = self.manager
        if curr_step == 1 and self.enable_first_step_checkpoint:
            manager.save(1, reason="interval")
        preempted = manager.step_end(curr_step)
        if last_step:  # the run ends here anyway, preempted or not: commit it as final
            manager.finish(curr_step)
            return True
        if preempted:
            self._exit_preempted(curr_step)
        return (last_step or curr_step % self.interval == 0
                or (curr_step == 1 and self.enable_first_step_checkpoint))

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save has copied the state when ``save`` returns."""

    def _wait_for_saving(self) -> None:
        self.manager.wait()

    def _close(self) -> None:
        try:
            self.manager.close()
        except BaseException:
            # The manager's failure (a peer died) is the one to raise: the vote group is
            # destroyed without the meeting, which would only fail on the same peer and
            # put its own error in the manager's place.
            self._destroy_vote_group(meet=False)
            raise
        self._destroy_vote_group()

    def _destroy_vote_group(self, *, meet: bool = True) -> None:
        """Destroy the vote's group if made here (once; after the manager removed the handler).

        The ranks meet on it first (``meet``): a gloo group destroyed while a peer still
        sends on it can abort that peer.
        """
        group, self._made_vote_group = self._made_vote_group, None
        if group is None or not dist.is_initialized():
            return
        try:
            if meet:
                dist.barrier(group=group)
        finally:
            dist.destroy_process_group(group)

    # -- helpers ----------------------------------------------------------------------------
    def _record_states(self) -> None:
        """Put every ``states`` object's state (``train_state`` without its step) in extras."""
        for key, value in self.states.items():
            state = dict(value.state_dict())
            if key == TRAIN_STATE:
                state.pop("step", None)
            self.extras[key] = state

    def _apply_states(self, step: int) -> None:
        """Load each ``states`` object from the restored extras (``train_state``: the step)."""
        for key, value in self.states.items():
            state = dict(value.state_dict())
            saved = self.extras.get(key)
            if isinstance(saved, Mapping):
                state.update(saved)
            if key == TRAIN_STATE:
                state["step"] = step
            value.load_state_dict(state)

    def _exit_preempted(self, step: int) -> None:
        """Every rank agreed on a preemption at ``step`` (committed): requeue if due, exit 75."""
        logger.warning("resumekit: preempted at step %d (committed under %s): exiting %d",
                       step, self.folder, EXIT_CODE_PREEMPTED)
        self._close()
        if self.requeue and self.preemption is not None:
            requeue_after_signal(self.preemption)
        raise SystemExit(EXIT_CODE_PREEMPTED)

