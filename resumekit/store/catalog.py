"""What a path holds: listing a root, the newest committed step, verification, targets.

Statuses of an entry:

* ``committed``: a step directory with a valid manifest — a checkpoint;
* ``partial``: work in progress or left by a crash (a hidden staging directory, or a step
  directory with data but no manifest) — never loaded;
* ``corrupt``: a step directory whose manifest exists but cannot be read or validated;
* ``legacy``: a weights-only ``checkpoint_step_N/`` from a trainer without resumekit
  (e.g. ``transformer/diffusion_pytorch_model.safetensors``) — importable, never chosen
  over a committed checkpoint;
* ``foreign``: another tool's checkpoint, recognised by that tool's own markers
  (:func:`detect_foreign`): plain DCP or torchtitan (``.metadata``), Accelerate
  (``optimizer.bin``, ``random_states_*.pkl``), HF Trainer (``trainer_state.json``),
  Lightning (``*.ckpt``) — never loaded as ours; ``resumekit import`` converts it.

A symbolic link is never a checkpoint, whatever it points to and whatever its name: a
step, staging, retired or set-aside name that is a link, or a step directory whose
``manifest.json`` is one, is ``corrupt`` with the defect ``symlink`` and is never read
through, set aside, swept or deleted (:func:`link_problem`); a file a manifest lists that
is (or lies below) a link fails :func:`verify_checkpoint` and :func:`refuse_links`.

An entry that is not committed also says what is wrong with it (:data:`Defect`), so a
restore can tell what is provably broken (:data:`BROKEN`: set aside) from what is merely
newer (``newer-schema``: refused) or still being written (``unfinished``, ``staging``).

For paths a user gives (the command line, export, import): :func:`open_target` tells a
checkpoint root from one checkpoint directory and detects the step-name format,
:func:`select_committed` picks the committed checkpoint of a step, and
:func:`tensors_url` is where its DCP tensor data lives. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import re
import shlex
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from resumekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    ResumekitError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store.layout import (
    ATTEMPT_PREFIX,
    DCP_METADATA_FILE,
    DEFAULT_NAME_FORMAT,
    GENERATIONS_DIR,
    LEGACY_NAME_FORMAT,
    MANIFEST_NAME,
    NEWEST_HINT_FILE,
    TENSORS_DIR,
    NameFormat,
    checked_step,
    parse_generation_record_name,
)
from resumekit.store.manifest import Manifest, checksum_chunks, parse_manifest
from resumekit.store.retry import read_with_retry
from resumekit.store.storage import RECORD_LIMIT, FileInfo, Storage
from resumekit.warnings import ResumekitWarning, warn

logger = logging.getLogger("resumekit")

__all__ = [
    "BROKEN",
    "DEFAULT_NAME_FORMATS",
    "FOREIGN_FORMATS",
    "UNLISTED",
    "CheckpointEntry",
    "CheckpointTarget",
    "Defect",
    "ForeignCheckpoint",
    "ForeignFormat",
    "Listing",
    "RootTop",
    "Status",
    "TensorData",
    "classify_step",
    "detect_foreign",
    "entries_from_top",
    "forget_newest_hint",
    "generation_record_numbers",
    "hidden_entries",
    "import_command",
    "latest_committed",
    "link_problem",
    "list_checkpoints",
    "list_root",
    "listing_with_hinted_step",
    "locate_tensor_data",
    "newest_committed",
    "newest_generation_record",
    "open_target",
    "other_entries",
    "other_name_checkpoints",
    "read_manifest",
    "read_newest_hint",
    "read_top",
    "refuse_links",
    "select_committed",
    "sort_entries",
    "split_parent",
    "step_directories",
    "tensors_url",
    "verify_checkpoint",
    "write_newest_hint",
    "write_stamped_hint",
]

Status = Literal["committed", "partial", "corrupt", "legacy", "foreign"]

#: ``newest_committed``'s ``newest_record`` when the caller has not listed the records.
UNLISTED = object()
ForeignFormat = Literal["dcp", "torchtitan", "accelerate", "lightning", "hf-trainer"]
#: What is wrong with an entry that is not committed:
#:
#: * ``newer-schema``: its manifest was written by a newer resumekit (not broken: newer);
#: * ``bad-manifest``: its manifest is not JSON, not a valid manifest, or a directory;
#: * ``unsafe-manifest``: its manifest lists a path that escapes it (``..``, absolute);
#: * ``wrong-step``: its manifest names another step than its directory;
#: * ``no-manifest``: a visible step directory with files but no manifest on a POSIX root,
#:   which the commit protocol never leaves (publishing renames a finished directory);
#: * ``empty``: a visible, empty step directory;
#: * ``unfinished``: an object-store step directory whose save has not written its
#:   manifest (yet: the manifest is written last);
#: * ``set-aside``, ``staging``, ``retiring``: hidden ``.bad-``, ``.tmp-`` and ``.old-``
#:   directories;
#: * ``symlink``: the entry (or its ``manifest.json``) is a symbolic link: never read
#:   through, never set aside, swept or deleted, whatever it points to.
Defect = Literal["newer-schema", "bad-manifest", "unsafe-manifest", "wrong-step",
                 "no-manifest", "empty", "unfinished", "set-aside", "staging", "retiring",
                 "symlink"]
#: Defects no save of resumekit leaves behind: such a directory can never become a
#: checkpoint, and it blocks a new save of its step until it is moved away.
BROKEN: frozenset[Defect] = frozenset(
    {"bad-manifest", "unsafe-manifest", "wrong-step", "no-manifest", "empty"})
#: Every foreign format :func:`detect_foreign` recognises (``resumekit import --format``).
FOREIGN_FORMATS: tuple[ForeignFormat, ...] = (
    "dcp", "torchtitan", "accelerate", "lightning", "hf-trainer")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: Step numbers in other tools' names: torchtitan ``step-N``, HF Trainer ``checkpoint-N``,
#: Lightning ``...step=N...ckpt``.
_FOREIGN_STEP = {
    "torchtitan": re.compile(r"^step-(\d+)$"),
    "hf-trainer": re.compile(r"^checkpoint-(\d+)$"),
    "lightning": re.compile(r"(?:^|[-_])step=(\d+)"),
}
#: Folders other tools save checkpoints into, looked into one level down: Accelerate's
#: ``automatic_checkpoint_naming`` (``checkpoints/checkpoint_N``) and Lightning's
#: ``ModelCheckpoint`` default (``checkpoints/*.ckpt``).
_FOREIGN_CONTAINERS = ("checkpoints",)
_DCP_METADATA = DCP_METADATA_FILE
#: Step-name formats :func:`open_target` tries, in order, when none is given.
DEFAULT_NAME_FORMATS = (DEFAULT_NAME_FORMAT, LEGACY_NAME_FORMAT)
_HF_TRAINER_STATE = "trainer_state.json"


@dataclass(frozen=True)
class CheckpointEntry:
    """One entry of a checkpoint root.

    Attributes:
        step: The step its name stands for.
        name: Directory name relative to the root.
        path: Full path (or URL) of the directory.
        status: ``committed``, ``partial``, ``corrupt``, ``legacy`` or ``foreign``.
        manifest: The parsed manifest of a committed entry.
        problem: Why an entry is not committed (one line), if it is not.
        format: The format of a ``foreign`` entry.
        defect: What is wrong with a ``partial`` or ``corrupt`` entry (:data:`Defect`).
    """

    step: int
    name: str
    path: str
    status: Status
    manifest: Manifest | None = None
    problem: str | None = None
    format: ForeignFormat | None = None
    defect: Defect | None = None


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


def _foreign_entry(storage: Storage, name: str, step: int | None) -> CheckpointEntry | None:
    foreign = detect_foreign(storage, name)
    if foreign is None:
        return None
    known = step if step is not None else foreign.step
    return CheckpointEntry(
        -1 if known is None else known, name, storage.path(name), "foreign",
        problem=f"a {foreign.format} checkpoint ({foreign.marker}), not resumekit's: "
                "convert it with resumekit import", format=foreign.format)


def _check_root(storage: Storage) -> None:
    if storage.exists() and not storage.is_dir():
        raise StorageError(
            f"checkpoint root {storage.path()} is a file, not a directory",
            path=storage.path(), operation="list",
        )


def read_manifest(storage: Storage, name: str) -> Manifest:
    """Read and validate the manifest of the step directory ``name``.

    Raises:
        CheckpointNotFoundError: No such directory.
        ManifestError: Missing, unreadable, invalid or future-version manifest.
    """
    manifest = _manifest_if_any(storage, name)
    if manifest is None:
        if not storage.exists(name):
            raise CheckpointNotFoundError(
                f"no checkpoint directory {storage.path(name)}", path=storage.path(name)
            )
        source = storage.path(f"{name}/{MANIFEST_NAME}")
        raise ManifestError(
            f"{source} is missing: {storage.path(name)} is not a committed checkpoint",
            path=source,
        )
    return manifest


def _manifest_if_any(storage: Storage, name: str) -> Manifest | None:
    """The manifest of ``name``, validated; None when there is no manifest file (one read).

    Raises:
        ManifestError: It is unreadable, invalid, a directory or of a future version.
        UnsafeCheckpointError: ``name`` or its manifest is a symbolic link (``link``
            set): nothing was read through it.
    """
    source = storage.path(f"{name}/{MANIFEST_NAME}")
    problem = link_problem(storage, name)
    if problem is not None:
        raise UnsafeCheckpointError(problem, path=storage.path(name), link=True)
    try:
        raw = read_with_retry(source, lambda: storage.read_small(f"{name}/{MANIFEST_NAME}"))
    except FileNotFoundError:
        # Some object stores answer "not found" for a prefix read as an object.
        if storage.is_local or not storage.is_dir(f"{name}/{MANIFEST_NAME}"):
            return None
        raise ManifestError(
            f"{source} is a directory, not a manifest: {storage.path(name)} is not a "
            "committed checkpoint", path=source,
        ) from None
    except StorageError:
        if storage.is_dir(f"{name}/{MANIFEST_NAME}"):
            # A directory in the manifest's place is bad content, not a storage failure:
            # it must not make the whole root unlistable.
            raise ManifestError(
                f"{source} is a directory, not a manifest: {storage.path(name)} is not a "
                "committed checkpoint", path=source,
            ) from None
        if storage.is_file(name):
            return None  # a file squatting on a step name holds no manifest (ENOTDIR)
        raise
    return parse_manifest(raw, source=source)


def link_problem(storage: Storage, name: str) -> str | None:
    """Why the entry ``name`` of a root is not to be read, if it or its manifest is a link.

    The one test of the catalog for links (``lstat``s; never a request on object stores):
    the entry itself is checked, then its ``manifest.json``.

    Returns:
        One line naming the link and its target, or None when neither is a link.
    """
    link = storage.link_on_path(f"{name}/{MANIFEST_NAME}")
    if link is None:
        return None
    return (f"{storage.path(link)} is a symbolic link (to {storage.link_target(link)}), not "
            f"{'a directory' if link == name else 'a file'} of this root: resumekit never "
            "reads, sets aside or deletes anything through a link, so it is no checkpoint "
            "and is left as it is")


def _link_entry(storage: Storage, name: str, name_format: NameFormat,
                legacy_format: NameFormat) -> CheckpointEntry | None:
    """The entry of the link ``name`` (a ``symlink`` one), from its name alone.

    None unless it has a step, staging, retired, set-aside or legacy name: any other
    link is ignored, like any other name that is not checkpoint-like.
    """
    hidden = name_format.parse_hidden(name)
    step = hidden[0] if hidden is not None else name_format.parse(name)
    if step is None:
        step = legacy_format.parse(name)
    problem = link_problem(storage, name)
    if step is None or problem is None:
        return None
    return CheckpointEntry(step, name, storage.path(name), "corrupt", problem=problem,
                           defect="symlink")


def refuse_links(storage: Storage, name: str, manifest: Manifest) -> None:
    """Refuse a checkpoint a file of which is (or lies below) a symbolic link.

    Every file ``manifest`` lists, and each directory on its way, is ``lstat``-ed once
    (nothing is opened): what restore, verify and export would read must be the step
    directory's own, never what a link points to, in or out of the root.

    Raises:
        UnsafeCheckpointError: The first link, named with its target (``link`` set).
    """
    if not storage.is_local:
        return
    seen: set[str] = set()
    for entry in manifest.files:
        parts = f"{name}/{manifest.data_path(entry.path)}".split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            if prefix in seen:
                continue
            seen.add(prefix)
            if storage.is_link(prefix):
                where = storage.path(prefix)
                raise UnsafeCheckpointError(
                    f"{where} is a symbolic link (to {storage.link_target(prefix)}) in "
                    f"checkpoint step {manifest.step} ({storage.path(name)}), which lists "
                    f"{entry.path}: resumekit never reads a checkpoint through a link; "
                    "put the file itself there, or move the step directory out of the root",
                    path=storage.path(name), file=entry.path, step=manifest.step, link=True)


def _classify_without_manifest(storage: Storage, name: str) -> tuple[Status, str]:
    files = storage.walk_files(name)
    if not files:
        return "partial", "empty directory without manifest.json"
    names = [path for path, _ in files]
    if any(path.startswith(ATTEMPT_PREFIX) or path.endswith(DCP_METADATA_FILE)
           for path in names):
        return "partial", "data without manifest.json (a save that did not finish)"
    if any(path.endswith(_WEIGHT_SUFFIXES) for path in names):
        return "legacy", "weights-only directory without manifest.json"
    return "partial", "files without manifest.json"


def list_checkpoints(
    storage: Storage,
    name_format: NameFormat | None = None,
    *,
    legacy_format: NameFormat | None = None,
) -> list[CheckpointEntry]:
    """List every checkpoint-like entry of a root, sorted by step (numerically).

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named (default ``step_{step:09d}``).
        legacy_format: Also recognise weights-only directories of this format (default
            ``checkpoint_step_{step}``).

    Returns:
        Entries sorted by (step, committed last), hidden work in progress as ``partial``.
        Names that do not parse are ignored.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    _check_root(storage)
    entries = []
    for info in storage.list_dir():
        nested = _foreign_entries_in(storage, info.name) \
            if info.is_dir and not info.is_link and info.name in _FOREIGN_CONTAINERS else []
        entry = None if nested else _entry_of(storage, info, name_format, legacy_format)
        entries.extend(nested if entry is None else [entry])
    return sorted(entries, key=_entry_order)


