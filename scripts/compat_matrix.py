"""Run resumekit's suites on one torch, and write the compatibility table from the results.

The release step behind ``make test-torch`` and ``make test-matrix`` (docs/compatibility.md).
Standard library only: it runs under any python 3.10+, and each suite runs under the python
of the torch being tested, from this checkout (``PYTHONPATH`` is the repository root), so
the code tested is this checkout's whatever that environment has installed.

    python3 scripts/compat_matrix.py run --torch 2.14.1            # .venv-torch-2.14.1
    python3 scripts/compat_matrix.py run --venv /work/venvs/t291   # an existing venv
    python3 scripts/compat_matrix.py cross --reader .venv --writer .venv-torch-2.15.0
    python3 scripts/compat_matrix.py table                         # docs/compatibility.md
    python3 scripts/compat_matrix.py matrix --torch 2.9.1 2.13.0 2.15.0  # all of the above

``run`` makes the venv when it is missing or holds another torch (``torch==X.Y.Z`` plus
``-e .[dev]``; when pip's own configuration refuses that torch - a constraints file that
caps it - it installs again with ``PIP_CONFIG_FILE=/dev/null`` and says so), then runs the
unit, property and dist suites (pytest, ``CI=true``: a skip is a failure) and the LingBot
drill, and writes ``.compat/torch-X.Y.Z.json``: suite -> passed, failed, errors, skipped,
seconds, with the torch, python and commit it ran on. ``cross`` runs
``tests/fixtures/torch_skew/cross_version_check.py`` (written by one torch, refused by the
other, resumed by the writer) and records its verdict in the reader's result file.
``table`` rewrites the table between the markers of docs/compatibility.md from every
result file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded from its file by a test
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import dev_lock  # scripts/dev_lock.py: the lock every venv installs from

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / ".compat"
DOC = REPO / "docs" / "compatibility.md"
BEGIN = "<!-- compat-matrix:begin (scripts/compat_matrix.py table writes this) -->"
END = "<!-- compat-matrix:end -->"
SUITES = ("unit", "property", "dist", "drill")
PYTEST_SUITES = {
    "unit": ["tests/unit"],
    "property": ["tests/property"],
    "dist": ["--dist", "loadfile", "tests/dist"],
}


def _release(version: str) -> str:
    """``2.15.0+cu132`` -> ``2.15.0``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return match.group(0) if match else version


def _torch_of(python: Path) -> str | None:
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def _has_dev_dependencies(python: Path) -> bool:
    probe = "import pytest, xdist, hypothesis, moto, pytest_timeout, pydantic, xxhash, fsspec"
    return subprocess.run([str(python), "-c", probe], capture_output=True,
                          check=False).returncode == 0


def ensure_venv(venv: Path, torch: str | None) -> Path:
    """The venv's python, after making the venv hold ``torch`` and the dev dependencies."""
    python = venv / "bin" / "python"
    if not python.exists():
        if torch is None:
            raise SystemExit(f"{venv} is not a venv, and no --torch says what to install")
        print(f"[compat] creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = _torch_of(python)
    wanted = torch is None or (installed is not None and _release(installed) == torch)
    # A venv kept between runs (CI's) is brought up to date when pyproject.toml or the lock
    # changes.
    digest = hashlib.sha1((REPO / "pyproject.toml").read_bytes() +
                          dev_lock.LOCK.read_bytes()).hexdigest()[:12]
    stamp = venv / f".resumekit-dev-{digest}"
    current = stamp.exists() or (torch is None and _has_dev_dependencies(python))
    if wanted and current:
        # A kept venv (CI's, outside the clone) may point at another checkout, or lack the
        # console script the CLI tests run, or the test models: install this checkout and
        # them (no dependencies: seconds).
        print(f"[compat] installing this checkout's resumekit into {venv} (--no-deps)",
              flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", ".",
                        *dev_lock.no_deps_requirements()], cwd=REPO, check=True)
        return python
    if torch is None:
        raise SystemExit(f"{venv} lacks torch or the dev dependencies; name --torch X.Y.Z")
    _install_from_lock(python, venv, torch)
    for old in venv.glob(".resumekit-dev-*"):
        old.unlink()
    stamp.touch()
    return python


