"""The LingBot-VA example's configs, model, losses and schedule, on one process.

The same step on two FSDP2 ranks is tests/dist/test_lingbot_model_fsdp.py."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from typing import Any

import pytest
import torch

from examples.lingbot.config import LingBotConfig, config_names, get_config
from examples.lingbot.data import SyntheticEpisodeDataset, collate
from examples.lingbot.errors import BatchError, ConfigError
from examples.lingbot.model import LingBotVA, count_parameters
from examples.lingbot.recipe import (
    build_optimizer,
    build_scheduler,
    flow_matching_loss,
    flow_matching_step,
    sample_flow_noise,
)

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
