"""A dropped connection while restoring from S3 is a storage error, never corruption.

Issue 29, finding 4a. On S3 the tensors are in DCP's own format, read through DCP's
fsspec reader. A shard whose every read loses its connection must not make a good step
"unusable": restore retries it, then raises a transient
:class:`~resumekit.errors.StorageError` naming the step and the file, sets nothing aside
and does not fall back to an older step (which the next save would collide with); once
the store answers again the same step restores.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from typing import Any

import pytest
import tenacity
import torch
from botocore.exceptions import ConnectionClosedError
from torch import nn

from resumekit.errors import CorruptCheckpointError, StorageError
from resumekit.manager import CheckpointManager
from resumekit.store import retry
from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from resumekit.tensors.raw import FsspecFiles as FsspecFileSystem
from resumekit.warnings import ResumekitWarning
from tests.storage_backends import S3Endpoint

SHARD = "__0_0.distcp"


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF", tenacity.wait_none())


def _manager(url: str, endpoint: S3Endpoint, seed: int) -> CheckpointManager:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return CheckpointManager(url, storage_options=endpoint.storage_options, model=model,
                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             retention=None)


def _cut_every_read_of(monkeypatch: pytest.MonkeyPatch, step_name: str) -> list[str]:
    """Every read DCP's fsspec reader makes of ``step_name``'s first shard loses its
    connection (botocore's ``ConnectionClosedError``, as s3fs raises it after its own
    retries)."""
    real = FsspecFileSystem.create_stream
    cut: list[str] = []

    def create_stream(self: FsspecFileSystem, path: Any, mode: str) -> Any:
        where = str(path)
        if "r" in mode and f"/{step_name}/" in where and where.endswith(SHARD):
            cut.append(where)
            raise ConnectionClosedError(endpoint_url=f"http://127.0.0.1/{where}")
        return real(self, path, mode)

    monkeypatch.setattr(FsspecFileSystem, "create_stream", create_stream)
    return cut


def test_a_shard_whose_reads_all_lose_their_connection_raises_a_transient_error_sets_nothing_aside(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"s3://{s3_endpoint.bucket}/rk-{uuid.uuid4().hex[:12]}"
    saver = _manager(url, s3_endpoint, seed=0)
    saver.save(100)
    with torch.no_grad():
        saver.state.model.weight.add_(1.0)  # type: ignore[union-attr]
    saved = saver.state.model.weight.detach().clone()  # type: ignore[union-attr]
    saver.save(200)
    saver.close()

    with pytest.MonkeyPatch.context() as patch:
        cut = _cut_every_read_of(patch, "step_000000200")
        resumed = _manager(url, s3_endpoint, seed=1)
        with caplog.at_level(logging.WARNING, "resumekit"), warnings.catch_warnings():
            warnings.simplefilter("error", ResumekitWarning)  # no fallback, nothing set aside
            with pytest.raises(StorageError) as caught:
                resumed.restore()
    error = caught.value
    assert not isinstance(error, CorruptCheckpointError)
    message = str(error)
    assert "step_000000200" in message and SHARD in message
    assert "transient" in message and "nothing was set aside" in message
    assert error.attempts == retry.READ_ATTEMPTS
    assert len(cut) >= retry.READ_ATTEMPTS
    assert sum("retrying" in record.getMessage() for record in caplog.records) \
        >= retry.READ_ATTEMPTS - 1
    store = Storage(url, s3_endpoint.storage_options)
    entries = {entry.name: entry.status for entry in list_checkpoints(store)}
    assert entries == {"step_000000100": "committed", "step_000000200": "committed"}
    assert [name for name, _ in store.list_names() if name.startswith(".step")] == []

    again = _manager(url, s3_endpoint, seed=2)  # the store answers again: the same step
    assert again.restore() == 200
    assert torch.equal(again.state.model.weight, saved)  # type: ignore[union-attr]
