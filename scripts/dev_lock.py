"""The development lock: the exact versions every venv of this repository installs.

``requirements/dev.lock`` pins every package of ``.[dev,docs,bench]`` as one resolution of
them (made beside the CPU torch of the Makefile's ``TORCH_PIN``). Every install reads it as
pip *constraints* (``-c``), so pip has one candidate per package and nothing to backtrack
through:

* the main ``.venv`` (the Makefile's bootstrap): ``pip install TORCH_PIN -e .[dev,docs] -c
  requirements/dev.lock``;
* a second torch's venv (``scripts/compat_matrix.py``, CI's torch 2.14.1): the same lock
  without its ``torch`` line (``constraints``), beside ``torch==X.Y.Z``. Only torch and its
  own binary stack (CUDA libraries, triton: pinned by torch itself) are resolved there.

A fresh resolution of an unpinned ``.[dev]`` beside another torch once ran 90 minutes
without finishing (pip backtracking through hundreds of releases of the S3 stack); with the
lock it is an install.

    python3 scripts/dev_lock.py write                 # regenerate (make lock): a fresh venv
    python3 scripts/dev_lock.py write --venv .venv    # freeze an existing venv instead
    python3 scripts/dev_lock.py constraints OUT       # the lock less torch, for another torch
    python3 scripts/dev_lock.py check                 # does the lock satisfy pyproject.toml?
    python3 scripts/dev_lock.py no-deps               # what to install with --no-deps

The ``test-models`` extra (torchtitan's model classes, for the tests) is installed with
``pip install --no-deps``: torchtitan's own requirements would pin fsspec below the S3
stack's.

Standard library only at import; ``check`` runs under the venv's python (``packaging``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "dev.lock"
EXTRAS = "dev,docs,bench"
# Extras installed without their dependencies (pyproject.toml says why), after the others.
NO_DEPS_EXTRAS = ("test-models",)
# What a second torch brings itself: never constrained by the lock.
TORCH_OWN = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
HEADER = """\
# The development lock (scripts/dev_lock.py; regenerate with `make lock`).
# Every venv of this repository installs with `-c requirements/dev.lock`: one candidate per
# package, so pip never backtracks. torch is not in it: the Makefile pins it (TORCH_PIN),
# and a second torch's venv brings its own (scripts/compat_matrix.py).
# Made beside {torch} for .[{extras}].
# torch requires: {torch_requires}
"""
# The header line naming the packages torch itself requires: another torch release may need
# other versions of them (torch 2.12 caps setuptools below 82), so a second torch's venv
# leaves them to torch's own requirement instead of the lock.
TORCH_REQUIRES = re.compile(r"^# torch requires: (.*)$", re.M)


def _name(line: str) -> str | None:
    """The normalised project name of a ``name==version`` line, or None for other lines."""
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line.strip())
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else None


def lock_lines(freeze: str) -> list[str]:
    """``pip freeze`` output -> the lock's pinned lines: sorted, without torch's own stack."""
    kept = []
    for line in freeze.splitlines():
        name = _name(line)
        if name is None or TORCH_OWN.match(name) or name in ("resumekit", "pip"):
            continue
        kept.append(line.strip())
    return sorted(kept, key=lambda line: _name(line) or line)


def torch_requirements(python: Path) -> list[str]:
    """The normalised names of what the venv's torch requires (markers evaluated there)."""
    probe = ("import importlib.metadata as m, re\n"
             "from packaging.requirements import Requirement\n"
             "names = set()\n"
             "for text in m.distribution('torch').requires or []:\n"
             "    r = Requirement(text)\n"
             "    if r.marker is None or r.marker.evaluate({'extra': ''}):\n"
             "        names.add(re.sub(r'[-_.]+', '-', r.name).lower())\n"
             "print(' '.join(sorted(names)))\n")
    shown = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                           check=True).stdout.split()
    return [name for name in shown if not TORCH_OWN.match(name)]


