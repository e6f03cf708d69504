"""``make bench-world``: what a save and a restore cost as the world size grows (issue 40).

Four parts, side by side with plain DCP, into ``benchmarks/results/world.json`` and
``world.png``:

* **real ranks**: W = 2..32 gloo ranks on loopback (forked from one server that imported
  torch once, one intra-op thread each), a tiny FSDP2 model with AdamW, so that what
  grows with W is the coordination, not the bytes. ``--rounds`` rounds (default 3), each
  running every W once; in each, the W ranks measure resumekit and DCP side by side,
  resumekit first in even rounds and DCP first in odd ones. Per W and round: rank 0's CPU
  seconds in a sync ``CheckpointManager.save`` and in ``dcp.save`` (the median of
  ``--repeats`` saves, and apart a run's first save and the median of its later ones,
  which reuse remembered plans; DCP's also with its own ``enable_plan_caching=True``),
  every rank's CPU seconds in ``CheckpointManager.restore()`` and in ``dcp.load`` (with
  ``get_state_dict`` and ``set_state_dict``, as a DCP trainer restores), ``.metadata``'s
  bytes, the bytes of ``.metadata`` files each rank opened during the restore (counted
  with an audit hook: every open of the process), and the files of each checkpoint. CPU
  seconds are ``time.process_time``: the whole process, every thread. A row's CPU figures
  are the medians over the rounds; each round's are kept in its ``rounds`` (with the
  1-minute load average at the round's start and end);
* **simulated ranks** (:mod:`benchmarks.world_fake`): W = 8..1,024 over the real 5B
  LingBot-VA shapes on the meta device, a fake process group (rank 0's save: a first
  save, and up to ``--steady-max`` a run's later saves, each side at its best);
* **a save's CPU per GB** (issue 40's item 4): one process, a sync save of a few hundred
  MB, CPU seconds of all threads per GB written, beside hashing the same bytes once;
* **the save under CPU load** (:mod:`benchmarks.cpu_load`, item 4): a sync save of
  ``--load-mb`` and a plain 4-thread ``O_DIRECT`` writer of the same bytes, alternated,
  in ``--load-bursts`` bursts (default 3), each a quiet phase and then one beside
  ``stress-ng --cpu 4`` (or 4 Python busy loops where stress-ng is not installed) for at
  most 90 s. ``--load-mb 0`` skips it (the key is then null, with the reason).

The summary's contract keys (issue 40), exactly:

* ``restore_cpu_per_rank_w32_vs_w2``: a restoring rank's CPU (the median of the ranks but
  rank 0) at the largest real W over the smallest's, each the median over the rounds;
* ``save_cpu_rank0_w32_vs_dcp``: rank 0's **steady-state** save at the largest real W (a
  run's later saves: the median of saves 2..``--repeats``, plans remembered) over DCP's
  at its best (the lower of its default planner's and its ``enable_plan_caching=True``
  later saves: caching is right here, where no dtype changes between saves), each the
  median over the rounds. A run's first save is ``save_cpu_rank0_first_w32_vs_dcp``
  (both sides plan in full; DCP at its best again); the key's definition before rounds
  (every save, against DCP's default planner) is
  ``save_cpu_rank0_all_saves_w32_vs_dcp_default``;
* ``files_per_checkpoint_w32``: the files of a resumekit checkpoint at the largest real W;
* ``restore_cpu_per_rank_w1024_vs_w8``, ``metadata_bytes_vs_dcp_w256``: simulated;
* ``save_vs_odirect_under_cpu_load``: per burst, the save's median GB/s over the plain
  writer's under the same load; the key is the median over the bursts.

``summary.per_round`` gives each real-rank ratio round by round (``values``, ``min``,
``max``, ``median``) and ``save_vs_odirect_under_cpu_load_per_burst`` (``_min``, ``_max``)
the bursts': a median is not every run's figure.

Usage: ``python -m benchmarks.world [--real 2,4,8,16,32] [--fake 8,...,1024]
[--rounds 3] [--repeats 3] [--save-mb 256] [--load-mb 1024] [--load-bursts 3]
[--out benchmarks/results/world.json] [--parts PATH[:part,...] ...]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from benchmarks import cpu_load, world_fake
from benchmarks.ranks import spawn_ranks
from resumekit.manager import CheckpointManager

REAL_WORLDS = (2, 4, 8, 16, 32)
FAKE_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
WIDTH = 32  # tiny layers: what grows with W is the coordination
LAYERS = 4
OUT = Path("benchmarks/results/world.json")
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "resumekit", "resumekit.manager", "benchmarks.world")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _metadata_opens() -> tuple[list[str], list[bool]]:
    """Paths of ``.metadata`` files this process opens while the flag is set."""
    opened: list[str] = []
    active = [False]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if (active[0] and event == "open" and isinstance(args[0], (str, Path))
                and str(args[0]).endswith(".metadata")):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    return opened, active


def _cpu(action: Any) -> float:
    dist.barrier()
    start = time.process_time()
    action()
    return time.process_time() - start


def real_rank(rank: int, world: int, root: str, repeats: int, dcp_first: bool = False
              ) -> dict[str, Any]:
    """One rank of one round: resumekit's saves and restores and DCP's, in CPU seconds.

    Each is done ``repeats`` times (the median is kept; a run's first save and the median
    of its later ones apart); the restores read the last save. ``dcp_first``: DCP's saves
    before resumekit's, and its restores before resumekit's (rounds alternate it).
    """
    opened, active = _metadata_opens()
    ours = f"{root}/resumekit"
    model, optimizer = _model()
    _step(model, optimizer)

    def dcp_save(number: int, cached: bool = False) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state},
                 checkpoint_id=f"{root}/dcp{'c' if cached else ''}{number}",
                 planner=DefaultSavePlanner(enable_plan_caching=cached))

    def our_saves() -> list[float]:
        manager = CheckpointManager(ours, model=model, optimizer=optimizer, retention=None)
        cpu = [_cpu(lambda step=step: manager.save(step)) for step in range(1, repeats + 1)]
        manager.close()
        return cpu

    def dcp_saves() -> tuple[list[float], list[float]]:
        default = [_cpu(lambda n=n: dcp_save(n)) for n in range(repeats)]
        # DCP at its best for a run's later saves: its own plan caching (empty plans
        # sent), which is right here, where no dtype changes between saves
        return default, [_cpu(lambda n=n: dcp_save(n, cached=True)) for n in range(repeats)]

    if dcp_first:
        dcp_save_cpu, dcp_cached_cpu = dcp_saves()
        save_cpu = our_saves()
    else:
        save_cpu = our_saves()
        dcp_save_cpu, dcp_cached_cpu = dcp_saves()

    def our_restores() -> tuple[list[float], list[str]]:
        cpu, ours_opened = [], []
        for _ in range(repeats):
            restored, restored_optimizer = _model()
            restorer = CheckpointManager(ours, model=restored, optimizer=restored_optimizer)
            opened.clear()
            active[0] = True
            cpu.append(_cpu(restorer.restore))
            active[0] = False
            restorer.close()
            ours_opened = list(opened)
        return cpu, ours_opened

    def dcp_load() -> None:
        loaded, loaded_optimizer = _model()
        model_state, optim_state = get_state_dict(loaded, loaded_optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=f"{root}/dcp{repeats - 1}")
        set_state_dict(loaded, loaded_optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def dcp_restores() -> tuple[list[float], list[str]]:
        cpu: list[float] = []
        for _ in range(repeats):
            opened.clear()
            active[0] = True
            cpu.append(_cpu(dcp_load))
            active[0] = False
        return cpu, list(opened)

    if dcp_first:
        dcp_restore_cpu, dcp_opened = dcp_restores()
        restore_cpu, ours_opened = our_restores()
    else:
        restore_cpu, ours_opened = our_restores()
        dcp_restore_cpu, dcp_opened = dcp_restores()
    return {"save_cpu_s": _median(save_cpu), "dcp_save_cpu_s": _median(dcp_save_cpu),
            "save_cpu_first_s": save_cpu[0], "dcp_save_cpu_first_s": dcp_save_cpu[0],
            "dcp_cached_save_cpu_first_s": dcp_cached_cpu[0],
            "save_cpu_steady_s": _median(save_cpu[1:]) if repeats > 1 else None,
            "dcp_save_cpu_steady_s": _median(dcp_save_cpu[1:]) if repeats > 1 else None,
            "dcp_cached_save_cpu_steady_s": _median(dcp_cached_cpu[1:])
            if repeats > 1 else None,
            "restore_cpu_s": _median(restore_cpu),
            "dcp_restore_cpu_s": _median(dcp_restore_cpu),
            "metadata_opened": ours_opened, "dcp_metadata_opened": dcp_opened}


def _files(directory: Path) -> int:
    return sum(1 for path in directory.rglob("*") if path.is_file())


def _read_bytes(paths: list[str]) -> int:
    """The bytes of the files ``paths`` opened, each open counted at its file's size.

    Since ``schema_version`` 5 a restoring rank opens ``.metadata`` once for its own part
    and rank 0 once more for the head: each open reads a range, not the whole file, so
    this is an upper bound of what they read.
    """
    return sum(os.path.getsize(path) for path in paths)


TIMED = ("save_cpu_rank0_s", "dcp_save_cpu_rank0_s",
         *(f"{side}save_cpu_rank0_{when}_s" for side in ("", "dcp_", "dcp_cached_")
           for when in ("first", "steady")),
         "restore_cpu_per_rank_s", "restore_cpu_rank0_s", "dcp_restore_cpu_per_rank_s")
"""A real-rank row's CPU figures: each the median over the rounds of the per-round
values kept in the row's ``rounds``."""


