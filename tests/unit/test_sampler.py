from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    SequentialSampler,
)

from resumekit.errors import (
    ConfigurationError,
    DistributedSetupError,
    IncompatibleCheckpointError,
)
from resumekit.state.sampler import ResumableDistributedSampler, SkipAheadSampler, wrap_sampler


def _reload(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _ranks(n: int, world: int, **options: Any) -> list[ResumableDistributedSampler]:
    return [
        ResumableDistributedSampler(n, num_replicas=world, rank=rank, **options)
        for rank in range(world)
    ]


def _consume(samplers: list[ResumableDistributedSampler], batch: int, steps: int) -> list[int]:
    """Every rank takes `steps` micro-batches of `batch` and reports them, in lockstep."""
    iterators = [iter(sampler) for sampler in samplers]
    taken: list[int] = []
    for _ in range(steps):
        for sampler, iterator in zip(samplers, iterators, strict=True):
            micro_batch = [index for _, index in zip(range(batch), iterator, strict=False)]
            taken.extend(micro_batch)
            sampler.advance(len(micro_batch))
    return taken


def _resume(state: dict[str, Any], n: int, world: int, **options: Any) -> list[int]:
    """Load `state` on `world` ranks and let each take the rest of the epoch."""
    rest: list[int] = []
    for sampler in _ranks(n, world, **options):
        sampler.load_state_dict(_reload(state))
        rest.extend(sampler)
    return rest


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "world"), [(10, 1), (10, 3), (7, 2), (2, 4), (0, 2)])
def test_a_fresh_epoch_deals_exactly_what_torch_distributed_sampler_deals(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    data = list(range(n))
    for rank in range(world):
        ours = ResumableDistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        theirs = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_after_c_global_samples_rank_r_yields_positions_c_plus_r_stepping_by_world_size() -> None:
    samplers = _ranks(50, 3, seed=1)
    _consume(samplers, batch=4, steps=2)
    order = samplers[0].epoch_order()
    assert samplers[0].consumed == 24
    for rank, sampler in enumerate(samplers):
        assert list(sampler)[:5] == [order[24 + rank + 3 * j] for j in range(5)]


@pytest.mark.parametrize("new_world", [1, 3])
def test_two_ranks_consume_then_a_resume_on_another_world_size_sees_each_sample_once(
    new_world: int,
) -> None:
    samplers = _ranks(60, 2, seed=3)
    samplers[0].set_epoch(2)
    samplers[1].set_epoch(2)
    before = _consume(samplers, batch=4, steps=3)
    assert samplers[0].state_dict() == samplers[1].state_dict()

    after = _resume(samplers[0].state_dict(), 60, new_world, seed=3)

    assert len(before) == 24
    assert sorted(before + after) == list(range(60))


def test_a_padded_tail_repeats_fewer_than_world_size_samples_from_the_start_of_the_epoch() -> None:
    samplers = _ranks(61, 2)
    before = _consume(samplers, batch=4, steps=3)
    order = samplers[0].epoch_order()

    after = _resume(samplers[0].state_dict(), 61, 3)  # 37 left: 13 each, 2 padded

    counts = Counter(before + after)
    assert set(counts) == set(range(61))
    assert sorted(index for index, seen in counts.items() if seen == 2) == sorted(order[:2])


def test_drop_last_leaves_out_only_the_ragged_end_of_the_remaining_tail() -> None:
    samplers = _ranks(61, 2, drop_last=True)
    before = _consume(samplers, batch=4, steps=3)
    order = samplers[0].epoch_order()

    after = _resume(samplers[0].state_dict(), 61, 3, drop_last=True)  # 37 left: 12 each

    assert len(before + after) == len(set(before + after)) == 60
    assert set(range(61)) - set(before + after) == {order[60]}


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 40),
    old_world=st.integers(1, 4),
    new_world=st.integers(1, 5),
    batch=st.integers(1, 5),
    steps=st.integers(0, 6),
    drop_last=st.booleans(),
)
def test_any_resume_covers_the_epoch_without_skips_and_repeats_only_padding(
    n: int, old_world: int, new_world: int, batch: int, steps: int, drop_last: bool
) -> None:
    samplers = _ranks(n, old_world, drop_last=drop_last)
    steps = min(steps, len(samplers[0]) // batch)
    before = _consume(samplers, batch=batch, steps=steps)
    finished_before = samplers[0].consumed == n
    after = _resume(samplers[0].state_dict(), n, new_world, drop_last=drop_last)
    seen = Counter(before + after)
    repeats = sum(seen.values()) - len(seen)
    # Only the phase that reaches the end of the epoch pads or drops, with its world size.
    if finished_before:
        assert after == []
        tail_world, tail_start = old_world, 0
    else:
        tail_world, tail_start = new_world, len(before)
    if drop_last:
        assert repeats == 0
        assert n - len(seen) == (n - tail_start) % tail_world
    else:
        assert set(seen) == set(range(n))
        assert repeats == -(n - tail_start) % tail_world


class _RecordingDataset(Dataset[int]):
    """Returns its index; appends every index it is asked for to a file (works in workers)."""

    def __init__(self, n: int, log: Path) -> None:
        self.n = n
        self.log = log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with self.log.open("a") as handle:
            handle.write(f"{index}\n")
        return index

    def reads(self) -> list[int]:
        if not self.log.exists():
            return []
        return [int(line) for line in self.log.read_text().split()]


class _CountingSampler(ResumableDistributedSampler):
    """Counts the indices a DataLoader pulled out of the sampler."""

    pulled = 0

    def __iter__(self) -> Iterator[int]:
        for index in super().__iter__():
            self.pulled += 1
            yield index


def test_a_resume_never_reads_the_samples_it_skips(tmp_path: Path) -> None:
    dataset = _RecordingDataset(30, tmp_path / "first.log")
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=9)
    consumed: list[int] = []
    for batch in DataLoader(dataset, batch_size=4, sampler=sampler):
        consumed.extend(batch.tolist())
        sampler.advance(len(batch))
        if len(consumed) == 12:
            break

    resumed_dataset = _RecordingDataset(30, tmp_path / "second.log")
    resumed = ResumableDistributedSampler(resumed_dataset, num_replicas=1, rank=0, seed=9)
    resumed.load_state_dict(_reload(sampler.state_dict()))
    loader = DataLoader(resumed_dataset, batch_size=4, sampler=resumed)
    rest = [i for batch in loader for i in batch.tolist()]

    assert sorted(resumed_dataset.reads()) == sorted(rest)
    assert not set(resumed_dataset.reads()) & set(consumed)
    assert sorted(consumed + rest) == list(range(30))


