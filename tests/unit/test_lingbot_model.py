"""The LingBot-VA example's configs, model, losses and schedule, on one process and on
two FSDP2 ranks."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from examples.lingbot.config import LingBotConfig, config_names, get_config
from examples.lingbot.data import SyntheticEpisodeDataset, collate
from examples.lingbot.errors import BatchError, ConfigError
from examples.lingbot.model import LingBotVA, count_parameters, shard_model
from examples.lingbot.recipe import (
    FlowNoise,
    build_optimizer,
    build_scheduler,
    flow_matching_loss,
    flow_matching_step,
    sample_flow_noise,
)
from tests.distributed_harness import run_ranks

TINY = get_config("tiny")
FURNITURE = get_config("furniture_all_e128")
FURNITURE_PARAMETERS = 5_010_204_894


def _tiny_model(seed: int = 0) -> LingBotVA:
    torch.manual_seed(seed)
    return LingBotVA(TINY.model)


def _batch(indices: range | list[int], config: LingBotConfig = TINY) -> dict[str, torch.Tensor]:
    dataset = SyntheticEpisodeDataset.from_config(config)
    return collate([dataset[index] for index in indices])


# --- configs -------------------------------------------------------------------------


def test_both_named_configs_exist_and_an_unknown_name_lists_them() -> None:
    assert config_names() == ["furniture_all_e128", "tiny"]
    with pytest.raises(ConfigError, match=r"'furniture'.*furniture_all_e128, tiny") as caught:
        get_config("furniture")
    assert caught.value.known == ["furniture_all_e128", "tiny"]  # type: ignore[attr-defined]
    assert isinstance(caught.value, ValueError)


def test_the_furniture_config_carries_the_incident_recipe() -> None:
    model, optim, train = FURNITURE.model, FURNITURE.optim, FURNITURE.train
    assert (model.num_layers, model.dim, model.num_heads, model.ffn_dim, model.text_dim) == (
        30, 3072, 24, 14336, 4096)
    assert (model.in_channels, model.patch_size, model.action_dim) == (48, (1, 2, 2), 30)
    assert train.world_size == 8 and train.effective_batch_size == 128
    assert train.world_size * train.micro_batch_size * train.grad_accum_steps == 128
    assert (optim.lr, optim.betas, optim.weight_decay) == (3e-5, (0.9, 0.95), 0.1)
    assert (optim.warmup_steps, optim.grad_clip) == (200, 2.0)


def test_invalid_config_values_are_rejected_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig\.effective_batch_size=100.*2\*2\*2 = 8"):
        dataclasses.replace(TINY.train, effective_batch_size=100)
    with pytest.raises(ConfigError, match=r"ModelConfig\.dim=66.*num_heads=4"):
        dataclasses.replace(TINY.model, dim=66)
    with pytest.raises(ConfigError, match=r"DataConfig\.width=5.*patch width 2"):
        dataclasses.replace(TINY, data=dataclasses.replace(TINY.data, width=5))
    with pytest.raises(ConfigError, match="empty_prompt_prob"):
        dataclasses.replace(TINY.data, empty_prompt_prob=1.5)
    error = pickle.loads(pickle.dumps(ConfigError("x", field="f", value=1)))
    assert (type(error), error.field, error.value) == (ConfigError, "f", 1)


# --- model ---------------------------------------------------------------------------


def test_the_tiny_model_predicts_latents_and_actions_of_the_input_shapes() -> None:
    batch = _batch(range(2))
    noise = sample_flow_noise(batch, torch.Generator().manual_seed(0))
    inputs = {"latents": batch["latents"], "timesteps": noise.timesteps, "text": batch["text"],
              "actions": batch["actions"], "action_timesteps": noise.action_timesteps}
    latent_pred, action_pred = _tiny_model()(inputs)
    assert latent_pred.shape == batch["latents"].shape == (2, 48, 2, 4, 4)
    assert action_pred.shape == batch["actions"].shape == (2, 4, 30)
    assert latent_pred.dtype == action_pred.dtype == torch.float32


def test_module_names_that_are_checkpoint_keys_are_stable() -> None:
    keys = set(_tiny_model().state_dict())
    for prefix in ("patch_embedding.", "text_embedding.", "time_embedding.",
                   "action_embedder.proj.", "action_embedder.time_embedding.", "proj_out.",
                   "action_proj_out.", "blocks.0.attn1.q.", "blocks.1.attn2.k.",
                   "blocks.1.ffn.fc_in."):
        assert any(key.startswith(prefix) for key in keys), prefix
    assert "blocks.0.modulation" in keys and "blocks.2.attn1.q.weight" not in keys


def test_the_furniture_model_has_about_five_billion_parameters_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = LingBotVA(FURNITURE.model)
    counted = sum(parameter.numel() for parameter in model.parameters())
    assert counted == count_parameters(FURNITURE.model) == FURNITURE_PARAMETERS
    assert 4.5e9 < counted < 5.5e9


def test_the_analytic_parameter_count_matches_the_built_tiny_model() -> None:
    model = _tiny_model()
    assert count_parameters(TINY.model) == sum(p.numel() for p in model.parameters()) > 0


def test_a_wrongly_shaped_model_input_is_rejected_naming_the_key() -> None:
    batch = _batch(range(2))
    noise = sample_flow_noise(batch, torch.Generator().manual_seed(0))
    inputs = {"latents": batch["latents"], "timesteps": noise.timesteps[:, :1],
              "text": batch["text"], "actions": batch["actions"],
              "action_timesteps": noise.action_timesteps}
    with pytest.raises(BatchError, match=r"'timesteps' has shape \(2, 1\), expected \(2, 2\)"):
        _tiny_model()(inputs)
    inputs["timesteps"] = noise.timesteps
    del inputs["text"]
    with pytest.raises(BatchError, match="lacks key 'text'"):
        _tiny_model()(inputs)


def _loss_and_grads(model_seed: int, noise_seed: int,
                    batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    model = _tiny_model(model_seed)
    terms = flow_matching_step(model, batch, torch.Generator().manual_seed(noise_seed))
    terms.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return terms, grads


def test_the_same_seeds_give_bitwise_identical_losses_and_gradients() -> None:
    batch = _batch(range(4))
    first, first_grads = _loss_and_grads(0, 7, batch)
    second, second_grads = _loss_and_grads(0, 7, batch)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert first_grads.keys() == second_grads.keys() and len(first_grads) > 0
    for name, grad in first_grads.items():
        assert torch.equal(grad, second_grads[name]), name
    other_noise, _ = _loss_and_grads(0, 8, batch)
    other_model, _ = _loss_and_grads(1, 7, batch)
    assert not torch.equal(first.loss, other_noise.loss)
    assert not torch.equal(first.loss, other_model.loss)


def test_the_same_seed_gives_bitwise_identical_predictions() -> None:
    batch = _batch(range(2))
    noise = sample_flow_noise(batch, torch.Generator().manual_seed(3))
    inputs = {"latents": batch["latents"], "timesteps": noise.timesteps, "text": batch["text"],
              "actions": batch["actions"], "action_timesteps": noise.action_timesteps,
              "action_mask": batch["action_mask"]}
    first, second = _tiny_model()(inputs), _tiny_model()(inputs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_masked_out_actions_change_neither_the_loss_nor_any_gradient() -> None:
    batch = _batch(range(4))
    assert not batch["action_mask"].all(), "the batch must hold padded action steps"
    noise = sample_flow_noise(batch, torch.Generator().manual_seed(5))
    results = []
    for fill in (0.0, 0.9, float("nan")):
        changed = dict(batch)
        changed["actions"] = torch.where(batch["action_mask"].unsqueeze(-1), batch["actions"],
                                         torch.full_like(batch["actions"], fill))
        model = _tiny_model()
        terms = flow_matching_loss(model, changed, noise)
        terms.loss.backward()
        results.append((terms, [p.grad.clone() for p in model.parameters()]))
    (base_terms, base_grads), *others = results
    for terms, grads in others:
        for a, b in zip(base_terms, terms, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(base_grads, grads, strict=True):
            assert torch.equal(a, b)
    # ...while a valid action step does change it.
    changed = dict(batch)
    changed["actions"] = batch["actions"].clone()
    changed["actions"][0, 0] = -batch["actions"][0, 0] + 0.5
    assert not torch.equal(flow_matching_loss(_tiny_model(), changed, noise).action_loss,
                           base_terms.action_loss)


def test_the_action_loss_averages_each_sample_over_its_valid_steps() -> None:
    batch = _batch(range(2))
    noise = sample_flow_noise(batch, torch.Generator().manual_seed(1))
    model = _tiny_model()
    terms = flow_matching_loss(model, batch, noise)
    t = noise.action_timesteps[:, :, None]
    inputs = {"latents": (1 - noise.timesteps[:, None, :, None, None]) * batch["latents"]
              + noise.timesteps[:, None, :, None, None] * noise.latent_noise,
              "timesteps": noise.timesteps, "text": batch["text"],
              "actions": (1 - t) * batch["actions"] + t * noise.action_noise,
              "action_timesteps": noise.action_timesteps, "action_mask": batch["action_mask"]}
    latent_pred, action_pred = model(inputs)
    target = noise.action_noise - batch["actions"]
    per_sample = [
        ((action_pred[i] - target[i])[batch["action_mask"][i]] ** 2).mean() for i in range(2)
    ]
    expected_latent = ((latent_pred - (noise.latent_noise - batch["latents"])) ** 2).mean()
    torch.testing.assert_close(terms.action_loss, torch.stack(per_sample).mean())
    torch.testing.assert_close(terms.latent_loss, expected_latent)
    torch.testing.assert_close(terms.loss, terms.latent_loss + terms.action_loss)


def test_noise_draws_come_only_from_the_given_generator_in_a_fixed_order() -> None:
    batch = _batch(range(2))
    torch.manual_seed(123)
    first = sample_flow_noise(batch, torch.Generator().manual_seed(9))
    torch.manual_seed(456)  # the global RNG must not matter
    second = sample_flow_noise(batch, torch.Generator().manual_seed(9))
    for name in ("timesteps", "action_timesteps", "latent_noise", "action_noise"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    generator = torch.Generator().manual_seed(9)
    assert torch.equal(first.timesteps, torch.rand(2, 2, generator=generator))
    assert first.timesteps.min() >= 0 and first.timesteps.max() < 1


def test_the_learning_rate_warms_up_linearly_then_stays_constant() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, FURNITURE.optim)
    scheduler = build_scheduler(optimizer, FURNITURE.optim)
    rates = []
    for _ in range(260):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(3e-5 / 200)
    assert rates[99] == pytest.approx(3e-5 * 100 / 200)
    assert rates[199] == rates[259] == pytest.approx(3e-5)
    assert all(a < b for a, b in itertools.pairwise(rates[:200]))
    group = optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.95), 0.1)


# --- two FSDP2 ranks vs one process ----------------------------------------------------

NOISE_SEED = 100


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_one_step(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    noise: FlowNoise) -> dict[str, Any]:
    """Loss, backward, clip, AdamW + scheduler step, loss again on the same draws."""
    optimizer = build_optimizer(model, TINY.optim)
    scheduler = build_scheduler(optimizer, TINY.optim)
    before = flow_matching_loss(model, batch, noise)
    before.loss.backward()
    grads = {name: _full(p.grad).clone() for name, p in model.named_parameters()}
    norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), TINY.optim.grad_clip))
    optimizer.step()
    scheduler.step()
    after = flow_matching_loss(model, batch, noise)
    return {
        "before": torch.stack(list(before)).detach(),
        "after": torch.stack(list(after)).detach(),
        "grad_norm": norm.detach(),
        "grads": grads,
        "params": {name: _full(p.detach()).clone() for name, p in model.named_parameters()},
    }


def _rank_noise(rank: int) -> tuple[dict[str, torch.Tensor], FlowNoise]:
    per_rank = TINY.train.micro_batch_size
    batch = _batch(range(rank * per_rank, (rank + 1) * per_rank))
    return batch, sample_flow_noise(batch, torch.Generator().manual_seed(NOISE_SEED + rank))


def _fsdp_rank(rank: int, world_size: int) -> dict[str, Any]:
    batch, noise = _rank_noise(rank)
    model = shard_model(_tiny_model(), mixed_precision=False)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(block, FSDPModule) for block in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    result = _train_one_step(model, batch, noise)
    for key in ("before", "after"):  # the loss of the global batch: the mean over ranks
        dist.all_reduce(result[key])
        result[key] /= world_size

    # bf16 compute with fp32 reduction runs too (gloo on CPU) and lands near fp32.
    mixed = shard_model(_tiny_model(), mixed_precision=True)
    sharded_dtype = next(mixed.parameters()).dtype
    inputs = {"latents": batch["latents"], "timesteps": noise.timesteps, "text": batch["text"],
              "actions": batch["actions"], "action_timesteps": noise.action_timesteps}
    result["mixed_dtypes"] = (mixed(inputs)[0].dtype, sharded_dtype)
    mixed_loss = flow_matching_loss(mixed, batch, noise).loss
    mixed_loss.backward()
    dist.all_reduce(mixed_loss.detach_())
    result["mixed_loss"] = mixed_loss / world_size
    result["mixed_grads_finite"] = all(bool(torch.isfinite(_full(p.grad)).all())
                                       for p in mixed.parameters())
    return result


def test_one_fsdp2_step_on_two_ranks_matches_one_process_on_the_global_batch() -> None:
    ranks = run_ranks(_fsdp_rank, world_size=2)

    parts = [_rank_noise(rank) for rank in range(2)]
    batch = _batch(range(4))
    single = _train_one_step(_tiny_model(), batch, FlowNoise.cat([noise for _, noise in parts]))

    assert single["grad_norm"] > TINY.optim.grad_clip, "clipping must be exercised"
    for result in ranks:
        torch.testing.assert_close(result["before"], single["before"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["grad_norm"], single["grad_norm"], rtol=1e-5,
                                   atol=1e-6)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")
        # The first AdamW step moves each weight by about lr / warmup = 2e-4.
        for name, param in single["params"].items():
            torch.testing.assert_close(result["params"][name], param, rtol=0, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} after the step: {m}")
        torch.testing.assert_close(result["after"], single["after"], rtol=1e-5, atol=1e-6)
        assert result["after"][0] < result["before"][0]

        assert result["mixed_dtypes"] == (torch.bfloat16, torch.float32)
        torch.testing.assert_close(result["mixed_loss"], single["before"][0], rtol=1e-2, atol=0)
        assert result["mixed_grads_finite"]
