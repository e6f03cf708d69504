"""``resumekit diff``: compare two checkpoints tensor by tensor and value by value.

Compared: every tensor of the sharded state (model and optimizer), consolidated one at a
time from each side (no process group; memory about two copies of the largest tensor);
``train_state.pt`` (step, scheduler); each rank's state file (RNG streams, data
position); the manifest's ``extras``, ``state`` and ``fingerprint``. Not compared: what
differs between any two saves by nature (creation time, lineage, file checksums).
Equality is bitwise by default (NaN equals NaN of the same bits, ``0.0`` differs from
``-0.0``); ``--atol`` accepts floating-point differences up to that size.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

import torch

from resumekit import tensors
from resumekit.cli._common import (
    JSON_SCHEMA_PREFIX,
    add_common_options,
    console,
    emit_json,
    fail,
    flatten,
    plain,
    progress_bar,
    storage_options,
    table,
)
from resumekit.state.train_state import read_plain
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.layout import RANK_STATE_DIR, TRAIN_STATE_FILE
from resumekit.store.targets import CheckpointTarget, open_target, select_committed, tensors_url

__all__ = ["SCHEMA", "add_parser", "compare_tensors", "run"]

SCHEMA = f"{JSON_SCHEMA_PREFIX}.diff/1"
_CHUNK = 1 << 20  # elements compared at a time (bounds the temporaries)


def add_parser(subparsers: Any, summary: str) -> None:
    """Register ``diff`` (``summary``: its line in ``resumekit --help``)."""
    parser = subparsers.add_parser(
        "diff",
        help=summary,
        description="Compare model and optimizer tensors (consolidated one at a time), "
        "train_state.pt, per-rank state and manifest extras of two checkpoints. A root "
        "stands for its newest committed checkpoint (or --step-a/--step-b). Exit 0 when "
        "equal (bitwise unless --atol), 1 with a table of differing keys.",
    )
    parser.add_argument("a", help="first checkpoint (directory or root)")
    parser.add_argument("b", help="second checkpoint (directory or root)")
    parser.add_argument("--step-a", dest="step_a", type=int, default=None,
                        help="step of A when A is a root")
    parser.add_argument("--step-b", dest="step_b", type=int, default=None,
                        help="step of B when B is a root")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance for floating-point values (default: "
                        "bitwise equality)")
    add_common_options(parser, json_help=f"print one JSON document (schema {SCHEMA})")
    parser.set_defaults(run=run)


def _chunks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        yield flat[start:start + _CHUNK]


def compare_tensors(a: torch.Tensor, b: torch.Tensor, atol: float | None) -> dict[str, Any] | None:
    """Compare two tensors; return None when equal, else what differs.

    Args:
        a: First tensor.
        b: Second tensor.
        atol: Tolerance for floating-point values; None demands identical bits.

    Returns:
        None, or ``{"reason", "max_abs_diff", "elements"}`` (elements that differ).
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"reason": f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}",
                "max_abs_diff": None, "elements": None}
    floating = a.is_floating_point() or a.is_complex()
    worst = 0.0
    differing = 0
    for left, right in zip(_chunks(a), _chunks(b), strict=True):
        if floating:
            wide_left, wide_right = left.to(torch.float64), right.to(torch.float64)
            both_nan = torch.isnan(wide_left) & torch.isnan(wide_right)
            delta = (wide_left - wide_right).abs()
            delta = torch.where(both_nan, torch.zeros_like(delta), delta)
            delta = torch.nan_to_num(delta, nan=math.inf)
            if atol is None:
                same_bits = left.contiguous().view(torch.uint8).reshape(left.numel(), -1) == \
                    right.contiguous().view(torch.uint8).reshape(right.numel(), -1)
                bad = ~same_bits.all(dim=1) if left.numel() else same_bits.reshape(0)
            else:
                bad = delta > atol
        elif a.dtype == torch.bool:
            bad = left != right
            delta = bad.to(torch.float64)
        else:
            delta = (left.to(torch.float64) - right.to(torch.float64)).abs()
            bad = left != right
        count = int(bad.sum())
        if count:
            differing += count
            worst = max(worst, float(delta[bad].max()))
    if not differing:
        return None
    return {"reason": "values differ", "max_abs_diff": worst, "elements": differing}


