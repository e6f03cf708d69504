"""``resumekit import --model MODULE:FACTORY``: the factory's model names an Accelerate
``save_state`` folder's optimizer state that shapes alone cannot (two parameters of one
shape); a spec that names no model is a one-line usage error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from tests.unit.test_cli_support import run_cli
from tests.unit.test_importers import _assert_restores_bitwise, _snapshot

HERE = __name__  # the module the specs below name (tests.unit.test_cli_import_model)


def equal_shapes() -> nn.Sequential:
    """The factory ``--model`` calls: two parameters share each shape."""
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))


def not_a_model() -> dict[str, int]:
    return {"layers": 3}


def broken() -> nn.Module:
    raise RuntimeError("no weights here")


def _accelerate_state(folder: Path) -> dict[str, object]:
    accelerator = Accelerator(cpu=True)
    model = equal_shapes()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    accelerator.save_state(str(folder))
    return _snapshot(accelerator.unwrap_model(model), optimizer.optimizer)


def test_import_with_a_model_factory_names_two_parameters_of_one_shape_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _accelerate_state(tmp_path / "acc")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "acc"), str(tmp_path / "root"),
                           "--step", "1")
    assert code == 1 and "cannot be told apart by shape" in err
    assert "--model MODULE:FACTORY" in err  # the refusal names the CLI way out
    code, out, err = run_cli(capsys, "import", str(tmp_path / "acc"), str(tmp_path / "root"),
                             "--step", "1", "--model", f"{HERE}:equal_shapes")
    assert code == 0, err
    assert "imported accelerate checkpoint" in out and "as step 1" in out
    fresh = equal_shapes()
    _assert_restores_bitwise(tmp_path / "root", expected, fresh,
                             torch.optim.AdamW(fresh.parameters(), lr=1e-2), 1)


@pytest.mark.parametrize(("spec", "reason"), [
    ("equal_shapes", "is not MODULE:FACTORY"),
    (f"{HERE}:", "is not MODULE:FACTORY"),
    ("tests.unit.no_such_module:build", "cannot import module 'tests.unit.no_such_module'"),
    (f"{HERE}:missing", "has no 'missing'"),
    (f"{HERE}:HERE", "'HERE' is not callable"),
    (f"{HERE}:not_a_model", "not_a_model() returned dict, not a torch.nn.Module"),
    (f"{HERE}:broken", "broken() failed: RuntimeError: no weights here"),
])
def test_a_model_spec_that_names_no_model_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, reason: str
) -> None:
    _accelerate_state(tmp_path / "acc")
    code, out, err = run_cli(capsys, "import", str(tmp_path / "acc"), str(tmp_path / "root"),
                             "--step", "1", "--model", spec)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("resumekit import: error: ")
    assert f"--model {spec!r}" in lines[0] and reason in lines[0], lines[0]
    assert not (tmp_path / "root").exists()  # nothing written
