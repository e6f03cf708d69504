"""What a restore does with each entry, decided without a manager, a model or torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resumekit.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    IncompatibleVersionError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    UnreadableFormatError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.restore import plan as restore_plan
from resumekit.store.catalog import CheckpointEntry, Defect, Status
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import Manifest
from resumekit.store.recovery import set_aside
from resumekit.store.storage import Storage

FORMAT = NameFormat("step_{step:09d}")


def _entry(step: int, status: Status = "committed", defect: Defect | None = None, *,
           problem: str | None = None, form: str | None = None) -> CheckpointEntry:
    name = FORMAT.build(step) if form is None else f"checkpoint-{step}"
    return CheckpointEntry(step, name, f"/root/{name}", status, problem=problem,
                           defect=defect, format=form)  # type: ignore[arg-type]


def test_an_explicit_step_that_is_not_committed_is_an_error_naming_it() -> None:
    entries = [_entry(1), _entry(2, "corrupt", "bad-manifest"), _entry(3)]
    assert [e.step for e in restore_plan.candidates(entries, None, root="/root")] == [1, 3]
    assert [e.step for e in restore_plan.candidates(entries, 1, root="/root")] == [1]
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint of step 2 "
                       "under /root") as caught:
        restore_plan.candidates(entries, 2, root="/root")
    assert caught.value.step == 2


def test_a_newer_schema_is_refused_only_when_it_is_above_what_would_be_restored() -> None:
    entries = [_entry(1), _entry(2, "corrupt", "newer-schema", problem="schema 9"), _entry(3)]
    restore_plan.refuse_newer_schema(entries, below=entries[2])  # step 3 is newer: fine
    with pytest.raises(UnsupportedSchemaError, match=r"step 2.*schema 9.*fall back to step 1"):
        restore_plan.refuse_newer_schema(entries, below=entries[0])
    with pytest.raises(UnsupportedSchemaError, match="start fresh at step 0"):
        restore_plan.refuse_newer_schema(entries, below=None)


def test_without_fallback_a_broken_newest_step_directory_is_refused_an_older_one_not() -> None:
    older = [_entry(1, "partial", "empty", problem="empty"), _entry(2)]
    restore_plan.refuse_broken_newest(older)
    newer = [_entry(2), _entry(3, "corrupt", "bad-manifest", problem="not JSON")]
    with pytest.raises(ManifestError, match=r"step 3.*not JSON.*fallback=False") as caught:
        restore_plan.refuse_broken_newest(newer)
    assert caught.value.step == 3


def test_each_leftover_is_logged_warned_or_set_aside_by_its_step_and_defect() -> None:
    entries = [
        _entry(1, "corrupt", "bad-manifest", problem="old garbage"),
        _entry(2),
        _entry(3, "partial", "staging", problem="a staging area"),
        _entry(4, "partial", "unfinished", problem="no manifest yet"),
        _entry(5, "corrupt", "newer-schema", problem="schema 9"),
        _entry(6, "partial", "no-manifest", problem="files but no manifest"),
        _entry(1, "foreign", form="hf-trainer"),
        _entry(7, "foreign", form="hf-trainer"),
    ]
    found = restore_plan.leftovers(entries, Storage("/root"), above=2)
    assert [(f.entry.step, f.entry.status, f.action) for f in found] == [
        (1, "corrupt", "log"), (4, "partial", "warn"), (5, "corrupt", "warn"),
        (6, "partial", "set-aside"), (1, "foreign", "log"), (7, "foreign", "warn"),
    ]
    assert "older than the step resumed from: old garbage" in found[0].message
    assert "--format hf-trainer" in found[-1].message  # the command that converts it
    aside = found[3].warning(".bad-step_000000006-x", None)
    assert "files but no manifest; set aside as .bad-step_000000006-x" in aside
    kept = found[3].warning(None, "renaming it failed: EROFS")
    assert "could not be set aside (renaming it failed: EROFS)" in kept
    own_only = restore_plan.leftovers(entries, Storage("/root"), above=-1, foreign=False)
    assert all(f.entry.status != "foreign" for f in own_only)
    assert own_only[0].action == "set-aside"  # step 1 is above a fresh start


def test_a_failed_checkpoint_is_fallen_back_from_only_when_its_step_is_free_again() -> None:
    entry = _entry(7)
    deleted = restore_plan.judge_failure(entry, StorageError("gone"), gone=True,
                                         may_fall_back=True)
    assert deleted.deleted and "deleted while it was being restored" in deleted.warning(None,
                                                                                        None)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being restored"):
        restore_plan.judge_failure(entry, StorageError("gone"), gone=True, may_fall_back=False)
    missing = restore_plan.judge_failure(
        entry, FileNotFoundError(2, "No such file", "tensors/__0_0.distcp"), gone=False,
        may_fall_back=True)
    assert isinstance(missing.error, IncompleteCheckpointError)
    assert "is missing tensors/__0_0.distcp" in str(missing.error)
    assert missing.account("aside").startswith("set aside (")
    corrupt = CorruptCheckpointError("checksum of train_state.pt differs")
    with pytest.raises(CorruptCheckpointError):  # fallback=False or an explicit step
        restore_plan.judge_failure(entry, corrupt, gone=False, may_fall_back=False)
    with pytest.raises(StorageError, match="timed out"):  # the checkpoint stays committed
        restore_plan.judge_failure(entry, StorageError("timed out"), gone=False,
                                   may_fall_back=True)


def test_a_transient_storage_error_is_raised_even_when_the_manifest_looks_gone() -> None:
    # os.path.exists answers False for an EIO: a failing mount is not a deletion
    retried = StorageError("reading tensors/__0_0.distcp failed 5 times with transient errors",
                           path="tensors/__0_0.distcp", operation="read", attempts=5)
    with pytest.raises(StorageError, match="5 times"):
        restore_plan.judge_failure(_entry(7), retried, gone=True, may_fall_back=True)
    dropped = StorageError("reading checkpoint step_7 failed", path="step_7")
    dropped.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    with pytest.raises(StorageError, match="step_7"):
        restore_plan.judge_failure(_entry(7), dropped, gone=True, may_fall_back=True)


def _hf_trainer_checkpoint(root: Path, step: int) -> None:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "model.safetensors").write_bytes(b"x")


def test_a_fresh_start_next_to_another_tools_checkpoint_is_refused_or_warned(
    tmp_path: Path,
) -> None:
    storage = Storage(tmp_path)
    assert restore_plan.foreign_instead(restore_plan.survey(storage, FORMAT), storage,
                                        policy="error") is None
    _hf_trainer_checkpoint(tmp_path, 4)
    _hf_trainer_checkpoint(tmp_path, 9)
    found = restore_plan.survey(storage, FORMAT)
    with pytest.raises(ForeignCheckpointError, match=r"checkpoint-9 is a hf-trainer "
                       r"checkpoint \(step 9\) \(and 1 more") as caught:
        restore_plan.foreign_instead(found, storage, policy="error")
    assert caught.value.command.startswith("resumekit import ")
    warning = restore_plan.foreign_instead(found, storage, policy="ignore")
    assert warning is not None and "foreign='ignore'" in warning


def test_a_root_that_is_itself_a_foreign_checkpoint_is_imported_next_to_it(
    tmp_path: Path,
) -> None:
    _hf_trainer_checkpoint(tmp_path, 4)
    storage = Storage(tmp_path / "checkpoint-4")
    found = restore_plan.survey(storage, FORMAT)
    assert found.root_foreign is not None
    with pytest.raises(ForeignCheckpointError, match="checkpoint-4-resumekit as the root"):
        restore_plan.foreign_instead(found, storage, policy="error")


def test_a_fresh_start_says_why_and_warns_about_what_the_root_holds(tmp_path: Path) -> None:
    missing = Storage(tmp_path / "nothing")
    said, warned = restore_plan.fresh_start_account(
        restore_plan.survey(missing, FORMAT), missing, FORMAT, import_legacy=True,
        has_model=True)
    assert said.endswith("does not exist yet") and warned == []
    storage = Storage(tmp_path)
    said, warned = restore_plan.fresh_start_account(
        restore_plan.survey(storage, FORMAT), storage, FORMAT, import_legacy=True,
        has_model=True)
    assert said.endswith("is empty") and warned == []
    (tmp_path / "ckpt-3").mkdir()
    (tmp_path / "ckpt-3" / "manifest.json").write_text("{}")
    (tmp_path / ".tmp-step_000000004-abc").mkdir()  # a staging area: not reported here
    said, warned = restore_plan.fresh_start_account(
        restore_plan.survey(storage, FORMAT), storage, FORMAT, import_legacy=True,
        has_model=True)
    assert "holds no committed checkpoint" in said
    assert any("name_format 'step_{step:09d}' does not match (e.g. 'ckpt-3')" in w
               for w in warned)


def test_a_broken_step_directory_is_set_aside_under_a_hidden_name_and_its_step_freed(
    tmp_path: Path,
) -> None:
    (tmp_path / "step_000000005").mkdir()
    storage = Storage(tmp_path)
    [entry] = restore_plan.survey(storage, FORMAT).entries
    assert entry.defect == "empty"
    aside, why_not = set_aside(storage, FORMAT, entry)
    assert why_not is None and aside is not None and aside.startswith(".step_000000005.bad-")
    assert (tmp_path / aside).is_dir() and not (tmp_path / "step_000000005").exists()
    [after] = restore_plan.survey(storage, FORMAT).entries
    assert after.defect == "set-aside"  # hidden: step 5 can be saved again
    again, why_not = set_aside(storage, FORMAT, entry)  # gone now: the reason comes back
    assert again is None and why_not is not None and "renaming it failed" in why_not


def test_an_unreadable_checkpoint_of_other_versions_is_refused_not_fallen_back_from() -> None:
    here = {"torch": "2.13.0+cpu", "resumekit": "0.1.0"}
    newer = CheckpointEntry(7, FORMAT.build(7), "/root/step_000000007", "committed",
                            manifest=Manifest(step=7, versions={"torch": "2.15.0+cu132",
                                                                "resumekit": "0.1.0"}))
    unreadable = UnreadableFormatError("/root/step_000000007/tensors/.metadata: a pickle "
                                       "whose objects do not build here")
    for may_fall_back in (True, False):
        with pytest.raises(IncompatibleVersionError, match=r"step_000000007 \(step 7\) .*"
                           r"written by torch 2\.15\.0\+cu132 .* runs torch 2\.13\.0\+cpu"
                           ) as refused:
            restore_plan.judge_failure(newer, unreadable, gone=False,
                                       may_fall_back=may_fall_back, running=here)
        assert refused.value.differences == ["torch: checkpoint 2.15.0+cu132, now 2.13.0+cpu"]
    refused_global = UnsafeCheckpointError(
        "refused to unpickle global torch.distributed.checkpoint.metadata.New",
        refused="torch.distributed.checkpoint.metadata.New")
    with pytest.raises(IncompatibleVersionError):
        restore_plan.judge_failure(newer, refused_global, gone=False, may_fall_back=True,
                                   running=here)
    corrupt = CorruptCheckpointError("checksum of train_state.pt differs")  # damage: as ever
    assert not restore_plan.judge_failure(newer, corrupt, gone=False, may_fall_back=True,
                                          running=here).deleted
    same = CheckpointEntry(7, FORMAT.build(7), "/root/step_000000007", "committed",
                           manifest=Manifest(step=7, versions={"torch": "2.13.0",
                                                               "resumekit": "0.1.0"}))
    assert restore_plan.judge_failure(same, unreadable, gone=False, may_fall_back=True,
                                      running=here).error is unreadable


def test_a_load_that_failed_on_verified_bytes_is_raised_naming_the_step_never_fallen_back(
        ) -> None:
    """Not damage (a bug): raised with or without fallback; only version skew or deletion win."""
    here = {"torch": "2.13.0+cpu", "resumekit": "0.1.0"}
    entry = CheckpointEntry(7, FORMAT.build(7), "/root/step_000000007", "committed",
                            manifest=Manifest(step=7, versions=dict(here)))
    failed = CheckpointLoadError(
        "loading checkpoint /root/step_000000007/tensors failed on rank 1: AttributeError: "
        "x", path="/root/step_000000007/tensors", step=None, rank=1,
        cause="AttributeError: x", file=None)
    for may_fall_back in (True, False):
        with pytest.raises(CheckpointLoadError) as raised:
            restore_plan.judge_failure(entry, failed, gone=False,
                                       may_fall_back=may_fall_back, running=here)
        assert str(raised.value).startswith(
            "/root/step_000000007 (step 7) failed to load on rank 1: AttributeError: x. Its "
            "files match the checksums")
        assert "nothing was set aside" in str(raised.value)
        assert raised.value.step == 7 and raised.value.rank == 1
        assert raised.value.__cause__ is failed
    newer = CheckpointEntry(7, FORMAT.build(7), "/root/step_000000007", "committed",
                            manifest=Manifest(step=7, versions={"torch": "2.15.0",
                                                                "resumekit": "0.1.0"}))
    with pytest.raises(IncompatibleVersionError, match=r"written by torch 2\.15\.0"):
        restore_plan.judge_failure(newer, failed, gone=False, may_fall_back=True,
                                   running=here)
    deleted = restore_plan.judge_failure(entry, failed, gone=True, may_fall_back=True,
                                         running=here)
    assert deleted.deleted  # deleted while it was read: its step is free, nothing set aside


# ---------------------------------------------------------------------- fallback order


def test_the_fallback_order_is_newest_first_whatever_order_the_entries_below_come_in() -> None:
    top = [_entry(50)]
    below = [_entry(40), _entry(30), _entry(20), _entry(10)]  # as read: highest first
    entries = list(top)
    order = restore_plan.fallback_order(entries, top, lambda: below)
    assert [entry.step for entry in order] == [50, 40, 30, 20, 10]
    assert [entry.step for entry in entries] == [10, 20, 30, 40, 50]  # joined, sorted
    shuffled = [_entry(30), _entry(10), _entry(40)]
    assert [e.step for e in restore_plan.fallback_order(
        list(shuffled), shuffled, lambda: [_entry(5), _entry(7)])] == [40, 30, 10, 7, 5]


def test_a_copy_set_aside_earlier_newer_than_the_step_restored_is_warned_about(
        tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    aside = _entry(50, "corrupt", "set-aside")
    older = _entry(30, "corrupt", "set-aside")
    found = restore_plan.leftovers([older, _entry(40), aside], storage, above=40)
    assert [(leftover.entry.step, leftover.action) for leftover in found] == [(50, "warn")]
    assert "newer than step 40 restored" in found[0].message
    assert restore_plan.leftovers([aside], storage, above=-1) == []  # the fresh start says it