def _configured_torch_cap(torch: str) -> str | None:
    """The line of pip's configured constraints file that refuses ``torch==X.Y.Z``, if any.

    This machine kind's pip configuration names a constraints file that caps torch at the
    releases on its disk; a torch above the cap is installed with pip's configuration off.
    """
    shown = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                           capture_output=True, text=True, check=False).stdout
    wanted = tuple(int(part) for part in torch.split("."))
    for line in shown.splitlines():
        key, _, value = line.partition("=")
        if not key.endswith(".constraint"):
            continue
        for name in value.strip().strip("'\"").split():
            path = Path(name)
            if not path.is_file():
                continue
            for pin in path.read_text().splitlines():
                match = re.match(r"^\s*torch\s*(<=|<|==)\s*([\d.]+)", pin)
                if match is None:
                    continue
                cap = tuple(int(part) for part in match.group(2).split("."))
                refused = {"<=": wanted > cap, "<": wanted >= cap,
                           "==": wanted != cap}[match.group(1)]
                if refused:
                    return f"{path}: {pin.strip()}"
    return None


def _install_from_lock(python: Path, venv: Path, torch: str) -> None:
    """``torch==X.Y.Z`` and ``-e .[dev]`` into the venv, every other package from the lock.

    The lock (requirements/dev.lock, less its torch lines) leaves pip one candidate per
    package: an install, never a resolver search. A failure raises naming the command, its
    exit status and pip's last lines.
    """
    constraints = venv / "constraints-from-dev-lock.txt"
    constraints.write_text(dev_lock.constraints_without_torch(dev_lock.LOCK.read_text()))
    command = [str(python), "-m", "pip", "install", "--progress-bar", "off",
               f"torch=={torch}", "-e", ".[dev]", "-c", str(constraints)]
    env = dict(os.environ)
    cap = _configured_torch_cap(torch)
    if cap is not None:
        print(f"[compat] pip's configured constraints refuse torch=={torch} ({cap}); "
              "installing with PIP_CONFIG_FILE=/dev/null", flush=True)
        env["PIP_CONFIG_FILE"] = "/dev/null"
    print(f"[compat] installing torch=={torch} and resumekit[dev] into {venv}, every "
          f"other package pinned by {dev_lock.LOCK.relative_to(REPO)}", flush=True)
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        said = [line for line in (done.stdout + done.stderr).splitlines()
                if not line.startswith("WARNING: Location")]  # the local index's noise
        cause = next((i for i, line in enumerate(said)
                      if line.startswith(("ERROR", "The conflict is caused by"))), None)
        tail = "\n".join(said[cause:][:40] if cause is not None else said[-30:])
        raise SystemExit(f"[compat] FAILED: pip exited {done.returncode} installing "
                         f"torch=={torch} with the lock into {venv}:\n  {' '.join(command)}"
                         f"\n{tail}")
    no_deps = [str(python), "-m", "pip", "install", "-q", "--no-deps", "-c", str(constraints),
               *dev_lock.no_deps_requirements()]
    done = subprocess.run(no_deps, cwd=REPO, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"[compat] FAILED: pip exited {done.returncode} installing the "
                         f"test models (--no-deps) into {venv}:\n{done.stderr[-3000:]}")
    print(f"[compat] installed in {time.monotonic() - started:.0f} s", flush=True)


