"""The simulated part of ``make bench-world``: a fake process group of W = 8..1,024 ranks.

One process plays rank 0 of a save and one restoring rank of W ranks over the real
5B LingBot-VA shapes (``examples.lingbot``'s ``furniture_all_e128``, built on the meta
device), FSDP2-sharded along dim 0 (``torch.chunk``'s split, as ``fully_shard`` does), with
AdamW's state. Nothing is read or written but ``.metadata``: the figures are what grows
with W, run through the real code of each side.

* **rank 0's save coordination**: DCP's ``DefaultSavePlanner.create_global_plan`` over
  the W local plans (what the coordinator gathers; the plans are built from the shapes,
  as each rank's planner would) and the writer's ``finish`` writing ``.metadata`` from
  the W ranks' write results: DCP's ``FileSystemWriter`` (one file per rank, an offset
  and a length per item) and resumekit's ``RawTensorWriter`` (one file per rank since
  ``schema_version`` 4, written in parts by four threads; one shared descriptor for the
  items stored alone and one per packed region, their checksums in the file's trailer);
  the results carry the byte counts the writers would record;
* **a restoring rank's CPU**: a rank in the middle of the group (not the leader) with
  its real ``DTensor`` shards on the meta device (fake process group, backend
  ``"fake"``): DCP: ``.metadata`` read and unpickled, ``DefaultLoadPlanner`` set up and
  its local plan made, the reader set up; resumekit: the same through its own planner
  (the fit check of every key, shape and dtype) and reader, from the ``.metadata`` bytes
  rank 0 broadcast (parsed once with the allow-list unpickler; no file opened), and, as
  before issue 40, from four reads of the file (one hashed, three parsed).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from resumekit.store.manifest import checksum_chunks
from resumekit.tensors.load import _CheckedLoadPlanner
from resumekit.tensors.raw import format as raw_format
from resumekit.tensors.raw.format import FileLayout
from resumekit.tensors.raw.writer import RawTensorWriter
from resumekit.tensors.reader import CheckedMetadata, make_reader

FILES_PER_RANK = 2  # a data file (its checksums in its trailer) and a rank state file
WRITER_THREADS = 4  # resumekit's DEFAULT_THREAD_COUNT: parts of the one data file
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of the model: its name, global shape and dtype."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def lingbot_params(config_name: str = "furniture_all_e128") -> list[Param]:
    """The parameters of LingBot-VA ``config_name``, built on the meta device (fp32)."""
    from examples.lingbot.config import get_config  # noqa: PLC0415 - examples are optional
    from examples.lingbot.model import LingBotVA  # noqa: PLC0415

    with torch.device("meta"):
        model = LingBotVA(get_config(config_name).model)
    return [Param(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]


def _shard(length: int, rank: int, world: int) -> tuple[int, int]:
    """``(offset, size)`` of ``rank``'s dim-0 shard (``torch.chunk``'s split, FSDP2's)."""
    size = math.ceil(length / world)
    offset = min(rank * size, length)
    return offset, max(0, min(size, length - offset))


def _stored(params: list[Param]) -> list[tuple[str, Param, tuple[str, ...]]]:
    """Every sharded tensor a checkpoint stores: (flat name, its parameter, nesting path)."""
    found = [(f"model.{p.fqn}", p, ("model", p.fqn)) for p in params]
    for state in OPTIMIZER_STATES:
        found += [(f"optimizer.state.{p.fqn}.{state}", p, ("optimizer", "state", p.fqn, state))
                  for p in params]
    return found


