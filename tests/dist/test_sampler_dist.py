from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resumekit.state.rng import capture_rng, restore_rng, select_rank_rng
from resumekit.state.sampler import ResumableDistributedSampler
from resumekit.warnings import ResumekitWarning
from tests.distributed_harness import run_ranks

DATASET_LEN = 50
BATCH = 4


def _train_then_save(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(100 + rank)
    sampler = ResumableDistributedSampler(DATASET_LEN, seed=11)  # world and rank from the group
    sampler.set_epoch(1)
    consumed: list[int] = []
    iterator = iter(sampler)
    for _ in range(3):
        batch = [next(iterator) for _ in range(BATCH)]
        consumed.extend(batch)
        sampler.advance(len(batch))
    torch.save(
        {"rng": capture_rng(), "data": sampler.state_dict()}, Path(directory) / f"rank{rank}.pt"
    )
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, sampler.state_dict())
    return {
        "consumed": consumed,
        "draws_after_save": torch.rand(3).tolist(),
        "states_agree": all(state == gathered[0] for state in gathered),
        "world": (sampler.num_replicas, sampler.rank),
    }


def _resume(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """One rank of the resumed run (emulated in the test process: no group is needed)."""
    files = {int(path.stem[4:]): path for path in Path(directory).glob("rank*.pt")}
    wanted = {0, rank} & set(files)
    saved = {r: torch.load(files[r], weights_only=True) for r in wanted}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumekitWarning)
        restore_rng(select_rank_rng({r: s["rng"] for r, s in saved.items()}, rank))
    draws = torch.rand(3).tolist()
    sampler = ResumableDistributedSampler(
        DATASET_LEN, num_replicas=world_size, rank=rank, seed=11
    )
    sampler.load_state_dict(saved[0]["data"])
    sampler.set_epoch(1)  # the restored epoch: the position is kept
    return {
        "rest": list(sampler),
        "draws_after_restore": draws,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ResumekitWarning)],
    }


def test_two_real_ranks_save_mid_epoch_and_three_ranks_resume_rng_and_data(
    tmp_path: Path,
) -> None:
    before = run_ranks(_train_then_save, world_size=2, args=(str(tmp_path),))
    outer_streams = capture_rng()  # the emulated ranks reseed this process's globals
    try:
        after = [_resume(rank, 3, str(tmp_path)) for rank in range(3)]
    finally:
        restore_rng(outer_streams)

    assert [result["world"] for result in before] == [(2, 0), (2, 1)]
    assert all(result["states_agree"] for result in before)
    consumed = [i for result in before for i in result["consumed"]]
    rest = [i for result in after for i in result["rest"]]
    counts = Counter(consumed + rest)
    assert set(counts) == set(range(DATASET_LEN))
    assert sum(counts.values()) - DATASET_LEN == 1  # 26 left over 3 ranks: one padded
    # Ranks 0 and 1 continue their own streams exactly; rank 2 gets new, announced ones.
    for rank in (0, 1):
        assert after[rank]["draws_after_restore"] == before[rank]["draws_after_save"]
        assert after[rank]["warnings"] == []
    assert after[2]["draws_after_restore"] not in [r["draws_after_save"] for r in before]
    assert any("rank 2" in message for message in after[2]["warnings"])
