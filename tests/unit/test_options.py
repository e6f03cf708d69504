"""CheckpointOptions: the manager's knobs, validated, given as options= or as keywords."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import resumekit
from resumekit import tensors
from resumekit.errors import ConfigurationError
from resumekit.options import CheckpointOptions, OptionKeywords
from resumekit.store.catalog import list_checkpoints, read_manifest
from resumekit.store.retention import keep_last
from resumekit.store.storage import Storage

# Each: a knob, a value that cannot work, and what the message says of it.
_BAD = [
    ("save_every", 0, "greater than or equal to 1"),
    ("save_every", -5, "greater than or equal to 1"),
    ("save_every", True, "not a bool"),
    ("save_every", "every", "a number of steps or 'auto'"),
    ("interruptions_every", 0, "greater than 0"),
    ("interruptions_every", -60.0, "greater than 0"),
    ("retention", 3, "RetentionPolicy"),
    ("name_format", "no_step_field", "exactly one {step} field"),
    ("async_save", "sometimes", "boolean"),
    ("async_writer", "fork", "'thread' or 'process'"),
    ("async_writer", "process", "needs async_save=True"),
    ("background_priority", "low", "'idle' or 'normal'"),
    ("on_mismatch", "bogus", "'error', 'warn' or 'ignore'"),
    ("fallback", None, "boolean"),
    ("verify_on_restore", [], "boolean"),
    ("storage_options", "endpoint", "dictionary"),
    ("import_legacy", object(), "boolean"),
    ("tensor_format", "safetensors", "'raw' or 'dcp'"),
    ("read_only", 2, "boolean"),
    ("foreign", "import", "'error' or 'ignore'"),
    ("stage_ahead", "later", "boolean"),
    ("capture_at_signal", "at once", "boolean"),
    ("restore_reads", "twice", "'once' or 'every_rank'"),
    ("local", "/dev/shm/run", "LocalTier"),
]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_every_knob_has_a_refused_value_in_this_table() -> None:
    assert {name for name, _, _ in _BAD} == set(CheckpointOptions.model_fields)


@pytest.mark.parametrize(("name", "value", "said"), _BAD,
                         ids=[f"{name}={'object()' if type(value) is object else repr(value)}"
                              for name, value, _ in _BAD])  # stable across xdist workers
def test_a_knob_that_cannot_work_is_refused_naming_it_in_options_and_as_a_keyword(
    tmp_path: Path, name: str, value: Any, said: str,
) -> None:
    with pytest.raises(ConfigurationError) as built:
        CheckpointOptions(**{name: value})
    assert built.value.name == name
    assert built.value.value is value or built.value.value == value
    assert name in str(built.value) or name == "name_format"
    assert said in str(built.value)
    root = tmp_path / "root"
    with pytest.raises(ConfigurationError) as kept:
        resumekit.CheckpointManager(root, **{name: value})
    assert kept.value.name == name
    assert str(kept.value) == str(built.value)
    assert not root.exists()  # refused before the root is touched


def test_several_bad_knobs_are_all_named_and_the_first_is_the_errors_name() -> None:
    with pytest.raises(ConfigurationError) as caught:
        CheckpointOptions(fallback="perhaps", foreign="maybe")
    assert caught.value.name == "fallback"
    assert "fallback='perhaps'" in str(caught.value)
    assert "foreign='maybe'" in str(caught.value)


def test_an_unknown_option_is_refused_and_an_unknown_manager_keyword_is_a_type_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigurationError, match="save_evry is not an option") as caught:
        CheckpointOptions(save_evry=5)  # type: ignore[call-arg]
    assert caught.value.name == "save_evry"
    with pytest.raises(TypeError, match="unexpected keyword argument 'modle'"):
        resumekit.CheckpointManager(tmp_path, modle=nn.Linear(2, 2))  # type: ignore[call-arg]


def test_options_that_are_not_options_are_refused_naming_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="must be a CheckpointOptions") as caught:
        resumekit.CheckpointManager(tmp_path, options={"save_every": 5})  # type: ignore[arg-type]
    assert caught.value.name == "options"


def test_the_defaults_are_the_managers_documented_defaults() -> None:
    options = CheckpointOptions()
    assert options.save_every is None
    assert options.retention is not None and options.retention.description == "keep_last(3)"
    assert options.name_format == "step_{step:09d}"
    assert (options.async_save, options.background_priority) == (False, "idle")
    assert (options.on_mismatch, options.foreign, options.tensor_format) == (
        "error", "error", None)
    assert (options.fallback, options.verify_on_restore, options.import_legacy) == (
        True, True, True)
    assert (options.read_only, options.stage_ahead) == (False, True)
    assert options.restore_reads == "once"
    assert options.model_fields_set == set()


def test_options_are_frozen() -> None:
    options = CheckpointOptions(save_every=10)
    with pytest.raises(ValueError, match="frozen"):
        options.save_every = 20  # type: ignore[misc]
    assert options.save_every == 10


def test_the_keyword_form_and_the_options_form_build_the_same_manager(tmp_path: Path) -> None:
    model, optimizer = _model()
    knobs: dict[str, Any] = {"save_every": 2, "retention": keep_last(2), "fallback": False,
                             "on_mismatch": "warn", "tensor_format": "dcp"}
    by_keyword = resumekit.CheckpointManager(tmp_path / "a", model=model,
                                             optimizer=optimizer, **knobs)
    by_options = resumekit.CheckpointManager(tmp_path / "b", model=model,
                                             optimizer=optimizer,
                                             options=resumekit.CheckpointOptions(**knobs))
    assert by_keyword.options == by_options.options
    for manager in (by_keyword, by_options):
        assert manager.options.model_fields_set == set(knobs)
        assert (manager.save_every, manager.fallback, manager.on_mismatch) == (
            2, False, "warn")
        assert manager.retention is knobs["retention"]
        assert manager.tensor_format == "dcp"
        for step in range(1, 7):
            manager.step_end(step)
        manager.close()
    for root in ("a", "b"):  # saved every 2 steps, the newest 2 kept
        committed = [e.step for e in list_checkpoints(Storage(tmp_path / root))
                     if e.status == "committed"]
        assert committed == [4, 6], root
        manifest = read_manifest(Storage(tmp_path / root), "step_000000006")
        assert manifest.tensor_format == "dcp"


def test_a_keyword_fills_a_knob_the_options_left_unset(tmp_path: Path) -> None:
    shared = CheckpointOptions(save_every=3, verify_on_restore=False)
    manager = resumekit.CheckpointManager(tmp_path, options=shared, read_only=True)
    assert manager.options == CheckpointOptions(save_every=3, verify_on_restore=False,
                                                read_only=True)
    assert (manager.save_every, manager.verify_on_restore, manager.read_only) == (
        3, False, True)
    assert shared.read_only is False  # the options given are not changed
    with pytest.raises(ConfigurationError, match="read_only"):
        manager.save(1)


@pytest.mark.parametrize("same", [True, False], ids=["same value", "other value"])
def test_a_knob_set_in_options_and_given_as_a_keyword_is_refused(
    tmp_path: Path, same: bool,
) -> None:
    root = tmp_path / "root"
    options = CheckpointOptions(save_every=10, async_save=True)
    with pytest.raises(ConfigurationError, match=r"async_save given twice") as caught:
        resumekit.CheckpointManager(root, options=options, async_save=same)
    assert caught.value.name == "async_save"
    assert not root.exists()


def test_a_knob_left_at_its_default_value_explicitly_counts_as_set() -> None:
    options = CheckpointOptions(fallback=True)
    with pytest.raises(ConfigurationError, match="fallback given twice"):
        options.merged({"fallback": False})
    assert options.merged({}) is options


def test_the_keyword_type_lists_exactly_the_options_fields_with_their_types() -> None:
    keywords = typing.get_type_hints(OptionKeywords)
    fields = typing.get_type_hints(CheckpointOptions)
    assert list(keywords) == list(CheckpointOptions.model_fields)
    for name, annotation in keywords.items():
        assert annotation == fields[name], name


def test_the_tensor_formats_the_options_accept_are_the_ones_sharded_writes() -> None:
    annotation = CheckpointOptions.model_fields["tensor_format"].annotation
    accepted = {value for arg in typing.get_args(annotation)
                for value in typing.get_args(arg)}
    assert accepted == set(tensors.TENSOR_FORMATS)
