"""An S3 root whose listings lag behind its newest commit: ``latest()`` and ``restore()`` agree.

On S3 ``latest()`` reads the newest-step hint and the hinted manifest by name, so it
finds a checkpoint a lagging listing does not show yet. ``restore()`` lists the whole
root; it must not resume an older step than the committed one the hint names (the run
would collide with it when it saves that step again). The lag is simulated on the
loopback S3 server by hiding the newest step directory from every listing of the root.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from resumekit.manager import CheckpointManager
from resumekit.store.layout import NameFormat
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.storage_backends import S3Endpoint

NAMES = NameFormat()


@contextmanager
def root_listings_without(hidden: str) -> Iterator[list[str]]:
    """Every listing of a checkpoint root (not of its subdirectories) leaves out ``hidden``.

    Yields the listings made (``list_names`` / ``list_dir``) that left it out.
    """
    lagged: list[str] = []
    originals = {name: getattr(Storage, name) for name in ("list_names", "list_dir")}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def lagging(self: Storage, relative: str = "", *args: Any, **kwargs: Any) -> Any:
            found = method(self, relative, *args, **kwargs)
            if relative:
                return found
            kept = [item for item in found
                    if (item[0] if isinstance(item, tuple) else item.name) != hidden]
            if len(kept) != len(found):
                lagged.append(name)
            return kept
        return lagging

    try:
        for name, method in originals.items():
            setattr(Storage, name, wrap(name, method))
        yield lagged
    finally:
        for name, method in originals.items():
            setattr(Storage, name, method)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def test_restore_on_a_lagging_s3_listing_resumes_the_committed_step_latest_names(
        s3_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture) -> None:
    root = f"s3://{s3_endpoint.bucket}/rk-{uuid.uuid4().hex[:12]}"
    options = s3_endpoint.storage_options
    model = _model(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)  # no fsync on S3, said once
        with CheckpointManager(root, model=model, storage_options=options) as manager:
            for step in (10, 20, 30):
                with torch.no_grad():
                    model.weight.fill_(step)
                manager.save(step)
    newest = NAMES.build(30)
    with root_listings_without(newest) as lagged, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumekitWarning)
        reader = CheckpointManager(root, model=_model(1), storage_options=options,
                                   read_only=True)
        found = reader.latest()
        reader.close()
        assert found is not None and found.step == 30
        restored = _model(2)
        with caplog.at_level("WARNING", logger="resumekit"), \
                CheckpointManager(root, model=restored, storage_options=options) as manager:
            assert manager.restore() == 30  # not 20, which the listing shows as newest
            assert torch.all(restored.weight == 30)
            manager.save(31)  # the run goes on past 30: no collision with it
    assert lagged  # the listings did lag
    assert newest in caplog.text and "newest-step hint" in caplog.text
