"""What a save and ``latest()`` cost as the root fills up: requests and seconds at N.

A long run's root holds many checkpoints (``keep_every(100)`` over 100k steps: 1,000).
Nothing a save or ``latest()`` does may grow with that number. This module makes roots of
N minimal committed checkpoints cheaply (written directly with the manifest API, not saved
N times), counts what a save and ``latest()`` then ask of the store, and times them:

* **storage operations**: calls of :class:`resumekit.store.storage.Storage` methods (outermost
  only: ``read_bytes`` opening a file is one), on every backend;
* **HTTP requests** (S3 only): every request the S3 client sends, DCP's writes included.

Tests use :func:`count_storage_calls` and :func:`populate` to assert the counts stay
flat; ``python -m benchmarks.run`` reports ``save_requests_at_1000_vs_10`` and
``latest_seconds_at_1000_vs_10`` from :func:`measure`.
"""

from __future__ import annotations

import collections
import functools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec.asyn

from resumekit.manager import CheckpointManager
from resumekit.store.layout import ATTEMPT_PREFIX, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, FileEntry, Manifest, checksum_chunks
from resumekit.store.retention import RetentionPolicy, keep_every, keep_last
from resumekit.store.storage import Storage

#: Storage methods counted as one operation each (what touches the store).
COUNTED = ("exists", "is_dir", "is_file", "list_dir", "list_names", "walk_files", "size",
           "mtime", "open", "read_bytes", "read_small", "iter_chunks", "write_bytes",
           "write_bytes_exclusive", "make_dirs", "make_dir_exclusive", "remove_tree",
           "remove_file", "fsync_file", "fsync_dir", "rename_dir", "exchange_dirs",
           "root_stamp")
#: Checkpoints of a populated root are multiples of this step (``keep_every`` keeps them).
MILESTONE = 100
#: Saves between milestones (the last few of them are kept by ``keep_last``).
SAVE_EVERY = 10


