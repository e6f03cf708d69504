"""The LingBot-VA trainer's own pieces, in one process: config, metrics file, micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.lingbot.config import get_config
from examples.lingbot.data import SyntheticEpisodeDataset
from examples.lingbot.errors import ConfigError
from examples.lingbot.train import (
    MetricsLog,
    MicroBatches,
    _local_tier,
    build_parser,
    read_metrics,
    recipe_fingerprint,
    resolve_config,
)
from resumekit.state.sampler import ResumableDistributedSampler


def test_another_world_size_keeps_the_effective_batch_by_rederiving_accumulation() -> None:
    two = resolve_config("tiny", world_size=2)
    one = resolve_config("tiny", world_size=1)
    assert (two.train.grad_accum_steps, one.train.grad_accum_steps) == (2, 4)
    assert two.train.effective_batch_size == one.train.effective_batch_size == 8
    assert recipe_fingerprint(two) == recipe_fingerprint(one)
    longer = resolve_config("tiny", world_size=2, num_steps=99, save_interval=3)
    assert recipe_fingerprint(longer) == recipe_fingerprint(two)
    assert recipe_fingerprint(resolve_config("tiny", world_size=2, seed=5)) != \
        recipe_fingerprint(two)


def test_the_local_tier_flags_become_the_managers_local_tier_every_fifth_interval_by_default(
) -> None:
    parse = build_parser().parse_args
    assert _local_tier(parse(["--save-root", "r"]), save_interval=50) is None
    tier = _local_tier(parse(["--save-root", "r", "--local-dir", "/dev/shm/run"]), 50)
    assert tier is not None
    assert (tier.root, tier.save_every, tier.keep, tier.replicas) == ("/dev/shm/run", 10, 2, True)
    assert _local_tier(parse(["--save-root", "r", "--local-dir", "l"]), 3).save_every == 1
    tier = _local_tier(parse(["--save-root", "r", "--local-dir", "l", "--local-every", "7",
                              "--local-keep", "1"]), 50)
    assert tier is not None and (tier.save_every, tier.keep) == (7, 1)
    with pytest.raises(ConfigError, match="--local-every needs --local-dir"):
        _local_tier(parse(["--save-root", "r", "--local-every", "7"]), 50)


def test_a_world_size_that_does_not_divide_the_effective_batch_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"effective_batch_size=8.*3\*2"):
        resolve_config("tiny", world_size=3)


def test_truncating_the_metrics_keeps_records_up_to_the_resumed_step_and_drops_a_torn_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0 / step}) for step in range(1, 8)]
    path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # killed mid-write

    log = MetricsLog(path, enabled=True)
    assert log.truncate_after(5) == 2
    log.append({"step": 6, "loss": 0.1 + 0.2})
    log.close()

    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["loss"] == 1.0 / 3  # full float precision round-trips
    assert records[-1]["loss"] == 0.1 + 0.2
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))


def test_a_disabled_metrics_log_on_other_ranks_never_touches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 9, "loss": 1.0}) + "\n")
    log = MetricsLog(path, enabled=False)
    assert log.truncate_after(0) == 0
    log.append({"step": 1, "loss": 2.0})
    log.close()
    assert read_metrics(path) == [{"step": 9, "loss": 1.0}]


def _micro_batches(sampler: ResumableDistributedSampler) -> MicroBatches:
    dataset = SyntheticEpisodeDataset.from_config(get_config("tiny"))
    return MicroBatches(dataset, sampler, 2, torch.device("cpu"))


def test_micro_batches_follow_the_sampler_across_epochs_and_resume_from_its_state() -> None:
    sampler = ResumableDistributedSampler(64, num_replicas=2, rank=1, seed=0)
    batches = _micro_batches(sampler)
    seen = []
    for _ in range(20):  # 16 micro-batches of 2 per rank make an epoch
        batch = next(batches)
        seen.append(batch["index"].tolist())
        sampler.advance(2)
    assert sampler.epoch == 1
    epoch0 = ResumableDistributedSampler(64, num_replicas=2, rank=1, seed=0).epoch_order()
    assert [i for pair in seen[:16] for i in pair] == epoch0[1::2]  # rank 1's share, in order
    state = sampler.state_dict()

    resumed_sampler = ResumableDistributedSampler(64, num_replicas=2, rank=1, seed=0)
    resumed_sampler.load_state_dict(state)
    resumed = _micro_batches(resumed_sampler)
    for _ in range(5):
        expected = next(batches)["index"].tolist()
        sampler.advance(2)
        assert next(resumed)["index"].tolist() == expected
        resumed_sampler.advance(2)


def test_micro_batches_deal_an_epoch_without_repeats_over_the_ranks() -> None:
    indices: list[int] = []
    for rank in range(2):
        sampler = ResumableDistributedSampler(64, num_replicas=2, rank=rank, seed=0)
        batches = _micro_batches(sampler)
        for _ in range(16):
            indices += next(batches)["index"].tolist()
            sampler.advance(2)
    assert sorted(indices) == list(range(64))


def test_a_mixed_precision_config_on_cpu_says_it_trains_in_fp32(
        caplog: pytest.LogCaptureFixture) -> None:
    import dataclasses
    import logging
    from types import SimpleNamespace

    from examples.lingbot.train import _build_model

    tiny = get_config("tiny")
    config = dataclasses.replace(
        tiny, train=dataclasses.replace(tiny.train, mixed_precision=True))
    context = SimpleNamespace(device=torch.device("cpu"), is_distributed=False)
    with caplog.at_level(logging.WARNING, logger="lingbot.train"):
        model = _build_model(config, context)  # type: ignore[arg-type]
    assert next(model.parameters()).dtype == torch.float32
    assert "needs CUDA: this run on cpu trains in fp32" in caplog.text


def test_the_trainer_seeds_python_and_numpy_per_rank_so_derived_rng_streams_repeat() -> None:
    # resumekit derives a new rank's streams from a hash of all of rank 0's saved streams:
    # Python's and NumPy's must not come from OS entropy, or a regrown run differs per rerun.
    import random

    import numpy as np

    from examples.lingbot.train import _seed_python_and_numpy

    states = []
    for rank in (0, 0, 1):
        random.seed()  # OS entropy, as in an unseeded process
        np.random.seed()
        _seed_python_and_numpy(1234, rank)
        states.append((random.getstate(), np.random.get_state()[1].tobytes()))
    assert states[0] == states[1]  # same seed and rank: the same streams on every rerun
    assert states[0][0] != states[2][0] and states[0][1] != states[2][1]  # per rank
