"""Step names round-trip through every accepted NameFormat, and listing sorts numerically.

Budget: 150 examples for each name property, 40 roots for the listing (about 10 s in all).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resumekit.errors import ConfigurationError
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import HiddenName, NameFormat
from resumekit.store.manifest import MANIFEST_NAME, Manifest
from resumekit.store.storage import Storage

_LITERAL = st.text(
    alphabet="abcxyz_-.0123456789ABC", max_size=8
)
_SPEC = st.one_of(
    st.just(""),
    st.from_regex(r"0?[0-9]{0,2}d?", fullmatch=True).map(lambda spec: f":{spec}" if spec
                                                          else ""),
)


@st.composite
def templates(draw: st.DrawFn) -> str:
    prefix = draw(_LITERAL.filter(lambda text: not text.startswith(".")))
    return f"{prefix}{{step{draw(_SPEC)}}}{draw(_LITERAL)}"


steps = st.integers(min_value=0, max_value=10**15)
tokens = st.text(alphabet="0123456789abcdef", min_size=1, max_size=12)


def _format(template: str) -> NameFormat:
    try:
        return NameFormat(template)
    except ConfigurationError:
        assume(False)  # a template refused up front cannot write an unreadable name
        raise


@settings(max_examples=150, deadline=None)
@given(template=templates(), step=steps, token=tokens)
def test_every_accepted_name_format_parses_back_the_step_it_builds(
    template: str, step: int, token: str
) -> None:
    name_format = _format(template)
    name = name_format.build(step)
    assert name_format.parse(name) == step
    assert not name.startswith(".") and "/" not in name
    staging, retired = name_format.staging_name(step, token), name_format.retired_name(step,
                                                                                         token)
    assert name_format.parse(staging) is None and name_format.parse(retired) is None
    assert name_format.parse_hidden(staging) == (step, HiddenName(name, "tmp", token))
    assert name_format.parse_hidden(retired) == (step, HiddenName(name, "old", token))
    assert name_format.parse_hidden(name) is None


@settings(max_examples=150, deadline=None)
@given(template=templates(), first=steps, second=steps)
def test_two_different_steps_never_share_a_name(template: str, first: int,
                                                second: int) -> None:
    name_format = _format(template)
    assume(first != second)
    assert name_format.build(first) != name_format.build(second)


@settings(max_examples=40, deadline=None)
@given(
    template=st.sampled_from(["step_{step:09d}", "checkpoint_step_{step}", "{step}",
                              "ck-{step:03d}-x"]),
    chosen=st.sets(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=12),
)
def test_listing_sorts_steps_numerically_not_by_name(template: str, chosen: set[int]) -> None:
    name_format = NameFormat(template)
    root = tempfile.mkdtemp(prefix="resumekit-names-")
    try:
        storage = Storage(root)
        for step in chosen:
            storage.write_bytes(f"{name_format.build(step)}/{MANIFEST_NAME}",
                                Manifest(step=step).to_json())
        os.mkdir(os.path.join(root, "not_a_step_dir"))
        listed = list_checkpoints(storage, name_format)
        assert [entry.step for entry in listed] == sorted(chosen)
        assert all(entry.status == "committed" for entry in listed)
    finally:
        shutil.rmtree(root)
