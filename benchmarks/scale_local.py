"""The scale bench's local tier at ``save_every=1``: its step against no checkpointing.

``scale_step_slowdown_local_every_step`` (issue 38, items 2 and 6): one torchrun launch of
the scale model (2 gloo CPU ranks, FSDP2, AdamW; :mod:`benchmarks.scale_worker`'s model
and step) trains in rounds of blocks of ``--block`` steps (:data:`MODES`): one with no
checkpointing (the steps alone), one with a :class:`~resumekit.options.LocalTier` saving
every step (``step_end`` after each step; the durable root never saves: its
``save_every`` is past the run), and for comparison one whose every local save is waited
for in its step (the local tier before issue 38.2). Each block's time runs from a barrier
before its first step to the end of its last step, and for a local block to the commit of
its last local save (``wait()``), so every write of the block is in it; the slower rank's
time counts. The order of the blocks rotates round after round (drift on a shared machine
falls on every mode alike); the figure is the median over the rounds of (local block /
the round's block without checkpointing), each per step: a ratio of two times measured
side by side, not a wall time. A first round (the staging buffers' allocation, the local
root's first commit, the writer thread's first start) is reported apart as
``first_round_ratio``, a launch cost.

The local root is node-local, outside the NAS stand-in: a directory in ``/dev/shm``
where it has room (:func:`node_local_root`), else on the host's own disk; one node here,
so ``replicas=False`` (a replica needs another node).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import median, remove

__all__ = ["analyse", "main", "run"]

REPO_ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
#: The blocks of a round: no checkpointing; a local save every step as resumekit makes it
#: (staged, written in the background); and, for comparison, the same save waited for in
#: the step (``wait()`` after ``step_end``: the local tier before issue 38.2).
MODES = ("off", "local", "blocking")
KEEP = 2  # local steps kept (each rank's own; no replicas on one node)
SHM = Path("/dev/shm")
GB = 1_000_000_000


def node_local_root(bench_dir: Path, state_bytes: int, *, shm: Path = SHM) -> Path:
    """The local tier's root: in ``/dev/shm`` where it holds ``keep + 1`` states (the
    usual node-local choice: RAM), else on the host's disk under ``bench_dir``."""
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = os.statvfs(shm)
        if free.f_bavail * free.f_frsize > (KEEP + 1) * state_bytes + GB:
            return Path(tempfile.mkdtemp(prefix="resumekit-scale-local-", dir=shm))
    return bench_dir / "node-local"