def local_plans(params: list[Param], world: int) -> list[SavePlan]:
    """The W local save plans DCP's planner makes (one per rank), from the shapes alone."""
    stored = _stored(params)
    mappings: dict[str, tuple[str | int, ...]] = {name: path for name, _, path in stored}
    steps = [f"optimizer.state.{p.fqn}.step" for p in params]
    mappings.update({name: ("optimizer", "state", p.fqn, "step")
                     for name, p in zip(steps, params, strict=True)})
    groups = {f"optimizer.param_groups.0.{key}": ("optimizer", "param_groups", 0, key)
              for key in ("lr", "params")}
    mappings.update(groups)
    plans = []
    scalar = TensorProperties(dtype=torch.float32)
    for rank in range(world):
        items = []
        for name, param, _ in stored:
            offset, size = _shard(param.shape[0], rank, world)
            offsets = torch.Size((offset,) + (0,) * (len(param.shape) - 1))
            items.append(WriteItem(
                index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets,
                                               sizes=torch.Size((size, *param.shape[1:]))),
                    properties=TensorProperties(dtype=param.dtype),
                    size=torch.Size(param.shape))))
        for name in steps:  # AdamW's step: a plain scalar tensor on every rank
            items.append(WriteItem(
                index=MetadataIndex(name, torch.Size(())), type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(())),
                    properties=scalar, size=torch.Size(()))))
        items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
                  for name in groups]
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 20_000  # a param_groups entry: a small pickled value
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def write_results(plans: list[SavePlan], *, raw: bool) -> list[list[WriteResult]]:
    """What each rank's writer would return for its final plan (the byte counts it records)."""
    results = []
    for rank, plan in enumerate(plans):
        mine: list[WriteResult] = []
        offset = 0
        region: list[int] = [0, 0]  # bytes used in the current packed region, its file
        alone: Any = raw_format.TRAILER_ALONE_DESCRIPTORS
        name = f"__{rank}_0.distcp"
        for item in plan.items:
            length = _nbytes(item)
            descriptors: Any = None
            if raw:
                if length < raw_format.PACK_ITEM_BYTES:
                    first = region[0] == 0 or region[0] + length > raw_format.PACK_BYTES
                    region[0] = length if first else region[0] + length
                    descriptors = ([f"{raw_format.TRAILER_PACK_PREFIX}{raw_format.PACK_BYTES}"]
                                   if first else raw_format.MEMBER_DESCRIPTORS)
                else:  # stored alone: its blocks are in its file's trailer
                    descriptors = alone
            mine.append(WriteResult(index=item.index, size_in_bytes=length,
                                    storage_data=_StorageInfo(name, offset, length,
                                                              transform_descriptors=descriptors)))
            offset += length
        results.append(mine)
    return results


