"""Rank 0's side of a restore as W grows: parse, index, then answer every rank (issue 40).

A restore over a checkpoint group reads ``.metadata`` on group rank 0, which sends every
other rank the skeleton and, when the load plans, answers each rank's request with its part
(:mod:`resumekit.tensors.metadata_parts`). Everything rank 0 does there is measured here,
in one process, over the real 5B LingBot-VA shapes of :mod:`benchmarks.world_fake` (its
``.metadata`` built as a restore-only row is: DCP's global plan without its validation,
resumekit's raw writer's ``finish``), per W:

* ``parse_cpu_s``: the file parsed and checked, the skeleton pickled; ``index_cpu_s``
  (``index_baseline_cpu_s``): the answerer's index built (this checkout's works out every
  stored chunk's answer there);
* ``requests_cpu_s``: the W - 1 other ranks' requests unpickled (what ``gather_object``
  hands rank 0);
* ``answers_cpu_s``: every part made and pickled (what the scatter sends), with this
  checkout's code, and ``answers_baseline_cpu_s`` the same with the code of ``--baseline``
  (a commit; its ``metadata_parts`` module loaded from git), on the same parsed metadata
  and the same requests, in the same process; each part is checked equal to the
  baseline's (the same chunks and storage entries).

Each rank's request is made from the shapes (FSDP2's dim-0 shard of each tensor, AdamW's
``step`` whole, the param groups' values); one rank's is checked equal to the request
resumekit's planner makes from that rank's real ``DTensor`` state (a fake process group).

With ``--replicas R`` (HSDP: R ranks hold each shard) the checkpoint holds W / R shards
and R ranks send each request; rank 0 answers each distinct request once
(``answers_distinct``), where the baseline answered every rank.

Usage: ``python -m benchmarks.world_leader [--worlds 8,64,256,1024] [--replicas 1]
[--baseline COMMIT] [--out benchmarks/results/world_leader.json]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from benchmarks import world_fake
from resumekit.tensors import metadata_file, metadata_parts, parts_exchange
from resumekit.tensors.context import paused_collection
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.tensors.reader import CheckedMetadata

OUT = Path("benchmarks/results/world_leader.json")
WORLDS = (8, 64, 256, 1024)
PARAM_GROUPS = ("optimizer.param_groups.0.lr", "optimizer.param_groups.0.params")


def requests_of(params: list[world_fake.Param], world: int
                ) -> list[metadata_parts.Request]:
    """Every rank's request, from the shapes: its dim-0 shard of each sharded tensor,
    AdamW's ``step`` whole, every stored chunk of the param groups' values."""
    stored = world_fake._stored(params)
    requests: list[metadata_parts.Request] = []
    for rank in range(world):
        request: metadata_parts.Request = {}
        for name, param, _ in stored:
            offset, size = world_fake._shard(param.shape[0], rank, world)
            request[name] = [((offset,) + (0,) * (len(param.shape) - 1),
                              (size, *param.shape[1:]))]
        for param in params:
            request[f"optimizer.state.{param.fqn}.step"] = [((), ())]
        request.update(dict.fromkeys(PARAM_GROUPS))
        requests.append(request)
    return requests


def planner_request(params: list[world_fake.Param], world: int, rank: int,
                    whole: CheckedMetadata, server: metadata_parts.MetadataServer
                    ) -> metadata_parts.Request:
    """The request resumekit's planner makes on ``rank`` from its real ``DTensor`` state."""
    made: list[metadata_parts.Request] = []

    def exchange(request: Any) -> metadata_parts.Part:
        made.append(request)
        return server.part_for(request)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        planner = _CheckedLoadPlanner("bench", reject_unexpected=True, exchange=exchange)
        sent = pickle.loads(pickle.dumps(whole.for_ranks()))
        planner.set_up_planner(world_fake._state_of(params, mesh), sent.parsed(), False)
    finally:
        dist.destroy_process_group()
    return made[0]