def test_samples_prefetched_by_two_workers_but_not_consumed_are_served_after_resume(
    tmp_path: Path,
) -> None:
    dataset = _RecordingDataset(40, tmp_path / "first.log")
    sampler = _CountingSampler(dataset, num_replicas=2, rank=1, seed=4)
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=2, prefetch_factor=2)
    consumed: list[int] = []
    for step, batch in enumerate(loader):
        consumed.extend(batch.tolist())
        sampler.advance(len(batch))
        if step == 1:
            break
    state = _reload(sampler.state_dict())
    assert sampler.pulled > len(consumed)  # the loader ran ahead: yields are not consumption
    rank0_share = list(_ranks(40, 2, seed=4)[0])[: len(consumed)]

    resumed_dataset = _RecordingDataset(40, tmp_path / "second.log")
    rest: list[int] = []
    for rank in range(3):
        resumed = ResumableDistributedSampler(resumed_dataset, num_replicas=3, rank=rank, seed=4)
        resumed.load_state_dict(state)
        if rank == 0:
            resumed_loader = DataLoader(
                resumed_dataset, batch_size=3, sampler=resumed, num_workers=2
            )
            assert -(-resumed.remaining // 3) == 4  # the rest: 4 batches of 3 here
            assert len(resumed_loader) == 5  # a whole epoch, as DistributedSampler's: 14
            rest.extend(i for batch in resumed_loader for i in batch.tolist())
        else:
            rest.extend(resumed)

    counts = Counter(rank0_share + consumed + rest)
    assert set(counts) == set(range(40))
    assert sum(counts.values()) - 40 == 2  # the padding of a 34-sample tail over 3 ranks
    assert not set(resumed_dataset.reads()) & set(rank0_share + consumed)


def test_setting_the_restored_epoch_keeps_the_position_and_a_new_epoch_starts_over() -> None:
    sampler = ResumableDistributedSampler(20, num_replicas=2, rank=0)
    sampler.set_epoch(4)
    sampler.advance(3)
    restored = ResumableDistributedSampler(20, num_replicas=2, rank=0)
    restored.load_state_dict(sampler.state_dict())

    restored.set_epoch(4)
    assert (restored.epoch, restored.consumed, restored.remaining) == (4, 6, 7)
    restored.set_epoch(5)
    assert (restored.epoch, restored.consumed, restored.remaining) == (5, 0, 10)


def test_an_iteration_already_started_is_not_changed_by_advance() -> None:
    sampler = ResumableDistributedSampler(12, num_replicas=2, rank=0)
    expected = list(sampler)
    iterator = iter(sampler)
    first = next(iterator)
    sampler.advance(1)
    assert [first, *iterator] == expected
    assert list(sampler) == expected[1:]


def test_finishing_the_share_marks_the_epoch_done_even_with_padding() -> None:
    sampler = ResumableDistributedSampler(7, num_replicas=2, rank=1)
    sampler.advance(sampler.remaining)
    assert sampler.consumed == 7
    assert list(sampler) == []


def test_advancing_past_this_ranks_share_is_an_error_naming_the_rank_and_epoch() -> None:
    sampler = ResumableDistributedSampler(10, num_replicas=2, rank=1)
    sampler.set_epoch(2)
    with pytest.raises(ConfigurationError, match=r"rank 1: only 5 samples of epoch 2") as caught:
        sampler.advance(6)
    assert caught.value.name == "num_samples"
    with pytest.raises(ConfigurationError, match="num_samples"):
        sampler.advance(-1)


def test_a_state_for_another_epoch_order_is_refused_listing_every_difference() -> None:
    state = ResumableDistributedSampler(10, num_replicas=1, rank=0, seed=1).state_dict()
    other = ResumableDistributedSampler(11, num_replicas=1, rank=0, seed=2)
    with pytest.raises(IncompatibleCheckpointError) as caught:
        other.load_state_dict(state)
    assert caught.value.differences == ["dataset_len: saved 10, now 11", "seed: saved 1, now 2"]
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("key", "value"), [("consumed", None), ("epoch", "3"), ("version", 2), ("shuffle", 1)]
)
def test_a_malformed_sampler_state_is_refused_naming_the_key(key: str, value: Any) -> None:
    state = ResumableDistributedSampler(10, num_replicas=1, rank=0).state_dict()
    if value is None:
        del state[key]
    else:
        state[key] = value
    with pytest.raises(IncompatibleCheckpointError, match=key) as caught:
        ResumableDistributedSampler(10, num_replicas=1, rank=0).load_state_dict(state)
    assert caught.value.key == key


