"""A path a user gives: a checkpoint root or one checkpoint, and what to read in it.

For the command line, export and import: :func:`open_target` tells a root from one
checkpoint directory and detects the step-name format, :func:`select_committed` picks the
committed checkpoint of a step, :func:`tensors_url` is where its DCP tensor data lives,
and :func:`locate_tensor_data` finds that data (and its checksums) from a step directory
or its ``tensors/`` folder. Nothing here imports torch.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumekit.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    UnsafeCheckpointError,
)
from resumekit.store.catalog import (
    CheckpointEntry,
    classify_entry,
    list_checkpoints,
    manifest_defect,
    read_manifest,
)
from resumekit.store.layout import (
    DCP_METADATA_FILE,
    DEFAULT_NAME_FORMAT,
    LEGACY_NAME_FORMAT,
    MANIFEST_NAME,
    TENSORS_DIR,
    NameFormat,
)
from resumekit.store.manifest import Manifest, parse_manifest
from resumekit.store.newest import newest_committed
from resumekit.store.storage import FileInfo, Storage

# What the other layers use.
__all__ = [
    "DEFAULT_NAME_FORMATS",
    "CheckpointTarget",
    "locate_tensor_data",
    "open_target",
    "select_committed",
    "split_parent",
    "tensors_url",
]

#: Step-name formats :func:`open_target` tries, in order, when none is given.
DEFAULT_NAME_FORMATS = (DEFAULT_NAME_FORMAT, LEGACY_NAME_FORMAT)



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

    def entries(self, *, unreadable: list[tuple[str, str]] | None = None
                ) -> list[CheckpointEntry]:
        """List the root's entries (for a single checkpoint: that one).

        Args:
            unreadable: Collects the entries that cannot be read instead of raising
                (see :func:`~resumekit.store.catalog.list_checkpoints`).
        """
        if self.entry is not None:
            return [self.entry]
        return list_checkpoints(self.storage, self.name_format, unreadable=unreadable)


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
    entry = classify_entry(parent, FileInfo(name, parent.path(name), True, 0, None), name_format,
                      legacy)
    if entry is not None:
        return entry
    # Not a step name of this format: a directory with a manifest, under any name.
    path = parent.path(name)
    try:
        manifest = read_manifest(parent, name)
    except (ManifestError, UnsafeCheckpointError) as error:
        return CheckpointEntry(-1, name, path, "corrupt", problem=str(error),
                               defect=manifest_defect(error))
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