def _foreign_entries_in(storage: Storage, folder: str) -> list[CheckpointEntry]:
    """Foreign checkpoints one level down in a folder other tools keep them in."""
    found = []
    for info in storage.list_dir(folder):
        name = f"{folder}/{info.name}"
        if info.is_dir or info.name.endswith(".ckpt"):
            entry = _foreign_entry(storage, name, None)
            if entry is not None:
                found.append(entry)
    return found


def _entry_of(storage: Storage, info: FileInfo, name_format: NameFormat,
              legacy_format: NameFormat) -> CheckpointEntry | None:
    """Classify one entry of the root (None: not checkpoint-like, ignored).

    A symbolic link is classified first, from its name alone (nothing is read through
    it): a step, staging, retired, set-aside or legacy name is a ``symlink`` entry, any
    other link is ignored like any name that is not checkpoint-like.
    """
    if info.is_link or storage.is_link(info.name):
        return _link_entry(storage, info.name, name_format, legacy_format)
    return _own_entry_of(storage, info, name_format, legacy_format)


def _own_entry_of(storage: Storage, info: FileInfo, name_format: NameFormat,
                  legacy_format: NameFormat) -> CheckpointEntry | None:
    """Classify one entry of the root that is not a link (:func:`_entry_of`)."""
    if not info.is_dir:
        return _foreign_entry(storage, info.name, None) if info.name.endswith(".ckpt") \
            else None
    hidden = name_format.parse_hidden(info.name)
    if hidden is not None:
        if hidden[1].kind == "bad":
            return CheckpointEntry(hidden[0], info.name, storage.path(info.name), "corrupt",
                                   problem="set aside after failing verification on restore",
                                   defect="set-aside")
        kind = "being written" if hidden[1].kind == "tmp" else "being retired"
        return CheckpointEntry(hidden[0], info.name, storage.path(info.name), "partial",
                               problem=f"hidden directory {kind}",
                               defect="staging" if hidden[1].kind == "tmp" else "retiring")
    step = name_format.parse(info.name)
    if step is not None:
        return _step_entry(storage, info.name, step, legacy_format)
    legacy_step = legacy_format.parse(info.name)
    if legacy_step is not None:
        status, problem = _classify_without_manifest(storage, info.name)
        if status == "legacy":
            return CheckpointEntry(legacy_step, info.name, storage.path(info.name), status,
                                   problem=problem)
    return _foreign_entry(storage, info.name, None)