def _compare_values(a: Any, b: Any, atol: float | None) -> dict[str, Any] | None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return compare_tensors(a, b, atol)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return {"reason": "tensor vs non-tensor", "max_abs_diff": None, "elements": None}
    if isinstance(a, float) and isinstance(b, float):
        return _compare_floats(a, b, atol)
    if type(a) is not type(b) or a != b:
        return {"reason": "values differ", "max_abs_diff": _numeric_distance(a, b),
                "elements": 1}
    return None


def _compare_floats(a: float, b: float, atol: float | None) -> dict[str, Any] | None:
    """Two floats: NaN equals NaN; within ``atol`` when one is given, else ``==``."""
    if math.isnan(a) and math.isnan(b):
        return None
    if (abs(a - b) <= atol) if atol is not None else a == b:
        return None
    return {"reason": "values differ", "max_abs_diff": abs(a - b), "elements": 1}


def _numeric_distance(a: Any, b: Any) -> float | None:
    """``|a - b|`` of two numbers (bools are not numbers here), else None."""
    numeric = isinstance(a, (int, float)) and isinstance(b, (int, float)) \
        and not isinstance(a, bool) and not isinstance(b, bool)
    return abs(float(a) - float(b)) if numeric else None


class _Comparison:
    def __init__(self, atol: float | None) -> None:
        self.atol = atol
        self.differences: list[dict[str, Any]] = []
        self.tensors = 0
        self.values = 0

    def add(self, key: str, section: str, found: dict[str, Any], a: Any = None,
            b: Any = None) -> None:
        worst = found.get("max_abs_diff")
        if isinstance(worst, float) and not math.isfinite(worst):
            found = {**found, "max_abs_diff": str(worst)}
        self.differences.append({
            "key": key, "section": section, **found,
            "a": _short(a), "b": _short(b),
        })

    def values_of(self, section: str, left: dict[str, Any], right: dict[str, Any]) -> None:
        for key in sorted(set(left) | set(right)):
            if key not in right:
                self.add(key, section, _only("a"), left[key], None)
            elif key not in left:
                self.add(key, section, _only("b"), None, right[key])
            else:
                self.values += 1
                found = _compare_values(left[key], right[key], self.atol)
                if found is not None:
                    self.add(key, section, found, left[key], right[key])


def _only(side: str) -> dict[str, Any]:
    return {"reason": f"only in {side}", "max_abs_diff": None, "elements": None}


def _short(value: Any) -> Any:
    if value is None:
        return None
    summary = plain(value)
    text = repr(summary) if not isinstance(summary, str) else summary
    return text if len(text) <= 60 else text[:57] + "..."


def _load(target: CheckpointTarget, entry: CheckpointEntry, path: str) -> Any:
    assert entry.manifest is not None
    return read_plain(target.storage, entry.name, entry.manifest, path)


def _compare_tensor_state(result: _Comparison, sides: list[tuple[CheckpointTarget,
                          CheckpointEntry]], options: dict[str, Any], *,
                          progress: bool = False) -> None:
    """Compare every tensor of both sides; ``progress``: a byte bar on a TTY stderr."""
    urls = [tensors_url(target.storage, entry) for target, entry in sides]
    index_a, index_b = (tensors.read_tensor_index(url, storage_options=options or None)
                        for url in urls)
    common = []
    for key in list(index_a) + [k for k in index_b if k not in index_a]:
        left, right = index_a.get(key), index_b.get(key)
        if right is None:
            result.add(key, "tensor", _only("a"))
        elif left is None:
            result.add(key, "tensor", _only("b"))
        elif left.shape != right.shape or left.dtype != right.dtype:
            result.add(key, "tensor", {
                "reason": f"shape/dtype {left.shape} {left.dtype} vs {right.shape} "
                f"{right.dtype}", "max_abs_diff": None, "elements": None})
        else:
            common.append(key)
    stream_a = tensors.iter_full_tensors(urls[0], common, storage_options=options or None)
    stream_b = tensors.iter_full_tensors(urls[1], common, storage_options=options or None)
    # Bytes read: both sides of every tensor compared (a GB checkpoint takes minutes).
    total = 2 * sum(index_a[key].nbytes for key in common)
    step_a, step_b = (entry.step for _, entry in sides)
    with progress_bar(total, f"diff step {step_a} vs {step_b}", enabled=progress) as advance:
        for (key, left_tensor), (_, right_tensor) in zip(stream_a, stream_b, strict=True):
            result.tensors += 1
            found = compare_tensors(left_tensor, right_tensor, result.atol)
            if found is not None:
                result.add(key, "tensor", found)
            advance(2 * index_a[key].nbytes)
            del left_tensor, right_tensor


