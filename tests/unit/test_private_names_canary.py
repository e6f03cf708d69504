"""Every private name of torch (and s3fs, Lightning) that resumekit touches still holds.

One section per part of resumekit; each test imports the names of ``resumekit._compat``
that part uses and checks the signature or fields resumekit relies on, so a torch upgrade
that moves or changes one fails here, by name, instead of in a checkpoint.
"""

from __future__ import annotations

import dataclasses
import pickle

from resumekit import _compat

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
