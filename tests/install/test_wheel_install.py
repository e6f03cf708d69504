"""``pip install resumekit`` as a cluster user runs it: the torch already there stays.

A clean virtual environment (no system site-packages) first gets the torch of this test
environment - the cluster's torch, installed before resumekit as a cluster user has it -
then the built wheel with plain ``pip install``, no extras. Checked:

* pip replaced nothing of torch: same version, same files (inode and mtime of its
  ``__init__.py`` and of its ``RECORD``), not in pip's install report; ``pip check`` is clean;
  ``pip install --upgrade`` would not touch it either, nor, with the installed torch as a
  constraint (docs/faq.md), would an eager upgrade;
* with only the runtime dependencies (no s3fs, Lightning, transformers, diffusers,
  Accelerate, matplotlib), ``import resumekit``, the command line (``--help`` of every
  command, ``inspect``, ``verify``, ``export``) and the LingBot drill work, from outside
  the checkout so that nothing is imported from it;
* an optional feature says in one line which extra to install (S3, Lightning), and the
  drill prints its verdict, skips only its plot with one line naming ``resumekit[plot]``,
  and exits by its verdict.

It installs torch into a new environment (from the local wheel on this machine kind) and
runs the drill's two-rank runs A and B: minutes, so it lives outside the unit suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.limits import HANG_S, TEST_HANG_S
from tests.packaging import REPO, build_distributions

pytestmark = pytest.mark.timeout(TEST_HANG_S)

#: This environment's torch: the one "already on the cluster" that pip must keep.
CLUSTER_TORCH = torch.__version__
OPTIONAL = ("s3fs", "lightning", "transformers", "diffusers", "accelerate", "matplotlib")
_IDENTITY = """
import importlib.metadata, json, os, torch
record = [f for f in importlib.metadata.distribution("torch").files if f.name == "RECORD"][0]
def stamp(path):
    status = os.stat(path)
    return [str(path), status.st_ino, status.st_mtime_ns]
print(json.dumps({"version": torch.__version__, "init": stamp(torch.__file__),
                  "record": stamp(record.locate())}))
"""


@dataclass
class Environment:
    """The clean environment after ``pip install torch``, then ``pip install WHEEL``."""

    root: Path
    wheel: Path
    torch_before: dict[str, Any]
    torch_after: dict[str, Any]
    installed: list[str]
    pip_log: str

    def run(self, *args: str, cwd: Path,
            timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
        """Run ``args`` (``python`` or a console script of this environment) from ``cwd``."""
        program = self.root / "bin" / args[0]
        return subprocess.run([str(program), *args[1:]], cwd=cwd, env=_user_env(),
                              capture_output=True, text=True, timeout=timeout, check=False)


def _user_env() -> dict[str, str]:
    """This process's environment less what would import resumekit from the checkout."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}


def _pip(python: Path, *args: str) -> str:
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check",
                           "--no-input", *args], env=_user_env(), capture_output=True,
                          text=True, timeout=HANG_S, check=False)
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _torch_identity(python: Path) -> dict[str, Any]:
    done = subprocess.run([str(python), "-c", _IDENTITY], env=_user_env(), capture_output=True,
                          text=True, timeout=HANG_S, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    base = tmp_path_factory.mktemp("install")
    (wheel,) = build_distributions(base / "dist", "wheel").glob("resumekit-*.whl")
    root = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=HANG_S,
                   env=_user_env())
    python = root / "bin" / "python"
    _pip(python, "install", f"torch=={CLUSTER_TORCH}")
    before = _torch_identity(python)
    report = base / "report.json"
    log = _pip(python, "install", "--report", str(report), str(wheel))
    installed = [item["metadata"]["name"].lower()
                 for item in json.loads(report.read_text())["install"]]
    return Environment(root, wheel, before, _torch_identity(python), installed, log)


