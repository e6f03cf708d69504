"""Reading a hostile checkpoint never runs its code nor escapes its directory."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from tests.unit.test_cli_support import (
    assert_one_error_line,
    malicious_metadata,
    rewrite_manifest,
    run_cli,
    write_checkpoints,
)


@pytest.fixture(scope="module")
def good_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safety") / "good"
    write_checkpoints(root, [10])
    return root


@pytest.fixture
def hostile(good_root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy whose tensors/.metadata is a code-running pickle, checksum updated to match."""
    marker = tmp_path / "pwned.txt"
    payload = malicious_metadata(marker)
    pickle.loads(payload)  # the payload is live: plain unpickling runs it
    assert marker.read_text() == "pwned"
    marker.unlink()
    root = tmp_path / "hostile"
    shutil.copytree(good_root, root)
    step_dir = root / "step_000000010"
    (step_dir / "tensors" / ".metadata").write_bytes(payload)
    rewrite_manifest(step_dir, rehash=("tensors/.metadata",))
    return root, marker


@pytest.mark.parametrize("command", [
    ["inspect", "{dir}", "--tensors"],
    ["inspect", "{dir}", "--tensors", "--json"],
    ["export", "{root}", "--out", "{out}"],
    ["export", "{root}", "--out", "{out}", "--verify"],
    ["diff", "{root}", "{good}"],
    ["diff", "{good}", "{dir}", "--json"],
])
def test_a_code_running_metadata_pickle_is_refused_and_never_runs(
    command: list[str], hostile: tuple[Path, Path], good_root: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, marker = hostile
    values = {"root": str(root), "dir": str(root / "step_000000010"),
              "out": str(tmp_path / "export"), "good": str(good_root)}
    code, out, err = run_cli(capsys, *[part.format(**values) for part in command])
    assert code == 1
    assert not marker.exists()
    assert_one_error_line(err, "refused to unpickle global builtins.exec", ".metadata")
    assert out == "" and not (tmp_path / "export" / "model.safetensors").exists()


def test_inspect_without_tensors_never_reads_the_metadata_pickle(
    hostile: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, marker = hostile
    code, out, err = run_cli(capsys, "inspect", str(root / "step_000000010"))
    assert code == 0, err
    assert "step 10" in out and not marker.exists()


@pytest.mark.parametrize("unsafe", ["../../outside.bin", "/etc/passwd"])
def test_a_manifest_path_outside_the_checkpoint_is_refused_in_one_line(
    unsafe: str, good_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "traversal"
    shutil.copytree(good_root, root)
    step_dir = root / "step_000000010"
    rewrite_manifest(step_dir, {"files": [{"path": unsafe, "size": 1, "checksum": "x:0"}]})
    code, _, err = run_cli(capsys, "inspect", str(root))
    assert code == 1
    assert_one_error_line(err, "corrupt", "unsafe path", repr(unsafe))
    for command in (["inspect", str(step_dir)], ["verify", str(step_dir)],
                    ["export", str(step_dir), "--out", str(tmp_path / "out")],
                    ["diff", str(step_dir), str(good_root)]):
        code, _, err = run_cli(capsys, *command)
        assert code == 1, command
        assert_one_error_line(err, "unsafe path", repr(unsafe))
    assert not (tmp_path / "out").exists()
