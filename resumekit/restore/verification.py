"""Which rank checks which file of a checkpoint before it is loaded.

Restore checks every byte it loads against the manifest (``verify_on_restore``). The work
is split so that no rank reads a file twice and no rank waits long for the others:

1. ``tensors/.metadata`` is hashed first, on every rank: it holds the per-block checksums
   of the raw tensor files (:mod:`resumekit.tensors.raw`);
2. those raw tensor files then only need the size the manifest records: every block is
   checked against its checksum while it is read (:func:`resumekit.tensors.sharded.load`);
3. every other file (the small ``.pt`` files, data files of DCP's own format) is hashed
   by exactly one rank: rank ``r`` of ``n`` takes the manifest's files ``r, r + n, ...``.

The checks themselves are :func:`resumekit.store.catalog.verify_checkpoint`'s. Without
``verify_on_restore`` each rank still ``lstat``-s its share of the files
(:func:`refuse_links_share`): nothing is ever read through a symbolic link.
"""

from __future__ import annotations

from resumekit.store.catalog import refuse_links, verify_checkpoint
from resumekit.store.layout import DCP_METADATA_FILE, TENSORS_DIR
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage
from resumekit.tensors import sharded

__all__ = ["refuse_links_share", "verify_share"]


def verify_share(storage: Storage, name: str, manifest: Manifest, *, rank: int = 0,
                 world_size: int = 1, under: str | None = None) -> None:
    """Check rank ``rank``'s share of step directory ``name`` against ``manifest``.

    Args:
        storage: The checkpoint root.
        name: The step directory, relative to the root.
        manifest: Its manifest.
        rank: This rank, of ``world_size``.
        world_size: The ranks that share the work (each calls this).
        under: Only the files under this directory of the step directory (``tensors``
            for a weights-only load).

    Raises:
        CorruptCheckpointError: A checksum or a size differs.
        IncompleteCheckpointError: A file the manifest lists is missing.
        UnsafeCheckpointError: A file of the share is a symbolic link (nothing was read).
    """
    if under is not None:
        manifest = manifest.model_copy(update={"files": [
            entry for entry in manifest.files if entry.path.startswith(f"{under}/")]})
    metadata_path = f"{TENSORS_DIR}/{DCP_METADATA_FILE}"
    first = [entry for entry in manifest.files if entry.path == metadata_path]
    rest = [entry for entry in manifest.files if entry.path != metadata_path]
    sizes_only: set[str] = set()
    if first:
        verify_checkpoint(storage, name, manifest=manifest.model_copy(update={"files": first}))
        sizes_only = {f"{TENSORS_DIR}/{file}" for file in sharded.files_verified_on_read(
            storage.url_of(f"{name}/{manifest.data_path(TENSORS_DIR)}"),
            storage_options=storage.storage_options or None)}
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
