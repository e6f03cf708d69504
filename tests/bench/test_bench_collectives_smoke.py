"""``python -m benchmarks.collectives`` at two small worlds: it runs and reports every kind.

No speed is asserted (times on a shared machine mean nothing); only that every kind was
timed on every rank and the summary compares the two worlds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import collectives
from tests.limits import TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)


def test_every_collective_is_timed_at_each_world_size_and_compared(tmp_path: Path) -> None:
    out = tmp_path / "collectives.json"
    assert collectives.main(["--worlds", "2,3", "--calls", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["world_size"] for row in result["rows"]] == [2, 3]
    for row in result["rows"]:
        for kind in collectives.KINDS:
            figures = row[kind]
            assert figures["cpu_ms_rank0"] >= 0 and figures["wall_ms_rank0"] > 0, (row, kind)
            assert figures["cpu_ms_others_median"] >= 0, (row, kind)
    assert set(result["summary"]) == {f"{kind}_cpu_w3_vs_w2" for kind in collectives.KINDS}
    assert result["measured"]["commit"]


def test_a_world_of_one_rank_is_refused() -> None:
    with pytest.raises(SystemExit):
        collectives.main(["--worlds", "1,2"])
