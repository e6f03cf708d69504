"""Which rank checks which file of a checkpoint before it is loaded.

Restore checks every byte it loads against the manifest (``verify_on_restore``). The work
is split so that no rank reads a file twice and no rank waits long for the others:

1. ``tensors/.metadata`` is read and hashed first, on one rank (:func:`share_metadata`,
   group rank 0), and sent to the others over the checkpoint group: it holds the
   names of the raw tensor files (:mod:`resumekit.tensors.raw`), and every rank plans its
   reads from it, but the store serves it once per restore, not once per rank. Over a
   group, the other ranks receive its skeleton (every key's size, dtype and nesting),
   and each, when its load plans, the part its own shards need
   (:mod:`resumekit.tensors.metadata_parts`): a rank's restore cost does not grow with the
   number of ranks that wrote the checkpoint. A failure there (missing, wrong size or
   checksum, a link, an unsafe or unreadable pickle) is raised on every rank, naming the
   file, so all ranks fall back together. Where there is no group (a node-local copy
   read alone), each reader reads it itself;
2. those raw tensor files then only need the size the manifest records: every block is
   checked against its checksum while it is read (:func:`resumekit.tensors.load`);
3. every other file (the small ``.pt`` files, data files of DCP's own format) is hashed
   by exactly one rank: rank ``r`` of ``n`` takes the manifest's files ``r, r + n, ...``.

The checks themselves are :func:`resumekit.store.catalog.verify_checkpoint`'s. Without
``verify_on_restore`` each rank still ``lstat``-s its share of the files
(:func:`refuse_links_share`): nothing is ever read through a symbolic link.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from resumekit import tensors
from resumekit.errors import CorruptCheckpointError
from resumekit.store.catalog import (
    read_checked_file,
    read_checked_range,
    read_checked_ranges,
    refuse_links,
    verify_checkpoint,
)
from resumekit.store.coordination import Coordinator, run_on_leader
from resumekit.store.layout import DCP_METADATA_FILE, TENSORS_DIR
from resumekit.store.manifest import FileEntry, Manifest
from resumekit.store.storage import Storage

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
from resumekit.tensors import metadata_file

__all__ = ["METADATA_PATH", "PrereadMetadata", "preread_metadata", "refuse_links_share",
           "share_metadata", "verify_share"]

METADATA_PATH = f"{TENSORS_DIR}/{DCP_METADATA_FILE}"
"""The manifest's name of a checkpoint's DCP metadata."""


@dataclass(frozen=True)
class PrereadMetadata:
    """``.metadata`` of one step directory, read by the leader ahead of its restore.

    A restore's survey reads it on the leader with the root (the checkpoint it will try
    first) and its broadcast carries :attr:`outcome`, so that :func:`share_metadata` of
    that step needs no broadcast of its own.

    Attributes:
        name: The step directory.
        outcome: ``("ok", skeleton)`` (:meth:`~resumekit.tensors.CheckedMetadata.for_ranks`)
            or ``("error", error)``, the same on every rank; ``("ok", None)`` when the
            manifest lists no ``.metadata``.
        whole: The whole file, on the leader only (never sent).
    """

    name: str
    outcome: tuple[str, Any]
    whole: tensors.CheckedMetadata | None = None

    def for_ranks(self) -> PrereadMetadata:
        """What the leader sends: the same, without the whole file."""
        return PrereadMetadata(self.name, self.outcome)


_LAID_OUT_SCHEMA = 5
"""The first ``schema_version`` whose raw format lays ``.metadata`` out by rank."""
_FIRST_READ = 256 << 10
"""Bytes of ``.metadata`` read with its frame: a head that fits takes one read."""


def _damaged(storage: Storage, name: str, manifest: Manifest, entry: FileEntry,
             error: CorruptCheckpointError, *, rank: int | None = None
             ) -> CorruptCheckpointError:
    """A damaged piece of a ``.metadata`` laid out by rank, named as its whole file's damage."""
    where = storage.path(f"{name}/{manifest.data_path(entry.path)}")
    text = error.message.removeprefix(f"{where}: ")
    piece = "" if rank is None else f", rank {rank}'s part"
    return CorruptCheckpointError(
        f"{where} (step {manifest.step}{piece}): {text}",
        path=storage.path(name), file=entry.path, step=manifest.step, rank=rank)


