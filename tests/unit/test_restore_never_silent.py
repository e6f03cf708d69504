"""``restore()`` says what it does with every entry of a root, and never crash-loops on one.

A newest step directory that is not a checkpoint is warned about and set aside (so its
step can be saved again), a newer schema is refused, a transient read error is retried,
a read-only root still falls back, a checkpoint deleted mid-restore is fallen back from,
and another tool's checkpoint is never a silent fresh start.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tenacity
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

import resumekit
from resumekit import tensors
from resumekit.errors import (
    CheckpointNotFoundError,
    ForeignCheckpointError,
    ManifestError,
    ResumekitError,
    StorageError,
    UnsupportedSchemaError,
)
from resumekit.manager import CheckpointManager
from resumekit.store import retry
from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning

STEP_100, STEP_200 = "step_000000100", "step_000000200"


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _manager(root: Path, seed: int = 0, **kwargs: Any) -> CheckpointManager:
    model, optimizer = _model(seed)
    return CheckpointManager(root, model=model, optimizer=optimizer, retention=None, **kwargs)


def _saved(root: Path, *steps: int) -> dict[int, torch.Tensor]:
    """Save ``steps`` from one run; return the weight each step holds."""
    manager = _manager(root)
    weights = {}
    for step in steps:
        with torch.no_grad():
            manager.state.model.weight.add_(1.0)  # type: ignore[union-attr]
        weights[step] = manager.state.model.weight.detach().clone()  # type: ignore[union-attr]
        manager.save(step)
    manager.close()
    return weights


def _hidden(root: Path, step_name: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(f".{step_name}.bad-"))


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF", tenacity.wait_none())


# --------------------------------------------------------------------- broken newest entry


def _garble(manifest: Path) -> None:
    manifest.write_bytes(b'{"schema_version": 1, "step": 2')


def _remove(manifest: Path) -> None:
    manifest.unlink()


def _other_step(manifest: Path) -> None:
    document = json.loads(manifest.read_bytes())
    document["step"] = 300
    manifest.write_text(json.dumps(document))


def _unsafe_path(manifest: Path) -> None:
    document = json.loads(manifest.read_bytes())
    document["files"][0]["path"] = "../../etc/passwd"
    manifest.write_text(json.dumps(document))


def _emptied(manifest: Path) -> None:
    shutil.rmtree(manifest.parent)
    manifest.parent.mkdir()


BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "garbled": (_garble, "not valid JSON"),
    "missing": (_remove, "without manifest.json"),
    "other-step": (_other_step, "manifest says step 300"),
    "unsafe-path": (_unsafe_path, "unsafe path"),
    "empty": (_emptied, "empty directory"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_newest_step_directory_is_warned_about_set_aside_and_its_step_saved_again(
    tmp_path: Path, breakage: str, caplog: pytest.LogCaptureFixture,
) -> None:
    weights = _saved(tmp_path, 100, 200)
    damage, reason = BREAKAGES[breakage]
    damage(tmp_path / STEP_200 / "manifest.json")

    resumed = _manager(tmp_path, seed=1)
    with caplog.at_level(logging.DEBUG, "resumekit"), \
            pytest.warns(ResumekitWarning) as caught:
        assert resumed.restore() == 100
    message = "\n".join(str(w.message) for w in caught)
    assert str(tmp_path / STEP_200) in message and reason in message
    assert "set aside" in message
    assert any(str(tmp_path / STEP_200) in r.getMessage() for r in caplog.records)
    assert torch.equal(resumed.state.model.weight, weights[100])  # type: ignore[union-attr]
    (aside,) = _hidden(tmp_path, STEP_200)
    assert not (tmp_path / STEP_200).exists()

    resumed.save(200)  # the step is free again: no StepCollisionError on any requeue
    resumed.close()
    again = _manager(tmp_path, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # nothing left to warn about
        assert again.restore() == 200
    assert torch.equal(again.state.model.weight, weights[100])  # type: ignore[union-attr]
    assert (tmp_path / aside).is_dir()  # kept for inspection, never deleted


def test_a_broken_newest_step_directory_is_an_error_without_fallback(tmp_path: Path) -> None:
    _saved(tmp_path, 100, 200)
    _garble(tmp_path / STEP_200 / "manifest.json")
    with pytest.raises(ManifestError, match=STEP_200):
        _manager(tmp_path, fallback=False).restore()
    assert (tmp_path / STEP_200).is_dir() and not _hidden(tmp_path, STEP_200)


def test_a_broken_step_directory_in_a_fresh_root_is_set_aside_before_starting_at_zero(
    tmp_path: Path,
) -> None:
    _saved(tmp_path, 200)
    _garble(tmp_path / STEP_200 / "manifest.json")
    resumed = _manager(tmp_path)
    with pytest.warns(ResumekitWarning, match="not valid JSON"):
        assert resumed.restore() == 0
    resumed.save(200)
    assert [e.status for e in list_checkpoints(Storage(tmp_path)) if e.name == STEP_200] == [
        "committed"]


def test_a_newer_schema_is_refused_never_set_aside_never_fallen_back_past(
    tmp_path: Path,
) -> None:
    _saved(tmp_path, 100, 200)
    manifest = tmp_path / STEP_200 / "manifest.json"
    document = json.loads(manifest.read_bytes())
    document["schema_version"] = 99
    manifest.write_text(json.dumps(document))
    before = manifest.read_bytes()
    with pytest.raises(UnsupportedSchemaError, match="schema_version 99") as caught:
        _manager(tmp_path).restore()
    assert STEP_200 in str(caught.value) and "upgrade resumekit" in str(caught.value)
    assert "fall back to step 100" in str(caught.value)
    assert manifest.read_bytes() == before and not _hidden(tmp_path, STEP_200)
    shutil.rmtree(tmp_path / STEP_100)  # nothing older either: no fresh start past it
    with pytest.raises(UnsupportedSchemaError, match="start fresh"):
        _manager(tmp_path).restore()


# --------------------------------------------------------------------- transient reads


def _flaky_create_stream(monkeypatch: pytest.MonkeyPatch, suffix: str, failures: int
                         ) -> list[str]:
    """Make DCP's reader fail opening ``*suffix`` files ``failures`` times with EIO."""
    original = FileSystem.create_stream
    failed: list[str] = []

    def create_stream(self: FileSystem, path: Any, mode: str) -> Any:
        if "r" in mode and str(path).endswith(suffix) and len(failed) < failures:
            failed.append(str(path))
            raise OSError(errno.EIO, "Input/output error", str(path))
        return original(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    return failed


def test_a_transient_read_error_is_retried_and_the_checkpoint_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    weights = _saved(tmp_path, 100, 200)
    failed = _flaky_create_stream(monkeypatch, ".distcp", failures=3)
    resumed = _manager(tmp_path, seed=1)
    with caplog.at_level(logging.WARNING, "resumekit"), warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # no fallback, nothing set aside
        assert resumed.restore() == 200
    assert len(failed) == 3
    assert torch.equal(resumed.state.model.weight, weights[200])  # type: ignore[union-attr]
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 3
    assert not _hidden(tmp_path, STEP_200)


def test_a_transient_error_while_hashing_a_small_file_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _saved(tmp_path, 100)
    original = Storage.iter_chunks
    calls = []

    def iter_chunks(self: Storage, relative: str, chunk_size: int = 1 << 20) -> Any:
        if relative.endswith("train_state.pt") and not calls:
            calls.append(relative)
            raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")
        return original(self, relative, chunk_size)

    monkeypatch.setattr(Storage, "iter_chunks", iter_chunks)
    assert _manager(tmp_path).restore() == 100
    assert calls


def test_a_read_error_that_outlives_its_retries_names_the_file_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _saved(tmp_path, 100, 200)
    failed = _flaky_create_stream(monkeypatch, ".distcp", failures=10**6)
    with pytest.raises(StorageError) as caught:
        _manager(tmp_path).restore()
    assert ".distcp" in str(caught.value) and STEP_200 in str(caught.value)
    assert f"{retry.READ_ATTEMPTS} times" in str(caught.value)
    assert caught.value.attempts == retry.READ_ATTEMPTS
    # Each shard file was tried READ_ATTEMPTS times; no fallback to step 100 was read.
    assert {path: failed.count(path) for path in failed} == {
        path: retry.READ_ATTEMPTS for path in failed}
    assert all(f"/{STEP_200}/" in path for path in failed)
    assert not _hidden(tmp_path, STEP_200)
    entries = {e.name: e.status for e in list_checkpoints(Storage(tmp_path))}
    assert entries == {STEP_100: "committed", STEP_200: "committed"}


def test_a_storage_failure_that_is_not_transient_is_not_taken_for_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _saved(tmp_path, 100, 200)
    original = FileSystem.create_stream

    def create_stream(self: FileSystem, path: Any, mode: str) -> Any:
        if str(path).endswith(".distcp"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return original(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    with pytest.raises(StorageError, match="Permission denied"):
        _manager(tmp_path).restore()
    assert not _hidden(tmp_path, STEP_200)


def test_transient_errors_are_told_apart_from_missing_files_and_bad_bytes() -> None:
    assert retry.is_transient(OSError(errno.EIO, "Input/output error"))
    assert retry.is_transient(ConnectionResetError())
    assert retry.is_transient(StorageError("cannot open x", path="x").with_traceback(None)) \
        is False
    wrapped = StorageError("cannot open x", path="x")
    wrapped.__cause__ = OSError(errno.ETIMEDOUT, "timed out")
    assert retry.is_transient(wrapped)
    assert not retry.is_transient(FileNotFoundError(errno.ENOENT, "gone"))
    assert not retry.is_transient(resumekit.CorruptCheckpointError("bad", path="x"))
    assert not retry.is_transient(OSError(errno.EACCES, "Permission denied"))


# --------------------------------------------------------------------- read-only roots


def _corrupt_train_state(step_dir: Path) -> None:
    """Flip a byte of the training state (its checksum is checked before loading)."""
    victim = step_dir / "train_state.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["checksum", "garbled manifest"])
def test_a_root_that_cannot_be_renamed_in_still_falls_back_and_says_why_nothing_was_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str,
) -> None:
    weights = _saved(tmp_path, 100, 200)
    if damage == "checksum":
        _corrupt_train_state(tmp_path / STEP_200)
    else:
        _garble(tmp_path / STEP_200 / "manifest.json")

    def refuse(self: Storage, source: str, target: str) -> None:
        raise StorageError(f"cannot rename {source} to {target}: [Errno 30] Read-only file "
                           "system", path=source, operation="rename")

    monkeypatch.setattr(Storage, "rename_dir", refuse)
    resumed = _manager(tmp_path, seed=1)
    with pytest.warns(ResumekitWarning, match="could not be set aside") as caught:
        assert resumed.restore() == 100
    assert any("Read-only file system" in str(w.message) and STEP_200 in str(w.message)
               for w in caught)
    assert torch.equal(resumed.state.model.weight, weights[100])  # type: ignore[union-attr]
    assert (tmp_path / STEP_200).is_dir()


def test_a_read_only_mount_with_a_corrupt_newest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path,
) -> None:
    from tests.unit.test_bad_input import _mount, _umount  # noqa: PLC0415

    root = tmp_path / "ro"
    weights = _saved(root, 100, 200)
    _corrupt_train_state(root / STEP_200)
    _mount("--bind", str(root), str(root))
    try:
        _mount("-o", "remount,bind,ro", str(root))
        resumed = _manager(root, seed=1)
        with pytest.warns(ResumekitWarning, match="Read-only file system"):
            assert resumed.restore() == 100
        assert torch.equal(resumed.state.model.weight, weights[100])  # type: ignore[union-attr]
    finally:
        _umount(root)
    assert sorted(p.name for p in root.iterdir()
                  if p.name != ".resumekit-generations") == [STEP_100, STEP_200]


# --------------------------------------------------------------------- deleted mid-restore


def _delete_during(monkeypatch: pytest.MonkeyPatch, target: Any, name: str,
                   victim: Path) -> None:
    """Delete ``victim`` the first time ``target.name`` is called (another job's prune)."""
    original = getattr(target, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if victim.exists():
            shutil.rmtree(victim)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, hooked)


@pytest.mark.parametrize("when", ["tensors", "train state"])
def test_a_checkpoint_deleted_while_it_is_restored_is_fallen_back_from_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str,
) -> None:
    weights = _saved(tmp_path, 100, 200)
    from resumekit import restore_root  # noqa: PLC0415

    if when == "tensors":
        _delete_during(monkeypatch, tensors, "load", tmp_path / STEP_200)
    else:
        _delete_during(monkeypatch, restore_root, "read_plain", tmp_path / STEP_200)
    resumed = _manager(tmp_path, seed=1, verify_on_restore=False)
    with pytest.warns(ResumekitWarning, match="deleted while it was being restored") as caught:
        assert resumed.restore() == 100
    assert any(str(tmp_path / STEP_200) in str(w.message) for w in caught)
    assert torch.equal(resumed.state.model.weight, weights[100])  # type: ignore[union-attr]
    resumed.save(200)  # its step is free


