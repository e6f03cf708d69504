"""``torchrun ... -m benchmarks.scale_worker``: one launch of one method of the scale bench.

Every rank builds the bench model ``fully_shard``-ed with FSDP2 over the two gloo ranks
(each rank holds half of every layer: its shard of the weights, their gradients and the
AdamW moments), restores the method's newest complete checkpoint, and trains up to
``--steps``, saving every ``--save-every`` steps the method's way and stopping on SIGTERM
the method's way (an emergency save, then exit 75). With ``--min-step-s`` it grows the
batch after any step shorter than that (:class:`BatchGrowth`). Each rank appends an event
per line (``time.time()``, one file per rank: :mod:`benchmarks.goodput`'s format, which
:func:`benchmarks.goodput.analyse` reads): ``launch``, ``restore_begin``/``restore_end``,
``step_begin`` (with the step's ``batch``)/``step``, ``blocked_begin``/``blocked_end``
around every call that makes training wait on checkpointing (``what`` and ``step`` say
which), ``memcpy`` (the first launch: a copy of a state of the rank's size into
preallocated buffers), ``baseline`` (the peak RSS of a step without a save), ``exit`` (the
peak RSS of the launch) and ``memory`` (:class:`Memory`: each step and each call into the
method as a segment, with its peak RSS and its RSS, malloc's live bytes and shared memory
at both ends, from which :mod:`benchmarks.scale` takes the method's own share of the
memory).

The methods (:data:`METHODS`): resumekit sync, async with its writer thread, async with
``async_writer="process"`` (where the option exists), DCP's ``async_save`` with its thread
and its process executor (with ``DefaultStager`` staging into shared memory; pinned only
with CUDA), and per-rank ``torch.save``. The peers' preemption handling is written here
the way a trainer would: a SIGTERM sets a flag, the ranks agree at the next step end
(an all-reduce), wait for a save in flight, save the step blocking, and exit.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from benchmarks.ranks import fsdp_model
from benchmarks.timing import fsync_tree
from benchmarks.workload import Shape, build_optimizer, state_tensors, tensor_bytes, train_step

EXIT_PREEMPTED = 75
METHODS = ("resumekit_sync", "resumekit_async_thread", "resumekit_async_process",
           "dcp_async_thread", "dcp_async_process", "torch_save")
#: The peers' step directories (resumekit names its own).
STEP_DIR = "step-{step:08d}"
DCP_DONE = ".metadata"  # DCP writes it last, on the coordinator: a complete checkpoint
TORCH_DONE = "COMMITTED"  # the per-rank torch.save peer's marker, written after a barrier
KEEP = 2  # checkpoints kept by every method (resumekit: keep_last(2))
#: Prints every thread's Python stack to stderr (faulthandler): what a hung rank was doing.
DUMP_SIGNAL = signal.SIGUSR2


def process_writer_available() -> bool:
    """Whether this resumekit has ``async_writer`` (issue 27 part 2)."""
    from resumekit.options import CheckpointOptions  # noqa: PLC0415

    return "async_writer" in CheckpointOptions.model_fields


class Events:
    """One rank's event file (line-buffered JSON lines)."""

    def __init__(self, path: str, rank: int) -> None:
        self.handle = open(path + ("" if rank == 0 else f".rank{rank}"), "a",  # noqa: SIM115
                           buffering=1)

    def log(self, kind: str, **fields: Any) -> None:
        """Append one event stamped with ``time.time()``."""
        if not self.handle.closed:
            self.handle.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")


