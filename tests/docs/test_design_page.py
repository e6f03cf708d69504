"""docs/design.md draws the house as it is: its countable claims, checked against the code.

Issue 41 found eight statements on the page untrue ("nine layers" beside ten in the
contract, "no file over 900 lines" beside a 1,172-line manager, "14 knobs" beside 17, two
module-level states it did not name, a module table that had lost modules, ...). Each test
here reads one claim from the page and the same fact from the code, so the page cannot
drift from the code again without a test failing: the number of layers and the layers
themselves (pyproject's import-linter contract), the file-size bound, the module table
(every module, nothing else), the number of knobs (``CheckpointOptions``), the module-level
state, the dotted names and file paths the page gives, the subpackages' front doors, and
the changelog the history moved to.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import tomllib

from resumekit import CheckpointOptions
from resumekit._version import __version__

REPOSITORY = Path(__file__).resolve().parents[2]
PACKAGE = REPOSITORY / "resumekit"
PAGE = (REPOSITORY / "docs" / "design.md").read_text()
CHANGELOG = (REPOSITORY / "CHANGELOG.md").read_text()
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
                "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def _section(title: str) -> str:
    """The text of the page's ``## title`` section, up to the next ``## ``."""
    return PAGE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _layers_contract() -> list[list[str]]:
    config = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"]
                  if c["type"] == "layers"]
    return [sorted(part.strip().removeprefix("resumekit.") for part in layer.split("|"))
            for layer in contract["layers"]]


def _modules() -> set[str]:
    """Every module file of the package, as a path below ``resumekit/``."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}


def _count(pattern: str) -> int:
    """The one number the page states in ``pattern`` (spaces in it match any whitespace)."""
    matches = re.findall(pattern.replace(" ", r"\s+"), PAGE, flags=re.I)
    assert len(matches) == 1, f"design.md states {pattern!r} {len(matches)} times, not once"
    word = matches[0].lower().replace(",", "")
    return NUMBER_WORDS[word] if word in NUMBER_WORDS else int(word)


def test_the_number_of_layers_the_page_states_is_the_import_linter_contracts() -> None:
    assert _count(r"the package is (\w+) layers") == len(_layers_contract())


def test_the_layer_tree_on_the_page_is_the_import_linter_contract_top_down() -> None:
    tree = _section("Layers").split("```\n", 2)[1]
    drawn = [sorted(name.strip() for name in line.split("  ", 1)[0].split("|"))
             for line in tree.splitlines() if line and not line.startswith(" ")]
    assert drawn == _layers_contract()


def test_no_library_file_is_over_the_bound_the_page_states() -> None:
    bound = _count(r"no library file is over ([\d,]+) lines")
    lengths = {path: len((PACKAGE / path).read_text().splitlines()) for path in _modules()}
    over = {path: lines for path, lines in lengths.items() if lines > bound}
    assert not over, f"design.md says no file is over {bound} lines; these are: {over}"


def test_the_module_table_lists_every_module_and_only_modules_that_exist() -> None:
    rows = [line for line in _section("Modules and their one job").splitlines()
            if line.startswith("| `")]
    listed = [path for row in rows for path in re.findall(r"`([\w/]+\.py)`",
                                                            row.split(" | ", 1)[0])]
    assert len(listed) == len(set(listed)), "a module has two rows"
    assert set(listed) == _modules(), {
        "in the table, not in the package": sorted(set(listed) - _modules()),
        "in the package, not in the table": sorted(_modules() - set(listed))}


def test_the_number_of_knobs_the_page_states_is_the_options_models() -> None:
    assert _count(r"which holds (\d+) knobs") == len(CheckpointOptions.model_fields)


MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update",
                      "setdefault", "add", "discard", "popitem", "appendleft", "sort",
                      "reverse"})


def _bound_at_module_level(tree: ast.Module) -> dict[str, ast.expr | None]:
    names: dict[str, ast.expr | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value
    return names


def _changed_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
    """Module-level names a function changes: an item or attribute set, a mutating call."""
    changed = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            changed.update(t.value.id for t in targets
                           if isinstance(t, ast.Subscript | ast.Attribute)
                           and isinstance(t.value, ast.Name) and t.value.id in names)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in names):
                changed.add(node.func.value.id)
    return changed


def _module_state() -> set[tuple[str, str]]:
    """(module path, name) of every module-level state: names a function rebinds with
    ``global``, ``ContextVar`` instances, module-level containers a function changes."""
    found = set()
    for path in _modules():
        tree = ast.parse((PACKAGE / path).read_text())
        bound = _bound_at_module_level(tree)
        found.update((path, name) for node in ast.walk(tree) if isinstance(node, ast.Global)
                     for name in node.names)
        found.update((path, name) for name, value in bound.items()
                     if isinstance(value, ast.Call)
                     and ast.unparse(value.func).endswith("ContextVar"))
        found.update((path, name) for name in _changed_in_functions(tree, set(bound)))
    return found


def test_the_module_level_state_the_page_declares_is_all_the_state_there_is() -> None:
    declared = set()
    for row in _section("Module-level state").splitlines():
        cells = row.split(" | ")
        if row.startswith("| `") and len(cells) >= 3:
            [module] = re.findall(r"`([\w/]+\.py)`", cells[1])
            declared.update((module, name) for name in re.findall(r"`(\w+)`", cells[0]))
    found = _module_state()
    assert declared == found, {"declared, not found": sorted(declared - found),
                               "found, not declared": sorted(found - declared)}


def test_the_state_finder_sees_a_global_a_context_variable_and_a_changed_container(
) -> None:
    source = ("import contextvars\n_a = None\n_b = contextvars.ContextVar('b')\n_c = [0]\n"
              "_d = {}\n_e = (1,)\n"
              "def f():\n    global _a\n    _a = 1\n    _c[0] += 1\n    return _d.get(1), _e\n")
    tree = ast.parse(source)
    bound = _bound_at_module_level(tree)
    assert _changed_in_functions(tree, set(bound)) == {"_c"}
    assert [n for node in ast.walk(tree) if isinstance(node, ast.Global)
            for n in node.names] == ["_a"]
    assert "_b" in bound and ast.unparse(bound["_b"].func).endswith("ContextVar")  # type: ignore[union-attr]


SUBPACKAGES = ("store", "runtime", "tensors", "state", "restore", "tools", "background",
               "local", "cli", "integrations", "manager", "options", "save_job", "restore_root",
               "errors", "warnings", "_compat", "_optional")


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


_DOTTED = re.compile(r"\b((?:resumekit\.)?(?:" + "|".join(SUBPACKAGES) + r")(?:\.\w+)+)")
TODAY = PAGE
DOTTED = sorted({match for span in re.findall(r"`([^`]+)`", TODAY)
                 for match in _DOTTED.findall(span)})


@pytest.mark.parametrize("dotted", DOTTED)
def test_every_dotted_name_the_page_gives_resolves(dotted: str) -> None:
    _resolve(dotted if dotted.startswith("resumekit.") else f"resumekit.{dotted}")


def test_every_file_the_page_names_exists() -> None:
    named = set(re.findall(r"`((?:[\w.]+/)+[\w.]+\.(?:py|toml|md))`", TODAY))
    missing = sorted(path for path in named
                     if not (PACKAGE / path).exists() and not (REPOSITORY / path).exists())
    assert len(named) > 20
    assert not missing, f"design.md names files that do not exist: {missing}"


def test_the_page_names_no_path_of_a_development_machine() -> None:
    found = re.findall(r"(?<![\w.])/(?:work|home|Users|root|mnt|opt)/[\w./-]*", PAGE)
    assert not found, found


def test_every_subpackage_front_door_says_what_it_holds_and_what_it_may_import() -> None:
    thin = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if (len(doc.splitlines()) < 5 or "where to start reading" not in doc.lower()
                or "may import" not in doc.lower()):
            thin[init.relative_to(REPOSITORY).as_posix()] = doc
    assert not thin, ("front doors whose docstring does not say what the wing holds, where "
                      f"to start reading and what it may import: {sorted(thin)}")


def _underscore_imports_between(package: Path, dotted: str) -> list[str]:
    """Every underscore name one module of ``package`` (imported as ``dotted``) takes from
    another of it: imported (``from .format import _X``) or read off an imported module
    (``format._X``)."""
    own = {path.stem for path in package.glob("*.py")}
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.startswith(f"{dotted}."):
                found += [f"{path.name}: from {node.module} import {alias.name}"
                          for alias in node.names if alias.name.startswith("_")
                          and not alias.name.startswith("__")]
            elif node.module == dotted:
                aliases.update(alias.asname or alias.name for alias in node.names
                               if alias.name in own)
        found += [f"{path.name}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in aliases and node.attr.startswith("_")
                  and not node.attr.startswith("__")]
    return found


def test_the_raw_formats_files_meet_at_public_names_only() -> None:
    """Issue 41 found 22 underscore names imported across tensors/raw's four files."""
    assert _count(r"between them they import (\d+) underscore names from one another") == 0
    crossing = _underscore_imports_between(PACKAGE / "tensors" / "raw", "resumekit.tensors.raw")
    assert not crossing, crossing


