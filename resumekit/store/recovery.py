"""What a crash or a dead writer leaves in a root, and how it is put right.

The commit protocol (:mod:`resumekit.store.commit`, where it is written down) leaves a
root in one of a few states when a process dies inside it; these are the functions that
recognise each state and undo or clear it, never deleting a committed checkpoint:

* an interrupted replacement or deletion (a ``.old-`` copy between two renames):
  :func:`recover_interrupted` puts the copy back or removes it, naming why;
* a step directory that cannot be restored: :func:`set_aside` renames it to a hidden
  ``.bad-`` name (nothing deleted);
* staging areas whose writer is provably dead or fenced, and deletions cut part-way:
  :func:`sweep_dead_writers` (``begin``, rank 0) and retention's age rule decide from
  :func:`cut_short_reason`, :func:`dead_writer_reason` and the writer records.

Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Collection, Iterable
from typing import Any

from resumekit.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store.aside import aside_token
from resumekit.store.catalog import (
    BROKEN,
    CheckpointEntry,
    Listing,
    classify_step,
    read_manifest,
    verify_checkpoint,
)
from resumekit.store.layout import ATTEMPT_PREFIX, MANIFEST_NAME, WRITER_FILE, NameFormat
from resumekit.store.manifest import WriterGeneration
from resumekit.store.newest import forget_newest_hint
from resumekit.store.storage import RECORD_LIMIT, Storage
from resumekit.warnings import ResumekitWarning, warn

# What the other layers use.
__all__ = [
    "recover_interrupted",
    "set_aside",
]

logger = logging.getLogger("resumekit")


def remove_retired(storage: Storage, retired: str) -> None:
    """Delete a retired step directory: its manifest first (durably), then its files.

    Without its manifest a directory is never restorable (``recover_interrupted`` reads
    it first), so a crash part-way through the deletion leaves only files for the sweep.
    A concurrent ``recover_interrupted`` may remove the same directory: its vanishing is
    not an error.
    """
    storage.remove_file(f"{retired}/{MANIFEST_NAME}")
    try:
        storage.fsync_dir(retired)
    except StorageError:
        if storage.exists(retired):
            raise
    storage.remove_tree(retired)


def recover_interrupted(storage: Storage, name_format: NameFormat, *,
                        listing: Listing | None = None) -> list[str]:
    """Undo a replacement or deletion that a crash cut between its two renames.

    A hidden ``.<name>.old-<token>`` directory that still holds a valid manifest while
    ``<name>`` is absent is renamed back (the operation did not happen), once every file
    its manifest lists is there at its size. Two other retired copies with a manifest are
    deleted, each with a warning naming it and why: one whose ``<name>`` is committed
    again (a replacement that a crash cut after its second rename: the new copy is the
    checkpoint; left alone, it would come back once retention deleted the new one), and
    one that misses files (a deletion cut part-way: restoring it would publish a broken
    checkpoint). Returns the names restored. Only POSIX roots can be in these states.

    A name is no proof of content: a ``<name>`` that is not a committed checkpoint never
    gets a complete retired copy deleted. When it is provably broken (empty, no or a bad
    manifest: :data:`~resumekit.store.catalog.BROKEN`) it is set aside (``.bad-``, nothing
    deleted) and the copy put back; anything else there (a symbolic link, a newer
    resumekit's checkpoint, another tool's) is left as it is, and so is the copy. Either
    way a warning names both paths. A retired name that is a link, or whose manifest is
    one, is never read through nor renamed (the catalog reports it).

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        listing: The root's listing, if already made (no second listing then).
    """
    if not storage.atomic_rename:
        return []
    if listing is None:
        if not storage.is_dir():
            return []
        listing = storage.list_names()
    restored: list[str] = []
    names = {name for name, _ in listing}
    for name in sorted(names):
        parsed = name_format.parse_hidden(name)
        if parsed is None or parsed[1].kind != "old":
            continue
        try:
            manifest = read_manifest(storage, name)  # a link raises: never read through
        except Exception:  # noqa: BLE001 - not restorable: left for the sweep
            continue
        step, target = parsed[0], parsed[1].name
        holder = classify_step(storage, step, name_format) if target in names else None
        problem, broken = (None, False) if holder is None else _what_holds(storage, holder)
        if holder is not None and problem is None:
            _remove_abandoned_retired(
                storage, name, f"the retired copy of step {step} left by an interrupted "
                f"replacement; {storage.path(target)} is the checkpoint")
            continue
        try:
            verify_checkpoint(storage, name, manifest=manifest,
                              sizes_only=[entry.path for entry in manifest.files])
        except IncompleteCheckpointError as error:
            _remove_abandoned_retired(
                storage, name, f"it cannot be restored as step {step}: {error}")
            continue
        except UnsafeCheckpointError as error:
            _warn(f"left {storage.path(name)} as it is (the retired copy of step {step}): "
                  f"{error}")
            continue
        if holder is not None and not _clear_name_for(
                storage, name_format, name, holder, problem=problem, broken=broken):
            continue
        if not restored:
            forget_newest_hint(storage)
        storage.rename_dir(name, target)
        restored.append(target)
    if restored:
        storage.fsync_dir()
    return restored


def _what_holds(storage: Storage, holder: CheckpointEntry) -> tuple[str | None, bool]:
    """Why ``holder`` is no checkpoint (None: a complete one), and whether it is broken.

    A committed entry is checked for every file at its size (nothing is hashed); one
    missing a file is provably broken, one with a linked file is not (it is left).
    """
    if holder.status != "committed" or holder.manifest is None:
        return holder.problem or holder.status, holder.defect in BROKEN
    try:
        verify_checkpoint(storage, holder.name, manifest=holder.manifest,
                          sizes_only=[entry.path for entry in holder.manifest.files])
    except IncompleteCheckpointError as error:
        return str(error), True
    except UnsafeCheckpointError as error:
        return str(error), False
    return None, False


def _clear_name_for(storage: Storage, name_format: NameFormat, retired: str,
                    holder: CheckpointEntry, *, problem: str | None, broken: bool) -> bool:
    """Free the name a complete retired copy goes back to, if what holds it is broken.

    ``holder`` holds the step name and is no checkpoint (``problem``). A provably
    ``broken`` one is set aside (renamed, nothing deleted); anything else is left, and
    so is the copy. A warning names both paths either way.

    Returns:
        Whether the name is free now.
    """
    copy = (f"{storage.path(retired)} holds a complete copy of step {holder.step} (retired "
            "by a replacement or deletion cut short)")
    why_not = None if broken else f"it is {holder.status}, not provably broken"
    aside = None
    if why_not is None:
        aside, why_not = set_aside(storage, name_format, holder)
    if aside is None:
        _warn(f"{copy}, but {holder.path} holds its name and is no checkpoint "
              f"({problem}); both are left as they are ({why_not}): move "
              f"{holder.path} out of the root and the next restore puts the copy back")
        return False
    _warn(f"{copy}, but {holder.path} held its name and is no checkpoint ({problem}): "
          f"set it aside as {storage.path(aside)} and put the copy back as {holder.path}")
    return True


def _warn(message: str) -> None:
    warn(message, ResumekitWarning, stacklevel=4)


def _remove_abandoned_retired(storage: Storage, name: str, reason: str) -> None:
    """Delete a retired copy that must never be restored, warning with the reason."""
    where = storage.path(name)
    try:
        remove_retired(storage, name)
    except OSError as error:
        message = f"cannot delete {where} ({reason}): {error}"
    else:
        message = f"deleted {where}: {reason}"
    warn(message, ResumekitWarning, stacklevel=3)


def set_aside(storage: Storage, name_format: NameFormat, entry: CheckpointEntry
              ) -> tuple[str | None, str | None]:
    """Rename a step directory that cannot be restored to a hidden ``.bad-`` name.

    The name's token says this version set it aside
    (:func:`~resumekit.store.aside.aside_token`), so that another version that reads it
    puts it back (:func:`~resumekit.store.aside.put_back_set_aside`) and this one never
    does. Nothing is deleted: the files stay for forensics, but the step no longer counts as
    taken, so a resumed run can save that step again. Object stores (no atomic rename)
    and roots this process cannot write keep the entry; the reason comes back so that
    the caller's warning can say what to do. Run it on one process (the leader).

    Args:
        storage: The checkpoint root.
        name_format: Its step directory names.
        entry: The step directory to set aside.

    Returns:
        ``(hidden name, None)`` once set aside, else ``(None, why not)``.
    """
    if not storage.atomic_rename:
        return None, (f"{storage.url} is an object store, where a directory cannot "
                      f"be renamed atomically: move or delete {entry.path} by hand")
    aside = name_format.quarantine_name(entry.step, aside_token(os.urandom(6).hex()))
    try:
        forget_newest_hint(storage)
        storage.rename_dir(entry.name, aside)
    except OSError as error:  # read-only root, another user's root, gone
        return None, f"renaming it failed: {error}"
    try:
        storage.fsync_dir()
    except OSError as error:
        logger.warning("resumekit: %s", error)
    logger.info("resumekit: set %s aside as %s", entry.path, aside)
    return aside, None


def read_writer(storage: Storage, staging: str) -> dict[str, Any] | None:
    """Return the writer record (``.writer.json``) of a staging area, None if unreadable."""
    try:
        writer = storage.read_json(f"{staging}/{WRITER_FILE}", limit=RECORD_LIMIT)
    except (FileNotFoundError, ValueError, OSError):
        return None
    return writer if isinstance(writer, dict) else None


def pid_gone(pid: Any) -> bool:
    """Whether process ``pid`` of this host provably no longer exists."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):
        return False
    return False