def _step_entry(storage: Storage, name: str, step: int,
                legacy_format: NameFormat) -> CheckpointEntry:
    """Classify a directory whose name parses as one of this root's steps."""
    path = storage.path(name)
    try:
        manifest = _manifest_if_any(storage, name)  # one read, not a look and a read
    except (ManifestError, CorruptCheckpointError, UnsafeCheckpointError) as error:
        return CheckpointEntry(step, name, path, "corrupt", problem=str(error),
                               defect=_manifest_defect(error))
    if manifest is None:
        foreign = _foreign_entry(storage, name, step)
        if foreign is not None:
            return foreign
        status, problem = _classify_without_manifest(storage, name)
        if status == "legacy" and legacy_format.parse(name) is None:
            # Our own step name without a manifest is a save that never committed
            # (or lost its manifest), not a weights-only export to import.
            status, problem = "partial", "data without manifest.json (not committed)"
        missing: Defect | None = None
        if status == "partial":
            missing = ("empty" if problem.startswith("empty") else
                       "no-manifest" if storage.atomic_rename else "unfinished")
        return CheckpointEntry(step, name, path, status, problem=problem, defect=missing)
    if manifest.step != step:
        return CheckpointEntry(
            step, name, path, "corrupt",
            problem=f"manifest says step {manifest.step}, directory name says {step}",
            defect="wrong-step")
    return CheckpointEntry(step, name, path, "committed", manifest=manifest)


def _manifest_defect(error: ResumekitError) -> Defect:
    """What an error reading a manifest says is wrong with its directory."""
    if isinstance(error, UnsupportedSchemaError):
        return "newer-schema"
    if isinstance(error, UnsafeCheckpointError):
        return "symlink" if getattr(error, "link", False) else "unsafe-manifest"
    return "bad-manifest"


def latest_committed(
    storage: Storage, name_format: NameFormat | None = None
) -> CheckpointEntry | None:
    """Return the committed checkpoint with the highest step, or None.

    Reads from the top down (:func:`newest_committed`): one listing and the manifests of
    the newest step directories, not every manifest of the root.
    """
    return newest_committed(storage, name_format)


# ------------------------------------------------------- the top of a root, read cheaply
#
# A long run's root holds many checkpoints; what a save, ``latest()`` or a restore needs is
# its top: the newest committed step and what lies above it. These read it with one
# listing and then only the manifests from the highest-numbered step directory down until
# one validates, so their cost does not grow with the number of checkpoints. Each manifest
# read is the real commit marker: nothing here trusts anything but a committed manifest.

#: ``(name, is_dir)`` of the entries of a root, as :meth:`Storage.list_names` lists them.
Listing = Sequence[tuple[str, bool]]


