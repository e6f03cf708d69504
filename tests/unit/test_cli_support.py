"""Helpers shared by the CLI tests: tiny checkpoints written by CheckpointManager.

No tests here; the ``test_cli_*`` modules import these helpers.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit.cli import main
from resumekit.manager import CheckpointManager
from resumekit.state.sampler import ResumableDistributedSampler
from resumekit.store.manifest import (
    MANIFEST_NAME,
    checksum_chunks,
    hex_digest,
    parse_parts_checksum,
    parts_checksum,
)
from resumekit.store.retention import keep_all

MODEL_CONFIG = {"num_layers": 2, "dim": 8}


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))


@contextmanager
def slurm_env(job: str | None, restart: int | None) -> Iterator[None]:
    """Pretend to run as SLURM job ``job`` after ``restart`` requeues (None: no SLURM)."""
    saved = {key: os.environ.get(key) for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT")}
    for key in saved:
        os.environ.pop(key, None)
    if job is not None:
        os.environ["SLURM_JOB_ID"] = job
        os.environ["SLURM_RESTART_COUNT"] = str(restart or 0)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Trainer:
    """A tiny model, AdamW, a warm-up schedule, a resumable sampler and a noise stream."""

    def __init__(self, root: str | Path, *, name_format: str = "step_{step:09d}",
                 storage_options: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.model = tiny_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / 4))
        self.sampler = ResumableDistributedSampler(32, seed=3, num_replicas=1, rank=0)
        self.noise = torch.Generator().manual_seed(11)
        self.manager = CheckpointManager(
            os.fspath(root), model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, data=self.sampler, generators={"noise": self.noise},
            extras={"wandb_run": "abc123", "model_config": MODEL_CONFIG},
            config={"lr": 1e-2, "model": MODEL_CONFIG}, retention=keep_all(),
            name_format=name_format, storage_options=storage_options,
        )

    def train_step(self) -> None:
        x = torch.randn(4, 4, generator=self.noise)
        loss = self.model(x).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.sampler.advance(4)

    def save(self, step: int, **kwargs: Any) -> None:
        self.train_step()
        self.manager.save(step, **kwargs)

    def close(self) -> None:
        self.manager.close()


def write_checkpoints(root: str | Path, steps: list[int], **kwargs: Any) -> Trainer:
    """Train one step before each save of ``steps``; return the (closed) trainer."""
    trainer = Trainer(root, **kwargs)
    for step in steps:
        trainer.save(step)
    trainer.close()
    return trainer


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``main(argv)`` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    """Run a command with ``--json``; return (exit code, parsed document, stderr)."""
    code, out, err = run_cli(capsys, *argv, "--json")
    return code, json.loads(out), err


def assert_one_error_line(err: str, *needles: str) -> None:
    """stderr holds exactly one line, ``resumekit: error: ...``, naming every needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("resumekit: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def rewrite_manifest(step_dir: Path, change: Mapping[str, Any] | None = None,
                     rehash: tuple[str, ...] = ()) -> None:
    """Edit a committed manifest: merge ``change``, re-hash the files in ``rehash``."""
    path = step_dir / MANIFEST_NAME
    document = json.loads(path.read_text())
    document.update(change or {})
    for entry in document["files"]:
        if entry["path"] in rehash:
            data = (step_dir / entry["path"]).read_bytes()
            entry["size"] = len(data)
            entry["checksum"] = _rehashed(data, entry["checksum"])
    path.write_text(json.dumps(document))


def _rehashed(data: bytes, old: str) -> str:
    """``data``'s checksum of the kind of ``old``: a checksum of parts keeps its parts but
    the last, which takes the rest (the trailer of a raw data file, after an edit of it)."""
    parts = parse_parts_checksum(old)
    if parts is None:
        return checksum_chunks([data])
    lengths = [length for length, _ in parts[:-1]]
    lengths.append(len(data) - sum(lengths))
    starts = [sum(lengths[:number]) for number in range(len(lengths))]
    return parts_checksum([(length, hex_digest(data[start:start + length]))
                           for start, length in zip(starts, lengths, strict=True)])


class CodeRunningPickle:
    """Unpickling this runs code: it creates ``marker`` (proof that a load executed)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def malicious_metadata(marker: Path) -> bytes:
    return pickle.dumps(CodeRunningPickle(marker))