def _suite_env() -> dict[str, str]:
    # CI=true: tests/conftest.py turns a skip into a failure, so a suite that cannot run on
    # this torch shows as failed in the table, never as quietly passed.
    return {**os.environ, "CI": "true", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def run_pytest(python: Path, suite: str, workers: int, log: Path) -> dict[str, Any]:
    """One pytest suite; its counts (from a JUnit XML report) and wall time."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-n", str(workers), f"--junitxml={report}", *PYTEST_SUITES[suite]]
        started = time.monotonic()
        with log.open("w") as out:
            code = subprocess.run(command, cwd=REPO, env=_suite_env(), stdout=out,
                                  stderr=subprocess.STDOUT, check=False).returncode
        seconds = time.monotonic() - started
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.exists():
            root = ElementTree.parse(report).getroot()
            for element in root.iter("testsuite"):
                for key in counts:
                    counts[key] += int(element.get(key, "0"))
    failed = counts["failures"]
    passed = counts["tests"] - failed - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": failed, "errors": counts["errors"],
            "skipped": counts["skipped"], "seconds": round(seconds, 1), "exit": code,
            "log": str(log)}


def run_drill(python: Path, log: Path) -> dict[str, Any]:
    """The LingBot drill (``make demo``): passed when the interrupted runs are bit-identical."""
    with tempfile.TemporaryDirectory() as scratch:
        started = time.monotonic()
        with log.open("w") as out:
            code = subprocess.run([str(python), "-m", "examples.lingbot.drill", "--out",
                                   str(Path(scratch) / "demo-output")], cwd=REPO,
                                  env=_suite_env(), stdout=out, stderr=subprocess.STDOUT,
                                  check=False).returncode
    return {"passed": int(code == 0), "failed": int(code != 0), "errors": 0, "skipped": 0,
            "seconds": round(time.monotonic() - started, 1), "exit": code, "log": str(log)}


def _commit() -> tuple[str, bool]:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=REPO, capture_output=True, text=True,
                           check=False).stdout.strip() != ""
    return head, dirty


def _commit_label() -> str:
    head, dirty = _commit()
    return head + ("+dirty" if dirty else "")


def _result_file(torch_version: str) -> Path:
    return RESULTS / f"torch-{_release(torch_version)}.json"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def command_run(args: argparse.Namespace) -> int:
    """``run``: make the venv, run the suites, write the result file; 1 if any failed."""
    venv = Path(args.venv) if args.venv else REPO / f".venv-torch-{args.torch}"
    python = ensure_venv(venv, args.torch)
    torch_version = _torch_of(python)
    if torch_version is None:
        raise SystemExit(f"{python} cannot import torch")
    if args.torch and _release(torch_version) != args.torch:
        raise SystemExit(f"{venv} holds torch {torch_version}, not {args.torch}")
    suites = [s for s in args.suites.split(",") if s]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise SystemExit(f"unknown suites {unknown}; choose from {list(SUITES)}")
    path = _result_file(torch_version)
    document = _load(path)
    document.update(torch=torch_version, venv=str(venv), python=subprocess.run(
        [str(python), "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True).stdout.strip())
    document.setdefault("suites", {})
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed = False
    for suite in suites:
        print(f"[compat] torch {torch_version}: {suite} ...", flush=True)
        log = logs / f"torch-{_release(torch_version)}-{suite}.log"
        commit = _commit_label()  # what is tested: the tree as the suite starts
        result = run_drill(python, log) if suite == "drill" else \
            run_pytest(python, suite, args.workers, log)
        result.update(commit=commit,
                      finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        document["suites"][suite] = result
        _save(path, document)
        ok = result["exit"] == 0 and result["failed"] == 0 and result["errors"] == 0
        failed |= not ok
        print(f"[compat] torch {torch_version}: {suite} {'passed' if ok else 'FAILED'} - "
              f"{_cell(result)} (log {log})", flush=True)
    print(f"[compat] results: {path}", flush=True)
    return 1 if failed else 0


def command_install(args: argparse.Namespace) -> int:
    """``install``: only make the venv (CI starts it beside ``make test``)."""
    started = time.monotonic()
    python = ensure_venv(Path(args.venv) if args.venv else REPO / f".venv-torch-{args.torch}",
                         args.torch)
    print(f"[compat] {python}: torch {_torch_of(python)} ready in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return 0


def command_cross(args: argparse.Namespace) -> int:
    """``cross``: the written-there, refused-here, resumed-there check between two venvs."""
    reader = Path(args.reader) / "bin" / "python"
    writer = Path(args.writer) / "bin" / "python"
    reader_torch, writer_torch = _torch_of(reader), _torch_of(writer)
    if reader_torch is None or writer_torch is None:
        raise SystemExit(f"cannot import torch in {reader} or {writer}")
    started = time.monotonic()
    done = subprocess.run([str(reader), "tests/fixtures/torch_skew/cross_version_check.py",
                           str(writer)], cwd=REPO, env=_suite_env(), capture_output=True,
                          text=True, check=False)
    verdict = (done.stdout.strip() or done.stderr.strip()).splitlines()
    record = {"writer": writer_torch, "reader": reader_torch, "passed": done.returncode == 0,
              "seconds": round(time.monotonic() - started, 1),
              "verdict": verdict[-1] if verdict else "", "commit": _commit_label()}
    print(f"[compat] cross-version: written by torch {writer_torch}, read by "
          f"{reader_torch}: {'passed' if record['passed'] else 'FAILED'}: "
          f"{record['verdict']}", flush=True)
    if done.returncode != 0:
        print(done.stdout + done.stderr, flush=True)
    path = _result_file(reader_torch)
    document = _load(path)
    document.setdefault("torch", reader_torch)
    document.setdefault("cross", {})[_release(writer_torch)] = record
    _save(path, document)
    return 0 if record["passed"] else 1


def command_matrix(args: argparse.Namespace) -> int:
    """``matrix``: ``run`` on each torch, the cross checks, then ``table``; 1 if any failed.

    The cross check runs from the newest torch to each older one; every step runs
    regardless of the ones before.
    """
    venvs = [Path(venv) for venv in args.venvs] or [
        REPO / f".venv-torch-{version}" for version in args.torch]
    versions = args.torch if not args.venvs else [None] * len(venvs)
    failed = False
    for venv, version in zip(venvs, versions, strict=True):
        print(f"==== torch {version or venv}: {args.suites} ====", flush=True)
        failed |= command_run(argparse.Namespace(
            torch=version, venv=str(venv), suites=args.suites, workers=args.workers)) != 0
    by_release = sorted(((_release(_torch_of(venv / "bin" / "python") or "0"), venv)
                         for venv in venvs), key=lambda item: tuple(
                             int(part) for part in item[0].split(".")))
    newest = by_release[-1][1]
    for _, older in by_release[:-1]:
        failed |= command_cross(argparse.Namespace(reader=str(older), writer=str(newest))) != 0
    command_table(argparse.Namespace(results=str(RESULTS), doc=str(DOC)))
    return 1 if failed else 0


def _cell(result: dict[str, Any]) -> str:
    parts = [f"{result['passed']} passed"]
    for key in ("failed", "errors", "skipped"):
        if result.get(key):
            parts.append(f"{result[key]} {key}")
    return ", ".join(parts) + f" ({result['seconds']:.0f} s)"


def _version_key(document: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(part) for part in _release(document["torch"]).split("."))


def render_table(documents: list[dict[str, Any]]) -> str:
    """The markdown table: one row per torch, one column per suite, then the cross check."""
    lines = ["| torch | " + " | ".join(SUITES) + " | commit |",
             "|---|" + "---|" * len(SUITES) + "---|"]
    for document in sorted(documents, key=_version_key):
        suites = document.get("suites", {})
        if not suites:
            continue
        cells = [_cell(suites[s]) if s in suites else "not run" for s in SUITES]
        commits = sorted({suites[s]["commit"] for s in suites})
        lines.append(f"| {document['torch']} | " + " | ".join(cells) +
                     f" | {', '.join(commits)} |")
    crosses = [(document["torch"], record) for document in documents
               for record in document.get("cross", {}).values()]
    if crosses:
        lines += ["", "| written by torch | read by torch | refused, nothing set aside, "
                  "resumed by the writer |", "|---|---|---|"]
        for reader, record in sorted(crosses, key=lambda c: (c[1]["writer"], c[0])):
            verdict = "yes" if record["passed"] else f"NO: {record['verdict']}"
            lines.append(f"| {record['writer']} | {reader} | {verdict} |")
    return "\n".join(lines)


def command_table(args: argparse.Namespace) -> int:
    """``table``: rewrite the table of docs/compatibility.md from the result files."""
    documents = [_load(path) for path in sorted(Path(args.results).glob("torch-*.json"))]
    if not documents:
        raise SystemExit(f"no result files under {args.results}: run `make test-torch` first")
    doc = Path(args.doc)
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{render_table(documents)}\n{END}{tail}")
    print(f"[compat] wrote the table of {len(documents)} torch versions to {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line."""
    parser = argparse.ArgumentParser(prog="scripts/compat_matrix.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the suites on one torch")
    run.add_argument("--torch", help="X.Y.Z: the torch release to test (installs it)")
    run.add_argument("--venv", help="an existing venv to use (default .venv-torch-X.Y.Z)")
    run.add_argument("--suites", default=",".join(SUITES))
    run.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    install = commands.add_parser("install", help="only make one torch's venv")
    install.add_argument("--torch", required=True, help="X.Y.Z: the torch release")
    install.add_argument("--venv", help="where (default .venv-torch-X.Y.Z)")
    cross = commands.add_parser("cross", help="the cross-version read check")
    cross.add_argument("--reader", required=True, help="venv whose torch reads")
    cross.add_argument("--writer", required=True, help="venv whose torch writes (newer)")
    matrix = commands.add_parser("matrix", help="run, cross and table for several torches")
    matrix.add_argument("--torch", nargs="*", default=["2.9.1", "2.13.0", "2.15.0"],
                        help="releases, each in .venv-torch-X.Y.Z")
    matrix.add_argument("--venvs", nargs="*", default=[],
                        help="existing venvs instead of --torch")
    matrix.add_argument("--suites", default=",".join(SUITES))
    matrix.add_argument("--workers", type=int, default=2)
    table = commands.add_parser("table", help="write docs/compatibility.md's table")
    table.add_argument("--results", default=str(RESULTS))
    table.add_argument("--doc", default=str(DOC))
    args = parser.parse_args(argv)
    if args.command == "run" and not (args.torch or args.venv):
        parser.error("run needs --torch X.Y.Z or --venv DIR")
    return {"run": command_run, "install": command_install, "cross": command_cross,
            "matrix": command_matrix, "table": command_table}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