def measured_stamp() -> dict[str, Any]:
    """When and at which commit a figure was measured (a partial rerun keeps it apart).

    Taken when a run starts (``dirty``: tracked files differed from the commit then).
    """
    import datetime  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                                  cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return ""

    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def cpu_of(action: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds (this process, all threads) ``action`` took, and its result."""
    gc.collect()
    start = time.process_time()
    result = action()
    return time.process_time() - start, result


def save_side(params: list[Param], world: int, directory: Path, *, raw: bool,
              timed: bool = True, plans: list[SavePlan] | None = None) -> dict[str, Any]:
    """Rank 0's coordination of a save of W ranks: global plan, then ``.metadata`` written.

    ``timed=False`` (a restore-only row): the global plan is DCP's without its validation
    (whose overlap sweep runs along each tensor's longest dimension, across which dim-0
    shards all overlap: O(W²) per such tensor, hours at W = 1,024 in one process); the
    ``.metadata`` written is the same, and no save CPU is reported. ``plans``: the W
    local plans, when already built (they are the same for both formats).
    """
    plans = local_plans(params, world) if plans is None else plans
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, is_coordinator=True)
    if timed:
        plan_cpu, (final, metadata) = cpu_of(lambda: planner.create_global_plan(plans))
    else:
        plan_cpu, (final, metadata) = 0.0, create_default_global_save_plan(
            dedup_save_plans(plans))
    results = write_results(final, raw=raw)
    directory.mkdir(parents=True, exist_ok=True)
    if raw:
        writer: Any = RawTensorWriter(directory, thread_count=WRITER_THREADS, sync_files=False)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    else:
        writer = FileSystemWriter(directory)
        writer.set_up_storage_writer(True)
    writer.prepare_global_plan(final)
    finish_cpu, _ = cpu_of(lambda: writer.finish(metadata, results))
    data = (directory / ".metadata").read_bytes()
    return {"plan_cpu_s": plan_cpu, "finish_cpu_s": finish_cpu,
            "save_cpu_rank0_s": plan_cpu + finish_cpu if timed else None,
            "metadata_bytes": len(data),
            "data": data}


def save_side_steady(params: list[Param], world: int, directory: Path, *, raw: bool,
                     plans: list[SavePlan] | None = None) -> dict[str, Any]:
    """Rank 0's coordination of a run's second and later saves of an unchanged layout.

    Each side at its best: resumekit with its remembered plans (:mod:`resumekit.tensors.
    plans`: every rank sends a marker of its round, rank 0 reuses its metadata and, for
    the same write results, ``.metadata``'s bytes); DCP with its own plan caching
    (``DefaultSavePlanner(enable_plan_caching=True)``: every rank sends an empty plan,
    rank 0 reuses its global plan and metadata, ``FileSystemWriter.finish`` pickles
    ``.metadata`` again). A first save fills each side's memory (not timed); the second
    is timed: the markers received (unpickled), the global plan, the markers sent back
    (pickled), the writer's ``prepare_global_plan`` and ``finish`` from the write results
    of that save (built afresh: equal, not the same objects). Where resumekit saves from
    remembered plans without DCP's planning round (:mod:`resumekit.tensors.remembered_save`,
    one all-reduce decides) its side is the remembered metadata taken and ``finish``.
    """
    # here, not at the top: the bench runs over code from before remembered plans too
    from resumekit.tensors.plans import (  # noqa: PLC0415
        MemoSavePlanner,
        Planned,
        SavePlans,
        Unchanged,
    )

    plans = local_plans(params, world) if plans is None else plans
    directory.mkdir(parents=True, exist_ok=True)

    def writer_of(name: str) -> Any:
        (directory / name).mkdir()
        if raw:
            writer: Any = RawTensorWriter(directory / name, thread_count=WRITER_THREADS,
                                          sync_files=False)
            writer.metadata_memo = memory
            writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        else:
            writer = FileSystemWriter(directory / name)
            writer.set_up_storage_writer(True)
        return writer

    def sent(objects: list[Any]) -> list[Any]:  # gathered or scattered: pickled, unpickled
        return [pickle.loads(pickle.dumps(one)) for one in objects]

    memory = SavePlans()
    if raw:
        first: list[SavePlan] = [dataclasses.replace(plan, planner_data=Planned(
            True, plan.planner_data)) for plan in plans]
        planner: Any = MemoSavePlanner(memory)
    else:
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans,
                      SavePlanner._cached_global_plan, SavePlanner._cached_metadata,
                      SavePlanner._cached_final_save_plan):
            cache.clear()  # DCP's caches are class attributes: this W's only
        first = plans
        planner = DefaultSavePlanner(enable_plan_caching=True)
    planner.set_up_planner({}, None, is_coordinator=True)
    finals, metadata = planner.create_global_plan(first)
    writer = writer_of("first")
    finals = writer.prepare_global_plan(finals)
    unwrapped = [dataclasses.replace(plan, planner_data=None) for plan in finals]
    writer.finish(metadata, write_results(unwrapped, raw=raw))
    if raw:
        token = finals[0].planner_data.token
        markers = [SavePlan([], planner_data=Unchanged(token), usable=False)
                   for _ in range(world)]
    else:
        markers = [SavePlan([], usable=False) for _ in range(world)]
    results = write_results(unwrapped, raw=raw)  # the second save's: equal, not the same
    second = writer_of("second")
    planner = MemoSavePlanner(memory) if raw else DefaultSavePlanner(enable_plan_caching=True)
    planner.set_up_planner({}, None, is_coordinator=True)

    def coordinate() -> tuple[Any, Any]:
        if raw and remembered_save_available():
            # resumekit.tensors.remembered_save: one all-reduce of four integers decides
            # (no marker gathered, no plan scattered); rank 0 takes its remembered metadata
            return [], memory.metadata_of([token] * world)
        replies, again = planner.create_global_plan(sent(markers))
        return sent(second.prepare_global_plan(replies)), again

    plan_cpu, (replies, again) = cpu_of(coordinate)
    assert all(not reply.usable for reply in replies)  # nothing planned: memory reused
    finish_cpu, _ = cpu_of(lambda: second.finish(again, results))
    data = (directory / "second" / ".metadata").read_bytes()
    assert data == (directory / "first" / ".metadata").read_bytes() or not raw
    return {"plan_cpu_s": plan_cpu, "finish_cpu_s": finish_cpu,
            "save_cpu_rank0_s": plan_cpu + finish_cpu,
            "metadata_reused": memory.metadata_reused if raw else 0}


def remembered_save_available() -> bool:
    """Whether this resumekit saves from remembered plans without DCP's planning round."""
    return importlib.util.find_spec("resumekit.tensors.remembered_save") is not None


def _state_of(params: list[Param], mesh: Any) -> dict[str, Any]:
    """This rank's destination state: DTensor shards on the meta device, AdamW's state."""
    world = mesh.size()

    def shard(param: Param) -> DTensor:
        _, size = _shard(param.shape[0], mesh.get_local_rank(), world)
        local = torch.empty((size, *param.shape[1:]), dtype=param.dtype, device="meta")
        stride = tuple(math.prod(param.shape[i + 1:]) for i in range(len(param.shape)))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(param.shape), stride=stride)

    model = {p.fqn: shard(p) for p in params}
    state = {p.fqn: {"step": torch.tensor(0.0), **{s: shard(p) for s in OPTIMIZER_STATES}}
             for p in params}
    return {"model": model, "optimizer": {"state": state, "param_groups": [
        {"lr": 0.0, "params": [p.fqn for p in params]}]}}


