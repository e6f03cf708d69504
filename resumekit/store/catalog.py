"""What a checkpoint root holds: its entries, classified, and the checks of one of them.

Statuses of an entry:

* ``committed``: a step directory with a valid manifest — a checkpoint;
* ``partial``: work in progress or left by a crash (a hidden staging directory, or a step
  directory with data but no manifest) — never loaded;
* ``corrupt``: a step directory whose manifest exists but cannot be read or validated;
* ``legacy``: a weights-only ``checkpoint_step_N/`` from a trainer without resumekit
  (e.g. ``transformer/diffusion_pytorch_model.safetensors``) — importable, never chosen
  over a committed checkpoint;
* ``foreign``: another tool's checkpoint, recognised by that tool's own markers
  (:func:`~resumekit.store.foreign.detect_foreign`): plain DCP or torchtitan
  (``.metadata``), Accelerate (``optimizer.bin``, ``random_states_*.pkl``), HF Trainer
  (``trainer_state.json``), Lightning (``*.ckpt``) — never loaded as ours; ``resumekit
  import`` converts it.

A symbolic link is never a checkpoint, whatever it points to and whatever its name: a
step, staging, retired or set-aside name that is a link, or a step directory whose
``manifest.json`` is one, is ``corrupt`` with the defect ``symlink`` and is never read
through, set aside, swept or deleted (:func:`link_problem`); a file a manifest lists that
is (or lies below) a link fails :func:`verify_checkpoint` and :func:`refuse_links`.

An entry that is not committed also says what is wrong with it (:data:`Defect`), so a
restore can tell what is provably broken (:data:`BROKEN`: set aside) from what is merely
newer (``newer-schema``: refused) or still being written (``unfinished``, ``staging``).

The rest of the store's reading side: the newest committed step, read from a root's top
down, is :mod:`resumekit.store.newest`'s; a path a user gives (root or one checkpoint) is
:mod:`resumekit.store.targets`'; other tools' checkpoints are
:mod:`resumekit.store.foreign`'s. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

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
from resumekit.store.foreign import ForeignFormat, detect_foreign
from resumekit.store.layout import (
    ATTEMPT_PREFIX,
    DCP_METADATA_FILE,
    LEGACY_NAME_FORMAT,
    MANIFEST_NAME,
    NameFormat,
)
from resumekit.store.manifest import FileEntry, Manifest, checksum_chunks, parse_manifest
from resumekit.store.retry import read_with_retry
from resumekit.store.storage import FileInfo, Storage

logger = logging.getLogger("resumekit")

T = TypeVar("T")

# What the other layers use (Status and Defect: the types of CheckpointEntry's fields).
__all__ = [
    "BROKEN",
    "CheckpointEntry",
    "Defect",
    "Status",
    "list_checkpoints",
    "list_root",
    "other_entries",
    "other_name_checkpoints",
    "read_checked_file",
    "read_checked_range",
    "read_checked_ranges",
    "read_manifest",
    "refuse_links",
    "sort_entries",
    "verify_checkpoint",
]

Status = Literal["committed", "partial", "corrupt", "legacy", "foreign"]
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
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: Folders other tools save checkpoints into, looked into one level down: Accelerate's
#: ``automatic_checkpoint_naming`` (``checkpoints/checkpoint_N``) and Lightning's
#: ``ModelCheckpoint`` default (``checkpoints/*.ckpt``).
_FOREIGN_CONTAINERS = ("checkpoints",)

#: ``(name, is_dir)`` of the entries of a root, as :meth:`Storage.list_names` lists them.
Listing = Sequence[tuple[str, bool]]


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


def read_checked_file(storage: Storage, name: str, manifest: Manifest, entry: FileEntry, *,
                      verify: bool = True) -> bytes:
    """Read one file of checkpoint ``name`` whole, checked as :func:`verify_checkpoint` does.

    A restore reads ``tensors/.metadata`` with it on one rank and sends the bytes to the
    others (:func:`resumekit.restore.verification.share_metadata`).

    Args:
        storage: The checkpoint root.
        name: The step directory name.
        manifest: Its manifest.
        entry: The manifest's entry of the file (``tensors/.metadata``).
        verify: Also compare the bytes with the manifest's checksum (without it, the
            link and the size are still checked).

    Returns:
        The file's bytes.

    Raises:
        IncompleteCheckpointError: The file is missing or has the wrong size.
        CorruptCheckpointError: Its checksum differs.
        UnsafeCheckpointError: It (or a directory on its way) is a symbolic link; nothing
            was read.
    """
    refuse_links(storage, name, manifest.model_copy(update={"files": [entry]}))
    relative = f"{name}/{manifest.data_path(entry.path)}"
    try:
        data = read_with_retry(storage.path(relative),
                               functools.partial(storage.read_bytes, relative))
    except FileNotFoundError:
        raise _missing(storage, name, manifest, entry) from None
    if len(data) != entry.size:
        raise _wrong_size(storage, name, manifest, entry, len(data))
    if verify:
        actual = checksum_chunks([data], like=entry.checksum)
        if actual != entry.checksum:
            raise _wrong_checksum(storage, name, manifest, entry, actual)
    return data


def read_checked_range(storage: Storage, name: str, manifest: Manifest, entry: FileEntry, *,
                       start: int, length: int) -> bytes:
    """Read ``length`` bytes at ``start`` of one file of checkpoint ``name``.

    As :func:`read_checked_file`, without the checksum: the link is refused, the file's
    size must be the manifest's, and the range must lie in it. The caller checks the
    bytes against a checksum of their own (a part of a ``.metadata`` laid out by rank).

    Raises:
        IncompleteCheckpointError: The file is missing, has the wrong size, or is shorter
            than the range.
        UnsafeCheckpointError: It (or a directory on its way) is a symbolic link.
    """
    return read_checked_ranges(storage, name, manifest, entry,
                               lambda pread: pread(start, length))


def read_checked_ranges(storage: Storage, name: str, manifest: Manifest, entry: FileEntry,
                        read: Callable[[Callable[[int, int], bytes]], T]) -> T:
    """Read ranges of one file of checkpoint ``name`` through one open of it.

    As :func:`read_checked_range`, for several reads where each may depend on the one
    before (a ``.metadata``'s head says where its parts lie): the link is refused, the
    file is opened once and its size checked against the manifest's, then
    ``read(pread)`` runs while it is open; ``pread(start, length)`` returns exactly
    those bytes of it. ``pread`` must not be kept: the file is closed when ``read``
    returns.

    Args:
        storage: The checkpoint root.
        name: The step directory name.
        manifest: Its manifest.
        entry: The manifest's entry of the file.
        read: Reads what it needs with ``pread`` and returns it; called again from the
            start after a transient error.

    Returns:
        What ``read`` returned.

    Raises:
        IncompleteCheckpointError: The file is missing, has the wrong size, or is shorter
            than a range.
        UnsafeCheckpointError: It (or a directory on its way) is a symbolic link.
        Exception: Any error of ``read``, unchanged.
    """
    refuse_links(storage, name, manifest.model_copy(update={"files": [entry]}))
    relative = f"{name}/{manifest.data_path(entry.path)}"

    def attempt() -> T:
        with storage.open(relative) as handle:
            size = handle.seek(0, 2)
            if size != entry.size:
                raise _wrong_size(storage, name, manifest, entry, size)

            def pread(start: int, length: int) -> bytes:
                handle.seek(start)
                data = handle.read(length)
                if len(data) != length:
                    raise _wrong_size(storage, name, manifest, entry, start + len(data))
                return data

            return read(pread)

    try:
        return read_with_retry(storage.path(relative), attempt)
    except ResumekitError:
        raise  # a wrong size (a FileNotFoundError too), or the error of ``read``
    except FileNotFoundError:
        raise _missing(storage, name, manifest, entry) from None


def _missing(storage: Storage, name: str, manifest: Manifest, entry: FileEntry
             ) -> IncompleteCheckpointError:
    where = storage.path(f"{name}/{manifest.data_path(entry.path)}")
    return IncompleteCheckpointError(
        f"{where} is missing (listed in the manifest of step {manifest.step})",
        path=storage.path(name), file=entry.path, step=manifest.step)


def _wrong_size(storage: Storage, name: str, manifest: Manifest, entry: FileEntry,
                size: int) -> IncompleteCheckpointError:
    where = storage.path(f"{name}/{manifest.data_path(entry.path)}")
    return IncompleteCheckpointError(
        f"{where} has {size} bytes, the manifest of step {manifest.step} says {entry.size}",
        path=storage.path(name), file=entry.path, step=manifest.step)


def _wrong_checksum(storage: Storage, name: str, manifest: Manifest, entry: FileEntry,
                    actual: str) -> CorruptCheckpointError:
    where = storage.path(f"{name}/{manifest.data_path(entry.path)}")
    return CorruptCheckpointError(
        f"{where} fails its checksum (step {manifest.step}): expected {entry.checksum}, "
        f"got {actual}", path=storage.path(name), file=entry.path, step=manifest.step)


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
    unreadable: list[tuple[str, str]] | None = None,
) -> list[CheckpointEntry]:
    """List every checkpoint-like entry of a root, sorted by step (numerically).

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named (default ``step_{step:09d}``).
        legacy_format: Also recognise weights-only directories of this format (default
            ``checkpoint_step_{step}``).
        unreadable: None (the default): an entry that cannot be read (a step directory
            without read permission) raises, as every reader that picks a step must. A
            list: such an entry is appended as ``(name, error message)`` and the others
            are listed (``resumekit inspect`` names it beside the readable steps).

    Returns:
        Entries sorted by (step, committed last), hidden work in progress as ``partial``.
        Names that do not parse are ignored.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    _check_root(storage)
    entries = []
    for info in storage.list_dir():
        try:
            nested = _foreign_entries_in(storage, info.name) \
                if info.is_dir and not info.is_link and info.name in _FOREIGN_CONTAINERS \
                else []
            entry = None if nested else classify_entry(storage, info, name_format,
                                                       legacy_format)
        except (StorageError, OSError) as error:
            if unreadable is None:
                raise
            unreadable.append((info.name, " ".join(str(error).split())))
            continue
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


def classify_entry(storage: Storage, info: FileInfo, name_format: NameFormat,
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
    """Classify one entry of the root that is not a link (:func:`classify_entry`)."""
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
                               defect=manifest_defect(error))
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


def manifest_defect(error: ResumekitError) -> Defect:
    """What an error reading a manifest says is wrong with its directory."""
    if isinstance(error, UnsupportedSchemaError):
        return "newer-schema"
    if isinstance(error, UnsafeCheckpointError):
        return "symlink" if getattr(error, "link", False) else "unsafe-manifest"
    return "bad-manifest"


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
    name_format = name_format or NameFormat()
    found = [(step, name) for name, is_dir in listing
             if is_dir and (step := name_format.parse(name)) is not None]
    return sorted(found, reverse=True)


def hidden_entries(storage: Storage, listing: Listing, name_format: NameFormat | None = None
                   ) -> list[CheckpointEntry]:
    """The hidden entries (``.tmp-``, ``.old-``, ``.bad-``) of a listing, from names alone."""
    name_format = name_format or NameFormat()
    legacy = NameFormat(LEGACY_NAME_FORMAT)
    return [entry for name, is_dir in listing
            if is_dir and name_format.parse_hidden(name) is not None
            and (entry := classify_entry(storage, FileInfo(name, storage.path(name), True, 0, None),
                                    name_format, legacy)) is not None]


def other_entries(storage: Storage, listing: Listing, name_format: NameFormat | None = None,
                  *, legacy_format: NameFormat | None = None) -> list[CheckpointEntry]:
    """Classify every entry of a listing that is not a visible step directory.

    Hidden work in progress, legacy and foreign checkpoints, exactly as
    :func:`list_checkpoints` classifies them; step directories are left to
    :func:`~resumekit.store.newest.entries_from_top`. Their number does not grow with the
    run's checkpoints.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    found = []
    for name, is_dir in listing:
        if is_dir and name_format.parse(name) is not None:
            continue
        nested = _foreign_entries_in(storage, name) \
            if is_dir and name in _FOREIGN_CONTAINERS and not storage.is_link(name) else []
        entry = None if nested else classify_entry(
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
            raise _missing(storage, name, manifest, entry) from None
        if size != entry.size:
            raise _wrong_size(storage, name, manifest, entry, size)
        if entry.path in sizes_only:
            continue

        def hashed(relative: str = relative, expected: str = entry.checksum) -> str:
            def counted() -> Iterator[bytes]:
                for chunk in storage.iter_chunks(relative):
                    if progress is not None:
                        progress(len(chunk))
                    yield chunk

            return checksum_chunks(counted(), like=expected)

        actual = read_with_retry(where, hashed)  # a transient error hashes it again
        if actual != entry.checksum:
            raise _wrong_checksum(storage, name, manifest, entry, actual)
    return manifest


