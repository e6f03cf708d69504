"""Hostile manifests and foreign files never crash, hang or escape.

Every file resumekit parses is read through one bounded reader
(:meth:`resumekit.store.storage.Storage.read_small` / ``read_json``): regular files only, a size
cap, a nesting cap; every path read from a file stays inside its directory; every step
read from a file is a real step number. Each failure is a ``ResumekitError`` naming the
file, and ``inspect`` lists the entry as corrupt, never as committed.

Calls that used to block (a FIFO) or run for minutes (a config of a million layers) run
on a daemon thread with a deadline here, so a regression fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file, save_model
from torch import nn

import resumekit
from resumekit.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from resumekit.manager import CheckpointManager
from resumekit.tensors.raw.format import TRAILER, trailer_length, wrap_trailer
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import (
    Trainer,
    assert_one_error_line,
    rewrite_manifest,
    run_cli,
    run_json,
    write_checkpoints,
)

STEP_10, STEP_20 = "step_000000010", "step_000000020"
DEADLINE = 60.0


def finishes(call: Callable[[], Any], seconds: float = DEADLINE) -> Any:
    """Run ``call`` on a daemon thread; fail (not hang) when it is still running later."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: blocked or unbounded"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


@pytest.fixture(scope="module")
def good_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "good"
    write_checkpoints(root, [10, 20])
    return root


