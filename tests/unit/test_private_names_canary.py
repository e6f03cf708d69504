"""Every private name of :mod:`resumekit._compat` is still where resumekit reaches it.

One section per section of ``resumekit/_compat.py`` (same titles). Each canary imports the
private name on the installed version of its library and checks the signature or fields
resumekit relies on, so an upgrade that moves one fails here, loudly, naming it, instead
of silently in a checkpoint.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from resumekit import _compat
from resumekit.tensors import state_dicts

# -- tensors: state-dict views -------------------------------------------------------------


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)


def test_activation_checkpointing_prefixes_its_names_with_the_prefix_dcp_strips() -> None:
    wrapper = importlib.import_module(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    prefix = _compat.checkpoint_wrapper_prefix()
    model = _Pair()
    model.first = wrapper.checkpoint_wrapper(model.first)
    assert [name for name, _ in model.named_parameters()] == [
        f"first.{prefix}weight", f"first.{prefix}bias", "second.weight", "second.bias"]
    assert list(get_model_state_dict(model)) == [
        "first.weight", "first.bias", "second.weight", "second.bias"]


def test_dcp_refuses_a_key_with_the_flat_parameter_name_and_so_do_the_state_views() -> None:
    flat = _compat.flat_param_name()
    model = nn.Module()
    model.register_parameter(flat, nn.Parameter(torch.zeros(2)))
    with pytest.raises(RuntimeError, match=flat):
        get_model_state_dict(model)
    with pytest.raises(RuntimeError, match=flat):
        state_dicts.model_state_dict(model)  # not captured by the shortcut: DCP's error


def test_dcp_renames_the_children_a_module_names_in_its_fqn_modifiers() -> None:
    get_fqns = importlib.import_module("torch.distributed.checkpoint.state_dict")._get_fqns
    default = inspect.signature(get_fqns).parameters["dsd_fqn_modifiers"].default
    assert default == _compat.FQN_MODIFIERS_ATTRIBUTE

    class Renaming(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.register_state_dict_post_hook(self._drop_inner)

        @staticmethod
        def _drop_inner(module: nn.Module, state: dict[str, object], prefix: str,
                        local: object) -> None:
            for key in list(state):
                state[key.replace("inner.", "")] = state.pop(key)

    def modifiers(self: nn.Module) -> dict[str, str]:
        return {"weight": "inner", "bias": "inner"}

    setattr(Renaming, _compat.FQN_MODIFIERS_ATTRIBUTE, modifiers)
    model = Renaming()
    assert list(get_model_state_dict(model)) == ["weight", "bias"]
    assert list(state_dicts.model_state_dict(model)) == ["weight", "bias"]


def test_torch_compile_wraps_a_module_in_the_class_dcp_strips_orig_mod_for() -> None:
    compiled = torch.compile(_Pair())  # wraps only: nothing compiles before a call
    kind = _compat.compiled_module_type()
    assert kind is not None
    assert type(compiled) is kind
    names = ["first.weight", "first.bias", "second.weight", "second.bias"]
    assert [name for name, _ in compiled.named_parameters()] == [f"_orig_mod.{n}" for n in names]
    assert list(get_model_state_dict(compiled)) == names


def test_fsdp2_puts_its_load_post_hook_on_a_method_of_the_class_compat_names() -> None:
    fsdp_param = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param")
    assert f"{fsdp_param.FSDPParam.__qualname__}." == _compat.FSDP2_LOAD_HOOK_OWNER
    source = inspect.getsource(fsdp_param.FSDPParam.__init__)
    assert "register_load_state_dict_post_hook(" in source


def test_a_modules_load_hooks_are_the_ones_registered_on_it_and_only_those() -> None:
    model = _Pair()
    assert _compat.load_state_dict_hooks(model) == ({}, {})
    pre = model.register_load_state_dict_pre_hook(lambda *args: None)
    post = model.register_load_state_dict_post_hook(lambda *args: None)
    pre_hooks, post_hooks = _compat.load_state_dict_hooks(model)
    assert list(pre_hooks) == [pre.id]
    assert list(post_hooks) == [post.id]
    assert _compat.load_state_dict_hooks(model.first) == ({}, {})
    pre.remove()
    post.remove()
    assert _compat.load_state_dict_hooks(model) == ({}, {})
