"""Every private name of :mod:`resumekit._compat` is still where resumekit reaches it.

One section per section of ``resumekit/_compat.py`` (same titles). Each canary imports the
private name on the installed version of its library and checks the signature or fields
resumekit relies on, so an upgrade that moves one fails here, loudly, naming it, instead
of silently in a checkpoint. A library that is not installed skips its section (under
``CI=true``, which installs them all, that is a failure).
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest

from resumekit import _compat
from tests.conftest import unavailable

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
