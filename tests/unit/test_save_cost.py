"""The fixed work of one blocking save: what it no longer does twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from resumekit.manager import CheckpointManager
from resumekit.store.commit import CommitProtocol, PendingCheckpoint
from resumekit.store.coordination import SingleProcess
from resumekit.store.manifest import FileEntry, Manifest, checksum_chunks
from resumekit.store.storage import Storage

T = TypeVar("T")


class CountingCoordinator(SingleProcess):
    """One process, counting the collectives a save asks for."""

    def __init__(self) -> None:
        self.gathers = 0
        self.broadcasts = 0

    def all_gather(self, value: T) -> list[T]:
        self.gathers += 1
        return super().all_gather(value)

    def gather(self, value: T) -> list[T] | None:
        self.gathers += 1
        return super().gather(value)

    def broadcast(self, value: T, source: int = 0) -> T:
        self.broadcasts += 1
        return super().broadcast(value, source)


def _begun(root: Path, step: int
           ) -> tuple[Storage, CountingCoordinator, CommitProtocol, PendingCheckpoint]:
    """A store, its counting ranks, their protocol, and ``step``'s save begun."""
    store = Storage(root)
    ranks = CountingCoordinator()
    protocol = CommitProtocol(store, coordinator=ranks)
    return store, ranks, protocol, protocol.begin(step)


def test_a_publish_whose_files_were_all_described_gathers_once(tmp_path: Path) -> None:
    store, ranks, protocol, pending = _begun(tmp_path, 3)
    store.write_bytes(f"{pending.staging}/shard.bin", b"abc", durable=True)
    described = [FileEntry(path="shard.bin", size=3, checksum=checksum_chunks([b"abc"]))]
    before = ranks.broadcasts
    committed = protocol.publish(pending, Manifest(step=3), described=described)
    assert ranks.gathers == 1  # the reports; no second gather of files nobody described
    assert ranks.broadcasts - before == 1  # checked and committed in one step on rank 0
    assert [(f.path, f.size) for f in committed.files] == [("shard.bin", 3)]


def test_a_publish_still_hashes_and_gathers_the_files_nobody_described(
        tmp_path: Path) -> None:
    store, ranks, protocol, pending = _begun(tmp_path, 4)
    store.write_bytes(f"{pending.staging}/extra.bin", b"12345")
    before = ranks.broadcasts
    committed = protocol.publish(pending, Manifest(step=4))
    assert ranks.gathers == 2
    assert ranks.broadcasts - before == 2  # what to describe; then the commit
    assert [(f.path, f.size, f.checksum) for f in committed.files] == [
        ("extra.bin", 5, checksum_chunks([b"12345"]))]


def test_a_publish_given_this_ranks_failure_raises_it_and_commits_nothing(
        tmp_path: Path) -> None:
    _, ranks, protocol, pending = _begun(tmp_path, 5)
    failure = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left") as raised:
        protocol.publish(pending, Manifest(step=5), failure=failure)
    assert raised.value is failure and ranks.gathers == 1  # told in the reports' gather
    assert not (tmp_path / protocol.name_format.build(5)).exists()


def test_a_managers_save_gathers_once_the_writes_outcome_riding_with_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gathers: list[tuple[str, object]] = []
    originals = {name: getattr(SingleProcess, name) for name in ("all_gather", "gather")}
    for name in originals:
        def counted(self: SingleProcess, value: T, _name: str = name) -> Any:
            gathers.append((_name, value))
            return originals[_name](self, value)

        monkeypatch.setattr(SingleProcess, name, counted)
    manager = CheckpointManager(tmp_path, model=torch.nn.Linear(4, 4), retention=None)
    manager.save(1)
    before = len(gathers)
    manager.save(2)
    manager.close()
    # publish's gather to rank 0, nothing before it, and no all-gather
    assert [name for name, _ in gathers[before:]] == ["gather"], gathers[before:]
