"""scripts/compat_matrix.py: the counts it records, the table it writes, the page it fills.

The script is the release step behind ``make test-torch`` and ``make test-matrix``
(docs/compatibility.md); it lives outside the package, so it is loaded from its file.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from resumekit import _compat

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_matrix",
                                                  REPO / "scripts" / "compat_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(passed: int, seconds: float, **more: Any) -> dict[str, Any]:
    return {"passed": passed, "failed": 0, "errors": 0, "skipped": 0, "seconds": seconds,
            "exit": 0, "commit": "abc1234", **more}


def test_a_pytest_suites_counts_come_from_its_report_failures_and_skips_apart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    suite = tmp_path / "test_sample.py"
    suite.write_text("import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
                     "def test_c():\n    assert False\n\n"
                     "def test_d():\n    pytest.skip('not here')\n")
    monkeypatch.setitem(script.PYTEST_SUITES, "sample", [str(suite)])
    result = script.run_pytest(Path(sys.executable), "sample", 0, tmp_path / "sample.log")
    assert {k: result[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 2, "failed": 1, "errors": 0, "skipped": 1}
    assert result["exit"] == 1 and result["seconds"] > 0
    assert "test_c" in (tmp_path / "sample.log").read_text()


def test_the_table_has_a_row_per_torch_in_release_order_and_the_cross_checks() -> None:
    script = _script()
    newest = {"torch": "2.15.0+cu132", "suites": {
        "unit": _result(1077, 200.4), "dist": _result(65, 600, failed=3, exit=1)}}
    floor = {"torch": "2.9.1+cu128", "suites": {"unit": _result(1077, 180.0)},
             "cross": {}}
    pin = {"torch": "2.13.0+cpu", "suites": {"drill": _result(1, 95.2)}, "cross": {
        "2.15.0": {"writer": "2.15.0+cu132", "reader": "2.13.0+cpu", "passed": True}}}
    table = script.render_table([newest, floor, pin]).splitlines()
    assert table[0] == "| torch | unit | property | dist | drill | commit |"
    assert table[2].startswith("| 2.9.1+cu128 | 1077 passed (180 s) | not run |")
    assert table[3].startswith("| 2.13.0+cpu | not run | not run | not run | 1 passed (95 s)")
    assert table[4] == ("| 2.15.0+cu132 | 1077 passed (200 s) | not run | "
                        "65 passed, 3 failed (600 s) | not run | abc1234 |")
    assert table[-1] == "| 2.15.0+cu132 | 2.13.0+cpu | yes |"


def test_the_table_is_written_between_the_markers_and_nothing_else_changes(
        tmp_path: Path) -> None:
    script = _script()
    results = tmp_path / "results"
    results.mkdir()
    (results / "torch-2.13.0.json").write_text(
        '{"torch": "2.13.0+cpu", "suites": {"unit": {"passed": 5, "failed": 0, "errors": 0,'
        ' "skipped": 0, "seconds": 3, "exit": 0, "commit": "abc"}}}')
    page = tmp_path / "compatibility.md"
    page.write_text(f"before\n{script.BEGIN}\nold table\n{script.END}\nafter\n")
    args = type("Args", (), {"results": str(results), "doc": str(page)})
    assert script.command_table(args) == 0
    text = page.read_text()
    assert text.startswith(f"before\n{script.BEGIN}\n| torch |") and text.endswith(
        f"| 2.13.0+cpu | 5 passed (3 s) | not run | not run | not run | abc |\n"
        f"{script.END}\nafter\n")
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="lacks the markers"):
        script.command_table(args)



def test_the_compatibility_page_shows_a_run_of_the_floor_the_ci_pin_and_a_2_15() -> None:
    """The table as run covers the declared floor, the Makefile's pin and the newest."""
    script = _script()
    page = (REPO / "docs" / "compatibility.md").read_text()
    table = page.split(script.BEGIN, 1)[1].split(script.END, 1)[0]
    tested = {_compat.torch_release(row.split("|")[1])[:2]
              for row in table.splitlines()[2:] if re.match(r"\| \d", row)
              and "written by" not in row and row.count("|") == 7}
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert pin is not None
    floor = _compat.torch_release(_compat.SUPPORTED_TORCH.split(",")[0].lstrip(">="))[:2]
    assert {floor, _compat.torch_release(pin.group(1))[:2], (2, 15)} <= tested, tested
