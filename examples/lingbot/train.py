"""Train LingBot-VA on resumekit: the same command starts, resumes and survives preemption.

From the repository root::

    torchrun --nproc_per_node=2 -m examples.lingbot.train --config tiny --save-root runs/a
    python -m examples.lingbot.train --config tiny --save-root runs/a      # one process
    torchrun --nproc_per_node=1 -m examples.lingbot.train --config tiny --save-root runs/g \
        --device cuda --dtype bf16 --deterministic                         # one GPU, bf16

Rerunning the same command resumes from the newest committed checkpoint under
``SAVE_ROOT/checkpoints/`` (``checkpoint_step_{N}``): weights, AdamW moments, the
warm-up scheduler, the step, every rank's RNG streams (including the flow-matching noise
generator) and the sampler's position. Nobody passes a resume path by hand.

What each piece of the incident became (``docs/lingbot-walkthrough.md`` tells the story):

* weights-only resume and overwritten ``checkpoint_step_200`` -> ``CheckpointManager``
  saves the full training state and refuses to overwrite a committed step;
* one 60-minute timeout for everything -> ``init_distributed(timeout=...)`` keeps the
  training group's timeout short and gives checkpoint coordination its own long one;
* silent preemption -> a ``PreemptionHandler`` turns SIGTERM/SIGUSR1 into a step every
  rank agrees on, a ``preemption`` checkpoint of that step, and exit status
  ``EXIT_CODE_PREEMPTED`` (75);
* a crash (job 111859's NCCL watchdog) that cost a requeue and a 9.5 GB re-read ->
  ``--local-dir``: a node-local tier (``resumekit.LocalTier``) saved every
  ``--local-every`` steps, each rank's copy also kept by a partner on another node; under
  ``torchrun --max-restarts`` (the sbatch script) a failed worker group is restarted on the
  same nodes and resumes from it (``docs/local-tier.md``, "In-job restart").

Outputs under ``--save-root``:

* ``checkpoints/checkpoint_step_{N}/`` - resumekit checkpoints;
* ``metrics.jsonl`` - one JSON object per optimizer step (``step``, ``loss``,
  ``latent_loss``, ``action_loss``, ``lr``, ``grad_norm``, ``epoch``, ``world_size``) at
  full float precision. On a resume from step S rank 0 first rewrites the file, keeping
  only records with ``step <= S``, so it always tells one consistent history.

``--export OUT`` writes the upstream inference layout after training:
``OUT/transformer/diffusion_pytorch_model.safetensors`` (bf16) and
``OUT/transformer/config.json`` (the model config, taken from the checkpoint's recorded
recipe), through :func:`resumekit.export.export_checkpoint`. ``CheckpointManager`` imports
that layout as a legacy weights-only ``checkpoint_step_N`` directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from tqdm import tqdm

from examples.lingbot.config import LingBotConfig, get_config
from examples.lingbot.data import (
    EpisodeDirectoryDataset,
    SampleSpec,
    SyntheticEpisodeDataset,
    collate,
)
from examples.lingbot.errors import ConfigError
from examples.lingbot.faults import hold_for_signal
from examples.lingbot.faults import install as install_test_faults
from examples.lingbot.model import LingBotVA, shard_model
from examples.lingbot.recipe import build_optimizer, build_scheduler, flow_matching_step
from resumekit import (
    EXIT_CODE_PREEMPTED,
    CheckpointManager,
    DistributedContext,
    LocalTier,
    PreemptionError,
    PreemptionHandler,
    ResumableDistributedSampler,
    RetentionPolicy,
    init_distributed,
    keep_all,
    keep_every,
    keep_last,
    requeue_after_signal,
    shutdown,
)
from resumekit.export import export_checkpoint

__all__ = [
    "CHECKPOINT_DIR",
    "CHECKPOINT_NAME_FORMAT",
    "EXPORT_CONFIG_FILE",
    "EXPORT_WEIGHTS_FILE",
    "METRICS_FILE",
    "METRIC_KEYS",
    "MetricsLog",
    "MicroBatches",
    "build_parser",
    "main",
    "read_metrics",
    "recipe_fingerprint",
    "resolve_config",
    "train",
]

logger = logging.getLogger("lingbot.train")

CHECKPOINT_DIR = "checkpoints"
"""Sub-directory of ``--save-root`` that holds the checkpoints."""

CHECKPOINT_NAME_FORMAT = "checkpoint_step_{step}"
"""Step directory names, as the upstream trainer named them (its weights-only directories
are imported by the same manager when no resumekit checkpoint exists)."""

METRICS_FILE = "metrics.jsonl"
"""Per-step metrics file under ``--save-root``."""

METRIC_KEYS = ("step", "loss", "latent_loss", "action_loss", "lr", "grad_norm")
"""Keys every metrics record has (plus ``epoch`` and ``world_size``)."""

EXPORT_WEIGHTS_FILE = "transformer/diffusion_pytorch_model.safetensors"
"""Weights of an export, relative to ``--export``."""

EXPORT_CONFIG_FILE = "transformer/config.json"
"""Model config of an export, relative to ``--export``."""

# Fields that describe the launch or the run length, not the recipe: a resume may change
# them (another world size re-derives the accumulation; a longer run extends the budget).
_LAUNCH_FIELDS = ("world_size", "grad_accum_steps", "num_steps", "save_interval")


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The command line of the trainer (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.lingbot.train",
        description="Train LingBot-VA with resumable checkpoints. Rerun the same command "
                    "to resume.",
    )
    parser.add_argument("--config", default="tiny", help="config name (tiny, "
                        "furniture_all_e128)")
    parser.add_argument("--save-root", required=True, type=Path,
                        help="run directory: checkpoints/ and metrics.jsonl go here")
    parser.add_argument("--num-steps", type=int, default=None,
                        help="total optimizer steps of the run (default: the config's)")
    parser.add_argument("--save-interval", type=int, default=None,
                        help="optimizer steps between checkpoints (default: the config's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="model-init and data-order seed (default: the config's)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="directory of pre-extracted episode files (default: the "
                             "config's synthetic data)")
    parser.add_argument("--local-dir", type=Path, default=None,
                        help="node-local directory (the same path on every node: "
                             "$SLURM_TMPDIR/..., /dev/shm/..., a local NVMe) for a local "
                             "checkpoint tier: frequent per-rank saves, each also kept by a "
                             "partner rank on another node; restores (an in-job restart "
                             "above all) resume from it when it is newest (default: none)")
    parser.add_argument("--local-every", type=int, default=None,
                        help="optimizer steps between local-tier saves (default: a fifth of "
                             "the save interval, at least 1); needs --local-dir")
    parser.add_argument("--local-keep", type=int, default=2,
                        help="local-tier steps kept per rank (and per replica)")
    parser.add_argument("--keep-last", type=int, default=3,
                        help="keep the newest K checkpoints (0: keep all)")
    parser.add_argument("--keep-every", type=int, default=None,
                        help="also keep every checkpoint whose step is a multiple of M")
    parser.add_argument("--async-save", action="store_true",
                        help="write interval checkpoints in the background")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds: timeout of training collectives (keep it short)")
    parser.add_argument("--checkpoint-timeout", type=float, default=7200.0,
                        help="seconds: timeout of checkpoint coordination (load skew)")
    parser.add_argument("--grace-period", type=float, default=None,
                        help="seconds between the preemption signal and the kill, if known")
    parser.add_argument("--requeue-on-signal", action="store_true",
                        help="after a save forced by SIGUSR1 (sbatch --signal time-limit "
                             "warning, which SLURM does not requeue), `scontrol requeue` "
                             "the job from rank 0; a SIGTERM preemption is requeued by SLURM")
    parser.add_argument("--export", type=Path, default=None,
                        help="after training, write the upstream bf16 inference layout here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per rank (CPU runs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="compute device (default: cuda:<local rank> when CUDA is "
                             "available, else cpu)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="bf16: FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16) with "
                             "fp32 gradient reduction (CUDA only); fp32: plain fp32 "
                             "(default: the config's)")
    parser.add_argument("--deterministic", action="store_true",
                        help="on CUDA: torch.use_deterministic_algorithms(True) and "
                             "CUBLAS_WORKSPACE_CONFIG=:4096:8 (CPU runs always use "
                             "deterministic kernels)")
    parser.add_argument("--wandb", action="store_true",
                        help="log to Weights & Biases when wandb is installed; the run id is "
                             "kept in the checkpoint so a resume continues the same run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--poll-every", type=_poll_every, default="auto",
                        help="steps between the ranks' preemption votes, or 'auto' (default: "
                             "as often as keeps the votes under 0.5%% of step time)")
    return parser


def _poll_every(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--poll-every must be >= 1 or auto, not {text}")
    return value


# --------------------------------------------------------------------------- config


def resolve_config(name: str, *, world_size: int, num_steps: int | None = None,
                   save_interval: int | None = None, seed: int | None = None
                   ) -> LingBotConfig:
    """The named config, adapted to this launch.

    The effective batch is the recipe and stays fixed: on another world size the
    gradient accumulation is re-derived (``effective / (world_size * micro_batch)``).

    Args:
        name: Config name.
        world_size: Ranks of this launch.
        num_steps: Override of the run length.
        save_interval: Override of the checkpoint cadence.
        seed: Override of the model-init and data-order seed.

    Raises:
        ConfigError: The effective batch is not a multiple of ``world_size`` times the
            micro-batch size, or an override is invalid.
    """
    config = get_config(name)
    train_cfg = config.train
    per_step = world_size * train_cfg.micro_batch_size
    if train_cfg.effective_batch_size % per_step:
        raise ConfigError(
            f"config {name!r}: effective_batch_size={train_cfg.effective_batch_size} is not a "
            f"multiple of world_size*micro_batch_size = {world_size}*"
            f"{train_cfg.micro_batch_size}; launch on a world size that divides it",
            field="TrainConfig.effective_batch_size", value=train_cfg.effective_batch_size,
        )
    train_cfg = dataclasses.replace(
        train_cfg,
        world_size=world_size,
        grad_accum_steps=train_cfg.effective_batch_size // per_step,
        num_steps=train_cfg.num_steps if num_steps is None else num_steps,
        save_interval=train_cfg.save_interval if save_interval is None else save_interval,
        seed=train_cfg.seed if seed is None else seed,
    )
    return dataclasses.replace(config, train=train_cfg)


def recipe_fingerprint(config: LingBotConfig) -> dict[str, Any]:
    """What must not change across a resume: the config without launch-only fields.

    World size, accumulation, run length and save cadence are left out: a resume on
    another world size (re-derived accumulation) or with a longer budget is legitimate.
    """
    recipe = config.to_dict()
    for key in _LAUNCH_FIELDS:
        recipe["train"].pop(key)
    return recipe


# --------------------------------------------------------------------------- metrics


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a metrics file, skipping a torn last line (a process killed mid-write).

    Args:
        path: A ``metrics.jsonl`` file; a missing file reads as no records.

    Returns:
        The records, in file order.
    """
    target = Path(path)
    if not target.exists():
        return []
    records = []
    for line in target.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


