"""Step directory names: building, parsing, numeric order, hidden work-in-progress names."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumekit.errors import ConfigurationError
from resumekit.store import layout
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import (
    DEFAULT_NAME_FORMAT,
    LEGACY_NAME_FORMAT,
    HiddenName,
    NameFormat,
)
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from tests.storage_backends import save_checkpoint
from tests.unit.test_cli_support import write_checkpoints


def test_the_default_format_pads_steps_to_nine_digits() -> None:
    fmt = NameFormat()
    assert fmt.template == DEFAULT_NAME_FORMAT == "step_{step:09d}"
    assert fmt.build(0) == "step_000000000"
    assert fmt.build(1000) == "step_000001000"
    assert fmt.parse("step_000001000") == 1000
    assert fmt.build(1_234_567_890) == "step_1234567890"
    assert fmt.parse("step_1234567890") == 1_234_567_890


def test_the_legacy_lingbot_format_is_checkpoint_step_without_padding() -> None:
    fmt = NameFormat(LEGACY_NAME_FORMAT)
    assert fmt.build(200) == "checkpoint_step_200"
    assert fmt.parse("checkpoint_step_200") == 200
    assert fmt.parse("checkpoint_step_0") == 0


@pytest.mark.parametrize("step", [0, 1, 9, 10, 999_999_999, 1_000_000_000, 10**15])
@pytest.mark.parametrize("template", [DEFAULT_NAME_FORMAT, LEGACY_NAME_FORMAT, "ckpt-{step:06}",
                                      "{step}", "run7_{step:d}_final"])
def test_every_built_name_parses_back_to_its_step(template: str, step: int) -> None:
    fmt = NameFormat(template)
    assert fmt.parse(fmt.build(step)) == step


@pytest.mark.parametrize(
    "name",
    [
        "step_1",  # not canonical under nine-digit padding
        "step_0000000001",  # one digit too many
        "step_00000000a",
        "step_-00000001",
        "step_000000001x",
        "xstep_000000001",
        "step_000000001/",
        "step_ 00000001",
        "checkpoint_step_1",
        "notes.txt",
        "",
        ".step_000000001",
        "step_000000001.tmp-abc",
        "step_" + "".join(chr(0xFF10 + d) for d in range(1, 10)),  # fullwidth, yet regex \d
    ],
)
def test_names_that_are_not_canonical_steps_do_not_parse(name: str) -> None:
    assert NameFormat().parse(name) is None


def test_the_legacy_format_rejects_leading_zeros_so_one_step_has_one_name() -> None:
    fmt = NameFormat(LEGACY_NAME_FORMAT)
    assert fmt.parse("checkpoint_step_0200") is None
    assert fmt.parse("checkpoint_step_") is None


@pytest.mark.parametrize(
    "template",
    [
        "step",  # no field
        "step_{}",  # positional
        "step_{0}",
        "step_{epoch}",
        "step_{step}_{step}",
        "{step}_{epoch}",
        "step_{step:x}",  # hex
        "step_{step:.2f}",
        "step_{step:>9}",  # space padding never parses back
        "step_{step:9d}",
        "step_{step:9}",
        "step_{step:,}",
        "ckpt/{step}",  # a path, not a name
        ".step_{step}",  # hidden names are reserved for work in progress
        "step_{step",  # malformed
    ],
)
def test_invalid_templates_are_rejected_naming_the_template(template: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        NameFormat(template)
    assert template in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_negative_step_has_no_name() -> None:
    with pytest.raises(ConfigurationError, match="-1"):
        NameFormat().build(-1)


def test_staging_and_retired_names_are_hidden_and_parse_back() -> None:
    fmt = NameFormat()
    staging = fmt.staging_name(1000, "a1b2c3")
    retired = fmt.retired_name(1000, "d4e5f6")
    assert staging == ".step_000001000.tmp-a1b2c3"
    assert retired == ".step_000001000.old-d4e5f6"
    assert fmt.parse(staging) is None
    assert fmt.parse(retired) is None
    assert fmt.parse_hidden(staging) == (1000, HiddenName("step_000001000", "tmp", "a1b2c3"))
    assert fmt.parse_hidden(retired) == (1000, HiddenName("step_000001000", "old", "d4e5f6"))


@pytest.mark.parametrize(
    "name",
    [".step_000001000.tmp-", ".step_1.tmp-abc", "step_000001000.tmp-abc",
     ".step_000001000.bak-abc", ".step_000001000.tmp-a/b", ".notes"],
)
def test_hidden_names_of_other_shapes_do_not_parse(name: str) -> None:
    assert NameFormat().parse_hidden(name) is None


def test_listing_sorts_legacy_names_numerically_and_ignores_strangers(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    legacy = NameFormat(LEGACY_NAME_FORMAT)
    for step in (50, 900, 1000):
        save_checkpoint(store, step, name_format=legacy)
    (tmp_path / "checkpoint_step_abc").mkdir()
    (tmp_path / "checkpoint_step_12.bak").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoint_step_7").write_text("a file, not a directory")
    (tmp_path / "README").write_text("hello")
    entries = list_checkpoints(store, legacy)
    assert [(e.name, e.status) for e in entries] == [
        ("checkpoint_step_50", "committed"),
        ("checkpoint_step_900", "committed"),
        ("checkpoint_step_1000", "committed"),
    ]
    latest = latest_committed(store, legacy)
    assert latest is not None
    assert latest.step == 1000


def test_listing_sorts_past_the_nine_digit_padding(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    save_checkpoint(store, 999_999_999)
    save_checkpoint(store, 1_000_000_000)
    assert [e.name for e in list_checkpoints(store)] == ["step_999999999", "step_1000000000"]
    latest = latest_committed(store)
    assert latest is not None
    assert latest.step == 1_000_000_000


def test_a_weights_only_legacy_directory_lists_as_legacy_not_committed(tmp_path: Path) -> None:
    store = Storage(tmp_path)
    weights = tmp_path / "checkpoint_step_200" / "transformer"
    weights.mkdir(parents=True)
    (weights / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    save_checkpoint(store, 100)
    entries = list_checkpoints(store)
    assert [(e.step, e.name, e.status) for e in entries] == [
        (100, "step_000000100", "committed"),
        (200, "checkpoint_step_200", "legacy"),
    ]
    latest = latest_committed(store)
    assert latest is not None
    assert latest.step == 100


def test_every_name_in_a_saved_step_directory_is_one_layout_defines(tmp_path: Path) -> None:
    write_checkpoints(tmp_path, [5])
    step_dir = tmp_path / layout.NameFormat().build(5)
    files = sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                   if p.is_file())
    assert layout.MANIFEST_NAME in files and layout.TRAIN_STATE_FILE in files
    assert f"{layout.TENSORS_DIR}/{layout.DCP_METADATA_FILE}" in files
    assert layout.rank_state_file(0) in files
    for path in files:
        top = path.split("/", 1)[0]
        assert top in {layout.MANIFEST_NAME, layout.TRAIN_STATE_FILE, layout.TENSORS_DIR,
                       layout.RANK_STATE_DIR}, path
        if top == layout.RANK_STATE_DIR:
            assert layout.parse_rank_state_file(path) == 0
    assert layout.parse_rank_state_file("rank_state/sub/rank_00001.pt") is None
