"""docs/api.md documents the public API, all of it, at the paths a user imports.

The public API is ``resumekit.__all__``, the names that left it in 0.4.0 at the module
that defines each (``resumekit._MOVED``), and five modules imported by path (and the
command line, documented on its own page). The documentation build checks that each
``:::`` reference renders; these tests check what the build cannot: that every path the
page gives imports, that each rendered object sits at a public path (not at the layer
module that happens to define it), that no public name is left out, that 0.2's flat module
paths are gone and docs/migration.md says where each went, and that the other pages' code
imports only from public paths.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import resumekit

DOCS = Path(__file__).resolve().parents[2] / "docs"
API = (DOCS / "api.md").read_text()
PUBLIC_MODULES = ("resumekit.export", "resumekit.testing", "resumekit.legacy",
                  "resumekit.integrations.lightning", "resumekit.integrations.torchtitan")
RENDERED = re.findall(r"^::: *([\w.]+)", API, flags=re.M)
DOTTED = sorted(set(re.findall(r"`(resumekit(?:\.\w+)+)`", API)))


def _resolve(path: str) -> Any:
    """The object at a dotted path: the longest prefix that imports, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


#: The names public at the module that defines them: those that left the top level in
#: 0.4.0 (``resumekit._MOVED``), the warning that says so, and the warnings added since
#: (each filterable by its class, never exported at the top level).
PUBLIC_BY_PATH = frozenset({f"{module}.{name}" for name, module in resumekit._MOVED.items()}
                           | {"resumekit.warnings.MovedNameWarning",
                              "resumekit.warnings.DirectIoRefusedWarning"})
#: Their modules, which a user imports those names from.
PUBLIC_HOMES = frozenset(path.rpartition(".")[0] for path in PUBLIC_BY_PATH)


def _is_public(path: str) -> bool:
    head, _, name = path.rpartition(".")
    if head == "resumekit":
        return name in resumekit.__all__ or path in PUBLIC_MODULES
    return path in PUBLIC_MODULES or path in PUBLIC_BY_PATH


def test_the_page_renders_something_from_each_part_of_the_public_api() -> None:
    assert len(RENDERED) > len(resumekit.__all__) // 2
    assert set(PUBLIC_MODULES) <= set(RENDERED)


@pytest.mark.parametrize("path", RENDERED)
def test_every_rendered_reference_imports_from_a_public_path(path: str) -> None:
    _resolve(path)
    assert _is_public(path), f"api.md renders {path}, which is not a public path"


@pytest.mark.parametrize("path", DOTTED)
def test_every_dotted_name_the_page_mentions_resolves(path: str) -> None:
    _resolve(path)


def test_every_public_name_is_on_the_page() -> None:
    missing = sorted(name for name in resumekit.__all__
                     if name != "__version__" and f"resumekit.{name}" not in RENDERED)
    assert not missing, f"api.md renders no ::: resumekit.<name> for {missing}"
    assert "`resumekit.__version__`" in API


def test_every_name_that_left_the_top_level_is_on_the_page_at_its_module() -> None:
    missing = sorted(PUBLIC_BY_PATH - set(RENDERED))
    assert not missing, f"api.md renders none of {missing}"


#: 0.2's flat module paths. 0.3.0 kept them importing as aliases, with a DeprecationWarning;
#: they went after 0.3.0 (issue 41, CHANGELOG.md).
OLD_0_2_PATHS = frozenset({
    "resumekit._tree", "resumekit.catalog", "resumekit.commit", "resumekit.compatibility",
    "resumekit.coordination", "resumekit.distributed", "resumekit.generations",
    "resumekit.importers", "resumekit.jsonable", "resumekit.layout", "resumekit.loader",
    "resumekit.manifest", "resumekit.preemption", "resumekit.raw_tensor_files",
    "resumekit.restore_plan", "resumekit.retention", "resumekit.retry", "resumekit.rng",
    "resumekit.safe_pickle", "resumekit.sampler", "resumekit.sharded", "resumekit.storage",
    "resumekit.verification", "resumekit.weights",
})
MIGRATION = (DOCS / "migration.md").read_text()


def _moved_table() -> dict[str, str]:
    """docs/migration.md's table of 0.2's module paths: old path -> where its code is now."""
    section = MIGRATION.split("## From resumekit 0.2's module paths", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(resumekit[\w.]*)` \| `(resumekit[\w.]*)` \|", section,
                           flags=re.M))


def test_the_migration_page_says_where_each_old_module_path_went() -> None:
    moved = _moved_table()
    assert set(moved) == OLD_0_2_PATHS, {
        "on the page only": sorted(set(moved) - OLD_0_2_PATHS),
        "not on the page": sorted(OLD_0_2_PATHS - set(moved))}
    for new in moved.values():
        importlib.import_module(new)


@pytest.mark.parametrize("old", sorted(OLD_0_2_PATHS))
def test_an_old_module_path_of_0_2_no_longer_imports(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"No module named '{old}'")):
        importlib.import_module(old)


def test_the_api_page_names_no_old_module_path() -> None:
    named = set(re.findall(r"`(resumekit(?:\.\w+)+)`", API))
    assert not named & OLD_0_2_PATHS, sorted(named & OLD_0_2_PATHS)


_IMPORT = re.compile(r"^\s*(?:from\s+(resumekit[\w.]*)\s+import|import\s+(resumekit[\w.]*))",
                     flags=re.M)


def _public_prefix(path: str) -> bool:
    """Whether a dotted path a user types starts at a public name or module."""
    parts = path.split(".")
    return any(_is_public(".".join(parts[:cut])) for cut in range(2, len(parts) + 1))


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_the_code_on_every_page_reaches_resumekit_through_public_paths_only(
    page: Path,
) -> None:
    blocks = re.findall(r"```(?:python|py)\n(.*?)```", page.read_text(), flags=re.S)
    modules = {m for block in blocks for pair in _IMPORT.findall(block) for m in pair if m}
    private = {m for m in modules
               if m != "resumekit" and m not in PUBLIC_MODULES and m not in PUBLIC_HOMES}
    for block in blocks:
        private.update(path for path in re.findall(r"\bresumekit(?:\.\w+)+", block)
                       if path not in modules and not _public_prefix(path))
    assert not private, f"{page.name} reaches {sorted(private)}; use resumekit's public names"
