"""How each method writes (or reads) the same model + AdamW state.

Every writer takes an empty target path and returns when its files are durable: peers
that do not fsync by themselves are followed by an fsync of every file they wrote (and of
their directories), so all methods pay for durability alike.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from benchmarks.timing import fsync_tree
from benchmarks.workload import state_tensors


def write_all(fd: int, view: memoryview) -> None:
    """Write ``view`` to ``fd`` completely (``os.write`` may write less than asked)."""
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B") if tensor.numel() else memoryview(b"")


def raw_write(model: nn.Module, optimizer: torch.optim.Optimizer, target: Path) -> None:
    """The machine's limit: every tensor's bytes, one stream, one file, then fsync."""
    tensors = state_tensors(model, optimizer)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for tensor in tensors:
            write_all(fd, _bytes_of(tensor))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_tree(target.parent)


def raw_read(model: nn.Module, optimizer: torch.optim.Optimizer, source: Path) -> None:
    """Read a :func:`raw_write` file back into the live tensors, one stream, in order."""
    tensors = state_tensors(model, optimizer)
    with open(source, "rb", buffering=0) as handle:
        for tensor in tensors:
            view = _bytes_of(tensor)
            while view:
                got = handle.readinto(view)
                if not got:
                    raise EOFError(f"{source} is shorter than the state it should hold")
                view = view[got:]


def torch_save(model: nn.Module, optimizer: torch.optim.Optimizer, target: Path) -> None:
    """``torch.save`` of the model and optimizer state dicts into one file, then fsync."""
    target.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               target / "checkpoint.pt")
    fsync_tree(target)


def dcp_save(model: nn.Module, optimizer: torch.optim.Optimizer, target: Path,
             thread_count: int | None = None) -> None:
    """``dcp.save`` of ``get_state_dict(model, optimizer)``; DCP's writer, DCP's fsync.

    ``thread_count=None`` is DCP's default writer (one thread); otherwise a
    ``FileSystemWriter`` with that many threads (other options at their defaults).
    """
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    writer = None if thread_count is None else dcp.FileSystemWriter(
        str(target), thread_count=thread_count)
    dcp.save(state, checkpoint_id=str(target), storage_writer=writer, no_dist=True)
    fsync_tree(target)


class AccelerateSaver:
    """``Accelerator.save_state`` (safetensors model, pickled optimizer, RNG states)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from accelerate import Accelerator  # noqa: PLC0415 - optional (bench extra)

        self.accelerator = Accelerator(cpu=True)
        # Registers both objects for save_state; on one CPU process nothing is wrapped in
        # a way that copies parameters or optimizer state.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def __call__(self, target: Path) -> None:
        self.accelerator.save_state(str(target))
        fsync_tree(target)


class LightningSaver:
    """Lightning Fabric ``save`` of ``{"model": model, "optimizer": optimizer}``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from lightning.fabric import Fabric  # noqa: PLC0415 - optional (bench extra)

        self.fabric = Fabric(accelerator="cpu", devices=1)
        self.state: dict[str, Any] = {"model": model, "optimizer": optimizer}

    def __call__(self, target: Path) -> None:
        target.mkdir()
        self.fabric.save(target / "checkpoint.ckpt", self.state)
        fsync_tree(target)


def missing(module: str) -> str | None:
    """Why the peer ``module`` cannot run here, or ``None`` when it can."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (make bench installs the bench extra)"
    return None