def rss_status(field: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_live() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (``mallinfo2``), or None.

    Unlike the RSS, this does not count freed memory malloc keeps (with
    :data:`benchmarks.scale.MALLOC_KEEP`, every freed block stays resident).
    """
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    call.restype = _MallInfo2
    info = call()
    return int(info.uordblks + info.hblkhd)


class Memory:
    """The rank's life cut into segments, each logged as a ``memory`` event.

    At every :meth:`cut` the segment that ends is logged with its ``part``
    (``"training"``: a step; ``"checkpoint"``: a call into the method: building it, a
    fresh launch's restore, ``step_end``, ``close``; ``"restore"``: a restore that reads
    a checkpoint), its peak RSS (``VmHWM``, reset at every cut), its RSS, malloc's live
    bytes and the shared memory mapped (``RssShmem``) at both ends. ``peak`` also keeps
    the high-water mark since :meth:`mark` (the max of the segments' peaks), which the
    ``baseline`` and ``exit`` events report as before.
    """

    def __init__(self, events: Events) -> None:
        self.events = events
        self.exact = _reset_peak()
        self.rss, self.live, self.shmem = (rss_status("VmRSS"), malloc_live(),
                                           rss_status("RssShmem"))
        self.since_mark = self.rss

    def mark(self) -> None:
        """Start :attr:`since_mark` over from the current RSS."""
        self.since_mark = rss_status("VmRSS")

    def cut(self, part: str) -> None:
        """Log the segment that ends now as ``part``; start the next."""
        peak, rss = rss_status("VmHWM"), rss_status("VmRSS")
        live, shmem = malloc_live(), rss_status("RssShmem")
        self.exact = _reset_peak() and self.exact
        self.events.log("memory", part=part, peak=peak, rss_begin=self.rss, rss_end=rss,
                        live_begin=self.live, live_end=live, shmem_begin=self.shmem,
                        shmem_end=shmem, exact=self.exact)
        self.since_mark = max(self.since_mark, peak)
        self.rss, self.live, self.shmem = rss, live, shmem


def memcpy_seconds(model: torch.nn.Module, rounds: int = 3) -> float:
    """Median time to copy a state of this rank's size (model shard + AdamW's two moments).

    Fresh buffers of the local shards' shapes, all touched before timing; the slower
    rank's time per round.
    """
    shapes = [p.to_local().shape if hasattr(p, "to_local") else p.shape
              for p in model.parameters()] * 3
    sources = [torch.randn(shape) for shape in shapes]
    targets = [torch.zeros(shape) for shape in shapes]
    seconds = []
    for _ in range(rounds):
        dist.barrier()
        begin = time.perf_counter()
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
        elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds.append(float(elapsed.item()))
    del sources, targets
    return sorted(seconds)[len(seconds) // 2]


# ------------------------------------------------------------------------- the methods


class Saver:
    """A method: restore, a per-step hook that saves when due and stops on SIGTERM, close."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: Events) -> None:
        self.args, self.model, self.optimizer, self.events = args, model, optimizer, events
        self.root = Path(args.root)
        self.rank = dist.get_rank()

    def blocked(self, what: str, step: int | None, action: Any) -> Any:
        """Run ``action()`` between ``blocked_begin`` and ``blocked_end`` events."""
        self.events.log("blocked_begin", what=what, step=step)
        try:
            return action()
        finally:
            self.events.log("blocked_end", what=what, step=step)

    def restore(self) -> int:
        raise NotImplementedError

    def step_end(self, step: int) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ResumekitSaver(Saver):
    """``CheckpointManager`` with a ``PreemptionHandler(grace_period=...)``."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: Events) -> None:
        super().__init__(args, model, optimizer, events)
        from resumekit.manager import CheckpointManager  # noqa: PLC0415
        from resumekit.runtime.preemption import PreemptionHandler  # noqa: PLC0415
        from resumekit.store.retention import keep_last  # noqa: PLC0415

        knobs: dict[str, Any] = {"async_save": args.method != "resumekit_sync"}
        if args.method == "resumekit_async_process":
            knobs["async_writer"] = "process"
        self.manager = CheckpointManager(
            self.root, model=model, optimizer=optimizer, save_every=args.save_every,
            retention=keep_last(KEEP),
            preemption=PreemptionHandler(grace_period=args.grace, poll_every=(
                "auto" if args.poll_every == "auto" else int(args.poll_every))),
            **knobs)
        for name in ("save", "wait"):
            method = getattr(self.manager, name)

            def wrapper(*a: Any, _method: Any = method, _name: str = name, **k: Any) -> Any:
                step = a[0] if a else None
                return self.blocked(_name, step, lambda: _method(*a, **k))

            setattr(self.manager, name, wrapper)

    def restore(self) -> int:
        return int(self.manager.restore())

    def step_end(self, step: int) -> bool:
        return bool(self.manager.step_end(step))

    def close(self) -> None:
        self.blocked("close", None, self.manager.close)


class _Signalled:
    """A SIGTERM flag the ranks agree on at each step end (one all-reduce of one int)."""

    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.flag = True

    def agreed(self) -> bool:
        ballot = torch.tensor([int(self.flag)], dtype=torch.int64)
        dist.all_reduce(ballot, op=dist.ReduceOp.MAX)
        return bool(ballot.item())


class _PeerSaver(Saver):
    """What the peers share: step directories, a completion marker, keep the newest 2."""

    done_marker = DCP_DONE

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: Events) -> None:
        super().__init__(args, model, optimizer, events)
        self.signalled = _Signalled()
        self.last_saved: int | None = None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def step_dir(self, step: int) -> Path:
        return self.root / STEP_DIR.format(step=step)

    def complete_steps(self) -> list[int]:
        """Steps whose checkpoint is complete, oldest first (rank 0 looks, all learn)."""
        found: list[Any] = [None]
        if self.rank == 0:
            found[0] = sorted(int(path.name.split("-")[1]) for path in self.root.glob("step-*")
                              if (path / self.done_marker).exists())
        dist.broadcast_object_list(found, src=0)
        return list(found[0])

    def prune(self) -> None:
        """Rank 0 deletes all but the newest ``KEEP`` complete checkpoints (and partials
        older than them)."""
        if self.rank != 0:
            return
        complete = sorted(int(p.name.split("-")[1]) for p in self.root.glob("step-*")
                          if (p / self.done_marker).exists())
        if len(complete) <= KEEP:
            return
        oldest_kept = complete[-KEEP]
        for path in self.root.glob("step-*"):
            if int(path.name.split("-")[1]) < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)

    def state(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def finish_in_flight(self, step: int | None) -> None:
        """Wait for a background save (none here)."""

    def forget_in_flight(self) -> None:
        """Drop a background save that failed (none here)."""

    def save(self, step: int, *, blocking: bool) -> None:
        raise NotImplementedError

    def step_end(self, step: int) -> bool:
        if self.signalled.agreed():
            try:
                self.blocked("wait", step, lambda: self.finish_in_flight(step))
            except Exception as error:  # noqa: BLE001 - what a trainer does: save anyway
                self.events.log("in_flight_failed", step=step,
                                error=f"{type(error).__name__}: {error}"[:500])
                self.forget_in_flight()
            if step != self.last_saved:
                self.blocked("save", step, lambda: self.save(step, blocking=True))
            return True
        if step % self.args.save_every == 0 and step != self.last_saved:
            self.blocked("save", step, lambda: self.save(step, blocking=False))
        return False

    def close(self) -> None:
        self.blocked("close", None, lambda: self.finish_in_flight(None))


class DcpAsyncSaver(_PeerSaver):
    """``dcp.async_save`` (thread or process executor); its emergency save is ``dcp.save``."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, events: Events) -> None:
        super().__init__(args, model, optimizer, events)
        from torch.distributed.checkpoint.state_dict_saver import (  # noqa: PLC0415
            AsyncCheckpointerType,
        )

        self.future: Any = None
        self.in_flight: int | None = None
        self.stager: Any = None
        self.kind = (AsyncCheckpointerType.PROCESS if args.method == "dcp_async_process"
                     else AsyncCheckpointerType.THREAD)
        # Uploads run collectives from another thread: a group of their own (DCP's advice).
        self.upload_group = dist.new_group(backend="gloo")
        if args.method == "dcp_async_process":
            try:
                from torch.distributed.checkpoint.staging import (  # noqa: PLC0415
                    DefaultStager,
                    StagingOptions,
                )
            except ImportError:  # an older torch: DCP's own default staging
                self.stager = None
            else:
                cuda = torch.cuda.is_available()
                self.stager = DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=True,
                    use_async_staging=cuda, use_non_blocking_copy=cuda))

    def restore(self) -> int:
        complete = self.complete_steps()
        if not complete:
            return 0
        step = complete[-1]
        state = self.state()  # also creates AdamW's state to load into
        dcp.load(state, checkpoint_id=str(self.step_dir(step)))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.last_saved = step
        return step

    def finish_in_flight(self, step: int | None) -> None:
        if self.future is not None:
            upload = getattr(self.future, "upload_completion", self.future)
            upload.result()
            self.future = None
            self.prune()

    def forget_in_flight(self) -> None:
        self.future = None

    def save(self, step: int, *, blocking: bool) -> None:
        self.finish_in_flight(step)
        target = str(self.step_dir(step))
        if blocking:
            dcp.save(self.state(), checkpoint_id=target)
            self.prune()
        else:
            self.future = dcp.async_save(
                self.state(), checkpoint_id=target, process_group=self.upload_group,
                async_checkpointer_type=self.kind, async_stager=self.stager)
            staging = getattr(self.future, "staging_completion", None)
            if staging is not None:
                staging.result()  # training may change the tensors once they are staged
        self.last_saved = step

    def close(self) -> None:
        super().close()
        if self.stager is not None:
            self.stager.close()


