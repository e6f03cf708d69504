"""The command line imports only what the command it runs needs.

``resumekit --help`` and the commands that only read the store (``inspect`` of a root,
``verify``, ``prune``) must work where torch cannot even be imported: each command's module
is imported only when it runs (``resumekit.cli.COMMANDS``), and the store (catalog, commit,
retention) is free of torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resumekit.cli import COMMANDS, build_parser
from tests.limits import HANG_S
from tests.unit.test_cli_support import write_checkpoints

# Runs the command lines given as JSON in argv[1], in order, in one process with torch made
# unimportable; prints one JSON object per command: exit status, output, the torch modules
# and the command modules imported so far.
_WITHOUT_TORCH = r"""
import contextlib, io, json, sys
sys.modules["torch"] = None  # `import torch` (and torch.anything) now raises ImportError
from resumekit.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    loaded = sorted(name for name, module in sys.modules.items()
                    if name.startswith("torch") and module is not None)
    commands = sorted(name for name in sys.modules if name.startswith("resumekit.cli."))
    print(json.dumps({"argv": argv, "code": code, "out": out.getvalue(),
                      "err": err.getvalue(), "torch_modules": loaded,
                      "cli_modules": commands}))
"""


def _run_without_torch(*commands: list[str]) -> list[dict[str, object]]:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, json.dumps(commands)],
                          capture_output=True, text=True, timeout=HANG_S, check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_help_inspect_verify_and_prune_of_a_root_run_where_torch_cannot_be_imported(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    write_checkpoints(root, [10, 20, 30])
    one = str(root / "step_000000020")
    results = _run_without_torch(
        ["--help"], ["prune", "--help"], ["inspect", str(root)],
        ["inspect", str(root), "--json"], ["verify", str(root)], ["verify", str(root), "--all"],
        ["verify", one], ["prune", str(root), "--keep-last", "2", "--dry-run"],
    )
    for result in results:
        assert result["code"] == 0, result
        assert result["torch_modules"] == [], result
    # --help imports no command module; a command imports only its own.
    assert results[0]["cli_modules"] == ["resumekit.cli._common"]
    assert results[1]["cli_modules"] == ["resumekit.cli._common", "resumekit.cli.prune"]
    help_text = " ".join(str(results[0]["out"]).split())
    for name, command in COMMANDS.items():
        assert f"{name} {command.summary}" in help_text
    listing = json.loads(str(results[3]["out"]))
    assert [c["step"] for c in listing["checkpoints"]] == [10, 20, 30]
    assert "2 kept, 1 would delete" in str(results[-1]["out"])


def test_a_command_that_needs_torch_says_so_in_one_line_where_torch_is_missing() -> None:
    (result,) = _run_without_torch(["export", "--help"])
    assert result["code"] == 1
    lines = str(result["err"]).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("resumekit: error: resumekit export "), lines
    assert "torch" in lines[0] and "Traceback" not in str(result["err"])


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_registered_command_builds_its_full_parser_with_the_registered_summary(
    name: str,
) -> None:
    parser = build_parser(name)
    subparsers = next(action for action in parser._actions
                      if action.dest == "command")
    (listed,) = [action for action in subparsers._choices_actions if action.dest == name]
    assert listed.help == COMMANDS[name].summary
    full = subparsers.choices[name]
    assert full.get_default("run") is not None  # the module registered its options
