"""Run a function on N real processes joined in a gloo process group (CPU).

Like PyTorch's own distributed tests: real processes, a real TCP store on loopback,
errors from any rank re-raised in the test with that rank's traceback.

    results = run_ranks(my_module_level_fn, world_size=2, args=(tmp_path,))

``fn(rank, world_size, *args)`` must be importable (defined at module level). Each rank
has RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, as torchrun would,
and (unless ``init_group=False``) a default gloo group already initialised. Ranks named
in ``may_exit`` may leave without a result (a test that kills a rank on purpose): their
result is None.

The torchrun drills (the quickstart's block, torchtitan's checkpointer and trainer) share
the rest: :func:`launch_torchrun` starts ``torch.distributed.run`` on 2 CPU ranks with its
output in ``<out>/log``; a worker writes its record with :func:`write_record` however it
ends (:func:`rank_records` reads them), pauses after a step (:func:`wait_paused` waits for
every rank's ``paused_<rank>`` file) and the test compares :func:`committed_steps` and
:func:`assert_identical` final states.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from tests.limits import COLLECTIVE_HANG_S, HANG_S

REPO_ROOT = Path(__file__).resolve().parents[1]

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


def launch_torchrun(folder: Path, tag: str, args: Sequence[str],
                    env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``torchrun`` on 2 CPU ranks in ``folder``: ``args`` (the script and its own).

    Its output (the agent's and both ranks') goes to ``<folder>/<tag>/log``; the ranks
    import this repository (``PYTHONPATH``) and run gloo on CPU, also on a GPU machine.

    Returns:
        The agent's process and ``<folder>/<tag>``, the launch's folder (made here).
    """
    out = folder / tag
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env,
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                  os.environ.get("PYTHONPATH", "")])}
    with (out / "log").open("wb") as log:
        process = subprocess.Popen(command, cwd=folder, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT)
    return process, out


def log_tail(out: Path) -> str:
    """The end of a launch's log, for an assertion's message."""
    return (out / "log").read_text(errors="replace")[-8000:]


def write_record(out: Path, rank: int, record: dict[str, Any], body: Callable[[], object]
                 ) -> None:
    """Run a torchrun worker's ``body``; write ``record`` with how it ended, however it ends.

    ``record["exit"]`` is the ``SystemExit`` code, or the error's type and message; the
    record goes to ``<out>/rank_<rank>.json`` (:func:`rank_records`).
    """
    try:
        body()
    except SystemExit as stop:
        record["exit"] = stop.code
        raise
    except BaseException as error:
        record["exit"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        (out / f"rank_{rank}.json").write_text(json.dumps(record))


def rank_records(out: Path) -> list[dict[str, Any]]:
    """The two ranks' records of a launch (:func:`write_record`)."""
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(2)]


def committed_steps(root: Path) -> list[tuple[int, str]]:
    """``(step, reason)`` of every committed checkpoint under ``root``, oldest first."""
    return [(entry.step, str(entry.manifest.reason.value))
            for entry in list_checkpoints(Storage(root))
            if entry.status == "committed" and entry.manifest is not None]


def say_paused(out: Path, rank: int, value: int) -> None:
    """A worker's ``paused_<rank>`` file holding ``value``, appearing whole or not at all.

    Written aside and renamed: a waiter polling for the file never reads it empty
    (``write_text`` creates the file before it writes, and a loaded machine showed a test
    that window).
    """
    aside = out / f".paused_{rank}.{os.getpid()}"
    aside.write_text(str(value))
    os.replace(aside, out / f"paused_{rank}")


def wait_paused(process: subprocess.Popen[bytes], out: Path, nproc: int = 2) -> list[int]:
    """Wait until every rank said :func:`say_paused`; return what each wrote (a number).

    Fails with the log's tail if the launch ends first (or after :data:`HANG_S`).
    """
    deadline = time.monotonic() + HANG_S
    while not all((out / f"paused_{rank}").exists() for rank in range(nproc)):
        assert process.poll() is None, log_tail(out)
        assert time.monotonic() < deadline, log_tail(out)
        time.sleep(0.05)
    return [int((out / f"paused_{rank}").read_text()) for rank in range(nproc)]


def assert_identical(left: Any, right: Any, where: str = "") -> None:
    """Nested dicts equal, every tensor bit for bit (dtype too); ``where`` names the key."""
    if isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_identical(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and torch.equal(left, right), where
    else:
        assert left == right, where


def final_states(out: Path) -> list[dict[str, Any]]:
    """The states the two ranks saved at their end (``state_<rank>.pt``)."""
    return [torch.load(out / f"state_{rank}.pt", weights_only=True) for rank in range(2)]
