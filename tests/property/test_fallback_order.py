"""Restore resumes the newest usable step and names every step it passed over.

Issue 37, finding 1, as a property: over random sets of damaged and undamaged committed
checkpoints (a flipped byte, a garbled manifest, a missing file), with a kill (an
exception no handler catches, as a SIGKILL ends a process) landing at any of the
restore's phases (verify, tensor read, training-state read, setting a step aside, before
or after each), a restore run again afterwards resumes the newest undamaged step,
holds its weights, and names in a warning every step above it that it did not resume.

Budget: 40 random roots of six checkpoints, each restored once or twice, about 15 s.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from resumekit import restore_root
from resumekit.errors import ResumekitError
from resumekit.manager import CheckpointManager
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning

STEPS = (10, 20, 30, 40, 50, 60)
DAMAGES = ("checksum", "manifest", "missing")


class _Killed(BaseException):
    """The process died here (nothing in resumekit catches a BaseException)."""


def _manager(root: Path, seed: int = 0) -> CheckpointManager:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return CheckpointManager(root, model=model, optimizer=optimizer, retention=None)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, torch.Tensor]]:
    """A root with STEPS committed, and the weight each step holds."""
    root = tmp_path_factory.mktemp("fallback") / "root"
    manager = _manager(root)
    weights = {}
    for step in STEPS:
        with torch.no_grad():
            manager.state.model.weight.add_(1.0)  # type: ignore[union-attr]
        weights[step] = manager.state.model.weight.detach().clone()  # type: ignore[union-attr]
        manager.save(step)
    manager.close()
    return root, weights


def _damage(step_dir: Path, how: str) -> None:
    if how == "checksum":
        victim = step_dir / "train_state.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif how == "manifest":
        (step_dir / "manifest.json").write_bytes(b'{"schema_version": 1, "step": ')
    else:
        (step_dir / "train_state.pt").unlink()


@contextlib.contextmanager
def _kill_at(point: int | None) -> Iterator[None]:
    """Raise :class:`_Killed` at the ``point``-th phase boundary of a restore (None: never).

    The boundaries: before and after each verification of a checkpoint's files, each
    tensor read, each training-state read and each rename (setting a step aside).
    """
    seen = [0]

    def tick() -> None:
        if point is not None and seen[0] == point:
            seen[0] += 1
            raise _Killed
        seen[0] += 1

    def around(original: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            tick()
            result = original(*args, **kwargs)
            tick()
            return result
        return hooked

    with mock.patch.object(restore_root, "verify_share",
                           around(restore_root.verify_share)), \
            mock.patch.object(restore_root.tensor_io, "load",
                              around(restore_root.tensor_io.load)), \
            mock.patch.object(restore_root, "read_plain",
                              around(restore_root.read_plain)), \
            mock.patch.object(Storage, "rename_dir", around(Storage.rename_dir)):
        yield


def _restore(root: Path, kill: int | None = None) -> tuple[int | None, list[str], Any]:
    """Restore ``root``; return the step, the warnings, and the weight (or what was raised)."""
    manager = _manager(root, seed=1)
    said: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught, _kill_at(kill):
            warnings.simplefilter("always")
            try:
                step = manager.restore()
            finally:
                said = [str(w.message) for w in caught
                        if issubclass(w.category, ResumekitWarning)]
        return step, said, manager.state.model.weight.detach().clone()  # type: ignore[union-attr]
    finally:
        with contextlib.suppress(Exception):
            manager.close()


def _named(step: int, said: list[str]) -> bool:
    return any(f"step_{step:09d}" in message for message in said)


def _nothing_usable(root: Path, damaged: dict[int, str]) -> None:
    """No step is usable: an error naming each committed one, or (none committed: every
    manifest is garbled) a fresh start that names each step directory it set aside."""
    committed = [step for step, how in damaged.items() if how != "manifest"]
    if committed:
        with pytest.raises(ResumekitError) as raised:
            _restore(root)
        for step in committed:
            assert f"step {step}:" in str(raised.value), (step, raised.value)
        return
    step, said, _ = _restore(root)
    assert step == 0  # a fresh start
    for passed in STEPS:
        assert _named(passed, said), (passed, said)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damages=st.lists(st.sampled_from((None, *DAMAGES)), min_size=len(STEPS),
                        max_size=len(STEPS)),
       kill=st.integers(min_value=0, max_value=20))
def test_restore_resumes_the_newest_usable_step_and_names_every_step_it_passed_over(
        template: tuple[Path, dict[int, torch.Tensor]], damages: list[str | None],
        kill: int) -> None:
    source, weights = template
    damaged = {step: how for step, how in zip(STEPS, damages, strict=True) if how}
    usable = [step for step in STEPS if step not in damaged]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "root"
        shutil.copytree(source, root)
        for step, how in damaged.items():
            _damage(root / f"step_{step:09d}", how)
        if not usable:
            _nothing_usable(root, damaged)
            return
        expected = usable[-1]
        try:
            step, said, weight = _restore(root, kill)
        except _Killed:
            event("killed part-way, then restored again")
        else:  # the kill point lay past this restore's end: it must hold on its own
            event("ran to the end, then restored again")
            assert step == expected
            assert torch.equal(weight, weights[expected])
            for passed in (s for s in STEPS if s > expected):
                assert _named(passed, said), (passed, said)
        step, said, weight = _restore(root)  # the requeued job, or a second restore
        assert step == expected, (damaged, kill, said)
        assert torch.equal(weight, weights[expected])
        for passed in (s for s in STEPS if s > expected):
            assert _named(passed, said), (passed, damaged, kill, said)