@dataclass(frozen=True)
class RootTop:
    """The top of a checkpoint root, read from its highest step down (:func:`read_top`).

    Attributes:
        listing: ``(name, is_dir)`` of every entry of the root (one listing).
        hidden: Its hidden entries (staging, retiring, set aside), classified by name.
        above: Step directories above ``newest``, highest first: not committed, or
            committed but skipped (e.g. a fenced writer's checkpoint).
        newest: The newest committed entry that was not skipped, or None.
    """

    listing: tuple[tuple[str, bool], ...]
    hidden: tuple[CheckpointEntry, ...]
    above: tuple[CheckpointEntry, ...]
    newest: CheckpointEntry | None

    @property
    def names(self) -> frozenset[str]:
        """The names of every entry of the root."""
        return frozenset(name for name, _ in self.listing)

    def entries(self) -> list[CheckpointEntry]:
        """Hidden entries, ``above`` and ``newest``, sorted as :func:`list_checkpoints`."""
        found = [*self.hidden, *self.above, *([self.newest] if self.newest else [])]
        return sorted(found, key=_entry_order)


def _entry_order(entry: CheckpointEntry) -> tuple[int, int, str]:
    order = {"foreign": 0, "partial": 1, "corrupt": 2, "legacy": 3, "committed": 4}
    return entry.step, order[entry.status], entry.name


def sort_entries(entries: Iterable[CheckpointEntry]) -> list[CheckpointEntry]:
    """Sort entries as :func:`list_checkpoints` does: by step, committed last."""
    return sorted(entries, key=_entry_order)


def list_root(storage: Storage) -> list[tuple[str, bool]]:
    """List a checkpoint root once, as ``(name, is_dir)``.

    Raises:
        StorageError: The root is a file (checked only when the listing is empty).
    """
    listing = storage.list_names()
    if not listing:
        _check_root(storage)
    return listing


def step_directories(listing: Listing, name_format: NameFormat | None = None
                     ) -> list[tuple[int, str]]:
    """``(step, name)`` of the visible step directories of a listing, highest step first."""
    template = (name_format or NameFormat()).template
    found = [(step, name) for name, is_dir in listing
             if is_dir and (step := _parsed_step(template, name)) is not None]
    return sorted(found, reverse=True)


@functools.lru_cache(maxsize=1 << 16)
def _parsed_step(template: str, name: str) -> int | None:
    """``NameFormat(template).parse(name)``, remembered: a root's names recur each listing."""
    return _name_format(template).parse(name)


@functools.lru_cache(maxsize=64)
def _name_format(template: str) -> NameFormat:
    return NameFormat(template)


def hidden_entries(storage: Storage, listing: Listing, name_format: NameFormat | None = None
                   ) -> list[CheckpointEntry]:
    """The hidden entries (``.tmp-``, ``.old-``, ``.bad-``) of a listing, from names alone."""
    name_format = name_format or NameFormat()
    legacy = NameFormat(LEGACY_NAME_FORMAT)
    return [entry for name, is_dir in listing
            if is_dir and name_format.parse_hidden(name) is not None
            and (entry := _entry_of(storage, FileInfo(name, storage.path(name), True, 0, None),
                                    name_format, legacy)) is not None]


def other_entries(storage: Storage, listing: Listing, name_format: NameFormat | None = None,
                  *, legacy_format: NameFormat | None = None) -> list[CheckpointEntry]:
    """Classify every entry of a listing that is not a visible step directory.

    Hidden work in progress, legacy and foreign checkpoints, exactly as
    :func:`list_checkpoints` classifies them; step directories are left to
    :func:`entries_from_top`. Their number does not grow with the run's checkpoints.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    found = []
    for name, is_dir in listing:
        if is_dir and name_format.parse(name) is not None:
            continue
        nested = _foreign_entries_in(storage, name) \
            if is_dir and name in _FOREIGN_CONTAINERS and not storage.is_link(name) else []
        entry = None if nested else _entry_of(
            storage, FileInfo(name, storage.path(name), is_dir, 0, None), name_format,
            legacy_format)
        found.extend(nested if entry is None else [entry])
    return found


def classify_step(storage: Storage, step: int, name_format: NameFormat | None = None, *,
                  legacy_format: NameFormat | None = None) -> CheckpointEntry:
    """Classify the step directory of ``step`` (which the caller listed), reading its manifest."""
    name_format = name_format or NameFormat()
    return _step_entry(storage, name_format.build(step), step,
                       legacy_format or NameFormat(LEGACY_NAME_FORMAT))


def entries_from_top(storage: Storage, name_format: NameFormat | None = None, *,
                     below: int | None = None, listing: Listing | None = None,
                     legacy_format: NameFormat | None = None) -> Iterator[CheckpointEntry]:
    """Classify the root's step directories from the highest step down, one by one.

    Each directory's manifest is read only when the iteration reaches it, so a caller
    that stops at the first committed entry reads no more than it needs.

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        below: Only steps below this one.
        listing: The root's listing, if already made (:func:`list_root`).
        legacy_format: As for :func:`list_checkpoints`.

    Yields:
        Entries of visible step directories (any status), highest step first.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    for step, name in step_directories(
            list_root(storage) if listing is None else listing, name_format):
        if below is None or step < below:
            yield _step_entry(storage, name, step, legacy_format)


def read_top(storage: Storage, name_format: NameFormat | None = None, *,
             skip: Callable[[CheckpointEntry], bool] | None = None,
             listing: Listing | None = None, below: int | None = None) -> RootTop:
    """Read the top of a root: one listing, then manifests from the top down.

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        skip: Committed entries for which this is true are not the newest (e.g. a fenced
            writer's checkpoint); they are reported in ``above`` and the search goes on.
        listing: The root's listing, if already made (:func:`list_root`).
        below: Only steps below this one count.

    Returns:
        The listing, the hidden entries, the step directories above the newest
        committed one, and that one (None when there is none).
    """
    name_format = name_format or NameFormat()
    listing = tuple(list_root(storage) if listing is None else listing)
    above: list[CheckpointEntry] = []
    newest = None
    for entry in entries_from_top(storage, name_format, below=below, listing=listing):
        if entry.status == "committed" and (skip is None or not skip(entry)):
            newest = entry
            break
        above.append(entry)
    return RootTop(listing, tuple(hidden_entries(storage, listing, name_format)),
                   tuple(above), newest)


