"""Block checksums live with the data files they check, not in ``.metadata`` (issue 40).

Every restoring rank reads ``.metadata`` (or is sent it); the block checksums of the items
stored alone are needed only by the reader of their file, so since ``schema_version`` 3
they are out of it: in the writing rank's checksum file then, and since ``schema_version``
4 in the trailer that ends the rank's one data file, each such item recording one shared
descriptor, ``resumekit-raw/5``. The trailer is checked against its footer (and the
manifest) before use; what it says about an item must agree with ``.metadata``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from resumekit import tensors
from resumekit.errors import (
    CorruptCheckpointError,
    UnreadableFormatError,
)
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.tensors import metadata_file
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors.raw.format import (
    TRAILER,
    TRAILER_ALONE_DESCRIPTORS,
    TRAILER_MAGIC,
    decode_file_trailer,
    trailer_length,
    wrap_trailer,
)
from resumekit.tensors.reader import read_metadata_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LARGE = raw_tensor_files.PACK_ITEM_BYTES // 4 * 3  # float32 elements: 192 KiB, 3 blocks


def state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {"big": torch.randn(LARGE, generator=generator),
                      "wide": torch.randn(4, LARGE // 4, generator=generator),
                      "small": torch.randn(7, generator=generator)}}


def blank(saved: dict[str, Any]) -> dict[str, Any]:
    return {"model": {key: torch.zeros_like(value) for key, value in saved["model"].items()}}


def _info(directory: Path, key: str) -> Any:
    metadata = tensors.read_metadata(directory)
    return next(info for index, info in (metadata.storage_data or {}).items()
                if index.fqn == key)


def _trailer(path: Path) -> tuple[int, dict[str, Any]]:
    """Where data file ``path``'s trailer starts, and its JSON body."""
    data = path.read_bytes()
    start = len(data) - trailer_length(data[-TRAILER.size:], len(data), where=str(path))
    body = TRAILER.unpack(data[-TRAILER.size:])[0]
    return start, json.loads(data[start:start + body])


def _rewrite_trailer(path: Path, start: int, body: dict[str, Any]) -> None:
    """Replace the trailer of ``path`` (at ``start``) by one holding ``body``, footer right."""
    path.write_bytes(path.read_bytes()[:start] + wrap_trailer(json.dumps(body).encode()))


def test_metadata_holds_no_block_checksum_and_its_bytes_depend_on_the_structure_only(
        tmp_path: Path) -> None:
    tensors.save(state(1), tmp_path / "a")
    tensors.save(state(2), tmp_path / "b")
    a = (tmp_path / "a" / DCP_METADATA_FILE).read_bytes()
    assert a == (tmp_path / "b" / DCP_METADATA_FILE).read_bytes()
    # no XXH3-128 in hex but those of its own pieces (its head's, its parts')
    length, head_sum = metadata_file.read_head_length(a, "a")
    head = metadata_file.parse_head(a[metadata_file.FRAME_BYTES:metadata_file.FRAME_BYTES
                                      + length], head_sum, "a")
    own = {checksum.split(":")[1].encode() for checksum in
           [head_sum, *(checksum for _, _, checksum in head.parts)]}
    assert set(re.findall(rb"[0-9a-f]{32}", a)) == own
    metadata = read_metadata_bytes(a, "a")
    alone = [info for index, info in metadata.storage_data.items()
             if index.fqn in ("model.big", "model.wide")]
    assert [tuple(info.transform_descriptors) for info in alone] == [
        TRAILER_ALONE_DESCRIPTORS] * 2
    assert alone[0].transform_descriptors is alone[1].transform_descriptors  # pickled once
    (name,) = {info.relative_path for info in metadata.storage_data.values()}
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == [DCP_METADATA_FILE, name]
    listed = decode_file_trailer((tmp_path / "a" / name).read_bytes(), where=name)
    for info in alone:
        length, block, blocks = listed.items[(info.relative_path, info.offset)]
        assert length == info.length and len(blocks) == -(-length // block) > 1
    assert _trailer(tmp_path / "a" / name)[1] != _trailer(tmp_path / "b" / name)[1]


def test_a_flipped_byte_of_an_item_stored_alone_names_its_key_file_and_block(
        tmp_path: Path) -> None:
    saved = state(3)
    tensors.save(saved, tmp_path / "ckpt")
    loaded = blank(saved)
    tensors.load(loaded, tmp_path / "ckpt")
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    info = _info(tmp_path / "ckpt", "model.wide")
    block = raw_tensor_files.block_bytes_for(info.length)
    path = tmp_path / "ckpt" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + block + 5] ^= 0x10  # in the second block
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as caught:
        tensors.load(blank(saved), tmp_path / "ckpt")
    assert caught.value.key == "model.wide"
    assert f"at offset {info.offset + block} " in str(caught.value)
    assert info.relative_path in str(caught.value)
    piece = {"model": {"wide": torch.zeros_like(saved["model"]["wide"])}}
    with pytest.raises(CorruptCheckpointError, match=r"model\.wide"):
        tensors.load_subset(piece, tmp_path / "ckpt")
    # Unverified (the trailer is not even read), the bytes come back as they lie.
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size - len(TRAILER_MAGIC))
        handle.write(b"X" * len(TRAILER_MAGIC))
    unchecked = blank(saved)
    tensors.load(unchecked, tmp_path / "ckpt", verify=False)
    assert torch.equal(unchecked["model"]["big"], saved["model"]["big"])


@pytest.mark.parametrize("damage", ["length", "unlisted", "blocks", "format", "flipped",
                                    "missing"])
def test_a_trailer_that_disagrees_with_the_metadata_or_its_footer_fails_the_load_naming_it(
        tmp_path: Path, damage: str) -> None:
    saved = state(4)
    directory = tmp_path / "ckpt"
    tensors.save(saved, directory)
    info = _info(directory, "model.big")
    path = directory / info.relative_path
    start, body = _trailer(path)
    entries = body["items"][info.relative_path]
    entry = next(entry for entry in entries if entry[0] == info.offset)
    expected: type[Exception] = CorruptCheckpointError
    match = "not listed"
    if damage == "length":
        entry[1] += 4
        entry[3] += "0" * 32 if -(-entry[1] // entry[2]) > len(entry[3]) // 32 else ""
    elif damage == "unlisted":
        entries.remove(entry)
    elif damage == "blocks":
        entry[3] = entry[3][:-32]
        expected, match = UnreadableFormatError, "unreadable"
    elif damage == "format":
        body["format"] = "resumekit-raw-trailer/9"
        expected, match = UnreadableFormatError, "unknown format"
    if damage == "flipped":
        data = bytearray(path.read_bytes())
        data[start + 3] ^= 0x01
        path.write_bytes(bytes(data))
        match = "does not match"
    elif damage == "missing":
        with open(path, "r+b") as handle:
            handle.truncate(start)
        match = "cut short"
    else:
        _rewrite_trailer(path, start, body)
    with pytest.raises(expected, match=match) as caught:
        tensors.load(blank(saved), directory)
    assert path.name in str(caught.value) and Path(caught.value.file).name == path.name
