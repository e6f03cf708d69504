"""The raw tensor format: tensors as raw bytes, checksummed as they are written and read.

A storage layer for DCP (``torch.distributed.checkpoint``); planning, resharding and the
``.metadata`` file stay DCP's own. One job per module:

* :mod:`.format`: the on-disk rules (descriptors, blocks and their checksums, packed
  regions, the checksum file) and their parsing.
* :mod:`.files`: writing one file: new only, hashed on its way out, ``O_DIRECT`` where
  the filesystem allows it, a failure named with its cause.
* :mod:`.writer`: the ``StorageWriter`` s (:class:`RawTensorWriter` for local
  directories, :class:`CheckedDcpWriter` for fsspec URLs) and their writer threads.
* :mod:`.reader`: :class:`RawTensorReading`, the in-place, block-checked reads (and
  :class:`FsspecReader`, DCP's reader at fsspec URLs).

This package re-exports what the rest of resumekit uses.
"""

from resumekit.store.manifest import hex_digest
from resumekit.tensors.raw.files import (
    FsspecFiles,
    aligned_empty,
    write_new_file,
)
from resumekit.tensors.raw.format import (
    ALIGNMENT,
    CHECKSUMS_FORMAT,
    CHUNK_BYTES,
    DATA_SUFFIX,
    FORMAT_NAME,
    MEMBER_DESCRIPTORS,
    MIN_BLOCK_BYTES,
    PACK_BYTES,
    PACK_ITEM_BYTES,
    WrittenFile,
    block_bytes_for,
    checksum_files,
    decode_checksums,
    encode_checksums,
    is_packed_member,
    is_raw,
    raw_files,
)
from resumekit.tensors.raw.reader import READ_THREADS, FsspecReader, RawTensorReading
from resumekit.tensors.raw.writer import (
    SMALL_SAVE_BYTES,
    CheckedDcpWriter,
    RankFiles,
    RawTensorWriter,
    run_writer_threads,
)

__all__ = [
    "ALIGNMENT",
    "CHECKSUMS_FORMAT",
    "CHUNK_BYTES",
    "DATA_SUFFIX",
    "FORMAT_NAME",
    "MEMBER_DESCRIPTORS",
    "MIN_BLOCK_BYTES",
    "PACK_BYTES",
    "PACK_ITEM_BYTES",
    "READ_THREADS",
    "SMALL_SAVE_BYTES",
    "CheckedDcpWriter",
    "FsspecFiles",
    "FsspecReader",
    "RankFiles",
    "RawTensorReading",
    "RawTensorWriter",
    "WrittenFile",
    "aligned_empty",
    "block_bytes_for",
    "checksum_files",
    "decode_checksums",
    "encode_checksums",
    "hex_digest",
    "is_packed_member",
    "is_raw",
    "raw_files",
    "run_writer_threads",
    "write_new_file",
]