def _rank_files(entry: CheckpointEntry) -> set[str]:
    assert entry.manifest is not None
    return {item.path for item in entry.manifest.files
            if item.path.startswith(f"{RANK_STATE_DIR}/")}


def _compare_plain_state(result: _Comparison, sides: list[tuple[CheckpointTarget,
                         CheckpointEntry]]) -> None:
    (target_a, entry_a), (target_b, entry_b) = sides
    assert entry_a.manifest is not None and entry_b.manifest is not None
    files_a = {item.path for item in entry_a.manifest.files}
    files_b = {item.path for item in entry_b.manifest.files}
    for path in sorted({TRAIN_STATE_FILE} | _rank_files(entry_a) | _rank_files(entry_b)):
        stem = path.removesuffix(".pt")
        in_a, in_b = path in files_a, path in files_b
        if not in_a and not in_b:
            continue
        if not in_b:
            result.add(stem, "file", _only("a"))
            continue
        if not in_a:
            result.add(stem, "file", _only("b"))
            continue
        section = "train_state" if path == TRAIN_STATE_FILE else "rank_state"
        result.values_of(section, flatten(_load(target_a, entry_a, path), stem),
                         flatten(_load(target_b, entry_b, path), stem))
    for part in ("extras", "state", "fingerprint"):
        result.values_of(
            f"manifest.{part}",
            flatten(getattr(entry_a.manifest, part), f"manifest.{part}"),
            flatten(getattr(entry_b.manifest, part), f"manifest.{part}"),
        )


def run(args: argparse.Namespace) -> int:
    """Run ``diff``; return the exit code."""
    options = storage_options(args.storage_option)
    sides = []
    for path, step in ((args.a, args.step_a), (args.b, args.step_b)):
        target = open_target(path, storage_options=options, name_format=args.name_format)
        sides.append((target, select_committed(target, step)))
    result = _Comparison(args.atol)
    _compare_tensor_state(result, sides, options,
                          progress=not (args.json or args.no_progress))
    _compare_plain_state(result, sides)
    (_, entry_a), (_, entry_b) = sides
    equal = not result.differences
    mode = "bitwise" if args.atol is None else f"atol {args.atol:g}"
    if args.json:
        emit_json({
            "schema": SCHEMA, "equal": equal, "a": entry_a.path, "b": entry_b.path,
            "step_a": entry_a.step, "step_b": entry_b.step, "atol": args.atol,
            "compared": {"tensors": result.tensors, "values": result.values},
            "differences": result.differences,
        })
    else:
        out = console()
        if equal:
            out.print(f"identical ({mode}): {result.tensors} tensors and {result.values} "
                      f"values of step {entry_a.step} ({entry_a.path}) and step "
                      f"{entry_b.step} ({entry_b.path})")
        else:
            grid = table("key", "section", "difference", "max abs diff", "elements", "a", "b")
            for item in result.differences:
                diff = item["max_abs_diff"]
                grid.add_row(item["key"], item["section"], item["reason"],
                             "-" if diff is None else
                             (f"{diff:.6g}" if isinstance(diff, float) else str(diff)),
                             "-" if item["elements"] is None else str(item["elements"]),
                             "" if item["a"] is None else str(item["a"]),
                             "" if item["b"] is None else str(item["b"]))
            out.print(grid)
            out.print(f"{len(result.differences)} differing keys ({mode}; compared "
                      f"{result.tensors} tensors and {result.values} values)")
    if not equal:
        first = result.differences[0]
        return fail(
            f"step {entry_a.step} ({entry_a.path}) and step {entry_b.step} "
            f"({entry_b.path}) differ in {len(result.differences)} keys; first: "
            f"{first['key']} ({first['reason']})"
        )
    return 0
