from __future__ import annotations

import io
import pickle
import random
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import resumekit.state.rng as rng_module
from resumekit.errors import IncompatibleCheckpointError, ResumekitError
from resumekit.state.rng import capture_rng, restore_rng, select_rank_rng
from resumekit.warnings import ResumekitWarning


@pytest.fixture(autouse=True)
def _leave_global_streams_as_found() -> Iterator[None]:
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def _reload(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _draws(generators: Sequence[torch.Generator] = ()) -> list[Any]:
    """A few draws from every source; gauss/randn exercise the cached-normal fields."""
    return [
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        float(np.random.randn()),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
        *[torch.rand(3, generator=gen).tolist() for gen in generators],
    ]


def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, count: int, seed: int = 100
) -> list[torch.Generator]:
    """Stand in for `count` CUDA devices with CPU generators (this machine has no GPU).

    Only the device-count policy is exercised this way; the generator calls are the
    same ones restore_rng makes on real CUDA generators (get_state/set_state/manual_seed).
    """
    devices = [torch.Generator().manual_seed(seed + index) for index in range(count)]
    monkeypatch.setattr(rng_module, "_cuda_generators", lambda: tuple(devices))
    return devices


def test_draws_after_restore_equal_the_draws_made_right_after_capture() -> None:
    augment = torch.Generator().manual_seed(7)
    random.gauss(0.0, 1.0)  # leaves python's second normal cached in gauss_next
    np.random.randn()  # leaves numpy's second normal cached
    state = _reload(capture_rng({"augment": augment}))
    expected = _draws([augment])
    _draws([augment])  # move every stream on

    restore_rng(state, {"augment": augment})

    assert _draws([augment]) == expected


def test_a_captured_state_holds_only_types_that_torch_load_weights_only_accepts() -> None:
    state = capture_rng({"a": torch.Generator().manual_seed(1)})
    reloaded = _reload(state)
    assert reloaded.keys() == state.keys()
    assert torch.equal(reloaded["torch"], state["torch"])
    assert torch.equal(reloaded["python"]["internal"], state["python"]["internal"])
    assert torch.equal(reloaded["numpy"]["key"], state["numpy"]["key"])
    assert reloaded["cuda"] is None  # captured on a machine without CUDA


def test_a_missing_registered_generator_is_an_error_naming_it_and_nothing_is_restored() -> None:
    state = capture_rng({"augment": torch.Generator()})
    torch.rand(5)
    before = torch.get_rng_state()

    with pytest.raises(IncompatibleCheckpointError, match=r"generators\.dropout") as caught:
        restore_rng(state, {"dropout": torch.Generator()})

    assert caught.value.key == "generators.dropout"
    assert isinstance(caught.value, ValueError)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_saved_generator_that_nobody_registered_is_ignored_with_a_warning_naming_it() -> None:
    state = capture_rng({"augment": torch.Generator()})
    with pytest.warns(ResumekitWarning, match=r"generators\.augment"):
        restore_rng(state)


def test_a_generator_saved_from_another_device_type_is_refused() -> None:
    state = capture_rng({"noise": torch.Generator()})
    state["generators"]["noise"]["device"] = "cuda:0"
    with pytest.raises(IncompatibleCheckpointError, match=r"generators\.noise"):
        restore_rng(state, {"noise": torch.Generator()})


@pytest.mark.parametrize(
    ("path", "replacement", "key"),
    [
        (("version",), 99, "version"),
        (("numpy", "key"), None, "numpy.key"),
        (("python",), None, "python"),
        (("cuda",), "not a list", "cuda"),
    ],
)
def test_a_malformed_state_is_refused_with_the_key_at_fault(
    path: tuple[str, ...], replacement: Any, key: str
) -> None:
    state = capture_rng()
    target = state
    for part in path[:-1]:
        target = target[part]
    if replacement is None:
        del target[path[-1]]
    else:
        target[path[-1]] = replacement
    with pytest.raises(IncompatibleCheckpointError) as caught:
        restore_rng(state)
    assert caught.value.key == key
    assert key in str(caught.value)


def test_every_cuda_device_generator_is_captured_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    devices = _fake_cuda(monkeypatch, count=2)
    state = _reload(capture_rng())
    assert isinstance(state["cuda"], list) and len(state["cuda"]) == 2
    expected = _draws(devices)
    _draws(devices)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        restore_rng(state)

    assert _draws(devices) == expected


def test_cuda_states_for_more_devices_than_visible_restore_the_common_ones_and_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved_on = _fake_cuda(monkeypatch, count=3)
    state = capture_rng()
    expected_device0 = torch.rand(2, generator=saved_on[0]).tolist()
    restored_on = _fake_cuda(monkeypatch, count=1, seed=999)

    with pytest.warns(ResumekitWarning, match="'cuda'.*3 CUDA generator.*1 device"):
        restore_rng(state)

    assert torch.rand(2, generator=restored_on[0]).tolist() == expected_device0


