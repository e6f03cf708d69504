"""The newest committed checkpoint of a root, read from its top down.

A long run's root holds many checkpoints; what a save, ``latest()`` or a restore needs is
its top: the newest committed step and what lies above it (:func:`read_top`,
:func:`newest_committed`). One listing, then only the manifests from the highest-numbered
step directory down until one validates, so the cost does not grow with the number of
checkpoints. Two hints spare even the listing, and neither is ever trusted over a
manifest: on S3 the newest-step hint lets the listing start at the hinted step
(:func:`write_newest_hint`; :func:`listing_with_hinted_step` for a listing that lags the
commit), on a local root the stamped hint stands for the listing while the root
directory's stat is the one stamped in it (:func:`write_stamped_hint`). How they fit into
the commit protocol is written down in :mod:`resumekit.store.commit`. Nothing here
imports torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from resumekit.store.catalog import (
    CheckpointEntry,
    Listing,
    classify_step,
    hidden_entries,
    list_root,
    sort_entries,
    step_directories,
)
from resumekit.store.layout import (
    GENERATIONS_DIR,
    LEGACY_NAME_FORMAT,
    NEWEST_HINT_FILE,
    NameFormat,
    parse_generation_record_name,
)
from resumekit.store.storage import RECORD_LIMIT, Storage
from resumekit.warnings import ResumekitWarning, warn

logger = logging.getLogger("resumekit")

# What the other layers use.
__all__ = [
    "entries_from_top",
    "latest_committed",
    "listing_with_hinted_step",
    "read_top",
]

#: ``newest_committed``'s ``newest_record`` when the caller has not listed the records.
UNLISTED = object()


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
        """Hidden entries, ``above`` and ``newest``, sorted as the catalog sorts them."""
        found = [*self.hidden, *self.above, *([self.newest] if self.newest else [])]
        return sort_entries(found)

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
        listing: The root's listing, if already made (:func:`~resumekit.store.catalog.list_root`).
        legacy_format: As for :func:`~resumekit.store.catalog.list_checkpoints`.

    Yields:
        Entries of visible step directories (any status), highest step first.
    """
    name_format = name_format or NameFormat()
    legacy_format = legacy_format or NameFormat(LEGACY_NAME_FORMAT)
    for step, _ in step_directories(
            list_root(storage) if listing is None else listing, name_format):
        if below is None or step < below:
            yield classify_step(storage, step, name_format, legacy_format=legacy_format)


def read_top(storage: Storage, name_format: NameFormat | None = None, *,
             skip: Callable[[CheckpointEntry], bool] | None = None,
             listing: Listing | None = None, below: int | None = None) -> RootTop:
    """Read the top of a root: one listing, then manifests from the top down.

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        skip: Committed entries for which this is true are not the newest (e.g. a fenced
            writer's checkpoint); they are reported in ``above`` and the search goes on.
        listing: The root's listing, if already made (:func:`~resumekit.store.catalog.list_root`).
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
        listing: The root's listing, if already made (:func:`~resumekit.store.catalog.list_root`).
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
    for step, _ in step_directories([*later, (name, True)], name_format):
        entry = classify_step(storage, step, name_format)
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
    entry = classify_step(storage, hinted, name_format)
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
        entry = classify_step(storage, found[0], name_format)
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