class TorchSaveSaver(_PeerSaver):
    """Per-rank ``torch.save`` of the rank's local tensors, fsync, then rank 0's marker."""

    done_marker = TORCH_DONE

    def restore(self) -> int:
        complete = self.complete_steps()
        if not complete:
            return 0
        step = complete[-1]
        get_state_dict(self.model, self.optimizer)  # creates AdamW's state to load into
        saved = torch.load(self.step_dir(step) / f"rank{self.rank}.pt", weights_only=True)
        live = state_tensors(self.model, self.optimizer)
        if len(saved) != len(live):
            raise RuntimeError(f"rank {self.rank}: {len(saved)} tensors saved, {len(live)} "
                               "in the state")
        with torch.no_grad():
            for target, source in zip(live, saved, strict=True):
                target.copy_(source)
        self.last_saved = step
        return step

    def save(self, step: int, *, blocking: bool) -> None:
        directory = self.step_dir(step)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        path = directory / f"rank{self.rank}.pt"
        torch.save(state_tensors(self.model, self.optimizer), path)
        fsync_tree(path)
        dist.barrier()
        if self.rank == 0:
            marker = directory / TORCH_DONE
            marker.write_text(str(step))
            fsync_tree(marker)
            fsync_tree(directory)
        dist.barrier()
        self.last_saved = step
        self.prune()


