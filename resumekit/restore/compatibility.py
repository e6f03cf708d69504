"""Whether a checkpoint fits this run: the fingerprint comparison of a restore.

Every checkpoint's manifest records a fingerprint (``{"config": ..., "params": ...}``):
the run's ``config=`` and each parameter's shape, under DCP's canonical names
(:meth:`~resumekit.state.train_state.TrainState.fingerprint_params`).
Before loading, restore compares
it with the run's own:

* **parameters** always: a name or a shape that differs is an
  :class:`~resumekit.errors.IncompatibleCheckpointError` whatever ``on_mismatch`` says
  (a checkpoint never loads partially);
* **configuration** per ``on_mismatch``: ``"error"`` raises, ``"warn"`` warns,
  ``"ignore"`` says nothing;
* **world size** is never an error: the state is resharded and training continues
  correctly, but it is not a bit-exact replay of an uninterrupted run, and one
  :class:`~resumekit.warnings.ResumekitWarning` says exactly that (none with
  ``on_mismatch="ignore"``). Next to a configuration difference it is one more line of
  that error or warning.

A checkpoint converted by ``resumekit import`` records no configuration unless it was
given one, and a world size that says nothing about a run (the converter's): there is
nothing to compare them with (restore's warning about the import says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from resumekit.errors import IncompatibleCheckpointError
from resumekit.store.manifest import Manifest, SaveReason
from resumekit.tensors.state_dicts import canonical_param_name
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["check_compatibility", "config_differences", "param_differences"]


def param_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each parameter whose name or shape differs between a checkpoint and the model.

    Args:
        saved: The checkpoint's ``{name: shape}``.
        now: The model's ``{name: shape}``.

    Returns:
        One line per difference, sorted by name; empty when either side is empty (a
        checkpoint without a model, a model without recorded parameters).
    """
    if not saved or not now:
        return []
    if set(saved) != set(now):
        # Fingerprints written before they held DCP's canonical names carry wrapper
        # atoms (``module.`` of DDP, ``_orig_mod.`` of torch.compile): compare both
        # sides without them.
        saved = {canonical_param_name(k): v for k, v in saved.items()}
        now = {canonical_param_name(k): v for k, v in now.items()}
    problems = []
    for key in sorted(set(saved) | set(now)):
        if key not in now:
            problems.append(f"{key}: in the checkpoint, not in the model")
        elif key not in saved:
            problems.append(f"{key}: in the model, not in the checkpoint")
        elif list(saved[key]) != list(now[key]):
            problems.append(f"{key}: checkpoint {saved[key]}, model {now[key]}")
    return problems


def config_differences(saved: Mapping[str, Any], now: Mapping[str, Any],
                       prefix: str = "config") -> list[str]:
    """Each key whose value differs between two nested configurations.

    Args:
        saved: The checkpoint's configuration.
        now: This run's.
        prefix: The dotted path the keys are named under (``config.optim.lr``).

    Returns:
        One line per differing leaf, sorted by key at each level.
    """
    differences = []
    for key in sorted(set(saved) | set(now)):
        where = f"{prefix}.{key}"
        if key not in now:
            differences.append(f"{where}: {saved[key]!r} in the checkpoint, absent now")
        elif key not in saved:
            differences.append(f"{where}: absent in the checkpoint, {now[key]!r} now")
        elif isinstance(saved[key], Mapping) and isinstance(now[key], Mapping):
            differences.extend(config_differences(saved[key], now[key], where))
        elif saved[key] != now[key]:
            differences.append(f"{where}: checkpoint {saved[key]!r}, now {now[key]!r}")
    return differences


def check_compatibility(
    manifest: Manifest,
    where: str,
    *,
    fingerprint: Mapping[str, Any],
    world_size: int,
    on_mismatch: Literal["error", "warn", "ignore"],
    stacklevel: int = 2,
) -> None:
    """Raise or warn when checkpoint ``where`` does not fit this run (see the module).

    Args:
        manifest: The checkpoint's manifest.
        where: Its path, named in the error or warning.
        fingerprint: This run's ``{"config": ..., "params": ...}``.
        world_size: This run's number of ranks.
        on_mismatch: What a configuration or world-size difference does.
        stacklevel: Of the warning, counted from the caller of this function (1).

    Raises:
        IncompatibleCheckpointError: A parameter differs, or (``on_mismatch="error"``)
            the configuration does; ``differences`` lists each line.
    """
    saved: dict[str, Any] = dict(manifest.fingerprint or {})
    problems = param_differences(saved.get("params") or {}, fingerprint["params"] or {})
    if problems:
        raise IncompatibleCheckpointError(
            f"{where} does not fit the model (nothing was loaded):\n  "
            + "\n  ".join(problems), path=where, differences=problems,
        )
    imported = manifest.reason == SaveReason.IMPORTED
    differences = [] if imported and not saved.get("config") else \
        config_differences(saved.get("config") or {}, fingerprint["config"])
    resized = manifest.world_size != world_size and not imported
    if on_mismatch == "ignore" or not (differences or resized):
        return
    if differences:
        if resized:
            differences.append(f"world_size: checkpoint {manifest.world_size}, now "
                               f"{world_size} (state is resharded)")
        message = f"{where} was written by a different configuration:\n  " + \
            "\n  ".join(differences)
        if on_mismatch == "error":
            raise IncompatibleCheckpointError(
                message + "\n(pass on_mismatch='warn' to resume anyway)",
                path=where, differences=differences,
            )
    else:
        message = (f"{where} was written by {manifest.world_size} rank(s), this run has "
                   f"{world_size} (world_size: checkpoint {manifest.world_size}, now "
                   f"{world_size} (state is resharded)): training continues correctly, "
                   "but this is not a bit-exact replay of an uninterrupted run")
    warn(message, ResumekitWarning, stacklevel=stacklevel + 1)
