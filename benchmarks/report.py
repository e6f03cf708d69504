"""From samples to the summary ratios, the markdown table and the throughput plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import median, paired_ratios

#: Summary key -> (direction, target, what it compares). ">=": higher is better. A target
#: of None marks a figure reported beside another for continuity, with no goal of its own
#: (shown as "informational", never as a miss).
TARGETS: dict[str, dict[str, Any]] = {
    "save_vs_raw_write": {"better": "higher", "target": 0.95,
                          "what": "sync save throughput / raw write+fsync, one stream"},
    "save_vs_torch_save": {"better": "higher", "target": 1.2,
                           "what": "sync save throughput / torch.save + fsync"},
    "save_vs_dcp_save": {"better": "higher", "target": 1.0,
                         "what": "sync save throughput / plain dcp.save (best thread count)"},
    "save_vs_accelerate": {"better": "higher", "target": 1.0,
                           "what": "sync save throughput / Accelerator.save_state + fsync"},
    "save_vs_lightning": {"better": "higher", "target": 1.0,
                          "what": "sync save throughput / Fabric.save + fsync"},
    "async_block_vs_memcpy": {"better": "lower", "target": 2.0,
                              "what": "time an async save blocks / memcpy of the state"},
    "async_total_vs_sync": {"better": "lower", "target": 1.3,
                            "what": "async save, call to committed / sync save"},
    "overlap_step_slowdown": {"better": "lower", "target": 1.15,
                              "what": "train step during an async save / step alone"},
    "load_vs_raw_read": {"better": "higher", "target": 0.9,
                         "what": "restore throughput / raw read, one stream (cold cache)"},
    "reshard_load_vs_load": {"better": "lower", "target": 1.2,
                             "what": "worse of 2->1 / 1->1 and 1->2 / 2->2 restore time"},
    "poll_overhead_frac": {"better": "lower", "target": 0.01,
                           "what": "PreemptionHandler.agreed on 2 gloo ranks / 10 ms step"},
    "rss_growth_frac_20_async_saves": {"better": "lower", "target": 0.01,
                                       "what": "RSS growth over 20 async saves / RSS after 1st"},
    "save_requests_at_1000_vs_10": {"better": "lower", "target": 1.1,
                                    "what": "storage ops per save, 1000 / 10 checkpoints "
                                            "in the root (local disk)"},
    "latest_seconds_at_1000_vs_10": {"better": "lower", "target": 1.1,
                                     "what": "latest() time, 1000 / 10 checkpoints in the "
                                             "root (local disk)"},
    "s3_save_requests_at_1000_vs_10": {"better": "lower", "target": 1.1,
                                       "what": "HTTP requests per save, 1000 / 10 "
                                               "checkpoints (loopback S3)"},
    "s3_latest_seconds_at_1000_vs_10": {"better": "lower", "target": 1.1,
                                        "what": "latest() time, 1000 / 10 checkpoints "
                                                "(loopback S3)"},
    "per_tensor_save_vs_dcp": {"better": "lower", "target": 0.1,
                               "what": "fixed save cost per tensor (10k small tensors, "
                                       "beyond a raw write of their bytes) / plain dcp.save's"},
    "per_tensor_restore_vs_dcp": {"better": "lower", "target": 0.1,
                                  "what": "fixed restore cost per tensor (beyond a raw read) "
                                          "/ plain dcp.load's"},
    "save_vs_disk_best": {"better": "higher", "target": 0.9,
                          "what": "sync save throughput / fio direct 4M writes, best of 1 "
                                  "and 4 jobs"},
    "load_vs_disk_best": {"better": "higher", "target": 0.9,
                          "what": "cold restore throughput, a fresh process each (as after a "
                                  "preemption) / fio direct 4M reads, best of 1 and 4 jobs"},
    "load_vs_disk_best_in_process": {"better": "higher", "target": None,
                                     "what": "the same, restoring again and again in the "
                                             "long-lived bench process (informational)"},
    "first_async_block_vs_memcpy": {"better": "lower", "target": 2.0,
                                    "what": "time the first async save of a new manager "
                                            "blocks / memcpy of the state"},
    "peak_rss_sync_vs_state": {"better": "lower", "target": 0.25,
                               "what": "peak RSS above the RSS before a sync save / state"},
    "peak_rss_async_vs_state": {"better": "lower", "target": 1.25,
                                "what": "peak RSS above the RSS before an async manager is "
                                        "built, through its first save / state"},
    "goodput_under_preemption": {"better": "higher", "target": 0.95,
                                 "what": "useful step time / wall time, LingBot tiny, 5 "
                                         "SIGTERMs + 1 SIGKILL in 600 steps (worse of sync, "
                                         "async)"},
}

_PEERS = {"save_vs_torch_save": "torch_save", "save_vs_accelerate": "accelerate",
          "save_vs_lightning": "lightning"}


def _samples(details: Mapping[str, Any], part: str) -> dict[str, list[float]] | None:
    section = details.get(part)
    return None if section is None else dict(section["samples"])


def _ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    return median(paired_ratios(numerator, denominator))


def _best_of(samples: Mapping[str, list[float]], names: Sequence[str]) -> list[float] | None:
    """Per round, the fastest of ``names`` (None when any is missing)."""
    if not all(name in samples for name in names):
        return None
    return [min(values) for values in zip(*(samples[name] for name in names), strict=True)]


def dcp_best(saves: Mapping[str, list[float]]) -> str:
    """The DCP variant with the lowest median save time."""
    variants = [name for name in saves if name.startswith("dcp_")]
    return min(variants, key=lambda name: median(saves[name]))


def ratio_details(details: Mapping[str, Any], state_bytes: int) -> dict[str, Any]:
    """Every per-round ratio behind the summary, and a few more that explain it."""
    out: dict[str, Any] = {}
    saves = _samples(details, "saves")
    if saves is not None:
        sync = saves["resumekit"]
        out["save_gbps_median"] = {
            name: state_bytes / median(values) / 1e9
            for name, values in saves.items()
            if name not in ("memcpy", "resumekit_async", "resumekit_async_blocked")
        }
        out["save_gbps_median"]["resumekit_async_total"] = \
            state_bytes / median(saves["resumekit_async"]) / 1e9
        out["memcpy_gbps_median"] = state_bytes / median(saves["memcpy"]) / 1e9
        out["resumekit_throughput_over"] = {
            name: paired_ratios(values, sync) for name, values in saves.items()
            if name not in ("resumekit", "memcpy", "resumekit_async",
                            "resumekit_async_blocked")}
        if "dcp_default" in saves:
            best = dcp_best(saves)
            out["dcp"] = {"default_threads": 1, "best": best,
                          "save_vs_dcp_default": _ratio(saves["dcp_default"], sync),
                          "save_vs_dcp_best": _ratio(saves[best], sync)}
        out["async_block_vs_memcpy"] = paired_ratios(saves["resumekit_async_blocked"],
                                                     saves["memcpy"])
        out["async_total_vs_sync"] = paired_ratios(saves["resumekit_async"], sync)
    overlap = _samples(details, "overlap")
    if overlap is not None:
        out["overlap_step_slowdown"] = paired_ratios(overlap["step_during_async_save"],
                                                     overlap["step_alone"])
    loads = _samples(details, "loads")
    if loads is not None:
        out["load_gbps_median"] = {name: state_bytes / median(values) / 1e9
                                   for name, values in loads.items()}
        out["load_vs_raw_read_cold"] = paired_ratios(loads["raw_read_cold"],
                                                     loads["restore_cold"])
        out["load_vs_raw_read_cold_no_verify"] = paired_ratios(
            loads["raw_read_cold"], loads["restore_cold_no_verify"])
        out["load_vs_raw_read_warm"] = paired_ratios(loads["raw_read_warm"],
                                                     loads["restore_warm"])
    if saves is not None:
        best = _best_of(saves, ["fio_write_1", "fio_write_4"])
        if best is not None:
            out["save_vs_disk_best"] = paired_ratios(best, saves["resumekit"])
            out["disk_best_write_gbps_median"] = state_bytes / median(best) / 1e9
    if loads is not None:
        best = _best_of(loads, ["fio_read_1", "fio_read_4"])
        if best is not None:
            if "restore_cold_fresh_process" in loads:
                out["load_vs_disk_best"] = paired_ratios(best,
                                                         loads["restore_cold_fresh_process"])
            out["load_vs_disk_best_in_process"] = paired_ratios(best, loads["restore_cold"])
            out["disk_best_read_gbps_median"] = state_bytes / median(best) / 1e9
    per_tensor = details.get("per_tensor")
    if per_tensor is not None:
        from benchmarks.per_tensor import fixed_costs  # noqa: PLC0415 - no torch at import

        costs = fixed_costs(per_tensor)
        out["per_tensor"] = {**costs, **{f"{key}_median": median(values)
                                          for key, values in costs.items()
                                          if isinstance(values, list)},
                             "count": per_tensor["count"],
                             "checkpoint_bytes": per_tensor["checkpoint_bytes"]}
    first = _samples(details, "first_async")
    if first is not None:
        out["first_async_block_vs_memcpy"] = paired_ratios(first["first_async_blocked"],
                                                           first["memcpy"])
        out["first_async_block_lazy_vs_memcpy"] = paired_ratios(
            first["first_async_blocked_lazy"], first["memcpy"])
    rss = details.get("rss")
    if rss is not None and "peak_rss_sync_extra" in rss:
        out["peak_rss_sync_vs_state"] = [b / state_bytes for b in rss["peak_rss_sync_extra"]]
        out["peak_rss_async_vs_state"] = [b / state_bytes for b in rss["peak_rss_async_extra"]]
    goodput = details.get("goodput")
    if goodput is not None:
        out["goodput"] = {mode: {key: value for key, value in run.items()
                                 if key not in ("segments", "schedule")}
                          for mode, run in goodput.items()}
    ranks = _samples(details, "ranks")
    if ranks is not None:
        out["reshard_2_to_1_vs_1_to_1"] = paired_ratios(ranks["load_2_to_1"],
                                                        ranks["load_1_to_1"])
        out["reshard_1_to_2_vs_2_to_2"] = paired_ratios(ranks["load_1_to_2"],
                                                        ranks["load_2_to_2"])
        poll = details["ranks"]["poll"]
        out["poll_overhead_frac"] = poll["per_round"]
        out["poll_vote_us"] = poll["vote_us_per_round"]
        if "every_step_vote_us_per_round" in poll:
            out["poll_every_step_vote_us"] = poll["every_step_vote_us_per_round"]
        out["poll_bare_all_reduce_us"] = poll["bare_all_reduce_us_per_round"]
        out["poll_block_overhead"] = poll["block_overhead_per_round"]
    return out


def summarise(details: Mapping[str, Any], state_bytes: int) -> dict[str, float | None]:
    """The summary: one median ratio per key of :data:`TARGETS` (None if not measured)."""
    summary: dict[str, float | None] = dict.fromkeys(TARGETS)
    saves = _samples(details, "saves")
    if saves is not None:
        sync = saves["resumekit"]
        summary["save_vs_raw_write"] = _ratio(saves["raw_write"], sync)
        for key, name in _PEERS.items():
            if name in saves:
                summary[key] = _ratio(saves[name], sync)
        if "dcp_default" in saves:
            summary["save_vs_dcp_save"] = _ratio(saves[dcp_best(saves)], sync)
        summary["async_block_vs_memcpy"] = _ratio(saves["resumekit_async_blocked"],
                                                  saves["memcpy"])
        summary["async_total_vs_sync"] = _ratio(saves["resumekit_async"], sync)
    overlap = _samples(details, "overlap")
    if overlap is not None:
        summary["overlap_step_slowdown"] = _ratio(overlap["step_during_async_save"],
                                                  overlap["step_alone"])
    loads = _samples(details, "loads")
    if loads is not None:
        summary["load_vs_raw_read"] = _ratio(loads["raw_read_cold"], loads["restore_cold"])
    ranks = _samples(details, "ranks")
    if ranks is not None:
        summary["reshard_load_vs_load"] = max(
            _ratio(ranks["load_2_to_1"], ranks["load_1_to_1"]),
            _ratio(ranks["load_1_to_2"], ranks["load_2_to_2"]))
        summary["poll_overhead_frac"] = median(details["ranks"]["poll"]["per_round"])
    rss = details.get("rss")
    if rss is not None:
        summary["rss_growth_frac_20_async_saves"] = \
            (rss["rss_after_all"] - rss["rss_after_first"]) / rss["rss_after_first"]
        if "peak_rss_sync_extra" in rss:
            summary["peak_rss_sync_vs_state"] = median(rss["peak_rss_sync_extra"]) / state_bytes
            summary["peak_rss_async_vs_state"] = \
                median(rss["peak_rss_async_extra"]) / state_bytes
    roots = details.get("roots")
    if roots is not None:
        for prefix, where in (("", "local"), ("s3_", "s3")):
            figures = roots.get(where) or {}
            summary[f"{prefix}save_requests_at_1000_vs_10"] = \
                figures.get("save_requests_at_1000_vs_10")
            summary[f"{prefix}latest_seconds_at_1000_vs_10"] = \
                figures.get("latest_seconds_at_1000_vs_10")
    if saves is not None:
        best = _best_of(saves, ["fio_write_1", "fio_write_4"])
        if best is not None:
            summary["save_vs_disk_best"] = _ratio(best, saves["resumekit"])
    if loads is not None:
        best = _best_of(loads, ["fio_read_1", "fio_read_4"])
        if best is not None:
            if "restore_cold_fresh_process" in loads:
                summary["load_vs_disk_best"] = _ratio(best, loads["restore_cold_fresh_process"])
            summary["load_vs_disk_best_in_process"] = _ratio(best, loads["restore_cold"])
    per_tensor = details.get("per_tensor")
    if per_tensor is not None:
        from benchmarks.per_tensor import fixed_costs  # noqa: PLC0415 - no torch at import

        costs = fixed_costs(per_tensor)
        summary["per_tensor_save_vs_dcp"] = (median(costs["save_vs_dcp"])
                                             if costs["save_vs_dcp"] else None)
        summary["per_tensor_restore_vs_dcp"] = (median(costs["restore_vs_dcp"])
                                                if costs["restore_vs_dcp"] else None)
    first = _samples(details, "first_async")
    if first is not None:
        summary["first_async_block_vs_memcpy"] = _ratio(first["first_async_blocked"],
                                                        first["memcpy"])
    goodput = details.get("goodput")
    if goodput:
        values = [run["goodput"] for run in goodput.values()]
        summary["goodput_under_preemption"] = (None if any(v is None for v in values)
                                               else min(values))
    return summary


def meets(key: str, value: float | None) -> bool | None:
    """Whether ``value`` meets the target of ``key`` (None when not measured or no target)."""
    goal = TARGETS[key]
    if value is None or goal["target"] is None:
        return None
    return bool(value >= goal["target"] if goal["better"] == "higher"
                else value <= goal["target"])


def markdown(results: Mapping[str, Any]) -> str:
    """The summary as a markdown table, then the median throughput of each method."""
    summary = results["summary"]
    lines = ["| figure | ratio | target | better | verdict |", "|---|---:|---:|---|---|"]
    for key, goal in TARGETS.items():
        value = summary.get(key)
        verdict = {True: "meets", False: "**misses**", None: "not measured"}[meets(key, value)]
        shown = "n/a" if value is None else f"{value:.3f}"
        sign = ">=" if goal["better"] == "higher" else "<="
        target = f"{sign} {goal['target']}"
        if goal["target"] is None:
            target = "none"
            verdict = "not measured" if value is None else "informational"
        lines.append(f"| `{key}` | {shown} | {target} | {goal['better']} | {verdict} |")
    ratios = results.get("ratios", {})
    if "save_gbps_median" in ratios:
        lines += ["", "| save method | median GB/s |", "|---|---:|"]
        for name, gbps in sorted(ratios["save_gbps_median"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {name} | {gbps:.3f} |")
    if "load_gbps_median" in ratios:
        lines += ["", "| load method | median GB/s |", "|---|---:|"]
        for name, gbps in ratios["load_gbps_median"].items():
            lines.append(f"| {name} | {gbps:.3f} |")
    roots = results.get("details", {}).get("roots") or {}
    measured = [(where, figures) for where, figures in roots.items() if "by_count" in figures]
    if measured:
        lines += ["", "| root | checkpoints | storage ops / save | HTTP requests / save "
                  "| latest() ms | its listing alone, ms | storage ops / latest() "
                  "| storage ops / restore |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for where, figures in measured:
            for count, row in figures["by_count"].items():
                http = row["http_requests_per_save"]
                lines.append(f"| {where} | {count} | {row['storage_ops_per_save']} | "
                             f"{'-' if http is None else http} | "
                             f"{row['latest_seconds'] * 1000:.2f} | "
                             f"{row.get('listing_floor_seconds', 0) * 1000:.2f} | "
                             f"{row['storage_ops_per_latest']} | "
                             f"{row['storage_ops_per_restore']} |")
    for where, figures in roots.items():
        if "skipped" in figures:
            lines.append(f"\nRoot cost on {where}: not measured ({figures['skipped']}).")
    if "per_tensor" in ratios:
        row = ratios["per_tensor"]
        metadata = row["metadata_bytes_per_tensor"]
        lines += ["", f"| per tensor ({row['count']} small tensors) | resumekit | plain DCP |",
                  "|---|---:|---:|",
                  f"| save, fixed us per tensor | {row['save_us_median']:.1f} | "
                  f"{row['dcp_save_us_median']:.1f} |",
                  f"| restore, fixed us per tensor | {row['restore_us_median']:.1f} | "
                  f"{row['dcp_load_us_median']:.1f} |",
                  f"| .metadata bytes per tensor | {metadata['resumekit']:.1f} | "
                  f"{metadata['dcp']:.1f} |"]
    if "goodput" in ratios:
        lines += ["", "| goodput run | goodput | useful s | replayed s (steps) | restore s | "
                  "blocked by saves s | other s | total s |", "|---|---:|---:|---:|---:|---:|"
                  "---:|---:|"]
        for mode, row in ratios["goodput"].items():
            lines.append(f"| {mode} | {row['goodput']:.3f} | {row['useful_s']:.1f} | "
                         f"{row['replayed_s']:.1f} ({row['replayed_steps']}) | "
                         f"{row['restore_s']:.1f} | {row['blocked_by_saves_s']:.1f} | "
                         f"{row['other_s']:.1f} | {row['total_s']:.1f} |")
    notes = {**results.get("details", {}).get("saves", {}).get("notes", {})}
    if "fio" in notes:
        lines += ["", f"Disk figures skipped: {notes['fio']}."]
    config = results["config"]
    machine = results["machine"]
    lines += ["", f"{config['rounds']} interleaved rounds; state "
              f"{config.get('shape', {}).get('state_bytes', 0) / 1e9:.2f} GB; "
              f"{machine['logical_cores']} cores; torch {machine['torch']}; load average "
              f"{machine['load_average_at_start'][0]:.1f} at start, "
              f"{machine['load_average_at_end'][0]:.1f} at end."]
    if config["rounds"] < 5:
        lines.append("Fewer than 5 rounds: a smoke run, not a measurement.")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> bool:
    """Bar charts of save and load throughput per method, with the raw lines.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional (bench extra)
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    ratios = results.get("ratios", {})
    saves: dict[str, float] = dict(ratios.get("save_gbps_median", {}))
    loads: dict[str, float] = dict(ratios.get("load_gbps_median", {}))
    figure, grid = plt.subplots(2, 2, figsize=(12, 9), width_ratios=[3, 2],
                                height_ratios=[1, 1.1])
    axes = grid[0]
    _plot_targets(grid[1][0], results)
    _plot_goodput(grid[1][1], ratios)
    for axis, data, raw, title in (
        (axes[0], saves, "raw_write", "save (model + AdamW, fsync'd)"),
        (axes[1], loads, "raw_read_cold", "restore"),
    ):
        names = [name for name in data if name != raw]
        values = [data[name] for name in names]
        colours = ["tab:green" if name.startswith(("resumekit", "restore")) else "tab:gray"
                   for name in names]
        axis.bar(range(len(names)), values, color=colours)
        axis.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        if raw in data:
            axis.axhline(data[raw], color="tab:red", linestyle="--",
                         label=f"{raw} {data[raw]:.2f} GB/s")
            axis.legend(fontsize=8)
        best = ratios.get("disk_best_write_gbps_median" if raw == "raw_write"
                          else "disk_best_read_gbps_median")
        if best is not None:
            axis.axhline(best, color="tab:blue", linestyle="-.",
                         label=f"disk best (fio) {best:.2f} GB/s")
            axis.legend(fontsize=8)
        if raw == "raw_read_cold" and "raw_read_warm" in data:
            axis.axhline(data["raw_read_warm"], color="tab:orange", linestyle=":",
                         label=f"raw_read_warm {data['raw_read_warm']:.2f} GB/s")
            axis.legend(fontsize=8)
        axis.set_ylabel("GB/s (median of rounds)")
        axis.set_title(title)
    config = results["config"]
    figure.suptitle(f"resumekit benchmarks: {config.get('shape', {}).get('state_bytes', 0)/1e9:.2f}"
                    f" GB state, {config['rounds']} interleaved rounds, "
                    f"{results['machine']['logical_cores']} cores", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _plot_targets(axis: Any, results: Mapping[str, Any]) -> None:
    """Every summary figure as a multiple of its target (>= 1 meets it)."""
    summary = results.get("summary", {})
    names, values, colours = [], [], []
    for key, goal in TARGETS.items():
        value = summary.get(key)
        if value is None or value <= 0 or goal["target"] is None:
            continue
        score = value / goal["target"] if goal["better"] == "higher" else goal["target"] / value
        names.append(key)
        values.append(score)
        colours.append("tab:green" if score >= 1 else "tab:red")
    axis.barh(range(len(names)), values, color=colours)
    axis.set_yticks(range(len(names)), names, fontsize=7)
    axis.invert_yaxis()
    axis.axvline(1.0, color="black", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel("figure / target (higher is better; >= 1 meets)")
    axis.set_title("every figure against its target")


def _plot_goodput(axis: Any, ratios: Mapping[str, Any]) -> None:
    """Where the wall time of the goodput runs went, per mode."""
    runs = ratios.get("goodput", {})
    parts = [("useful_s", "useful steps", "tab:green"), ("replayed_s", "replayed", "tab:red"),
             ("restore_s", "restore", "tab:orange"),
             ("blocked_by_saves_s", "blocked by saves", "tab:purple"),
             ("other_s", "other", "tab:gray")]
    for row, run in enumerate(runs.values()):
        left = 0.0
        for key, label, colour in parts:
            width = max(0.0, float(run[key]))
            axis.barh(row, width, left=left, color=colour, label=label if row == 0 else None)
            left += width
        axis.text(left, row, f" {run['goodput']:.3f}", va="center", fontsize=8)
    axis.set_yticks(range(len(runs)), list(runs), fontsize=8)
    axis.set_xlabel("seconds of wall time (start-up excluded)")
    axis.set_title("goodput under preemption (LingBot tiny)")
    if runs:
        axis.legend(fontsize=7, loc="lower right")
    else:
        axis.text(0.5, 0.5, "not measured", ha="center", va="center",
                  transform=axis.transAxes)