def dead_writer_reason(writer: dict[str, Any] | None,
                       current: WriterGeneration | None) -> str | None:
    """Why the writer of a record is provably dead (or fenced), else None.

    Provably: of a generation older than ``current`` (it can never commit), or on this
    host with its pid gone. A writer on another host, or without a readable record, is
    not provably dead (retention's age rule handles those).
    """
    if writer is None:
        return None
    number, token = writer.get("generation"), writer.get("generation_token")
    if current is not None and isinstance(number, int) and isinstance(token, str) and (
        number < current.number or (number == current.number and token != current.token)
    ):
        return (f"its writer's generation {number} is fenced by {current.describe()}")
    if writer.get("host") == socket.gethostname() and pid_gone(writer.get("pid", -1)):
        return f"its writer, pid {writer.get('pid')} on this host, is gone"
    return None


def writer_of(storage: Storage, staging: str, writer: dict[str, Any] | None
              ) -> dict[str, Any] | None:
    """The writer record of ``staging``, else one made from its manifest (POSIX), or None.

    A POSIX writer removes its record only once its manifest is whole, so a staging area
    without a record but with a valid manifest names its writer there (lineage and
    generation): it was about to rename, or died just before.
    """
    if writer is not None or not storage.atomic_rename:
        return writer
    try:
        manifest = read_manifest(storage, staging)
    except (CorruptCheckpointError, UnsafeCheckpointError, FileNotFoundError):
        return None
    made: dict[str, Any] = {"host": manifest.lineage.hostname, "pid": manifest.lineage.pid}
    if manifest.generation is not None:
        made.update(generation=manifest.generation.number,
                    generation_token=manifest.generation.token)
    return made