def _plan_load(state: dict[str, Any], planner: Any, reader: Any) -> int:
    metadata = reader.read_metadata()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    reader.set_up_storage_reader(metadata, False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    return len(plan.items)


def _layout(reader: Any, plan: Any) -> None:
    """The reader's layout of the files ``plan`` reads (their checksum files not read:
    the simulation writes no data; a rank reads those of the files it reads, whatever W)."""
    storage = reader.storage_data
    files = {storage[item.storage_index].relative_path for item in plan.items}
    FileLayout(storage, reader._where, None, files=files, blocks=None)


def _timed_plan(state_of: Callable[[], dict[str, Any]], planner: Any, reader: Any,
                parse: Callable[[], Any], times: dict[str, float]) -> int:
    """Plan a load step by step, adding each step's CPU seconds to ``times``."""
    def step(name: str, action: Callable[[], Any]) -> Any:
        start = time.process_time()
        result = action()
        times[name] = times.get(name, 0.0) + time.process_time() - start
        return result

    state = step("state", state_of)
    metadata = step("receive_metadata", parse)
    step("set_up_planner", lambda: planner.set_up_planner(state, metadata, False))
    step("set_up_reader", lambda: reader.set_up_storage_reader(metadata, False))
    plan = step("local_plan", lambda: reader.prepare_local_plan(planner.create_local_plan()))
    step("reader_layout", lambda: _layout(reader, plan))
    return len(plan.items)


def restore_side(params: list[Param], world: int, rank: int, dcp_dir: Path, raw_dir: Path,
                 raw_data: bytes, *, before: bool = True, others: bool = True
                 ) -> dict[str, Any]:
    """One restoring rank's CPU: DCP; resumekit now (skeleton + its part); resumekit
    sharing the whole file (issue 40's item 1); resumekit before issue 40 (four reads).

    For "now", rank 0's side runs in this process too (it parsed the file, sent the
    skeleton, answers the request): its CPU is measured apart and left out of the
    restoring rank's, as are the bytes it sends (the skeleton, the part).
    """
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        dcp_cpu, dcp_items = cpu_of(lambda: _plan_load(
            _state_of(params, mesh), DefaultLoadPlanner(), FileSystemReader(dcp_dir))
        ) if others else (None, None)

        # rank 0: the file parsed and checked, the skeleton sent, the index of chunks
        leader_cpu, (whole, sent) = cpu_of(lambda: _leader(raw_data, raw_dir))
        leader_request_cpu = [0.0]
        received_bytes = [len(sent)]

        def exchange(request: Any) -> Any:
            data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)  # sent
            start = time.process_time()  # rank 0's answer: not this rank's CPU
            reply = pickle.dumps(whole.server().part_for(pickle.loads(data)),
                                 protocol=pickle.HIGHEST_PROTOCOL)
            leader_request_cpu[0] += time.process_time() - start
            received_bytes[0] += len(reply)
            return pickle.loads(reply)  # received

        parts_times: dict[str, float] = {}

        def ours() -> int:
            checked: list[CheckedMetadata] = []

            def receive() -> Any:
                checked.append(pickle.loads(sent))
                return checked[0].parsed()

            planner = _CheckedLoadPlanner(str(raw_dir), reject_unexpected=True,
                                          exchange=exchange)
            reader = make_reader(str(raw_dir), None, metadata=None)
            return _timed_plan(lambda: _state_of(params, mesh), planner, reader, receive,
                               parts_times)

        # rank 0's parse lives in this process, not in a restoring rank's: kept out of the
        # cycle collector's way, as if it were elsewhere
        gc.collect()
        gc.freeze()
        try:
            now_cpu, now_items = cpu_of(ours)
        finally:
            gc.unfreeze()
        now_cpu -= leader_request_cpu[0]
        parts_times["set_up_planner"] -= leader_request_cpu[0]
        whole_times: dict[str, float] = {}

        def shared_whole() -> int:  # issue 40's item 1: the whole file's bytes sent
            checked = CheckedMetadata(raw_data, str(raw_dir / ".metadata"),
                                      checksum_chunks([raw_data]))
            planner = _CheckedLoadPlanner(str(raw_dir), reject_unexpected=True)
            reader = make_reader(str(raw_dir), None, metadata=checked)
            return _timed_plan(lambda: _state_of(params, mesh), planner, reader,
                               checked.parsed, whole_times)

        whole_cpu, whole_items = cpu_of(shared_whole) if others else (None, None)

        def before_40() -> int:  # four reads: hashed once (verify), parsed three times
            source = raw_dir / ".metadata"
            checksum_chunks([source.read_bytes()])
            for _ in range(2):  # files_verified_on_read, the optimizer's preallocation
                make_reader(str(raw_dir), None).read_metadata()
            return _plan_load(_state_of(params, mesh),
                              _CheckedLoadPlanner(str(raw_dir), reject_unexpected=True),
                              make_reader(str(raw_dir), None))

        before_cpu, before_items = cpu_of(before_40) if before else (None, None)
    finally:
        dist.destroy_process_group()
    assert {dcp_items, whole_items, before_items} - {None} <= {now_items}, (
        dcp_items, now_items, whole_items, before_items)
    return {"dcp_restore_cpu_s": dcp_cpu, "restore_cpu_s": now_cpu,
            "restore_cpu_whole_s": whole_cpu, "restore_cpu_before_s": before_cpu,
            "restore_breakdown_s": parts_times, "restore_breakdown_whole_s": whole_times,
            "leader_prepare_cpu_s": leader_cpu, "leader_cpu_per_request_s":
            leader_request_cpu[0], "metadata_bytes_received": received_bytes[0],
            "load_items": now_items}