def real_round(world: int, repeats: int, dcp_first: bool) -> dict[str, Any]:
    """One round at ``world`` ranks: resumekit's and DCP's figures, side by side."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-world-") as root:
        ranks = spawn_ranks(real_rank, world, (root, repeats, dcp_first),
                            start_method="forkserver")
        step = Path(root) / "resumekit" / f"step_{repeats:09d}"
        metadata = step / "tensors" / ".metadata"
        dcp_dir = Path(root) / f"dcp{repeats - 1}"
        dcp_metadata = dcp_dir / ".metadata"
        reads = [_read_bytes(r["metadata_opened"]) for r in ranks]
        dcp_reads = [_read_bytes(r["dcp_metadata_opened"]) for r in ranks]
        others = ranks[1:]  # the restoring ranks that do not lead
        return {
            "world_size": world,
            "dcp_first": dcp_first,
            "loadavg_1min": [load_before, os.getloadavg()[0]],
            "save_cpu_rank0_s": ranks[0]["save_cpu_s"],
            "dcp_save_cpu_rank0_s": ranks[0]["dcp_save_cpu_s"],
            **{f"{side}save_cpu_rank0_{when}_s": ranks[0][f"{side}save_cpu_{when}_s"]
               for side in ("", "dcp_", "dcp_cached_") for when in ("first", "steady")},
            "restore_cpu_per_rank_s": _median([r["restore_cpu_s"] for r in others]),
            "restore_cpu_rank0_s": ranks[0]["restore_cpu_s"],
            "dcp_restore_cpu_per_rank_s": _median([r["dcp_restore_cpu_s"] for r in others]),
            "metadata_bytes": metadata.stat().st_size,
            "dcp_metadata_bytes": dcp_metadata.stat().st_size,
            "metadata_bytes_read_per_rank": max(reads[1:]),
            "metadata_bytes_read_leader": reads[0],
            "dcp_metadata_bytes_read_per_rank": max(dcp_reads[1:]),
            "files_per_checkpoint": _files(step),
            "dcp_files_per_checkpoint": _files(dcp_dir),
        }


def real(worlds: list[int], repeats: int = 3, rounds: int = 3) -> list[dict[str, Any]]:
    """The real-rank rows, one per W, each over ``rounds`` rounds.

    A round runs every W once (each W's ranks measure resumekit and DCP side by side,
    resumekit first in even rounds, DCP first in odd ones). A row's CPU figures
    (:data:`TIMED`) are the medians over the rounds, the per-round values kept in its
    ``rounds``; its bytes and files are the last round's (every round's are the same
    layout's).
    """
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    stamp = world_fake.measured_stamp()
    taken: dict[int, list[dict[str, Any]]] = {world: [] for world in worlds}
    for number in range(rounds):
        for world in worlds:
            taken[world].append(real_round(world, repeats, dcp_first=number % 2 == 1))
            print(f"world real round {number + 1}/{rounds} W={world}: " + ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in taken[world][-1].items()), flush=True)
    return [{**combine_rounds(taken[world]), "measured": stamp} for world in worlds]


def combine_rounds(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One W's row from its rounds (:func:`real_round`'s results, in the order run).

    Its CPU figures (:data:`TIMED`) are the medians over the rounds (of the rounds that
    measured them), each round's kept in ``rounds`` (with which side went first and the
    1-minute load average at its start and end); its bytes and files are the last
    round's.
    """
    row = {key: value for key, value in per_round[-1].items()
           if key not in ("dcp_first", "loadavg_1min")}
    for key in TIMED:
        values = [one[key] for one in per_round if one[key] is not None]
        row[key] = _median(values) if values else None
    row["rounds"] = [{"dcp_first": one["dcp_first"], "loadavg_1min": one["loadavg_1min"],
                      **{key: one[key] for key in TIMED}} for one in per_round]
    return row


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def save_cpu_per_gb(megabytes: int) -> dict[str, Any]:
    """A sync save of ``megabytes`` of fp32 tensors in one process: CPU (all threads) per GB.

    Beside it: hashing the same bytes once with XXH3-128 (what a save must do at least to
    record its checksums) and the bytes copied once (``torch.clone``).
    """
    stamp = world_fake.measured_stamp()
    tensors = [torch.randn(4 << 20, generator=torch.Generator().manual_seed(n))
               for n in range(max(1, megabytes // 16))]
    model = nn.Module()
    for number, tensor in enumerate(tensors):
        model.register_parameter(f"p{number}", nn.Parameter(tensor, requires_grad=False))
    total = sum(t.numel() * t.element_size() for t in tensors)
    gb = total / 1e9
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-world-save-",
                                     dir=os.environ.get("BENCH_WORLD_DIR")) as root:
        manager = CheckpointManager(root, model=model, retention=None)
        manager.save(0)  # warm-up: the first save's plan, the writer threads
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        manager.save(1)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        manager.close()
    start = time.process_time()
    for tensor in tensors:
        xxhash.xxh3_128_intdigest(tensor.numpy().data)
    hash_cpu = time.process_time() - start
    start = time.process_time()
    for tensor in tensors:
        tensor.clone()
    copy_cpu = time.process_time() - start
    return {"bytes": total, "save_cpu_s": cpu, "save_wall_s": wall,
            "save_cpu_s_per_gb": cpu / gb, "hash_once_cpu_s_per_gb": hash_cpu / gb,
            "copy_once_cpu_s_per_gb": copy_cpu / gb,
            "save_cpu_vs_hash_once": cpu / hash_cpu if hash_cpu else None,
            "measured": stamp}


PARTS = ("real", "simulated", "save_cpu_per_gb", "save_under_cpu_load")


def _stamped(row: dict[str, Any], path: str) -> dict[str, Any]:
    """``row`` of an earlier output: its own ``measured`` stamp, or, for a row written
    before the bench stamped its rows, the commit that last changed ``path`` (marked so)."""
    if row.get("measured"):
        return {**row, "measured": {**row["measured"], "taken_from": path}}
    import subprocess  # noqa: PLC0415

    found = subprocess.run(["git", "log", "-1", "--format=%H %cI", "--", path],
                           capture_output=True, text=True, check=False).stdout.split()
    return {**row, "measured": {
        "date": found[1] if len(found) == 2 else None,
        "commit": found[0] if len(found) == 2 else None, "taken_from": path,
        "note": "recorded before the bench stamped its rows: the date and commit are those "
                "of the last commit that changed the file, not of the measurement"}}


def provenance(real_rows: list[dict[str, Any]], fake_rows: list[dict[str, Any]],
               save: dict[str, Any] | None, load: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """Per part, the dates and commits its figures were measured at (a partial rerun
    mixes parts of several runs: this says which is which)."""
    def of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for row in rows:
            stamp = row.get("measured") or {}
            key = json.dumps(stamp, sort_keys=True)
            entry = seen.setdefault(key, {**stamp, "worlds": []})
            entry["worlds"].append(row["world_size"])
        return list(seen.values())

    return {"real": of(real_rows), "simulated": of(fake_rows),
            "save_cpu_per_gb": None if save is None else save.get("measured"),
            "save_under_cpu_load": None if load is None else load.get("measured")}


def _row(rows: list[dict[str, Any]], world: int) -> dict[str, Any] | None:
    return next((row for row in rows if row["world_size"] == world), None)


def _key_ratio(high: dict[str, Any] | None, low: dict[str, Any] | None, key: str
               ) -> float | None:
    if high is None or low is None:
        return None
    return _ratio(high.get(key), low.get(key))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _steady(row: dict[str, Any] | None, when: str) -> float | None:
    """Rank 0's save CPU over DCP's at its best, for a run's first save or its later ones
    (the median of saves 2..repeats): DCP's default planner or its own plan caching,
    whichever cost less."""
    if row is None or row.get(f"save_cpu_rank0_{when}_s") is None:
        return None
    theirs = [row.get(f"{side}save_cpu_rank0_{when}_s") for side in ("dcp_", "dcp_cached_")]
    best = min((value for value in theirs if value is not None), default=None)
    return _ratio(row[f"save_cpu_rank0_{when}_s"], best)


def _all_saves(row: dict[str, Any] | None) -> float | None:
    """The contract key's definition before rounds: the median of a manager's saves
    1..repeats over the median of ``dcp.save`` with DCP's default planner."""
    return None if row is None else _ratio(row["save_cpu_rank0_s"],
                                           row["dcp_save_cpu_rank0_s"])


def _restore_growth(high: dict[str, Any] | None, low: dict[str, Any] | None,
                    side: str = "") -> float | None:
    if high is None or low is None:
        return None
    return _ratio(high[f"{side}restore_cpu_per_rank_s"], low[f"{side}restore_cpu_per_rank_s"])


Row = dict[str, Any] | None
REAL_RATIOS: dict[str, Callable[[Row, Row], float | None]] = {
    "restore_cpu_per_rank_w32_vs_w2": _restore_growth,
    "dcp_restore_cpu_per_rank_w32_vs_w2": lambda high, low: _restore_growth(high, low, "dcp_"),
    "save_cpu_rank0_w32_vs_dcp": lambda high, low: _steady(high, "steady"),
    "save_cpu_rank0_first_w32_vs_dcp": lambda high, low: _steady(high, "first"),
    "save_cpu_rank0_all_saves_w32_vs_dcp_default": lambda high, low: _all_saves(high),
}
"""The summary's ratios of the real-rank rows, each a function of the largest and the
smallest W's row (or of one round's figures of them)."""


def per_round(high: dict[str, Any] | None, low: dict[str, Any] | None
              ) -> dict[str, Any] | None:
    """Each :data:`REAL_RATIOS` ratio round by round, with its min, max and median over
    the rounds (null where the rows carry no rounds, e.g. taken from an older run)."""
    if high is None or low is None or "rounds" not in high or "rounds" not in low:
        return None
    if len(high["rounds"]) != len(low["rounds"]):
        return None
    spread: dict[str, Any] = {}
    for key, ratio in REAL_RATIOS.items():
        values = [ratio(up, down) for up, down in zip(high["rounds"], low["rounds"],
                                                      strict=True)]
        kept = [value for value in values if value is not None]
        spread[key] = {"values": values, "min": min(kept, default=None),
                       "max": max(kept, default=None),
                       "median": _median(kept) if kept else None}
    return spread


def summarize(real_rows: list[dict[str, Any]], fake_rows: list[dict[str, Any]],
              save: dict[str, Any] | None, load: dict[str, Any] | None = None,
              load_skipped: str | None = None) -> dict[str, Any]:
    """The issue's contract keys (null where a part did not run, with the reason)."""
    real_worlds = [row["world_size"] for row in real_rows]
    fake_worlds = [row["world_size"] for row in fake_rows]
    low, high = (real_rows[0], real_rows[-1]) if real_rows else (None, None)
    w8, w1024, w256 = _row(fake_rows, 8), _row(fake_rows, 1024), _row(fake_rows, 256)
    largest = fake_rows[-1] if fake_rows else None
    summary: dict[str, Any] = {
        # each real-rank ratio is that of the rows' figures, the medians over the rounds;
        # per_round: the same ratio round by round (min, max), never to be taken for it
        "restore_cpu_per_rank_w32_vs_w2": REAL_RATIOS["restore_cpu_per_rank_w32_vs_w2"](
            high, low),
        "restore_cpu_per_rank_w32_vs_w2_worlds": [real_worlds[0], real_worlds[-1]]
        if real_worlds else None,
        "dcp_restore_cpu_per_rank_w32_vs_w2": REAL_RATIOS[
            "dcp_restore_cpu_per_rank_w32_vs_w2"](high, low),
        "rounds": None if high is None else len(high.get("rounds") or []) or None,
        "per_round": per_round(high, low),
        "restore_cpu_per_rank_w1024_vs_w8": None if w8 is None or w1024 is None else _ratio(
            w1024["restore_cpu_per_rank_s"], w8["restore_cpu_per_rank_s"]),
        "restore_cpu_per_rank_w1024_vs_w8_reason": None if w1024 is not None else (
            f"the simulation reached W = {max(fake_worlds, default=0)}, not 1,024 (see "
            "restore_cpu_per_rank_wmax_vs_w8)"),
        "restore_cpu_per_rank_wmax_vs_w8": None if w8 is None or largest is None else _ratio(
            largest["restore_cpu_per_rank_s"], w8["restore_cpu_per_rank_s"]),
        "dcp_restore_cpu_per_rank_wmax_vs_w8": None if w8 is None or largest is None
        else _ratio(largest["dcp_restore_cpu_per_rank_s"], w8["dcp_restore_cpu_per_rank_s"]),
        "restore_cpu_per_rank_before_wmax_vs_w8": None if w8 is None or largest is None
        else _ratio(largest["restore_cpu_per_rank_before_s"],
                    w8["restore_cpu_per_rank_before_s"]),
        "wmax": None if largest is None else largest["world_size"],
        "restore_cpu_per_rank_whole_w1024_vs_w8": _key_ratio(
            w1024, w8, "restore_cpu_per_rank_whole_s"),
        "restore_cpu_per_rank_w1024_vs_dcp": _ratio(
            None if w1024 is None else w1024["restore_cpu_per_rank_s"],
            None if w1024 is None else w1024["dcp_restore_cpu_per_rank_s"]),
        "metadata_bytes_received_per_rank_w1024_vs_w8": _key_ratio(
            w1024, w8, "metadata_bytes_received_per_rank"),
        "restore_leader_cpu_w1024_s": None if w1024 is None or "restore_leader_prepare_cpu_s"
        not in w1024 else w1024["restore_leader_prepare_cpu_s"]
        + w1024["restore_leader_cpu_per_request_s"] * (w1024["world_size"] - 1),
        "restore_cpu_per_rank_before_w1024_vs_w8": None if w8 is None or w1024 is None
        else _ratio(w1024["restore_cpu_per_rank_before_s"],
                    w8["restore_cpu_per_rank_before_s"]),
        "dcp_restore_cpu_per_rank_w1024_vs_w8": None if w8 is None or w1024 is None
        else _ratio(w1024["dcp_restore_cpu_per_rank_s"], w8["dcp_restore_cpu_per_rank_s"]),
        "metadata_bytes_vs_dcp_w256": None if w256 is None else _ratio(
            w256["metadata_bytes"], w256["dcp_metadata_bytes"]),
        "files_per_checkpoint_w32": None if high is None else high["files_per_checkpoint"],
        "files_per_checkpoint_w32_world": None if high is None else high["world_size"],
        # rank 0's steady-state save (a run's later saves, plans remembered) over DCP's
        # at its best (its plan caching or its default planner, whichever cost less), the
        # medians over the rounds; a run's first save apart (both sides plan in full)
        "save_cpu_rank0_w32_vs_dcp": REAL_RATIOS["save_cpu_rank0_w32_vs_dcp"](high, low),
        "save_cpu_rank0_w32_vs_dcp_reason": None if high is None
        or high.get("save_cpu_rank0_steady_s") is not None else (
            "no later save timed (--repeats 1, or rows of a run before a run's first and "
            "later saves were timed apart)"),
        "save_cpu_rank0_first_w32_vs_dcp": REAL_RATIOS["save_cpu_rank0_first_w32_vs_dcp"](
            high, low),
        "save_cpu_rank0_all_saves_w32_vs_dcp_default": _all_saves(high),
        "save_cpu_rank0_w256_vs_dcp_simulated": None if w256 is None else _ratio(
            w256["save_cpu_rank0_s"], w256["dcp_save_cpu_rank0_s"]),
        # the same as save_cpu_rank0_first_w32_vs_dcp and save_cpu_rank0_w32_vs_dcp
        # (kept: earlier outputs carry them)
        "save_cpu_rank0_w32_vs_dcp_first": _steady(high, "first"),
        "save_cpu_rank0_w32_vs_dcp_steady": _steady(high, "steady"),
        "save_cpu_rank0_w256_vs_dcp_simulated_steady": _steady(w256, "steady"),
        "save_cpu_rank0_w32_vs_dcp_simulated_steady": _steady(_row(fake_rows, 32), "steady"),
        **cpu_load.summary(load, load_skipped),
        "save_cpu_s_per_gb": None if save is None else save["save_cpu_s_per_gb"],
        "save_cpu_vs_hash_once": None if save is None else save["save_cpu_vs_hash_once"],
    }
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", default=",".join(map(str, REAL_WORLDS)))
    parser.add_argument("--fake", default=",".join(map(str, FAKE_WORLDS)))
    parser.add_argument("--save-mb", type=int, default=256)
    parser.add_argument("--load-mb", type=int, default=1024,
                        help="the bytes of the save under CPU load (0: not run)")
    parser.add_argument("--load-repeats", type=int, default=5,
                        help="saves and plain writes per phase (quiet, loaded)")
    parser.add_argument("--load-bursts", type=int, default=3,
                        help="quiet and loaded phases, alternated, each loaded one beside "
                             "a load burst of its own; the key is the bursts' median ratio")
    parser.add_argument("--load-workers", type=int, default=cpu_load.LOAD_WORKERS)
    parser.add_argument("--repeats", type=int, default=3,
                        help="saves and restores per side in a real-rank round (the first "
                             "save apart, the median of the later ones: at least 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="real-rank rounds: each runs every W, resumekit and DCP side by "
                             "side, which goes first alternating; rows keep the medians")
    parser.add_argument("--config", default="furniture_all_e128")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--before-max", type=int, default=1024,
                        help="the largest simulated W whose restore before issue 40 is run")
    parser.add_argument("--save-timed-max", type=int, default=512,
                        help="the largest simulated W whose rank-0 save is timed (above it "
                             "DCP's validation of the global plan, O(W^2) per tensor, is "
                             "skipped: restore figures only)")
    parser.add_argument("--others-max", type=int, default=1024,
                        help="the largest simulated W whose DCP side and resumekit's earlier "
                             "restores run (above it: resumekit's restore only)")
    parser.add_argument("--steady-max", type=int, default=256,
                        help="the largest simulated W whose rank-0 save of a run's later "
                             "saves (plans remembered; DCP with its plan caching) is timed")
    parser.add_argument("--rows-to", default=None,
                        help="append each simulated row to this file as it is done")
    parser.add_argument("--parts", nargs="*", default=[],
                        help="earlier outputs whose rows to take (the parts run apart): "
                             "PATH (every part) or PATH:real,save_cpu_per_gb (those parts "
                             "only), or a .jsonl of simulated rows; each row keeps the "
                             "date and commit it was measured at (see 'provenance')")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.real.split(",") if w]
    fake_worlds = [int(w) for w in args.fake.split(",") if w]
    started = time.perf_counter()
    save = save_cpu_per_gb(args.save_mb) if args.save_mb > 0 else None
    load = None if args.load_mb <= 0 else cpu_load.measure(
        args.load_mb, args.load_repeats, workers=args.load_workers,
        stress_ng=cpu_load.which_stress_ng(), directory=os.environ.get("BENCH_WORLD_DIR"),
        stamp=world_fake.measured_stamp(), bursts=args.load_bursts)
    real_rows = real(worlds, args.repeats, args.rounds) if worlds else []
    fake_rows = world_fake.run(fake_worlds, config=args.config,
                               rows_to=Path(args.rows_to) if args.rows_to else None,
                               before_max=args.before_max,
                               save_timed_max=args.save_timed_max,
                               others_max=args.others_max,
                               steady_max=args.steady_max)
    for part in args.parts:  # e.g. the real ranks and the simulation run side by side
        path, _, wanted = part.partition(":")
        if path.endswith(".jsonl"):  # rows of a simulation stopped before its end
            fake_rows += [_stamped(json.loads(line), path)
                          for line in Path(path).read_text().splitlines()]
            continue
        earlier = json.loads(Path(path).read_text())
        taken = set(wanted.split(",")) if wanted else set(PARTS)
        if unknown := taken - set(PARTS):
            parser.error(f"--parts {part}: no part {sorted(unknown)} (parts: {PARTS})")
        if "real" in taken:
            real_rows += [_stamped(row, path) for row in earlier["real"]]
        if "simulated" in taken:
            fake_rows += [_stamped(row, path) for row in earlier["simulated"]]
        if "save_cpu_per_gb" in taken and save is None and earlier["save_cpu_per_gb"]:
            save = _stamped(earlier["save_cpu_per_gb"], path)
        if ("save_under_cpu_load" in taken and load is None
                and earlier.get("save_under_cpu_load")):
            load = _stamped(earlier["save_under_cpu_load"], path)
    real_rows.sort(key=lambda row: row["world_size"])
    fake_rows.sort(key=lambda row: row["world_size"])
    for name, rows in (("real", real_rows), ("simulated", fake_rows)):
        worlds = [row["world_size"] for row in rows]
        if len(worlds) != len(set(worlds)):  # two runs' figures for one W: never mixed
            parser.error(f"two {name} rows for one world size ({sorted(worlds)}): take "
                         "each part from one run (--parts PATH:real,save_cpu_per_gb)")
    result = {
        "summary": summarize(real_rows, fake_rows, save, load,
                             None if load else "not run (--load-mb 0)"),
        "provenance": provenance(real_rows, fake_rows, save, load),
        "real": real_rows,
        "simulated": fake_rows,
        "save_cpu_per_gb": save,
        "save_under_cpu_load": load,
        "setup": {"real_model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}), FSDP2, AdamW",
                  "simulated_model": f"LingBot-VA {args.config} (meta device), FSDP2 "
                                     "dim-0 shards, AdamW",
                  "torch": torch.__version__, "python": platform.python_version(),
                  "cpus": os.cpu_count(), "seconds": time.perf_counter() - started},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_plot:
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    """Per-rank restore CPU, rank 0's save CPU and ``.metadata`` bytes against W."""
    import matplotlib  # noqa: PLC0415 - the bench extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    def series(rows: list[dict[str, Any]], key: str, scale: float = 1.0
               ) -> tuple[list[int], list[float]]:
        kept = [row for row in rows if row.get(key) is not None]  # a part not run: a gap
        return [row["world_size"] for row in kept], [row[key] / scale for row in kept]

    for rows, style, label in ((result["real"], "o-", "real gloo"),
                               (result["simulated"], "s--", "simulated 5B")):
        if not rows:
            continue
        axes[0].plot(*series(rows, "restore_cpu_per_rank_s"), style,
                     label=f"resumekit ({label})")
        axes[0].plot(*series(rows, "dcp_restore_cpu_per_rank_s"), style,
                     label=f"DCP ({label})", alpha=0.6)
        if "restore_cpu_per_rank_before_s" in rows[0]:
            axes[0].plot(*series(rows, "restore_cpu_per_rank_before_s"), ":",
                         label=f"resumekit before #40 ({label})")
        if "restore_cpu_per_rank_whole_s" in rows[0]:
            axes[0].plot(*series(rows, "restore_cpu_per_rank_whole_s"), "-.",
                         label=f"resumekit, whole .metadata shared ({label})")
        axes[1].plot(*series(rows, "save_cpu_rank0_s"), style, label=f"resumekit ({label})")
        axes[1].plot(*series(rows, "dcp_save_cpu_rank0_s"), style, label=f"DCP ({label})",
                     alpha=0.6)
        axes[2].plot(*series(rows, "metadata_bytes", 1e6), style, label=f"resumekit ({label})")
        axes[2].plot(*series(rows, "dcp_metadata_bytes", 1e6), style, label=f"DCP ({label})",
                     alpha=0.6)
    titles = ("a restoring rank's CPU (s)", "rank 0's save CPU (s)", ".metadata (MB)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("world size W")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