def test_the_only_checkpoint_deleted_while_it_is_restored_is_an_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _saved(tmp_path, 100)
    _delete_during(monkeypatch, tensors, "load", tmp_path / STEP_100)
    with pytest.warns(ResumekitWarning), pytest.raises(ResumekitError) as caught:
        _manager(tmp_path).restore()
    assert "deleted while it was being restored" in str(caught.value)
    assert not isinstance(caught.value, FileNotFoundError) or isinstance(
        caught.value, ResumekitError)
    _saved(tmp_path, 100)
    _delete_during(monkeypatch, tensors, "load", tmp_path / STEP_100)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being restored"):
        _manager(tmp_path).restore(step=100)


# --------------------------------------------------------------------- foreign checkpoints


def _touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _dcp_save(directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... single process"
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(directory))


FOREIGN: dict[str, tuple[str, Callable[[Path], None], bool]] = {
    # format: (entry name, writer, records a step)
    "dcp": ("exported", _dcp_save, False),
    "torchtitan": ("step-20", _dcp_save, True),
    "hf-trainer": ("checkpoint-4", lambda d: (
        _touch(d / "trainer_state.json", b'{"global_step": 4}'),
        _touch(d / "model.safetensors")), True),
    "accelerate": ("checkpoint_0", lambda d: (
        _touch(d / "model.safetensors"), _touch(d / "optimizer.bin"),
        _touch(d / "random_states_0.pkl")), False),
}


