"""What a restore does with each entry of a root: load, fall back, set aside, warn, refuse.

The decisions of :meth:`resumekit.CheckpointManager.restore`, as functions of what the
catalog lists, so that each is read and tested without a manager, a model or a process
group. The manager runs them in this order and does what they say (it loads, sets aside
through :func:`resumekit.store.recovery.set_aside`, warns and logs):

1. :func:`survey` the root (leader only): undo an interrupted replacement, put back the
   copies another resumekit version set aside that this one reads
   (:func:`resumekit.store.aside.put_back_set_aside`), list it, and check whether the root
   itself is another tool's checkpoint;
2. :func:`candidates`: the committed checkpoints it may load, newest last (only the one
   of an explicit ``step``);
3. refuse what must never be restored past: :func:`refuse_broken_newest` (with
   ``fallback=False``), :func:`refuse_newer_schema` (a newer resumekit's checkpoint);
4. load the newest candidate; :func:`judge_failure` says whether a failed one may be
   fallen back from, and whether it is set aside (never one that another torch or
   resumekit version wrote and this one cannot read: :func:`refuse_version_skew`);
5. :func:`leftovers`: every entry newer than the step restored that is not usable, and
   every newer foreign checkpoint, is warned about (broken ones set aside); older ones
   are logged;
6. with nothing restored: :func:`foreign_instead` (never start from step 0 next to
   another tool's checkpoint without saying so) and :func:`fresh_start_account` (why the
   run starts at step 0).

Nothing here runs a collective or touches torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from resumekit.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    IncompatibleVersionError,
    IncompleteCheckpointError,
    ManifestError,
    ResumekitError,
    StorageError,
    UnreadableFormatError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store import generations
from resumekit.store.aside import put_back_set_aside
from resumekit.store.catalog import (
    BROKEN,
    CheckpointEntry,
    list_checkpoints,
    list_root,
    other_entries,
    other_name_checkpoints,
    sort_entries,
)
from resumekit.store.foreign import ForeignCheckpoint, detect_foreign, import_command
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.manifest import WriterGeneration, running_versions, version_skew
from resumekit.store.newest import entries_from_top, listing_with_hinted_step, read_top
from resumekit.store.recovery import recover_interrupted
from resumekit.store.retry import is_transient
from resumekit.store.storage import Storage

__all__ = [
    "Leftover",
    "Survey",
    "Unusable",
    "candidates",
    "fallback_order",
    "foreign_instead",
    "fresh_start_account",
    "imported_warning",
    "judge_failure",
    "leftovers",
    "new_root_for",
    "not_damaged",
    "refuse_broken_newest",
    "refuse_newer_schema",
    "refuse_version_skew",
    "survey",
    "survey_below",
]

#: Defects that :func:`leftovers` reports on their own (and the fresh-start account
#: leaves out).
_REPORTED = BROKEN | {"newer-schema", "unfinished", "symlink"}


@dataclass(frozen=True)
class Survey:
    """What restore found in the root.

    Attributes:
        entries: Its entries, as the catalog lists them.
        root_foreign: The root itself, when it is another tool's checkpoint.
    """

    entries: list[CheckpointEntry]
    root_foreign: ForeignCheckpoint | None = None
    #: False when only the top of the root was read (down to the newest committed
    #: checkpoint): the step directories below ``below`` are not in ``entries``.
    complete: bool = True
    below: int | None = None
    #: The generation fenced writers' commits are judged by (the root's newest claim).
    reference: WriterGeneration | None = None


def survey(storage: Storage, name_format: NameFormat, *, recover: bool = True,
           whole: bool = False) -> Survey:
    """Read the root; check whether it is itself a foreign checkpoint (leader only).

    Without ``whole`` only its top is read: one listing, every entry that is not a step
    directory, and the step directories from the highest down to the newest checkpoint a
    writer that was not fenced committed (:func:`~resumekit.store.newest.read_top`), so a
    restore's cost does not grow with the checkpoints below it; a restore that falls back
    past that one reads the rest (:func:`survey_below`).

    Args:
        storage: The checkpoint root.
        name_format: Its step directory names.
        recover: First undo a replacement a crash cut between its two renames
            (:func:`resumekit.store.recovery.recover_interrupted`); False for a read-only restore.
        whole: Read every entry (a restore of an explicit step).

    A root passed as ``.../checkpoint-4`` is a foreign one only when it holds nothing
    committed.
    """
    if whole:
        if recover and storage.is_dir():
            recover_interrupted(storage, name_format)
            put_back_set_aside(storage, name_format, list_root(storage))
        entries = list_checkpoints(storage, name_format)
        top = reference = None
    else:
        reference = generations.newest_generation(storage) if storage.is_dir() else None
        listing = list_root(storage)
        if recover and recover_interrupted(storage, name_format, listing=listing):
            listing = list_root(storage)
        if recover and put_back_set_aside(storage, name_format, listing):
            listing = list_root(storage)
        # latest() on S3 finds a commit by the newest-step hint; a lagging listing must not
        # make restore resume an older step than that one
        listing = list(listing_with_hinted_step(storage, name_format, listing))

        def fenced(entry: CheckpointEntry) -> bool:
            return entry.manifest is not None and \
                generations.zombie_reason(entry.manifest, reference) is not None

        top = read_top(storage, name_format, skip=fenced, listing=listing)
        entries = sort_entries([*other_entries(storage, listing, name_format),
                                *top.above, *([top.newest] if top.newest else [])])
    root_foreign = None
    if not any(e.status == "committed" for e in entries) and storage.is_dir():
        root_foreign = detect_foreign(storage)
    if top is None or top.newest is None:
        return Survey(entries, root_foreign)
    return Survey(entries, root_foreign, complete=False, below=top.newest.step,
                  reference=reference)


def survey_below(storage: Storage, name_format: NameFormat, found: Survey
                 ) -> list[CheckpointEntry]:
    """The step directories below the top ``found`` read, highest first (leader only)."""
    return list(entries_from_top(storage, name_format, below=found.below))


def fallback_order(entries: list[CheckpointEntry], committed: Sequence[CheckpointEntry],
                   more: Callable[[], list[CheckpointEntry]] | None
                   ) -> Iterator[CheckpointEntry]:
    """``committed`` newest first, then (read when reached) the committed ones below.

    After an unusable step the next candidate is always the next-newest committed one,
    whatever order ``committed`` and ``more`` give them in: each is sorted by step here,
    highest first, so a fallback never skips a usable checkpoint for an older one.

    ``more`` returns the entries below those of a top-only survey; they join ``entries``
    (in place, sorted) when the fallback reaches them, so what restore reports afterwards
    covers them too.
    """
    yield from _newest_first(committed)
    if more is None:
        return
    below = more()
    entries[:] = sort_entries([*entries, *below])
    yield from _newest_first([e for e in below if e.status == "committed"])


def _newest_first(entries: Sequence[CheckpointEntry]) -> list[CheckpointEntry]:
    """``entries`` by step, highest first (a stable sort: equal steps keep their order)."""
    return sorted(entries, key=lambda entry: entry.step, reverse=True)


def candidates(entries: Sequence[CheckpointEntry], step: int | None, *, root: str
               ) -> list[CheckpointEntry]:
    """The committed checkpoints a restore may load, oldest first.

    Args:
        entries: The root's entries.
        step: The step asked for (None: any).
        root: The root's path, for the error.

    Raises:
        CheckpointNotFoundError: ``step`` was asked for and is not committed.
    """
    committed = [e for e in entries if e.status == "committed"]
    if step is None:
        return committed
    chosen = [e for e in committed if e.step == step]
    if not chosen:
        raise CheckpointNotFoundError(f"no committed checkpoint of step {step} under {root}",
                                      path=root, step=step)
    return chosen


def refuse_newer_schema(entries: Sequence[CheckpointEntry],
                        below: CheckpointEntry | None) -> None:
    """Never restore ``below`` (or start fresh: None) past a checkpoint a newer resumekit wrote.

    Raises:
        UnsupportedSchemaError: There is such a checkpoint newer than ``below``.
    """
    floor = -1 if below is None else below.step
    newer = [e for e in entries if e.defect == "newer-schema" and e.step > floor]
    if not newer:
        return
    newest = newer[-1]
    instead = "start fresh at step 0" if below is None else \
        f"fall back to step {below.step}"
    raise UnsupportedSchemaError(
        f"{newest.path} (step {newest.step}) was written by a newer resumekit: "
        f"{newest.problem}. Refusing to {instead} past it: upgrade resumekit to resume "
        "from it, or move it out of the root to resume without it",
        path=newest.path, step=newest.step,
    )


def refuse_broken_newest(entries: Sequence[CheckpointEntry]) -> None:
    """Refuse a broken step directory newer than every committed one (``fallback=False``).

    Raises:
        ManifestError: There is one; it names it and its problem.
    """
    newest = max((e.step for e in entries if e.status == "committed"), default=-1)
    broken = [e for e in entries if e.defect in BROKEN and e.step > newest]
    if broken:
        entry = broken[-1]
        raise ManifestError(
            f"{entry.path} (step {entry.step}) is newer than every committed checkpoint "
            f"but is not one: {entry.problem} (fallback=False: not restoring an older "
            "one; move it out of the root or pass fallback=True to set it aside)",
            path=entry.path, step=entry.step,
        )


@dataclass(frozen=True)
class Unusable:
    """A committed checkpoint that failed to restore and may be fallen back from.

    Attributes:
        entry: The checkpoint.
        error: Why it failed.
        deleted: It was deleted while it was read (its step is free; nothing to set
            aside); else it failed a checksum or a size and is to be set aside.
    """

    entry: CheckpointEntry
    error: BaseException
    deleted: bool

    def warning(self, aside: str | None, why_not: str | None) -> str:
        """The warning, once setting it aside gave ``aside`` (or failed: ``why_not``)."""
        entry = self.entry
        if self.deleted:
            return (f"{_deleted(entry, self.error)}; falling back to the previous "
                    "checkpoint")
        where = (f"set aside as {aside}" if aside else
                 f"it could not be set aside ({why_not}), so saving step {entry.step} again "
                 "will fail until it is moved out of the root")
        return (f"checkpoint step {entry.step} ({entry.path}) is unusable ({self.error}); "
                f"{where}; falling back to the previous checkpoint")

    def account(self, aside: str | None) -> str:
        """One line for the error raised when every candidate failed."""
        if self.deleted:
            return f"deleted while it was being restored ({self.error})"
        return f"set aside ({self.error})" if aside else f"unusable ({self.error})"


def _deleted(entry: CheckpointEntry, error: BaseException) -> str:
    return (f"{entry.path} (step {entry.step}) was deleted while it was being "
            f"restored (another job's retention or prune?): {error}")


def judge_failure(entry: CheckpointEntry, error: BaseException, *, gone: bool,
                  may_fall_back: bool, running: Mapping[str, str] | None = None
                  ) -> Unusable:
    """Decide what a committed checkpoint that failed to restore means.

    Restore may fall back to the previous checkpoint only when the step is free again:
    the entry was deleted while it was read (another job's retention), or it failed a
    checksum or a size, or its files could not be interpreted by the versions that wrote
    them (it is then set aside). Anything else (a storage failure that outlived its
    retries, unsafe content, files another torch or resumekit version wrote:
    :func:`refuse_version_skew`; a load that failed on bytes that match their checksums,
    a :class:`~resumekit.errors.CheckpointLoadError`: a bug, not damage) is raised:
    falling back past a checkpoint that stays committed would only collide with it on
    the next save, and would hide a good step. A transient storage failure
    (retried, or one :func:`~resumekit.store.retry.is_transient` names) is raised even when the
    manifest looks gone: a lookup on a failing mount answers "absent" for an ``EIO``
    (``os.path.exists``), and a deleted file reads as missing, not as a connection error.

    Args:
        entry: The checkpoint.
        error: Why loading it failed.
        gone: Its manifest no longer exists.
        may_fall_back: ``fallback`` is on and no explicit step was asked for.
        running: This process's library versions (default: read from it).

    Raises:
        CheckpointNotFoundError: It was deleted and restore may not fall back.
        IncompatibleVersionError: See :func:`refuse_version_skew`.
        CheckpointLoadError: ``error`` is one (its files are intact): told again naming
            the checkpoint and its step.
        ResumekitError: ``error`` itself (a bare ``FileNotFoundError`` as an
            :class:`~resumekit.errors.IncompleteCheckpointError` naming the file), when
            restore may not fall back past it.
    """
    if isinstance(error, StorageError) and (getattr(error, "attempts", None)
                                            or is_transient(error)):
        raise error  # the storage failed, not the checkpoint: nothing says it is gone
    if gone:
        if not may_fall_back:
            raise CheckpointNotFoundError(_deleted(entry, error), path=entry.path,
                                          step=entry.step) from error
        return Unusable(entry, error, deleted=True)
    refuse_version_skew(entry, error, running=running)
    if isinstance(error, CheckpointLoadError):
        raise not_damaged(entry, error) from error
    if isinstance(error, FileNotFoundError) and not isinstance(error, ResumekitError):
        error = IncompleteCheckpointError(
            f"{entry.path} (step {entry.step}) is missing {error.filename or error}",
            path=entry.path, file=error.filename, step=entry.step)
    if not isinstance(error, (CorruptCheckpointError, IncompleteCheckpointError)) or \
            not may_fall_back:
        raise error
    return Unusable(entry, error, deleted=False)


def not_damaged(entry: CheckpointEntry, error: CheckpointLoadError, *,
                rank: int | None = None, node_local: bool = False) -> CheckpointLoadError:
    """``error`` (its files were verified), naming the checkpoint, its step and what to do.

    Args:
        entry: The checkpoint whose load failed.
        error: The failure.
        rank: The rank whose load failed, where ``error`` does not name it.
        node_local: ``entry`` is a node-local copy (the local tier's restore says so, and
            that the durable root is not read in its place).
    """
    rank = error.fields.get("rank") if rank is None else rank
    file = error.fields.get("file")
    where = ("" if rank is None else f" on rank {rank}") + ("" if file is None else
                                                            f" ({file})")
    cause = error.fields.get("cause") or error.message
    what, kept, then = (
        ("node-local copy ", "no copy was deleted",
         "without restoring an older step or the durable root instead: fix the cause and "
         "restore again (or restore without the local tier, local=None, to read the "
         "durable root)") if node_local else
        ("", "nothing was set aside",
         "without falling back to an older checkpoint: fix the cause and restore again (or "
         "move it out of the root to resume from the previous checkpoint without it)"))
    return CheckpointLoadError(
        f"{what}{entry.path} (step {entry.step}) failed to load{where}: {cause}. Its files "
        "match the checksums recorded when it was written, so it is not damaged: what "
        "failed is the code interpreting them (resumekit, torch, or code of this run the "
        f"load calls, such as a state-dict hook). It is kept as it is ({kept}) and restore "
        f"stops here, {then}",
        path=entry.path, step=entry.step, rank=rank, cause=cause, file=file,
    )


def refuse_version_skew(entry: CheckpointEntry, error: BaseException, *,
                        running: Mapping[str, str] | None = None) -> None:
    """Never set aside, as if damaged, a checkpoint another torch or resumekit wrote.

    A failure to interpret a checkpoint's files
    (:class:`~resumekit.errors.UnreadableFormatError`: a ``.metadata`` pickle whose
    objects do not build, a storage descriptor or checksum file of an unknown format,
    DCP's reading failing; a :class:`~resumekit.errors.CheckpointLoadError`: the load
    failing on files that match their checksums; or a torch global the metadata names
    that this torch does not allow) can be a format this process's torch or resumekit
    does not know. When the
    versions the checkpoint records differ from this process's
    (:func:`resumekit.store.manifest.version_skew`), or it records none, restore stops here:
    setting it aside would hide it from the version that can read it, and the run would
    then resume from an older step or step 0.

    Raises:
        IncompatibleVersionError: Such a failure, and the versions differ or are unknown;
            the message names the checkpoint, both torch versions and what to do.
    """
    refused = getattr(error, "refused", None) if isinstance(error, UnsafeCheckpointError) \
        else None
    if not (isinstance(error, (UnreadableFormatError, CheckpointLoadError))
            or (isinstance(refused, str) and refused.startswith("torch."))):
        return
    written = {} if entry.manifest is None else dict(entry.manifest.versions)
    now = running_versions() if running is None else dict(running)
    differences = version_skew(written, now)
    if not differences:
        return
    writer = written.get("torch")
    if writer is None:
        who = (f"its manifest does not record which torch wrote it, so it may be another "
               f"version than this torch {now.get('torch', '?')}")
        then = ("restore it with the torch that wrote it, or move it out of the root (to "
                "resume from an older checkpoint, or start fresh without it)")
    else:
        who = (f"it was written by torch {writer} (resumekit "
               f"{written.get('resumekit', '?')}) and this process runs torch "
               f"{now.get('torch', '?')} (resumekit {now.get('resumekit', '?')})")
        then = (f"install torch {writer.split('+')[0]} to restore it (or to export its "
                "weights: resumekit export writes safetensors any torch reads), or move it "
                "out of the root to resume from an older checkpoint without it")
    raise IncompatibleVersionError(
        f"{entry.path} (step {entry.step}) cannot be read by this process: {error}. "
        f"Not treating it as damaged: {who}. It is kept as it is (nothing was set "
        f"aside) and restore stops here: {then}",
        path=entry.path, step=entry.step, written_by=written, running=now,
        differences=differences,
    ) from error


@dataclass(frozen=True)
class Leftover:
    """An entry restore did not load and must say something about.

    Attributes:
        entry: The entry.
        action: ``"log"`` (info only: older than the step restored, or an older foreign
            checkpoint), ``"warn"``, or ``"set-aside"`` (provably broken and newer: set
            it aside, then warn with :meth:`warning`).
        message: What to log or warn (for ``set-aside``: the start of the warning).
    """

    entry: CheckpointEntry
    action: Literal["log", "warn", "set-aside"]
    message: str

    def warning(self, aside: str | None, why_not: str | None) -> str:
        """The warning of a ``set-aside`` leftover, once setting it aside was tried."""
        entry = self.entry
        outcome = (f"set aside as {aside} (kept for inspection) so that step "
                   f"{entry.step} can be saved again" if aside else
                   f"it could not be set aside ({why_not}); saving step {entry.step} "
                   "will fail until it is moved out of the root")
        return f"{self.message}; {outcome}"


def leftovers(entries: Sequence[CheckpointEntry], storage: Storage, *, above: int,
              foreign: bool = True) -> list[Leftover]:
    """What restore says about the entries it did not load, in the order to say it.

    Every own step directory newer than ``above`` that is not usable is warned about;
    what is provably broken (:data:`~resumekit.store.catalog.BROKEN`) is set aside, so the
    resumed run can save its step again instead of colliding with it on every requeue;
    older ones are only logged (they block nothing: steps only increase); a set-aside
    copy of the same step is named in the warning (it is kept). A symbolic link
    in a checkpoint's place is warned about whatever its step, and never set aside (it
    is left as it is: restore neither used it nor touches it). A copy set aside earlier
    whose step is newer than ``above`` (>= 0) is warned about too, so that a restore run
    again after one killed part-way still names every step it passed over. Then (with
    ``foreign``) every foreign checkpoint of a newer step is warned about (it may hold
    the run's newest state), the others logged.

    Args:
        entries: The root's entries.
        storage: The root (for the ``resumekit import`` commands).
        above: The step restored (-1: none).
        foreign: Also report foreign checkpoints.
    """
    aside: dict[int, list[str]] = {}
    for entry in entries:
        if entry.defect == "set-aside":
            aside.setdefault(entry.step, []).append(entry.path)
    found = [_own_leftover(entry, above, aside.get(entry.step, [])) for entry in entries
             if entry.defect in _REPORTED]
    named = {leftover.entry.step for leftover in found}
    if above >= 0:
        found.extend(_set_aside_leftover(entry, above) for entry in entries
                     if entry.defect == "set-aside" and entry.step > above
                     and entry.step not in named)
    if foreign:
        found.extend(_foreign_leftover(entry, above, storage) for entry in entries
                     if entry.status == "foreign")
    return found


def _own_leftover(entry: CheckpointEntry, above: int, aside: Sequence[str] = ()
                  ) -> Leftover:
    if entry.defect == "symlink":
        return Leftover(entry, "warn", f"ignoring {entry.path} (step {entry.step}): "
                        f"{entry.problem}")
    if entry.step <= above:
        return Leftover(entry, "log", f"ignoring {entry.path}, older than the step resumed "
                        f"from: {entry.problem}")
    if entry.defect == "unfinished":
        return Leftover(entry, "warn", f"ignoring {entry.path} (step {entry.step}): "
                        f"{entry.problem}; a save that has not committed (the next save of "
                        "that step writes a new attempt)")
    if entry.defect == "newer-schema":
        return Leftover(entry, "warn", f"ignoring {entry.path} (step {entry.step}), written "
                        f"by a newer resumekit ({entry.problem}), because an older step was "
                        "asked for; it is kept")
    earlier = (f" ({', '.join(aside)}, set aside earlier with the same step, is kept as "
               "it is: restore never loads a set-aside copy, nor deletes it)" if aside else "")
    return Leftover(entry, "set-aside", f"{entry.path} (step {entry.step}) is not a usable "
                    f"checkpoint: {entry.problem}{earlier}")


def _set_aside_leftover(entry: CheckpointEntry, restored: int) -> Leftover:
    """A copy set aside earlier, newer than the step restored: the run is behind it.

    Warned about on every restore until the run saves past its step, so that a restore
    after one that was killed part-way (or after an earlier fallback) still names every
    step it passed over. It is kept as it is (never loaded, moved or deleted).
    """
    return Leftover(entry, "warn", f"{entry.path} (step {entry.step}) is newer than step "
                    f"{restored} restored but was set aside earlier as unusable (a restore "
                    "failed to verify or read it); it is kept as it is for inspection and "
                    "never loaded: the run resumes behind it")


def _foreign_leftover(entry: CheckpointEntry, restored: int, storage: Storage) -> Leftover:
    if entry.step > restored:
        return Leftover(entry, "warn", f"{entry.path} is a {entry.format} checkpoint of step "
                        f"{entry.step}, newer than step {restored} restored; it is ignored "
                        f"(convert it with: {import_command(entry, storage)})")
    return Leftover(entry, "log", f"ignoring the {entry.format} checkpoint {entry.path} (not "
                    "resumekit's)")


def new_root_for(storage: Storage) -> str:
    """Where to import a root that is itself a foreign checkpoint: a sibling directory."""
    return f"{storage.url_of().rstrip('/')}-resumekit"


def foreign_instead(found: Survey, storage: Storage, *,
                    policy: Literal["error", "ignore"]) -> str | None:
    """Nothing restored but another tool's checkpoint is there: never start silently.

    Args:
        found: The survey of the root.
        storage: The root.
        policy: The manager's ``foreign``.

    Returns:
        The warning to give before starting at step 0 (``policy="ignore"``), or None
        when there is no foreign checkpoint.

    Raises:
        ForeignCheckpointError: There is one and ``policy="error"``; the message gives
            the ``resumekit import`` command that converts the newest.
    """
    listed: list[tuple[str, str, int | None, str]] = [
        (e.path, str(e.format), None if e.step < 0 else e.step, import_command(e, storage))
        for e in found.entries if e.status == "foreign"]
    if found.root_foreign is not None:
        root = found.root_foreign
        listed.append((root.path, root.format, root.step, import_command(
            root, storage, into=new_root_for(storage))))
    if not listed:
        return None
    path, form, step, command = max(listed, key=lambda f: (f[2] is not None, f[2] or 0))
    others = f" (and {len(listed) - 1} more foreign checkpoint(s))" if len(listed) > 1 \
        else ""
    recorded = f"step {step}" if step is not None else "no step: pass the step it was " \
        "saved at as --step N"
    if policy == "ignore":
        return (f"starting fresh at step 0 although {path} is a {form} checkpoint "
                f"({recorded}){others}: foreign='ignore'")
    itself = found.root_foreign is not None and path == found.root_foreign.path
    then = f" and use {new_root_for(storage)} as the root" if itself else ""
    raise ForeignCheckpointError(
        f"{storage.path()} holds no resumekit checkpoint, but {path} is a {form} "
        f"checkpoint ({recorded}){others}; refusing to start from step 0. Convert it "
        f"with: {command}{then} - or pass foreign='ignore' to start fresh anyway",
        path=path, format=form, step=step, command=command,
    )


def fresh_start_account(found: Survey, storage: Storage, name_format: NameFormat, *,
                        import_legacy: bool, has_model: bool) -> tuple[str, list[str]]:
    """Say why a run starts at step 0 (leader only: it lists the root).

    Args:
        found: The survey of the root.
        storage: The root.
        name_format: The manager's step directory names.
        import_legacy: The manager's ``import_legacy``.
        has_model: Whether the manager has a model to import legacy weights into.

    Returns:
        The line to log (an empty root, a root that does not exist yet, or one that holds
        nothing resumable), and the warnings to give: the root holds entries that are not
        committed checkpoints (besides those :func:`leftovers` reported), or checkpoints
        of another ``name_format``.
    """
    root = storage.path()
    if not storage.exists():
        return f"starting fresh at step 0: {root} does not exist yet", []
    listing = storage.list_dir()
    if not [info for info in listing if info.name != GENERATIONS_DIR]:
        said = f"starting fresh at step 0: {root} is empty"
    else:
        said = (f"starting fresh at step 0: {root} holds no committed checkpoint "
                f"({len(listing)} entries, none resumekit can resume from)")
    warnings: list[str] = []
    others = [e for e in found.entries
              if e.status not in ("committed", "foreign") and e.defect not in _REPORTED]
    if others:
        listed = "; ".join(f"{e.name} ({e.status}: {e.problem})" for e in others[-5:])
        reason = ""
        if any(e.status == "legacy" for e in others):
            reason = " (import_legacy=False)" if not import_legacy else \
                " (no model to load weights into)"
        warnings.append(f"starting fresh at step 0, but {root} holds entries that are not "
                        f"committed checkpoints{reason}: {listed}")
    named = other_name_checkpoints(storage, name_format)
    if named:
        warnings.append(
            f"starting fresh at step 0, but {root} holds checkpoints this manager's "
            f"name_format {name_format.template!r} does not match (e.g. {named[-1]!r}): "
            "pass the name_format they were written with")
    return said, warnings


def imported_warning(entry: CheckpointEntry, fresh: Sequence[str], *,
                     config_unrecorded: bool) -> str:
    """The one warning of a restore from a checkpoint ``resumekit import`` converted.

    Args:
        entry: The checkpoint restored.
        fresh: The parts of the state it does not hold, which start fresh (``"RNG"``,
            ``"data position"``, ...).
        config_unrecorded: It records no configuration although this run has one (so
            ``config=`` was not compared with it).
    """
    assert entry.manifest is not None
    manifest = entry.manifest
    source = (manifest.lineage.imported_from or {}).get("path", "another tool")
    unrecorded = "; it records no configuration, so config= is not compared with it" \
        if config_unrecorded else ""
    return (f"{entry.path} (step {manifest.step}) was converted by resumekit import "
            f"from {source}; it holds no {', '.join(fresh)} of that run, so "
            f"{'they start' if len(fresh) > 1 else 'it starts'} fresh (the weights, "
            "the step and what else it holds are restored): the run continues, but not "
            f"exactly as the source run would have{unrecorded}")
