"""The fixed cost per tensor: many small tensors saved and restored, against plain DCP.

A model of ``count`` small parameter tensors (no optimizer: every tensor is one item) is
saved by resumekit (sync, raw tensor files) and by plain ``dcp.save`` (DCP's default
writer, fsync'd like every method), and restored by ``restore()`` (verified) and by plain
``dcp.load``, interleaved round by round with a raw write and a raw read of the same
bytes. A method's fixed cost per tensor is ``(its seconds - the raw write's (or read's)
seconds of the same round) / count``: what the tensors cost beyond moving their bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from benchmarks.peers import write_all
from benchmarks.timing import FreshDirs, clock, fsync_tree, interleave, remove
from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.retention import keep_all

#: Elements per tensor: 192 fp32 = 768 bytes, the issue's 10k tensors = 7.7 MB.
ELEMENTS = 192


class ManySmall(nn.Module):
    """``count`` parameter tensors of ``elements`` fp32 each."""

    def __init__(self, count: int, elements: int = ELEMENTS) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(elements, generator=generator)) for _ in range(count))


def _raw_write(model: nn.Module, target: Path) -> None:
    target.mkdir()
    fd = os.open(target / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for tensor in model.state_dict().values():
            write_all(fd, memoryview(tensor.detach().numpy()).cast("B"))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_tree(target)


def _raw_read(model: nn.Module, source: Path) -> None:
    with open(source / "raw.bin", "rb", buffering=0) as handle:
        for tensor in model.state_dict().values():
            view = memoryview(tensor.detach().numpy()).cast("B")
            while view:
                got = handle.readinto(view)
                if not got:
                    raise EOFError(f"{source} is shorter than the state it should hold")
                view = view[got:]


def _dcp_save(model: nn.Module, target: Path) -> None:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(target), no_dist=True)
    fsync_tree(target)


def _dcp_load(model: nn.Module, source: Path) -> None:
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(source), no_dist=True)


def bench_per_tensor(work: Path, count: int, rounds: int,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Interleaved saves and restores of ``count`` small tensors; every sample."""
    model = ManySmall(count)
    step = [0]
    timed = FreshDirs(work, "per-tensor-").timed_write

    save_root = work / "per-tensor-resumekit"
    saver = CheckpointManager(save_root, model=model, retention=keep_all())

    def resumekit_save() -> float:
        step[0] += 1
        try:
            return clock(lambda: saver.save(step[0]))
        finally:
            remove(save_root / saver.name_format.build(step[0]))

    raw_dir, dcp_dir = work / "per-tensor-load-raw", work / "per-tensor-load-dcp"
    _raw_write(model, raw_dir)
    _dcp_save(model, dcp_dir)
    load_root = work / "per-tensor-load-resumekit"
    CheckpointManager(load_root, model=model).save(1)
    loader = CheckpointManager(load_root, model=model)
    # Warm reads: the files are in the page cache, so the bytes cost a memory copy and
    # the rest is per-tensor work.
    _raw_read(model, raw_dir)
    _dcp_load(model, dcp_dir)
    loader.restore()
    methods: dict[str, Callable[[], float]] = {
        "raw_write": timed("raw", lambda t: _raw_write(model, t)),
        "resumekit_save": resumekit_save,
        "dcp_save": timed("dcp", lambda t: _dcp_save(model, t)),
        "raw_read": lambda: clock(lambda: _raw_read(model, raw_dir)),
        "resumekit_restore": lambda: clock(loader.restore),
        "dcp_load": lambda: clock(lambda: _dcp_load(model, dcp_dir)),
    }
    begin = time.monotonic()
    samples = interleave(methods, rounds, progress=progress)
    saver.close()
    loader.close()
    step_dir = load_root / loader.name_format.build(1)
    bytes_on_disk = {"resumekit": sum(p.stat().st_size for p in step_dir.rglob("*")
                                      if p.is_file()),
                     "dcp": sum(p.stat().st_size for p in dcp_dir.rglob("*") if p.is_file())}
    # The metadata of the same state by resumekit's writer and by plain DCP, into
    # directories of the same name length (the path is recorded in it once).
    ours, theirs = work / "per-tensor-md-rk", work / "per-tensor-md-dc"
    tensors.save({"model": model.state_dict()}, ours)
    _dcp_save(model, theirs)
    metadata = {"resumekit": (ours / DCP_METADATA_FILE).stat().st_size,
                "dcp": (theirs / DCP_METADATA_FILE).stat().st_size}
    for path in (raw_dir, dcp_dir, load_root, save_root, ours, theirs):
        remove(path)
    return {"samples": samples, "count": count, "tensor_bytes": count * ELEMENTS * 4,
            "metadata_bytes": metadata, "checkpoint_bytes": bytes_on_disk,
            "seconds": time.monotonic() - begin}


def fixed_costs(section: dict[str, Any]) -> dict[str, Any]:
    """Per-round fixed costs per tensor (seconds) and their ratios to plain DCP's."""
    samples, count = section["samples"], section["count"]

    def per_tensor(name: str, baseline: str) -> list[float]:
        return [max(t - b, 0.0) / count
                for t, b in zip(samples[name], samples[baseline], strict=True)]

    ours_save = per_tensor("resumekit_save", "raw_write")
    dcp_save = per_tensor("dcp_save", "raw_write")
    ours_load = per_tensor("resumekit_restore", "raw_read")
    dcp_load = per_tensor("dcp_load", "raw_read")
    return {
        "save_us": [s * 1e6 for s in ours_save], "dcp_save_us": [s * 1e6 for s in dcp_save],
        "restore_us": [s * 1e6 for s in ours_load], "dcp_load_us": [s * 1e6 for s in dcp_load],
        # A round whose DCP cost vanished in the noise (at or below the raw baseline, on a
        # loaded machine) measures no ratio.
        "save_vs_dcp": [a / b for a, b in zip(ours_save, dcp_save, strict=True) if b > 0],
        "restore_vs_dcp": [a / b for a, b in zip(ours_load, dcp_load, strict=True) if b > 0],
        "metadata_bytes_per_tensor": {name: size / count
                                      for name, size in section["metadata_bytes"].items()},
    }