def freeze(python: Path) -> str:
    """``pip freeze --all`` of a venv (setuptools included: a dev requirement), editables out."""
    return subprocess.run([str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"],
                          capture_output=True, text=True, check=True).stdout


def torch_pin() -> str:
    """The Makefile's ``TORCH_PIN`` (``torch==2.13.0``)."""
    match = re.search(r"^TORCH_PIN \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    if match is None:
        raise SystemExit("Makefile: no `TORCH_PIN ?= torch==X.Y.Z` line")
    return match.group(1)


def command_write(args: argparse.Namespace) -> int:
    """``write``: resolve ``.[dev,docs,bench]`` afresh (or freeze --venv) into the lock."""
    pin = torch_pin()
    if args.venv:
        python = Path(args.venv) / "bin" / "python"
        text, requires = freeze(python), torch_requirements(python)
    else:
        with tempfile.TemporaryDirectory(prefix="resumekit-lock-") as scratch:
            python = Path(scratch) / "bin" / "python"
            subprocess.run([sys.executable, "-m", "venv", scratch], check=True)
            print(f"[lock] resolving {pin} + .[{EXTRAS}] in a fresh venv", flush=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", pin,
                            "-e", f".[{EXTRAS}]"], cwd=REPO, check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                            *no_deps_requirements()], cwd=REPO, check=True)
            text, requires = freeze(python), torch_requirements(python)
    lines = lock_lines(text)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    LOCK.write_text(HEADER.format(torch=pin, extras=EXTRAS, torch_requires=" ".join(requires))
                    + "\n".join(lines) + "\n")
    print(f"[lock] wrote {len(lines)} pins to {LOCK.relative_to(REPO)}", flush=True)
    return 0


def no_deps_requirements(pyproject_text: str | None = None) -> list[str]:
    """The requirements of the extras installed with ``--no-deps`` (NO_DEPS_EXTRAS)."""
    text = pyproject_text or (REPO / "pyproject.toml").read_text()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    return [requirement for name in NO_DEPS_EXTRAS for requirement in extras[name]]


def command_no_deps(args: argparse.Namespace) -> int:
    """``no-deps``: print the requirements to install with ``pip install --no-deps``."""
    print(" ".join(no_deps_requirements()))  # no spaces in them: the shell may split
    return 0


def constraints_without_torch(lock_text: str) -> str:
    """The lock's pins for a venv whose torch is another release.

    Dropped: torch's own stack, and the packages the lock's header names as torch's own
    requirements (left to that torch's requirement: each release bounds them itself).
    """
    named = TORCH_REQUIRES.search(lock_text)
    left_to_torch = set(named.group(1).split()) if named else set()
    return "\n".join(line for line in lock_lines(lock_text)
                     if _name(line) not in left_to_torch) + "\n"


def command_constraints(args: argparse.Namespace) -> int:
    """``constraints OUT``: write the lock, less torch's own stack, to OUT."""
    Path(args.out).write_text(constraints_without_torch(LOCK.read_text()))
    return 0


def unsatisfied(lock_text: str, pyproject_text: str) -> list[str]:
    """Each requirement of pyproject.toml (runtime + every extra) the lock does not satisfy.

    Needs ``packaging`` (the venv's). A requirement whose package is not pinned counts as
    unsatisfied unless it is torch (the Makefile's pin).
    """
    from packaging.requirements import Requirement  # noqa: PLC0415  (the venv's)
    from packaging.utils import canonicalize_name  # noqa: PLC0415

    pinned = {}
    for line in lock_text.splitlines():
        name = _name(line)
        if name is not None:
            pinned[name] = line.strip().split("==", 1)[1]
    project = tomllib.loads(pyproject_text)["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        if name not in pinned:
            problems.append(f"{text}: not in the lock")
        elif not requirement.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{text}: the lock pins {pinned[name]}")
    return problems


def command_check(args: argparse.Namespace) -> int:
    """``check``: exit 1 naming every pyproject requirement the lock does not satisfy."""
    problems = unsatisfied(LOCK.read_text(), (REPO / "pyproject.toml").read_text())
    for problem in problems:
        print(f"requirements/dev.lock: {problem}", file=sys.stderr)
    if problems:
        print("regenerate the lock: make lock", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """The command line."""
    parser = argparse.ArgumentParser(prog="scripts/dev_lock.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="regenerate requirements/dev.lock")
    write.add_argument("--venv", help="freeze this venv instead of resolving afresh")
    constraints = commands.add_parser("constraints", help="the lock for another torch")
    constraints.add_argument("out")
    commands.add_parser("check", help="does the lock satisfy pyproject.toml?")
    commands.add_parser("no-deps", help="the requirements installed with --no-deps")
    args = parser.parse_args(argv)
    return {"write": command_write, "constraints": command_constraints,
            "check": command_check, "no-deps": command_no_deps}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
