"""The raw writer's data file hashes each byte where it copies it (issue 40, item 4).

``AlignedFile.write`` copies a chunk into its aligned bounce buffer and hashes it there
piece by piece, for the file's checksum and each block's digest, so that the bytes are
read from memory once. The digests must be those a reader computes over the stored bytes
(one XXH3-128 per block, the file's checksum over every byte, padding included), for every
block size: blocks smaller and larger than a hashing piece, and ones that are no multiple
of it; with direct I/O (bounce buffer) and through the page cache; from a known address
in memory and from a plain buffer.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import xxhash

from resumekit.store.manifest import checksum_chunks
from resumekit.tensors.raw.files import HASH_PIECE, AlignedFile
from resumekit.tensors.raw.format import ALIGNMENT, CHUNK_BYTES
from tests.unaligned import unaligned_bytes


@pytest.mark.parametrize("block", [64 << 10, 3 * HASH_PIECE // 2 + ALIGNMENT, CHUNK_BYTES])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("with_address", [True, False])
def test_each_block_digest_and_the_file_checksum_match_the_bytes_on_disk(
        tmp_path: Path, block: int, direct: bool, with_address: bool) -> None:
    data = unaligned_bytes(2 * CHUNK_BYTES + 3 * block + 1000, seed=block)
    view = memoryview(data.numpy()).cast("B")
    stride = block * max(1, CHUNK_BYTES // block)  # as the writer cuts an item
    path = tmp_path / "__0_0.distcp"
    digests: list[str] = []
    with AlignedFile(str(path)) as handle:
        if not direct:  # as on a filesystem that refuses O_DIRECT
            fcntl.fcntl(handle.fd, fcntl.F_SETFL,
                        fcntl.fcntl(handle.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            handle.direct = False
        elif not handle.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        for start in range(0, len(view), stride):
            digests += handle.write(view[start:start + stride],
                                    data.data_ptr() + start if with_address else None,
                                    block=block)
        handle.pad()
        checksum = handle.checksum.value()
        size = handle.offset
    stored = path.read_bytes()
    assert size == len(stored) and len(stored) % ALIGNMENT == 0
    assert stored[:len(view)] == view.tobytes()
    assert set(stored[len(view):]) <= {0}
    expected = [xxhash.xxh3_128_hexdigest(stored[at:min(at + block, len(view))])
                for start in range(0, len(view), stride)
                for at in range(start, min(start + stride, len(view)), block)]
    assert digests == expected
    assert checksum == checksum_chunks([stored])


def test_a_write_without_blocks_returns_no_digests_and_still_feeds_the_file_checksum(
        tmp_path: Path) -> None:
    data = unaligned_bytes(CHUNK_BYTES + 12345, seed=1)
    view = memoryview(data.numpy()).cast("B")
    path = tmp_path / "file"
    with AlignedFile(str(path)) as handle:
        assert handle.write(view, data.data_ptr()) == []
        handle.pad()
        checksum = handle.checksum.value()
    assert checksum == checksum_chunks([path.read_bytes()])


def test_a_chunk_hashed_per_block_longer_than_a_chunk_is_refused(tmp_path: Path) -> None:
    data = bytearray(CHUNK_BYTES + ALIGNMENT)
    with AlignedFile(str(tmp_path / "file")) as handle, pytest.raises(
            ValueError, match=f"at most {CHUNK_BYTES} bytes"):
        handle.write(memoryview(data), None, block=64 << 10)
