"""The benchmark step splits a large batch into micro-batches: compute grows, memory not."""

from __future__ import annotations

import pytest
import torch

from benchmarks import workload
from benchmarks.workload import Shape, build_model, train_step


def _step(batch: int, monkeypatch: pytest.MonkeyPatch, elements: int) -> tuple[
        torch.nn.Module, int]:
    monkeypatch.setattr(workload, "MICRO_BATCH_ELEMENTS", elements)
    model = build_model(Shape(2, 8))
    passes = []
    model.register_forward_hook(lambda module, args, out: passes.append(args[0].shape[0]))
    # SGD: the update is the gradient itself (AdamW's first step would hide its scale).
    train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch=batch, seed=3)
    return model, len(passes)


def test_a_batch_larger_than_a_micro_batch_takes_the_step_of_one_pass_over_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole, whole_passes = _step(40, monkeypatch, elements=10**6)
    split, split_passes = _step(40, monkeypatch, elements=8 * 16)  # 16 rows a pass
    assert (whole_passes, split_passes) == (1, 3)
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(split.state_dict()[name], tensor, msg=name)


def test_a_micro_batch_is_at_least_one_row() -> None:
    assert workload.micro_batch_rows(workload.MICRO_BATCH_ELEMENTS * 4) == 1
    assert workload.micro_batch_rows(128) == workload.MICRO_BATCH_ELEMENTS // 128