#: The most :class:`BatchGrowth` multiplies the batch by after one step.
MAX_BATCH_GROWTH = 32
#: How far past the wanted step time :class:`BatchGrowth` aims.
BATCH_AIM = 1.25


class BatchGrowth:
    """The batch of each next step, grown until a step takes ``min_step_s`` (real compute).

    After each step every rank passes its batch and seconds; the ranks all-reduce the
    seconds (MAX: the slower rank), so every rank picks the same batch. Once a step took
    ``min_step_s`` the batch stays. Otherwise the next batch aims at ``min_step_s`` x
    :data:`BATCH_AIM`: a step's time is a fixed part (the collectives, AdamW, which do
    not grow with the batch) plus a part per row, so from two steps after the launch's
    first (a warm-up) the straight line through them (the secant) gives the batch, at
    least the proportional guess (``batch x aim / seconds``: short of the aim while the
    fixed part counts) and at most 4x it; before that, the proportional guess. Never more
    than :data:`MAX_BATCH_GROWTH` x the batch.
    """

    def __init__(self, min_step_s: float) -> None:
        self.min_step_s = min_step_s
        self.seen: list[tuple[int, float]] = []

    def next(self, batch: int, seconds: float) -> int:
        """The batch for the step after one of ``batch`` rows that took ``seconds``."""
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        took = float(slowest.item())
        self.seen.append((batch, took))
        if took >= self.min_step_s:
            return batch
        aim = BATCH_AIM * self.min_step_s
        guess = batch * aim / max(took, 1e-6)
        if len(self.seen) >= 3:  # two steps after the warm-up
            (b0, t0), (b1, t1) = self.seen[-2], self.seen[-1]
            if b1 > b0 and t1 > t0:
                per_row = (t1 - t0) / (b1 - b0)
                line = (aim - (t1 - per_row * b1)) / per_row
                guess = min(max(guess, line), 4 * guess)
        return max(batch + 1, min(int(guess + 0.999), batch * MAX_BATCH_GROWTH))


