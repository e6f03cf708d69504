"""Each rank's share of the checks before a load: disjoint, and the metadata on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resumekit.errors import CorruptCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.restore.verification import verify_share
from resumekit.store.catalog import read_manifest
from resumekit.store.storage import Storage


def _saved(root: Path) -> tuple[Storage, str]:
    model = torch.nn.Linear(3, 2)
    with CheckpointManager(root, model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                         lr=0.1)) as ckpt:
        ckpt.save(1)
        name = ckpt.checkpoints()[-1].name
    return Storage(root), name


def _failing_ranks(storage: Storage, name: str, world_size: int) -> list[int]:
    manifest = read_manifest(storage, name)
    failing = []
    for rank in range(world_size):
        try:
            verify_share(storage, name, manifest, rank=rank, world_size=world_size)
        except CorruptCheckpointError:
            failing.append(rank)
    return failing


def test_a_flipped_small_file_is_found_by_exactly_one_rank(tmp_path: Path) -> None:
    storage, name = _saved(tmp_path)
    state = tmp_path / name / "train_state.pt"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    assert len(_failing_ranks(storage, name, world_size=3)) == 1
    assert _failing_ranks(storage, name, world_size=1) == [0]


def test_the_tensor_metadata_is_checked_on_every_rank(tmp_path: Path) -> None:
    storage, name = _saved(tmp_path)
    metadata = tmp_path / name / "tensors" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0xFF
    metadata.write_bytes(bytes(data))
    assert _failing_ranks(storage, name, world_size=3) == [0, 1, 2]


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_intact_checkpoint_passes_on_every_rank(tmp_path: Path, world_size: int) -> None:
    storage, name = _saved(tmp_path)
    assert _failing_ranks(storage, name, world_size) == []


def _metadata_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of a ``.metadata`` file through resumekit's storage or DCP's file system."""
    from torch.distributed.checkpoint import filesystem

    reads: list[str] = []
    inside = [0]  # Storage.read_bytes may open the file through Storage.open: one read
    for owner, method in ((Storage, "read_bytes"), (Storage, "iter_chunks"),
                          (Storage, "open"), (filesystem.FileSystem, "create_stream")):
        original = getattr(owner, method)

        def counted(self: object, path: object, *args: object,
                    _original: object = original, **kwargs: object) -> object:
            if str(path).endswith(".metadata") and not inside[0]:
                reads.append(str(path))
            inside[0] += 1
            try:
                return _original(self, path, *args, **kwargs)  # type: ignore[operator]
            finally:
                inside[0] -= 1

        monkeypatch.setattr(owner, method, counted)
    return reads


@pytest.mark.parametrize("verify", [True, False])
def test_a_single_process_restore_reads_the_metadata_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    _saved(tmp_path)
    model = torch.nn.Linear(3, 2)
    reads = _metadata_reads(monkeypatch)
    with CheckpointManager(tmp_path, model=model, verify_on_restore=verify,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ckpt:
        assert ckpt.restore() == 1
    assert len(reads) == 1, reads


def test_shared_metadata_names_a_corrupt_file_and_travels_as_bytes_only(
        tmp_path: Path) -> None:
    import pickle

    from resumekit.restore.verification import share_metadata
    from resumekit.store.coordination import SingleProcess

    storage, name = _saved(tmp_path)
    manifest = read_manifest(storage, name)
    checked = share_metadata(storage, name, manifest, SingleProcess())
    assert checked is not None
    sent = pickle.loads(pickle.dumps(checked))
    assert sent.__dict__["_parsed"] is None and sent.data == checked.data
    assert sent.parsed().state_dict_metadata.keys() == \
        checked.parsed().state_dict_metadata.keys()
    metadata = tmp_path / name / "tensors" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[len(data) // 2] ^= 0xFF
    metadata.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="fails its checksum") as caught:
        share_metadata(storage, name, manifest, SingleProcess())
    assert caught.value.fields["file"] == "tensors/.metadata"


def test_the_leaders_preread_for_a_group_holds_the_head_and_a_rank_alone_the_whole_file(
        tmp_path: Path) -> None:
    from resumekit.restore.verification import preread_metadata, share_metadata
    from resumekit.store.coordination import SingleProcess

    storage, name = _saved(tmp_path)
    manifest = read_manifest(storage, name)
    assert manifest.schema_version >= 5  # .metadata laid out by rank
    read = preread_metadata(storage, name, manifest)
    assert read.outcome[0] == "ok" and read.whole is not None
    assert read.whole.head is not None and not read.whole.whole  # the head alone
    alone = share_metadata(storage, name, manifest, SingleProcess())
    assert alone is not None and alone.head is None and alone.whole  # the whole file


@pytest.mark.parametrize("first_read", [256 << 10, 0])
def test_the_leader_reads_the_head_and_its_own_part_through_one_open_of_the_metadata(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_read: int) -> None:
    from resumekit.restore import verification
    from resumekit.tensors import metadata_file

    storage, name = _saved(tmp_path)
    manifest = read_manifest(storage, name)
    target = tmp_path / name / "tensors" / ".metadata"
    monkeypatch.setattr(verification, "_FIRST_READ", first_read)  # 0: the head, then the part
    reads = _metadata_reads(monkeypatch)
    read = verification.preread_metadata(storage, name, manifest)
    assert read.whole is not None and read.whole.head is not None
    assert read.whole.read_part is not None
    rows = read.whole.read_part(0)
    assert reads == [f"{name}/tensors/.metadata"], reads  # one open: the head and the part
    head = read.whole.head
    offset, length, checksum = head.parts[0]
    data = target.read_bytes()[head.base + offset:head.base + offset + length]
    assert rows == metadata_file.parse_part(data, checksum, str(target), 0)


def test_the_leaders_own_part_read_with_the_head_is_checked_when_asked_for_naming_it(
        tmp_path: Path) -> None:
    from resumekit.restore.verification import preread_metadata

    storage, name = _saved(tmp_path)
    manifest = read_manifest(storage, name)
    target = tmp_path / name / "tensors" / ".metadata"
    read = preread_metadata(storage, name, manifest, verify=False)
    assert read.whole is not None and read.whole.head is not None
    head = read.whole.head
    offset, length, _ = head.parts[0]
    data = bytearray(target.read_bytes())
    data[head.base + offset + length // 2] ^= 0xFF  # in rank 0's part: the head is intact
    target.write_bytes(bytes(data))
    read = preread_metadata(storage, name, manifest, verify=False)
    assert read.outcome[0] == "ok" and read.whole is not None  # the head is read and fine
    assert read.whole.read_part is not None
    with pytest.raises(CorruptCheckpointError, match="rank 0's part") as caught:
        read.whole.read_part(0)
    assert str(target) in str(caught.value) and caught.value.fields["rank"] == 0


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_the_leaders_head_read_of_a_truncated_or_missing_metadata_says_which_naming_it(
        tmp_path: Path, damage: str) -> None:
    from resumekit.errors import IncompleteCheckpointError
    from resumekit.restore.verification import preread_metadata

    storage, name = _saved(tmp_path)
    manifest = read_manifest(storage, name)
    target = tmp_path / name / "tensors" / ".metadata"
    size = target.stat().st_size
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        target.unlink()
    status, error = preread_metadata(storage, name, manifest).outcome
    assert status == "error" and isinstance(error, IncompleteCheckpointError), error
    assert str(target) in str(error) and error.fields["file"] == "tensors/.metadata"
    expected = f"has {size - 1} bytes, the manifest of step 1 says {size}" \
        if damage == "truncated" else "is missing"
    assert expected in str(error), error