def _read_for_ranks(storage: Storage, name: str, manifest: Manifest, entry: FileEntry, *,
                    verify: bool, for_group: bool) -> tensors.CheckedMetadata:
    """The leader's read of ``.metadata``: its head alone, or the whole file.

    The head alone where the file is laid out by rank
    (:mod:`resumekit.tensors.metadata_file`) and ``for_group``: other ranks restore
    with the leader (a group of two ranks or more; how many does not matter here, each
    reads its own part when its load plans). Otherwise, for a restore by one rank
    alone or of a file not laid out by rank, the whole file.

    The head and the leader's own part (writing rank 0's, which group rank 0 reads when
    its load plans) are read through one open of the file: the part's bytes are kept,
    and checked against the head's checksum only when the load asks for them, as every
    other rank's part is (:attr:`~resumekit.tensors.CheckedMetadata.read_part`).
    """
    source = storage.path(f"{name}/{manifest.data_path(METADATA_PATH)}")
    if (for_group and manifest.schema_version >= _LAID_OUT_SCHEMA
            and manifest.tensor_format != "dcp" and entry.size >= metadata_file.FRAME_BYTES):

        def read_head(pread: Callable[[int, int], bytes]
                      ) -> tuple[metadata_file.Head, bytes | None] | None:
            first = pread(0, min(entry.size, metadata_file.FRAME_BYTES + _FIRST_READ))
            if not metadata_file.is_framed(first):
                return None
            length, expected = metadata_file.read_head_length(first, source)
            end = metadata_file.FRAME_BYTES + length
            if end > entry.size:
                raise CorruptCheckpointError(
                    f"{source}: its head of {length} bytes lies past its end",
                    path=source, file=source)
            data = first[metadata_file.FRAME_BYTES:end] if end <= len(first) else (
                first[metadata_file.FRAME_BYTES:] + pread(len(first), end - len(first)))
            head = metadata_file.parse_head(data, expected, source)
            return head, _own_part(head, entry, first, pread)

        try:
            found = read_checked_ranges(storage, name, manifest, entry, read_head)
        except CorruptCheckpointError as error:
            raise _damaged(storage, name, manifest, entry, error) from None
        if found is not None:
            head, own = found
            checked = tensors.CheckedMetadata.from_head(head, source, entry.checksum)

            def read_whole() -> Metadata:
                data = read_checked_file(storage, name, manifest, entry, verify=verify)
                return tensors.CheckedMetadata.parse(data, source=source).parsed()

            checked.read_whole = read_whole
            checked.read_part = _part_reader(storage, name, manifest, entry, head=head,
                                             source=source,
                                             held={} if own is None else {0: own})
            return checked
    data = read_checked_file(storage, name, manifest, entry, verify=verify)
    return tensors.CheckedMetadata.parse(data, source=source)


def _own_part(head: metadata_file.Head, entry: FileEntry, first: bytes,
              pread: Callable[[int, int], bytes]) -> bytes | None:
    """Writing rank 0's part's bytes, read with the head (unchecked), or None.

    None where there is no part 0 or it does not lie in the file: its reader then tries
    it and names the fault (:func:`_part_reader`). A failed read is left to it too: it
    reads the part again when the load asks for it and reports what fails then, as
    before the head and the part shared an open.
    """
    if not head.parts:
        return None
    offset, length, _ = head.parts[0]
    start = head.base + offset
    if offset < 0 or length < 0 or start + length > entry.size:
        return None
    if start + length <= len(first):
        return first[start:start + length]
    try:
        return pread(start, length)
    except Exception:  # noqa: BLE001 - read again, and reported, when the load asks for it
        return None


