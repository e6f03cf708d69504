"""write_step: the one commit sequence of every tier, and the save clock around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumekit.errors import StorageError
from resumekit.runtime.save_clock import CommitClock
from resumekit.save_job import SaveJob, StepTarget, write_step
from resumekit.store.catalog import list_checkpoints
from resumekit.store.commit import CommitProtocol
from resumekit.store.coordination import SingleProcess
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage


def _job(step: int) -> SaveJob:
    manifest = Manifest(step=step, world_size=1, reason="manual", tensor_format="raw")
    return SaveJob(step, False, {"w": torch.arange(4.0)}, b"train", b"rank", manifest, 0.0)


def _protocol(root: Path) -> CommitProtocol:
    return CommitProtocol(Storage(str(root)), NameFormat(), SingleProcess())


def test_write_step_commits_then_retains_then_the_clock_records_the_write(
        tmp_path: Path) -> None:
    protocol, clock, seen = _protocol(tmp_path), CommitClock(), []

    def retain() -> None:
        seen.extend((entry.step, entry.status) for entry in
                    list_checkpoints(protocol.storage, NameFormat()))

    with clock.writing(3, 16, blocking=True, held_from=None, captured=0.0) as timing:
        assert clock.estimate(16).in_flight_step == 3
        pending = write_step(_job(3), StepTarget(protocol, 0, "raw"), retain=retain,
                             timing=timing)
    assert pending.step == 3 and seen == [(3, "committed")]
    assert clock.estimate(16).in_flight_step is None and clock.bytes_per_second
    [entry] = list_checkpoints(protocol.storage, NameFormat())
    assert entry.manifest is not None and entry.manifest.save_throughput is not None
    assert entry.manifest.save_throughput.bytes == 16


def test_a_failed_write_is_a_storage_error_naming_the_step_and_nothing_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    protocol, clock = _protocol(tmp_path), CommitClock()

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", "tensors/__0_0.distcp")

    monkeypatch.setattr("resumekit.save_job.tensors.save", full)
    with pytest.raises(StorageError, match=r"save of step 5 .* failed writing"), \
            clock.writing(5, 16, blocking=True, held_from=None, captured=0.0) as timing:
        write_step(_job(5), StepTarget(protocol, 0, "raw"), retain=pytest.fail,
                   timing=timing)
    assert clock.estimate(16).in_flight_step is None
    assert list_checkpoints(protocol.storage, NameFormat()) == []
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    with pytest.raises(OSError, match="No space") as raised:
        write_step(_job(5), StepTarget(protocol, 0, "raw", alone=True, name_failures=False),
                   retain=pytest.fail)
    assert type(raised.value) is OSError