def analyse(blocks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The figure from the blocks rank 0 logged (``round``, ``mode``, ``steps``, ``seconds``).

    Round 0 is the warm-up (reported apart); each later round pairs its two blocks.

    Returns:
        ``ratio`` (median over the measured rounds of local / off, per step; None without
        a measured round), ``rounds`` (each round's ratio), ``first_round_ratio``,
        ``blocking_ratio`` and ``blocking_rounds`` (the same of the waited-for save), the
        median seconds per step of each mode, ``held_s_per_step_median``: of a local
        block's step, the seconds training waited in ``step_end`` (the staging copy, and
        the previous write where it had not committed yet) and in the block's last wait,
        and ``cpu_ratio`` / ``cpu_rounds``: the same ratio of the CPU time the ranks'
        processes used (``cpu_s``: every thread, the local save's writer included, both
        ranks summed), which other processes' load inflates far less than wall time
        (None for blocks without it).
    """
    by_round: dict[int, dict[str, float]] = {}
    for block in blocks:
        per_step = float(block["seconds"]) / int(block["steps"])
        by_round.setdefault(int(block["round"]), {})[str(block["mode"])] = per_step
    ratios = {number: modes["local"] / modes["off"] for number, modes in by_round.items()
              if {"local", "off"} <= set(modes) and modes["off"] > 0}
    measured = [ratios[number] for number in sorted(ratios) if number > 0]
    blocking = [modes["blocking"] / modes["off"] for number, modes in sorted(by_round.items())
                if number > 0 and {"blocking", "off"} <= set(modes) and modes["off"] > 0]

    def median_of(mode: str) -> float | None:
        values = [by_round[number][mode] for number in sorted(ratios) if number > 0]
        return median(values) if values else None

    held = [float(block.get("held_s", 0.0)) / int(block["steps"]) for block in blocks
            if block["mode"] == "local" and int(block["round"]) > 0]
    cpu: dict[int, dict[str, float]] = {}
    for block in blocks:
        if "cpu_s" in block:
            cpu.setdefault(int(block["round"]), {})[str(block["mode"])] = \
                float(block["cpu_s"]) / int(block["steps"])
    cpu_rounds = [modes["local"] / modes["off"] for number, modes in sorted(cpu.items())
                  if number > 0 and {"local", "off"} <= set(modes) and modes["off"] > 0]
    return {"ratio": median(measured) if measured else None, "rounds": measured,
            "cpu_ratio": median(cpu_rounds) if cpu_rounds else None,
            "cpu_rounds": cpu_rounds,
            "first_round_ratio": ratios.get(0), "step_s_off_median": median_of("off"),
            "step_s_local_median": median_of("local"),
            "blocking_ratio": median(blocking) if blocking else None,
            "blocking_rounds": blocking,
            "held_s_per_step_median": median(held) if held else None}


def run(*, work: Path, local_root: Path, logs: Path, layers: int, width: int, batch: int,
        rounds: int, block: int, timeout_s: float, env: Mapping[str, str]) -> dict[str, Any]:
    """Launch the worker (``rounds`` measured rounds after a warm-up); its figures.

    Args:
        work: The durable root's parent (the NAS stand-in, or a plain directory).
        local_root: The local tier's root (node-local: the host's own disk).
        logs: Where the launch's log and blocks go.
        layers: The scale model's layers.
        width: Its width.
        batch: Rows per step.
        rounds: Measured rounds (each: one block without checkpointing, one local).
        block: Steps per block.
        timeout_s: The launch's limit (a hang detector).
        env: Settings of the trainers beside this process's environment (the scale
            bench's ``MALLOC_KEEP``: the same for both kinds of block).

    Raises:
        RuntimeError: The launch failed (its log's tail in the message).
    """
    logs.mkdir(parents=True, exist_ok=True)
    blocks_path, log_path = logs / "local-every-step.jsonl", logs / "local-every-step.log"
    remove(blocks_path)
    durable = work / "local_every_step_durable"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANKS}", "-m", "benchmarks.scale_local",
               "--durable-root", str(durable), "--local-root", str(local_root),
               "--blocks", str(blocks_path), "--layers", str(layers), "--width", str(width),
               "--batch", str(batch), "--rounds", str(rounds), "--block", str(block)]
    settings = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                               os.environ.get("PYTHONPATH", "")])}
    began = time.monotonic()
    try:
        with log_path.open("wb") as log:
            done = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  env=settings, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the local-every-step launch failed ({done.returncode}); "
                               f"see {log_path}:\n{log_path.read_text()[-3000:]}")
        blocks = [json.loads(line) for line in blocks_path.read_text().splitlines()
                  if line.strip()]
    finally:
        remove(durable)
        remove(local_root)
    return {**analyse(blocks), "blocks": blocks, "rounds_measured": rounds,
            "steps_per_block": block, "seconds": time.monotonic() - began,
            "local_root": str(local_root), "replicas": False}


# ------------------------------------------------------------------------ the worker


def main(argv: list[str] | None = None) -> int:
    """One rank of the launch (under torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_local")
    parser.add_argument("--durable-root", required=True)
    parser.add_argument("--local-root", required=True)
    parser.add_argument("--blocks", required=True, help="rank 0 appends each block here")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--block", type=int, required=True)
    args = parser.parse_args(argv)
    import warnings  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from benchmarks.ranks import fsdp_model  # noqa: PLC0415
    from benchmarks.workload import Shape, build_optimizer, train_step  # noqa: PLC0415
    from resumekit import CheckpointManager, LocalTier  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp_model(Shape(args.layers, args.width))
    optimizer = build_optimizer(model)
    steps = (args.rounds + 1) * len(MODES) * args.block + 1
    manager = CheckpointManager(
        args.durable_root, model=model, optimizer=optimizer, save_every=steps + 1,
        local=LocalTier(args.local_root, save_every=1, keep=KEEP, replicas=False))
    step = manager.restore()
    step += 1
    train_step(model, optimizer, batch=args.batch, seed=step)  # AdamW's state exists
    with Path(args.blocks).open("a", buffering=1) as out:
        for number in range(args.rounds + 1):
            # Rotated each round: drift on a shared machine falls on every mode alike.
            order = MODES[number % len(MODES):] + MODES[:number % len(MODES)]
            for mode in order:
                dist.barrier()
                began, cpu_began = time.perf_counter(), time.process_time()
                held = 0.0  # inside step_end and the last wait: what training waited
                for _ in range(args.block):
                    step += 1
                    train_step(model, optimizer, batch=args.batch, seed=step)
                    if mode != "off":
                        called = time.perf_counter()
                        manager.step_end(step)
                        if mode == "blocking":
                            manager.wait()
                        held += time.perf_counter() - called
                if mode == "local":
                    called = time.perf_counter()
                    manager.wait()  # the block's last write is the block's
                    held += time.perf_counter() - called
                seconds = torch.tensor([time.perf_counter() - began, held],
                                       dtype=torch.float64)
                cpu = torch.tensor([time.process_time() - cpu_began], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
                if rank == 0:
                    out.write(json.dumps({"round": number, "mode": mode,
                                          "steps": args.block,
                                          "seconds": float(seconds[0].item()),
                                          "held_s": float(seconds[1].item()),
                                          "cpu_s": float(cpu[0].item())}) + "\n")
    manager.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