def baseline_module(commit: str) -> types.ModuleType:
    """``resumekit.tensors.metadata_parts`` as it was at ``commit`` (read from git)."""
    source = subprocess.run(["git", "show", f"{commit}:resumekit/tensors/metadata_parts.py"],
                            capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parent).stdout
    module = types.ModuleType("metadata_parts_baseline")
    module.__dict__["__file__"] = f"{commit}:resumekit/tensors/metadata_parts.py"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def _cpu(action: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``action``, the cyclic collector paused (as a load pauses it)."""
    gc.collect()
    with paused_collection(False):
        start = time.process_time()
        result = action()
        return time.process_time() - start, result


def _same(part: Any, baseline: Any) -> bool:
    return ({key: sorted(chunks) for key, chunks in part.chunks.items()}
            == {key: sorted(chunks) for key, chunks in baseline.chunks.items()}
            and sorted(map(repr, part.storage)) == sorted(map(repr, baseline.storage)))


def leader_row(params: list[world_fake.Param], world: int, baseline: types.ModuleType,
               replicas: int = 1) -> dict[str, Any]:
    """Rank 0's CPU at ``world`` ranks, this checkout's answers beside the baseline's.

    With ``replicas`` (HSDP), the checkpoint holds ``world // replicas`` shards of each
    tensor and rank ``r`` asks for shard ``r % (world // replicas)``.
    """
    shards = world // replicas
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-leader-") as scratch:
        data = world_fake.save_side(params, shards, Path(scratch) / "raw", raw=True,
                                    timed=False)["data"]
    source = "bench/.metadata"

    def parse() -> CheckedMetadata:
        whole = CheckedMetadata.parse(data, source)
        pickle.dumps(whole.for_ranks(), protocol=pickle.HIGHEST_PROTOCOL)
        return whole

    parse_cpu, whole = _cpu(parse)
    dcp_metadata = copy.copy(whole.parsed())
    dcp_metadata.storage_meta = None  # as the raw writer pickled it before schema 5
    dcp_data = pickle.dumps(dcp_metadata)
    parse_dcp_cpu, _ = _cpu(lambda: CheckedMetadata.parse(dcp_data, source).for_ranks())
    laid_out = laid_out_row(params, shards, world, data, source)
    old = baseline.MetadataServer(whole.parsed(), source)
    baseline_index_cpu, _ = _cpu(old.prepare)
    new = metadata_parts.MetadataServer(whole.parsed(), source)
    index_cpu, _ = _cpu(new.prepare)
    shard_requests = requests_of(params, shards)
    requests = [shard_requests[rank % shards] for rank in range(world)]
    checked_rank = shards // 2 + 1 if shards > 2 else 1
    assert planner_request(params, shards, checked_rank, whole, new) == requests[checked_rank]
    sent = [pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            for request in requests[1:]]  # what the other ranks send
    requests_cpu, received = _cpu(lambda: [pickle.loads(data) for data in sent])
    sent.clear()

    def answer_new() -> list[bytes]:
        pickled: dict[int, bytes] = {}  # a part given to several ranks: pickled once
        for part in (parts := new.parts_for(received)):
            if id(part) not in pickled:
                pickled[id(part)] = pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)
        return [pickled[id(part)] for part in parts]

    def answer_old() -> list[bytes]:
        return [pickle.dumps(old.part_for(request), protocol=pickle.HIGHEST_PROTOCOL)
                for request in received]

    baseline_cpu, old_parts = _cpu(answer_old)
    answers_cpu, new_parts = _cpu(answer_new)
    same = all(_same(pickle.loads(a), pickle.loads(b))
               for a, b in zip(new_parts, old_parts, strict=True))
    assert same, f"W = {world}: a part differs from the baseline's"
    row = {
        "world_size": world,
        "replicas": replicas,
        "answers_distinct": new.answers,
        "metadata_bytes": len(data),
        "parse_cpu_s": parse_cpu,
        "index_cpu_s": index_cpu,
        "index_baseline_cpu_s": baseline_index_cpu,
        "requests_cpu_s": requests_cpu,
        "answers_cpu_s": answers_cpu,
        "answers_baseline_cpu_s": baseline_cpu,
        "answer_cpu_s": answers_cpu / (world - 1),
        "answer_baseline_cpu_s": baseline_cpu / (world - 1),
        "leader_cpu_s": parse_cpu + index_cpu + requests_cpu + answers_cpu,
        "leader_baseline_cpu_s": parse_cpu + baseline_index_cpu + requests_cpu + baseline_cpu,
        "part_bytes_mean": sum(map(len, new_parts)) / len(new_parts),
        "part_bytes_baseline_mean": sum(map(len, old_parts)) / len(old_parts),
        "parts_equal_baseline": same,
        # schema 4's .metadata (DCP's pickle of the same metadata), read whole, indexed
        # and every rank answered: rank 0's side before the layout by rank
        "metadata_dcp_bytes": len(dcp_data),
        "metadata_bytes_vs_dcp": len(data) / len(dcp_data),
        "parse_dcp_cpu_s": parse_dcp_cpu,
        "leader_schema4_cpu_s": parse_dcp_cpu + index_cpu + requests_cpu + answers_cpu,
        **laid_out,
    }
    return row


def laid_out_row(params: list[world_fake.Param], shards: int, world: int, data: bytes,
                 source: str) -> dict[str, Any]:
    """Rank 0's side of a restore of ``.metadata`` laid out by rank (schema 5), every
    rank sharded as the checkpoint (covered by its part).

    ``head_cpu_s``: the head read from the file's bytes, checked, parsed and pickled for
    the broadcast; ``covered_requests_cpu_s``: the W - 1 other ranks' :class:`Covered`
    marks unpickled; ``covered_answers_cpu_s``: the one reply made and pickled (the small
    shared items it carries are read once, at most 256 KiB whatever W: not read here);
    ``own_part_cpu_s``: rank 0's own part read, checked, parsed, found covering its
    request and its answer worked out from it (what every rank does for itself).
    """
    def head() -> tuple[metadata_file.Head, bytes]:
        length, expected = metadata_file.read_head_length(data[:metadata_file.FRAME_BYTES],
                                                          source)
        found = metadata_file.parse_head(
            data[metadata_file.FRAME_BYTES:metadata_file.FRAME_BYTES + length], expected,
            source)
        checked = CheckedMetadata.from_head(found, source, "xxh3_128:0")
        return found, pickle.dumps(checked.for_ranks(), protocol=pickle.HIGHEST_PROTOCOL)

    head_cpu, (found, sent) = _cpu(head)
    covered = [pickle.dumps(parts_exchange.Covered(False), protocol=pickle.HIGHEST_PROTOCOL)
               ] * (world - 1)
    requests_cpu, marks = _cpu(lambda: [pickle.loads(mark) for mark in covered])

    def whole() -> Any:
        raise AssertionError("every rank is covered: the whole file is never read")

    answerer = parts_exchange.PartsAnswerer(found, source, whole, lambda metadata, items: {})

    def answer() -> bytes:
        replies = answerer.parts_for([parts_exchange.Covered(False), *marks])
        return pickle.dumps(replies[0], protocol=pickle.HIGHEST_PROTOCOL)  # one object

    answers_cpu, _ = _cpu(answer)
    request = requests_of(params, shards)[0]

    def own_part() -> metadata_parts.Part:
        offset, length, checksum = found.parts[0]
        rows = metadata_file.parse_part(
            data[found.base + offset:found.base + offset + length], checksum, source, 0)
        assert metadata_file.covers(request, found.shared_keys, rows)
        mine = parts_exchange.shared_metadata(found, rows)
        return metadata_parts.MetadataServer(mine, source).part_for(request)

    own_cpu, _ = _cpu(own_part)
    assert answerer.whole_reads == 0
    leader = head_cpu + requests_cpu + answers_cpu + own_cpu
    return {"head_bytes": found.base, "head_sent_bytes": len(sent),
            "part_bytes": found.parts[0][1], "head_cpu_s": head_cpu,
            "covered_requests_cpu_s": requests_cpu, "covered_answers_cpu_s": answers_cpu,
            "own_part_cpu_s": own_cpu, "leader_laid_out_cpu_s": leader}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--replicas", type=int, default=1,
                        help="ranks holding each shard (HSDP); 1: FSDP, every request differs")
    parser.add_argument("--baseline", default="07bc8ea",
                        help="the commit whose answering code is measured beside this one")
    parser.add_argument("--config", default="furniture_all_e128")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    stamp = world_fake.measured_stamp()
    # '' (tests): this checkout's code on both sides, no git needed
    baseline = baseline_module(args.baseline) if args.baseline else metadata_parts
    params = world_fake.lingbot_params(args.config)
    rows: list[dict[str, Any]] = []
    result = {"rows": rows, "measured": stamp, "baseline": args.baseline,
              "config": args.config, "replicas": args.replicas}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for world in (int(w) for w in args.worlds.split(",") if w):
        rows.append({**leader_row(params, world, baseline, args.replicas), "measured": stamp})
        print(json.dumps(rows[-1]), flush=True)
        # written after each row: a run stopped at a large W keeps the smaller ones
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
