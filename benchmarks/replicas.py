"""Peer replicas: what a replicate costs next to a local copy of the same bytes, and disk.

Two gloo ranks on this machine act as two nodes (``RESUMEKIT_NODE_NAME``), each with its
own local root. Each commits one step of ``--mb`` MB (one large tensor file, a few small
ones) and then, in interleaved rounds (``benchmarks.timing.interleave``):

* ``replicate``: :func:`resumekit.local.replicas.replicate`: each rank sends its step to
  the other, which writes, checks and commits it (every file fsynced);
* ``local_copy``: each rank copies its own step directory to another directory of the
  same disk (``shutil.copyfile`` per file, every file and directory fsynced): what the
  bytes cost without the network, the checksums and the commit;
* ``local_copy_hashed``: the same copy through user memory as a replicate moves it (read
  into a chunk buffer, XXH3 on both sides, write, fsync), without the network: what of a
  replicate's time is the network's.

Both run on both ranks at once (the same bytes written per round); a round's time is the
slowest rank's. The source files are in the page cache for both (just written). Then the
disk a node uses with ``keep`` steps: its own root and the replicas it keeps, after
``keep + 1`` steps were saved and replicated (own root pruned to ``keep`` as the local
tier does), measured (``du``-like sum of file sizes) and against ``2 x keep x step``.

    python -m benchmarks.replicas --mb 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ranks import spawn_ranks
from benchmarks.timing import fsync_tree, interleave, median, paired_ratios
from resumekit.local import replicas
from resumekit.store.commit import CommitProtocol
from resumekit.store.manifest import Checksum, Manifest
from resumekit.store.retention import keep_last, prune
from resumekit.store.storage import Storage

RESULTS = Path(__file__).parent / "results" / "replicas.json"


def _name(step: int) -> str:
    return f"step_{step:09d}"


def _commit(own: Storage, step: int, megabytes: int) -> int:
    """Commit one step: a large tensor file of random bytes and three small files."""
    protocol = CommitProtocol(own)
    pending = protocol.begin(step)
    big = own.path(f"{pending.staging}/tensors/__0_0.distcp")
    os.makedirs(os.path.dirname(big), exist_ok=True)
    generator = torch.Generator().manual_seed(step * 1000 + int(os.environ["RANK"]))
    with open(big, "wb") as handle:
        for _ in range(megabytes):
            block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator)
            handle.write(block.numpy().tobytes())
    for path, size in (("tensors/.metadata", 200_000), ("train_state.pt", 3_000),
                       ("rank_state/rank_00000.pt", 20_000)):
        own.write_bytes(f"{pending.staging}/{path}", os.urandom(size))
    manifest = protocol.publish(pending, Manifest(step=step))
    return manifest.total_bytes


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _rank(rank: int, world_size: int, base: str, megabytes: int, rounds: int, keep: int,
          chunk_mb: int) -> dict[str, Any]:
    os.environ[replicas.NODE_NAME_ENV] = f"node{rank}"
    replicas.CHUNK_BYTES = chunk_mb << 20
    local = Path(base) / f"node{rank}"
    own = Storage(local / f"rank_{rank:05d}")
    partners = replicas.Partners.of()
    source = partners.sources[0]

    def replica_root(of: int) -> Storage:
        return Storage(local / replicas.replica_dir(of))

    step_bytes = _commit(own, 1, megabytes)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def replicate() -> float:
        shutil.rmtree(replica_root(source).path(), ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        replicas.replicate(own, _name(1), partners, replica_root, keep=keep)
        return _slowest(time.perf_counter() - start)

    def local_copy() -> float:
        target = local / "copy"
        shutil.rmtree(target, ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        source_dir = Path(own.path(_name(1)))
        for file in sorted(p for p in source_dir.rglob("*") if p.is_file()):
            copy = target / file.relative_to(source_dir)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, copy)
        fsync_tree(target)
        return _slowest(time.perf_counter() - start)

    def local_copy_hashed() -> float:
        target = local / "copy"
        shutil.rmtree(target, ignore_errors=True)
        dist.barrier()
        start = time.perf_counter()
        source_dir = Path(own.path(_name(1)))
        buffer = memoryview(bytearray(replicas.CHUNK_BYTES))
        for file in sorted(p for p in source_dir.rglob("*") if p.is_file()):
            copy = target / file.relative_to(source_dir)
            copy.parent.mkdir(parents=True, exist_ok=True)
            read, written = Checksum(), Checksum()
            with open(file, "rb", buffering=0) as source_file, open(copy, "xb") as out:
                while count := source_file.readinto(buffer):
                    read.update(buffer[:count])
                    written.update(buffer[:count])
                    out.write(buffer[:count])
        fsync_tree(target)
        return _slowest(time.perf_counter() - start)

    samples = interleave({"replicate": replicate, "local_copy": local_copy,
                          "local_copy_hashed": local_copy_hashed}, rounds)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shutil.rmtree(local / "copy", ignore_errors=True)
    # disk with keep steps: save and replicate keep + 1 steps, own root pruned to keep
    for step in range(2, keep + 3):
        _commit(own, step, megabytes)
        prune(own, keep_last(keep), scope="top")
        replicas.replicate(own, _name(step), partners, replica_root, keep=keep)
    dist.barrier()
    return {"samples": samples, "step_bytes": step_bytes,
            "max_rss_growth_mb": (rss_after - rss_before) / 1024,
            "max_rss_mb": rss_after / 1024,
            "own_bytes": _bytes_under(Path(own.path())),
            "replica_bytes": _bytes_under(Path(replica_root(source).path())),
            "held": replicas.holdings(local)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="MB per rank per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--chunk-mb", type=int, default=replicas.CHUNK_BYTES >> 20,
                        help="bytes per send (default: the library's)")
    parser.add_argument("--dir", default=None, help="where the local roots go (a temp dir)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="resumekit-replicas-", dir=args.dir) as base:
        base_dir = str(Path(base).parent)
        results = spawn_ranks(_rank, 2, (base, args.mb, args.rounds, args.keep,
                                              args.chunk_mb))
    first = results[0]
    step_bytes = first["step_bytes"]
    samples = first["samples"]  # every rank's samples are the slowest rank's
    replicate_s, copy_s = samples["replicate"], samples["local_copy"]
    node_bytes = first["own_bytes"] + first["replica_bytes"]
    report = {
        "megabytes_per_rank_step": step_bytes / 1e6,
        "rounds": args.rounds,
        "chunk_mb": args.chunk_mb,
        "replicate_seconds": replicate_s,
        "local_copy_seconds": copy_s,
        "replicate_mb_per_s": step_bytes / 1e6 / median(replicate_s),
        "local_copy_mb_per_s": step_bytes / 1e6 / median(copy_s),
        "local_copy_hashed_seconds": samples["local_copy_hashed"],
        "local_copy_hashed_mb_per_s": step_bytes / 1e6 / median(samples["local_copy_hashed"]),
        "replicate_vs_local_copy_time": median(paired_ratios(replicate_s, copy_s)),
        "replicate_vs_local_copy_hashed_time": median(paired_ratios(
            replicate_s, samples["local_copy_hashed"])),
        "where": base_dir,
        "max_rss_growth_mb_during_rounds": [r["max_rss_growth_mb"] for r in results],
        "max_rss_mb": [r["max_rss_mb"] for r in results],
        "keep": args.keep,
        "node_bytes": node_bytes,
        "node_bytes_expected": 2 * args.keep * step_bytes,
        "held": {str(k): v for k, v in first["held"].items()},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