def test_the_tensors_wings_modules_meet_at_public_names_only() -> None:
    """Issue 41: ``tensors/load.py`` imported ``_SafeReader`` from ``tensors/reader.py``."""
    assert _underscore_imports_between(PACKAGE / "tensors", "resumekit.tensors") == []


def test_the_underscore_import_counter_sees_an_import_and_an_attribute(
    tmp_path: Path,
) -> None:
    package = PACKAGE / "tensors" / "raw"
    sources = {path.name: path.read_text() for path in package.glob("*.py")}
    sources["writer.py"] += ("\nfrom resumekit.tensors.raw.format import _hidden\n"
                             "from resumekit.tensors.raw import files\n"
                             "files._private\n")
    fake = tmp_path / "raw"
    fake.mkdir()
    for name, text in sources.items():
        (fake / name).write_text(text)
    assert _underscore_imports_between(package, "resumekit.tensors.raw") == []
    assert _underscore_imports_between(fake, "resumekit.tensors.raw") == [
        "writer.py: from resumekit.tensors.raw.format import _hidden",
        "writer.py: files._private"]


def test_the_changelog_has_a_section_for_every_release_and_the_newest_is_this_version(
) -> None:
    releases = re.findall(r"^## \[([^\]]+)\]", CHANGELOG, flags=re.M)
    assert releases[0] == "Unreleased"
    assert releases[1] == __version__
    numbers = [tuple(int(part) for part in release.split(".")) for release in releases[1:]]
    assert numbers == sorted(numbers, reverse=True), releases
    versions = (REPOSITORY / "docs" / "versions.md").read_text()
    named = set(re.findall(r"^\| (\d+\.\d+(?:\.\d+)?) \|", versions, flags=re.M))
    assert named and named <= set(releases), sorted(named - set(releases))
