"""torchtitan's own llama3 model classes, built small, for the suites that checkpoint them.

torchtitan (``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3
torch_checkpointing==0.1.1 einops tyro docstring_parser typeguard shtab``: the model
classes need no more) is not a dependency of resumekit. Without it :func:`llama3` skips,
and fails under ``CI=true`` (tests/conftest.py).

One shim, installed by :func:`llama3` before the first import of torchtitan:

* ``torchtitan.distributed.minimal_async_ep.kernels`` imports ``triton`` at module level
  (``ModuleNotFoundError: No module named 'triton'`` from ``import
  torchtitan.models.llama3``, through ``models.common.moe`` -> ``token_dispatcher``): a
  CPU torch has no triton, and a stand-in ``triton`` module would mislead torch's own
  ``has_triton`` checks. The shim is a module of that name whose kernels raise when
  called; llama3 (no mixture of experts) never calls them.

The model is never run forward here: torchtitan's attention (flex) has no backward on
CPU (``NotImplementedError: FlexAttention does not support backward on CPU``). The
optimizer steps on seeded gradients instead, which is all a checkpoint sees.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, NoReturn

import torch
from torch import nn

from tests.conftest import unavailable

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _shim_triton_kernels() -> None:
    if _KERNELS in sys.modules:
        return
    shim = types.ModuleType(_KERNELS)

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError("torchtitan's triton kernels are not available in resumekit's tests")

    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return kernel

    shim.__getattr__ = attribute  # type: ignore[method-assign]
    sys.modules[_KERNELS] = shim


def llama3(*, fuse_qkv: bool = True, n_layers: int = 2, seed: int = 0) -> nn.Module:
    """torchtitan's ``llama3`` ``debugmodel`` with ``n_layers`` layers, initialised, on CPU.

    ``fuse_qkv=True`` is the stock flavour (``FusedQKVLinear``, whose state-dict hooks
    save ``wqkv`` as ``wq``/``wk``/``wv``); False builds the same layers with torchtitan's
    unfused ``QKVLinear``.
    """
    _shim_triton_kernels()
    try:
        from torchtitan.models.common.config_utils import make_gqa_config
        from torchtitan.models.llama3 import llama3_configs
    except ImportError as error:
        unavailable(f"torchtitan's model classes cannot be imported: {error}")
        raise
    config = llama3_configs["debugmodel"](attn_backend="flex")
    layers = list(config.layers[:n_layers])
    if not fuse_qkv:
        layers = [_unfused(layer, make_gqa_config) for layer in layers]
    torch.manual_seed(seed)
    model = dataclasses.replace(config, layers=layers).build()
    model.init_weights()
    return model


def _unfused(layer: Any, make_gqa_config: Any) -> Any:
    attention = layer.attention
    qkv = make_gqa_config(
        dim=attention.dim, n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads,
        wqkv_param_init={"weight": nn.init.normal_}, wo_param_init={"weight": nn.init.normal_},
        inner_attention=attention.inner_attention, rope=attention.rope,
        fuse_qkv=False).qkv_linear
    return dataclasses.replace(layer, attention=dataclasses.replace(attention, qkv_linear=qkv))


def fake_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *,
               seed: int = 0) -> None:
    """``steps`` optimizer steps on seeded gradients (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in model.parameters():
            full = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if hasattr(param, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                param.grad = distribute_tensor(full, param.device_mesh, param.placements)
            else:
                param.grad = full
        optimizer.step()
        optimizer.zero_grad()


def optimizers_container(model: nn.Module) -> torch.optim.Optimizer:
    """torchtitan's ``OptimizersContainer``: Adam for the norms, AdamW for the rest (two).

    Built from its own config, as its trainer builds it (``implementation="for-loop"``:
    the default ``fused`` is CUDA's), its parameter groups carrying ``param_names``.
    """
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    config = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=r"norm", optimizer_name="Adam",
                             optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 8e-4, "weight_decay": 0.1}),
        ])
    return OptimizersContainer(config, model_parts=[model])


class TrainProgress:
    """The ``train_state`` torchtitan's trainer hands its checkpointer: step, tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def write_torchtitan_checkpoints(folder: str, *, fuse_qkv: bool, steps: int,
                                 interval: int) -> dict[str, Any]:
    """Train with torchtitan's own checkpointer (every ``interval`` steps) under ``folder``.

    Its ``CheckpointManager`` (``torchtitan.components.checkpointer``) writes
    ``<folder>/checkpoint/step-N`` as torchtitan does: the model's keys at the top level,
    ``optimizer`` (its containers' flat form), ``lr_scheduler`` and ``train_state``.
    Under a process group of several ranks the model is FSDP2-sharded. Returns the state
    at the last step, whole: ``params`` by name, ``exp_avg`` by name, ``last_epoch``.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer import CheckpointManager as TorchtitanManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    model = llama3(fuse_qkv=fuse_qkv)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    optimizers = optimizers_container(model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps)
    progress = TrainProgress()
    checkpointer = TorchtitanManager(
        TorchtitanManager.Config(enable=True, folder="checkpoint", interval=interval),
        dataloader=None, model_parts=[model], optimizers=optimizers,
        lr_schedulers=schedulers, states={"train_state": progress}, sd_adapter=None,
        base_folder=folder)
    for step in range(1, steps + 1):
        fake_steps(model, optimizers, 1, seed=step)
        schedulers.step()
        progress.step, progress.ntokens_seen = step, progress.ntokens_seen + 512
        checkpointer.save(curr_step=step)
    checkpointer.close()

    def whole(value: torch.Tensor) -> torch.Tensor:
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        return full.detach().clone()

    names = {id(param): name for name, param in model.named_parameters()}
    return {"params": {name: whole(param) for name, param in model.named_parameters()},
            "exp_avg": {names[id(param)]: whole(state["exp_avg"])
                        for part in optimizers.optimizers
                        for param, state in part.state.items()},
            "last_epoch": schedulers.state_dict()["last_epoch"],
            "ntokens_seen": progress.ntokens_seen}
