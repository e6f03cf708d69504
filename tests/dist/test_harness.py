from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed_harness import run_ranks


def _all_reduce_rank(rank: int, world_size: int) -> int:
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    return int(value.item())


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_ranks_share_a_real_gloo_group() -> None:
    assert run_ranks(_all_reduce_rank, world_size=2) == [3, 3]


def test_an_error_on_one_rank_fails_the_test_with_its_message() -> None:
    with pytest.raises(AssertionError, match="rank one refuses"):
        run_ranks(_fail_on_rank_one, world_size=2, init_group=False)
