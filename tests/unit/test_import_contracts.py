"""The layer rules of docs/design.md hold: ``lint-imports`` keeps every contract.

``make lint`` runs the same command; this test also checks the one contract type of our own
(tests/lint_contracts.py), which reads import lines for a dotted external sub-package.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.limits import HANG_S
from tests.lint_contracts import ExternalSubpackageContract, imported_names

_REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("line", "reached"), [
    ("from torch.distributed.checkpoint.planner import ReadItem",
     ["torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.planner.ReadItem"]),
    ("from torch.distributed import checkpoint as dcp, rpc",
     ["torch.distributed", "torch.distributed.checkpoint", "torch.distributed.rpc"]),
    ("import torch.distributed.checkpoint as dcp", ["torch.distributed.checkpoint"]),
    ("from torch import (nn, optim)", ["torch", "torch.nn", "torch.optim"]),
    ("import torch", ["torch"]),
])
def test_an_import_line_reaches_every_dotted_name_it_names(line: str, reached: list[str]) -> None:
    assert imported_names(line) == reached


def test_the_dcp_contract_breaks_on_an_import_outside_its_importers_and_exceptions() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.store", "pkg.fingerprint", "pkg.reader", "pkg.model"):
        graph.add_module(module)
    graph.add_module("torch", is_squashed=True)
    lines = {"pkg.store": "from torch.distributed.checkpoint.planner import ReadItem",
             "pkg.fingerprint": "from torch.distributed.checkpoint.state_dict import x",
             "pkg.reader": "from torch.distributed import checkpoint as dcp",
             "pkg.model": "import torch.nn"}
    for number, (importer, line) in enumerate(lines.items(), start=1):
        graph.add_import(importer=importer, imported="torch", line_number=number,
                         line_contents=line)
    contract = ExternalSubpackageContract(
        name="dcp", session_options={"root_packages": ["pkg"]},
        contract_options={"protected": "torch.distributed.checkpoint",
                          "allowed_importers": ["pkg.sharded"],
                          "ignore_imports": [
                              "pkg.fingerprint -> torch.distributed.checkpoint.state_dict"]})
    check = contract.check(graph, verbose=False)
    assert not check.kept
    assert [item["importer"] for item in check.metadata["illegal"]] == ["pkg.reader",
                                                                        "pkg.store"]


def test_lint_imports_keeps_every_layer_contract() -> None:
    script = Path(sys.executable).with_name("lint-imports")
    command = str(script) if script.exists() else shutil.which("lint-imports")
    if command is None:
        pytest.skip("import-linter is not installed (the dev extra installs it)")
    done = subprocess.run([command, "--no-cache"], cwd=_REPO, capture_output=True, text=True,
                          timeout=HANG_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