def test_pip_install_of_the_wheel_keeps_the_torch_already_installed(env: Environment) -> None:
    assert env.torch_before["version"] == CLUSTER_TORCH
    assert env.torch_after == env.torch_before, env.pip_log
    assert "torch" not in env.installed and "resumekit" in env.installed, env.installed
    assert "Uninstalling torch" not in env.pip_log
    assert not set(OPTIONAL) & set(env.installed), env.installed
    check = subprocess.run([str(env.root / "bin" / "python"), "-m", "pip", "check"],
                           env=_user_env(), capture_output=True, text=True, timeout=HANG_S,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def _would_install(env: Environment, tmp_path: Path, *args: str) -> list[str]:
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    _pip(env.root / "bin" / "python", "install", "--dry-run", "--report", str(report),
         *args, str(env.wheel))
    return [item["metadata"]["name"].lower()
            for item in json.loads(report.read_text())["install"]]


def test_an_upgrade_keeps_torch_and_a_torch_constraint_keeps_it_even_from_an_eager_one(
    env: Environment, tmp_path: Path,
) -> None:
    # pip's default upgrade strategy touches a dependency only when it does not fit.
    assert "torch" not in _would_install(env, tmp_path, "--upgrade")
    # The docs' guard (docs/faq.md): the installed torch as a constraint. An eager upgrade
    # would otherwise take the newest torch the indexes hold, CUDA build and all.
    pin = tmp_path / "torch-pin.txt"
    pin.write_text(f"torch=={env.torch_before['version']}\n")
    assert "torch" not in _would_install(env, tmp_path, "--upgrade", "--upgrade-strategy",
                                         "eager", "-c", str(pin))


_CHECKPOINT = """
import sys, torch, resumekit
print(resumekit.__file__)
for name in sys.argv[2:]:
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(f"{name} is importable: not a runtime-only environment")
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
with resumekit.CheckpointManager(sys.argv[1], model=model, optimizer=optimizer) as ckpt:
    ckpt.save(3)
"""


_HELP_OF_EACH = """
import sys
from resumekit.cli import main
for command in sys.argv[1:]:
    status = main([command, "--help"])
    if status != 0:
        raise SystemExit(f"resumekit {command} --help exited {status}")
"""


def test_import_and_the_command_line_work_with_only_the_runtime_dependencies(
    env: Environment, tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    made = env.run("python", "-c", _CHECKPOINT, str(root), *OPTIONAL, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert Path(made.stdout.splitlines()[0]).is_relative_to(env.root), made.stdout

    version = env.run("resumekit", "--version", cwd=tmp_path)
    released = re.search(r'__version__ = "(.+)"', (REPO / "resumekit" / "_version.py").read_text())
    assert released is not None
    assert version.returncode == 0 and version.stdout.strip() == f"resumekit {released[1]}", \
        version
    usage = env.run("resumekit", "--help", cwd=tmp_path)
    assert usage.returncode == 0, usage.stderr
    commands = ("inspect", "verify", "export", "import", "diff", "prune")
    assert all(command in usage.stdout for command in commands), usage.stdout
    # Each command's parser imports what the command needs: one interpreter for all six.
    helped = env.run("python", "-c", _HELP_OF_EACH, *commands, cwd=tmp_path)
    assert helped.returncode == 0, helped.stdout[-2000:] + helped.stderr
    assert helped.stdout.count("usage: resumekit") == len(commands), helped.stdout

    listing = env.run("resumekit", "inspect", str(root), "--no-progress", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "committed" in listing.stdout and CLUSTER_TORCH in listing.stdout, listing.stdout
    verified = env.run("resumekit", "verify", str(root), "--no-progress", cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("ok") and "step 3" in verified.stdout, verified.stdout
    exported = env.run("resumekit", "export", str(root), "--out", str(tmp_path / "out"),
                       "--no-progress", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0


def test_optional_features_name_the_extra_to_install_in_one_line(
    env: Environment, tmp_path: Path,
) -> None:
    s3 = env.run("resumekit", "inspect", "s3://bucket/run", "--no-progress", cwd=tmp_path)
    assert s3.returncode == 1
    assert s3.stderr.strip() == (
        "resumekit: error: cannot open s3://bucket/run: an s3:// root needs s3fs, which is "
        "not installed: pip install 'resumekit[s3]'")
    lightning = env.run("python", "-c", "import resumekit.integrations.lightning", cwd=tmp_path)
    assert lightning.returncode == 1
    assert lightning.stderr.strip().splitlines()[-1] == (
        "resumekit.errors.MissingDependencyError: resumekit.integrations.lightning needs "
        "lightning, which is not installed: pip install 'resumekit[lightning]'")


def test_the_lingbot_drill_runs_on_the_runtime_dependencies_and_skips_only_its_plot(
    env: Environment, tmp_path: Path,
) -> None:
    work = tmp_path / "work"  # the examples beside no resumekit: the installed one runs
    shutil.copytree(REPO / "examples", work / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "demo"
    drill = env.run("python", "-m", "examples.lingbot.drill", "--out", str(out),
                    "--no-world-size-change", "--timeout", str(HANG_S), cwd=work,
                    timeout=HANG_S)
    lines = drill.stdout.splitlines()
    assert drill.returncode == 0, drill.stdout[-4000:] + drill.stderr[-4000:]
    assert lines[-1] == ("OK the preempted and crashed run is bit-identical to the "
                         "uninterrupted one"), lines[-5:]
    (picture,) = [line for line in lines if line.startswith("loss curves:")]
    assert picture.startswith(
        "loss curves: not drawn (the drill's loss.png needs matplotlib, which is not "
        "installed: pip install 'resumekit[plot]'); summary: "), picture
    assert not (out / "loss.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == []
    assert summary["comparisons"]["B"]["tensors_different"] == 0
    assert summary["comparisons"]["B"]["first_metric_difference"] is None
