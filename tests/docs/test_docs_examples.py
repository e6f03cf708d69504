"""Every ```python block in docs/ runs, so the documentation cannot rot.

Blocks of one page run in order in one namespace, in a temporary working directory.
A block preceded by ``<!-- no-run: reason -->`` is skipped (it needs a GPU cluster, say),
and the reason must be given. A block followed by a line ``prints `X` `` must print X.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(
    r"(?P<marker><!-- no-run:[^>]*-->\s*)?```python\n(?P<code>.*?)```\s*(?:\n(?P<after>[^\n]*))?",
    re.S,
)
PRINTS = re.compile(r"prints `([^`]*)`")


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_example_in_the_page_runs(page: Path, tmp_path: Path) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for number, match in enumerate(BLOCK.finditer(page.read_text()), start=1):
            if match.group("marker"):
                assert re.search(r"no-run:\s*\S", match.group("marker")), "give a reason"
                continue
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(match.group("code"), f"{page.name}[block {number}]", "exec"),
                     namespace)
            expected = PRINTS.search(match.group("after") or "")
            if expected:
                assert out.getvalue().strip().endswith(expected.group(1)), (
                    f"{page.name} block {number} printed {out.getvalue()!r}, "
                    f"the page says {expected.group(1)!r}"
                )
    finally:
        os.chdir(cwd)
