"""``python -m benchmarks.restore_reads``: a replicated restore read once vs by every rank.

Two gloo ranks on loopback hold the same model + AdamW state (DDP-style: every rank holds
all of it; ``--layers`` x ``Linear(--width)``, 24 x 1024 is ~300 MB per rank), saved once
by the manager. Each round restores it with ``restore_reads="once"`` and ``"every_rank"``
side by side (the order alternates by round), in three settings:

* ``warm``: the checkpoint's files in the page cache (a read is a memory copy);
* ``cold``: the files dropped from the page cache first (``posix_fadvise(DONTNEED)`` on
  them only), read from this machine's local disk;
* ``link``: files in the page cache, but every read of a data file passes through one
  link of ``--bandwidth`` MB/s shared by both ranks (a FIFO reservation in shared memory:
  a read of n bytes ends no sooner than n / bandwidth after the link is free), the way
  ranks share a NAS's bandwidth.

A restore's time is its slowest rank's. Bytes read are counted on every read of a data
file (``*.distcp``). Writes ``benchmarks/results/restore_reads.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

from benchmarks.ranks import spawn_ranks
from benchmarks.timing import clock, evict, median
from benchmarks.workload import Shape, build_model, build_optimizer, train_step
from resumekit.manager import CheckpointManager
from resumekit.store.retention import keep_all

MODES = ("once", "every_rank")
SETTINGS = ("warm", "cold", "link")
RESULTS = Path(__file__).parent / "results" / "restore_reads.json"


class _Link:
    """One shared link: bandwidth in bytes/s, its next free moment in shared memory."""

    def __init__(self, bandwidth: float, free_at: Any, lock: Any) -> None:
        self.bandwidth = bandwidth
        self.free_at = free_at
        self.lock = lock
        self.on = False

    def carry(self, count: int) -> None:
        if not self.on or count <= 0:
            return
        with self.lock:
            start = max(time.monotonic(), self.free_at.value)
            self.free_at.value = done = start + count / self.bandwidth
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _Stream:
    def __init__(self, stream: Any, counts: list[int], link: _Link) -> None:
        self._stream, self._counts, self._link = stream, counts, link

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._stream.read(size)
        self._counts[0] += len(data)
        self._link.carry(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        count: int = self._stream.readinto(buffer) or 0
        self._counts[0] += count
        self._link.carry(count)
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _instrumented(link: _Link) -> Iterator[list[int]]:
    counts = [0]
    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            data = "r" in mode and str(path).endswith(".distcp")
            yield _Stream(stream, counts, link) if data else stream

    filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        filesystem.FileSystem.create_stream = original  # type: ignore[method-assign]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _rank(rank: int, world_size: int, root: str, shape: Shape, rounds: int,
          bandwidth: float, free_at: Any, lock: Any) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    model = build_model(shape)
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    manager = CheckpointManager(root, model=model, optimizer=optimizer, retention=keep_all())
    manager.save(1)
    manager.close()
    link = _Link(bandwidth, free_at, lock)
    seconds: dict[str, dict[str, list[float]]] = {s: {m: [] for m in MODES} for s in SETTINGS}
    read: dict[str, dict[str, list[int]]] = {s: {m: [] for m in MODES} for s in SETTINGS}
    for number in range(rounds):
        for setting in SETTINGS:
            for mode in MODES if number % 2 == 0 else tuple(reversed(MODES)):
                manager = CheckpointManager(root, model=model, optimizer=optimizer,
                                            restore_reads=mode, retention=keep_all())
                dist.barrier()
                if setting == "cold" and rank == 0:
                    evict(root)
                link.on = setting == "link"
                dist.barrier()
                with _instrumented(link) as counts:
                    took = clock(manager.restore)
                link.on = False
                manager.close()
                seconds[setting][mode].append(_slowest(took))
                read[setting][mode].append(counts[0])
    return {"seconds": seconds, "read": read}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, write its JSON, and return it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restore_reads")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=500.0,
                        help="the shared link's MB/s in the 'link' setting")
    parser.add_argument("--root", default=None, help="where to save (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    shape = Shape(args.layers, args.width)
    context = multiprocessing.get_context("spawn")
    free_at, lock = context.Value("d", 0.0, lock=False), context.Lock()
    with tempfile.TemporaryDirectory(prefix="rk-restore-reads-",
                                     dir=args.root) as scratch:
        results = spawn_ranks(_rank, 2, (str(Path(scratch) / "ckpt"), shape, args.rounds,
                                         args.bandwidth * 1e6, free_at, lock))
        data = sum(p.stat().st_size for p in
                   (Path(scratch) / "ckpt" / "step_000000001" / "tensors").glob("*.distcp"))
    seconds = results[0]["seconds"]
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        once, every = seconds[setting]["once"], seconds[setting]["every_rank"]
        summary[f"{setting}_once_s"] = median(once)
        summary[f"{setting}_every_rank_s"] = median(every)
        summary[f"{setting}_once_vs_every_rank"] = median(
            [a / b for a, b in zip(once, every, strict=True)])
        for mode in MODES:
            summary[f"{setting}_{mode}_read_per_rank_vs_data"] = [
                median(result["read"][setting][mode]) / data for result in results]
    out = {"what": "2 gloo ranks restoring one replicated (DDP-style) model + AdamW state; "
                   "restore_reads='once' vs 'every_rank', side by side; seconds of the "
                   "slowest rank, median of rounds",
           "state_bytes_per_rank": data, "layers": shape.layers, "width": shape.width,
           "rounds": args.rounds, "link_mb_per_s": args.bandwidth,
           "torch": torch.__version__, "summary": summary,
           "seconds": seconds, "read_bytes": [r["read"] for r in results]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return out


if __name__ == "__main__":
    main()
