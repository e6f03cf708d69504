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
      3. gather to rank 0 of the files each rank wrote, hashed and fsynced while
         writing them, and of the files the data references (DCP's .metadata), or of
         the rank's failed write; with rank 0's broadcast of the outcome (4 or 5) it
         doubles as the barrier: every writer has finished. The reports are the file
         list: rank 0 fails the commit (IncompleteCheckpointError naming step and file) for a
         referenced file no rank reported, and for a reported file that is not in the
         store (looked up by name when a listing misses it) or has another size
      4. every rank hashes and fsyncs its share of the files nobody reported (found by
         listing; a second gather sends those entries to rank 0, skipped by every rank
         alike when rank 0 found none); rank 0 writes manifest.json (durable), then removes
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
(``newest.read_top``); everything above it (unfinished saves, broken or fenced writers'
directories) is what begin sweeps and restore reports. On S3 the listing may start at the
newest-step hint (``ListObjectsV2`` ``StartAfter``): every name after it is listed and the
hint's own manifest is read, so a hint that lags (a crash after the commit point, before
the hint) only lists more, and one that names a step that is not committed (deleted, never
committed) falls back to the full listing; it is never taken over a manifest. The
manager's retention after a save (``prune(scope="top")``) decides from names and reads the
manifests from the top down to the lowest step it would delete; it deletes only what a
manifest read then says is committed.

The stamped hint (POSIX roots: ``newest.write_stamped_hint``, ``newest._newest_from_stamp``).
``latest()`` (``newest.newest_committed`` without a listing) does not list a local root
while the root directory's stat (``Storage.root_stamp``: st_dev, st_ino, st_mtime_ns,
st_ctime_ns, st_nlink) still equals the stamp in the hint, st_nlink >= 2, the hint's
generation is the root's newest and the hinted manifest validates (and is not a fenced
writer's); anything else lists, with the same answer. The writer takes the stamp first,
then lists the root once, and writes the hint only when the step it committed is the
highest step directory of that listing, after the save's own prune (so the stamp includes
its deletions). The reader stats the root before it reads the hint. Every resumekit
operation that creates, removes or renames entries of the root removes the hint first
(``newest.forget_newest_hint``): ``begin`` before it sweeps and stages, ``prune`` before
each deletion or sweep, ``set_aside`` and ``recover_interrupted`` before they rename; a
crash anywhere after that leaves no hint. So resumekit's own changes never depend on
timestamps. Caveat: directory timestamps are coarse on Linux before 6.13 (one tick, 1-4 ms);
a change by something that is not a resumekit writer within the same tick as the writer's
stamp (a hand rename giving a committed directory a higher step name) can go unseen by
``latest()`` until the next save; a hand copy or deletion of a directory changes st_nlink
and is always seen. ``restore()`` always lists the whole root.

Retention (``resumekit.store.retention``) runs only after publish; its failures do not undo the
commit (the manager reports them as warnings on every rank).

Where the rest lives: what a crash or a dead writer leaves (the retired copy between two
renames, staging areas, a step directory to set aside) is put right by
``resumekit.store.recovery``; finding the newest committed step and its hints by
``resumekit.store.newest``. This docstring stays the one description of the protocol.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from resumekit.errors import (
    FencedWriterError,
    IncompleteCheckpointError,
    StepCollisionError,
    StorageError,
)
from resumekit.store import generations
from resumekit.store.catalog import (
    CheckpointEntry,
    classify_step,
    list_root,
    read_manifest,
)
from resumekit.store.coordination import (
    Coordinator,
    SingleProcess,
    gather_outcomes,
    run_on_leader,
    values_or_failure,
)
from resumekit.store.layout import ATTEMPT_PREFIX, MANIFEST_NAME, WRITER_FILE, NameFormat
from resumekit.store.manifest import (
    FileEntry,
    Manifest,
    WriterGeneration,
    checksum_chunks,
)
from resumekit.store.newest import (
    RootTop,
    forget_newest_hint,
    read_top,
    write_newest_hint,
    write_stamped_hint,
)
from resumekit.store.recovery import recover_interrupted, remove_retired, sweep_dead_writers
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