@pytest.fixture
def root(good_root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "root"
    shutil.copytree(good_root, copy)
    return copy


@pytest.fixture
def fifo_manifest(root: Path) -> Iterator[Path]:
    """Step 20's manifest.json replaced by a FIFO; released at the end if a reader waits."""
    manifest = root / STEP_20 / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    yield manifest
    _release(manifest)


def _release(fifo: Path) -> None:
    """Give a reader blocked in ``open(fifo)`` (a regression) EOF instead of a hang."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is waiting
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _nest(manifest: Path, depth: int = 5000) -> None:
    document = json.loads(manifest.read_text())
    text = json.dumps({**document, "extras": {}})
    manifest.write_text(text.replace('"extras": {}',
                                     '"extras": {"x": ' + "[" * depth + "]" * depth + "}"))


def _restore_falls_back_to_10(root: Path, *needles: str) -> None:
    """A fresh run restores step 10, warning about step 20 with every needle."""
    trainer = Trainer(root, seed=1)
    with pytest.warns(ResumekitWarning) as caught:
        assert finishes(trainer.manager.restore) == 10
    message = "\n".join(str(w.message) for w in caught)
    for needle in (str(root / STEP_20), *needles):
        assert needle in message, (needle, message)
    trainer.close()


def _inspect_lists_20_as_corrupt(root: Path, capsys: pytest.CaptureFixture[str],
                                 *needles: str) -> None:
    code, document, _ = finishes(lambda: run_json(capsys, "inspect", str(root)))
    assert code == 1
    (entry,) = [e for e in document["checkpoints"] if e["step"] == 20]
    assert entry["status"] == "corrupt", entry
    for needle in needles:
        assert needle in entry["problem"], (needle, entry["problem"])
    assert document["resume_from"] == 10


# ------------------------------------------------------------------------ deep nesting


def test_restore_sets_aside_a_manifest_nested_too_deep_naming_it(root: Path) -> None:
    _nest(root / STEP_20 / "manifest.json")
    _restore_falls_back_to_10(root, "manifest.json", "nested deeper than")


def test_inspect_lists_a_manifest_nested_too_deep_as_corrupt_with_the_reason(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _nest(root / STEP_20 / "manifest.json")
    _inspect_lists_20_as_corrupt(root, capsys, "manifest.json", "nested deeper than")


def test_verify_all_fails_on_a_manifest_nested_too_deep_naming_it(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _nest(root / STEP_20 / "manifest.json")
    code, out, err = run_cli(capsys, "verify", str(root), "--all")
    assert code == 1
    assert str(root / STEP_20 / "manifest.json") in out + err
    assert "nested deeper than" in out + err and "RecursionError" not in out + err
    code, _, err = run_cli(capsys, "verify", str(root / STEP_20))
    assert code == 1
    assert_one_error_line(err, str(root / STEP_20 / "manifest.json"), "nested deeper than")


def test_prune_keeps_a_step_whose_manifest_is_nested_too_deep_and_prunes_the_rest(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _nest(root / STEP_20 / "manifest.json")
    code, out, err = run_cli(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 1, err  # prune names every entry it cannot read, and exits 1
    assert STEP_20 in out + err
    assert (root / STEP_20 / "manifest.json").exists()  # not ours to delete: corrupt
    assert (root / STEP_10).exists()  # the newest committed step is always kept


# ------------------------------------------------------------------------------ NUL


def test_a_nul_byte_in_a_manifest_path_makes_the_step_corrupt_never_committed(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = json.loads((root / STEP_20 / "manifest.json").read_text())
    document["files"][0]["path"] = "rank_state/rank\x00.pt"
    (root / STEP_20 / "manifest.json").write_text(json.dumps(document))
    _inspect_lists_20_as_corrupt(root, capsys, "manifest.json", "NUL byte")
    code, _, err = run_cli(capsys, "verify", str(root / STEP_20))
    assert code == 1
    assert_one_error_line(err, str(root / STEP_20 / "manifest.json"), "NUL byte",
                          repr("rank_state/rank\x00.pt"))
    _restore_falls_back_to_10(root, "NUL byte")


def test_a_manifest_whose_step_is_true_is_corrupt_not_step_1(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_1 = root / "step_000000001"
    shutil.copytree(root / STEP_10, step_1)
    rewrite_manifest(step_1, {"step": True})
    code, document, _ = run_json(capsys, "inspect", str(root))
    assert code == 1
    (entry,) = [e for e in document["checkpoints"] if e["step"] == 1]
    assert entry["status"] == "corrupt"
    assert "step is True, not a step number" in entry["problem"]


# ---------------------------------------------------------- FIFOs and devices


def test_restore_never_waits_on_a_fifo_in_the_place_of_a_manifest(
    root: Path, fifo_manifest: Path
) -> None:
    _restore_falls_back_to_10(root, "is a FIFO, not a regular file")


def test_inspect_lists_a_fifo_manifest_as_corrupt_without_waiting_on_it(
    root: Path, fifo_manifest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _inspect_lists_20_as_corrupt(root, capsys, str(fifo_manifest), "is a FIFO")


def test_a_manifest_symlinked_to_dev_zero_is_refused_unread_by_restore_and_inspect(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = root / STEP_20 / "manifest.json"
    manifest.unlink()
    manifest.symlink_to("/dev/zero")  # a link is never read through, whatever it names
    _inspect_lists_20_as_corrupt(root, capsys, "is a symbolic link")
    _restore_falls_back_to_10(root, "is a symbolic link")


def test_a_device_node_in_the_place_of_a_manifest_is_refused_unread_by_restore_and_inspect(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = root / STEP_20 / "manifest.json"
    manifest.unlink()
    os.mknod(manifest, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    _inspect_lists_20_as_corrupt(root, capsys, "is a device, not a regular file")
    _restore_falls_back_to_10(root, "is a device, not a regular file")


# ------------------------------------------------------ safetensors index escaping


def _escaping_index(tmp_path: Path, entry: str) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """``up/checkpoint_step_5``, whose index names ``entry``; the same weights lie outside."""
    torch.manual_seed(0)
    weights = {k: v.detach().clone() for k, v in nn.Linear(3, 2).state_dict().items()}
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file(weights, str(outside / "secret.safetensors"))
    folder = tmp_path / "up" / "checkpoint_step_5" / "transformer"
    folder.mkdir(parents=True)
    # The shard a sound index would name, beside it: the directory is a legacy one.
    save_file(weights, str(folder / "diffusion_pytorch_model-00001-of-00001.safetensors"))
    index = {"weight_map": dict.fromkeys(weights, entry)}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path / "up", folder / "diffusion_pytorch_model.safetensors.index.json", weights


ESCAPES = ["../../../outside/secret.safetensors", "/etc/passwd", "a\x00.safetensors"]


@pytest.mark.parametrize("entry", ESCAPES)
def test_the_legacy_restore_never_follows_an_index_entry_out_of_its_folder(
    tmp_path: Path, entry: str
) -> None:
    up, index, _ = _escaping_index(tmp_path, entry)
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(up, model=model, name_format="checkpoint_step_{step}")
    with pytest.raises(UnsafeCheckpointError) as caught:
        manager.restore()
    assert str(index) in str(caught.value) and repr(entry) in str(caught.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    manager.close()


@pytest.mark.parametrize("entry", ESCAPES)
def test_import_format_lingbot_refuses_an_index_entry_out_of_its_folder(
    tmp_path: Path, entry: str, capsys: pytest.CaptureFixture[str]
) -> None:
    up, index, _ = _escaping_index(tmp_path, entry)
    code, _, err = run_cli(capsys, "import", str(up / "checkpoint_step_5"),
                           str(tmp_path / "root"), "--format", "lingbot")
    assert code == 1
    assert_one_error_line(err, str(index), repr(entry), "nothing was read")
    assert not list((tmp_path / "root").glob("step_*"))


@pytest.mark.parametrize("entry", ESCAPES)
def test_inspect_tensors_refuses_an_index_entry_out_of_its_folder(
    tmp_path: Path, entry: str, capsys: pytest.CaptureFixture[str]
) -> None:
    up, index, _ = _escaping_index(tmp_path, entry)
    code, out, err = run_cli(capsys, "inspect", str(up / "checkpoint_step_5"), "--tensors")
    assert code == 1
    assert_one_error_line(err, str(index), repr(entry))
    assert "weight" not in out


@pytest.mark.parametrize("offsets", [5, [1, 2, 3], ["a", "b"]])
def test_inspect_tensors_names_the_file_of_a_safetensors_header_with_bad_offsets(
    tmp_path: Path, offsets: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "up" / "checkpoint_step_5" / "transformer"
    folder.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}})
    weights = folder / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(4))
    code, _, err = run_cli(capsys, "inspect", str(folder.parent), "--tensors")
    assert code == 1
    assert_one_error_line(err, str(weights), "'w'", "data_offsets")


# ------------------------------------------------------------- foreign config, steps


def _llama_source(tmp_path: Path, **config_changes: Any) -> Path:
    """An HF Trainer ``checkpoint-2``: weights, two-group optimizer state, config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - heavy

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    source = tmp_path / "hf" / "checkpoint-2"
    source.mkdir(parents=True)
    save_model(model, str(source / "model.safetensors"))
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
         {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}], lr=1e-3)
    model(torch.arange(8)[None]).logits.sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), source / "optimizer.pt")
    document = config.to_dict()
    document.update(architectures=["LlamaForCausalLM"], **config_changes)
    (source / "config.json").write_text(json.dumps(document))
    (source / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    return source


@pytest.mark.parametrize("change", [{"num_hidden_layers": 10**6},
                                    {"text_config": {"num_hidden_layers": 10**6}},
                                    {"hidden_size": 10**15}])
def test_import_refuses_a_config_declaring_more_than_its_weights_hold_at_once(
    tmp_path: Path, change: dict[str, Any]
) -> None:
    source = _llama_source(tmp_path, **change)
    key = "num_hidden_layers" if "num_hidden_layers" in json.dumps(change) else "hidden_size"
    with pytest.raises(CorruptCheckpointError) as caught:
        finishes(lambda: resumekit.import_checkpoint(source, tmp_path / "root"), seconds=30)
    message = str(caught.value)
    assert str(source / "config.json") in message and key in message
    assert "more than the weight files hold" in message
    assert not list((tmp_path / "root").glob("step_*"))


def test_import_still_builds_a_config_that_fits_its_weights(tmp_path: Path) -> None:
    source = _llama_source(tmp_path)
    result = resumekit.import_checkpoint(source, tmp_path / "root")
    assert result.step == 2


@pytest.mark.parametrize("global_step", [True, -3, 10**13, 2.0, "7"])
def test_an_hf_global_step_that_is_no_step_number_is_refused_naming_the_file_and_value(
    tmp_path: Path, global_step: Any
) -> None:
    source = tmp_path / "hf" / "checkpoint-7"
    source.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(source / "model.safetensors"))
    (source / "trainer_state.json").write_text(json.dumps({"global_step": global_step}))
    with pytest.raises(CorruptCheckpointError) as caught:
        resumekit.import_checkpoint(source, tmp_path / "root")
    message = str(caught.value)
    assert str(source / "trainer_state.json") in message and "global_step" in message
    assert repr(global_step) in message
    assert not list((tmp_path / "root").glob("step_*"))


