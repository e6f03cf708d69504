"""scripts/dev_lock.py: every venv installs from one lock, so pip never searches.

The lock (requirements/dev.lock) must satisfy every requirement pyproject.toml declares
(else a venv made from it lacks or mis-versions a package), must pin every package
exactly, and must leave torch to the Makefile's pin or to the second torch's venv.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_lock_satisfies_every_requirement_of_pyproject() -> None:
    lock = _script("dev_lock")
    problems = lock.unsatisfied(lock.LOCK.read_text(), (REPO / "pyproject.toml").read_text())
    assert problems == [], "requirements/dev.lock is stale; run `make lock`: " + "; ".join(problems)


def test_a_requirement_the_lock_misses_or_misversions_is_named() -> None:
    lock = _script("dev_lock")
    pyproject = ('[project]\nname = "x"\ndependencies = ["torch>=2.9", "fsspec>=2099.1"]\n'
                 '[project.optional-dependencies]\ndev = ["pytest>=8", "newthing>=1"]\n')
    problems = lock.unsatisfied("fsspec==2026.9.0\npytest==8.4.0\n", pyproject)
    assert problems == ["fsspec>=2099.1: the lock pins 2026.9.0", "newthing>=1: not in the lock"]


def test_the_lock_pins_every_line_exactly_and_holds_no_torch_of_its_own() -> None:
    lock = _script("dev_lock")
    lines = [line for line in lock.LOCK.read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^\s=]+", line)
                         for line in lines), lines
    names = [lock._name(line) for line in lines]
    assert not [n for n in names if lock.TORCH_OWN.match(n) or n in ("pip", "resumekit")]
    assert "setuptools" in names  # a dev requirement pip freeze hides without --all
    assert names == sorted(names)


def test_a_freeze_becomes_the_lock_without_torch_its_cuda_stack_pip_or_resumekit() -> None:
    lock = _script("dev_lock")
    freeze = ("torch==2.14.1\nnvidia-nccl-cu13==2.30.7\ntriton==3.8.0\ncuda-bindings==13.0.3\n"
              "Pip==25.3\nzipp==3.23.0\nSympy==1.14.0\n-e git+x#egg=resumekit\n")
    assert lock.lock_lines(freeze) == ["Sympy==1.14.0", "zipp==3.23.0"]
    assert lock.constraints_without_torch(freeze) == "Sympy==1.14.0\nzipp==3.23.0\n"


def test_another_torch_release_resolves_what_torch_itself_requires_the_rest_stays_pinned() -> None:
    lock = _script("dev_lock")
    text = ("# torch requires: setuptools sympy\nboto3==1.40.0\nsetuptools==84.2.1\n"
            "sympy==1.14.0\nzipp==3.23.0\n")
    # torch 2.12 caps setuptools below 82: the lock's 84 would make its venv impossible.
    assert lock.constraints_without_torch(text) == "boto3==1.40.0\nzipp==3.23.0\n"
    committed = lock.TORCH_REQUIRES.search(lock.LOCK.read_text())
    assert committed is not None and "setuptools" in committed.group(1).split()


def test_the_second_torch_is_installed_with_pip_configuration_off_only_above_its_cap(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    matrix = _script("compat_matrix")
    caps = tmp_path / "constraints.txt"
    caps.write_text("# on this disk\ntorch<=2.14.1\ntorchvision<=0.29.1\n")

    class Shown:
        stdout = f"global.constraint='{caps}'\n:env:.find-links='/opt/wheels'\n"

    monkeypatch.setattr(matrix.subprocess, "run", lambda *a, **k: Shown())
    assert matrix._configured_torch_cap("2.14.1") is None
    assert matrix._configured_torch_cap("2.12.1") is None
    assert matrix._configured_torch_cap("2.15.0") == f"{caps}: torch<=2.14.1"


def test_a_failed_second_torch_install_says_what_failed_not_that_configuration_refused_it(
        tmp_path: Path) -> None:
    matrix = _script("compat_matrix")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for torch==2.12.7'"
                      " >&2\nexit 1\n")
    python.chmod(0o755)
    try:
        matrix._install_from_lock(python, venv, "2.12.7")
    except SystemExit as failure:
        message = str(failure)
    else:
        raise AssertionError("a failing pip did not stop the install")
    assert "pip exited 1 installing torch==2.12.7" in message
    assert "No matching distribution found for torch==2.12.7" in message
    assert "configuration" not in message
    assert (venv / "constraints-from-dev-lock.txt").read_text().startswith("accelerate==")
