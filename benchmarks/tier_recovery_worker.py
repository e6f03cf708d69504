"""One rank of the tier-recovery benchmark, run by ``torchrun --max-restarts`` (see
:mod:`benchmarks.tier_recovery`).

Trains the bench model (FSDP2 over the gloo ranks) with a durable root and a local tier
(a local save every step, ``keep`` 2, no replicas: one node). Faults, at fixed steps, so
that both recoveries happen in one job:

* at ``--crash-local`` rank 1 SIGKILLs itself right after its step (the step's local copy
  is committed on every rank: the ranks meet first): torchrun restarts the group, which
  restores from the local tier;
* at ``--crash-durable`` the local tier is lost first (rank 0 deletes the local directory,
  as a wiped node-local disk, and drops the durable root's pages from the page cache, as
  on a node that never read them), then rank 1 SIGKILLs itself: the restart restores
  from the durable root, at the NAS stand-in's bandwidth.

Every rank appends JSON-line events (``launch``, ``restored`` with the tier and the
seconds ``restore()`` took, ``step``, ``fault``) to ``--events`` (``.rank<r>`` for rank r).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal

import torch
import torch.distributed as dist

import resumekit
from benchmarks.ranks import fsdp_model
from benchmarks.scale_worker import Events
from benchmarks.timing import evict
from benchmarks.workload import Shape, build_optimizer, tensor_bytes, train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tier_recovery_worker")
    parser.add_argument("--durable", required=True)
    parser.add_argument("--local-root", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--durable-every", type=int, required=True)
    parser.add_argument("--crash-local", type=int, required=True)
    parser.add_argument("--crash-durable", type=int, required=True)
    args = parser.parse_args(argv)
    import time  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    resumekit.init_distributed(timeout=120, checkpoint_timeout=600)
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = Events(args.events, rank)
    events.log("launch", pid=os.getpid(), attempt=attempt)
    model = fsdp_model(Shape(args.layers, args.width))
    optimizer = build_optimizer(model)
    with resumekit.CheckpointManager(
            args.durable, model=model, optimizer=optimizer, save_every=args.durable_every,
            local=resumekit.LocalTier(args.local_root, save_every=1, keep=2, replicas=False)
    ) as ckpt:
        began = time.perf_counter()
        start = ckpt.restore()
        events.log("restored", step=start, tier=ckpt.restored_from_tier, attempt=attempt,
                   seconds=time.perf_counter() - began)
        for step in range(start + 1, args.steps + 1):
            train_step(model, optimizer, batch=8, seed=step)
            ckpt.step_end(step)
            events.log("step", step=step, attempt=attempt,
                       state_bytes=tensor_bytes(model, optimizer))
            if step in (args.crash_local, args.crash_durable) and attempt < 2:
                ckpt.wait()  # local saves write in the background: this one committed
                _crash(rank, step == args.crash_durable, args, events)
    return 0


def _crash(rank: int, lose_local: bool, args: argparse.Namespace, events: Events) -> None:
    """Rank 1 dies by SIGKILL once every rank committed the step (and lost the tier)."""
    dist.barrier()  # every rank's local copy of the step is committed
    if lose_local and rank == 0:
        shutil.rmtree(args.local_root)
        evict(args.durable)
    dist.barrier()
    if rank == 1:
        events.log("fault", lose_local=lose_local)
        events.handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main())