@contextmanager
def count_storage_calls() -> Iterator[collections.Counter[str]]:
    """Count the :class:`Storage` operations of every instance while the block runs.

    Only outermost calls count (a method calling another, e.g. ``read_bytes`` calling
    ``open``, is one operation), per thread.

    Yields:
        A counter of method name -> calls, filled in as the block runs.
    """
    counts: collections.Counter[str] = collections.Counter()
    local = threading.local()
    lock = threading.Lock()
    originals = {name: getattr(Storage, name) for name in COUNTED if hasattr(Storage, name)}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(self: Storage, *args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            if depth == 0:
                with lock:
                    counts[name] += 1
            local.depth = depth + 1
            try:
                return method(self, *args, **kwargs)
            finally:
                local.depth = depth
        return counted

    try:
        for name, method in originals.items():
            setattr(Storage, name, wrap(name, method))
        yield counts
    finally:
        for name, method in originals.items():
            setattr(Storage, name, method)


@contextmanager
def count_s3_requests(storage: Storage) -> Iterator[list[int]]:
    """Count the HTTP requests the S3 client of ``storage`` sends while the block runs.

    Yields:
        A one-element list holding the count so far.
    """
    fs = storage.fs
    client = fsspec.asyn.sync(fs.loop, fs.set_session)
    events = client.meta.events
    seen = [0]

    def before_send(**_: Any) -> None:
        seen[0] += 1

    events.register("before-send.s3", before_send)
    try:
        yield seen
    finally:
        events.unregister("before-send.s3", before_send)


def checkpoint_steps(count: int) -> list[int]:
    """Steps of a root of ``count`` checkpoints under ``keep_every(100) | keep_last(3)``.

    Milestones (multiples of :data:`MILESTONE`) and, above them, the three newest saves.
    """
    if count <= 3:
        return [SAVE_EVERY * (i + 1) for i in range(count)]
    milestones = [MILESTONE * (i + 1) for i in range(count - 3)]
    return milestones + [milestones[-1] + SAVE_EVERY * (i + 1) for i in range(3)]


def policy() -> RetentionPolicy:
    """The retention of a long run: milestones and the three newest."""
    return keep_every(MILESTONE) | keep_last(3)


def populate(storage: Storage, steps: Sequence[int],
             name_format: NameFormat | None = None) -> None:
    """Write a minimal committed checkpoint of each step directly (no save, no protocol).

    Each is one small data file and its manifest, laid out as the commit protocol lays
    them out on that store (POSIX: ``<name>/``; object stores: ``<name>/attempt-<t>/``).
    """
    name_format = name_format or NameFormat()
    payload = b"resumekit root-cost filler\n"
    checksum = checksum_chunks([payload])
    blobs: dict[str, bytes] = {}
    for step in steps:
        name = name_format.build(step)
        data_dir = "." if storage.atomic_rename else f"{ATTEMPT_PREFIX}{secrets.token_hex(6)}"
        data = "data.bin" if data_dir == "." else f"{data_dir}/data.bin"
        manifest = Manifest(step=step, data_dir=data_dir, files=[
            FileEntry(path="data.bin", size=len(payload), checksum=checksum)])
        blobs[f"{name}/{data}"] = payload
        blobs[f"{name}/{MANIFEST_NAME}"] = manifest.to_json()
    if storage.is_local:
        for relative, blob in blobs.items():
            storage.write_bytes(relative, blob)
        return
    storage.fs.pipe({storage.path(relative): blob for relative, blob in blobs.items()})


def _manager(url: str, storage_options: dict[str, Any] | None) -> CheckpointManager:
    # No model: the populated checkpoints hold no tensors, and the measure is the root's
    # cost, not the state's (train state, RNG and the manifest are still written).
    return CheckpointManager(url, retention=policy(), storage_options=storage_options)


def prepare(url: str, count: int, *, storage_options: dict[str, Any] | None = None) -> None:
    """Fill the (empty) root at ``url`` with ``count`` checkpoints of a long run.

    The newest three are saved for real (restorable); the others, the milestones, are
    written directly by :func:`populate`.
    """
    storage = Storage(url, storage_options)
    steps = checkpoint_steps(count)
    populate(storage, steps[:-3])
    writer = _manager(url, storage_options)
    try:
        for step in steps[-3:]:
            writer.save(step)
    finally:
        writer.close()


def measure(url: str, count: int, *, storage_options: dict[str, Any] | None = None,
            latest_repeats: int = 5, prepared: bool = False) -> dict[str, Any]:
    """Requests and seconds of one steady-state save and of ``latest()`` in a root of N.

    The root at ``url`` is filled by :func:`prepare` (unless ``prepared``); a manager
    restores, saves once (the first save claims the root's generation), then the measured
    save follows (it deletes one checkpoint, as a long run's saves do), and ``latest()``.

    Returns:
        ``storage_ops_per_save``, ``http_requests_per_save`` (S3; else None),
        ``save_seconds``, ``storage_ops_per_latest``, ``latest_seconds`` (median of
        ``latest_repeats``), ``storage_ops_per_restore``, ``http_requests_per_latest``.
    """
    if not prepared:
        prepare(url, count, storage_options=storage_options)
    storage = Storage(url, storage_options)
    steps = checkpoint_steps(count)
    s3 = storage.url.startswith(("s3://", "s3a://"))
    manager = _manager(url, storage_options)
    try:
        with count_storage_calls() as restore_ops:
            manager.restore()
        step = (steps[-1] if steps else 0) + SAVE_EVERY
        manager.save(step)
        step += SAVE_EVERY
        with count_storage_calls() as save_ops, \
                (count_s3_requests(storage) if s3 else _nothing()) as http:
            begin = time.perf_counter()
            manager.save(step)
            save_seconds = time.perf_counter() - begin
        with count_storage_calls() as latest_ops, \
                (count_s3_requests(storage) if s3 else _nothing()) as latest_http:
            found = manager.latest()
        assert found is not None and found.step == step, (found, step)
        latest_seconds = [time_latest(manager, step) for _ in range(latest_repeats)]
    finally:
        manager.close()
    return {
        "checkpoints": count,
        "storage_ops_per_restore": sum(restore_ops.values()),
        "storage_ops_per_save": sum(save_ops.values()),
        "save_ops_by_kind": dict(save_ops),
        "http_requests_per_save": http[0] if s3 else None,
        "save_seconds": save_seconds,
        "storage_ops_per_latest": sum(latest_ops.values()),
        "http_requests_per_latest": latest_http[0] if s3 else None,
        "latest_seconds": sorted(latest_seconds)[len(latest_seconds) // 2],
        "newest_step": step,
    }


def time_latest(manager: CheckpointManager, step: int) -> float:
    """Seconds of one ``manager.latest()``, which must find ``step``."""
    begin = time.perf_counter()
    found = manager.latest()
    seconds = time.perf_counter() - begin
    assert found is not None and found.step == step, (found, step)
    return seconds


@contextmanager
def _nothing() -> Iterator[list[int]]:
    yield [0]


def bench_root_cost(roots: Callable[[str], tuple[str, dict[str, Any] | None]],
                    counts: Sequence[int] = (0, 10, 100, 1000),
                    latest_rounds: int = 21) -> dict[str, Any]:
    """:func:`measure` at each count, in a root of its own (``roots(label)`` makes one).

    Every root is filled first, then each is measured, so every measurement sees the same
    store (a loopback S3 server's per-request work grows with its bucket's keys, all
    roots' together: that is the fake server's cost, not resumekit's). ``latest()`` is
    then timed in rounds that alternate between the roots (median per root).

    Returns:
        ``{"by_count": {N: figures}, "save_requests_at_1000_vs_10": ...,
        "latest_seconds_at_1000_vs_10": ...}``: the largest count against 10 (None
        without both). Requests are HTTP requests on S3, storage operations elsewhere.
    """
    where = {count: roots(f"n{count}") for count in counts}
    for count, (url, options) in where.items():
        prepare(url, count, storage_options=options)
    by_count = {count: measure(url, count, storage_options=options, prepared=True,
                               latest_repeats=1)
                for count, (url, options) in where.items()}
    managers = {count: _manager(url, options) for count, (url, options) in where.items()}
    stores = {count: Storage(url, options) for count, (url, options) in where.items()}
    newest = {count: NameFormat().build(by_count[count]["newest_step"]) for count in counts}
    try:
        samples: dict[int, list[float]] = {count: [] for count in counts}
        floors: dict[int, list[float]] = {count: [] for count in counts}
        # latest() first, the listing floors after: a floor listing of the largest root
        # (a whole directory of 1,000 entries read) right before the next root's latest()
        # slowed that sample by ~40 % every other round (the caches it evicts), which the
        # figure then reported as growth with N.
        for round_ in range(latest_rounds):
            order = list(counts) if round_ % 2 == 0 else list(reversed(counts))
            for count in order:
                samples[count].append(
                    time_latest(managers[count], by_count[count]["newest_step"]))
        for round_ in range(latest_rounds):
            order = list(counts) if round_ % 2 == 0 else list(reversed(counts))
            for count in order:
                begin = time.perf_counter()
                stores[count].list_names(after=newest[count])
                floors[count].append(time.perf_counter() - begin)
    finally:
        for manager in managers.values():
            manager.close()
    for count, seconds in samples.items():
        by_count[count]["latest_seconds"] = sorted(seconds)[len(seconds) // 2]
        by_count[count]["latest_seconds_samples"] = seconds
        # The one listing latest() makes (names after the newest: none), alone: on a
        # local disk the whole directory is read; on S3 the server is asked for the names
        # after it (a loopback moto_server still scans every key under the prefix).
        by_count[count]["listing_floor_seconds"] = sorted(floors[count])[len(seconds) // 2]
    out: dict[str, Any] = {"by_count": by_count, "largest_count": max(counts)}
    small, large = by_count.get(10), by_count.get(max(counts))
    requests = "http_requests_per_save" if small and small["http_requests_per_save"] \
        is not None else "storage_ops_per_save"
    out["save_requests_at_1000_vs_10"] = (large[requests] / small[requests]
                                          if small and large else None)
    out["latest_seconds_at_1000_vs_10"] = (large["latest_seconds"] / small["latest_seconds"]
                                           if small and large else None)
    return out


# ------------------------------------------------------------------ loopback S3, both roots

_BUCKET = "resumekit-root-cost"


@contextmanager
def loopback_s3() -> Iterator[dict[str, Any] | str]:
    """Run ``moto_server`` on a free loopback port with one bucket, for the S3 figures.

    Yields:
        The storage options of the endpoint, or why there is none (a sentence).
    """
    script = Path(sys.executable).with_name("moto_server")
    command = str(script) if script.exists() else shutil.which("moto_server")
    try:
        import boto3  # noqa: PLC0415 - optional: the S3 figures only
        import s3fs  # noqa: F401, PLC0415
    except ImportError as error:
        yield f"the S3 figures need boto3 and s3fs ({error})"
        return
    if command is None:
        yield "moto_server is not installed (pip install 'moto[server]')"
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    process = subprocess.Popen([command, "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket=_BUCKET)
                break
            except Exception:  # noqa: BLE001 - not serving yet
                if time.monotonic() > deadline or process.poll() is not None:
                    yield f"moto_server did not serve on {url} within 60 s"
                    return
                time.sleep(0.1)
        yield {"endpoint_url": url, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_roots(work: Path, counts: Sequence[int], *, s3: bool = True) -> dict[str, Any]:
    """:func:`bench_root_cost` on a local directory under ``work`` and on loopback S3.

    Returns:
        ``{"local": ..., "s3": ... }``; ``s3`` is ``{"skipped": why}`` without an endpoint.
    """
    out: dict[str, Any] = {}
    local = Path(tempfile.mkdtemp(prefix="roots-", dir=work))
    try:
        out["local"] = bench_root_cost(lambda label: (str(local / label), None), counts)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if not s3:
        out["s3"] = {"skipped": "--root-s3 off"}
        return out
    with loopback_s3() as options:
        if isinstance(options, str):
            out["s3"] = {"skipped": options}
        else:
            run = uuid.uuid4().hex[:8]
            out["s3"] = bench_root_cost(
                lambda label: (f"s3://{_BUCKET}/{run}-{label}", options), counts)
    return out