def test_a_state_holds_only_plain_values_that_weights_only_loading_accepts() -> None:
    sampler = ResumableDistributedSampler(10, num_replicas=2, rank=0, seed=7)
    sampler.advance(2)
    assert _reload(sampler.state_dict()) == sampler.state_dict()


def test_a_rank_outside_the_world_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"rank must be in \[0, 2\), got 2"):
        ResumableDistributedSampler(10, num_replicas=2, rank=2)


def test_a_multi_rank_launch_without_a_process_group_is_a_setup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(DistributedSetupError, match="WORLD_SIZE=4") as caught:
        ResumableDistributedSampler(10)
    assert caught.value.variable == "WORLD_SIZE"


def test_a_single_process_without_a_group_is_rank_zero_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sampler = ResumableDistributedSampler(10, shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, list(range(10)))


def test_a_wrapped_batch_sampler_resumes_by_skipping_consumed_batches_without_reading_them(
    tmp_path: Path,
) -> None:
    dataset = _RecordingDataset(20, tmp_path / "first.log")

    def build(data: _RecordingDataset) -> SkipAheadSampler[list[int]]:
        inner = DistributedSampler(data, num_replicas=2, rank=0, seed=3)
        return SkipAheadSampler(BatchSampler(inner, batch_size=3, drop_last=False), world_size=2)

    first = build(dataset)
    first.set_epoch(1)
    everything = list(first)
    for _ in DataLoader(dataset, batch_sampler=first):
        first.advance()
        if first.consumed == 2:
            break

    resumed_dataset = _RecordingDataset(20, tmp_path / "second.log")
    resumed = build(resumed_dataset)
    resumed.load_state_dict(_reload(first.state_dict()))
    rest = [batch.tolist() for batch in DataLoader(resumed_dataset, batch_sampler=resumed)]

    assert resumed.epoch == 1
    assert resumed.remaining == 2
    assert rest == everything[2:]
    assert sorted(resumed_dataset.reads()) == sorted(i for batch in rest for i in batch)


