"""One data file per rank, written in parts by several threads (issue 40 item 3).

A checkpoint of W ranks is 2W + 3 files: per rank its data file (``__<rank>_0.distcp``,
its checksums in a trailer at its end) and its rank state; ``manifest.json``,
``train_state.pt`` and ``tensors/.metadata``. The writer threads each write one part of the
rank's file at an offset worked out before writing and hash it; the manifest records the
file's checksum as one of parts, which a reader of the file from its start checks byte for
byte (``resumekit verify``, a restore's checks, peer copies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resumekit import CheckpointManager
from resumekit import tensors as tensor_io
from resumekit.errors import CorruptCheckpointError, StorageError
from resumekit.store.catalog import verify_checkpoint
from resumekit.store.manifest import (
    PARTS_ALGORITHM,
    Checksum,
    checksum_chunks,
    hex_digest,
    parse_parts_checksum,
    parts_checksum,
)
from resumekit.store.storage import Storage
from resumekit.tensors.raw import writer as raw_writer
from tests.unit.test_cli_support import run_cli, run_json

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Eight 256 KiB weights (stored alone) and small biases (packed): four parts' worth.
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def _files(step: Path) -> list[str]:
    return sorted(path.relative_to(step).as_posix() for path in step.rglob("*")
                  if path.is_file())


def test_a_checkpoint_is_one_data_file_and_one_rank_state_per_rank_and_three_more(
        tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, model=_model(), retention=None)
    manager.save(1)
    manager.close()
    step = tmp_path / "step_000000001"
    assert _files(step) == ["manifest.json", "rank_state/rank_00000.pt", "tensors/.metadata",
                            "tensors/__0_0.distcp", "train_state.pt"]
    manifest = json.loads((step / "manifest.json").read_text())
    (entry,) = [entry for entry in manifest["files"] if entry["path"].endswith(".distcp")]
    parts = parse_parts_checksum(entry["checksum"])
    assert parts is not None and len(parts) == tensor_io.DEFAULT_THREAD_COUNT + 1  # + trailer
    assert sum(length for length, _ in parts) == entry["size"]
    data = (step / entry["path"]).read_bytes()
    at = 0
    for length, digest in parts:  # each part's checksum is of its own bytes, in file order
        assert hex_digest(data[at:at + length]) == digest
        at += length


def test_a_flipped_byte_in_any_part_or_the_trailer_fails_verify_naming_the_file(
        tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, model=_model(), retention=None)
    manager.save(1)
    manager.close()
    storage = Storage(tmp_path)
    verify_checkpoint(storage, "step_000000001")
    path = tmp_path / "step_000000001" / "tensors" / "__0_0.distcp"
    manifest = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    (entry,) = [entry for entry in manifest["files"] if entry["path"].endswith(".distcp")]
    parts = parse_parts_checksum(entry["checksum"])
    assert parts is not None
    at = 0
    for length, _ in parts:
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[at + length // 2] ^= 0x20
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match="fails its checksum") as caught:
            verify_checkpoint(storage, "step_000000001")
        assert caught.value.file == "tensors/__0_0.distcp"
        path.write_bytes(original)
        at += length
    verify_checkpoint(storage, "step_000000001")


def test_a_running_checksum_like_one_of_parts_matches_only_the_same_bytes_cut_the_same_way(
) -> None:
    data = bytes(range(256)) * 40
    expected = parts_checksum([(1000, hex_digest(data[:1000])),
                               (4000, hex_digest(data[1000:5000])),
                               (len(data) - 5000, hex_digest(data[5000:]))])
    assert expected.startswith(f"{PARTS_ALGORITHM}:")
    for size in (1, 7, 999, 1000, 4096, len(data)):  # any chunking of the same bytes
        running = Checksum.like(expected)
        for start in range(0, len(data), size):
            running.update(data[start:start + size])
        assert running.value() == expected, size
    assert checksum_chunks([data], like=expected) == expected
    assert checksum_chunks([data[:-1]], like=expected) != expected  # cut short
    assert checksum_chunks([data + b"\0"], like=expected) != expected  # longer
    assert checksum_chunks([data[:999], data[999:]], like=expected) == expected
    moved = data[:999] + data[1000:1001] + data[999:1000] + data[1001:]
    assert checksum_chunks([moved], like=expected) != expected  # two bytes swapped
    # A whole-file checksum is still one: "xxh3_128:<hex>".
    assert checksum_chunks([data], like="xxh3_128:00") == checksum_chunks([data])


def test_a_part_that_ends_elsewhere_than_planned_fails_the_save_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planned = raw_writer._planned_bytes

    def one_page_short(items: Any) -> int:
        return int(planned(items)) - 4096

    monkeypatch.setattr(raw_writer, "_planned_bytes", one_page_short)
    with pytest.raises(StorageError, match=r"__0_0\.distcp.*planned as bytes") as caught:
        tensor_io.save({"w": torch.randn(64, 1024), "b": torch.randn(3)}, tmp_path / "ckpt")
    assert caught.value.file == "__0_0.distcp"


def test_the_parts_plan_matches_what_is_written_for_any_mix_of_sizes(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(7)
    lengths = [0, 1, 3, 15, 16, 17, 4095, 4096, 4097, 16_383, 16_384, 65_535, 65_536,
               65_537, 200_001, 1_048_575, 1_048_576]
    state: dict[str, Any] = {f"t{number}": torch.randint(0, 255, (length,), dtype=torch.uint8,
                                                          generator=generator)
                             for number, length in enumerate(lengths * 3)}
    state["many"] = {f"s{number}": torch.randn(number % 700 + 1, generator=generator)
                     for number in range(900)}  # regions that fill up and close
    state["count"] = 3
    for threads in (1, 2, 3, 4):
        directory = tmp_path / f"threads{threads}"
        written = tensor_io.save(state, directory, thread_count=threads)  # checks each part
        (data,) = [file for file in written if file.name.endswith(".distcp")]
        parts = parse_parts_checksum(data.checksum)
        assert parts is not None and len(parts) == threads + 1
        loaded: dict[str, Any] = {
            key: (torch.zeros_like(value) if isinstance(value, torch.Tensor) else
                  {k: torch.zeros_like(v) for k, v in value.items()}
                  if isinstance(value, dict) else 0)
            for key, value in state.items()}
        tensor_io.load(loaded, directory)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[key], value), (threads, key)
        assert all(torch.equal(loaded["many"][k], v) for k, v in state["many"].items())
        assert loaded["count"] == 3


def test_inspect_shows_the_data_files_checksum_of_parts_by_its_count_and_json_in_full(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manager = CheckpointManager(tmp_path, model=_model(), retention=None)
    manager.save(1)
    manager.close()
    step = str(tmp_path / "step_000000001")
    code, out, _ = run_cli(capsys, "inspect", step)
    assert code == 0
    (line,) = [line for line in out.splitlines() if "__0_0.distcp" in line]
    assert f"{PARTS_ALGORITHM}: {tensor_io.DEFAULT_THREAD_COUNT + 1} parts" in line
    code, document, _ = run_json(capsys, "inspect", step, "--json")
    assert code == 0
    (entry,) = [item for item in document["files"] if item["path"].endswith(".distcp")]
    manifest = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    assert entry["checksum"] == next(item["checksum"] for item in manifest["files"]
                                     if item["path"] == entry["path"])