# What the other layers use (WRITER_FILE: re-exported for code that imported it from here).
__all__ = [
    "WRITER_FILE",
    "CommitProtocol",
    "PendingCheckpoint",
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
    def claim(self, *, if_root_exists: bool = False, check_held: bool = True
              ) -> tuple[WriterGeneration | None, dict[str, str]]:
        """Claim the root's next writer generation for this writer (every rank calls it).

        Keeps the claim already held while it is still the newest. Returns the generation
        and ``{name: reason}`` of committed checkpoints that fenced writers committed
        (never to be restored from).

        Args:
            if_root_exists: Claim nothing (return ``(None, {})``) when the root does not
                exist yet: the first ``begin`` claims it.
            check_held: Check that a claim already held is not fenced (else it is
                returned as it is: the next ``begin`` checks it).

        Raises:
            FencedWriterError: The claim held is fenced, or a newer restart of this SLURM
                job already claimed the root.
            StorageError: The root cannot be written.
        """
        result: tuple[WriterGeneration | None, dict[str, str]] = run_on_leader(
            self.coordinator, lambda: self.claim_on_leader(if_root_exists=if_root_exists,
                                                           check_held=check_held))
        return self.take_claim(result)

    def claim_on_leader(self, *, if_root_exists: bool = False, check_held: bool = True
                        ) -> tuple[WriterGeneration | None, dict[str, str]]:
        """The leader's part of :meth:`claim` (call on the leader only; no collective).

        A restore runs it inside its survey's leader action, so one broadcast carries
        both; every rank then passes the result to :meth:`take_claim`.
        """
        if if_root_exists and not self.storage.is_dir():
            return None, {}
        generation, zombies, _, _ = self._claim_on_leader("restore", check=check_held)
        return generation, zombies

    def take_claim(self, result: tuple[WriterGeneration | None, dict[str, str]]
                   ) -> tuple[WriterGeneration | None, dict[str, str]]:
        """Hold the generation :meth:`claim_on_leader` claimed (every rank); return ``result``."""
        if result[0] is not None:
            self.fence.generation = result[0]
        return result

    def fenced_commits(self, entries: Sequence[CheckpointEntry]) -> dict[str, str]:
        """Return ``{name: reason}`` of ``entries`` that fenced writers committed.

        Claims nothing: for readers that must not take the root over (call on the leader).
        """
        return generations.zombie_commits(entries, generations.newest_generation(self.storage))

    def _claim_on_leader(self, action: str, step: int | None = None, *, claim: bool = True,
                         check: bool = True
                         ) -> tuple[WriterGeneration | None, dict[str, str], RootTop,
                                    WriterGeneration | None]:
        """Check this writer's claim (``check``), or make one (``claim``; else only look).

        Returns the claim (None when none is held and ``claim`` is False), the fenced
        writers' commits found above the newest checkpoint (by the root's newest
        generation), the top of the root (:func:`~resumekit.store.newest.read_top`: one
        listing, then manifests from the highest step down to the newest checkpoint a
        writer that was not fenced committed) and the generation fenced writers' commits
        are judged by (the claim held, else the root's newest).
        """
        with self.fence.lock:  # another channel's thread may be claiming: one claim
            held = self.fence.generation
            if held is not None and check:
                generations.check(self.storage, held, action=action, step=step)
            reference = (held if held is not None
                         else generations.newest_generation(self.storage))
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
        # The look and the claim are one step under the fence's lock: another channel's
        # thread claiming between them would claim a second generation, and the one set
        # here last would be fenced by the other (the process fencing itself).
        with self.fence.lock:
            held, zombies, top, reference = self._claim_on_leader(
                f"begin saving step {step}", step, claim=False)
            name = self.name_format.build(step)
            extra = self._entry_below_the_top(step, name, top, reference, zombies)
            replaces = self._refuse_unless_free(step, name, top, extra=extra,
                                                zombies=zombies, replace=replace)
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
        (:func:`~resumekit.store.newest.write_stamped_hint`). Object stores get their hint at
        the commit instead. A failure is a warning, never the save's failure.

        Returns:
            Whether a stamped hint was written (False on other ranks).
        """
        if self.coordinator.rank != 0 or pending.generation is None:
            return False
        return write_stamped_hint(self.storage, self.name_format, pending.step,
                                  pending.generation.number)

    # -- 3-6: publish -----------------------------------------------------------------
    def publish(self, pending: PendingCheckpoint, manifest: Manifest, *,
                described: Sequence[FileEntry] = (),
                required: Sequence[str] = (),
                failure: Exception | None = None) -> Manifest:
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
            failure: This rank's writes failed with it: the ranks' reports are gathered
                all the same (one gather to rank 0 carries the writes' outcome and the
                files), and the lowest failing rank's error is raised on every rank,
                nothing committed.

        Returns:
            The manifest as committed.

        Raises:
            IncompleteCheckpointError: A required file no rank described, or a described
                file missing from the store or of another size; nothing is committed.
            StepCollisionError: Another writer committed this step first (on object stores
                the conditional commit marker, on POSIX the rename, tells).
        """
        outcomes = gather_outcomes(self.coordinator, (list(described), list(required)),
                                   failure)
        self._phase("hash")

        def final_of(files: Sequence[FileEntry]) -> Manifest:
            return manifest.model_copy(update={
                "step": pending.step, "files": sorted(files, key=lambda e: e.path),
                "data_dir": pending.data_dir, "world_size": max(manifest.world_size, 1),
                "generation": pending.generation,
                "created_at": datetime.now(timezone.utc),  # publication, not capture
            })

        known: list[FileEntry] = []  # the leader's

        def reconcile_and_publish() -> tuple[list[str], tuple[Manifest, str | None] | None]:
            # Where the ranks described every file (resumekit's own writers always do),
            # the leader commits in the same step: one broadcast, and no rank is sent
            # the others' file lists. Otherwise every rank learns what to describe.
            assert outcomes is not None  # the leader's
            reports = values_or_failure(outcomes)  # a rank's failure: raised on every rank
            described_here, unknown = self._reconcile(pending, reports)
            known.extend(described_here)
            if unknown:
                return unknown, None
            return [], self._publish_on_leader(pending, final_of(known))

        unknown, outcome = run_on_leader(self.coordinator, reconcile_and_publish)
        if outcome is None:
            mine = [
                self._describe_file(pending, path)
                for index, path in enumerate(unknown)
                if index % self.coordinator.world_size == self.coordinator.rank
            ]
            parts = self.coordinator.gather(mine)  # the leader's: every rank's part

            def publish_described() -> tuple[Manifest, str | None]:
                assert parts is not None
                files = [entry for part in parts for entry in part] + list(known)
                return self._publish_on_leader(pending, final_of(files))

            outcome = run_on_leader(self.coordinator, publish_described)
        committed, doubt = outcome
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
                remove_retired(storage, retired)
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



def _warn_weak_commit(storage: Storage) -> None:
    """Say once per root (``Storage``) that its commit marker is check-then-write."""
    if storage.weak_commit_warned:
        return
    storage.weak_commit_warned = True
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

