"""``inspect ROOT`` lists every readable step and names each unreadable one (issue 36 item 6).

One step directory without read permission made ``inspect ROOT`` print only the error, no
table for the other steps. The suite runs as root in CI containers, where ``chmod 000``
does not stop a read: the test makes the storage answer EACCES for that one step's files,
as the kernel does for another user.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from resumekit.cli import main
from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from tests.unit.test_cli_support import Trainer

DENIED = "step_000000002"


@pytest.fixture
def one_step_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "run"
    trainer = Trainer(root)
    for step in (1, 2, 3):
        trainer.save(step)
    trainer.close()
    original = Storage.read_small

    def read_small(self: Storage, relative: str, *args: Any, **kwargs: Any) -> Any:
        if relative.startswith(f"{DENIED}/"):
            raise PermissionError(errno.EACCES, "Permission denied", self.path(relative))
        return original(self, relative, *args, **kwargs)

    monkeypatch.setattr(Storage, "read_small", read_small)
    return root


def test_inspect_lists_the_readable_steps_and_names_the_unreadable_one(
    one_step_unreadable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(one_step_unreadable)]) == 1  # a problem found
    out, err = capsys.readouterr()
    rows = [line.split() for line in out.splitlines()]
    assert ["1", "committed"] in [row[:2] for row in rows]
    assert ["*", "3", "committed"] in [row[:3] for row in rows]
    assert f"unreadable: {one_step_unreadable / DENIED}: " in out
    assert "Permission denied" in out
    assert err.startswith("resumekit: error: 1 entry of ") and DENIED in err
    assert len(err.splitlines()) == 1


def test_inspect_json_lists_the_readable_steps_and_the_unreadable_one(
    one_step_unreadable: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(one_step_unreadable), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert [row["step"] for row in document["checkpoints"]] == [1, 3]
    [denied] = document["unreadable"]
    assert denied["name"] == DENIED and "Permission denied" in denied["error"]


def test_a_reader_that_picks_a_step_still_refuses_an_unreadable_root(
    one_step_unreadable: Path,
) -> None:
    # restore and the other readers list without `unreadable=`: they never skip a step.
    with pytest.raises(OSError, match="Permission denied"):
        list_checkpoints(Storage(one_step_unreadable))
