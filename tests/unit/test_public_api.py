"""The package's public names: one list in three places that must agree, each importable.

``resumekit/__init__.py`` imports lazily (``_EXPORTS``: name -> module) so that the store and
the light commands do not load torch; type checkers read the ``TYPE_CHECKING`` imports; and
``__all__`` is what ``from resumekit import *`` and the docs publish. Nothing but this test
keeps the three in step (docs/design.md, "Public API").
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import resumekit
from tests.limits import HANG_S

_INIT = Path(resumekit.__file__)


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(_INIT.read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: str(node.module) for node in block.body
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_the_type_checking_imports_the_lazy_table_and_all_name_the_same_things() -> None:
    typed = _type_checking_imports()
    lazy = dict(resumekit._EXPORTS)
    assert typed == lazy, {"only typed": sorted(typed.keys() - lazy.keys()),
                           "only lazy": sorted(lazy.keys() - typed.keys()),
                           "other module": sorted(k for k in typed.keys() & lazy.keys()
                                                  if typed[k] != lazy[k])}
    assert set(resumekit.__all__) == set(lazy) | {"__version__"}
    assert len(resumekit.__all__) == len(set(resumekit.__all__))


@pytest.mark.parametrize("name", sorted(resumekit._EXPORTS))
def test_every_public_name_is_what_its_own_module_defines(name: str) -> None:
    module = importlib.import_module(resumekit._EXPORTS[name])
    assert getattr(resumekit, name) is getattr(module, name)
    assert name in getattr(module, "__all__", ()), f"{module.__name__}.__all__ lacks {name}"


def test_importing_the_package_and_the_store_loads_no_torch() -> None:
    code = ("import sys, resumekit, resumekit.store.catalog, resumekit.store.commit, "
            "resumekit.store.foreign, resumekit.store.newest, resumekit.store.recovery, "
            "resumekit.store.targets, resumekit.store.retention, resumekit._compat; "
            "resumekit.keep_last, resumekit.CheckpointEntry, resumekit.ResumekitError; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=HANG_S, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("old", "home", "name"), [
    ("resumekit.state.train_state", "resumekit.store.layout", "TENSORS_DIR"),
    ("resumekit.state.train_state", "resumekit.store.layout", "TRAIN_STATE_FILE"),
    ("resumekit.state.train_state", "resumekit.store.layout", "RANK_STATE_DIR"),
    ("resumekit.state.train_state", "resumekit.store.layout", "rank_state_file"),
    ("resumekit.store.commit", "resumekit.store.layout", "WRITER_FILE"),
    ("resumekit.store.manifest", "resumekit.store.layout", "MANIFEST_NAME"),
    ("resumekit.tensors", "resumekit.store.layout", "METADATA_FILE"),
    ("resumekit.tools.export", "resumekit.store.targets", "CheckpointTarget"),
    ("resumekit.tools.export", "resumekit.store.targets", "open_target"),
    ("resumekit.tools.export", "resumekit.store.targets", "select_committed"),
    ("resumekit.tools.export", "resumekit.store.targets", "tensors_url"),
    ("resumekit.tools.export", "resumekit.store.targets", "DEFAULT_NAME_FORMATS"),
    ("resumekit.tools.export", "resumekit.tensors", "read_full_state"),
])
def test_a_name_that_moved_still_imports_from_its_old_module_as_the_same_object(
    old: str, home: str, name: str,
) -> None:
    moved = getattr(importlib.import_module(old), name)
    if name == "METADATA_FILE":  # sharded's alias of layout.DCP_METADATA_FILE
        name = "DCP_METADATA_FILE"
    assert moved is getattr(importlib.import_module(home), name)
