"""What one collective of the checkpoint group costs a rank, as the world size grows.

``python -m benchmarks.collectives`` (``--worlds 2,32``, ``--calls 50``): for each W, W gloo
ranks on loopback (spawned, one intra-op thread each) run each collective ``--calls``
times after a few warm-up calls, with a barrier between kinds. Each rank measures its
process's CPU (``getrusage``: every thread, gloo's transport included) and its wall time
per call; a row gives rank 0's figures and the median of the other ranks'. The kinds are
the raw tensor collectives and the :class:`~resumekit.store.coordination.
ProcessGroupCoordinator` calls a restore and a save make (``agree_on_failure`` where no
rank failed, ``gather`` and ``broadcast`` of a small object, the framed all-gather they
replaced). It writes ``benchmarks/results/collectives.json`` (docs/performance.md,
"Agreements in one integer").

No figure is asserted anywhere: on a shared machine wall and CPU times are only compared
within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.ranks import spawn_ranks
from benchmarks.world_fake import measured_stamp
from resumekit.store.coordination import ProcessGroupCoordinator, agree_on_failure

__all__ = ["KINDS", "main", "measure"]

#: The collectives timed, in order.
KINDS = ("coordinator_all_gather", "all_gather_int64", "all_reduce_int64",
         "agree_on_failure", "coordinator_gather", "gather_broadcast_int64",
         "coordinator_broadcast", "broadcast_int64", "barrier")

#: A small object, as an outcome is (what a restore's agreements sent before).
OUTCOME = ("ok", None)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _calls(rank: int, world_size: int) -> dict[str, Callable[[], object]]:
    coordinator = ProcessGroupCoordinator()

    def one() -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int64)

    def gather_broadcast() -> None:
        dist.gather(one(), [one() for _ in range(world_size)] if rank == 0 else None, dst=0)
        dist.broadcast(one(), src=0)

    return {
        "coordinator_all_gather": lambda: coordinator.all_gather(OUTCOME),
        "all_gather_int64": lambda: dist.all_gather([one() for _ in range(world_size)], one()),
        "all_reduce_int64": lambda: dist.all_reduce(one(), op=dist.ReduceOp.MIN),
        "agree_on_failure": lambda: agree_on_failure(coordinator, None),
        "coordinator_gather": lambda: coordinator.gather(OUTCOME),
        "gather_broadcast_int64": gather_broadcast,
        "coordinator_broadcast": lambda: coordinator.broadcast(OUTCOME),
        "broadcast_int64": lambda: dist.broadcast(one(), src=0),
        "barrier": dist.barrier,
    }


def _rank(rank: int, world_size: int, calls: int) -> dict[str, tuple[float, float]]:
    """This rank's (CPU ms, wall ms) per call of each kind."""
    figures: dict[str, tuple[float, float]] = {}
    for kind, call in _calls(rank, world_size).items():
        for _ in range(3):
            call()
        dist.barrier()
        cpu, wall = _cpu(), time.perf_counter()
        for _ in range(calls):
            call()
        figures[kind] = ((_cpu() - cpu) / calls * 1e3, (time.perf_counter() - wall) / calls * 1e3)
        dist.barrier()
    return figures


def measure(world_size: int, calls: int) -> dict[str, Any]:
    """One row: each kind's CPU and wall milliseconds per call at ``world_size`` ranks."""
    ranks = spawn_ranks(_rank, world_size, (calls,))
    row: dict[str, Any] = {"world_size": world_size, "calls": calls}
    for kind in KINDS:
        others = [ranks[rank][kind] for rank in range(1, world_size)]
        row[kind] = {
            "cpu_ms_rank0": ranks[0][kind][0],
            "cpu_ms_others_median": statistics.median(cpu for cpu, _ in others),
            "wall_ms_rank0": ranks[0][kind][1],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    """Measure every W of ``--worlds``; write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,32", help="comma-separated world sizes (>= 2)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per kind")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "collectives.json")
    args = parser.parse_args(argv)
    worlds = [int(value) for value in args.worlds.split(",") if value]
    if any(world < 2 for world in worlds):
        parser.error("--worlds: every world size must be at least 2")
    stamp = measured_stamp()
    rows = []
    for world in worlds:
        rows.append(measure(world, args.calls))
        print(f"W = {world}: " + ", ".join(
            f"{kind} {rows[-1][kind]['cpu_ms_others_median']:.2f}" for kind in KINDS),
            flush=True)
    low, high = rows[0], rows[-1]
    # a ratio is None where the smaller world's CPU was below the clock's resolution
    summary = {
        f"{kind}_cpu_w{high['world_size']}_vs_w{low['world_size']}":
        high[kind]["cpu_ms_others_median"] / low[kind]["cpu_ms_others_median"]
        if low[kind]["cpu_ms_others_median"] > 0 else None
        for kind in KINDS} if len(rows) > 1 else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "rows": rows, "measured": stamp,
                                    "setup": {"backend": "gloo", "threads_per_rank": 1,
                                              "clock": "getrusage RUSAGE_SELF (all threads)"}},
                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
