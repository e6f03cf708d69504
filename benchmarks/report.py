"""From samples to the summary ratios, the markdown table and the throughput plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import median, paired_ratios

#: Summary key -> (direction, target, what it compares). ">=": higher is better.
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
}

_PEERS = {"save_vs_torch_save": "torch_save", "save_vs_accelerate": "accelerate",
          "save_vs_lightning": "lightning"}


def _samples(details: Mapping[str, Any], part: str) -> dict[str, list[float]] | None:
    section = details.get(part)
    return None if section is None else dict(section["samples"])


def _ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    return median(paired_ratios(numerator, denominator))


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
    roots = details.get("roots")
    if roots is not None:
        for prefix, where in (("", "local"), ("s3_", "s3")):
            figures = roots.get(where) or {}
            summary[f"{prefix}save_requests_at_1000_vs_10"] = \
                figures.get("save_requests_at_1000_vs_10")
            summary[f"{prefix}latest_seconds_at_1000_vs_10"] = \
                figures.get("latest_seconds_at_1000_vs_10")
    return summary


def meets(key: str, value: float | None) -> bool | None:
    """Whether ``value`` meets the target of ``key`` (None when not measured)."""
    if value is None:
        return None
    goal = TARGETS[key]
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
        lines.append(f"| `{key}` | {shown} | {sign} {goal['target']} | {goal['better']} "
                     f"| {verdict} |")
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
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[3, 2])
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
