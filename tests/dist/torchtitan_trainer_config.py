"""The torchtitan config module of tests/dist/test_torchtitan_trainer.py (``--module``).

``--module tests.dist.torchtitan_trainer_config --config resumekit_debugmodel`` is what
torchtitan's ``ConfigManager`` loads (a ``config_registry`` function, as a torchtitan user
writes one). It starts from torchtitan's own ``llama3_debugmodel()`` and changes:

* the one line of the switch: ``checkpoint=ResumekitCheckpointer.Config(...)`` (torchtitan's
  has ``CheckpointManager.Config(interval=10, last_save_model_only=False)``);
* what a 2-core CPU needs: 2 of the debugmodel's 6 layers, ``seq_len`` 32, 2 sequences a
  rank, float32 FSDP2 parameters (no bf16 mixed precision), no activation checkpointing,
  no CUDA graphs, no validation;
* the data: torchtitan's stock dataset (``c4_test``) and tokenizer ship in its repository's
  tests/assets, not in the wheel. :class:`WordsDataLoader` is a torchtitan data loader
  (a ``ParallelAwareDataloader``, its stateful loader) over seeded documents of words,
  tokenized by torchtitan's ``HuggingFaceTokenizer`` from a word-level ``tokenizer.json``
  that ``torchtitan_real_trainer_runner.write_tokenizer`` builds with the ``tokenizers`` package.

Environment (set by the test): ``TITAN_OUT`` (the dump folder's run: the checkpoint root is
``TITAN_OUT/../checkpoint``), ``TITAN_ASSETS`` (the tokenizer folder), ``TITAN_STEPS``,
``TITAN_INTERVAL``; ``TITAN_PAUSE_AT`` and ``TITAN_PAUSE_FOR`` (the runner's :func:`pause`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from resumekit.integrations.torchtitan import ResumekitCheckpointer
from tests.dist.torchtitan_real_trainer_runner import WORDS
from tests.distributed_harness import say_paused
from tests.limits import HANG_S


class WordsDataset(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Seeded documents (a different stream per data-parallel rank), tokenized and packed.

    Yields ``({"input": ids, "positions": per-document positions}, labels)`` windows of
    ``seq_len`` tokens, as torchtitan's ``HuggingFaceTextDataset`` does; its state (the
    document index and the token buffer) is what a resume must restore.
    """

    def __init__(self, tokenizer: Any, seq_len: int, dp_rank: int) -> None:
        self.tokenizer, self.seq_len, self.dp_rank = tokenizer, seq_len, dp_rank
        self.document = 0
        self.buffer: list[tuple[int, int]] = []  # (token, position in its document)
        self.windows = 0
        self.before_window: Callable[[], None] | None = None  # the test runner's hook

    def _text(self, index: int) -> str:
        rng = random.Random(f"{self.dp_rank}/{index}")
        return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randrange(5, 40)))

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            while len(self.buffer) < self.seq_len + 1:
                ids = self.tokenizer.encode(self._text(self.document))
                self.buffer.extend((token, position) for position, token in enumerate(ids))
                self.document += 1
            if self.before_window is not None:
                self.before_window()
            window, self.buffer = self.buffer[:self.seq_len + 1], self.buffer[self.seq_len:]
            self.windows += 1
            tokens = torch.tensor([token for token, _ in window])
            yield {"input": tokens[:-1], "positions": _positions(window[:-1])}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"document": self.document, "buffer": json.dumps(self.buffer),
                "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.document, self.windows = state["document"], state["windows"]
        self.buffer = [tuple(item) for item in json.loads(state["buffer"])]  # type: ignore[misc]


def _positions(window: list[tuple[int, int]]) -> torch.Tensor:
    """Positions in each document, the window's first document's counted from the window's
    start (``HuggingFaceTextDataset._normalize_positions``)."""
    positions = [position for _, position in window]
    offset = positions[0]
    for index, position in enumerate(positions):
        if position == 0:
            break
        positions[index] = position - offset
    return torch.tensor(positions)


class WordsDataLoader(ParallelAwareDataloader):
    """torchtitan's ``ParallelAwareDataloader`` over :class:`WordsDataset`, from its config."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "resumekit_words"

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any,
                 seq_len: int, local_batch_size: int,
                 snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        dataset = WordsDataset(tokenizer, seq_len, dp_rank)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size, num_workers=config.num_workers,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def pause(out: Path, rank: int, preemption: Any) -> None:
    """Say so (``paused_<rank>``: the pid), then wait for a preemption signal or a kill.

    Called by the test runner when the trainer fetches the batch of the step after
    ``TITAN_PAUSE_AT``: for a preemption signal when ``TITAN_PAUSE_FOR=signal``, else until
    killed.
    """
    say_paused(out, rank, os.getpid())
    deadline = time.monotonic() + HANG_S
    signal_wanted = os.environ.get("TITAN_PAUSE_FOR") == "signal"
    while not (signal_wanted and preemption.requested):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: neither signal nor kill {HANG_S}s after pausing")
        time.sleep(0.01)


def resumekit_debugmodel() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel``, its checkpointer resumekit's, sized for a CPU."""
    config = llama3_debugmodel()
    spec = config.model_spec
    assert spec is not None
    config.model_spec = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, layers=list(spec.model.layers[:2])))
    steps = int(os.environ.get("TITAN_STEPS", "10"))
    interval = int(os.environ.get("TITAN_INTERVAL", "3"))
    out = Path(os.environ["TITAN_OUT"])
    config.dump_folder = str(out.parent)
    config.hf_assets_path = os.environ["TITAN_ASSETS"]
    config.training.steps = steps
    config.debug.seed = 0  # torchtitan draws a seed per launch without one
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None
    config.validator.enable = False
    config.parallelism.spmd_backend = "partial_dtensor"
    config.dataloader = WordsDataLoader.Config()
    # The one line: torchtitan's llama3_debugmodel has
    # checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False).
    # (preemption_poll_every=1: these steps take a fraction of a second, the automatic vote
    # interval could let the run end before a vote counts the signal)
    config.checkpoint = ResumekitCheckpointer.Config(
        enable=True, interval=interval, last_save_model_only=False, preemption_poll_every=1)
    return config
