"""The commit protocol, written down once.

A kill at any instant leaves either the previous newest checkpoint or the new one,
never a mix, and a directory without a valid manifest is never a checkpoint::

    begin (rank 0 decides, all ranks learn the outcome)
      1. the step must be newer than every committed step (or ``replace=True`` for an
         existing step): otherwise StepCollisionError, on every rank
      2. rank 0 creates the staging area and records its writer (host, pid)
         POSIX : <root>/.step_000001000.tmp-<token>/
         object: <root>/step_000001000/attempt-<token>/
    write (every rank writes its shards into the staging area)
    publish
      3. all-gather of the files each rank wrote, hashed and fsynced while writing
         them, and of the files the data references (DCP's .metadata); it doubles as
         the barrier: every writer has finished. The reports are the file list: rank 0
         fails the commit (IncompleteCheckpointError naming step and file) for a
         referenced file no rank reported, and for a reported file that is not in the
         store (looked up by name when a listing misses it) or has another size
      4. every rank hashes and fsyncs its share of the files nobody reported (found by
         listing; a second all-gather shares those entries, skipped by every rank alike
         when rank 0 found none); rank 0 writes manifest.json (durable), then removes
         the writer record (POSIX: a staging area holding neither is a crashed writer's),
         fsyncs the staging directory
      5. POSIX : rename staging -> step_000001000 (the commit point), fsync the root (a
                 failure from here on is a warning that the step IS committed, its
                 durability unconfirmed: never a failed save, whose retry would collide);
                 replacing an existing step swaps the two atomically (RENAME_EXCHANGE);
                 without it, two renames: step -> .step_....old-<token>, staging -> step
                 (a crash between them is undone: ``recover_interrupted``), then, once
                 the root's fsync succeeded, the retired copy loses its manifest
                 (fsynced) before its files go, so that a crash inside its deletion
                 never leaves a half-deleted directory that still looks restorable (the
                 next begin or prune finishes such a deletion)
         object: create step_000001000/manifest.json last, only if absent (the commit
                 point): S3 If-None-Match: *, so of two writers of a step one commits and
                 the other gets StepCollisionError; stores without conditional writes
                 check, then write (warned once per root: a one-round-trip race window)
      6. rank 0 removes what the new checkpoint replaced (kept when the root's fsync
         failed; a failure to remove it is a warning too); on S3 it writes the
         newest-step hint (<root>/.resumekit-generations/newest-step.json; after the
         commit point, a hint only: see "Finding the newest" below); all ranks learn the outcome
      7. POSIX, after retention (``record_newest``): rank 0 stamps the newest-step hint
         with the root's stat, taken before one listing, if the step is the highest step
         directory there (see "The stamped hint" below)
    abort: rank 0 removes the staging area (a crash leaves it for the sweep instead)

Writer generations (fencing). Every writer holds a generation of the root
(``resumekit.store.generations``): a manager claims the next one when it restores (or, if it
never restored, at its first ``begin``); records live in ``<root>/.resumekit-generations/``.
Two managers of one SLURM allocation (same ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT``)
share a generation; an older restart of a job cannot claim after a newer one did. The rule:

    a writer commits only while its generation is the newest claim of the root.

  - checked in step 1 (before anything is written or swept), and again in step 5
    immediately before the commit point (after the manifest is durable, before the
    rename / the object-store manifest write); a fenced writer gets FencedWriterError
    naming both generations and its staging area is removed: nothing of the newer run
    is touched;
  - the one window left is between that last check (two small reads) and the rename:
    a claim landing inside it lets a fenced writer's checkpoint appear. Restore never
    chooses such a checkpoint (``generations.zombie_commits``: an older generation's
    checkpoint with a step above the newest step the newer claim saw), and ``begin``
    neither counts it as the newest step nor suggests ``replace=True`` over it;
  - the manifest records the generation that committed it.

Before a save writes (step 2), rank 0 sweeps staging areas whose writer is provably dead:
on this host with its pid gone, or of a fenced generation (read from its writer record,
else from its manifest), or cut while writing its manifest (files, but neither a writer
record nor a valid manifest), and retired copies that lost their manifest (a deletion cut
part-way); writers on other hosts are left to retention's age rule, which measures age on
the storage's own clock. Each sweep is logged and warned about, naming the directory.

Finding the newest (what begin, restore, ``latest()`` and retention read). The commit
marker is the truth: a step directory is a checkpoint exactly when its manifest validates.
To find the newest one nobody reads every manifest: one listing of the root, then the
manifests from the highest-numbered step directory down until one validates
(``catalog.read_top``); everything above it (unfinished saves, broken or fenced writers'
directories) is what begin sweeps and restore reports. On S3 the listing may start at the
newest-step hint (``ListObjectsV2`` ``StartAfter``): every name after it is listed and the
hint's own manifest is read, so a hint that lags (a crash after the commit point, before
the hint) only lists more, and one that names a step that is not committed (deleted, never
committed) falls back to the full listing; it is never taken over a manifest. The
manager's retention after a save (``prune(scope="top")``) decides from names and reads the
manifests from the top down to the lowest step it would delete; it deletes only what a
manifest read then says is committed.

The stamped hint (POSIX roots: ``catalog.write_stamped_hint``, ``catalog._newest_from_stamp``).
``latest()`` (``catalog.newest_committed`` without a listing) does not list a local root
while the root directory's stat (``Storage.root_stamp``: st_dev, st_ino, st_mtime_ns,
st_ctime_ns, st_nlink) still equals the stamp in the hint, st_nlink >= 2, the hint's
generation is the root's newest and the hinted manifest validates (and is not a fenced
writer's); anything else lists, with the same answer. The writer takes the stamp first,
then lists the root once, and writes the hint only when the step it committed is the
highest step directory of that listing, after the save's own prune (so the stamp includes
its deletions). The reader stats the root before it reads the hint. Every resumekit
operation that creates, removes or renames entries of the root removes the hint first
(``catalog.forget_newest_hint``): ``begin`` before it sweeps and stages, ``prune`` before
each deletion or sweep, ``set_aside`` and ``recover_interrupted`` before they rename; a
crash anywhere after that leaves no hint. So resumekit's own changes never depend on
timestamps. Caveat: directory timestamps are coarse on Linux before 6.13 (one tick, 1-4 ms);
a change by something that is not a resumekit writer within the same tick as the writer's
stamp (a hand rename giving a committed directory a higher step name) can go unseen by
``latest()`` until the next save; a hand copy or deletion of a directory changes st_nlink
and is always seen. ``restore()`` always lists the whole root.

Retention (``resumekit.store.retention``) runs only after publish; its failures do not undo the
commit (the manager reports them as warnings on every rank).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from resumekit.errors import (
    CorruptCheckpointError,
    FencedWriterError,
    IncompleteCheckpointError,
    StepCollisionError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store import generations
from resumekit.store.catalog import (
    BROKEN,
    CheckpointEntry,
    Listing,
    RootTop,
    classify_step,
    forget_newest_hint,
    list_root,
    read_manifest,
    read_top,
    verify_checkpoint,
    write_newest_hint,
    write_stamped_hint,
)
from resumekit.store.coordination import Coordinator, SingleProcess, run_on_leader
from resumekit.store.layout import ATTEMPT_PREFIX, MANIFEST_NAME, WRITER_FILE, NameFormat
from resumekit.store.manifest import (
    FileEntry,
    Manifest,
    WriterGeneration,
    checksum_chunks,
)
from resumekit.store.storage import RECORD_LIMIT, Storage
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "WRITER_FILE",
    "CommitProtocol",
    "PendingCheckpoint",
    "cut_short_reason",
    "dead_writer_reason",
    "pid_gone",
    "read_writer",
    "recover_interrupted",
    "set_aside",
    "staging_areas",
    "sweep_dead_writers",
    "writer_of",
]

logger = logging.getLogger("resumekit")

#: Test hook: called with the name of each protocol phase as it starts (crash tests).
PhaseHook = Callable[[str], None]


@dataclass(frozen=True)
class PendingCheckpoint:
    """A save between ``begin`` and ``publish``.

    Attributes:
        step: The step being saved.
        name: The final directory name.
        staging: Where ranks write, relative to the root.
        token: Unique token of this attempt.
        replaces: True when an existing committed checkpoint of this step is replaced.
        data_dir: Data directory relative to the final directory (``"."`` on POSIX).
        generation: The writer generation that began it (checked again at publish).
    """

    step: int
    name: str
    staging: str
    token: str
    replaces: bool
    data_dir: str
    generation: WriterGeneration | None = None


class CommitProtocol:
    """Stage, write, describe and publish checkpoints atomically under one root.

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        coordinator: The ranks taking part (default: this process alone).
        on_phase: Test hook called with each phase name (``"stage"``, ``"hash"``,
            ``"manifest"``, ``"publish"``, ``"cleanup"``).
        fence: The writer generation this protocol commits as, shared between protocols
            of one writer (default: its own, claimed at the first ``begin``).

    Example:
        >>> import tempfile
        >>> protocol = CommitProtocol(Storage(tempfile.mkdtemp()))
        >>> pending = protocol.begin(100)
        >>> protocol.storage.write_bytes(f"{pending.staging}/weights.bin", b"0123")
        >>> protocol.publish(pending, Manifest(step=100)).files[0].path
        'weights.bin'
    """

    def __init__(
        self,
        storage: Storage,
        name_format: NameFormat | None = None,
        coordinator: Coordinator | None = None,
        *,
        on_phase: PhaseHook | None = None,
        fence: generations.Fence | None = None,
    ) -> None:
        self.storage = storage
        self.name_format = name_format or NameFormat()
        self.coordinator: Coordinator = coordinator or SingleProcess()
        self._on_phase = on_phase
        self.fence = fence or generations.Fence()

    def _phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    # -- generations ------------------------------------------------------------------
    def claim(self, *, if_root_exists: bool = False
              ) -> tuple[WriterGeneration | None, dict[str, str]]:
        """Claim the root's next writer generation for this writer (every rank calls it).

        Keeps the claim already held while it is still the newest. Returns the generation
        and ``{name: reason}`` of committed checkpoints that fenced writers committed
        (never to be restored from).

        Args:
            if_root_exists: Claim nothing (return ``(None, {})``) when the root does not
                exist yet: the first ``begin`` claims it.

        Raises:
            FencedWriterError: The claim held is fenced, or a newer restart of this SLURM
                job already claimed the root.
            StorageError: The root cannot be written.
        """

        def on_leader() -> tuple[WriterGeneration | None, dict[str, str]]:
            if if_root_exists and not self.storage.is_dir():
                return None, {}
            generation, zombies, _, _ = self._claim_on_leader("restore")
            return generation, zombies

        result: tuple[WriterGeneration | None, dict[str, str]] = run_on_leader(
            self.coordinator, on_leader)
        if result[0] is not None:
            self.fence.generation = result[0]
        return result

    def fenced_commits(self, entries: Sequence[CheckpointEntry]) -> dict[str, str]:
        """Return ``{name: reason}`` of ``entries`` that fenced writers committed.

        Claims nothing: for readers that must not take the root over (call on the leader).
        """
        return generations.zombie_commits(entries, generations.newest_generation(self.storage))

    def _claim_on_leader(self, action: str, step: int | None = None, *, claim: bool = True
                         ) -> tuple[WriterGeneration | None, dict[str, str], RootTop,
                                    WriterGeneration | None]:
        """Check this writer's claim, or make one (``claim``; else only look).

        Returns the claim (None when none is held and ``claim`` is False), the fenced
        writers' commits found above the newest checkpoint (by the root's newest
        generation), the top of the root (:func:`~resumekit.store.catalog.read_top`: one
        listing, then manifests from the highest step down to the newest checkpoint a
        writer that was not fenced committed) and the generation fenced writers' commits
        are judged by (the claim held, else the root's newest).
        """
        held = self.fence.generation
        if held is not None:
            generations.check(self.storage, held, action=action, step=step)
        reference = held if held is not None else generations.newest_generation(self.storage)
        top = self._read_top(reference)
        zombies = self._zombies_in(top, reference)
        if held is not None:
            return held, zombies, top, reference
        if not claim:
            return None, zombies, top, reference
        return self._claim_now(top), zombies, top, reference

    def _read_top(self, reference: WriterGeneration | None) -> RootTop:
        """Read the top of the root, after undoing an interrupted replacement (POSIX)."""
        listing = list_root(self.storage)
        if recover_interrupted(self.storage, self.name_format, listing=listing):
            listing = list_root(self.storage)

        def fenced(entry: CheckpointEntry) -> bool:
            return entry.manifest is not None and \
                generations.zombie_reason(entry.manifest, reference) is not None

        return read_top(self.storage, self.name_format, skip=fenced, listing=listing)

    @staticmethod
    def _zombies_in(top: RootTop, reference: WriterGeneration | None) -> dict[str, str]:
        return generations.zombie_commits(top.above, reference)

    def _claim_now(self, top: RootTop) -> WriterGeneration:
        self.storage.make_dirs()
        newest = top.newest.step if top.newest is not None else None
        claimed = generations.claim(self.storage, newest_step=newest)
        self.fence.generation = claimed
        return claimed

    # -- 1-2: begin -------------------------------------------------------------------
    def begin(self, step: int, *, replace: bool = False,
              active_tokens: Collection[str] = ()) -> PendingCheckpoint:
        """Check the writer is not fenced and the step is new, then create the staging area.

        Staging areas of provably dead writers are swept first (with a warning each), so a
        full disk left by a crash does not fail this save.

        Args:
            step: The step to save.
            replace: Atomically replace an existing committed checkpoint of ``step``.
            active_tokens: Tokens of this writer's saves in flight (never swept).

        Raises:
            FencedWriterError: A newer writer generation has claimed the root.
            StepCollisionError: ``step`` is not newer than the newest committed step
                (and not an explicit replacement of an existing one).
            StorageError: The root is a file or cannot be written.
        """
        token = secrets.token_hex(6)
        pending: PendingCheckpoint = run_on_leader(
            self.coordinator,
            lambda: self._begin_on_leader(step, token, replace, active_tokens))
        self.fence.generation = pending.generation
        return pending

    def _begin_on_leader(self, step: int, token: str, replace: bool,
                         active_tokens: Collection[str] = ()) -> PendingCheckpoint:
        self._phase("stage")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.storage.make_dirs()
        held, zombies, top, reference = self._claim_on_leader(
            f"begin saving step {step}", step, claim=False)
        name = self.name_format.build(step)
        extra = self._entry_below_the_top(step, name, top, reference, zombies)
        replaces = self._refuse_unless_free(step, name, top, extra=extra, zombies=zombies,
                                            replace=replace)
        # A writer that never restored claims the root now, as its first save starts
        # (not on a save refused above: that one neither restored nor committed).
        generation = held or self._claim_now(top)
        forget_newest_hint(self.storage)  # before the sweep and the staging change the root
        # The sweep looks at the top of the root (where a crashed or fenced writer's
        # staging is: its step was newer than every committed one), not at every entry.
        sweep_dead_writers(self.storage, [*top.entries(), *([extra] if extra else [])],
                           generation, active_tokens=active_tokens)
        return self._stage(step, name, token, replaces, generation)

    def _entry_below_the_top(self, step: int, name: str, top: RootTop,
                             reference: WriterGeneration | None, zombies: dict[str, str]
                             ) -> CheckpointEntry | None:
        """The entry ``name`` when it exists below the top read (its manifest read alone).

        A fenced writer's commit there joins ``zombies``.
        """
        known = {entry.name for entry in top.entries()}
        if name not in top.names or name in known:
            return None
        extra = classify_step(self.storage, step, self.name_format)
        if extra.manifest is not None and extra.status == "committed":
            reason = generations.zombie_reason(extra.manifest, reference)
            if reason is not None:
                zombies[name] = reason
        return extra

    def _refuse_unless_free(self, step: int, name: str, top: RootTop, *,
                            extra: CheckpointEntry | None, zombies: dict[str, str],
                            replace: bool) -> bool:
        """Raise unless ``step`` may be saved now; return whether it replaces a commit.

        Raises:
            StepCollisionError: A fenced writer's commit holds the step (and ``replace``
                is not set), the step is not above the newest committed one (and is not
                replaced), or a directory that is not a checkpoint holds its name.
        """
        newest = top.newest.step if top.newest is not None else None
        known = {entry.name: entry for entry in top.entries()}
        own = known.get(name, extra)
        replaces = own is not None and own.status == "committed" and name not in zombies
        if name in zombies and not replace:
            raise StepCollisionError(
                f"cannot save step {step}: {self.storage.path(name)} was {zombies[name]}. "
                "This run never resumes from it; move it out of the root to save this "
                "step (it is not replaced automatically)",
                step=step, newest=newest, path=self.storage.path(name),
            )
        replaces = replaces or name in zombies
        if newest is not None and step <= newest and not (replace and replaces):
            hint = (" (pass replace=True to replace it atomically)" if replaces else
                    "; steps only ever increase: prune newer checkpoints first to go back")
            raise StepCollisionError(
                f"cannot save step {step} under {self.storage.path()}: the newest committed "
                f"checkpoint is step {newest}{hint}",
                step=step, newest=newest, path=self.storage.path(),
            )
        if self.storage.atomic_rename and not replaces and name in top.names:
            raise StepCollisionError(
                f"cannot save step {step}: {self.storage.path(name)} already exists and is "
                "not a committed checkpoint ("
                + (own.problem if own is not None and own.defect == "symlink" and own.problem
                   else "a weights-only legacy or foreign directory")
                + "); move it out of the root first",
                step=step, newest=newest, path=self.storage.path(name),
            )
        return replaces

    def _stage(self, step: int, name: str, token: str, replaces: bool,
               generation: WriterGeneration) -> PendingCheckpoint:
        """Create the staging area of ``step`` and its writer record."""
        if self.storage.atomic_rename:
            staging = self.name_format.staging_name(step, token)
            data_dir = "."
            self.storage.make_dir_exclusive(staging)
        else:
            data_dir = f"{ATTEMPT_PREFIX}{token}"
            staging = f"{name}/{data_dir}"
        writer = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                  "step": step, "started": time.time(),
                  "generation": generation.number, "generation_token": generation.token}
        self.storage.write_bytes(f"{staging}/{WRITER_FILE}", json.dumps(writer).encode())
        return PendingCheckpoint(step, name, staging, token, replaces, data_dir, generation)

    def record_newest(self, pending: PendingCheckpoint) -> bool:
        """Stamp the newest-step hint of a local root after ``pending`` committed (rank 0).

        Call after the commit and after whatever the save then deletes (retention), so
        that the stamp is the root's stat with those deletions: the hint is written only
        when ``pending``'s step is the root's highest step directory
        (:func:`~resumekit.store.catalog.write_stamped_hint`). Object stores get their hint at
        the commit instead. A failure is a warning, never the save's failure.

        Returns:
            Whether a stamped hint was written (False on other ranks).
        """
        if self.coordinator.rank != 0 or pending.generation is None:
            return False
        return write_stamped_hint(self.storage, self.name_format, pending.step,
                                  pending.generation.number)

    def staging_url(self, pending: PendingCheckpoint) -> str:
        """Return the path/URL data writers (e.g. DCP) should write into."""
        return self.storage.url_of(pending.staging)

    # -- 3-6: publish -----------------------------------------------------------------
    def publish(self, pending: PendingCheckpoint, manifest: Manifest, *,
                described: Sequence[FileEntry] = (),
                required: Sequence[str] = ()) -> Manifest:
        """Describe the staged files and commit them as checkpoint ``pending.step``.

        Every rank must call it once its writes are done. ``manifest`` supplies the
        metadata (reason, lineage, extras, ...); its file list, step and data directory
        are filled in here.

        What the ranks report is authoritative: every file a rank described is listed in
        the manifest, checked against the store (a file a directory listing misses is
        looked up by name; one that is not there, or has another size, fails the
        commit). Files no rank described (callers that write through :class:`Storage`
        directly) are found by listing the staging area and hashed here.

        Args:
            pending: What :meth:`begin` returned.
            manifest: The metadata to commit.
            described: Files this rank wrote and already hashed and fsynced while writing
                them (paths relative to the staging directory). They are not read again.
            required: Files the written data cannot load without (for DCP: every file
                its ``.metadata`` references). Each must be described by some rank.

        Returns:
            The manifest as committed.

        Raises:
            IncompleteCheckpointError: A required file no rank described, or a described
                file missing from the store or of another size; nothing is committed.
            StepCollisionError: Another writer committed this step first (on object stores
                the conditional commit marker, on POSIX the rename, tells).
        """
        reports = self.coordinator.all_gather((list(described), list(required)))
        self._phase("hash")
        known, unknown = run_on_leader(
            self.coordinator, lambda: self._reconcile(pending, reports))
        # Every rank learnt the same ``unknown`` from the leader: when the ranks described
        # every file (resumekit's own writers always do) there is nothing to share.
        gathered: list[list[FileEntry]] = []
        if unknown:
            mine = [
                self._describe_file(pending, path)
                for index, path in enumerate(unknown)
                if index % self.coordinator.world_size == self.coordinator.rank
            ]
            gathered = self.coordinator.all_gather(mine)
        files = sorted([entry for part in gathered for entry in part] + list(known),
                       key=lambda e: e.path)
        final = manifest.model_copy(update={
            "step": pending.step, "files": files, "data_dir": pending.data_dir,
            "world_size": max(manifest.world_size, 1), "generation": pending.generation,
            "created_at": datetime.now(timezone.utc),  # publication, not capture
        })
        committed, doubt = run_on_leader(self.coordinator,
                                         lambda: self._publish_on_leader(pending, final))
        if doubt is not None:  # after the commit point: the step is committed
            warn(doubt, ResumekitWarning, stacklevel=2)
        result: Manifest = committed
        return result

    def _reconcile(self, pending: PendingCheckpoint,
                   reports: Sequence[tuple[Sequence[FileEntry], Sequence[str]]]
                   ) -> tuple[list[FileEntry], list[str]]:
        """Check the ranks' reports against each other and the store (rank 0).

        Returns the described entries and the staged files nobody described.
        """
        known: dict[str, tuple[int, FileEntry]] = {}
        for rank, (entries, _) in enumerate(reports):
            for entry in entries:
                other = known.get(entry.path)
                if other is not None and other[1] != entry:
                    raise self._incomplete(
                        pending, entry.path,
                        f"ranks {other[0]} and {rank} both report writing it, differently")
                known[entry.path] = (rank, entry)
        for path in sorted({path for _, paths in reports for path in paths} - set(known)):
            raise self._incomplete(pending, path, "the checkpoint's data references it but "
                                   "no rank reported writing it")
        listing = {path: size for path, size in self.storage.walk_files(pending.staging)
                   if path != WRITER_FILE}
        for path, (rank, entry) in sorted(known.items()):
            size = listing.get(path)
            if size is None:
                size = self._size_or_none(f"{pending.staging}/{path}")
                if size is None:
                    raise self._incomplete(pending, path, f"rank {rank} reported writing it "
                                           f"({entry.size} bytes) but it is not in the store")
                message = (f"resumekit: the listing of {self.storage.path(pending.staging)} "
                           f"missed {path}, which rank {rank} wrote; found by name "
                           f"({size} bytes) and committed (a stale directory cache?)")
                warn(message, ResumekitWarning, stacklevel=5)
            if size != entry.size:
                raise self._incomplete(pending, path, f"rank {rank} wrote {entry.size} "
                                       f"bytes but the store holds {size}")
        unknown = sorted(path for path in listing if path not in known)
        return [entry for _, entry in known.values()], unknown

    def _size_or_none(self, relative: str) -> int | None:
        try:
            return self.storage.size(relative)
        except FileNotFoundError:
            return None

    def _incomplete(self, pending: PendingCheckpoint, path: str, reason: str
                    ) -> IncompleteCheckpointError:
        where = self.storage.path(f"{pending.staging}/{path}")
        return IncompleteCheckpointError(
            f"cannot commit step {pending.step}: {path} ({where}): {reason}; nothing was "
            "committed", path=where, file=path, step=pending.step)

    def _describe_file(self, pending: PendingCheckpoint, path: str) -> FileEntry:
        relative = f"{pending.staging}/{path}"
        size = 0

        def chunks():  # type: ignore[no-untyped-def]
            nonlocal size
            for chunk in self.storage.iter_chunks(relative):
                size += len(chunk)
                yield chunk

        checksum = checksum_chunks(chunks())
        self.storage.fsync_file(relative)
        return FileEntry(path=path, size=size, checksum=checksum)

    def _publish_on_leader(self, pending: PendingCheckpoint, manifest: Manifest
                           ) -> tuple[Manifest, str | None]:
        """Write the manifest and commit (rank 0).

        Returns the manifest and, when something after the commit point failed (the
        fsync of the root, removing a replaced copy), what: the step is committed then.
        """
        self._phase("manifest")
        storage = self.storage
        self._check_fence(pending)  # before the manifest: a fenced writer describes nothing
        if storage.atomic_rename:
            # The writer record goes only once the manifest is whole: staging without
            # either (data, or a cut manifest) is then provably a crashed writer's.
            storage.write_bytes(f"{pending.staging}/{MANIFEST_NAME}", manifest.to_json(),
                                durable=True)
            storage.remove_file(f"{pending.staging}/{WRITER_FILE}")
            for directory in _directories_of(manifest):
                storage.fsync_dir(f"{pending.staging}/{directory}")
            storage.fsync_dir(pending.staging)
            self._check_fence(pending)  # the last check: the race window starts here
            self._phase("publish")
            retired = None
            if pending.replaces:
                retired = self._swap_in(pending)
            else:
                try:
                    storage.rename_dir(pending.staging, pending.name)
                except StorageError:
                    if not storage.exists(pending.name):
                        raise
                    raise self._collision(pending) from None  # a writer of this generation
            return manifest, self._after_rename(pending, retired)
        storage.remove_file(f"{pending.staging}/{WRITER_FILE}")
        previous = read_manifest(storage, pending.name) if pending.replaces else None
        self._check_fence(pending)  # the last check: the race window starts here
        self._phase("publish")
        if pending.replaces:
            storage.write_bytes(f"{pending.name}/{MANIFEST_NAME}", manifest.to_json())
        else:
            self._create_commit_marker(pending, manifest)
        self._phase("cleanup")
        if not pending.replaces:  # a hint, after the commit point (see catalog)
            write_newest_hint(storage, self.name_format, pending.step)
        if previous is not None and previous.data_dir not in (".", manifest.data_dir):
            old_data = f"{pending.name}/{previous.data_dir}"
            try:
                storage.remove_tree(old_data)
            except OSError as error:
                return manifest, (
                    f"step {pending.step} is committed as {storage.path(pending.name)}, but "
                    f"the replaced copy's data {storage.path(old_data)} could not be "
                    f"removed: {error}; the sweep of abandoned attempts removes it later")
        return manifest, None

    def _after_rename(self, pending: PendingCheckpoint, retired: str | None) -> str | None:
        """Make the commit durable and remove what it replaced (POSIX, after the rename).

        The step is committed once renamed: a failure here is returned as what to warn
        about (never raised as a failed save, which would say nothing was committed and
        send the caller to save a step that now exists). When the root's fsync fails,
        the replaced copy is kept (the sweeps remove it once the root is durable).

        Args:
            pending: The save just committed.
            retired: The replaced copy's retired name (two-rename replacement), else None
                (an exchange left the replaced copy at the staging name).
        """
        storage = self.storage
        where = storage.path(pending.name)
        leftover = retired if retired is not None else pending.staging
        try:
            storage.fsync_dir()
        except OSError as error:
            kept = (f"; the replaced copy stays in {storage.path(leftover)} until a later "
                    "save or prune removes it") if pending.replaces else ""
            return (f"step {pending.step} IS committed as {where} (renamed into place), but "
                    f"its durability could not be confirmed: the fsync of the root "
                    f"{storage.path()} failed: {error}. It can be restored and a save of "
                    f"step {pending.step} again collides with it; a power loss before the "
                    f"root's next successful fsync (the next save's) could undo it, "
                    f"leaving the previous newest checkpoint{kept}")
        self._phase("cleanup")
        try:
            if retired is not None:
                _remove_retired(storage, retired)
            else:
                storage.remove_tree(pending.staging)  # after a swap: the replaced checkpoint
        except OSError as error:
            return (f"step {pending.step} is committed as {where}, but the copy it replaced "
                    f"could not be removed from {storage.path(leftover)}: {error}; the next "
                    "save or prune removes it")
        return None

    def _create_commit_marker(self, pending: PendingCheckpoint, manifest: Manifest) -> None:
        """Write ``<name>/manifest.json`` only if no other writer has (object stores).

        S3 creates it conditionally (``If-None-Match: *``): of two writers publishing
        the same step, exactly one commits. Stores without conditional writes get a
        check-then-write (warned about once per root).
        """
        storage = self.storage
        marker = f"{pending.name}/{MANIFEST_NAME}"
        if not storage.conditional_create:
            _warn_weak_commit(storage)
        try:
            storage.write_bytes_exclusive(marker, manifest.to_json())
        except FileExistsError:
            raise self._collision(pending) from None

    def _collision(self, pending: PendingCheckpoint) -> StepCollisionError:
        """The error of a commit another writer beat to ``pending``'s step directory."""
        storage = self.storage
        winner = ""
        try:
            other = read_manifest(storage, pending.name)
            winner = (f" (by {other.lineage.hostname} pid {other.lineage.pid}, data in "
                      f"{other.data_dir})")
        except Exception:  # noqa: BLE001 - only detail for the message
            pass
        return StepCollisionError(
            f"cannot commit step {pending.step}: another writer committed "
            f"{storage.path(pending.name)} first{winner}; this save's data in "
            f"{storage.path(pending.staging)} is not committed",
            step=pending.step, newest=pending.step, path=storage.path(pending.name),
        )

    def _check_fence(self, pending: PendingCheckpoint) -> None:
        """Refuse the commit of a fenced writer, removing its staging area (rank 0)."""
        if pending.generation is None:
            return
        try:
            generations.check(self.storage, pending.generation,
                              action=f"commit step {pending.step}", step=pending.step)
        except Exception as error:
            why = ("a fenced writer's" if isinstance(error, FencedWriterError)
                   else "the fence could not be checked (not fenced), so this")
            logger.warning("resumekit: %s save of step %d is abandoned; "
                           "removing its staging area %s", why, pending.step,
                           self.storage.path(pending.staging))
            self.storage.remove_tree(pending.staging)
            raise

    def _swap_in(self, pending: PendingCheckpoint) -> str | None:
        """Put the staging area in place of the step's committed copy (the commit point).

        Returns the retired name of the replaced copy when two renames did it (removed
        by the caller), None after an exchange (the replaced copy is at the staging name).
        """
        try:
            self.storage.exchange_dirs(pending.staging, pending.name)
            return None
        except StorageError:
            pass
        # No RENAME_EXCHANGE on this filesystem: retire the old directory, then rename.
        # A crash between the two renames is undone by recover_interrupted().
        retired = self.name_format.retired_name(pending.step, pending.token)
        self.storage.rename_dir(pending.name, retired)
        self.storage.rename_dir(pending.staging, pending.name)
        return retired

    def abort(self, pending: PendingCheckpoint) -> None:
        """Remove the staging area of a save that will not be published (rank 0 only)."""
        if self.coordinator.rank == 0:
            self.storage.remove_tree(pending.staging)
            if not self.storage.atomic_rename and not pending.replaces and not any(
                info.name != pending.data_dir for info in self.storage.list_dir(pending.name)
            ):
                self.storage.remove_tree(pending.name)


