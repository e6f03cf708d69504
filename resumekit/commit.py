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
      3. all-gather of the files each rank hashed and fsynced while writing them
         (it doubles as the barrier: every writer has finished)
      4. every rank hashes and fsyncs its share of the other files; rank 0 gathers
         the list, writes manifest.json (durable) and fsyncs the staging directory
      5. POSIX : rename staging -> step_000001000, fsync the root (the commit point);
                 replacing an existing step swaps the two atomically (RENAME_EXCHANGE)
         object: write step_000001000/manifest.json last (the commit point)
      6. rank 0 removes what the new checkpoint replaced; all ranks learn the outcome
    abort: rank 0 removes the staging area (a crash leaves it for the sweep instead)

Retention (``resumekit.retention``) runs only after publish.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from resumekit.catalog import list_checkpoints, read_manifest
from resumekit.coordination import Coordinator, SingleProcess, run_on_leader
from resumekit.errors import StepCollisionError, StorageError
from resumekit.layout import ATTEMPT_PREFIX, NameFormat
from resumekit.manifest import MANIFEST_NAME, FileEntry, Manifest, checksum_chunks
from resumekit.storage import Storage

__all__ = ["WRITER_FILE", "CommitProtocol", "PendingCheckpoint", "recover_interrupted"]

WRITER_FILE = ".writer.json"

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
    """

    step: int
    name: str
    staging: str
    token: str
    replaces: bool
    data_dir: str


class CommitProtocol:
    """Stage, write, describe and publish checkpoints atomically under one root.

    Args:
        storage: The checkpoint root.
        name_format: How step directories are named.
        coordinator: The ranks taking part (default: this process alone).
        on_phase: Test hook called with each phase name (``"stage"``, ``"hash"``,
            ``"manifest"``, ``"publish"``, ``"cleanup"``).

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
    ) -> None:
        self.storage = storage
        self.name_format = name_format or NameFormat()
        self.coordinator: Coordinator = coordinator or SingleProcess()
        self._on_phase = on_phase

    def _phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    # -- 1-2: begin -------------------------------------------------------------------
    def begin(self, step: int, *, replace: bool = False) -> PendingCheckpoint:
        """Check the step is new (or an explicit replacement) and create the staging area.

        Raises:
            StepCollisionError: ``step`` is not newer than the newest committed step
                (and not an explicit replacement of an existing one).
            StorageError: The root is a file or cannot be written.
        """
        token = secrets.token_hex(6)
        pending: PendingCheckpoint = run_on_leader(
            self.coordinator, lambda: self._begin_on_leader(step, token, replace)
        )
        return pending

    def _begin_on_leader(self, step: int, token: str, replace: bool) -> PendingCheckpoint:
        self._phase("stage")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.storage.make_dirs()
        recover_interrupted(self.storage, self.name_format)
        committed = [e.step for e in list_checkpoints(self.storage, self.name_format)
                     if e.status == "committed"]
        newest = max(committed, default=None)
        replaces = step in committed
        if newest is not None and step <= newest and not (replace and replaces):
            hint = (" (pass replace=True to replace it atomically)" if replaces else
                    "; steps only ever increase: prune newer checkpoints first to go back")
            raise StepCollisionError(
                f"cannot save step {step} under {self.storage.path()}: the newest committed "
                f"checkpoint is step {newest}{hint}",
                step=step, newest=newest, path=self.storage.path(),
            )
        name = self.name_format.build(step)
        if self.storage.atomic_rename and not replaces and self.storage.exists(name):
            raise StepCollisionError(
                f"cannot save step {step}: {self.storage.path(name)} already exists and is "
                "not a committed checkpoint (a weights-only legacy or foreign directory); "
                "move it out of the root first",
                step=step, newest=newest, path=self.storage.path(name),
            )
        if self.storage.atomic_rename:
            staging = self.name_format.staging_name(step, token)
            data_dir = "."
            self.storage.make_dir_exclusive(staging)
        else:
            data_dir = f"{ATTEMPT_PREFIX}{token}"
            staging = f"{name}/{data_dir}"
        writer = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                  "step": step, "started": time.time()}
        self.storage.write_bytes(f"{staging}/{WRITER_FILE}", json.dumps(writer).encode())
        return PendingCheckpoint(step, name, staging, token, replaces, data_dir)

    def staging_url(self, pending: PendingCheckpoint) -> str:
        """Return the path/URL data writers (e.g. DCP) should write into."""
        return self.storage.url_of(pending.staging)

    # -- 3-6: publish -----------------------------------------------------------------
    def publish(self, pending: PendingCheckpoint, manifest: Manifest, *,
                described: Sequence[FileEntry] = ()) -> Manifest:
        """Describe the staged files and commit them as checkpoint ``pending.step``.

        Every rank must call it once its writes are done. ``manifest`` supplies the
        metadata (reason, lineage, extras, ...); its file list, step and data directory
        are filled in here.

        Args:
            pending: What :meth:`begin` returned.
            manifest: The metadata to commit.
            described: Files this rank already hashed and fsynced while writing them
                (paths relative to the staging directory). They are not read again
                unless their size on disk differs; every other file is hashed here.

        Returns:
            The manifest as committed.
        """
        known = {entry.path: entry for part in self.coordinator.all_gather(list(described))
                 for entry in part}
        self._phase("hash")
        listing = run_on_leader(self.coordinator, lambda: [
            (path, size) for path, size in self.storage.walk_files(pending.staging)
            if path != WRITER_FILE
        ])
        unknown = [path for path, size in listing
                   if path not in known or known[path].size != size]
        mine = [
            self._describe_file(pending, path)
            for index, path in enumerate(unknown)
            if index % self.coordinator.world_size == self.coordinator.rank
        ]
        gathered = self.coordinator.all_gather(mine)
        trusted = {path for path, _ in listing} - set(unknown)
        files = sorted([entry for part in gathered for entry in part]
                       + [entry for path, entry in known.items() if path in trusted],
                       key=lambda e: e.path)
        final = manifest.model_copy(update={
            "step": pending.step, "files": files, "data_dir": pending.data_dir,
            "world_size": max(manifest.world_size, 1),
            "created_at": datetime.now(timezone.utc),  # publication, not capture
        })
        committed: Manifest = run_on_leader(self.coordinator,
                                            lambda: self._publish_on_leader(pending, final))
        return committed

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

    def _publish_on_leader(self, pending: PendingCheckpoint, manifest: Manifest) -> Manifest:
        self._phase("manifest")
        storage = self.storage
        storage.remove_file(f"{pending.staging}/{WRITER_FILE}")
        if storage.atomic_rename:
            storage.write_bytes(f"{pending.staging}/{MANIFEST_NAME}", manifest.to_json(),
                                durable=True)
            for directory in _directories_of(manifest):
                storage.fsync_dir(f"{pending.staging}/{directory}")
            storage.fsync_dir(pending.staging)
            self._phase("publish")
            if pending.replaces:
                self._swap_in(pending)
            else:
                storage.rename_dir(pending.staging, pending.name)
            storage.fsync_dir()
            self._phase("cleanup")
            storage.remove_tree(pending.staging)  # after a swap: the replaced checkpoint
            return manifest
        previous = read_manifest(storage, pending.name) if pending.replaces else None
        self._phase("publish")
        storage.write_bytes(f"{pending.name}/{MANIFEST_NAME}", manifest.to_json())
        self._phase("cleanup")
        if previous is not None and previous.data_dir not in (".", manifest.data_dir):
            storage.remove_tree(f"{pending.name}/{previous.data_dir}")
        return manifest

    def _swap_in(self, pending: PendingCheckpoint) -> None:
        try:
            self.storage.exchange_dirs(pending.staging, pending.name)
            return
        except StorageError:
            pass
        # No RENAME_EXCHANGE on this filesystem: retire the old directory, then rename.
        # A crash between the two renames is undone by recover_interrupted().
        retired = self.name_format.retired_name(pending.step, pending.token)
        self.storage.rename_dir(pending.name, retired)
        self.storage.rename_dir(pending.staging, pending.name)
        self.storage.remove_tree(retired)

    def abort(self, pending: PendingCheckpoint) -> None:
        """Remove the staging area of a save that will not be published (rank 0 only)."""
        if self.coordinator.rank == 0:
            self.storage.remove_tree(pending.staging)
            if not self.storage.atomic_rename and not pending.replaces and not any(
                info.name != pending.data_dir for info in self.storage.list_dir(pending.name)
            ):
                self.storage.remove_tree(pending.name)


def _directories_of(manifest: Manifest) -> set[str]:
    directories = set()
    for entry in manifest.files:
        parts = entry.path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            directories.add("/".join(parts[:depth]))
    return directories


def recover_interrupted(storage: Storage, name_format: NameFormat) -> list[str]:
    """Undo a replacement or deletion that a crash cut between its two renames.

    A hidden ``.<name>.old-<token>`` directory that still holds a valid manifest while
    ``<name>`` is absent is renamed back (the operation did not happen). Returns the names
    restored. Only POSIX roots can be in this state.
    """
    if not storage.atomic_rename or not storage.is_dir():
        return []
    restored = []
    names = {info.name for info in storage.list_dir()}
    for name in sorted(names):
        parsed = name_format.parse_hidden(name)
        if parsed is None or parsed[1].kind != "old" or parsed[1].name in names:
            continue
        try:
            read_manifest(storage, name)
        except Exception:  # noqa: BLE001 - not restorable: left for the sweep
            continue
        storage.rename_dir(name, parsed[1].name)
        restored.append(parsed[1].name)
    if restored:
        storage.fsync_dir()
    return restored
