"""What a checkpoint root holds: listing, the newest committed step, verification.

Statuses of an entry:

* ``committed``: a step directory with a valid manifest — a checkpoint;
* ``partial``: work in progress or left by a crash (a hidden staging directory, or a step
  directory with data but no manifest) — never loaded;
* ``corrupt``: a step directory whose manifest exists but cannot be read or validated;
* ``legacy``: a weights-only ``checkpoint_step_N/`` from a trainer without resumekit
  (e.g. ``transformer/diffusion_pytorch_model.safetensors``) — importable, never chosen
  over a committed checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from resumekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    UnsafeCheckpointError,
)
from resumekit.layout import LEGACY_NAME_FORMAT, NameFormat
from resumekit.manifest import MANIFEST_NAME, Manifest, checksum_chunks, parse_manifest
from resumekit.storage import Storage

__all__ = [
    "CheckpointEntry",
    "Status",
    "latest_committed",
    "list_checkpoints",
    "read_manifest",
    "verify_checkpoint",
]

Status = Literal["committed", "partial", "corrupt", "legacy"]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class CheckpointEntry:
    """One entry of a checkpoint root.

    Attributes:
        step: The step its name stands for.
        name: Directory name relative to the root.
        path: Full path (or URL) of the directory.
        status: ``committed``, ``partial``, ``corrupt`` or ``legacy``.
        manifest: The parsed manifest of a committed entry.
        problem: Why an entry is not committed (one line), if it is not.
    """

    step: int
    name: str
    path: str
    status: Status
    manifest: Manifest | None = None
    problem: str | None = None


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
    source = storage.path(f"{name}/{MANIFEST_NAME}")
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST_NAME}")
    except FileNotFoundError:
        if not storage.exists(name):
            raise CheckpointNotFoundError(
                f"no checkpoint directory {storage.path(name)}", path=storage.path(name)
            ) from None
        raise ManifestError(
            f"{source} is missing: {storage.path(name)} is not a committed checkpoint",
            path=source,
        ) from None
    except StorageError:
        if storage.is_dir(f"{name}/{MANIFEST_NAME}"):
            # A directory in the manifest's place is bad content, not a storage failure:
            # it must not make the whole root unlistable.
            raise ManifestError(
                f"{source} is a directory, not a manifest: {storage.path(name)} is not a "
                "committed checkpoint", path=source,
            ) from None
        raise
    return parse_manifest(raw, source=source)


def _classify_without_manifest(storage: Storage, name: str) -> tuple[Status, str]:
    files = storage.walk_files(name)
    if not files:
        return "partial", "empty directory without manifest.json"
    names = [path for path, _ in files]
    if any(path.startswith("attempt-") or path.endswith(".metadata") for path in names):
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
    entries: list[CheckpointEntry] = []
    for info in storage.list_dir():
        if not info.is_dir:
            continue
        hidden = name_format.parse_hidden(info.name)
        if hidden is not None:
            if hidden[1].kind == "bad":
                entries.append(CheckpointEntry(
                    hidden[0], info.name, storage.path(info.name), "corrupt",
                    problem="set aside after failing verification on restore"))
                continue
            kind = "being written" if hidden[1].kind == "tmp" else "being retired"
            entries.append(CheckpointEntry(hidden[0], info.name, storage.path(info.name),
                                           "partial", problem=f"hidden directory {kind}"))
            continue
        step = name_format.parse(info.name)
        if step is None:
            legacy_step = legacy_format.parse(info.name)
            if legacy_step is not None:
                status, problem = _classify_without_manifest(storage, info.name)
                if status == "legacy":
                    entries.append(CheckpointEntry(legacy_step, info.name,
                                                   storage.path(info.name), status,
                                                   problem=problem))
            continue
        if not storage.exists(f"{info.name}/{MANIFEST_NAME}"):
            status, problem = _classify_without_manifest(storage, info.name)
            if status == "legacy" and legacy_format.parse(info.name) is None:
                # Our own step name without a manifest is a save that never committed
                # (or lost its manifest), not a weights-only export to import.
                status, problem = "partial", "data without manifest.json (not committed)"
            entries.append(CheckpointEntry(step, info.name, storage.path(info.name), status,
                                           problem=problem))
            continue
        try:
            manifest = read_manifest(storage, info.name)
        except (ManifestError, CorruptCheckpointError, UnsafeCheckpointError) as error:
            entries.append(CheckpointEntry(step, info.name, storage.path(info.name),
                                           "corrupt", problem=str(error)))
            continue
        if manifest.step != step:
            entries.append(CheckpointEntry(
                step, info.name, storage.path(info.name), "corrupt",
                problem=f"manifest says step {manifest.step}, directory name says {step}",
            ))
            continue
        entries.append(CheckpointEntry(step, info.name, storage.path(info.name),
                                       "committed", manifest=manifest))
    order = {"partial": 0, "corrupt": 1, "legacy": 2, "committed": 3}
    return sorted(entries, key=lambda entry: (entry.step, order[entry.status], entry.name))


def latest_committed(
    storage: Storage, name_format: NameFormat | None = None
) -> CheckpointEntry | None:
    """Return the committed checkpoint with the highest step, or None."""
    committed = [
        entry for entry in list_checkpoints(storage, name_format)
        if entry.status == "committed"
    ]
    return committed[-1] if committed else None


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
    """
    manifest = manifest or read_manifest(storage, name)
    for entry in manifest.files:
        relative = f"{name}/{manifest.data_path(entry.path)}"
        where = storage.path(relative)
        try:
            size = storage.size(relative)
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

        def counted(relative: str = relative) -> object:
            for chunk in storage.iter_chunks(relative):
                if progress is not None:
                    progress(len(chunk))
                yield chunk

        actual = checksum_chunks(counted())  # type: ignore[arg-type]
        if actual != entry.checksum:
            raise CorruptCheckpointError(
                f"{where} fails its checksum (step {manifest.step}): expected "
                f"{entry.checksum}, got {actual}",
                path=storage.path(name), file=entry.path, step=manifest.step,
            )
    return manifest