def cut_short_reason(storage: Storage, name: str, *, retiring: bool) -> str | None:
    """Why the hidden entry ``name`` is provably left by a cut operation, else None.

    Decided from what it holds, not from anyone's clock (POSIX roots only):

    * a retired copy (``.old-``) without a valid manifest: a deletion lost its manifest
      first, so this is a deletion cut part-way (or another process's, in progress:
      finishing it is what that process does too);
    * a staging area (``.tmp-``) holding files but neither a readable writer record nor
      a valid manifest: a live writer keeps its record until its manifest is whole, so
      its writer was cut while writing the manifest (or its record), and is gone.

    A staging area with a valid or newer-schema manifest, or holding nothing but a
    (possibly half-written) writer record, is not decided here.

    Raises:
        FileNotFoundError: ``name`` vanished meanwhile.
    """
    if not storage.atomic_rename:
        return None
    try:
        read_manifest(storage, name)
        return None
    except UnsupportedSchemaError:
        return None  # a newer resumekit's manifest: not ours to judge
    except (CorruptCheckpointError, UnsafeCheckpointError) as error:
        problem = str(error)
    if retiring:
        return (f"a retired copy without a valid manifest ({problem}): a deletion cut "
                "part-way, finished now")
    if read_writer(storage, name) is not None or not any(
            path != WRITER_FILE for path, _ in storage.walk_files(name)):
        return None  # its writer may live, or has only just created it
    return (f"it holds files but neither a writer record nor a valid manifest ({problem}): "
            "its writer was cut while writing its manifest (a live writer keeps its record "
            "until the manifest is whole)")


