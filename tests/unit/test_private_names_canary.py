"""Every private name of :mod:`resumekit._compat` is still where resumekit reaches it.

One section per section of ``resumekit/_compat.py`` (same titles). Each canary imports the
private name on the installed version of its library and checks the signature or fields
resumekit relies on, so an upgrade that moves one fails here, loudly, naming it, instead
of silently in a checkpoint.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from resumekit import _compat

# -- tensors: save and load ----------------------------------------------------------------


def test_dcps_filesystem_reader_names_its_metadata_path_by_rank(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    assert list(inspect.signature(FileSystemReader._get_metadata_path).parameters) == [
        "self", "rank"]
    reader = FileSystemReader(tmp_path)
    assert Path(_compat.dcp_metadata_path(reader, None)) == tmp_path / ".metadata"


def test_dcps_fsspec_filesystem_opens_streams_of_an_fsspec_url() -> None:
    filesystem = _compat.fsspec_filesystem()
    path = filesystem.init_path("memory://resumekit-canary/ckpt")
    with filesystem.create_stream(filesystem.concat_path(path, "x"), "wb") as stream:
        stream.write(b"abc")
    with filesystem.create_stream(filesystem.concat_path(path, "x"), "rb") as stream:
        assert stream.read() == b"abc"
    assert filesystem.validate_checkpoint_id("memory://resumekit-canary/ckpt")


def test_dcps_set_element_sets_a_value_at_a_flattening_path() -> None:
    root: dict[str, object] = {"optimizer": {"param_groups": [{"lr": 1.0}]}}
    _compat.set_nested(root, ("optimizer", "param_groups", 0, "lr"), 0.5)
    assert root == {"optimizer": {"param_groups": [{"lr": 0.5}]}}


def test_dcps_empty_state_dict_load_planner_rebuilds_the_state_and_loads_in_place(
        tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner_class = _compat.empty_state_dict_load_planner_class()
    assert issubclass(planner_class, DefaultLoadPlanner)
    assert "keys" in inspect.signature(planner_class.__init__).parameters
    assert "load_bytes" in vars(DefaultLoadPlanner)  # the method our subclass overrides
    state = {"model": {"w": torch.arange(4.0)}, "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    loaded: dict[str, object] = {}
    _compat.load_without_collectives(loaded, dcp.FileSystemReader(str(tmp_path)),
                                     planner_class())
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))  # type: ignore[index]
    assert loaded["step"] == 3


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
