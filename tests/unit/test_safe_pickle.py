"""resumekit.tensors.safe_pickle: DCP metadata is read without letting the file run code."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from resumekit.errors import CorruptCheckpointError, UnsafeCheckpointError
from resumekit.tensors.safe_pickle import DCP_METADATA_GLOBALS, load_dcp_metadata, restricted_loads


class WritesMarker:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def real_metadata_bytes(directory: Path) -> bytes:
    state = {
        "model": {"w": torch.ones(3, 2), "h": torch.zeros(4, dtype=torch.bfloat16)},
        "extra": {"lr": 0.1, "name": "run"},
    }
    dcp_save(state, storage_writer=FileSystemWriter(str(directory)), no_dist=True)
    return (directory / ".metadata").read_bytes()


def globals_referenced(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a (trusted) pickle resolves, recorded while loading it."""
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            found.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return found


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_dcp_metadata_loads_and_needs_only_allowed_globals(tmp_path: Path) -> None:
    data = real_metadata_bytes(tmp_path)
    assert globals_referenced(data) <= DCP_METADATA_GLOBALS
    metadata = load_dcp_metadata(data, source=str(tmp_path / ".metadata"))
    assert metadata.state_dict_metadata["model.w"].size == torch.Size([3, 2])
    assert metadata.state_dict_metadata["model.h"].properties.dtype == torch.bfloat16
    assert set(metadata.state_dict_metadata) == set(pickle.loads(data).state_dict_metadata)


def test_a_pickle_that_would_run_a_shell_command_is_refused_and_never_runs(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(WritesMarker(marker))
    source = str(tmp_path / ".metadata")
    with pytest.raises(UnsafeCheckpointError) as caught:
        load_dcp_metadata(payload, source=source)
    assert not marker.exists()
    assert source in str(caught.value)
    assert caught.value.refused == f"{os.system.__module__}.system"
    assert caught.value.refused in str(caught.value)
    # the payload is real: plain pickle runs it
    pickle.loads(payload)
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_payload_hidden_inside_genuine_metadata_is_refused(tmp_path: Path) -> None:
    metadata = pickle.loads(real_metadata_bytes(tmp_path))
    marker = tmp_path / "pwned"
    metadata.planner_data = {"model.w": WritesMarker(marker)}
    with pytest.raises(UnsafeCheckpointError, match="system"):
        load_dcp_metadata(pickle.dumps(metadata), source="ckpt/.metadata")
    assert not marker.exists()


def test_a_torch_function_off_the_allow_list_is_refused_before_import() -> None:
    # protocol 0: GLOBAL torch.load, called on a string
    payload = b"ctorch\nload\n(S'/etc/passwd'\ntR."
    with pytest.raises(UnsafeCheckpointError, match=r"torch\.load"):
        load_dcp_metadata(payload, source="x/.metadata")


def test_a_persistent_id_is_refused() -> None:
    payload = b"(S'storage'\nS'0'\ntQ."  # BINPERSID of a tuple, as torch.save would emit
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        restricted_loads(payload, allowed=DCP_METADATA_GLOBALS, source="x/.metadata")


def test_a_truncated_metadata_file_is_reported_as_corrupt_naming_the_file(
    tmp_path: Path,
) -> None:
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        data = real_metadata_bytes(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"ckpt/\.metadata"):
        load_dcp_metadata(data[: len(data) // 2], source="ckpt/.metadata")


def test_a_valid_pickle_that_is_not_dcp_metadata_is_rejected() -> None:
    with pytest.raises(CorruptCheckpointError, match="holds a dict"):
        load_dcp_metadata(pickle.dumps({"state_dict_metadata": {}}), source="m")


def test_unsafe_checkpoint_errors_survive_a_process_boundary() -> None:
    error = UnsafeCheckpointError("a: refused", path="a", refused="posix.system")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.refused, str(copy)) == ("posix.system", "a: refused")
