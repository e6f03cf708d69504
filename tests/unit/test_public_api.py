"""The package's public names: one list in three places that must agree, each importable.

``resumekit/__init__.py`` imports lazily (``_EXPORTS``: name -> module) so that the store and
the light commands do not load torch; type checkers read the ``TYPE_CHECKING`` imports; and
``__all__`` is what ``from resumekit import *`` and the docs publish: what a trainer
calls. The names the top level held up to 0.3.0 besides those (``_MOVED``) still resolve,
each with one ``MovedNameWarning`` naming its module. Nothing but this test keeps these in
step (docs/design.md, "Public API").
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import resumekit
from resumekit.warnings import MovedNameWarning, ResumekitWarning
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


#: What a trainer calls (issue 41, item 6): the top level's names, exactly.
TRAINER_NAMES = {
    "CheckpointManager", "CheckpointOptions", "LocalTier", "StatefulGroup",
    "init_distributed", "shutdown", "meet", "DistributedContext",
    "PreemptionHandler", "EXIT_CODE_PREEMPTED", "protect_loader_workers",
    "requeue_slurm_job", "requeue_after_signal",
    "ResumableDistributedSampler", "SkipAheadSampler", "wrap_sampler",
    "RetentionPolicy", "keep_last", "keep_every", "keep_best", "keep_steps", "keep_all",
    "StorageReader", "import_checkpoint",
    "ResumekitError", "ConfigurationError", "CheckpointNotFoundError",
    "CorruptCheckpointError", "IncompatibleCheckpointError", "AsyncSaveError",
    "PreemptionError", "CheckpointLoadError", "ResumekitWarning", "__version__",
}


def test_the_top_level_exports_exactly_what_a_trainer_calls() -> None:
    assert set(resumekit.__all__) == TRAINER_NAMES
    assert resumekit.__all__ == sorted(resumekit.__all__, key=lambda name: (
        0 if name.isupper() else 1 if name[0].isupper() else 2, name))


@pytest.mark.parametrize("name", sorted(TRAINER_NAMES))
def test_every_name_of_all_imports_from_the_top_level_without_a_warning(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(f"from resumekit import {name}", {})  # noqa: S102 - the import a user writes
        assert getattr(resumekit, name) is not None


def test_a_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from resumekit import *", namespace)  # noqa: S102 - the import a user writes
    assert set(namespace) - {"__builtins__"} == set(resumekit.__all__)


def test_no_name_is_both_exported_and_moved_and_every_moved_name_is_its_modules_own(
) -> None:
    assert not set(resumekit._MOVED) & set(resumekit.__all__)
    for name, module in resumekit._MOVED.items():
        assert name in importlib.import_module(module).__all__, (name, module)


@pytest.mark.parametrize("name", sorted(resumekit._MOVED))
def test_a_name_that_left_the_top_level_still_resolves_with_one_warning_naming_its_module(
    name: str,
) -> None:
    module = resumekit._MOVED[name]
    resumekit.__dict__.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(resumekit, name)
    assert value is getattr(importlib.import_module(module), name)
    assert len(caught) == 1, [str(w.message) for w in caught]
    [warning] = caught
    assert issubclass(warning.category, MovedNameWarning)
    assert issubclass(warning.category, ResumekitWarning)
    assert f"from {module} import {name}" in str(warning.message)
    assert warning.filename == __file__  # the user's line, not resumekit's


def test_a_from_import_of_a_name_that_left_the_top_level_warns_at_the_importing_line(
) -> None:
    said = r"from resumekit\.errors import StorageError"
    with pytest.warns(MovedNameWarning, match=said) as caught:
        from resumekit import StorageError  # noqa: PLC0415 - the import under test
    assert StorageError is importlib.import_module("resumekit.errors").StorageError
    assert caught[0].filename == __file__


def test_a_moved_name_warns_again_at_each_access_and_is_not_cached_silently() -> None:
    for _ in range(2):
        with pytest.warns(MovedNameWarning):
            _ = resumekit.list_checkpoints  # type: ignore[attr-defined]
    assert "list_checkpoints" not in vars(resumekit)


def test_a_name_resumekit_never_had_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = resumekit.no_such_name  # type: ignore[attr-defined]


def test_every_moved_name_is_listed_in_the_changelog() -> None:
    changelog = (Path(resumekit.__file__).parents[1] / "CHANGELOG.md").read_text()
    unreleased = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    missing = sorted(name for name in resumekit._MOVED if f"`{name}`" not in unreleased)
    assert not missing, f"CHANGELOG.md's Unreleased section does not list {missing}"


@pytest.mark.parametrize("name", sorted(resumekit._EXPORTS))
def test_every_public_name_is_what_its_own_module_defines(name: str) -> None:
    module = importlib.import_module(resumekit._EXPORTS[name])
    assert getattr(resumekit, name) is getattr(module, name)
    assert name in getattr(module, "__all__", ()), f"{module.__name__}.__all__ lacks {name}"


def test_importing_the_package_and_the_store_loads_no_torch() -> None:
    code = ("import sys, resumekit, resumekit.store.catalog, resumekit.store.commit, "
            "resumekit.store.foreign, resumekit.store.newest, resumekit.store.recovery, "
            "resumekit.store.targets, resumekit.store.retention, resumekit._compat; "
            "resumekit.keep_last, resumekit.RetentionPolicy, resumekit.ResumekitError; "
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


@pytest.mark.parametrize(("old", "new"), [
    ("resumekit.tiers.local", "resumekit.local.site"),
    ("resumekit.tiers.restore_across", "resumekit.local.restore_across"),
    ("resumekit.restore.tier_choice", "resumekit.local.tier_choice"),
    ("resumekit.store.local_roots", "resumekit.local.roots"),
    ("resumekit.runtime.replicas", "resumekit.local.replicas"),
    ("resumekit.background.local", "resumekit.local.saves"),
])
def test_the_local_tiers_modules_are_in_one_package_and_their_old_paths_are_gone(
        old: str, new: str) -> None:
    """Issue 41 gathered the local tier from five wings into ``resumekit.local``.

    The old module is looked for as a file of this package (an editable install of
    another checkout beside it could still import it).
    """
    importlib.import_module(new)
    package = Path(resumekit.__file__).parent.parent
    path = package / Path(*old.split("."))
    assert not path.with_suffix(".py").exists() and not (path / "__init__.py").exists()
    assert resumekit.LocalTier is importlib.import_module("resumekit.options").LocalTier