@pytest.mark.parametrize("form", sorted(FOREIGN))
def test_a_root_holding_only_a_foreign_checkpoint_raises_with_the_import_command(
    tmp_path: Path, form: str,
) -> None:
    name, write, has_step = FOREIGN[form]
    write(tmp_path / name)
    with pytest.raises(ForeignCheckpointError) as caught:
        _manager(tmp_path).restore()
    error = caught.value
    assert isinstance(error, FileExistsError) and isinstance(error, resumekit.ResumekitError)
    command = f"resumekit import {tmp_path / name} {tmp_path} --format {form}"
    expected = command if has_step else f"{command} --step N"
    assert error.command == expected and expected in str(error)
    assert error.format == form and error.path == str(tmp_path / name)
    assert str(tmp_path / name) in str(error) and form in str(error)


def test_a_lightning_checkpoint_file_in_the_root_is_foreign_too(tmp_path: Path) -> None:
    _touch(tmp_path / "epoch=0-step=7.ckpt")
    with pytest.raises(ForeignCheckpointError, match="--format lightning") as caught:
        _manager(tmp_path).restore()
    assert caught.value.step == 7 and "--step" not in caught.value.command


def test_a_root_that_is_itself_a_foreign_checkpoint_raises_too(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint-4"
    FOREIGN["hf-trainer"][1](root)
    with pytest.raises(ForeignCheckpointError) as caught:
        _manager(root).restore()
    assert caught.value.format == "hf-trainer" and caught.value.path == str(root)
    assert caught.value.command == (f"resumekit import {root} {root}-resumekit "
                                    "--format hf-trainer")
    assert f"use {root}-resumekit as the root" in str(caught.value)
    dcp_root = tmp_path / "dcp"
    _dcp_save(dcp_root)
    with pytest.raises(ForeignCheckpointError, match="--format dcp --step N"):
        _manager(dcp_root).restore()


def test_foreign_ignore_warns_naming_what_it_ignores_and_starts_at_zero(tmp_path: Path) -> None:
    _dcp_save(tmp_path / "step-20")
    with pytest.warns(ResumekitWarning, match="step-20.*torchtitan.*foreign='ignore'"):
        assert _manager(tmp_path, foreign="ignore").restore() == 0
    with pytest.raises(resumekit.ConfigurationError, match="foreign"):
        _manager(tmp_path, foreign="import")  # type: ignore[arg-type]


def test_a_foreign_checkpoint_newer_than_the_one_restored_is_warned_about(
    tmp_path: Path,
) -> None:
    _saved(tmp_path, 10)
    _dcp_save(tmp_path / "step-20")
    with pytest.warns(ResumekitWarning, match="step-20.*newer than step 10"):
        assert _manager(tmp_path).restore() == 10


# --------------------------------------------------------------------- fresh starts


def test_a_fresh_start_logs_why_at_info_level(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "resumekit"), warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        assert _manager(tmp_path / "new").restore() == 0
        assert _manager(tmp_path).restore() == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("starting fresh at step 0" in m and "does not exist yet" in m for m in messages)
    assert any("starting fresh at step 0" in m and "is empty" in m for m in messages)


def test_a_fresh_start_next_to_entries_that_are_not_checkpoints_warns_naming_them(
    tmp_path: Path,
) -> None:
    (tmp_path / ".step_000000300.tmp-deadbeef" / "tensors").mkdir(parents=True)
    with pytest.warns(ResumekitWarning, match=r"starting fresh.*step_000000300\.tmp-deadbeef"):
        assert _manager(tmp_path).restore() == 0