_WEAK_COMMIT_WARNED: set[str] = set()


def _warn_weak_commit(storage: Storage) -> None:
    """Say once per root that its commit marker is check-then-write, not atomic."""
    if storage.url in _WEAK_COMMIT_WARNED:
        return
    _WEAK_COMMIT_WARNED.add(storage.url)
    message = (
        f"resumekit: {storage.url} has no conditional create (If-None-Match); a commit "
        "marker is checked for, then written, so two writers publishing the same step "
        "within one round trip of each other can both succeed (the later manifest wins). "
        "Use a local/NAS path or s3:// for an atomic commit"
    )
    warn(message, ResumekitWarning, stacklevel=4)


def _directories_of(manifest: Manifest) -> set[str]:
    directories = set()
    for entry in manifest.files:
        parts = entry.path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directories.add("/".join(parts[:depth]))
    return directories


def _remove_retired(storage: Storage, retired: str) -> None:
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
        _remove_retired(storage, name)
    except OSError as error:
        message = f"cannot delete {where} ({reason}): {error}"
    else:
        message = f"deleted {where}: {reason}"
    warn(message, ResumekitWarning, stacklevel=3)


def set_aside(storage: Storage, name_format: NameFormat, entry: CheckpointEntry
              ) -> tuple[str | None, str | None]:
    """Rename a step directory that cannot be restored to a hidden ``.bad-`` name.

    Nothing is deleted: the files stay for forensics, but the step no longer counts as
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
    aside = name_format.quarantine_name(entry.step, os.urandom(6).hex())
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