def test_cuda_states_with_cuda_unavailable_warn_and_restore_the_cpu_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cuda(monkeypatch, count=2)
    state = capture_rng()
    expected = torch.rand(3).tolist()
    monkeypatch.setattr(rng_module, "_cuda_generators", tuple)

    with pytest.warns(ResumekitWarning, match="'cuda'.*not available"):
        restore_rng(state)

    assert torch.rand(3).tolist() == expected


def test_a_state_captured_without_cuda_warns_when_restored_where_cuda_is_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = capture_rng()
    _fake_cuda(monkeypatch, count=1)
    with pytest.warns(ResumekitWarning, match="'cuda'.*captured without CUDA"):
        restore_rng(state)


def _saved_run(world_size: int) -> dict[int, dict[str, Any]]:
    states = {}
    for rank in range(world_size):
        random.seed(rank)
        np.random.seed(rank)
        torch.manual_seed(rank)
        states[rank] = _reload(capture_rng({"augment": torch.Generator().manual_seed(rank)}))
    return states


def _streams_of(state: dict[str, Any]) -> list[Any]:
    augment = torch.Generator()
    restore_rng(state, {"augment": augment})
    return _draws([augment])


def test_a_rank_the_checkpoint_has_gets_exactly_its_own_saved_streams() -> None:
    saved = _saved_run(world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumekitWarning)
        chosen = select_rank_rng(saved, 1)
    assert _streams_of(chosen) == _streams_of(saved[1])


def test_a_rank_beyond_the_saved_world_gets_deterministic_streams_and_a_warning() -> None:
    saved = _saved_run(world_size=2)
    with pytest.warns(ResumekitWarning, match="rank 3 .*derived from rank 0"):
        first = select_rank_rng(saved, 3)
    with pytest.warns(ResumekitWarning):
        again = select_rank_rng(_saved_run(world_size=2), 3)

    assert _streams_of(first) == _streams_of(again)
    assert first["origin"].startswith("derived for rank 3")


def test_new_ranks_get_streams_unlike_each_other_and_unlike_every_saved_rank() -> None:
    saved = _saved_run(world_size=2)
    with pytest.warns(ResumekitWarning):
        derived = [select_rank_rng(saved, rank) for rank in (2, 3, 4)]
    streams = [_streams_of(state) for state in (*saved.values(), *derived)]
    for index, stream in enumerate(streams):
        for other in streams[index + 1 :]:
            for source, other_source in zip(stream, other, strict=True):
                assert source != other_source


def test_derived_streams_depend_on_the_saved_state_not_only_on_the_rank() -> None:
    saved = _saved_run(world_size=1)
    torch.manual_seed(12345)
    later = {0: _reload(capture_rng({"augment": torch.Generator().manual_seed(0)}))}
    with pytest.warns(ResumekitWarning):
        assert _streams_of(select_rank_rng(saved, 1)) != _streams_of(select_rank_rng(later, 1))


def test_a_derived_state_round_trips_through_torch_load_weights_only_and_seeds_cuda_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_cuda(monkeypatch, count=2)
    saved = {0: _reload(capture_rng({"augment": torch.Generator()}))}
    with pytest.warns(ResumekitWarning):
        derived = _reload(select_rank_rng(saved, 1))
    assert [type(entry) for entry in derived["cuda"]] == [int, int]

    devices = _fake_cuda(monkeypatch, count=2, seed=0)
    restore_rng(derived, {"augment": torch.Generator()})
    after_restore = [torch.rand(2, generator=device).tolist() for device in devices]
    restore_rng(derived, {"augment": torch.Generator()})
    assert [torch.rand(2, generator=device).tolist() for device in devices] == after_restore
    assert after_restore[0] != after_restore[1]


def test_deriving_a_new_rank_without_rank_zeros_state_is_an_error() -> None:
    saved = _saved_run(world_size=2)
    del saved[0]
    with pytest.raises(IncompatibleCheckpointError, match="rank 0"):
        select_rank_rng(saved, 5)


def test_rng_errors_pickle_with_their_key() -> None:
    with pytest.raises(ResumekitError) as caught:
        restore_rng({"version": 1})
    clone = pickle.loads(pickle.dumps(caught.value))
    assert clone.key == caught.value.key == "python"


def test_a_state_a_generator_rejects_names_its_key_and_leaves_cpu_streams_as_they_were() -> None:
    state = capture_rng()
    state["torch"] = state["torch"][:100]  # truncated: torch refuses it
    random.random()
    before = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())

    with pytest.raises(IncompatibleCheckpointError) as caught:
        restore_rng(state)

    assert caught.value.key == "torch"
    after = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    assert after[:2] == before[:2]
    assert torch.equal(after[2], before[2])