def _leader(raw_data: bytes, raw_dir: Path) -> tuple[CheckedMetadata, bytes]:
    """Rank 0 of a restore: parses the file, makes the skeleton, indexes the chunks."""
    whole = CheckedMetadata.parse(raw_data, str(raw_dir / ".metadata"))
    sent = pickle.dumps(whole.for_ranks(), protocol=pickle.HIGHEST_PROTOCOL)
    whole.server().prepare()
    return whole, sent


def run(worlds: list[int], *, config: str = "furniture_all_e128",
        rows_to: Path | None = None, before_max: int = 1024,
        save_timed_max: int = 512, others_max: int = 1024, steady_max: int = 256
        ) -> list[dict[str, Any]]:
    """Both sides for each W; one row per W (each also appended to ``rows_to`` as a line
    of JSON when it is done, so a run stopped at a large W keeps the smaller ones).
    ``before_max``: the largest W whose restore before issue 40 (four parses) is run;
    ``save_timed_max``: the largest W whose rank-0 save is timed (above: restore only);
    ``others_max``: the largest W whose DCP side and resumekit's earlier restores (the
    whole file shared, before issue 40) are run (above: resumekit's restore only);
    ``steady_max``: the largest W whose rank-0 save of a run's later saves
    (:func:`save_side_steady`) is timed."""
    if not worlds:
        return []
    stamp = measured_stamp()  # the code this run imported: its commit when it started
    params = lingbot_params(config)
    with tempfile.TemporaryDirectory(prefix="resumekit-bench-world-") as scratch:
        # Warm-up (imports, DTensor's caches, the allocator): the first W's figures would
        # carry them, for whichever side ran first.
        warm = [save_side(params, 2, Path(scratch) / side, raw=side == "raw")
                for side in ("dcp", "raw")]
        restore_side(params, 2, 1, Path(scratch) / "dcp", Path(scratch) / "raw",
                     warm[1]["data"])
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="resumekit-bench-world-") as scratch:
            root = Path(scratch)
            timed = world <= save_timed_max
            plans = local_plans(params, world)
            others = world <= others_max
            dcp = (save_side(params, world, root / "dcp", raw=False, timed=timed, plans=plans)
                   if others else {"save_cpu_rank0_s": None, "metadata_bytes": None,
                                   "data": None})
            ours = save_side(params, world, root / "raw", raw=True, timed=timed, plans=plans)
            steady = world <= steady_max and timed
            ours_steady = save_side_steady(params, world, root / "raw-steady", raw=True,
                                           plans=plans) if steady else None
            dcp_steady = save_side_steady(params, world, root / "dcp-steady", raw=False,
                                          plans=plans) if steady and others else None
            del plans
            raw_data = ours.pop("data")
            dcp.pop("data")
            gc.collect()
            restore = restore_side(params, world, world // 2 + 1 if world > 2 else 1,
                                   root / "dcp", root / "raw", raw_data,
                                   before=world <= before_max and others, others=others)
            metadata_bytes = ours["metadata_bytes"]
            rows.append({
                "world_size": world,
                "save_cpu_rank0_s": ours["save_cpu_rank0_s"],
                "dcp_save_cpu_rank0_s": dcp["save_cpu_rank0_s"],
                "save_cpu_rank0_first_s": ours["save_cpu_rank0_s"],
                "dcp_save_cpu_rank0_first_s": dcp["save_cpu_rank0_s"],
                "save_cpu_rank0_steady_s": None if ours_steady is None
                else ours_steady["save_cpu_rank0_s"],
                "dcp_cached_save_cpu_rank0_steady_s": None if dcp_steady is None
                else dcp_steady["save_cpu_rank0_s"],
                "save_steady_breakdown_s": None if ours_steady is None else {
                    key: ours_steady[key] for key in ("plan_cpu_s", "finish_cpu_s")},
                "dcp_save_steady_breakdown_s": None if dcp_steady is None else {
                    key: dcp_steady[key] for key in ("plan_cpu_s", "finish_cpu_s")},
                "restore_cpu_per_rank_s": restore["restore_cpu_s"],
                "restore_cpu_per_rank_whole_s": restore["restore_cpu_whole_s"],
                "restore_cpu_per_rank_before_s": restore["restore_cpu_before_s"],
                "dcp_restore_cpu_per_rank_s": restore["dcp_restore_cpu_s"],
                "restore_breakdown_s": restore["restore_breakdown_s"],
                "restore_breakdown_whole_s": restore["restore_breakdown_whole_s"],
                "restore_leader_prepare_cpu_s": restore["leader_prepare_cpu_s"],
                "restore_leader_cpu_per_request_s": restore["leader_cpu_per_request_s"],
                "metadata_bytes": metadata_bytes,
                "dcp_metadata_bytes": dcp["metadata_bytes"],
                "metadata_bytes_read_per_rank": 0,
                "metadata_bytes_read_leader": metadata_bytes,
                "metadata_bytes_received_per_rank": restore["metadata_bytes_received"],
                "metadata_bytes_received_per_rank_whole": metadata_bytes if others else None,
                "metadata_bytes_read_per_rank_before": 4 * metadata_bytes,
                "dcp_metadata_bytes_read_per_rank": dcp["metadata_bytes"],
                "files_per_checkpoint": FILES_PER_RANK * world + 3,
                "dcp_files_per_checkpoint": world + 1,
                "not_run": None if others else (
                    f"W > others_max ({others_max}): DCP's side and resumekit's earlier "
                    "restores were not run, only resumekit's restore (machine time)"),
                "load_items": restore["load_items"],
                "measured": stamp,
            })
            del raw_data
        if rows_to is not None:
            with rows_to.open("a") as handle:
                handle.write(json.dumps(rows[-1]) + "\n")
        print(f"world fake W={world}: " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in rows[-1].items()), flush=True)
    return rows


if __name__ == "__main__":
    import sys

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(run([int(w) for w in sys.argv[1:]] or [8, 16]))
