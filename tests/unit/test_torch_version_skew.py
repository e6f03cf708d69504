"""A checkpoint another torch wrote and this one cannot read is refused, never set aside.

The fixture ``tests/fixtures/torch_skew/root-2.15.0`` is a real checkpoint (step 3 of a
2x2 linear model and SGD) written by torch 2.15.0 with this resumekit, by
``tests/fixtures/torch_skew/make_fixture.py`` (its docstring says how to regenerate it).
torch 2.15.0's DCP pickles a sixth value in ``TensorProperties`` (``strides``); torch
2.14 and older unpack five, so their ``.metadata`` unpickling fails. Before this was
refused, restore set the checkpoint aside as corrupt (``.step_000000003.bad-<id>``), and
the run, back on 2.15.0, started from step 0.

On torch 2.15 and newer, which read the fixture, nothing skips: the fixture restores (the
torch that wrote it reads it back), and the refusals are checked on a copy made as a newer
torch's checkpoint would be: its manifest records torch 2.16.0, and its ``.metadata`` names a
DCP class this torch lacks (unreadable, as 2.15's metadata is to 2.14).

The same round trip with the other torch really installed (written there, refused here,
resumed there) is ``tests/fixtures/torch_skew/cross_version_check.py``: it needs a second
environment, so it is a release step (``make test-matrix``), not part of the suite.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorProperties

from resumekit import __version__ as resumekit_version
from resumekit import _compat
from resumekit.errors import (
    CorruptCheckpointError,
    IncompatibleVersionError,
    ResumekitError,
    UnreadableFormatError,
)
from resumekit.manager import CheckpointManager
from resumekit.store.manifest import parse_manifest, version_skew
from resumekit.tensors.safe_pickle import load_dcp_metadata
from resumekit.warnings import ResumekitWarning
from tests.unit.test_cli_support import rewrite_manifest, run_cli, run_json

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "torch_skew" / "root-2.15.0"
STEP = "step_000000003"
FIXTURE_TORCH = "2.15.0+cu132"
#: torch 2.15 and newer read the fixture's metadata (2.15.0 wrote it); older ones cannot.
FIXTURE_READABLE_HERE = _compat.torch_release(torch.__version__)[:2] >= (2, 15)
#: The torch an unreadable checkpoint of these tests records: the fixture's own where this
#: torch cannot read it, else a newer torch's (see _copy_fixture).
WRITER_TORCH = "2.16.0+cu132" if FIXTURE_READABLE_HERE else FIXTURE_TORCH
WRITER_RELEASE = WRITER_TORCH.split("+")[0]


def _unreadable_metadata() -> bytes:
    """The fixture's ``.metadata`` as a torch newer than this one would pickle it.

    Below 2.15 the fixture's own (2.15 pickles one value more per tensor than 2.14 reads);
    from 2.15 on, the same step again: each ``TensorProperties`` pickles one value more than
    this torch's unpacks.
    """
    data = (FIXTURE / STEP / "tensors" / ".metadata").read_bytes()
    if not FIXTURE_READABLE_HERE:
        return data
    metadata = load_dcp_metadata(data, source="fixture/.metadata")
    own = TensorProperties.__getstate__
    TensorProperties.__getstate__ = lambda self: (*own(self), None)  # type: ignore[method-assign]
    try:
        return pickle.dumps(metadata)
    finally:
        TensorProperties.__getstate__ = own  # type: ignore[method-assign]


def _copy_fixture(tmp_path: Path, name: str = "run") -> Path:
    """A copy of the fixture this torch cannot read, recording WRITER_TORCH as its writer.

    Where this torch reads the fixture (2.15 and newer), the copy is made as a newer torch's
    would be: its metadata names a DCP class this torch lacks, its manifest that newer torch.
    """
    root = tmp_path / name
    shutil.copytree(FIXTURE, root)
    if FIXTURE_READABLE_HERE:
        (root / STEP / "tensors" / ".metadata").write_bytes(_unreadable_metadata())
        versions = json.loads((root / STEP / "manifest.json").read_text())["versions"]
        rewrite_manifest(root / STEP, {"versions": {**versions, "torch": WRITER_TORCH}},
                         rehash=("tensors/.metadata",))
    return root


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")
                  if ".resumekit-generations" not in path.parts)


def _manager(root: Path, **kwargs: object) -> CheckpointManager:
    torch.manual_seed(1)
    model = nn.Linear(2, 2)
    return CheckpointManager(root, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), config={"fixture": "torch_skew"}, retention=None,
        **kwargs)  # type: ignore[arg-type]


def test_restore_refuses_a_checkpoint_a_newer_torch_wrote_naming_both_versions(
        tmp_path: Path) -> None:
    root = _copy_fixture(tmp_path)
    before = _tree(root)
    manager = _manager(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)  # nothing set aside, no warning
        with pytest.raises(IncompatibleVersionError) as raised:
            manager.restore()
    message = str(raised.value)
    assert f"{root / STEP} (step 3)" in message
    assert f"written by torch {WRITER_TORCH}" in message
    assert f"runs torch {torch.__version__}" in message
    assert f"install torch {WRITER_RELEASE}" in message and "nothing was set aside" in message
    assert raised.value.step == 3 and raised.value.written_by["torch"] == WRITER_TORCH
    assert raised.value.running["torch"] == torch.__version__
    assert _tree(root) == before  # not set aside: every name and file as it was
    manager.close()


def test_restore_of_the_step_asked_for_is_refused_the_same_way(tmp_path: Path) -> None:
    root = _copy_fixture(tmp_path)
    manager = _manager(root)
    with pytest.raises(IncompatibleVersionError, match=r"step 3\) cannot be read"):
        manager.restore(step=3)
    assert (root / STEP / "manifest.json").is_file()
    manager.close()


def test_restore_does_not_fall_back_past_a_newer_torchs_checkpoint(tmp_path: Path) -> None:
    """Steps 1 and 3 of one writer generation; step 3's files and versions are torch 2.15's.

    (As if the run had been requeued on torch 2.15.0 for step 3, then back on this one.)
    Falling back to step 1 would leave step 3 committed, in the way of the next save.
    """
    root = tmp_path / "run"
    writer = _manager(root)
    writer.restore()
    writer.save(1)
    writer.save(3)
    writer.close()
    generation = json.loads((root / STEP / "manifest.json").read_text())["generation"]
    shutil.rmtree(root / STEP)
    shutil.copytree(_copy_fixture(tmp_path, "newer") / STEP, root / STEP)
    rewrite_manifest(root / STEP, {"generation": generation})
    before = _tree(root)
    manager = _manager(root)
    with pytest.raises(IncompatibleVersionError, match="restore stops here"):
        manager.restore()
    assert manager.resumed_from is None
    assert _tree(root) == before
    manager.close()
    readable = _manager(root)  # what main did, once step 3 was set aside
    assert readable.restore(step=1) == 1
    readable.close()


def test_an_unreadable_checkpoint_that_records_no_torch_is_refused_not_set_aside(
        tmp_path: Path) -> None:
    root = _copy_fixture(tmp_path)
    document = json.loads((root / STEP / "manifest.json").read_text())
    del document["versions"]
    (root / STEP / "manifest.json").write_text(json.dumps(document))
    before = _tree(root)
    manager = _manager(root)
    with pytest.raises(IncompatibleVersionError) as raised:
        manager.restore()
    message = str(raised.value)
    assert "does not record which torch wrote it" in message
    assert f"this torch {torch.__version__}" in message and str(root / STEP) in message
    assert raised.value.written_by == {}
    assert _tree(root) == before
    manager.close()


def test_an_unreadable_checkpoint_this_very_torch_wrote_is_still_set_aside(
        tmp_path: Path) -> None:
    """Same versions: nothing else could read it, so it is damage (as before)."""
    root = _copy_fixture(tmp_path)
    rewrite_manifest(root / STEP, {"versions": {
        "resumekit": resumekit_version, "python": "3", "torch": torch.__version__}})
    manager = _manager(root)
    with pytest.warns(ResumekitWarning, match=r"step 3 .* is unusable .*set aside as "
                      r"\.step_000000003\.bad-"), \
            pytest.raises(ResumekitError, match=r"no checkpoint under .* could be restored"):
        manager.restore()
    assert not (root / STEP).exists()
    manager.close()


def test_a_metadata_naming_a_torch_class_this_torch_lacks_is_version_skew(
        tmp_path: Path) -> None:
    """A DCP class of another torch is still never imported, but not called damage."""
    root = tmp_path / "run"
    shutil.copytree(FIXTURE, root)
    rewrite_manifest(root / STEP, {"versions": {
        "resumekit": resumekit_version, "python": "3", "torch": WRITER_TORCH}})
    metadata = root / STEP / "tensors" / ".metadata"
    data = metadata.read_bytes()
    assert data.count(b"TensorProperties") >= 1
    metadata.write_bytes(data.replace(b"TensorProperties", b"TensorPropertieX"))
    rewrite_manifest(root / STEP, rehash=("tensors/.metadata",))
    before = _tree(root)
    manager = _manager(root)
    with pytest.raises(IncompatibleVersionError, match="TensorPropertieX"):
        manager.restore()
    assert _tree(root) == before
    manager.close()


def test_the_fixture_restores_on_the_torch_that_wrote_it_and_is_refused_before(
        tmp_path: Path) -> None:
    """torch 2.15 reads back what it wrote (nothing set aside, no warning); 2.14 refuses."""
    root = tmp_path / "run"
    shutil.copytree(FIXTURE, root)
    before = _tree(root)
    manager = _manager(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        if FIXTURE_READABLE_HERE:
            assert manager.restore() == 3
            assert manager.resumed_from == 3
        else:
            with pytest.raises(IncompatibleVersionError,
                               match=f"written by torch {re.escape(FIXTURE_TORCH)}"):
                manager.restore()
    manager.close()
    assert _tree(root) == before


def test_metadata_whose_objects_do_not_build_is_unreadable_not_malformed() -> None:
    fixture = (FIXTURE / STEP / "tensors" / ".metadata").read_bytes()
    if FIXTURE_READABLE_HERE:  # the torch that wrote it builds its objects
        assert len(load_dcp_metadata(fixture, source="x/.metadata").state_dict_metadata) >= 2
    data = _unreadable_metadata()
    with pytest.raises(UnreadableFormatError, match="too many values to unpack"):
        load_dcp_metadata(data, source="x/.metadata")
    with pytest.raises(CorruptCheckpointError) as truncated:
        load_dcp_metadata(data[: len(data) // 2], source="x/.metadata")
    assert not isinstance(truncated.value, UnreadableFormatError)


def test_version_skew_compares_releases_of_torch_and_resumekit_only() -> None:
    here = {"torch": "2.13.0+cpu", "resumekit": "0.1.0", "python": "3.11.7"}
    assert version_skew({"torch": "2.13.0", "resumekit": "0.1.0", "python": "3.12.0"},
                        here) == []
    assert version_skew({"torch": "2.15.0+cu132", "resumekit": "0.1.0"}, here) == [
        "torch: checkpoint 2.15.0+cu132, now 2.13.0+cpu"]
    assert version_skew({"torch": "2.13.0+cpu", "resumekit": "0.2.0"}, here) == [
        "resumekit: checkpoint 0.2.0, now 0.1.0"]
    assert version_skew({}, here) == ["torch: not recorded by the checkpoint, now "
                                      "2.13.0+cpu", "resumekit: not recorded by the "
                                      "checkpoint, now 0.1.0"]


def test_a_manifest_without_versions_loads_and_records_none() -> None:
    document = json.loads((FIXTURE / STEP / "manifest.json").read_text())
    del document["versions"]
    manifest = parse_manifest(json.dumps(document).encode(), source="old/manifest.json")
    assert manifest.step == 3
    assert manifest.versions == {}  # not the reader's versions


def test_inspect_shows_the_torch_and_resumekit_that_wrote_each_checkpoint(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, document, _ = run_json(capsys, "inspect", str(FIXTURE))
    assert code == 0
    (entry,) = document["checkpoints"]
    assert entry["torch_version"] == FIXTURE_TORCH
    assert entry["resumekit_version"] == "0.1.0"
    code, out, _ = run_cli(capsys, "inspect", str(FIXTURE))
    assert code == 0 and "torch" in out and FIXTURE_TORCH in out
    code, document, _ = run_json(capsys, "inspect", str(FIXTURE / STEP))
    assert code == 0 and document["manifest"]["versions"]["torch"] == FIXTURE_TORCH
    assert document["checkpoints"][0]["torch_version"] == FIXTURE_TORCH
    code, out, _ = run_cli(capsys, "inspect", str(FIXTURE / STEP))
    assert code == 0 and f"torch {FIXTURE_TORCH}" in out