@pytest.mark.parametrize("global_step", [True, -1, 10**13])
def test_a_lightning_global_step_that_is_no_step_number_is_refused_naming_the_file(
    tmp_path: Path, global_step: Any
) -> None:
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": global_step}, ckpt)
    with pytest.raises(CorruptCheckpointError) as caught:
        resumekit.import_checkpoint(ckpt, tmp_path / "root")
    assert str(ckpt) in str(caught.value) and repr(global_step) in str(caught.value)


def test_a_lingbot_directory_named_for_a_step_out_of_range_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "up" / f"checkpoint_step_{10**13}"
    (source / "transformer").mkdir(parents=True)
    save_file({"w": torch.zeros(2)},
              str(source / "transformer" / "diffusion_pytorch_model.safetensors"))
    code, _, err = run_cli(capsys, "import", str(source), str(tmp_path / "root"),
                           "--format", "lingbot")
    assert code == 1
    assert_one_error_line(err, str(source), str(10**13), "not a step number")
    assert not list((tmp_path / "root").glob("step_*"))


# -------------------------------------------------------------- more hostile files


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_generation_record_that_is_a_fifo_or_huge_is_ignored_with_a_warning_unread(
    root: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    record = root / ".resumekit-generations" / "000000000099.json"
    if kind == "fifo":
        os.mkfifo(record)
    else:  # a valid record, but one line of 2 MiB
        record.write_text(json.dumps({"number": 99, "token": "x" * (2 << 20)}))
    try:
        with caplog.at_level(logging.WARNING, "resumekit"):
            trainer = finishes(lambda: Trainer(root, seed=1))
            assert finishes(trainer.manager.restore) == 20
            trainer.close()
        why = "is a FIFO" if kind == "fifo" else "larger than"
        assert any(str(record) in r.getMessage() and why in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        if kind == "fifo":
            _release(record)


def test_a_checksum_trailer_nested_too_deep_is_refused_naming_it(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checksums = root / STEP_20 / "tensors" / "__0_0.distcp"
    data = checksums.read_bytes()
    start = len(data) - trailer_length(data[-TRAILER.size:], len(data), where="")
    checksums.write_bytes(data[:start] + wrap_trailer(
        ('{"format": ' + "[" * 5000 + "]" * 5000 + "}").encode()))
    rewrite_manifest(root / STEP_20, rehash=("tensors/__0_0.distcp",))
    trainer = Trainer(root, seed=1)
    with pytest.raises(CorruptCheckpointError) as caught:
        trainer.manager.restore(20)
    assert str(checksums) in str(caught.value)
    assert "nested deeper than" in str(caught.value)
    trainer.close()


def _deep(levels: int = 80) -> Any:
    deep: Any = 0
    for _ in range(levels):
        deep = [deep]
    return deep


@pytest.mark.parametrize("what", ["extras", "config"])
def test_user_data_nested_deeper_than_a_manifest_can_be_read_back_is_refused_up_front(
    tmp_path: Path, what: str
) -> None:
    with pytest.raises(ConfigurationError, match=rf"{what} is nested more than \d+ levels"):
        CheckpointManager(tmp_path / "root", model=nn.Linear(2, 2), **{what: {"x": _deep()}})
    source = tmp_path / "up" / "checkpoint_step_3"
    (source / "transformer").mkdir(parents=True)
    save_file({"w": torch.zeros(2)},
              str(source / "transformer" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ConfigurationError, match=rf"{what} is nested more than \d+ levels"):
        resumekit.import_checkpoint(source, tmp_path / "root", format="lingbot",
                                    **{what: {"x": _deep()}})
    assert not (tmp_path / "root").exists()


def test_the_json_depth_walk_counts_every_kind_of_nesting_and_stops_past_the_limit() -> None:
    from collections import OrderedDict

    from resumekit.store.storage import json_depth

    assert [json_depth(value) for value in (0, "x", None, [], {}, (), [1, "a"])] == \
        [0, 0, 0, 1, 1, 1, 1]
    assert json_depth({"a": [1, {"b": (2, [3])}], "c": {}}) == 5
    assert json_depth(OrderedDict(a=[[]]), stop=10) == 3  # subclasses of dict, too
    assert json_depth([[], [[[]]], {"x": [1]}]) == 4  # the deepest branch, not the first
    assert json_depth(_deep(80)) == 80 and json_depth(_deep(80), stop=64) == 65
    looped: list[Any] = []
    looped.append(looped)
    assert json_depth(looped, stop=10) == 11  # a structure that contains itself ends
