"""Optional features: each names, in one line, the extra that installs what it misses.

A module is hidden the way a user lacks it: a meta-path finder that refuses it (and its
submodules), with the module taken out of ``sys.modules``. Where a library caches what it
imported once (fsspec's registry keeps ``S3FileSystem``), the check runs in a fresh
interpreter with the finder installed before anything else.

The extras themselves: ``resumekit._optional.EXTRAS`` and ``pyproject.toml`` declare the
same ones, the dev extra installs all of them, and every module the tests, benchmarks and
examples import is declared by the runtime dependencies or the extra that suite uses.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.metadata
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
import torch
from torch import nn

from resumekit._optional import EXTRAS, install_command, missing, require
from resumekit.errors import ConfigurationError, MissingDependencyError, ResumekitError
from tests.limits import HANG_S

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: The project's own extras (not features of the library).
PROJECT_EXTRAS = {"dev", "bench", "docs", "test-models"}


class _Refuse(importlib.abc.MetaPathFinder):
    """Imports of ``names`` (and their submodules) fail as for a package not installed."""

    def __init__(self, names: set[str], *, broken: bool = False) -> None:
        self.names = names
        self.broken = broken

    def find_spec(self, fullname: str, path: object = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".", maxsplit=1)[0]
        if top not in self.names:
            return None
        if self.broken:  # installed, but its own import fails
            raise ImportError(f"cannot import name 'gone' from '{top}._core'")
        raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str, broken: bool = False) -> None:
    for loaded in list(sys.modules):
        if loaded.split(".")[0] in names:
            monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(set(names), broken=broken), *sys.meta_path])


def _without(names: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which ``names`` (comma-separated) are missing."""
    prelude = textwrap.dedent(f"""
        import importlib.abc, sys
        class _Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path=None, target=None):
                if fullname.split(".")[0] in {set(names.split(","))!r}:
                    raise ModuleNotFoundError(f"No module named {{fullname!r}}", name=fullname)
        sys.meta_path.insert(0, _Refuse())
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=HANG_S, check=False, cwd=ROOT)


# --------------------------------------------------------------------------- the helper


def test_a_missing_module_is_one_line_naming_the_feature_the_package_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingDependencyError) as caught:
        require("matplotlib.pyplot", extra="plot", feature="the drill's loss.png")
    error = caught.value
    assert str(error) == ("the drill's loss.png needs matplotlib, which is not installed: "
                          "pip install 'resumekit[plot]'")
    assert "\n" not in str(error)
    assert isinstance(error, ImportError) and isinstance(error, ConfigurationError)
    assert isinstance(error, ResumekitError)
    assert (error.name, error.extra, error.feature) == ("matplotlib", "plot",
                                                        "the drill's loss.png")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    restored = pickle.loads(pickle.dumps(error))
    assert str(restored) == str(error) and restored.extra == "plot"


def test_a_package_that_is_installed_but_fails_to_import_is_told_apart_with_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide(monkeypatch, "matplotlib", broken=True)
    with pytest.raises(MissingDependencyError) as caught:
        require("matplotlib", extra="plot", feature="the drill's loss.png")
    assert str(caught.value) == (
        "the drill's loss.png needs matplotlib, which is installed but fails to import "
        "(cannot import name 'gone' from 'matplotlib._core'): pip install -U 'matplotlib>=3.7'")


def test_a_missing_submodule_of_an_installed_package_is_not_called_a_missing_package() -> None:
    nested = ModuleNotFoundError("No module named 'lightning.pytorch.gone'",
                                 name="lightning.pytorch.gone")
    error = missing("lightning", extra="lightning", feature="resumekit.integrations.lightning",
                    error=nested)
    assert "installed but fails to import (No module named 'lightning.pytorch.gone')" in \
        str(error)
    assert str(error).endswith("pip install -U 'lightning>=2.2'")


def test_an_extra_that_is_not_declared_is_a_bug_not_a_message() -> None:
    with pytest.raises(KeyError, match="'s4' is not an extra"):
        install_command("s4")


# --------------------------------------------------------------------------- each feature


def test_an_s3_root_without_s3fs_names_the_s3_extra_in_the_api_and_on_the_command_line(
) -> None:
    done = _without("s3fs", """
        import io, contextlib
        from resumekit import ConfigurationError
        from resumekit.errors import MissingDependencyError
        from resumekit.store.storage import Storage
        from resumekit.cli import main
        try:
            Storage("s3://bucket/run")
        except MissingDependencyError as error:
            assert isinstance(error, ConfigurationError) and error.value == "s3://bucket/run"
            print("api:", error)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["inspect", "s3://bucket/run"])
        print("cli:", status, err.getvalue().strip())
    """)
    assert done.returncode == 0, done.stderr
    line = ("cannot open s3://bucket/run: an s3:// root needs s3fs, which is not installed: "
            "pip install 'resumekit[s3]'")
    assert done.stdout.splitlines() == [f"api: {line}", f"cli: 1 resumekit: error: {line}"]
    assert "Install s3fs" not in done.stdout + done.stderr


def test_the_lightning_integration_without_lightning_names_the_lightning_extra() -> None:
    done = _without("lightning", """
        from resumekit.errors import MissingDependencyError
        try:
            import resumekit.integrations.lightning
        except MissingDependencyError as error:
            print(error)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("resumekit.integrations.lightning needs lightning, which "
                                   "is not installed: pip install 'resumekit[lightning]'")


