"""Another tool's checkpoint, recognised by that tool's own files.

Plain DCP and torchtitan (``.metadata``), Accelerate (``optimizer.bin``,
``random_states_*.pkl``), HF Trainer (``trainer_state.json``) and Lightning (``*.ckpt``):
:func:`detect_foreign` names the format, its marker file and the step it records, and
:func:`import_command` is the ``resumekit import`` line that converts it. The catalog
lists such an entry as ``foreign``; it is never loaded as resumekit's. Nothing here
imports torch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from resumekit.store.layout import DCP_METADATA_FILE, MANIFEST_NAME, checked_step
from resumekit.store.storage import Storage

if TYPE_CHECKING:
    from resumekit.store.catalog import CheckpointEntry

# What the other layers use.
__all__ = [
    "FOREIGN_FORMATS",
    "ForeignCheckpoint",
    "detect_foreign",
    "import_command",
]

ForeignFormat = Literal["dcp", "torchtitan", "accelerate", "lightning", "hf-trainer"]
#: Every foreign format :func:`detect_foreign` recognises (``resumekit import --format``).
FOREIGN_FORMATS: tuple[ForeignFormat, ...] = (
    "dcp", "torchtitan", "accelerate", "lightning", "hf-trainer")
#: Step numbers in other tools' names: torchtitan ``step-N``, HF Trainer ``checkpoint-N``,
#: Lightning ``...step=N...ckpt``.
_FOREIGN_STEP = {
    "torchtitan": re.compile(r"^step-(\d+)$"),
    "hf-trainer": re.compile(r"^checkpoint-(\d+)$"),
    "lightning": re.compile(r"(?:^|[-_])step=(\d+)"),
}
_DCP_METADATA = DCP_METADATA_FILE
_HF_TRAINER_STATE = "trainer_state.json"


@dataclass(frozen=True)
class ForeignCheckpoint:
    """Another tool's checkpoint, recognised by that tool's own files.

    Attributes:
        name: Its name relative to the root that was searched (``""``: the root itself).
        path: Its full path (or URL).
        format: ``dcp``, ``torchtitan``, ``accelerate``, ``lightning`` or ``hf-trainer``.
        step: The step it records in its name or state, if it records one (Accelerate and
            plain DCP do not).
        marker: The file that identified the format.
    """

    name: str
    path: str
    format: ForeignFormat
    step: int | None
    marker: str


def _step_in_name(form: ForeignFormat, name: str) -> int | None:
    pattern = _FOREIGN_STEP.get(form)
    match = pattern.search(name) if pattern is not None else None
    return int(match.group(1)) if match else None


def _hf_trainer_step(storage: Storage, state_file: str) -> int | None:
    """The ``global_step`` of ``trainer_state.json``; None when it records none to use.

    Only for recognising the checkpoint: importing it reads the file again and refuses
    what is not a step number, naming the file.
    """
    try:
        source = storage.path(state_file)
        return checked_step(storage.read_json(state_file).get("global_step"),
                            source=source, key="global_step")
    except (OSError, ValueError, AttributeError):
        return None


def detect_foreign(storage: Storage, name: str = "") -> ForeignCheckpoint | None:
    """Recognise another tool's checkpoint at ``name`` (a directory, or a Lightning file).

    Only the entry's own files are listed (no recursion); a resumekit checkpoint (one with
    ``manifest.json``) is never foreign.

    Args:
        storage: The root the name is relative to.
        name: A directory or file under it (``""``: the root itself).

    Returns:
        What was recognised, or None.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1] or storage.root.rstrip("/").rsplit("/", 1)[-1]
    path = storage.path(name)
    if name and name.endswith(".ckpt") and storage.is_file(name):
        return ForeignCheckpoint(name, path, "lightning", _step_in_name("lightning", base),
                                 name)
    files = {info.name for info in storage.list_dir(name) if not info.is_dir}
    if not files or MANIFEST_NAME in files:
        return None

    form, marker, step = _format_of_files(storage, name, base, files)
    if form is None:
        return None
    return ForeignCheckpoint(name, path, form, step, f"{name}/{marker}".lstrip("/"))


def _format_of_files(storage: Storage, name: str, base: str, files: set[str]
                     ) -> tuple[ForeignFormat | None, str, int | None]:
    """``(format, marker file, step)`` of a directory holding ``files`` (format None: none)."""
    if _HF_TRAINER_STATE in files:
        step = _hf_trainer_step(storage, f"{name}/{_HF_TRAINER_STATE}".lstrip("/"))
        return "hf-trainer", _HF_TRAINER_STATE, (
            step if step is not None else _step_in_name("hf-trainer", base))
    accelerate = sorted(f for f in files if f == "optimizer.bin"
                        or (f.startswith("random_states_") and f.endswith(".pkl")))
    if accelerate:
        return "accelerate", accelerate[0], None
    if _DCP_METADATA in files:
        step = _step_in_name("torchtitan", base)
        return ("torchtitan" if step is not None else "dcp"), _DCP_METADATA, step
    lightning = sorted(f for f in files if f.endswith(".ckpt"))
    if lightning:
        return "lightning", lightning[-1], _step_in_name("lightning", lightning[-1])
    return None, "", None


def import_command(found: CheckpointEntry | ForeignCheckpoint, storage: Storage, *,
                   into: str | None = None) -> str:
    """The ``resumekit import`` command line that converts a foreign checkpoint.

    Args:
        found: A ``foreign`` entry of ``storage``, or what :func:`detect_foreign` found.
        storage: The root it was found in (the import's destination by default).
        into: Another destination root (for a root that is itself a foreign checkpoint).

    Returns:
        ``resumekit import SRC ROOT --format FORMAT``, plus ``--step N`` when the format
        records no step (Accelerate, plain DCP): N is then for the user to fill in.
    """
    source = storage.url_of(found.name)
    command = (f"resumekit import {shlex.quote(source)} "
               f"{shlex.quote(into or storage.url_of())} --format {found.format}")
    recorded = found.step is not None and found.step >= 0
    return command if recorded else f"{command} --step N"