def newest_committed(storage: Storage, name_format: NameFormat | None = None, *,
                     below: int | None = None,
                     skip: Callable[[CheckpointEntry], bool] | None = None,
                     listing: Listing | None = None,
                     newest_record: int | object | None = UNLISTED
                     ) -> CheckpointEntry | None:
    """Return the newest committed checkpoint (below ``below``), reading from the top down.

    One listing of the root, then the manifests of the highest-numbered step directories
    until one validates: the cost does not grow with the number of checkpoints below it.
    On S3 (:attr:`Storage.range_listing`) the listing starts at the newest-step hint
    (:func:`write_newest_hint`) and holds only the names after it: the hint's own
    manifest, and every step directory above it, are then read as always, so a stale or
    wrong hint costs a full listing, never a wrong answer. On a local root the stamped
    hint (:func:`write_stamped_hint`) is taken without any listing while the root
    directory's stat is still the one stamped in it (:func:`_newest_from_stamp`).

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        below: Only steps below this one.
        skip: Committed entries not to return (the search goes on below them).
        listing: The root's listing, if already made (:func:`list_root`).
        newest_record: The highest generation record number of the root (None: none),
            if the caller listed them already; :data:`UNLISTED`: list them here when the
            stamped hint needs it.

    Returns:
        The entry, or None when no committed checkpoint is there.
    """
    if listing is None and below is None and storage.range_listing:
        found = _newest_from_hint(storage, name_format or NameFormat(), skip)
        if found is not None:
            return found
    elif listing is None and below is None and storage.atomic_rename:
        found = _newest_from_stamp(storage, name_format or NameFormat(), skip, newest_record)
        if found is not None:
            return found
    for entry in entries_from_top(storage, name_format, below=below, listing=listing):
        if entry.status == "committed" and (skip is None or not skip(entry)):
            return entry
    return None


def _newest_from_hint(storage: Storage, name_format: NameFormat,
                      skip: Callable[[CheckpointEntry], bool] | None) -> CheckpointEntry | None:
    """The newest committed entry at or above the hint, listing only names after it.

    None when there is no usable hint, or nothing at or above it is committed (the
    caller then lists the whole root).
    """
    hinted = read_newest_hint(storage, name_format)
    if hinted is None or not _sorts_by_name(name_format, hinted):
        return None
    name = name_format.build(hinted)
    later = storage.list_names(after=name)
    for step, found in step_directories([*later, (name, True)], name_format):
        entry = _step_entry(storage, found, step, NameFormat(LEGACY_NAME_FORMAT))
        if entry.status == "committed" and (skip is None or not skip(entry)):
            return entry
    return None


def listing_with_hinted_step(storage: Storage, name_format: NameFormat,
                             listing: Listing) -> Listing:
    """``listing`` of an S3 root, with the committed step the newest-step hint names.

    :func:`newest_committed` on S3 (``latest()``) reads the hinted checkpoint's manifest
    by name and the names listed after it, so it finds a commit that a lagging listing
    of the whole root does not show yet. A caller that lists the whole root (restore)
    passes its listing here to see that checkpoint too: when the hint names a step above
    every step directory of ``listing`` and that step's manifest is committed, its
    directory and the names listed after it are added, with a warning naming it (the
    listing lagged). Otherwise (another store, no usable hint, a hint at or below the
    listing's newest, a hinted step that is not committed any more) ``listing`` is
    returned as it is: a hint never stands in for a manifest.
    """
    if not storage.range_listing:
        return listing
    hinted = read_newest_hint(storage, name_format)
    if hinted is None or not _sorts_by_name(name_format, hinted):
        return listing
    steps = step_directories(listing, name_format)
    if steps and steps[0][0] >= hinted:
        return listing
    name = name_format.build(hinted)
    entry = _step_entry(storage, name, hinted, NameFormat(LEGACY_NAME_FORMAT))
    if entry.status != "committed":
        return listing
    logger.warning(
        "resumekit: the listing of %s does not show %s yet, although the newest-step hint "
        "names it and its manifest is committed (an eventually consistent listing lagging "
        "behind the commit); reading it by name, as latest() does, so that restore does not "
        "resume an older step", storage.path(), storage.path(name))
    merged = {item[0]: item for item in listing}
    merged.update({item[0]: item for item in [*storage.list_names(after=name), (name, True)]})
    return sorted(merged.values())


def _sorts_by_name(name_format: NameFormat, step: int) -> bool:
    """Whether every step directory above ``step`` has a name that sorts after its own.

    True for a zero-padded step field (``{step:09d}``) while ``step`` still has a leading
    zero there: then a higher step's name is either as long and larger, or longer with a
    non-zero digit where ``step``'s has its zero.
    """
    shortest = len(name_format.build(0))
    width = 0
    while width < 30 and len(name_format.build(10 ** (width + 1) - 1)) == shortest:
        width += 1
    return width >= 2 and step < 10 ** (width - 1)


def read_newest_hint(storage: Storage, name_format: NameFormat | None = None) -> int | None:
    """The step the newest-step hint names (None: absent, unreadable, another format).

    A hint only: a committed manifest always decides (:func:`newest_committed`).
    """
    found = _hint_document(storage, name_format or NameFormat())
    return None if isinstance(found, str) else found[0]


