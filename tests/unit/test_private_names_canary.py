"""Every private name of :mod:`resumekit._compat` is still where resumekit reaches it.

One section per section of ``resumekit/_compat.py`` (same titles). Each canary imports the
private name on the installed version of its library and checks the signature or fields
resumekit relies on, so an upgrade that moves one fails here, loudly, naming it, instead
of silently in a checkpoint. A library that is not installed skips its section (under
``CI=true``, which installs them all, that is a failure).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from resumekit import _compat
from resumekit.tensors import state_dicts
from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[2]

# -- torch versions ------------------------------------------------------------------------


def test_torch_version_reads_the_running_torchs_version_without_importing_torch() -> None:
    """torch/version.py, read as a file, says what ``torch.__version__`` says."""
    probe = ("import sys\nfrom resumekit import _compat\nversion = _compat.torch_version()\n"
             "assert 'torch' not in sys.modules, sorted(sys.modules)\n"
             "import torch\nprint(version == torch.__version__, version)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", torch.__version__]


def test_the_torchrun_of_this_torch_takes_exactly_the_options_compat_says_it_takes() -> None:
    """``torchrun --help`` of the running torch lists each option of TORCHRUN_OPTION_SINCE
    exactly when :func:`_compat.torchrun_takes` says this release has it."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"],
                          capture_output=True, text=True, check=True)
    for option in _compat.TORCHRUN_OPTION_SINCE:
        listed = re.search(rf"{re.escape(option)}\b", done.stdout) is not None
        assert listed == _compat.torchrun_takes(option, torch.__version__), option


# -- s3fs ----------------------------------------------------------------------------------


def test_s3fs_sends_every_request_through_call_s3_with_the_method_name_and_its_parameters(
) -> None:
    try:
        import s3fs
    except ImportError as error:
        unavailable(f"s3fs is not installed: {error}")
    call = s3fs.S3FileSystem._call_s3
    assert inspect.iscoroutinefunction(call)
    parameters = list(inspect.signature(call).parameters.values())
    assert [p.name for p in parameters[:2]] == ["self", "method"]
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD  # Bucket=, Prefix=, ...
    # fsspec.asyn.sync runs it on the filesystem's own loop, its public attribute
    assert isinstance(inspect.getattr_static(s3fs.S3FileSystem, "loop"), property)


@pytest.mark.s3
def test_s3_call_answers_a_list_objects_v2_request_from_a_real_s3_endpoint(
    s3_endpoint: Any,
) -> None:
    from resumekit.store.storage import Storage

    storage = Storage(f"s3://{s3_endpoint.bucket}/canary", s3_endpoint.storage_options)
    storage.write_bytes("a/one", b"1")
    page = _compat.s3_call(storage.fs, "list_objects_v2", Bucket=s3_endpoint.bucket,
                           Prefix="canary/a/", MaxKeys=1)
    assert [item["Key"] for item in page["Contents"]] == ["canary/a/one"]


# -- Lightning -----------------------------------------------------------------------------


def _lightning() -> Any:
    try:
        import lightning
    except ImportError as error:
        unavailable(f"lightning is not installed: {error}")
    return lightning


def test_lightnings_trainer_fit_loop_and_fetcher_hold_the_private_attributes_resumekit_reads(
    tmp_path: Path,
) -> None:
    lightning = _lightning()
    import torch
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.utilities import CombinedLoader

    seen: dict[str, Any] = {}

    class Look(lightning.pytorch.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # the attributes themselves, not _compat's None for a missing one
            seen["connector"] = trainer._accelerator_connector
            seen["combined"] = trainer.fit_loop._combined_loader
            seen["fetcher"] = trainer.fit_loop._data_fetcher
            seen["via compat"] = (_compat.lightning_cluster_environment(trainer),
                                  _compat.lightning_combined_loader(trainer.fit_loop),
                                  _compat.lightning_data_fetcher(trainer.fit_loop))

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, _: int) -> Any:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.ones(6, 2))
            return torch.utils.data.DataLoader(data, batch_size=2)

    lightning.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=tmp_path, callbacks=[Look()]).fit(Tiny())

    environment, combined, fetcher = seen["via compat"]
    assert isinstance(seen["connector"].cluster_environment, ClusterEnvironment)
    assert environment is seen["connector"].cluster_environment
    assert isinstance(seen["combined"], CombinedLoader) and combined is seen["combined"]
    assert combined.limits == [3]  # one loader, its batch limit: what the callback rewrites
    assert fetcher is seen["fetcher"] and fetcher.length == 3  # the epoch it counts to

