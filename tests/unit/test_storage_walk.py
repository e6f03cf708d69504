"""A local root's listing: the plain walk says what fsspec's walk says, without its calls."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from resumekit.store.storage import Storage


def _fsspec_listing(base: Path) -> list[tuple[str, int]]:
    found = fsspec.filesystem("file").find(str(base), detail=True, withdirs=False)
    return sorted((os.path.relpath(name, base), int(info.get("size") or 0))
                  for name, info in found.items() if info.get("type") != "directory")


def _tree(root: Path) -> Path:
    base = root / "staging"
    (base / "tensors" / "deep").mkdir(parents=True)
    (base / "train_state.json").write_bytes(b"{}")
    (base / "tensors" / "__0_0.raw").write_bytes(b"x" * 1000)
    (base / "tensors" / "deep" / "empty").write_bytes(b"")
    (base / "hollow").mkdir()
    return base


def test_a_plain_tree_is_listed_as_fsspec_lists_it_without_its_info_calls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _tree(tmp_path)
    want = _fsspec_listing(base)
    store = Storage(tmp_path)
    monkeypatch.setattr(store.fs, "find", lambda *a, **k: pytest.fail("fsspec walked"))
    assert store.walk_files("staging") == want


def test_a_tree_with_a_link_is_listed_by_fsspecs_walk_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _tree(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"abc")
    (base / "tensors" / "linked").symlink_to(outside)
    store = Storage(tmp_path)
    calls: list[str] = []
    find = store.fs.find

    def counted(path: str, **kwargs: object) -> object:
        calls.append(path)
        return find(path, **kwargs)

    monkeypatch.setattr(store.fs, "find", counted)  # fsspec's instance is shared: undone
    assert store.walk_files("staging") == _fsspec_listing(base)
    assert calls, "the link was not left to fsspec's walk"