def _hint_document(storage: Storage, name_format: NameFormat
                   ) -> tuple[int, dict[str, Any]] | str:
    """The newest-step hint's step and document, or why there is none to use."""
    try:
        hint = storage.read_json(NEWEST_HINT_FILE, limit=RECORD_LIMIT)
    except FileNotFoundError:
        return "no newest-step hint"
    except (ValueError, OSError) as error:
        return f"unreadable newest-step hint ({error})"
    step = hint.get("step") if isinstance(hint, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or \
            hint.get("name_format") != name_format.template or \
            hint.get("name") != name_format.build(step):
        return "the newest-step hint names no step of this root's name format"
    return step, hint


def write_newest_hint(storage: Storage, name_format: NameFormat, step: int) -> None:
    """Record ``step`` as the newest committed step (after its commit; S3 roots only).

    Written where :attr:`Storage.range_listing` lets :func:`newest_committed` list only
    the names after it. Nothing trusts it over a manifest, so a failure to write it costs
    later readers a full listing, never a wrong answer (and is logged and warned about).
    """
    if not storage.range_listing:
        return
    document = {"step": step, "name": name_format.build(step),
                "name_format": name_format.template}
    try:
        storage.write_bytes(NEWEST_HINT_FILE, json.dumps(document).encode())
    except OSError as error:
        message = (f"resumekit: cannot write the newest-step hint "
                   f"{storage.path(NEWEST_HINT_FILE)} ({error}); step {step} is committed, "
                   "readers list the whole root to find it")
        warn(message, ResumekitWarning, stacklevel=3)


# ------------------------------------------------ the stamped hint of a local root
#
# On a local root ``latest()`` need not list the root: the writer of the newest checkpoint
# stamps the hint with the root directory's stat (:meth:`Storage.root_stamp`) and its
# generation; while the root's stat is still that stamp, no entry was created, removed or
# renamed in the root since, so the listing's answer is still the hinted step. Every
# resumekit operation that changes the root's entries removes the hint first
# (:func:`forget_newest_hint`), so its own changes never depend on timestamps. The hint
# lives in ``.resumekit-generations/``: writing or removing it leaves the root's stat as is.


def forget_newest_hint(storage: Storage) -> None:
    """Remove the stamped hint of a local root, before changing the root's entries.

    Called before a save stages, a commit renames, a prune deletes, a restore sets aside
    or puts back: a crash anywhere after it leaves no hint, so readers list the root.
    A no-op on object stores (their hint is never trusted over a listing of the names
    after it).

    Raises:
        StorageError: The hint exists and cannot be removed (nothing was changed).
    """
    if storage.atomic_rename:
        storage.remove_file(NEWEST_HINT_FILE)


def write_stamped_hint(storage: Storage, name_format: NameFormat, step: int,
                       generation: int) -> bool:
    """Stamp ``step`` as the newest checkpoint of a local root (after commit and prune).

    The root's stat is taken first, then the root is listed once: the hint is written
    only when the highest step directory of that listing is ``step``, so it names what
    the listing at the stamp's instant answered. A failure to write it is logged and
    warned about; the checkpoint is committed either way, and readers list the root.

    Args:
        storage: The checkpoint root (a no-op unless :attr:`Storage.atomic_rename`).
        name_format: How step directories are named.
        step: The step just committed.
        generation: The writer generation that committed it (readers trust the hint
            only while it is the root's newest).

    Returns:
        Whether the hint was written.
    """
    if not storage.atomic_rename:
        return False
    where = storage.path(NEWEST_HINT_FILE)
    try:
        # (.resumekit-generations/ exists: the writer's claim is there. Were it made by
        # the write below, the root's stat would change and no reader would trust it.)
        stamp = storage.root_stamp()
        why = None
        if stamp is None or stamp[4] < 2:
            why = "the root has no stat with a subdirectory count"
        else:
            top = step_directories(list_root(storage), name_format)[:1]
            if not top or top[0][0] != step:
                why = (f"{top[0][1]} is the highest step directory" if top
                       else f"{name_format.build(step)} is not listed")
        if why is not None or stamp is None:
            logger.debug("resumekit: no stamped newest-step hint for step %d in %s: %s",
                         step, storage.path(), why)
            return False
        document = {"step": step, "name": name_format.build(step),
                    "name_format": name_format.template, "generation": generation,
                    "root_stamp": list(stamp)}
        storage.write_bytes(NEWEST_HINT_FILE, json.dumps(document).encode())
    except OSError as error:
        message = (f"resumekit: cannot write the newest-step hint {where} ({error}); "
                   f"step {step} is committed, latest() lists the whole root to find it")
        warn(message, ResumekitWarning, stacklevel=3)
        return False
    return True


def _newest_from_stamp(storage: Storage, name_format: NameFormat,
                       skip: Callable[[CheckpointEntry], bool] | None,
                       newest_record: int | object | None = None) -> CheckpointEntry | None:
    """The hinted checkpoint while the root is as its writer stamped it; else None.

    None (the caller lists the root; same answer, logged at DEBUG) unless the root's stat
    equals the hint's stamp exactly and counts subdirectories (``st_nlink >= 2``), the
    hint's generation is the root's newest, and the hinted step is committed and not
    skipped. The root is stat'ed before the hint is read: a writer removes the hint
    before it changes the root, so a hint still there was valid at that stat.
    """
    stamp = storage.root_stamp()
    found = _hint_document(storage, name_format)
    why = found if isinstance(found, str) else _stamp_doubt(storage, found[1], stamp,
                                                            newest_record)
    if why is None and not isinstance(found, str):
        entry = _step_entry(storage, name_format.build(found[0]), found[0],
                            NameFormat(LEGACY_NAME_FORMAT))
        if entry.status == "committed" and (skip is None or not skip(entry)):
            return entry
        why = (f"the hinted {entry.name} is {entry.status}" if entry.status != "committed"
               else f"the hinted {entry.name} is passed over")
    logger.debug("resumekit: listing %s to find the newest checkpoint: %s",
                 storage.path(), why)
    return None


def _stamp_doubt(storage: Storage, hint: Mapping[str, Any],
                 stamp: tuple[int, int, int, int, int] | None,
                 newest_record: int | object | None) -> str | None:
    """Why a stamped hint cannot stand for the root's listing now (None: it can)."""
    recorded = hint.get("root_stamp")
    if not isinstance(recorded, list) or len(recorded) != 5:
        return "the newest-step hint has no root stamp"
    if stamp is None:
        return "the root has no stat"
    if tuple(recorded) != stamp:
        return "the root changed since the newest-step hint was stamped"
    if stamp[4] < 2:
        return "the root's filesystem reports no subdirectory count (st_nlink < 2)"
    generation = hint.get("generation")
    newest = (newest_generation_record(storage) if newest_record is UNLISTED
              else newest_record)
    if not isinstance(generation, int) or isinstance(generation, bool) or \
            generation != newest:
        return (f"the newest-step hint is of generation {generation}, the root's newest "
                f"is {newest}")
    return None


def generation_record_numbers(storage: Storage) -> list[int]:
    """The numbers of the root's generation records, sorted (one listing)."""
    numbers = [parse_generation_record_name(name)
               for name, is_dir in storage.list_names(GENERATIONS_DIR) if not is_dir]
    return sorted(number for number in numbers if number is not None)


def newest_generation_record(storage: Storage) -> int | None:
    """The highest generation record number of the root (None: no record)."""
    numbers = generation_record_numbers(storage)
    return numbers[-1] if numbers else None


def other_name_checkpoints(storage: Storage, name_format: NameFormat) -> list[str]:
    """Name the visible directories with a manifest that ``name_format`` does not match.

    Checkpoints written with another ``name_format`` (``step_{step}`` next to a manager
    of ``checkpoint_step_{step}``): a fresh start next to them is almost always a bug.

    Returns:
        Their names, sorted.
    """
    return sorted(
        info.name for info in storage.list_dir()
        if info.is_dir and not info.name.startswith(".")
        and name_format.parse(info.name) is None
        and storage.exists(f"{info.name}/{MANIFEST_NAME}")
    )


def verify_checkpoint(
    storage: Storage,
    name: str,
    *,
    manifest: Manifest | None = None,
    progress: Callable[[int], None] | None = None,
    sizes_only: Collection[str] = (),
) -> Manifest:
    """Re-hash every file of checkpoint ``name`` against its manifest.

    Args:
        storage: The checkpoint root.
        name: The step directory name.
        manifest: Its manifest, if already read.
        progress: Called with the number of bytes hashed since the last call.
        sizes_only: Manifest paths whose size is checked but whose bytes are not hashed,
            because their reader checks every byte it reads (raw tensor files on restore).

    Returns:
        The manifest, once every file matched.

    Raises:
        IncompleteCheckpointError: The first file that is missing or has the wrong size.
        CorruptCheckpointError: The first file whose checksum differs.
        UnsafeCheckpointError: A file (or a directory on its way) is a symbolic link
            (:func:`refuse_links`); nothing was read through it.
    """
    manifest = manifest or read_manifest(storage, name)
    refuse_links(storage, name, manifest)
    for entry in manifest.files:
        relative = f"{name}/{manifest.data_path(entry.path)}"
        where = storage.path(relative)
        try:
            size = read_with_retry(where, functools.partial(storage.size, relative))
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{where} is missing (listed in the manifest of step {manifest.step})",
                path=storage.path(name), file=entry.path, step=manifest.step,
            ) from None
        if size != entry.size:
            raise IncompleteCheckpointError(
                f"{where} has {size} bytes, the manifest of step {manifest.step} "
                f"says {entry.size}",
                path=storage.path(name), file=entry.path, step=manifest.step,
            )
        if entry.path in sizes_only:
            continue

        def hashed(relative: str = relative) -> str:
            def counted() -> Iterator[bytes]:
                for chunk in storage.iter_chunks(relative):
                    if progress is not None:
                        progress(len(chunk))
                    yield chunk

            return checksum_chunks(counted())

        actual = read_with_retry(where, hashed)  # a transient error hashes it again
        if actual != entry.checksum:
            raise CorruptCheckpointError(
                f"{where} fails its checksum (step {manifest.step}): expected "
                f"{entry.checksum}, got {actual}",
                path=storage.path(name), file=entry.path, step=manifest.step,
            )
    return manifest


