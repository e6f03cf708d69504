"""Run a function on N real processes joined in a gloo process group (CPU).

Like PyTorch's own distributed tests: real processes, a real TCP store on loopback,
errors from any rank re-raised in the test with that rank's traceback.

    results = run_ranks(my_module_level_fn, world_size=2, args=(tmp_path,))

``fn(rank, world_size, *args)`` must be importable (defined at module level). Each rank
has RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, as torchrun would,
and (unless ``init_group=False``) a default gloo group already initialised. Ranks named
in ``may_exit`` may leave without a result (a test that kills a rank on purpose): their
result is None.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from tests.limits import COLLECTIVE_HANG_S

#: Imported once by the fork server every rank is forked from (``start_method="forkserver"``):
#: a rank then starts without paying torch's and resumekit's import time (most of a short
#: multi-rank test's). The server is a clean process (no threads, no process group), started
#: on first use by each pytest process; a rank still sees the environment it was started
#: with plus what ``_entry`` sets.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "resumekit",
           "tests.distributed_harness")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    port: int,
    out_dir: str,
    init_group: bool,
    group_timeout_s: float,
    extra_env: dict[str, str],
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    os.environ.update(extra_env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        if init_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size,
                timeout=timedelta(seconds=group_timeout_s),
            )
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the test
        payload = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    finally:
        if init_group and dist.is_initialized():
            try:
                if payload[0] == "ok":
                    dist.barrier()
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    with open(result_path, "wb") as handle:
        pickle.dump(payload, handle)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    *,
    init_group: bool = True,
    group_timeout_s: float = COLLECTIVE_HANG_S,
    env: dict[str, str] | None = None,
    may_exit: Collection[int] = (),
) -> list[Any]:
    """Run ``fn`` on ``world_size`` processes; return each rank's return value."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts
    with tempfile.TemporaryDirectory(prefix="rk-ranks-") as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, args, free_port(), out_dir, init_group,
                  group_timeout_s, dict(env or {})),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        failure: BaseException | None = None
        try:
            while not context.join():
                pass
        except Exception as error:  # noqa: BLE001 - a rank died without writing its result
            failure = error
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists() and rank in may_exit:
                results.append(None)
                continue
            if not path.exists():
                errors.append(f"rank {rank}: no result ({failure})")
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {rank}: {value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results
