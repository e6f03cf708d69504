"""The one save path and the one load path on many small tensors: the same state writes the
same bytes, a changed structure still saves and loads, damage is named (issue 25)."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resumekit import tensors as tensor_io
from resumekit.errors import CorruptCheckpointError, IncompatibleCheckpointError
from resumekit.manager import CheckpointManager
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.retention import keep_all
from resumekit.tensors import raw as raw_tensor_files
from resumekit.tensors.raw import FORMAT_NAME, MEMBER_DESCRIPTORS
from resumekit.tensors.raw.format import Descriptor, decode_file_trailer
from resumekit.tensors.reader import read_metadata_bytes

# the modules, whose names the wing's functions ``load`` and ``save`` shadow
DATA = "__0_0.distcp"  # a one-rank save's one data file
load_module = importlib.import_module("resumekit.tensors.load")
save_module = importlib.import_module("resumekit.tensors.save")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def small_state(count: int = 40, seed: int = 0, size: int = 24) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{n}.weight": torch.randn(size, generator=generator)
                      for n in range(count)},
            "extra": {"scale": torch.ones(3, dtype=torch.float64)}}


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {top: {key: torch.zeros_like(value) for key, value in part.items()}
            for top, part in state.items()}


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


class _Calls:
    """Counts calls of a module function, still calling it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.count = 0
        real = getattr(module, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


def test_a_second_save_of_the_same_state_writes_the_same_bytes_and_reports_the_same_files(
    tmp_path: Path,
) -> None:
    tensor_io.save(small_state(seed=1), tmp_path / "first")
    second = small_state(seed=2)
    written = tensor_io.save(second, tmp_path / "second")
    again = tensor_io.save(second, tmp_path / "again")
    assert files_of(tmp_path / "second") == files_of(tmp_path / "again")
    assert written == again  # names, sizes, checksums and references as reported
    loaded = blank(second)
    tensor_io.load(loaded, tmp_path / "second")
    for top, part in second.items():
        for key, value in part.items():
            assert torch.equal(loaded[top][key], value), key


def test_metadata_bytes_depend_on_the_structure_only_and_checksums_are_in_the_data_file(
    tmp_path: Path,
) -> None:
    tensor_io.save(small_state(seed=1), tmp_path / "a")
    tensor_io.save(small_state(seed=2), tmp_path / "b")
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert a[DCP_METADATA_FILE] == b[DCP_METADATA_FILE]
    assert sorted(a) == [DCP_METADATA_FILE, "__0_0.distcp"]
    trailers = [decode_file_trailer(files[DATA], where=DATA) for files in (a, b)]
    assert trailers[0].regions.keys() == trailers[1].regions.keys()
    assert trailers[0].regions != trailers[1].regions  # other bytes, other checksums
    assert str(tmp_path) not in a[DCP_METADATA_FILE].decode("latin-1")  # no path in it


@pytest.mark.parametrize("change", ["shape", "dtype", "key", "nesting", "threads", "large"])
def test_a_changed_structure_is_saved_by_dcp_and_loads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str,
) -> None:
    tensor_io.save(small_state(), tmp_path / "first")
    planned = _Calls(monkeypatch, save_module, "dcp_save")
    state = small_state(seed=3)
    threads = tensor_io.DEFAULT_THREAD_COUNT
    model = state["model"]
    if change == "shape":
        model["layer7.weight"] = torch.randn(25)
    elif change == "dtype":
        model["layer7.weight"] = model["layer7.weight"].to(torch.bfloat16)
    elif change == "key":
        model["layer99.weight"] = model.pop("layer7.weight")
    elif change == "nesting":  # the same dotted key from another nesting
        state["extra"] = {"scale": {}}
        del state["extra"]
        state["extra.scale"] = torch.ones(3, dtype=torch.float64)
    elif change == "threads":
        threads = 2
    elif change == "large":  # stored alone: its blocks' checksums are in .metadata
        model["layer7.weight"] = torch.randn(raw_tensor_files.PACK_ITEM_BYTES // 4)
    tensor_io.save(state, tmp_path / "changed", thread_count=threads)
    assert planned.count == 1
    loaded = {top: ({k: torch.zeros_like(v) for k, v in part.items()}
                    if isinstance(part, dict) else torch.zeros_like(part))
              for top, part in state.items()}
    tensor_io.load(loaded, tmp_path / "changed")
    assert torch.equal(loaded["model"]["layer0.weight"], model["layer0.weight"])


def test_a_save_of_more_than_one_rank_runs_dcps_save_on_that_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensor_io.save(small_state(), tmp_path / "first")
    seen: list[Any] = []

    def two_ranks(group: Any) -> tuple[Any, bool]:
        return "a group of two", False

    def recording(state: Any, **kwargs: Any) -> None:
        seen.append((kwargs["process_group"], kwargs["no_dist"], kwargs["planner"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(save_module, "resolve_group", two_ranks)
    monkeypatch.setattr(save_module, "dcp_save", recording)
    with pytest.raises(Exception, match="stop here"):
        tensor_io.save(small_state(seed=4), tmp_path / "world")
    ((group, no_dist, planner),) = seen
    assert (group, no_dist) == ("a group of two", False)
    assert type(planner) is DefaultSavePlanner  # DCP's own, planning every save


def test_a_load_reads_every_tensor_and_names_the_files_it_verifies(tmp_path: Path) -> None:
    state = small_state(seed=5)
    tensor_io.save(state, tmp_path / "ckpt")
    loaded = blank(state)
    tensor_io.load(loaded, tmp_path / "ckpt")
    assert tensor_io.files_verified_on_read(tmp_path / "ckpt") == {
        path.name for path in (tmp_path / "ckpt").glob("*.distcp")}
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    subset = {"model": {"layer3.weight": torch.zeros(24)}}
    tensor_io.load_subset(subset, tmp_path / "ckpt")
    assert torch.equal(subset["model"]["layer3.weight"], state["model"]["layer3.weight"])


def test_a_destination_that_differs_from_a_known_layout_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    state = small_state()
    tensor_io.save(state, tmp_path / "ckpt")
    tensor_io.load(blank(state), tmp_path / "ckpt")
    wrong = blank(state)
    wrong["model"]["layer2.weight"] = torch.zeros(23)
    with pytest.raises(IncompatibleCheckpointError, match=r"layer2\.weight"):
        tensor_io.load(wrong, tmp_path / "ckpt")
    fewer = blank(state)
    del fewer["model"]["layer5.weight"]
    with pytest.raises(IncompatibleCheckpointError, match="unexpected in checkpoint"):
        tensor_io.load(fewer, tmp_path / "ckpt")


def test_a_flipped_byte_under_a_known_layout_still_names_the_damaged_tensor(
    tmp_path: Path,
) -> None:
    state = small_state(seed=6)
    tensor_io.save(state, tmp_path / "ckpt")
    tensor_io.load(blank(state), tmp_path / "ckpt")
    metadata = tensor_io.read_metadata(tmp_path / "ckpt")
    info = next(info for index, info in (metadata.storage_data or {}).items()
                if index.fqn == "model.layer9.weight")
    path = tmp_path / "ckpt" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as caught:
        tensor_io.load(blank(state), tmp_path / "ckpt")
    assert caught.value.key == "model.layer9.weight"


def test_a_damaged_checksum_trailer_fails_the_restore_naming_its_file(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(8)])
    CheckpointManager(tmp_path, model=model, retention=keep_all()).save(1)
    data_file = next(tmp_path.glob(f"step_*/tensors/{DATA}"))
    data = bytearray(data_file.read_bytes())
    data[len(data) - 4096 + 10] ^= 0x01  # in the trailer's JSON
    data_file.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=DATA) as caught:
        CheckpointManager(tmp_path, model=model, fallback=False).restore()
    assert "checksum trailer" in str(caught.value)


def test_a_checkpoint_whose_regions_carry_their_checksums_inline_still_loads(
    tmp_path: Path,
) -> None:
    # Format 2 (before the checksum files): "resumekit-raw/2;<length>;xxh3_128:<hex>".
    state = small_state(seed=7)
    directory = tmp_path / "ckpt"
    tensor_io.save(state, directory)
    listed = decode_file_trailer((directory / DATA).read_bytes(), where=DATA).regions
    sums = {key: digest for key, (_, digest) in listed.items()}
    metadata = read_metadata_bytes((directory / DCP_METADATA_FILE).read_bytes(), "test")
    for info in metadata.storage_data.values():
        if tuple(info.transform_descriptors or ()) == MEMBER_DESCRIPTORS:
            info.transform_descriptors = None  # format 2's members carried none
        elif info.transform_descriptors:
            _, length = info.transform_descriptors[0].split(";")
            digest = sums[(info.relative_path, info.offset)]
            info.transform_descriptors = [f"{FORMAT_NAME}/2;{length};xxh3_128:{digest}"]
    (directory / DCP_METADATA_FILE).write_bytes(pickle.dumps(metadata))
    data = bytearray((directory / DATA).read_bytes())
    data[-8:] = b"X" * 8  # the trailer is not read for format 2: its footer is no matter
    (directory / DATA).write_bytes(bytes(data))
    loaded = blank(state)
    tensor_io.load(loaded, directory)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    info = next(iter(metadata.storage_data.values()))
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        tensor_io.load(blank(state), directory)


def test_readers_of_earlier_formats_refuse_format_3_by_its_name() -> None:
    # What a resumekit before format 3 does with a region's descriptor: decode it as an
    # item of format 1, or as a region of format 2; both refuse, naming the format.
    text = f"{FORMAT_NAME}/3;4096;__0_checksums.json"
    with pytest.raises(CorruptCheckpointError, match=f"{FORMAT_NAME}/3"):
        Descriptor.decode(text, where="x.distcp")
    with pytest.raises(CorruptCheckpointError, match=f"{FORMAT_NAME}/3"):
        Descriptor.decode_region(text, 0, where="x.distcp")


def test_a_manager_saves_and_restores_many_small_tensors_through_dcps_save_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    manager = CheckpointManager(tmp_path, model=model, retention=keep_all())
    manager.save(1)
    planned = _Calls(monkeypatch, save_module, "dcp_save")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    manager.save(2)
    manager.close()
    assert planned.count == 1  # every save is DCP's
    other = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    loader = CheckpointManager(tmp_path, model=other)
    loader.restore()
    loaded = _Calls(monkeypatch, load_module, "dcp_load")
    loader.restore()
    assert loaded.count == 1 and loader.resumed_from == 2
    for key, value in other.state_dict().items():
        assert torch.equal(value, saved[key]), key
    loader.close()


def test_captures_and_fingerprints_run_with_the_collector_paused_on_the_main_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc  # noqa: PLC0415 - this test only

    from resumekit.state import train_state as state_module  # noqa: PLC0415 - this test only

    seen: list[bool] = []
    real = state_module._params_of

    def spy(model_state: Any) -> Any:
        seen.append(gc.isenabled())
        return real(model_state)

    monkeypatch.setattr(state_module, "_params_of", spy)
    train = state_module.TrainState(model=nn.Linear(2, 2))
    train.fingerprint_params()
    train.tensor_state()
    assert seen == [False, False]
    assert gc.isenabled()  # restored


def test_a_value_set_at_a_flattening_path_lands_where_dcps_flattening_found_it() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from resumekit.tensors.load import set_at_path

    state = {"optimizer": {"param_groups": [{"lr": 0.1}, {"lr": 0.2}]}, "step": 3}
    _, mappings = flatten_state_dict(state)
    for fqn, path in mappings.items():
        set_at_path(state, path, f"loaded {fqn}")
    assert state == {"optimizer": {"param_groups": [{"lr": "loaded optimizer.param_groups.0.lr"},
                                                    {"lr": "loaded optimizer.param_groups.1.lr"}]},
                     "step": "loaded step"}
    empty: dict[str, object] = {}
    set_at_path(empty, ("a", 1, "b"), 5)
    assert empty == {"a": [None, {"b": 5}]}


def test_a_save_asked_for_no_writer_thread_is_refused_naming_the_option(tmp_path: Path) -> None:
    from resumekit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="thread_count must be >= 1") as refused:
        tensor_io.save({"w": torch.zeros(2)}, tmp_path / "ckpt", thread_count=0)
    assert refused.value.name == "thread_count"
    assert isinstance(refused.value, ValueError)
