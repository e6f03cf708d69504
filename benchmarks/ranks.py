"""The two-rank part: resharding loads (FSDP2, gloo) and the preemption vote's cost.

Ranks are real processes (``spawn``) joined in a gloo group on loopback, one intra-op
thread each (two ranks on two cores).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from benchmarks.timing import median
from benchmarks.workload import Shape, build_model, build_optimizer, train_step
from resumekit.manager import CheckpointManager
from resumekit.runtime.preemption import PreemptionHandler
from resumekit.store.retention import keep_all


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str,
           args: tuple[Any, ...]) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=10))
        payload: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        dist.barrier()
    except BaseException as error:  # noqa: BLE001 - reported by spawn_ranks
        payload = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(payload, handle)


def spawn_ranks(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], *,
                start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each result.

    ``start_method="forkserver"`` forks each rank from a server that imported torch once
    (the caller sets its preload): many ranks on few cores start in seconds, sharing
    torch's pages.

    Raises:
        RuntimeError: A rank failed (its traceback is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-ranks-") as out_dir:
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                                     nprocs=world_size, start_method=start_method,
                                     join=False)
        while not context.join():
            pass
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                raise RuntimeError(f"benchmark rank {rank} left no result in {path}")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise RuntimeError(f"benchmark rank {rank} failed: {value}")
            results.append(value)
    return results


# ------------------------------------------------------------------------- rank side


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (an operation ends when its last rank does)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def fsdp_model(shape: Shape) -> nn.Module:
    """The benchmark model with every linear layer (and the root) ``fully_shard``-ed."""
    model = build_model(shape)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _calibrated_step(target_ms: float) -> tuple[Callable[[], None], int]:
    """A CPU-bound step of about ``target_ms`` (same repetition count on every rank)."""
    a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))

    def one() -> None:
        torch.mm(a, a)

    for _ in range(20):
        one()
    timings = []
    for _ in range(50):
        start = time.perf_counter()
        one()
        timings.append(time.perf_counter() - start)
    reps = torch.tensor([max(1, round(target_ms / 1000 / median(timings)))], dtype=torch.int64)
    dist.broadcast(reps, src=0)
    count = int(reps.item())

    def step() -> None:
        for _ in range(count):
            one()

    return step, count


def poll_overhead(rounds: int, steps: int, step_ms: float) -> dict[str, Any]:
    """Cost of ``PreemptionHandler.agreed`` per step, against a ~``step_ms`` step.

    Per round: ``steps`` steps of compute, each ended by a collective that lines the ranks
    up (as a gradient all-reduce does), then ``agreed(step)`` of the default handler
    (``poll_every="auto"``) and of one that votes at every step; a call's cost is the
    slower rank's time in it. The figure is the default handler's mean cost per step (it
    votes only at some steps) over the median step. Alongside, the same all-reduce bare
    (the floor of gloo on this machine) and, as a cross-check, blocks of steps without
    and with the default handler.
    """
    handler = PreemptionHandler()
    every_step = PreemptionHandler(poll_every=1)
    step, reps = _calibrated_step(step_ms)
    counter = 0
    per_round: list[float] = []
    intervals: list[int] = []
    every_step_us: list[float] = []
    vote_us: list[float] = []
    bare_us: list[float] = []
    step_ms_seen: list[float] = []
    block_ratios: list[float] = []
    for _ in range(rounds):
        compute = torch.zeros(steps, dtype=torch.float64)
        vote = torch.zeros(steps, dtype=torch.float64)
        vote_every = torch.zeros(steps, dtype=torch.float64)
        bare = torch.zeros(steps, dtype=torch.float64)
        ballot = torch.zeros(4, dtype=torch.int64)
        dist.barrier()
        for index in range(steps):
            start = time.perf_counter()
            step()
            compute[index] = time.perf_counter() - start
            # A training step ends in a collective (gradient all-reduce, FSDP reduce-scatter)
            # that lines the ranks up; the vote's cost is what it adds after that.
            dist.all_reduce(ballot, op=dist.ReduceOp.MAX)
            start = time.perf_counter()
            if handler.agreed(counter):
                raise RuntimeError("no rank was signalled, yet the ranks agreed to stop")
            counter += 1
            vote[index] = time.perf_counter() - start
            dist.all_reduce(ballot, op=dist.ReduceOp.MAX)
            start = time.perf_counter()
            if every_step.agreed(counter - 1):
                raise RuntimeError("no rank was signalled, yet the ranks agreed to stop")
            vote_every[index] = time.perf_counter() - start
            # The floor: the same all-reduce of four int64, lined up the same way, bare.
            dist.all_reduce(ballot, op=dist.ReduceOp.MAX)
            start = time.perf_counter()
            dist.all_reduce(ballot, op=dist.ReduceOp.MAX)
            bare[index] = time.perf_counter() - start
        for series in (vote, vote_every, bare, compute):  # the slower rank's, step by step
            dist.all_reduce(series, op=dist.ReduceOp.MAX)
        cost = float(vote.mean())  # votes at some steps only: the mean is what a step pays
        step_seconds = median(compute.tolist())
        per_round.append(cost / step_seconds)
        vote_us.append(cost * 1e6)
        every_step_us.append(median(vote_every.tolist()) * 1e6)
        intervals.append(handler.poll_interval)
        bare_us.append(median(bare.tolist()) * 1e6)
        step_ms_seen.append(step_seconds * 1e3)
        # Cross-check: the same number of steps without and with the vote, back to back.
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        without = _slowest(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
            handler.agreed(counter)
            counter += 1
        with_vote = _slowest(time.perf_counter() - start)
        block_ratios.append(with_vote / without - 1)
    return {
        "per_round": per_round,
        "vote_us_per_round": vote_us,
        "auto_poll_interval_per_round": intervals,
        "every_step_vote_us_per_round": every_step_us,
        "bare_all_reduce_us_per_round": bare_us,
        "step_ms_per_round": step_ms_seen,
        "matmul_reps_per_step": reps,
        "steps_per_round": steps,
        "block_overhead_per_round": block_ratios,
        "block_overhead_median": median(block_ratios),
    }


def reshard_loads(shape: Shape, root_w1: str, root_w2: str, rounds: int) -> dict[str, Any]:
    """Save a 2-rank FSDP2 checkpoint, then time loading it (2->2) against 1->2.

    ``root_w1`` must already hold a checkpoint written by one process.
    """
    model = fsdp_model(shape)
    optimizer = build_optimizer(model)
    train_step(model, optimizer)
    writer = CheckpointManager(root_w2, model=model, optimizer=optimizer, retention=keep_all())
    dist.barrier()
    start = time.perf_counter()
    writer.save(1)
    save_seconds = _slowest(time.perf_counter() - start)
    writer.close()
    managers = {
        "load_2_to_2": CheckpointManager(root_w2, model=model, optimizer=optimizer),
        "load_1_to_2": CheckpointManager(root_w1, model=model, optimizer=optimizer),
    }
    samples: dict[str, list[float]] = {name: [] for name in managers}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "written by a different world size" on purpose
        for manager in managers.values():  # warm the page cache for both
            manager.restore()
        names = list(managers)
        for index in range(rounds):
            for name in names if index % 2 == 0 else reversed(names):
                dist.barrier()
                start = time.perf_counter()
                managers[name].restore()
                samples[name].append(_slowest(time.perf_counter() - start))
    for manager in managers.values():
        manager.close()
    return {"samples": samples, "save_2_ranks_seconds": save_seconds}


def two_rank_work(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Everything measured on two ranks, in one process group (one spawn)."""
    poll = poll_overhead(config["rounds"], config["poll_steps"], config["poll_step_ms"])
    reshard = reshard_loads(Shape(**config["shape"]), config["root_w1"], config["root_w2"],
                            config["rounds"])
    return {"rank": rank, "poll": poll, "reshard": reshard}
