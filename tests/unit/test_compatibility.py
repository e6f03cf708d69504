"""Whether a checkpoint fits the run, decided from fingerprints alone (no model, no load)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from resumekit.errors import IncompatibleCheckpointError
from resumekit.restore.compatibility import (
    check_compatibility,
    config_differences,
    param_differences,
)
from resumekit.store.manifest import Manifest, SaveReason
from resumekit.warnings import ResumekitWarning

PARAMS = {"0.weight": [4, 3], "0.bias": [4]}


def _manifest(config: dict[str, Any] | None = None, *, params: dict[str, Any] | None = None,
              world_size: int = 1, reason: SaveReason = SaveReason.INTERVAL) -> Manifest:
    fingerprint: dict[str, Any] = {"params": PARAMS if params is None else params}
    if config is not None:
        fingerprint["config"] = config
    return Manifest(step=3, world_size=world_size, reason=reason, fingerprint=fingerprint)


def _check(manifest: Manifest, config: dict[str, Any], *, world_size: int = 1,
           on_mismatch: Any = "error", params: dict[str, Any] | None = None) -> None:
    check_compatibility(manifest, "/root/step_3",
                        fingerprint={"config": config,
                                     "params": PARAMS if params is None else params},
                        world_size=world_size, on_mismatch=on_mismatch)


def test_parameter_differences_name_each_key_and_ignore_wrapper_atoms() -> None:
    assert param_differences({"module._orig_mod.0.weight": [4, 3]}, {"0.weight": (4, 3)}) == []
    assert param_differences(PARAMS, {"0.weight": [4, 2], "1.weight": [2]}) == [
        "0.bias: in the checkpoint, not in the model",
        "0.weight: checkpoint [4, 3], model [4, 2]",
        "1.weight: in the model, not in the checkpoint",
    ]
    assert param_differences({}, PARAMS) == []  # nothing recorded: nothing to compare


def test_configuration_differences_are_named_by_their_dotted_path() -> None:
    assert config_differences({"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "seed": 1},
                              {"optim": {"lr": 2e-3, "betas": [0.9, 0.95]}, "depth": 4}) == [
        "config.depth: absent in the checkpoint, 4 now",
        "config.optim.lr: checkpoint 0.001, now 0.002",
        "config.seed: 1 in the checkpoint, absent now",
    ]


def test_a_parameter_mismatch_is_an_error_whatever_on_mismatch_says() -> None:
    with pytest.raises(IncompatibleCheckpointError, match="does not fit the model") as caught:
        _check(_manifest(), {}, on_mismatch="ignore", params={"0.weight": [4, 3]})
    assert caught.value.differences == ["0.bias: in the checkpoint, not in the model"]


def test_a_configuration_mismatch_errors_warns_or_is_ignored_as_asked() -> None:
    saved = _manifest({"lr": 1})
    with pytest.raises(IncompatibleCheckpointError, match="on_mismatch='warn'"):
        _check(saved, {"lr": 2})
    with pytest.warns(ResumekitWarning, match=r"config\.lr: checkpoint 1, now 2"):
        _check(saved, {"lr": 2}, on_mismatch="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(saved, {"lr": 2}, on_mismatch="ignore")
        _check(saved, {"lr": 1})


def test_another_world_size_alone_only_warns_that_the_state_is_resharded() -> None:
    with pytest.warns(ResumekitWarning, match="world_size: checkpoint 2, now 4 "
                      r"\(state is resharded\)"):
        _check(_manifest({"lr": 1}, world_size=2), {"lr": 1}, world_size=4)


def test_an_imported_checkpoint_without_a_configuration_is_not_compared() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(_manifest(reason=SaveReason.IMPORTED), {"lr": 2})
    with pytest.raises(IncompatibleCheckpointError):  # one of ours records {} and differs
        _check(_manifest(), {"lr": 2})


def test_another_world_size_alone_is_a_correct_continuation_not_a_bit_exact_replay() -> None:
    with pytest.warns(ResumekitWarning) as seen:
        _check(_manifest({"lr": 1}, world_size=2), {"lr": 1}, world_size=4, on_mismatch="error")
    (warning,) = seen
    text = str(warning.message)
    assert "written by 2 rank(s), this run has 4" in text
    assert "not a bit-exact replay" in text
    assert "different configuration" not in text


def test_a_world_size_change_beside_a_config_change_is_one_more_line_of_that_error() -> None:
    with pytest.raises(IncompatibleCheckpointError) as caught:
        _check(_manifest({"lr": 1}, world_size=2), {"lr": 2}, world_size=4)
    assert caught.value.differences == [
        "config.lr: checkpoint 1, now 2",
        "world_size: checkpoint 2, now 4 (state is resharded)",
    ]


def test_an_imported_checkpoint_records_the_converters_world_size_and_is_not_compared() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(_manifest(reason=SaveReason.IMPORTED, world_size=1), {"lr": 2}, world_size=2)
