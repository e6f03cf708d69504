"""Recovery time from the local tier vs from the durable root on a NAS, in one job.

Issue 30's figure the drills cannot give (their durable root is a local disk and their
state 2.7 MB): one ``torchrun --standalone --max-restarts=2`` job of 2 gloo ranks
(:mod:`benchmarks.tier_recovery_worker`: the bench model, FSDP2, AdamW) with its durable
root on the NAS stand-in of :mod:`benchmarks.nas` (bounded bandwidth, shared by every
reader and writer) and its local tier on ``--local`` (``/dev/shm`` by default; a local
save every step). Rank 1 SIGKILLs itself twice: the first in-job restart restores from the
local tier; before the second the local tier is lost (deleted) and the durable root's pages
dropped from the page cache, so that restart reads the durable root at the stand-in's
bandwidth. Reported per recovery: seconds ``restore()`` took, and from the kill to the
restore done and to the first step trained after it; the durable/local ratios of both.

    python -m benchmarks.tier_recovery --state-mb 768 --bandwidth-mbs 100
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import nas
from benchmarks.scale import GB, MB, RANKS, REPO_ROOT, RESULTS_DIR
from benchmarks.timing import machine_facts, remove
from benchmarks.workload import shape_for
from examples.lingbot.drill import kill_tree

LAYERS = 16


def _events(path: Path) -> list[dict[str, Any]]:
    """Every rank's events, each with its ``rank``, in time order."""
    found = []
    for rank in range(RANKS):
        file = Path(str(path) + ("" if rank == 0 else f".rank{rank}"))
        if file.exists():
            found += [{**json.loads(line), "rank": rank}
                      for line in file.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda event: event["t"])


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fault's recovery: the tier read, restore seconds, kill to restored / first step."""
    found = []
    for fault in (e for e in events if e["kind"] == "fault"):
        after = [e for e in events if e["t"] > fault["t"]]
        restored = [e for e in after if e["kind"] == "restored"][:RANKS]
        if len(restored) < RANKS:
            continue
        attempt = restored[0]["attempt"]
        first = next(e for e in after if e["kind"] == "step" and e["attempt"] == attempt)
        done = max(e["t"] for e in restored)
        found.append({
            "fault": "local tier lost, then rank 1 SIGKILLed" if fault["lose_local"]
            else "rank 1 SIGKILLed",
            "tiers": sorted({str(e["tier"]) for e in restored}),
            "restored_step": restored[0]["step"],
            "restore_s": max(e["seconds"] for e in restored),
            "kill_to_restored_s": done - fault["t"],
            "kill_to_first_step_s": first["t"] - fault["t"],
        })
    return found


def run(args: argparse.Namespace, work: Path, durable_parent: Path) -> dict[str, Any]:
    """One job; its recoveries."""
    shape = shape_for(int(args.state_mb * MB) * RANKS, layers=LAYERS)
    durable = durable_parent / "durable"
    local = Path(tempfile.mkdtemp(prefix="resumekit-recovery-", dir=args.local))
    events = work / "events.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANKS}", "--max-restarts=2", "--monitor-interval=0.1",
               "-m", "benchmarks.tier_recovery_worker", "--durable", str(durable),
               "--local-root", str(local), "--events", str(events),
               "--layers", str(shape.layers), "--width", str(shape.width),
               "--steps", str(args.steps), "--durable-every", str(args.durable_every),
               "--crash-local", str(args.crash_local),
               "--crash-durable", str(args.crash_durable)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    log = work / "job.log"
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            try:
                code = process.wait(timeout=args.timeout_s)
            except BaseException:
                kill_tree(process.pid)
                process.wait()
                raise
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"the job exited {code}; its log:\n"
                           + log.read_text(errors="replace")[-4000:])
    found = _events(events)
    state = next(e["state_bytes"] for e in found if e["kind"] == "step")
    return {"shape": {"layers": shape.layers, "width": shape.width},
            "state_bytes_per_rank": state, "recoveries": recoveries(found)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the job (on the stand-in unless ``--no-stand-in``); write and return results."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tier_recovery",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--state-mb", type=float, default=768.0,
                        help="training state per rank (model + AdamW), MB")
    parser.add_argument("--bandwidth-mbs", type=float, default=100.0,
                        help="the NAS stand-in's bandwidth, shared by all, MB/s")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--durable-every", type=int, default=4)
    parser.add_argument("--crash-local", type=int, default=6)
    parser.add_argument("--crash-durable", type=int, default=10)
    parser.add_argument("--local", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--bench-dir", type=Path, default=None)
    parser.add_argument("--no-stand-in", action="store_true",
                        help="durable root in a plain directory (no bandwidth bound)")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "tier_recovery.json")
    args = parser.parse_args(argv)
    bench_dir = Path(tempfile.mkdtemp(prefix="resumekit-recovery-", dir=args.bench_dir))
    facts = machine_facts(bench_dir)
    began = time.monotonic()
    config: dict[str, Any] = {key: getattr(args, key) for key in (
        "state_mb", "steps", "durable_every", "crash_local", "crash_durable")}
    config.update(ranks=RANKS, local=str(args.local), local_every=1, local_keep=2)
    try:
        if args.no_stand_in:
            config["durable"] = "a plain directory (--no-stand-in)"
            result = run(args, bench_dir, bench_dir)
        else:
            bandwidth = args.bandwidth_mbs * MB
            size = int(args.state_mb * MB * RANKS * 4) + GB
            with nas.NasStandIn(bench_dir, size, bandwidth) as stand_in:
                config["durable"] = {"bandwidth": bandwidth,
                                     "kind": f"NAS stand-in (cgroup {stand_in.kind})",
                                     "measured": stand_in.verify(min(256 * MB, size // 8))}
                result = run(args, bench_dir, stand_in.mount)
    finally:
        remove(bench_dir)
    by_tier = {r["tiers"][0]: r for r in result["recoveries"] if len(r["tiers"]) == 1}
    summary = {}
    if {"local", "durable"} <= by_tier.keys():
        for figure in ("restore_s", "kill_to_first_step_s"):
            summary[f"durable_vs_local_{figure}"] = (by_tier["durable"][figure]
                                                    / by_tier["local"][figure])
    results = {"summary": summary, **result, "config": config,
               "machine": {**facts, "load_average_at_end": list(os.getloadavg())},
               "seconds": time.monotonic() - began,
               "when": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"summary": summary, "recoveries": result["recoveries"]}, indent=2))
    return results


if __name__ == "__main__":
    main()
