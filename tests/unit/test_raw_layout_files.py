"""A reader works out the packed regions of the data files it reads only.

The checksums of packed regions live in each writing rank's checksum file; a restoring
rank that read every rank's (what it did before issue 40) paid a cost that grows with the
world size that wrote the checkpoint, in file opens on the store.
"""

from __future__ import annotations

from torch.distributed.checkpoint.filesystem import _StorageInfo

from resumekit.tensors.raw.format import FORMAT_NAME, PACK_FORMAT_VERSION, FileLayout


def _storage_data(ranks: int) -> dict[str, _StorageInfo]:
    head = f"{FORMAT_NAME}/{PACK_FORMAT_VERSION}"
    return {f"item{rank}": _StorageInfo(f"__{rank}_0.distcp", 0, 10, transform_descriptors=[
        f"{head};4096;__{rank}_checksums.json"]) for rank in range(ranks)}


def test_the_layout_of_one_rank_s_files_reads_that_rank_s_checksum_file_only() -> None:
    asked: list[str] = []

    def checksums(name: str) -> dict[tuple[str, int], tuple[int, str]]:
        asked.append(name)
        rank = name.split("_")[2]
        return {(f"__{rank}_0.distcp", 0): (4096, "ab" * 16)}

    layout = FileLayout(_storage_data(8), str, checksums, files={"__3_0.distcp"})
    assert asked == ["__3_checksums.json"]
    assert layout.raw == {"__3_0.distcp"}
    assert layout.regions == {"__3_0.distcp": [(0, 4096, "ab" * 16)]}
    asked.clear()
    FileLayout(_storage_data(8), str, checksums)  # every file: every rank's
    assert sorted(asked) == [f"__{rank}_checksums.json" for rank in range(8)]