def _part_reader(storage: Storage, name: str, manifest: Manifest, entry: FileEntry, *,
                 head: metadata_file.Head, source: str, held: Mapping[int, bytes]
                 ) -> Callable[[int], list[metadata_file.Row] | None]:
    """Reads, checks and parses writing rank ``r``'s part (None when it has none).

    ``held``: parts' bytes read already (the leader's own, read with the head): checked
    as those read now.
    """

    def read_part(rank: int) -> list[metadata_file.Row] | None:
        if rank >= len(head.parts):
            return None
        offset, length, checksum = head.parts[rank]
        try:
            data = held.get(rank)
            if data is None:
                if offset < 0 or head.base + offset + length > entry.size:
                    raise CorruptCheckpointError(
                        f"{source}: rank {rank}'s part lies past its end",
                        path=source, file=source, rank=rank)
                data = read_checked_range(storage, name, manifest, entry,
                                          start=head.base + offset, length=length)
            return metadata_file.parse_part(data, checksum, source, rank)
        except CorruptCheckpointError as error:
            raise _damaged(storage, name, manifest, entry, error, rank=rank) from None

    return read_part


def _with_parts(checked: tensors.CheckedMetadata | None, storage: Storage, name: str,
                manifest: Manifest, entry: FileEntry) -> tensors.CheckedMetadata | None:
    """``checked``, able to read its rank's part where only a head was read (every rank).

    The leader's reads them already (:func:`_read_for_ranks`).
    """
    if checked is None or checked.head is None or checked.read_part is not None:
        return checked
    checked.read_part = _part_reader(storage, name, manifest, entry, head=checked.head,
                                     source=checked.source, held={})
    return checked


def preread_metadata(storage: Storage, name: str, manifest: Manifest, *,
                     verify: bool = True) -> PrereadMetadata:
    """Read and check ``.metadata`` of ``name`` as :func:`share_metadata` does (leader only).

    For a group of ranks only (:func:`share_metadata` uses it only where there are
    several): where the file is laid out by rank, only its head is read.

    Never raises: a failure is the outcome, raised by :func:`share_metadata` on every
    rank when (and only when) that step is restored.
    """
    entry = next((e for e in manifest.files if e.path == METADATA_PATH), None)
    if entry is None:
        return PrereadMetadata(name, ("ok", None))
    try:
        checked = _read_for_ranks(storage, name, manifest, entry, verify=verify,
                                  for_group=True)
        return PrereadMetadata(name, ("ok", checked.for_ranks()), checked)
    except Exception as error:  # noqa: BLE001 - raised on every rank by share_metadata
        return PrereadMetadata(name, ("error", error))