# ------------------------------------------------------------------- tensors: raw format


def test_dcps_storage_info_is_the_dataclass_every_metadata_file_pickles_by_name() -> None:
    info_class = _compat.dcp_storage_info()
    assert (info_class.__module__, info_class.__qualname__) == (
        "torch.distributed.checkpoint.filesystem", "_StorageInfo")
    assert [field.name for field in dataclasses.fields(info_class)] == [
        "relative_path", "offset", "length", "transform_descriptors"]


def test_dcps_storage_info_is_built_positionally_and_pickles_no_empty_descriptors() -> None:
    # The raw writer builds it as (file, offset, length, transform_descriptors=...), and
    # the .metadata of DCP's own format, which records no descriptors, must not grow one.
    info_class = _compat.dcp_storage_info()
    described = info_class("__0_0.distcp", 4096, 12, transform_descriptors=["resumekit-raw/member"])
    assert (described.relative_path, described.offset, described.length) == (
        "__0_0.distcp", 4096, 12)
    plain = info_class("__0_0.distcp", 0, 8)
    assert plain.transform_descriptors is None
    assert "transform_descriptors" not in plain.__getstate__()
    assert pickle.loads(pickle.dumps(described)) == described


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


def test_a_compiled_modules_wrapped_module_is_the_one_compat_hands_out() -> None:
    inner = _Pair()
    assert _compat.compiled_inner_module(torch.compile(inner)) is inner


def test_a_modules_extra_state_is_saved_under_the_suffix_compat_names() -> None:
    class WithExtra(nn.Module):
        def get_extra_state(self) -> object:
            return {"kind": "extra"}

        def set_extra_state(self, state: object) -> None:
            pass

    model = nn.Sequential(WithExtra())
    assert list(model.state_dict()) == [f"0.{_compat.extra_state_key_suffix()}"]


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


# -- tensors: save and load ----------------------------------------------------------------


def test_dcps_filesystem_reader_names_its_metadata_path_by_rank(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    assert list(inspect.signature(FileSystemReader._get_metadata_path).parameters) == [
        "self", "rank"]
    reader = FileSystemReader(tmp_path)
    assert Path(_compat.dcp_metadata_path(reader, None)) == tmp_path / ".metadata"






def test_a_dtensor_wraps_a_cpu_shard_with_another_dtensors_spec_as_it_is(
        tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        like = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
        local = torch.zeros(2, 3)
        wrapped = _compat.dtensor_over(local, like)
        assert isinstance(wrapped, DTensor) and wrapped._spec == like._spec
        assert wrapped.to_local().data_ptr() == local.data_ptr()  # the buffer itself
        assert (wrapped.shape, wrapped.placements, wrapped.device_mesh) == (
            like.shape, like.placements, like.device_mesh)
        assert not wrapped.requires_grad
    finally:
        dist.destroy_process_group()


def test_nn_modules_own_load_step_is_what_a_plain_module_uses_and_an_override_replaces() -> None:
    class Custom(nn.Linear):
        def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
            super()._load_from_state_dict(*args, **kwargs)

    assert "_load_from_state_dict" in vars(nn.Module)
    assert not _compat.overrides_load_from_state_dict(nn.Linear)
    assert _compat.overrides_load_from_state_dict(Custom)

