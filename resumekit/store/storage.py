"""The one place that touches files: a thin, typed layer over fsspec.

A :class:`Storage` is a filesystem plus a root. Local paths, ``file://``, ``memory://`` and
``s3://`` (with ``s3fs`` installed) all go through the same methods, so the commit protocol
is written once. Local storage adds what fsspec does not give: ``fsync`` of files and
directories and an atomic directory rename (POSIX ``rename``, Linux ``RENAME_EXCHANGE``).

Symbolic links (local roots, plain paths and ``file://`` alike): nothing below the root is
ever deleted, renamed or written through a link. :meth:`Storage.link_on_path` finds the
first link on a path below the root (``lstat`` of each part; the root itself may be a
link: the user chose it), :meth:`Storage.is_link` tells whether one entry is a link, and
every deletion, rename and write here refuses a path with a link on it
(:class:`~resumekit.errors.StorageError` naming the link and where it points). A root
resumekit derives from another (a node-local sub-root ``<local_root>/rank_00003``) is
built ``confined_to`` the directory it was derived under: then a link on the root's own
path below that directory is refused the same way (:meth:`Storage.root_link`), so a
sub-root that is a link to another run's directory is never deleted or written through. Deciding
what a link in a root *is* (never a checkpoint) is the catalog's job; this is the net
under it. Object stores and ``memory://`` have no links.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from resumekit._compat import s3_call
from resumekit._optional import missing
from resumekit.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)
from resumekit.store.retry import create_with_retry

__all__ = ["JSON_DEPTH_LIMIT", "RECORD_LIMIT", "SMALL_FILE_LIMIT", "FileInfo", "Storage",
           "json_depth", "open_filesystem", "parse_json"]

_READ_CHUNK = 8 << 20
#: The most bytes :meth:`Storage.read_small` reads (a manifest listing every parameter
#: tensor of a large model is a few MB).
SMALL_FILE_LIMIT = 256 << 20
#: The most bytes of a record resumekit writes itself (a generation or writer record, the
#: newest-step hint): a few hundred bytes each.
RECORD_LIMIT = 1 << 20
#: The deepest nesting of arrays and objects :func:`parse_json` accepts.
JSON_DEPTH_LIMIT = 64
#: fsspec protocols whose ``pipe_file(mode="create")`` is an atomic create-if-absent.
_CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a"})
#: ``link(2)`` errors of a filesystem without hard links (vfat, some FUSE mounts).
_NO_HARD_LINKS = frozenset(getattr(errno, name) for name in ("EPERM", "ENOTSUP", "EOPNOTSUPP")
                           if hasattr(errno, name))


@dataclass(frozen=True)
class FileInfo:
    """One entry of a directory listing.

    Attributes:
        name: Base name of the entry.
        path: Full path of the entry as the filesystem spells it.
        is_dir: True for a directory (or an object-store prefix).
        size: Size in bytes (0 for directories).
        mtime: Modification time (seconds since the epoch) when the backend reports one.
        is_link: True for a symbolic link (local only; ``is_dir`` is then False, as fsspec
            reports a link without following it).
    """

    name: str
    path: str
    is_dir: bool
    size: int
    mtime: float | None
    is_link: bool = False


def _mtime_of(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        timestamp = getattr(value, "timestamp", None)
        if callable(timestamp):
            return float(timestamp())
    return None


class Storage:
    """A filesystem and a root path, addressed by relative, ``/``-separated names.

    Args:
        url: A local path, or an fsspec URL (``file://``, ``memory://``, ``s3://bucket/p``).
        storage_options: Options for the fsspec filesystem (e.g. ``endpoint_url`` for S3).

    Example:
        >>> import tempfile
        >>> store = Storage(tempfile.mkdtemp())
        >>> store.write_bytes("a/b.txt", b"hi")
        >>> store.read_bytes("a/b.txt")
        b'hi'
    """

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 *, confined_to: str | None = None):
        url = os.fspath(url)
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        fs, path = open_filesystem(url, self.storage_options)
        self.fs: Any = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root: str = os.path.abspath(path) if self.is_local else path.rstrip("/")
        self.url = url
        #: A directory above the root: no part of the root's path below it may be a
        #: link for a deletion, rename or write to go ahead (None: the root may be one).
        self.confined_to: str | None = (os.path.abspath(confined_to)
                                        if confined_to is not None and self.is_local else None)
        self.weak_commit_warned = False
        """Whether the commit protocol has said that this root's commit marker is not
        atomic (said once per ``Storage``, see :attr:`conditional_create`)."""

    # -- naming -----------------------------------------------------------------------
    def path(self, relative: str = "") -> str:
        """Return the backend path of ``relative`` (a ``/``-separated name under the root)."""
        if not relative:
            return self.root
        if self.is_local:
            return os.path.join(self.root, *relative.split("/"))
        return posixpath.join(self.root, relative)

    def url_of(self, relative: str = "") -> str:
        """Return a URL for ``relative`` that another fsspec user (e.g. DCP) can open."""
        if self.is_local:
            return self.path(relative)
        return f"{self._protocol()}://{self.path(relative).lstrip('/')}"

    @property
    def atomic_rename(self) -> bool:
        """True when a directory can be published with one atomic rename (POSIX)."""
        return self.is_local

    def root_stamp(self) -> tuple[int, int, int, int, int] | None:
        """The root directory's ``(st_dev, st_ino, st_mtime_ns, st_ctime_ns, st_nlink)``.

        One ``stat`` of the root: any entry created, removed or renamed in it changes its
        times (one kernel tick apart at least) and a subdirectory made or removed changes
        its link count; another directory put in its place changes the inode. None where
        there is no such directory: object stores, ``memory://``, a root that is absent
        or not a directory.
        """
        if not self.is_local:
            return None
        try:
            found = os.stat(self.root)
        except OSError:
            return None
        if not stat.S_ISDIR(found.st_mode):
            return None
        return (found.st_dev, found.st_ino, found.st_mtime_ns, found.st_ctime_ns,
                found.st_nlink)

    @property
    def conditional_create(self) -> bool:
        """True when :meth:`write_bytes_exclusive` is one atomic create-if-absent.

        Local filesystems (``O_EXCL``) and S3 (``If-None-Match: *``, through s3fs) have
        it. Other fsspec backends (``memory://``, ...) get a check-then-write that two
        writers racing inside the window between the check and the write can both pass.
        """
        return self.is_local or self._protocol() in _CONDITIONAL_PROTOCOLS

    def _protocol(self) -> str:
        protocol = self.fs.protocol
        return str(protocol[0] if isinstance(protocol, (tuple, list)) else protocol)

    # -- queries ----------------------------------------------------------------------
    def exists(self, relative: str = "") -> bool:
        """Return whether ``relative`` exists (file or directory)."""
        self._forget(relative)
        target = self.path(relative)
        with _storage_errors("exists", target, "exists", passes=(FileNotFoundError,)):
            return bool(self.fs.exists(target))

    def is_dir(self, relative: str = "") -> bool:
        """Return whether ``relative`` is a directory (or a non-empty object prefix).

        On S3 one ``ListObjectsV2`` request for at most one key under the prefix: s3fs's
        ``isdir`` lists the whole directory (every page of it), which in a checkpoint root
        grows with the checkpoints in it.
        """
        self._forget(relative)
        target = self.path(relative)
        with _storage_errors("isdir", target, "isdir", passes=(FileNotFoundError,)):
            if self.range_listing and not getattr(self.fs, "version_aware", False):
                return self._s3_has_keys_under(target)
            return bool(self.fs.isdir(target))

    def _s3_has_keys_under(self, target: str) -> bool:
        """Whether any key starts with ``<target>/`` (a bucket: whether it exists).

        What s3fs's ``isdir`` answers (its listing of the prefix is non-empty), asked for
        one key instead of all of them.
        """
        bucket, _, key = target.strip("/").partition("/")
        prefix = f"{key}/" if key else ""
        try:
            page = s3_call(self.fs, "list_objects_v2", Bucket=bucket, Prefix=prefix,
                           MaxKeys=1)
        except FileNotFoundError:  # no such bucket
            return False
        return bool(page.get("KeyCount") or page.get("Contents")
                    or page.get("CommonPrefixes"))

    def is_file(self, relative: str) -> bool:
        """Return whether ``relative`` is a regular file."""
        self._forget(relative)
        target = self.path(relative)
        with _storage_errors("isfile", target, "isfile", passes=(FileNotFoundError,)):
            return bool(self.fs.isfile(target))

    def is_link(self, relative: str) -> bool:
        """Return whether the entry ``relative`` itself is a symbolic link (``lstat``).

        Always False on object stores and ``memory://`` (they have no links); a dangling
        link or a loop is a link too. Costs one ``lstat``, no request.
        """
        if not self.is_local or not relative:
            return False
        try:
            return stat.S_ISLNK(os.lstat(self.path(relative)).st_mode)
        except OSError:
            return False

    def link_on_path(self, relative: str) -> str | None:
        """The first part of ``relative`` (below the root) that is a symbolic link, or None.

        ``a/b/c`` is checked as ``a``, ``a/b``, ``a/b/c`` (one ``lstat`` each, stopping at
        the first link or missing part). The root itself is not checked. Always None on
        object stores.
        """
        if not self.is_local:
            return None
        parts = [part for part in relative.split("/") if part]
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            try:
                mode = os.lstat(self.path(prefix)).st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                return prefix
        return None

    def root_link(self) -> str | None:
        """The first part of the root's own path below :attr:`confined_to` that is a link.

        ``confined_to=/scratch`` and root ``/scratch/local/rank_00000``: ``/scratch/local``,
        then ``/scratch/local/rank_00000`` (one ``lstat`` each, stopping at the first link
        or missing part). None without ``confined_to``, or when none is a link.
        """
        if self.confined_to is None:
            return None
        below = os.path.relpath(self.root, self.confined_to)
        if below == "." or below.startswith(".."):
            return None
        path = self.confined_to
        for part in below.split(os.sep):
            path = os.path.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                return path
        return None

    def link_target(self, relative: str) -> str:
        """Where the link ``relative`` points, as it is written (``?`` if unreadable)."""
        try:
            return os.readlink(self.path(relative))
        except OSError:
            return "?"

    def _refuse_links(self, verb: str, operation: str, *relatives: str) -> None:
        """Raise before ``verb`` touches a path with a symbolic link on it (local only).

        Raises:
            StorageError: One of ``relatives`` is, or lies below, a link in the root (or
                the root's own path is one, :meth:`root_link`); the message names the
                link and its target. Nothing was done.
        """
        linked_root = self.root_link()
        if linked_root is not None:
            target = self.path(relatives[0]) if relatives else self.root
            raise StorageError(
                f"refusing to {verb} {target}: {linked_root} is a symbolic link (to "
                f"{_link_target(linked_root)}); resumekit never deletes, renames or writes "
                f"through a link below {self.confined_to}",
                path=linked_root, operation=operation, link=linked_root)
        for relative in relatives:
            link = self.link_on_path(relative)
            if link is not None:
                where = self.path(link)
                raise StorageError(
                    f"refusing to {verb} {self.path(relative)}: {where} is a symbolic link "
                    f"(to {self.link_target(link)}); resumekit never deletes, renames or "
                    "writes through a link in its root",
                    path=where, operation=operation, link=where)

    def list_dir(self, relative: str = "") -> list[FileInfo]:
        """List the direct children of ``relative``; an absent directory lists as empty."""
        target = self.path(relative)
        entries: list[dict[str, Any]] = []  # stays empty for an absent directory
        with _storage_errors("list", target, "list", ignores=(FileNotFoundError,)):
            if self.is_local and not os.path.isdir(target):
                return []
            entries = self.fs.ls(target, detail=True, refresh=True) if not self.is_local \
                else self.fs.ls(target, detail=True)
        infos = []
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if not name or str(entry["name"]).rstrip("/") == target.rstrip("/"):
                continue
            is_dir = entry.get("type") == "directory"
            infos.append(
                FileInfo(
                    name=name,
                    path=str(entry["name"]),
                    is_dir=is_dir,
                    size=0 if is_dir else int(entry.get("size") or 0),
                    mtime=_mtime_of(entry),
                    is_link=bool(entry.get("islink")),
                )
            )
        return sorted(infos, key=lambda info: info.name)

    @property
    def range_listing(self) -> bool:
        """True when :meth:`list_names` can list only the names after a given one.

        S3 (``ListObjectsV2`` ``StartAfter``): the cost does not grow with the names
        before it. Elsewhere everything is listed and filtered here.
        """
        return not self.is_local and self._protocol() in _CONDITIONAL_PROTOCOLS

    def list_names(self, relative: str = "", *, after: str | None = None
                   ) -> list[tuple[str, bool]]:
        """List the direct children of ``relative`` as ``(name, is_dir)``, sorted by name.

        One call, like :meth:`list_dir`, but without sizes and times: on a local disk the
        entries' types come from the directory itself (no ``stat`` per entry), so listing
        a root of thousands of checkpoints stays cheap. An absent directory lists as empty.
        A symbolic link lists as no directory, whatever it points to (as :meth:`list_dir`).

        Args:
            relative: The directory.
            after: Only names that sort after this one (byte order); see
                :attr:`range_listing`.
        """
        if after is not None:
            if self.range_listing:
                return self._s3_names_after(relative, after)
            return [item for item in self.list_names(relative) if item[0] > after]
        if not self.is_local:
            return [(info.name, info.is_dir) for info in self.list_dir(relative)]
        target = self.path(relative)
        names: list[tuple[str, bool]] = []  # stays empty for an absent directory
        with _storage_errors("list", target, "list",
                             ignores=(FileNotFoundError, NotADirectoryError)), \
                os.scandir(target) as found:
            # a link is never a directory here, as in list_dir (a loop would not even
            # stat): what it is, is the catalog's to say
            names = sorted((entry.name, entry.is_dir(follow_symlinks=False))
                           for entry in found)
        return names

    def _s3_names_after(self, relative: str, after: str) -> list[tuple[str, bool]]:
        """``ListObjectsV2`` with a delimiter, from ``StartAfter=<prefix><after>`` on."""
        target = self.path(relative).strip("/")
        bucket, _, key = target.partition("/")
        prefix = f"{key}/" if key else ""
        found: list[tuple[str, bool]] = []
        token: str | None = None
        with _storage_errors("list", target, "list", ignores=(FileNotFoundError,)):
            while True:
                extra = {"ContinuationToken": token} if token else {}
                page = s3_call(self.fs, "list_objects_v2", Bucket=bucket, Prefix=prefix,
                               Delimiter="/", StartAfter=prefix + after, **extra)
                found.extend((str(item["Prefix"])[len(prefix):].rstrip("/"), True)
                             for item in page.get("CommonPrefixes", []))
                found.extend((str(item["Key"])[len(prefix):], False)
                             for item in page.get("Contents", []))
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break
        return sorted(item for item in found if item[0] and item[0] > after)

    def walk_files(self, relative: str = "") -> list[tuple[str, int]]:
        """Return ``(path relative to relative, size)`` of every file below ``relative``."""
        base = self.path(relative).rstrip("/")
        self._forget(relative)
        if self.is_local and os.path.isdir(base) and not os.path.islink(base):
            with _storage_errors("list", base, "list", ignores=(FileNotFoundError,)):
                plain = _walk_plain(base)
                if plain is not None:
                    return sorted(plain)
        found: dict[str, dict[str, Any]] = {}  # stays empty for an absent directory
        with _storage_errors("list", base, "list", ignores=(FileNotFoundError,)):
            found = self.fs.find(base, detail=True, withdirs=False)
        files = []
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            name = str(full)
            rel = os.path.relpath(name, base) if self.is_local else name[len(base):].lstrip("/")
            files.append((rel.replace(os.sep, "/"), int(info.get("size") or 0)))
        return sorted(files)

    def size(self, relative: str) -> int:
        """Return the size in bytes of the file ``relative``."""
        self._forget(relative)
        target = self.path(relative)
        with _storage_errors("size", target, "size", passes=(FileNotFoundError,)):
            return int(self.fs.size(target))

    def mtime(self, relative: str) -> float | None:
        """Return the modification time of ``relative`` when the backend reports one."""
        self._forget(relative)
        target = self.path(relative)
        with _storage_errors("info", target, "info", passes=(FileNotFoundError,)):
            info = self.fs.info(target)
        return _mtime_of(info)

    # -- reading and writing ----------------------------------------------------------
    @contextmanager
    def open(self, relative: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        """Open ``relative`` (binary modes only); parent directories are created on write.

        A local file to read must be a regular file: a FIFO, device or socket in its place
        (or a symlink to one) is refused from its ``stat`` with
        :class:`~resumekit.errors.UnsafeCheckpointError`, never opened (that could block).
        """
        target = self.path(relative)
        if "w" in mode and self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        self._forget(relative)
        with _storage_errors("open", target, "open", passes=(FileNotFoundError,)):
            if self.is_local and "r" in mode:
                _require_regular(target, os.stat(target))  # a FIFO's open would block
            handle = self.fs.open(target, mode)
        with handle:
            yield handle

    def read_bytes(self, relative: str) -> bytes:
        """Return the whole content of ``relative``.

        On object stores one GET (``cat_file``), not a HEAD for the size and then a GET.
        """
        return self._cat(relative)

    def read_small(self, relative: str, *, limit: int = SMALL_FILE_LIMIT) -> bytes:
        """Return the content of a small file (a manifest, a record) in one request.

        Every small file resumekit parses (manifests, generation and writer records,
        checksum files, hints, other tools' JSON) is read here, bounded: only a regular
        file is opened (a FIFO, device or socket in its place, or a symlink to one, is
        refused from its ``stat``, never opened, so the read cannot block or run on
        forever), and one larger than ``limit`` is refused. On S3 one GET without the
        HEAD s3fs sends first to split a large download into concurrent ranges.

        Args:
            relative: The file.
            limit: The most bytes it may hold.

        Raises:
            UnsafeCheckpointError: Not a regular file, or larger than ``limit``; names
                the file.
            FileNotFoundError: It does not exist.
        """
        if self.is_local:
            return self._read_regular(relative, limit)
        options: dict[str, Any] = {"start": 0, "end": limit + 1}
        if self._protocol() in _CONDITIONAL_PROTOCOLS:
            options["max_concurrency"] = 1
        data = self._cat(relative, **options)
        if len(data) > limit:
            raise _too_large(self.path(relative), limit)
        return data

    def read_json(self, relative: str, *, limit: int = SMALL_FILE_LIMIT) -> Any:
        """Return the JSON document in the small file ``relative``, read and parsed bounded.

        :meth:`read_small` then :func:`parse_json`: the one way resumekit reads a JSON file
        it did not just write itself.

        Raises:
            UnsafeCheckpointError: Not a regular file, too large or nested too deep.
            CorruptCheckpointError: Not JSON.
            FileNotFoundError: It does not exist.
        """
        return parse_json(self.read_small(relative, limit=limit), source=self.path(relative))

    def _read_regular(self, relative: str, limit: int) -> bytes:
        """Read a local file that ``stat`` shows to be regular, at most ``limit`` bytes."""
        target = self.path(relative)
        with _storage_errors("open", target, "open", passes=(FileNotFoundError,)):
            _require_regular(target, os.stat(target))
            # O_NONBLOCK: should the name be swapped for a FIFO after the stat, the open
            # returns at once and the fstat below refuses it.
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as handle:
                found = os.fstat(handle.fileno())
                _require_regular(target, found)
                if found.st_size > limit:
                    raise _too_large(target, limit)
                # Its size, not the limit: a read allocates the count it is asked for. A
                # file that grew since shows a byte past its size and is read on in chunks.
                data = handle.read(found.st_size + 1)
                while found.st_size < len(data) <= limit:
                    more = handle.read(min(_READ_CHUNK, limit + 1 - len(data)))
                    if not more:
                        break
                    data += more
        if len(data) > limit:
            raise _too_large(target, limit)
        return data

    def _cat(self, relative: str, **options: Any) -> bytes:
        if self.is_local:
            with self.open(relative, "rb") as handle:
                return handle.read()
        target = self.path(relative)
        self._forget(relative)
        with _storage_errors("open", target, "open", passes=(FileNotFoundError,)):
            data = self.fs.cat_file(target, **options)
        return bytes(data)

    def iter_chunks(self, relative: str, chunk_size: int = _READ_CHUNK) -> Iterator[bytes]:
        """Yield the content of ``relative`` in chunks (bounded memory)."""
        with self.open(relative, "rb") as handle:
            while chunk := handle.read(chunk_size):
                yield chunk

    def write_bytes(self, relative: str, data: bytes, *, durable: bool = False) -> None:
        """Write ``data`` to ``relative``; with ``durable`` it is fsynced before returning."""
        target = self.path(relative)
        if self.is_local:
            self._refuse_links("write", "write", relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with _storage_errors("write", target, "write"), open(target, "wb") as handle:
                handle.write(data)
                if durable:
                    handle.flush()
                    os.fsync(handle.fileno())
            return
        with self.open(relative, "wb") as handle:
            handle.write(data)

    def write_bytes_exclusive(self, relative: str, data: bytes) -> None:
        """Create ``relative`` holding ``data``, only if nothing is there yet.

        Where :attr:`conditional_create` is true the check and the write are one atomic
        operation of the store (a hard link locally, a PUT with ``If-None-Match: *`` on
        S3): of two writers, exactly one succeeds, and the file appears with all of its
        bytes: a reader never sees it empty or half-written. Locally the bytes are written
        and fsynced under a hidden name beside ``relative`` first (``.<name>.tmp-<hex>``,
        removed afterwards; a kill in between leaves only that), then linked in; where
        the filesystem has no hard links it is created with ``O_CREAT | O_EXCL`` and then
        written. Elsewhere the file is checked for, then written (a race window of one
        round trip).

        Raises:
            FileExistsError: Something is already at ``relative``; nothing was written.
            StorageError: The store refused the write.
        """
        target = self.path(relative)
        if self.is_local:
            self._refuse_links("write", "write", relative)
            directory, base = os.path.split(target)
            os.makedirs(directory, exist_ok=True)
            aside = os.path.join(directory, f".{base}.tmp-{secrets.token_hex(6)}")
            with _storage_errors("write", target, "write", passes=(FileExistsError,)):
                try:
                    _write_durably(aside, data)
                    try:
                        os.link(aside, target)  # atomic, and EEXIST if anything is there
                    except OSError as error:
                        if error.errno not in _NO_HARD_LINKS:
                            raise
                        _write_durably(target, data)  # no hard links: O_EXCL, then write
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(aside)
            self.fsync_dir(posixpath.dirname(relative))  # the name, durable
            return
        self._forget(relative)
        try:
            with _storage_errors("write", target, "write", passes=(FileExistsError,)):
                if self.conditional_create:
                    # S3 answers 409 while another request on the key is in flight:
                    # nothing was written, so the create is sent again
                    create_with_retry(target, lambda: self.fs.pipe_file(
                        target, data, mode="create"))
                else:
                    if self.fs.exists(target):
                        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
                    self.fs.pipe_file(target, data)
        finally:
            self._forget(relative)

    def make_dirs(self, relative: str = "") -> None:
        """Create the directory ``relative`` and its parents (a no-op on object stores)."""
        target = self.path(relative)
        if self.is_local:
            with _storage_errors("create directory", target, "mkdir"):
                os.makedirs(target, exist_ok=True)

    def make_dir_exclusive(self, relative: str) -> None:
        """Create the directory ``relative``; fail if it exists (local only)."""
        target = self.path(relative)
        if self.is_local:
            self._refuse_links("create", "mkdir", relative)
            with _storage_errors("create directory", target, "mkdir"):
                os.mkdir(target)

    def remove_tree(self, relative: str) -> None:
        """Delete ``relative`` and everything below it; an absent path is not an error.

        Links below it are removed as links (their targets are never followed); a path
        that is itself a link, or lies below one, is refused (:meth:`link_on_path`).
        Entries another process deletes meanwhile (two sweeps of one directory) are
        skipped, not the end of the deletion: each caller goes on to the end, so the
        directory is gone once either returns.
        """
        target = self.path(relative)
        self._refuse_links("delete", "delete", relative)
        with _storage_errors("delete", target, "delete", ignores=(FileNotFoundError,)):
            if self.is_local:
                if os.path.isdir(target):
                    shutil.rmtree(target, onerror=_unless_gone)
                elif os.path.lexists(target):
                    os.unlink(target)
                return
            self._forget(relative)
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)

    def remove_file(self, relative: str) -> None:
        """Delete the file ``relative``; an absent file is not an error.

        A path that is, or lies below, a link in the root is refused (:meth:`link_on_path`).
        """
        target = self.path(relative)
        self._refuse_links("delete", "delete", relative)
        with _storage_errors("delete", target, "delete", ignores=(FileNotFoundError,)):
            self.fs.rm_file(target)

    # -- durability (local filesystems) -----------------------------------------------
    def fsync_file(self, relative: str) -> None:
        """Flush the file ``relative`` to stable storage (a no-op on object stores)."""
        if not self.is_local:
            return
        target = self.path(relative)
        with _storage_errors("fsync", target, "fsync"):
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def fsync_dir(self, relative: str = "") -> None:
        """Flush the directory entry list of ``relative`` (so renames and creates persist)."""
        self.fsync_file(relative)

    def rename_dir(self, source: str, target: str) -> None:
        """Atomically rename directory ``source`` to ``target``, which must not exist."""
        self._require_local("rename")
        self._refuse_links("rename", "rename", source, target)
        src, dst = self.path(source), self.path(target)
        if os.path.lexists(dst):
            raise StorageError(
                f"cannot publish {src}: {dst} already exists", path=dst, operation="rename"
            )
        with _storage_errors("rename", f"{src} to {dst}", "rename", path=src):
            os.rename(src, dst)

    def exchange_dirs(self, first: str, second: str) -> None:
        """Atomically swap two existing directories (Linux ``renameat2(RENAME_EXCHANGE)``).

        Raises:
            StorageError: When the filesystem cannot exchange atomically.
        """
        self._require_local("exchange")
        self._refuse_links("exchange", "exchange", first, second)
        a, b = os.fsencode(self.path(first)), os.fsencode(self.path(second))
        renameat2 = _renameat2()
        if renameat2 is None:
            raise StorageError(
                f"atomic exchange is unavailable here for {self.path(first)}",
                path=self.path(first), operation="exchange",
            )
        at_fdcwd = -100
        rename_exchange = 2
        if renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) != 0:
            code = ctypes.get_errno()
            raise StorageError(
                f"cannot exchange {self.path(first)} and {self.path(second)}: "
                f"{os.strerror(code)}",
                path=self.path(first), operation="exchange", errno=code,
            )

    def _forget(self, relative: str) -> None:
        """Drop cached listings of ``relative`` and its parents (object stores).

        s3fs answers ``exists``/``info``/``open`` from listings it cached earlier, so a
        file another process (rank, job, CLI) wrote, replaced or deleted since would be
        missed or read with a stale size. Checkpoint operations are rare and must see the
        store as it is now; one extra request is the price.
        """
        if not self.is_local:
            self.fs.invalidate_cache(self.path(relative))

    def _require_local(self, operation: str) -> None:
        if not self.is_local:
            raise StorageError(
                f"{operation} needs a local filesystem, not {self.url}",
                path=self.url, operation=operation,
            )

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"


def _link_target(path: str) -> str:
    """Where the link ``path`` points, as it is written (``?`` if unreadable)."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _require_regular(target: str, found: os.stat_result) -> None:
    """Refuse what is not a regular file, from its ``stat`` (a directory: as ``open`` would)."""
    if stat.S_ISDIR(found.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
    if not stat.S_ISREG(found.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(found.st_mode) else
                "a device" if stat.S_ISCHR(found.st_mode) or stat.S_ISBLK(found.st_mode) else
                "a socket" if stat.S_ISSOCK(found.st_mode) else "not a file")
        raise UnsafeCheckpointError(
            f"{target} is {kind}, not a regular file: refused unread", path=target)


def _too_large(target: str, limit: int) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{target} is larger than {limit} bytes, the most resumekit reads of such a file: "
        "refused", path=target, limit=limit)


def parse_json(raw: bytes, *, source: str, max_depth: int = JSON_DEPTH_LIMIT) -> Any:
    """Parse the JSON document ``raw`` read from ``source``, its nesting bounded.

    Args:
        raw: The bytes (UTF-8).
        source: The file they came from, named in every error.
        max_depth: The deepest nesting of arrays and objects accepted.

    Raises:
        CorruptCheckpointError: Not UTF-8 JSON.
        UnsafeCheckpointError: Nested deeper than ``max_depth``.
    """
    try:
        document = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise _too_deep(source, max_depth) from None
    except ValueError as error:  # not UTF-8, not JSON, an integer of too many digits
        raise CorruptCheckpointError(f"{source}: not valid JSON ({error})",
                                     path=source) from error
    if json_depth(document, stop=max_depth) > max_depth:
        raise _too_deep(source, max_depth)
    return document


def json_depth(value: Any, *, stop: int | None = None) -> int:
    """The deepest nesting of lists and dicts in ``value`` (0 for a scalar), no recursion.

    Args:
        value: Parsed JSON, or data to be saved as JSON.
        stop: Return as soon as the nesting is found deeper than this (so a structure
            that contains itself ends the walk too).
    """
    # Level by level; a JSON scalar (most of a document's values) is skipped by its exact
    # type before any isinstance check: the walk cost three times the parse of a
    # manifest, read several times by every commit (issue 38.2).
    if not isinstance(value, _CONTAINERS):
        return 0
    deepest, level = 0, [value]
    while level:
        deepest += 1
        if stop is not None and deepest > stop:
            return deepest
        below: list[Any] = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                if type(child) not in _SCALARS and isinstance(child, _CONTAINERS):
                    below.append(child)
        level = below
    return deepest


_CONTAINERS = (dict, list, tuple)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _too_deep(source: str, max_depth: int) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source}: JSON nested deeper than {max_depth} levels: refused", path=source,
        max_depth=max_depth)


_RENAMEAT2: Any = None


def _unless_gone(function: Any, path: str, exc_info: Any) -> None:
    """``shutil.rmtree``'s error handler: an entry already deleted is skipped."""
    if isinstance(exc_info[1], FileNotFoundError):
        return
    raise exc_info[1]


@contextmanager
def _storage_errors(
    verb: str,
    target: str,
    operation: str,
    *,
    path: str | None = None,
    passes: tuple[type[OSError], ...] = (),
    ignores: tuple[type[OSError], ...] = (),
) -> Iterator[None]:
    """Turn an ``OSError`` of the block into a :class:`StorageError`: the one way it is done.

    The message is ``cannot <verb> <target>: <error>``.

    Args:
        verb: What was being done (``"write"``, ``"list"``).
        target: What it was done to, as the message names it.
        operation: The error's ``operation`` attribute.
        path: The error's ``path`` attribute (default ``target``).
        passes: Errors raised unchanged, for callers that tell them apart
            (``FileNotFoundError`` from ``open``, ``FileExistsError`` from an exclusive
            create).
        ignores: Errors that end the block quietly (deleting what is already gone).
    """
    try:
        yield
    except StorageError:
        raise
    except OSError as error:
        if isinstance(error, ignores):
            return
        if isinstance(error, passes):
            raise
        raise StorageError(f"cannot {verb} {target}: {error}", path=path or target,
                           operation=operation) from error


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None
                    ) -> tuple[Any, str]:
    """Fsspec's filesystem and path of ``url``, or an error naming what to install.

    Args:
        url: A local path or an fsspec URL.
        storage_options: Options for the fsspec filesystem.

    Returns:
        ``(filesystem, path)`` as ``fsspec.core.url_to_fs`` returns them.

    Raises:
        MissingDependencyError: ``s3://`` without s3fs (``pip install 'resumekit[s3]'``).
        ConfigurationError: Another protocol whose fsspec backend is not installed.
    """
    try:
        fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as error:
        raise _missing_backend(url, error) from error
    return fs, str(path)


def _missing_backend(url: str, error: ImportError) -> ConfigurationError:
    """The error for a root whose fsspec backend is not installed, naming what to install."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        return missing("s3fs", extra="s3", feature=f"an {protocol}:// root", error=error,
                       where=f"cannot open {url}", value=url)
    return ConfigurationError(f"cannot open {url}: {protocol}:// needs a package that is not "
                              f"installed; install the fsspec backend for {protocol}:// "
                              f"({error})", name="root", value=url)


def _write_durably(path: str, data: bytes) -> None:
    """Create ``path`` (``O_EXCL``: FileExistsError if it exists), write ``data``, fsync."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _renameat2() -> Any:
    global _RENAMEAT2  # noqa: PLW0603 - resolved once per process
    if _RENAMEAT2 is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _RENAMEAT2 = getattr(libc, "renameat2", False)
        if _RENAMEAT2:
            _RENAMEAT2.argtypes = [
                ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint,
            ]
            _RENAMEAT2.restype = ctypes.c_int
    return _RENAMEAT2 or None


def _walk_plain(base: str) -> list[tuple[str, int]] | None:
    """Every file below local directory ``base`` with its size, from ``os.scandir``.

    None when the tree holds anything but directories and regular files (a link, a FIFO,
    a device): fsspec's walk, which the caller then runs, decides what such an entry is,
    as it always did. A plain tree is listed without fsspec's per-file ``info`` calls
    (the commit's listing of a staging area, once per save).

    Raises:
        FileNotFoundError: ``base`` does not exist.
    """
    files: list[tuple[str, int]] = []
    pending = [("", base)]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                name = f"{prefix}{entry.name}"
                if entry.is_symlink():
                    return None
                if entry.is_dir(follow_symlinks=False):
                    pending.append((f"{name}/", entry.path))
                elif entry.is_file(follow_symlinks=False):
                    files.append((name, entry.stat(follow_symlinks=False).st_size))
                else:
                    return None
    return files