# --------------------------------------------------------------------- tensor data


@dataclass(frozen=True)
class TensorData:
    """Where the model/optimizer tensors of one committed checkpoint live.

    Attributes:
        url: The DCP directory holding them (``<step>/tensors`` on POSIX,
            ``<step>/attempt-<token>/tensors`` on object stores), as DCP opens it.
        step_dir: The step directory (holding ``manifest.json``).
        manifest: Its manifest.
        checksums: ``{file name relative to url: "xxh3_128:<hex>"}`` of every data file
            the manifest lists there, ``.metadata`` included.
    """

    url: str
    step_dir: str
    manifest: Manifest
    checksums: Mapping[str, str]


def locate_tensor_data(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> TensorData:
    """Find the tensor data of the committed checkpoint at ``path``.

    Args:
        path: A step directory (holding ``manifest.json``) or its tensor directory
            (``tensors/``, also under ``attempt-<token>/`` on object stores): a local path
            or an fsspec URL.
        storage_options: fsspec options for URLs.

    Returns:
        The tensor directory, the manifest and the checksums it records there.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or is not a resumekit checkpoint
            (neither it nor a step directory above it has ``manifest.json``).
        ManifestError: The manifest is unreadable or invalid.
        IncompleteCheckpointError: The manifest points at tensor data that is not there.
    """
    options = dict(storage_options or {})
    given = Storage(path, options)
    where = given.path()
    if not given.is_dir():
        raise CheckpointNotFoundError(
            f"{where} is not a resumekit checkpoint: no such directory", path=where)
    candidates = [(given, "")]
    parent = _parent_storage(given, options)
    if parent is not None and given.is_file(DCP_METADATA_FILE):
        candidates.append((parent, posixpath.basename(given.root.rstrip("/"))))
        grandparent = _parent_storage(parent, options)
        if grandparent is not None:
            inner = posixpath.basename(parent.root.rstrip("/"))
            candidates.append(
                (grandparent, f"{inner}/{posixpath.basename(given.root.rstrip('/'))}"))
    for step_dir, below in candidates:
        if not step_dir.is_file(MANIFEST_NAME):
            continue
        source = step_dir.path(MANIFEST_NAME)
        manifest = parse_manifest(step_dir.read_small(MANIFEST_NAME), source=source)
        data = manifest.data_path(TENSORS_DIR)
        if below and below != data:
            continue  # a manifest above, but not of this directory
        if not step_dir.is_file(f"{data}/{DCP_METADATA_FILE}"):
            raise IncompleteCheckpointError(
                f"{step_dir.path(data)} has no {DCP_METADATA_FILE}: checkpoint "
                f"{step_dir.path()} (step {manifest.step}) holds no model/optimizer tensors "
                "or lost them",
                path=step_dir.path(), file=f"{data}/{DCP_METADATA_FILE}", step=manifest.step,
            )
        prefix = f"{TENSORS_DIR}/"
        checksums = {entry.path[len(prefix):]: entry.checksum
                     for entry in manifest.files if entry.path.startswith(prefix)}
        return TensorData(step_dir.url_of(data), step_dir.path(), manifest, checksums)
    what = ("DCP data without a resumekit manifest.json above it (a plain DCP "
            "checkpoint: read it with DCP's own FileSystemReader, or bring it in with "
            "`resumekit import`)" if given.is_file(DCP_METADATA_FILE)
            else f"no {MANIFEST_NAME} and no DCP {DCP_METADATA_FILE}")
    raise CheckpointNotFoundError(
        f"{where} is not a resumekit checkpoint: {what}; pass a step directory "
        f"(holding {MANIFEST_NAME}) or its {TENSORS_DIR}/ folder", path=where)


def _parent_storage(storage: Storage, options: dict[str, Any]) -> Storage | None:
    root = storage.root.rstrip("/")
    parent = os.path.dirname(root) if storage.is_local else posixpath.dirname(root)
    if not parent or parent == root:
        return None
    if storage.is_local:
        return Storage(parent, options)
    protocol = storage.fs.protocol
    protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
    return Storage(f"{protocol}://{parent.lstrip('/')}", options)


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class CheckpointTarget:
    """What a path given by a user points at.

    Attributes:
        storage: The checkpoint root (the parent directory when ``entry`` is set).
        name_format: The step-name format detected (or given).
        entry: The one checkpoint directory pointed at, or None for a root.
    """

    storage: Storage
    name_format: NameFormat
    entry: CheckpointEntry | None = None

    @property
    def is_root(self) -> bool:
        """True when the path is a checkpoint root rather than one checkpoint."""
        return self.entry is None

    def entries(self) -> list[CheckpointEntry]:
        """List the root's entries (for a single checkpoint: that one)."""
        if self.entry is not None:
            return [self.entry]
        return list_checkpoints(self.storage, self.name_format)


def _formats(name_format: str | NameFormat | None) -> list[NameFormat]:
    if isinstance(name_format, NameFormat):
        return [name_format]
    if name_format is not None:
        return [NameFormat(name_format)]
    return [NameFormat(template) for template in DEFAULT_NAME_FORMATS]


def _parses(name_format: NameFormat, name: str) -> bool:
    return name_format.parse(name) is not None or name_format.parse_hidden(name) is not None


def split_parent(url: str) -> tuple[str, str]:
    """Split a local path or URL into ``(parent, name)``; local paths become absolute."""
    trimmed = url.rstrip("/")
    if "://" in trimmed:
        protocol, rest = trimmed.split("://", 1)
        parent, _, name = rest.rpartition("/")
        return f"{protocol}://{parent}", name
    absolute = os.path.abspath(trimmed)
    return os.path.dirname(absolute), os.path.basename(absolute)


def open_target(
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    name_format: str | NameFormat | None = None,
) -> CheckpointTarget:
    """Decide whether ``path`` is a checkpoint root or one checkpoint directory.

    A directory holding ``manifest.json``, or whose name parses as a step (work in
    progress included), is one checkpoint; any other directory is a root. Without
    ``name_format``, ``step_{step:09d}`` and ``checkpoint_step_{step}`` are tried: for a
    root, the one that names more of its directories wins (ties go to the first).

    Args:
        path: A local path or fsspec URL (``s3://bucket/run``).
        storage_options: fsspec options (e.g. ``endpoint_url``).
        name_format: The step-name template, if known.

    Returns:
        The target; for one checkpoint, its entry as the catalog classifies it.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or is a directory with a
            manifest-like name that is not a checkpoint.
        StorageError: ``path`` is a file, or cannot be read.
    """
    url = os.fspath(path)
    options = dict(storage_options or {})
    storage = Storage(url, options)
    if not storage.exists():
        raise CheckpointNotFoundError(f"{storage.path()} does not exist", path=storage.path())
    if not storage.is_dir():
        raise StorageError(
            f"{storage.path()} is a file, not a checkpoint directory or root",
            path=storage.path(), operation="inspect",
        )
    candidates = _formats(name_format)
    parent_url, name = split_parent(url)
    own = [fmt for fmt in candidates if _parses(fmt, name)]
    if storage.exists(MANIFEST_NAME) or own:
        parent = Storage(parent_url, options)
        fmt = own[0] if own else candidates[0]
        return CheckpointTarget(parent, fmt, _named_entry(parent, fmt, name))
    names = [info.name for info in storage.list_dir() if info.is_dir]
    scores = [sum(_parses(fmt, entry) for entry in names) for fmt in candidates]
    best = candidates[scores.index(max(scores))]
    return CheckpointTarget(storage, best)


def _named_entry(parent: Storage, name_format: NameFormat, name: str) -> CheckpointEntry:
    legacy = NameFormat(LEGACY_NAME_FORMAT)
    # Classified as list_checkpoints classifies it, without listing (and reading) the
    # rest of the root: the directory exists (open_target checked).
    entry = _entry_of(parent, FileInfo(name, parent.path(name), True, 0, None), name_format,
                      legacy)
    if entry is not None:
        return entry
    # Not a step name of this format: a directory with a manifest, under any name.
    path = parent.path(name)
    try:
        manifest = read_manifest(parent, name)
    except (ManifestError, UnsafeCheckpointError) as error:
        return CheckpointEntry(-1, name, path, "corrupt", problem=str(error),
                               defect=_manifest_defect(error))
    except CheckpointNotFoundError:
        raise
    if not parent.exists(f"{name}/{MANIFEST_NAME}"):
        raise CheckpointNotFoundError(f"{path} is not a checkpoint", path=path)
    return CheckpointEntry(manifest.step, name, path, "committed", manifest=manifest)


def select_committed(target: CheckpointTarget, step: int | None = None) -> CheckpointEntry:
    """Return the committed checkpoint of ``step`` (newest when None) of a target.

    For a single-checkpoint target, ``step`` (if given) must be its step.

    Raises:
        CheckpointNotFoundError: No committed checkpoint of that step.
        ManifestError: The checkpoint pointed at is not committed (its problem named).
        UnsafeCheckpointError: Its manifest lists a path outside its directory.
    """
    where = target.storage.path()
    if target.entry is not None:
        entry = target.entry
        if step is not None and entry.step != step:
            raise CheckpointNotFoundError(
                f"{entry.path} is step {entry.step}, not step {step}",
                path=entry.path, step=step,
            )
        if entry.status != "committed":
            _raise_not_committed(entry)
        return entry
    if step is None:  # the newest: read from the top down, not every manifest
        newest = newest_committed(target.storage, target.name_format)
        if newest is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {where} (name format "
                f"{target.name_format.template!r})", path=where,
            )
        return newest
    matching = [entry for entry in target.entries() if entry.step == step]
    committed = [entry for entry in matching if entry.status == "committed"]
    if committed:
        return committed[-1]
    if matching:
        _raise_not_committed(matching[-1])
    raise CheckpointNotFoundError(
        f"no checkpoint of step {step} under {where} (name format "
        f"{target.name_format.template!r})", path=where, step=step,
    )


def _raise_not_committed(entry: CheckpointEntry) -> None:
    problem = entry.problem or f"no valid {MANIFEST_NAME}"
    if entry.defect == "unsafe-manifest":
        raise UnsafeCheckpointError(problem, path=entry.path, step=entry.step)
    raise ManifestError(
        f"{entry.path} is not a committed checkpoint ({entry.status}: {problem})",
        path=entry.path, step=entry.step,
    )


def tensors_url(storage: Storage, entry: CheckpointEntry) -> str:
    """Return the URL of the DCP tensor directory of a committed checkpoint."""
    if entry.manifest is None:
        raise ManifestError(f"{entry.path} has no manifest", path=entry.path)
    return storage.url_of(f"{entry.name}/{entry.manifest.data_path(TENSORS_DIR)}")
