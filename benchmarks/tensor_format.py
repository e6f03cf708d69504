"""``python -m benchmarks.tensor_format``: the cost of ``tensor_format="dcp"`` against raw.

The same model + AdamW state is saved and restored (verified, as ``restore()`` does by
default) by two managers that differ only in ``tensor_format``, interleaved round by
round (A B, B A, ...). Restores are timed warm (files in the page cache: a restore right
after a save, or from a NAS client cache) and cold (this process's files evicted first).
Writes ``benchmarks/results/tensor_format.json`` (every sample, per-round ratios, machine
facts) and prints a markdown table of ``dcp / raw`` ratios: median and the range over
rounds. See ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import clock, evict, interleave, machine_facts, paired_ratios, remove
from benchmarks.timing import median as median_of
from benchmarks.workload import build_model, build_optimizer, shape_for, tensor_bytes, train_step
from resumekit.manager import CheckpointManager
from resumekit.store.retention import keep_all

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MB = 1_000_000
FORMATS = ("raw", "dcp")
#: (figure, method of the numerator, method of the denominator)
FIGURES = (
    ("save", "save_dcp", "save_raw"),
    ("restore_warm", "restore_warm_dcp", "restore_warm_raw"),
    ("restore_cold", "restore_cold_dcp", "restore_cold_raw"),
)

_STARTED = time.monotonic()


def _log(message: str) -> None:
    print(f"[tensor_format {time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr,
          flush=True)


def measure(state_mb: float, rounds: int, work: Path) -> dict[str, Any]:
    """Interleaved saves and verified restores of both formats; every sample."""
    shape = shape_for(int(state_mb * MB))
    model = build_model(shape)
    optimizer = build_optimizer(model)
    train_step(model, optimizer)  # AdamW state exists from here on
    state_bytes = tensor_bytes(model, optimizer)
    _log(f"state: {state_bytes / 1e9:.3f} GB ({shape.layers} x Linear({shape.width}) + AdamW)")
    step = [0]
    methods: dict[str, Callable[[], float]] = {}
    restores: dict[str, CheckpointManager] = {}
    for name in FORMATS:
        root = work / f"save-{name}"
        saver = CheckpointManager(root, model=model, optimizer=optimizer,
                                  retention=keep_all(), tensor_format=name)  # type: ignore[arg-type]

        def save(saver: CheckpointManager = saver, root: Path = root) -> float:
            step[0] += 1
            try:
                return clock(lambda: saver.save(step[0]))
            finally:  # each save pays for exactly one checkpoint, deleted off the clock
                remove(root / saver.name_format.build(step[0]))

        methods[f"save_{name}"] = save
        restore_root = work / f"restore-{name}"
        CheckpointManager(restore_root, model=model, optimizer=optimizer,
                          tensor_format=name).save(1)  # type: ignore[arg-type]
        restores[name] = CheckpointManager(restore_root, model=model, optimizer=optimizer)
    for name, manager in restores.items():
        def warm(manager: CheckpointManager = manager) -> float:
            manager.restore()  # every byte in the page cache
            return clock(manager.restore)

        def cold(manager: CheckpointManager = manager, name: str = name) -> float:
            evict(work / f"restore-{name}")
            return clock(manager.restore)

        methods[f"restore_warm_{name}"] = warm
        methods[f"restore_cold_{name}"] = cold
    order = [method for _, *pair in FIGURES for method in reversed(pair)]  # raw, dcp, ...
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = interleave({name: methods[name] for name in order}, rounds, progress=_log)
    figures: dict[str, Any] = {}
    for figure, numerator, denominator in FIGURES:
        ratios = paired_ratios(samples[numerator], samples[denominator])
        figures[figure] = {
            "ratio_median": median_of(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratios": ratios,
            "raw_median_s": median_of(samples[denominator]),
            "dcp_median_s": median_of(samples[numerator]),
        }
    sizes = {name: sum(p.stat().st_size for p in (work / f"restore-{name}").rglob("*")
                       if p.is_file()) for name in FORMATS}
    return {"state_bytes": state_bytes, "checkpoint_bytes": sizes,
            "shape": {"layers": shape.layers, "width": shape.width},
            "samples": samples, "figures": figures}


def markdown(results: dict[str, Any]) -> str:
    """A table of the ``dcp / raw`` ratios, with the seconds behind them."""
    state_gb = results["measured"]["state_bytes"] / 1e9
    lines = [
        f"tensor_format='dcp' vs 'raw': {state_gb:.2f} GB of model + AdamW state, "
        f"{results['config']['rounds']} interleaved rounds",
        "",
        "| figure | dcp / raw (median) | range over rounds | raw median s | dcp median s |",
        "|---|---|---|---|---|",
    ]
    for figure, row in results["measured"]["figures"].items():
        lines.append(f"| {figure} | {row['ratio_median']:.2f} | {row['ratio_min']:.2f}-"
                     f"{row['ratio_max']:.2f} | {row['raw_median_s']:.3f} | "
                     f"{row['dcp_median_s']:.3f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_format",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mb", type=float, default=400,
                        help="model + AdamW state (MB)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--bench-dir", default=os.environ.get("RESUMEKIT_BENCH_DIR"),
                        help="where files are written (default: the temp directory)")
    parser.add_argument("--out", default=str(RESULTS_DIR),
                        help="directory for tensor_format.json")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison; write the JSON; print the table; return the results."""
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = args.bench_dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="resumekit-tensor-format-", dir=base))
    results: dict[str, Any] = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["python", "-m", "benchmarks.tensor_format", *(argv or sys.argv[1:])],
        "machine": machine_facts(work),
        "config": {"state_mb": args.state_mb, "rounds": args.rounds},
    }
    try:
        results["measured"] = measure(args.state_mb, args.rounds, work)
    finally:
        remove(work)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    results["machine"]["bench_dir_removed"] = not work.exists()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_format.json").write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
