"""Old module paths of resumekit 0.2 that still import, for one release.

Version 0.3 grouped the flat package into layers (``store``, ``state``, ``tensors``,
``restore``, ``runtime``, ``tools``; docs/design.md). A script or test that imports an old
path such as ``resumekit.sharded`` gets the moved module itself (the same object, so
attributes set through either name are one) and one ``DeprecationWarning`` naming the new
path. The aliases are removed in 0.4. The documented public modules ``resumekit.export``,
``resumekit.testing`` and ``resumekit.legacy`` are real modules and stay.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "resumekit._tree": "resumekit.store.tree",
    "resumekit.catalog": "resumekit.store.catalog",
    "resumekit.commit": "resumekit.store.commit",
    "resumekit.compatibility": "resumekit.restore.compatibility",
    "resumekit.coordination": "resumekit.store.coordination",
    "resumekit.distributed": "resumekit.runtime.distributed",
    "resumekit.generations": "resumekit.store.generations",
    "resumekit.importers": "resumekit.tools.importers",
    "resumekit.jsonable": "resumekit.state.jsonable",
    "resumekit.layout": "resumekit.store.layout",
    "resumekit.loader": "resumekit.state.loader",
    "resumekit.manifest": "resumekit.store.manifest",
    "resumekit.preemption": "resumekit.runtime.preemption",
    "resumekit.raw_tensor_files": "resumekit.tensors.raw",
    "resumekit.restore_plan": "resumekit.restore.plan",
    "resumekit.retention": "resumekit.store.retention",
    "resumekit.retry": "resumekit.store.retry",
    "resumekit.rng": "resumekit.state.rng",
    "resumekit.safe_pickle": "resumekit.tensors.safe_pickle",
    "resumekit.sampler": "resumekit.state.sampler",
    "resumekit.sharded": "resumekit.tensors.sharded",
    "resumekit.storage": "resumekit.store.storage",
    "resumekit.verification": "resumekit.restore.verification",
    "resumekit.weights": "resumekit.tools.weights",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self._target} in resumekit 0.3; the old path is removed "
            "in 0.4",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Give the moved module back its own spec (the import system set the alias's)."""
        module.__spec__ = self._spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds each old path of ``MOVED`` and hands back the moved module."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The alias spec of an old module path; None for every other name."""
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Puts one ``MovedModuleFinder`` on ``sys.meta_path`` (a second call adds none)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