SAVERS: dict[str, type[Saver]] = {
    "resumekit_sync": ResumekitSaver, "resumekit_async_thread": ResumekitSaver,
    "resumekit_async_process": ResumekitSaver, "dcp_async_thread": DcpAsyncSaver,
    "dcp_async_process": DcpAsyncSaver, "torch_save": TorchSaveSaver,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_worker")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--poll-every", default="auto",
                        help="PreemptionHandler(poll_every=...): 'auto' or a number of steps")
    parser.add_argument("--memcpy", action="store_true", help="measure the memcpy first")
    parser.add_argument("--min-step-s", type=float, default=0.0,
                        help="grow the batch after any step shorter than this (the slower "
                             "rank's time), so later steps take at least this long: the "
                             "tight-grace launch's long steps (real compute, no sleep)")
    args = parser.parse_args(argv)
    # A fatal signal (SIGABRT from a failed gloo check, SIGSEGV) prints every thread's
    # Python stack to stderr, which the bench keeps per rank for a failed launch.
    faulthandler.enable(all_threads=True)
    # A launch that hangs: the bench sends DUMP_SIGNAL before killing it (scale.py).
    faulthandler.register(DUMP_SIGNAL, all_threads=True)
    import warnings  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    events = Events(args.events, rank)
    events.log("launch", pid=os.getpid())
    model = fsdp_model(Shape(args.layers, args.width))
    optimizer = build_optimizer(model)
    if args.memcpy:
        events.log("memcpy", seconds=memcpy_seconds(model))
    memory = Memory(events)  # the method's share of the memory from here on
    saver = SAVERS[args.method](args, model, optimizer, events)
    memory.cut("checkpoint")
    events.log("restore_begin")
    start = saver.restore()
    events.log("restore_end", step=start)
    memory.cut("checkpoint" if start == 0 else "restore")  # fresh: the method's own work
    code = 0
    batch = args.batch
    growth = BatchGrowth(args.min_step_s) if args.min_step_s > 0 else None
    for step in range(start + 1, args.steps + 1):
        events.log("step_begin", step=step, batch=batch)
        began = time.perf_counter()
        train_step(model, optimizer, batch=batch, seed=step)
        events.log("step", step=step)
        if growth is not None:
            batch = growth.next(batch, time.perf_counter() - began)
        memory.cut("training")
        if step == start + 1:
            memory.mark()  # the whole-launch peak from here on: training and saving only
        elif step == start + 2:  # a step without a save: the launch peak's baseline
            events.log("baseline", hwm=memory.since_mark, rss=memory.rss, exact=memory.exact,
                       state_bytes=tensor_bytes(model, optimizer))
        stop = saver.step_end(step)
        memory.cut("checkpoint")
        if stop:
            code = EXIT_PREEMPTED
            break
    saver.close()
    memory.cut("checkpoint")
    events.log("exit", code=code, hwm=memory.since_mark, rss=memory.rss)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