def staging_areas(storage: Storage, entries: Iterable[CheckpointEntry]) -> list[str]:
    """Names of the root's unpublished staging areas (relative to the root).

    POSIX: the hidden ``.<name>.tmp-<token>`` directories (and ``.old-`` directories of
    interrupted deletions); object stores: ``<step dir>/attempt-<token>/`` prefixes that
    no manifest points to.
    """
    areas = [entry.name for entry in entries
             if entry.status == "partial" and entry.name.startswith(".")]
    if storage.atomic_rename:
        return areas
    for entry in entries:
        if entry.name.startswith(".") or entry.status in ("legacy", "foreign"):
            continue
        published = entry.manifest.data_dir if entry.manifest is not None else None
        for info in storage.list_dir(entry.name):
            if info.is_dir and info.name.startswith(ATTEMPT_PREFIX) and info.name != published:
                areas.append(f"{entry.name}/{info.name}")
    return areas


def sweep_dead_writers(storage: Storage, entries: Iterable[CheckpointEntry],
                       current: WriterGeneration | None, *,
                       active_tokens: Collection[str] = ()) -> list[str]:
    """Remove staging areas whose writer is provably dead or fenced; return their names.

    Runs in ``begin`` (rank 0), before the new save writes, so the space a crashed writer
    left is free again. Provably abandoned: what :func:`cut_short_reason` finds (a cut
    manifest write, a half-deleted retired copy), or a writer (its record, else its
    manifest's lineage) that :func:`dead_writer_reason` finds dead or fenced. Each sweep
    is logged and warned about, naming the directory and the reason; a sweep that fails
    is warned about and the save goes on.
    """
    swept = []
    entries = list(entries)
    retiring = {entry.name for entry in entries if entry.defect == "retiring"}
    for name in staging_areas(storage, entries):
        writer = read_writer(storage, name)
        if writer is not None and writer.get("token") in active_tokens:
            continue
        try:
            reason = cut_short_reason(storage, name, retiring=name in retiring)
            if reason is None and name not in retiring:
                reason = dead_writer_reason(writer_of(storage, name, writer), current)
        except FileNotFoundError:
            continue  # vanished: its writer renamed or removed it meanwhile
        if reason is None:
            continue
        where = storage.path(name)
        try:
            storage.remove_tree(name)
        except OSError as error:
            message = f"cannot sweep the abandoned staging area {where} ({reason}): {error}"
        else:
            swept.append(name)
            message = f"swept the abandoned staging area {where}: {reason}"
        warn(message, ResumekitWarning, stacklevel=2)
    return swept