def share_metadata(storage: Storage, name: str, manifest: Manifest,
                   coordinator: Coordinator, *, verify: bool = True,
                   preread: PrereadMetadata | None = None
                   ) -> tensors.CheckedMetadata | None:
    """Read ``.metadata`` of step directory ``name`` on group rank 0; give it to every rank.

    Collective: every rank of ``coordinator`` calls it, with the same arguments. Rank 0
    refuses a link, reads the file whole, checks its size and (with ``verify``) its
    checksum against ``manifest`` and parses it with the allow-list unpickler; then one
    broadcast (on the checkpoint group, within its ``checkpoint_timeout``) carries its
    skeleton (:meth:`~resumekit.tensors.CheckedMetadata.for_ranks`), or rank 0's
    error, to every rank; each gets its part of the chunks when its load plans. No other
    rank opens the file.

    Args:
        storage: The checkpoint root.
        name: The step directory, relative to the root.
        manifest: Its manifest (the same on every rank: the survey's).
        coordinator: The ranks that restore together.
        verify: Compare the bytes with the manifest's checksum.
        preread: What the leader's survey read already (:func:`preread_metadata`, the
            same on every rank): used, with no collective, when it is ``name``'s.

    Returns:
        The checked metadata (the whole file on rank 0, its skeleton on the others),
        or None when the manifest lists no ``.metadata`` (each
        reader then finds that out itself, as before).

    Raises:
        CorruptCheckpointError: Its checksum differs, or it is not a readable pickle.
        IncompleteCheckpointError: It is missing or has the wrong size.
        UnsafeCheckpointError: It is a symbolic link, or its pickle would run code.
        CoordinationError: The group broke during the broadcast.
    """
    entry = next((e for e in manifest.files if e.path == METADATA_PATH), None)
    if entry is None:
        return None
    if preread is not None and preread.name == name and coordinator.world_size > 1:
        status, value = preread.outcome
        if status == "error":
            raise value
        found = cast("tensors.CheckedMetadata | None",
                     preread.whole if preread.whole is not None else value)
        return _with_parts(found, storage, name, manifest, entry)

    whole: list[tensors.CheckedMetadata] = []

    def read() -> tensors.CheckedMetadata:
        checked = _read_for_ranks(storage, name, manifest, entry, verify=verify,
                                  for_group=coordinator.world_size > 1)
        if coordinator.world_size == 1:
            return checked
        whole.append(checked)
        return checked.for_ranks()

    shared = run_on_leader(coordinator, read)
    return _with_parts(whole[0] if whole else shared, storage, name, manifest, entry)


def verify_share(storage: Storage, name: str, manifest: Manifest, *, rank: int = 0,
                 world_size: int = 1, under: str | None = None,
                 metadata: tensors.CheckedMetadata | None = None) -> None:
    """Check rank ``rank``'s share of step directory ``name`` against ``manifest``.

    Args:
        storage: The checkpoint root.
        name: The step directory, relative to the root.
        manifest: Its manifest.
        rank: This rank, of ``world_size``.
        world_size: The ranks that share the work (each calls this).
        under: Only the files under this directory of the step directory (``tensors``
            for a weights-only load).
        metadata: ``.metadata``, already read and checked by :func:`share_metadata`: it
            is not read again.

    Raises:
        CorruptCheckpointError: A checksum or a size differs.
        IncompleteCheckpointError: A file the manifest lists is missing.
        UnsafeCheckpointError: A file of the share is a symbolic link (nothing was read).
    """
    if under is not None:
        manifest = manifest.model_copy(update={"files": [
            entry for entry in manifest.files if entry.path.startswith(f"{under}/")]})
    first = [entry for entry in manifest.files if entry.path == METADATA_PATH]
    rest = [entry for entry in manifest.files if entry.path != METADATA_PATH]
    sizes_only: set[str] = set()
    if first:
        if metadata is None:
            verify_checkpoint(storage, name,
                              manifest=manifest.model_copy(update={"files": first}))
        sizes_only = {f"{TENSORS_DIR}/{file}" for file in tensors.files_verified_on_read(
            storage.url_of(f"{name}/{manifest.data_path(TENSORS_DIR)}"),
            storage_options=storage.storage_options or None, metadata=metadata)}
    mine = manifest.model_copy(update={"files": rest[rank::world_size]})
    verify_checkpoint(storage, name, manifest=mine, sizes_only=sizes_only)


def refuse_links_share(storage: Storage, name: str, manifest: Manifest, *, rank: int = 0,
                       world_size: int = 1) -> None:
    """Refuse rank ``rank``'s share of the files of ``name`` that are symbolic links.

    What :func:`verify_share` checks first, without reading a byte: the restore without
    ``verify_on_restore`` runs it (on every rank, the same share of files).

    Raises:
        UnsafeCheckpointError: A file of the share, or a directory on its way, is a link.
    """
    refuse_links(storage, name, manifest.model_copy(
        update={"files": manifest.files[rank::world_size]}))