class MetricsLog:
    """The per-step metrics file of a run, written by rank 0 only.

    Args:
        path: The ``metrics.jsonl`` file.
        enabled: False on ranks other than 0 (every method is then a no-op).
    """

    def __init__(self, path: Path, *, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._handle: Any = None

    def truncate_after(self, step: int) -> int:
        """Keep only the records with ``step <= step``; atomic (write, fsync, rename).

        Call once after restoring, before training: records after the resumed step were
        written by a run whose later state was lost (a crash) and will be recomputed.

        Returns:
            The number of records dropped.
        """
        if not self.enabled:
            return 0
        records = read_metrics(self.path)
        kept = [record for record in records if record["step"] <= step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with staging.open("w") as handle:
            for record in kept:
                handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return len(records) - len(kept)

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record as a JSON line and flush it (watchers see it at once)."""
        if not self.enabled:
            return
        if self._handle is None:
            self._handle = self.path.open("a")
        self._handle.write(json.dumps(dict(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


# --------------------------------------------------------------------------- data


class MicroBatches(Iterator[dict[str, Tensor]]):
    """Endless micro-batches of this rank's share, epoch after epoch.

    The sampler is the single source of the data position: each micro-batch is read from
    a sampler iteration started at the current position, and the trainer calls
    ``sampler.advance(n)`` once the micro-batch is in the gradients. A new epoch starts
    when the sampler has nothing left for this rank.

    Args:
        dataset: Map-style dataset of samples.
        sampler: The resumable sampler (its state is checkpointed).
        micro_batch_size: Samples per micro-batch (the last of an epoch may be smaller).
        device: Where the batch tensors go.
    """

    def __init__(self, dataset: Dataset[dict[str, Tensor]],
                 sampler: ResumableDistributedSampler, micro_batch_size: int,
                 device: torch.device) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.device = device
        self._indices: Iterator[int] | None = None
        self._position: tuple[int, int] | None = None

    def __next__(self) -> dict[str, Tensor]:
        if self.sampler.remaining == 0:
            self.sampler.set_epoch(self.sampler.epoch + 1)
        position = (self.sampler.epoch, self.sampler.consumed)
        if self._indices is None or position != self._position:
            # The position moved by other means than our own advance (a restore): restart
            # the iteration where the sampler now stands.
            self._indices = iter(self.sampler)
        indices = [index for _, index in zip(range(self.micro_batch_size), self._indices,
                                             strict=False)]
        self._position = (self.sampler.epoch,
                          min(self.sampler.dataset_len,
                              self.sampler.consumed + len(indices) * self.sampler.num_replicas))
        samples = [self.dataset[index] for index in indices]
        return {key: value.to(self.device) for key, value in collate(samples).items()}


def _dataset(config: LingBotConfig, data_dir: Path | None
             ) -> SyntheticEpisodeDataset | EpisodeDirectoryDataset:
    if data_dir is None:
        return SyntheticEpisodeDataset.from_config(config)
    return EpisodeDirectoryDataset(data_dir, SampleSpec.from_config(config))


# --------------------------------------------------------------------------- training


def _retention(args: argparse.Namespace) -> RetentionPolicy:
    if not args.keep_last:
        return keep_all()
    policy = keep_last(args.keep_last)
    return policy | keep_every(args.keep_every) if args.keep_every else policy


def _local_tier(args: argparse.Namespace, save_interval: int) -> LocalTier | None:
    """``--local-dir``/``--local-every``/``--local-keep`` as the manager's local tier."""
    if args.local_dir is None:
        if args.local_every is not None:
            raise ConfigError("--local-every needs --local-dir (the node-local directory)",
                              field="--local-every", value=args.local_every)
        return None
    every = args.local_every if args.local_every is not None else max(1, save_interval // 5)
    return LocalTier(str(args.local_dir), save_every=every, keep=args.local_keep)


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _seed_python_and_numpy(seed: int, rank: int) -> None:
    """Seed Python's and NumPy's global streams per rank (a restore then overwrites them).

    They are checkpointed per rank like torch's, and the streams resumekit derives for a
    rank that a grown world adds hash all of rank 0's: seeded, they are the same on every
    rerun instead of drawn from OS entropy (unseeded, a run regrown from 1 to 2 ranks
    continued differently on each rerun).
    """
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)


def _build_model(config: LingBotConfig, context: DistributedContext) -> LingBotVA:
    mixed = config.train.mixed_precision and context.device.type == "cuda"
    if config.train.mixed_precision and not mixed:
        logger.warning("config %s asks for bf16 mixed precision, which needs CUDA: this run "
                       "on %s trains in fp32", config.name, context.device)
    torch.manual_seed(config.train.seed)
    if context.device.type == "cuda":
        # Real sizes: never materialise the full model on any rank; initialise the shards.
        with torch.device("meta"):
            model = LingBotVA(config.model)
        if context.is_distributed:
            shard_model(model, mixed_precision=mixed)
        model.to_empty(device=context.device)
        model.init_weights()
        return model
    model = LingBotVA(config.model)
    if context.is_distributed:
        shard_model(model, mixed_precision=mixed)
    return model


def _with_dtype(config: LingBotConfig, dtype: str | None, device: torch.device
                ) -> LingBotConfig:
    """Apply ``--dtype``: bf16 turns on the config's mixed precision, which needs CUDA."""
    if dtype is None:
        return config
    if dtype == "bf16" and device.type != "cuda":
        raise ConfigError(
            f"--dtype bf16 (FSDP2 bf16 mixed precision) needs a CUDA device; this run is on "
            f"{device}", field="TrainConfig.mixed_precision", value=True)
    train_cfg = dataclasses.replace(config.train, mixed_precision=dtype == "bf16")
    return dataclasses.replace(config, train=train_cfg)


def _wandb_run(enabled: bool, ckpt: CheckpointManager, config: LingBotConfig,
               leader: bool) -> Any:
    """Start (or continue, by the id kept in the checkpoint) a wandb run on rank 0."""
    if not (enabled and leader):
        return None
    if importlib.util.find_spec("wandb") is None:
        logger.warning("--wandb given but wandb is not installed; not logging to wandb")
        return None
    wandb: Any = importlib.import_module("wandb")
    run_id = ckpt.extras.get("wandb_run_id") or wandb.util.generate_id()
    ckpt.extras["wandb_run_id"] = run_id
    return wandb.init(id=run_id, resume="allow", config=config.to_dict(),
                      name=f"lingbot-{config.name}")


def _init(args: argparse.Namespace) -> DistributedContext:
    """Start the process group (short training timeout) and choose the kernels."""
    if args.deterministic:
        # cuBLAS reads this when its first handle is created: set it before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    context = init_distributed(timeout=args.timeout, checkpoint_timeout=args.checkpoint_timeout,
                               device=args.device)
    if context.device.type == "cpu":
        # Bit-identical resumes on CPU: one thread per rank, deterministic kernels.
        torch.set_num_threads(args.threads)
        torch.use_deterministic_algorithms(True)
    elif args.deterministic:
        torch.use_deterministic_algorithms(True)
    return context


def _restart_count(context: DistributedContext) -> int:
    """torchrun's restarts of the worker group so far: the largest of the nodes' counts.

    ``TORCHELASTIC_RESTART_COUNT`` is per node: the node whose worker failed counts the
    restart, a node restarted because of it (a membership change) does not.
    """
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not context.is_distributed:
        return count
    value = torch.tensor([count], device=context.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _log_in_job_restart(restarts: int) -> None:
    """Say so when torchrun restarted this worker group in the job (``--max-restarts``)."""
    if restarts:
        logger.warning("in-job restart %d of at most %s (torchrun --max-restarts): a worker "
                       "failed and torchrun restarted every worker on the same nodes; "
                       "resuming from the newest step every rank can get", restarts,
                       os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))


def _log_start(ckpt: CheckpointManager, start: int, dropped: int, config: LingBotConfig,
               world_size: int, scheduler: Any, sampler: ResumableDistributedSampler,
               ) -> None:
    """Say how this launch starts: fresh, resumed (and what), or already finished.

    (An in-job restart that found no usable node-local copy is resumekit's own warning.)
    """
    if ckpt.finished and start >= config.train.num_steps:
        # A relaunch of a finished run (its final checkpoint restored): nothing to train,
        # and the job exits 0.
        logger.info("run already finished at step %d (final checkpoint): nothing to train",
                    start)
    elif ckpt.resumed_from is None:
        logger.info("fresh start: step 0 of %d on %d rank(s)", config.train.num_steps,
                    world_size)
    else:
        tier = f" from the {ckpt.restored_from_tier} tier" if ckpt.restored_from_tier else ""
        logger.info("resumed at step %d%s: weights, AdamW state, lr schedule (lr %.3g), RNG "
                    "streams and data position (epoch %d, %d samples consumed); %d metric "
                    "record(s) after step %d dropped", start, tier, scheduler.get_last_lr()[0],
                    sampler.epoch, sampler.consumed, dropped, start)


def _optimizer_step(model: LingBotVA, optimizer: torch.optim.Optimizer, scheduler: Any,
                    batches: MicroBatches, noise: torch.Generator, config: LingBotConfig,
                    context: DistributedContext) -> dict[str, float]:
    """One optimizer step over ``grad_accum_steps`` micro-batches; its losses, lr and norm."""
    tcfg = config.train
    model.train()
    sums = torch.zeros(3, dtype=torch.float64)
    for micro in range(tcfg.grad_accum_steps):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(micro == tcfg.grad_accum_steps - 1)
        batch = next(batches)
        terms = flow_matching_step(model, batch, noise, frame_patch=config.model.patch_size[0],
                                   action_loss_weight=tcfg.action_loss_weight)
        (terms.loss / tcfg.grad_accum_steps).backward()
        batches.sampler.advance(int(batch["latents"].shape[0]))
        sums += torch.stack([t.detach().double().cpu() for t in terms])
    max_norm = config.optim.grad_clip if config.optim.grad_clip > 0 else math.inf
    grad_norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    sums /= tcfg.grad_accum_steps
    if context.is_distributed:
        dist.all_reduce(sums)
        sums /= context.world_size
    loss, latent_loss, action_loss = sums.tolist()
    return {"loss": loss, "latent_loss": latent_loss, "action_loss": action_loss, "lr": lr,
            "grad_norm": float(grad_norm)}


def _say_preempted(ckpt: CheckpointManager, preemption: PreemptionHandler, step: int) -> None:
    signals = "/".join(dict.fromkeys(r.name for r in preemption.received)) or "another rank's"
    saved = (f"saved checkpoint_step_{step}" if ckpt.last_saved_step == step
             else f"emergency save skipped, newest checkpoint is step {ckpt.last_saved_step}")
    logger.warning("preempted at step %d (%s signal): %s; exiting with status %d; rerun the "
                   "same command to resume", step, signals, saved, EXIT_CODE_PREEMPTED)


def _export(args: argparse.Namespace) -> None:
    """``--export``: the newest checkpoint as the upstream bf16 inference layout."""
    exported = export_checkpoint(
        args.save_root / CHECKPOINT_DIR, out=args.export, dtype="bf16", layout="diffusers",
        name_format=CHECKPOINT_NAME_FORMAT, overwrite=True)
    logger.info("exported step %d (%d tensors, bf16) to %s", exported.step, exported.tensors,
                Path(exported.out) / exported.files[0])


def train(args: argparse.Namespace) -> int:
    """Run (or resume) one training job; return the process exit status.

    Returns:
        0 when the run reached ``num_steps``; ``EXIT_CODE_PREEMPTED`` (75) after a
        preemption checkpoint.
    """
    context = _init(args)
    config = _with_dtype(resolve_config(
        args.config, world_size=context.world_size, num_steps=args.num_steps,
        save_interval=args.save_interval, seed=args.seed), args.dtype, context.device)
    tcfg, leader = config.train, context.is_leader
    restarts = _restart_count(context)
    if leader:
        args.save_root.mkdir(parents=True, exist_ok=True)
        _log_in_job_restart(restarts)
    _seed_python_and_numpy(config.train.seed, context.rank)
    model = _build_model(config, context)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim)
    dataset = _dataset(config, args.data_dir)
    sampler = ResumableDistributedSampler(dataset, seed=tcfg.seed)
    noise = torch.Generator(device=context.device).manual_seed(tcfg.noise_seed + context.rank)
    preemption = PreemptionHandler(grace_period=args.grace_period,  # the manager installs it
                                   poll_every=args.poll_every)
    ckpt = CheckpointManager(
        args.save_root / CHECKPOINT_DIR, model=model, optimizer=optimizer,
        scheduler=scheduler, data=sampler,
        generators={"noise": noise}, extras={"config_name": config.name},
        save_every=tcfg.save_interval, retention=_retention(args),
        name_format=CHECKPOINT_NAME_FORMAT, async_save=args.async_save,
        config=recipe_fingerprint(config), preemption=preemption,
        local=_local_tier(args, tcfg.save_interval),
    )
    metrics = MetricsLog(args.save_root / METRICS_FILE, enabled=leader)
    progress: Any = None
    status = 0
    try:
        start = ckpt.restore()
        dropped = metrics.truncate_after(start)
        if leader:
            _log_start(ckpt, start, dropped, config, context.world_size, scheduler, sampler)
        run = _wandb_run(args.wandb, ckpt, config, leader)
        batches = MicroBatches(dataset, sampler, tcfg.micro_batch_size, context.device)
        progress = tqdm(total=tcfg.num_steps, initial=start, file=sys.stderr,
                        disable=not leader or args.no_progress, desc=f"lingbot {config.name}",
                        unit="step", dynamic_ncols=True, mininterval=0.5)
        for step in range(start + 1, tcfg.num_steps + 1):  # step: optimizer steps done
            record = {"step": step, **_optimizer_step(model, optimizer, scheduler, batches,
                                                      noise, config, context),
                      "epoch": sampler.epoch, "world_size": context.world_size}
            metrics.append(record)
            hold_for_signal(step, lambda: preemption.requested)  # test-only, off by default
            if run is not None:
                run.log({k: v for k, v in record.items() if k != "step"}, step=step)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            if step == start + 1 and ckpt.resumed_from is not None and leader:
                # The end of a recovery (the drills time a fault to this line).
                logger.info("first step after resuming at step %d done: step %d", start, step)
            if step == tcfg.num_steps:
                ckpt.finish(step)  # the last step is committed, as reason "final"
            elif ckpt.step_end(step):  # a preemption checkpoint of `step` is committed
                if leader:
                    _say_preempted(ckpt, preemption, step)
                status = EXIT_CODE_PREEMPTED
                break
        ckpt.wait()
        if status == 0 and args.export is not None and leader:
            _export(args)
        if status == 0 and run is not None:
            run.finish()  # after a preemption the run stays open for the resume
    finally:
        if progress is not None:
            progress.close()
        metrics.close()
    # Not reached on an error: closing meets the other ranks, and one of them may be gone.
    ckpt.close()  # also removes the preemption handler
    shutdown()
    if status == EXIT_CODE_PREEMPTED and args.requeue_on_signal:
        _requeue(preemption)  # last, and rank 0 only: requeueing ends the job at once
    return status


def _requeue(preemption: PreemptionHandler) -> None:
    """Requeue after SIGUSR1 (SLURM does not); a failure is logged, the checkpoint stays."""
    try:
        requeue_after_signal(preemption)
    except PreemptionError as error:
        logger.error("could not requeue the job (%s); resubmit it to resume", error)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, train, return the exit status."""
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    install_test_faults()  # test-only, off unless LINGBOT_TEST_* variables are set
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
