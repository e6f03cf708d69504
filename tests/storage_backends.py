"""Storage backends every store test can run against, as pytest fixtures.

``storage_factory`` is parametrised over four backends and hands out fresh, empty roots:

* ``local``: a plain path under ``tmp_path``;
* ``file``: the same kind of directory addressed as a ``file://`` URL;
* ``memory``: fsspec's in-memory filesystem (process-global, so every root is unique and
  removed after the test);
* ``s3``: a real S3 HTTP endpoint (``moto_server``) on loopback, started once per session,
  reached through ``s3fs`` with ``endpoint_url`` in the storage options.

The first two publish with a POSIX rename; the last two use the object-store mode of the
commit protocol (data under ``step_X/attempt-<token>/``, ``manifest.json`` written last).

Registered for the whole suite by ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from resumekit.store.catalog import read_manifest
from resumekit.store.commit import CommitProtocol
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage
from tests.limits import HANG_S

BACKENDS = ("local", "file", "memory", "s3")
#: Backends whose commit point is an atomic directory rename.
POSIX_BACKENDS = frozenset({"local", "file"})

_BUCKET = "resumekit-tests"
_STARTUP_S = HANG_S  # a hang detector: a loaded machine starts it late


@dataclass(frozen=True)
class S3Endpoint:
    """A running loopback S3 endpoint with one bucket."""

    url: str
    bucket: str
    storage_options: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _moto_command(port: int) -> list[str] | None:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script), "-H", "127.0.0.1", "-p", str(port)]
    if shutil.which("moto_server"):
        return ["moto_server", "-H", "127.0.0.1", "-p", str(port)]
    return None


def _wait_until_serving(process: subprocess.Popen[bytes], url: str) -> str | None:
    """Poll the endpoint until it answers HTTP; return why not if it never does."""
    deadline = time.monotonic() + _STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"moto_server exited with status {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return None
        except urllib.error.HTTPError:
            return None  # any HTTP answer means it is serving
        except OSError:
            time.sleep(0.05)
    return f"moto_server did not answer on {url} within {_STARTUP_S:.0f} s"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """Start ``moto_server`` on a free loopback port, create a bucket, stop it at the end."""
    from tests.conftest import unavailable  # noqa: PLC0415 - conftest imports this module

    try:
        import boto3  # noqa: PLC0415 - optional: only the S3 backend needs it
        import s3fs  # noqa: F401, PLC0415 - the client under test
    except ImportError as error:
        unavailable(f"the S3 backend needs boto3 and s3fs: {error}")
    port = _free_port()
    command = _moto_command(port)
    if command is None:
        unavailable("moto_server is not installed (pip install 'moto[server]')")
        return
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        problem = _wait_until_serving(process, url)
        if problem is not None:
            unavailable(problem)
        client = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=_BUCKET)
        yield S3Endpoint(
            url=url,
            bucket=_BUCKET,
            storage_options={
                "endpoint_url": url,
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"region_name": "us-east-1"},
            },
        )
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


StorageFactory = Callable[[], Storage]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test (``local``, ``file``, ``memory``, ``s3``)."""
    return str(request.param)


@pytest.fixture
def storage_factory(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StorageFactory]:
    """Return a function that makes a new, empty checkpoint root on the backend."""
    made: list[Storage] = []
    endpoint: S3Endpoint | None = None
    if backend == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")

    def make() -> Storage:
        unique = f"rk-{uuid.uuid4().hex[:12]}"
        if backend == "local":
            store = Storage(tmp_path / unique)
        elif backend == "file":
            store = Storage(f"file://{tmp_path / unique}")
        elif backend == "memory":
            store = Storage(f"memory://{unique}")
        else:
            assert endpoint is not None
            store = Storage(f"s3://{endpoint.bucket}/{unique}", endpoint.storage_options)
        made.append(store)
        return store

    yield make
    if backend == "memory":  # process-global: free it (S3 dies with its server)
        for store in made:
            store.remove_tree("")


@pytest.fixture
def storage(storage_factory: StorageFactory) -> Storage:
    """A new, empty checkpoint root on each backend in turn."""
    return storage_factory()


def save_checkpoint(
    store: Storage,
    step: int,
    files: dict[str, bytes] | None = None,
    *,
    replace: bool = False,
    name_format: NameFormat | None = None,
    manifest: Manifest | None = None,
) -> Manifest:
    """Save ``files`` (relative path -> bytes) as checkpoint ``step`` in one process."""
    protocol = CommitProtocol(store, name_format)
    pending = protocol.begin(step, replace=replace)
    try:
        for path, data in (files if files is not None else default_files(step)).items():
            store.write_bytes(f"{pending.staging}/{path}", data)
        return protocol.publish(pending, manifest or Manifest(step=step))
    except BaseException:
        protocol.abort(pending)
        raise


def default_files(step: int) -> dict[str, bytes]:
    """Two small data files whose content depends on ``step``."""
    return {
        "model/shard_0.bin": f"model weights of step {step} ".encode() * 8,
        "optim.bin": f"optimizer state of step {step}".encode(),
    }


def data_file(store: Storage, name: str, path: str) -> str:
    """Return the root-relative location of data file ``path`` of committed ``name``."""
    return f"{name}/{read_manifest(store, name).data_path(path)}"