def test_the_torchtitan_integration_without_torchtitan_says_how_to_install_it() -> None:
    done = _without("torchtitan", """
        from resumekit.errors import MissingDependencyError
        try:
            import resumekit.integrations.torchtitan
        except MissingDependencyError as error:
            print(error)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("resumekit.integrations.torchtitan needs torchtitan, which "
                                   "is not installed: pip install 'resumekit[torchtitan]'")


def test_an_hf_trainer_import_with_a_model_but_without_transformers_names_the_hf_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resumekit.tools import importers

    _hide(monkeypatch, "transformers")
    with pytest.raises(MissingDependencyError, match=re.escape(
            "needs transformers, which is not installed: pip install 'resumekit[hf]'")):
        importers._hf_decay_names(nn.Linear(2, 2))


def test_an_hf_trainer_import_without_transformers_says_it_matches_by_shape_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from resumekit.store.storage import Storage
    from resumekit.tools import importers
    from resumekit.warnings import ResumekitWarning

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "n_layer": 1}')
    _hide(monkeypatch, "transformers")
    with pytest.warns(ResumekitWarning) as caught:
        built = importers._hf_meta_model(Storage(tmp_path), "checkpoint-3",
                                         {"w": torch.zeros(2)})
    assert built is None
    (message,) = [str(w.message) for w in caught]
    assert "config.json names GPT2LMHeadModel, but" in message
    assert "pip install 'resumekit[hf]'" in message
    assert message.endswith("matched by the weight files' order or shapes instead")


def test_the_drills_plot_without_matplotlib_names_the_plot_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from examples.lingbot.drill import plot_losses

    _hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingDependencyError, match=re.escape(
            "the drill's loss.png needs matplotlib, which is not installed: "
            "pip install 'resumekit[plot]'")):
        plot_losses({"A": tmp_path}, tmp_path / "loss.png", marks={})
    assert not (tmp_path / "loss.png").exists()


# --------------------------------------------------------------------------- the extras


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string (PEP 503)."""
    bare = re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", bare).lower()


def test_the_extras_the_code_names_are_the_extras_pyproject_declares() -> None:
    declared = PROJECT["optional-dependencies"]
    features = {name: tuple(reqs) for name, reqs in declared.items()
                if name not in PROJECT_EXTRAS}
    assert features == {name: extra.requirements for name, extra in EXTRAS.items()}


def test_no_extra_and_no_dependency_but_the_one_bound_names_torch() -> None:
    for name, requirements in PROJECT["optional-dependencies"].items():
        assert not [r for r in requirements if _name(r) == "torch"], name
    assert [_name(r) for r in PROJECT["dependencies"]].count("torch") == 1


def test_the_dev_extra_installs_every_feature_extra() -> None:
    """Every feature extra's requirements are dev's, or (the torchtitan extra) test-models'.

    test-models is installed ``--no-deps`` beside dev (the Makefile): torchtitan's own
    requirements would pin fsspec below the S3 stack's. There the package must be pinned
    (``==``) at a version the feature extra's floor (``>=``) admits.
    """
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))

    dev = set(PROJECT["optional-dependencies"]["dev"])
    pinned = dict(requirement.split("==", 1)
                  for requirement in PROJECT["optional-dependencies"]["test-models"]
                  if "==" in requirement)
    for name, extra in EXTRAS.items():
        for requirement in extra.requirements:
            if requirement in dev:
                continue
            package, floor = requirement.split(">=", 1)
            assert package in pinned, (name, requirement)
            assert version(pinned[package]) >= version(floor), (name, requirement)


def test_the_torchtitan_extra_is_installed_by_test_models_not_dev() -> None:
    assert "torchtitan>=0.3" not in PROJECT["optional-dependencies"]["dev"]
    assert EXTRAS["torchtitan"].requirements == ("torchtitan>=0.3",)
    assert "torchtitan==0.3.0" in PROJECT["optional-dependencies"]["test-models"]


def _imported_modules(folder: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((alias.name.split(".")[0], path) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module.split(".")[0], path


@pytest.mark.parametrize(("folder", "extras"), [
    ("tests", ("dev", "test-models")), ("benchmarks", ("dev", "bench")), ("examples", ("plot",)),
])
def test_every_module_a_suite_imports_is_declared_by_the_extra_it_runs_with(
    folder: str, extras: tuple[str, ...],
) -> None:
    declared = {_name(r) for r in PROJECT["dependencies"]}
    for extra in extras:
        declared |= {_name(r) for r in PROJECT["optional-dependencies"][extra]}
    local = {"resumekit", "tests", "examples", "benchmarks"}
    owners = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, path in _imported_modules(ROOT / folder):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        if (path.parent / f"{module}.py").exists():  # a script's sibling (sys.path[0])
            continue
        distributions = {_name(d) for d in owners.get(module, [])}
        if not distributions & declared:
            undeclared[module] = (sorted(distributions) or ["not installed"],
                                  str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but declared by no extra of {extras}: {undeclared}"


def test_the_faqs_extras_table_is_the_extras_the_code_names() -> None:
    faq = (ROOT / "docs" / "faq.md").read_text()
    section = faq.split("## What does `pip install resumekit` install", 1)[1].split("\n## ")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    table = {extra.strip("`"): (enables, tuple(p.strip(" `") for p in packages.split(",")))
             for extra, enables, packages in rows}
    assert table == {name: (extra.enables, extra.requirements) for name, extra in EXTRAS.items()}
    readme = (ROOT / "README.md").read_text()
    assert f"extras: {', '.join(EXTRAS)}" in readme