def test_a_wrapped_sampler_refuses_a_resume_on_another_world_size() -> None:
    state = SkipAheadSampler(range(10), world_size=2).state_dict()
    with pytest.raises(IncompatibleCheckpointError, match="world_size") as caught:
        SkipAheadSampler(range(10), world_size=3).load_state_dict(state)
    assert caught.value.differences == ["world_size: saved 2, now 3"]


def test_wrap_sampler_returns_resumable_samplers_unchanged_and_wraps_others() -> None:
    resumable = ResumableDistributedSampler(5, num_replicas=1, rank=0)
    assert wrap_sampler(resumable) is resumable
    wrapped = wrap_sampler(range(5), world_size=1)
    assert isinstance(wrapped, SkipAheadSampler)
    assert wrap_sampler(wrapped) is wrapped


@pytest.mark.parametrize(("samples", "world", "drop_last"),
                         [(40, 3, False), (40, 3, True), (7, 2, False), (7, 2, True),
                          (8, 4, False)])
def test_len_is_the_per_rank_epoch_length_of_torchs_distributed_sampler_at_any_position(
    samples: int, world: int, drop_last: bool
) -> None:
    # A drop-in swap for DistributedSampler: len() means the same, also mid-epoch and at
    # the epoch's end (len() of what was left made a step loop divide by zero there).
    theirs = DistributedSampler(range(samples), num_replicas=world, rank=0, shuffle=True,
                                seed=1, drop_last=drop_last)
    ours = ResumableDistributedSampler(samples, num_replicas=world, rank=0, seed=1,
                                       drop_last=drop_last)
    assert len(ours) == len(theirs) == ours.remaining == len(list(ours))
    ours.advance(1)  # one sample trained on this rank
    assert len(ours) == len(theirs)
    assert ours.remaining == len(list(ours)) == len(theirs) - 1
    ours.advance(ours.remaining)
    assert (len(ours), ours.remaining, list(ours)) == (len(theirs), 0, [])


def test_a_wrapped_sampler_keeps_the_inner_len_and_says_what_is_left_as_remaining() -> None:
    wrapped = SkipAheadSampler(SequentialSampler(range(10)))
    wrapped.advance(4)
    assert (len(wrapped), wrapped.remaining, list(wrapped)) == (10, 6, list(range(4, 10)))


@pytest.mark.parametrize("inner", ["sequential", "batch"])
def test_a_wrapped_sampler_refuses_a_position_the_dataset_no_longer_fits(inner: str) -> None:
    from torch.utils.data import SequentialSampler  # noqa: PLC0415

    def build(length: int) -> Any:
        sampler = SequentialSampler(range(length))
        return wrap_sampler(sampler if inner == "sequential" else
                            BatchSampler(sampler, batch_size=1, drop_last=False), world_size=1)

    first = build(100)
    first.advance(80)
    state = _reload(first.state_dict())
    shrunk = build(50)
    with pytest.raises(IncompatibleCheckpointError, match="80") as caught:
        shrunk.load_state_dict(state)
    assert caught.value.differences == ["epoch/consumed: 0/80 out of range (length now 50)"]
    assert (shrunk.epoch, shrunk.consumed, len(list(shrunk))) == (0, 0, 50)  # untouched
    exact = build(80)  # the end of the epoch fits: the epoch is done
    exact.load_state_dict(state)
    assert list(exact) == []
    resumed = build(100)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 20


def test_a_wrapped_sampler_refuses_a_negative_position_as_an_incompatible_checkpoint() -> None:
    state = SkipAheadSampler(range(10), world_size=1).state_dict()
    with pytest.raises(IncompatibleCheckpointError, match="consumed"):
        SkipAheadSampler(range(10), world_size=1).load_state_dict({**state, "consumed": -3})
