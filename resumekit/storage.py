"""The one place that touches files: a thin, typed layer over fsspec.

A :class:`Storage` is a filesystem plus a root. Local paths, ``file://``, ``memory://`` and
``s3://`` (with ``s3fs`` installed) all go through the same methods, so the commit protocol
is written once. Local storage adds what fsspec does not give: ``fsync`` of files and
directories and an atomic directory rename (POSIX ``rename``, Linux ``RENAME_EXCHANGE``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from resumekit.errors import StorageError
from resumekit.retry import create_with_retry

__all__ = ["FileInfo", "Storage"]

_READ_CHUNK = 8 << 20
#: fsspec protocols whose ``pipe_file(mode="create")`` is an atomic create-if-absent.
_CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a"})


@dataclass(frozen=True)
class FileInfo:
    """One entry of a directory listing.

    Attributes:
        name: Base name of the entry.
        path: Full path of the entry as the filesystem spells it.
        is_dir: True for a directory (or an object-store prefix).
        size: Size in bytes (0 for directories).
        mtime: Modification time (seconds since the epoch) when the backend reports one.
    """

    name: str
    path: str
    is_dir: bool
    size: int
    mtime: float | None


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

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        url = os.fspath(url)
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
        self.fs: Any = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        self.root: str = os.path.abspath(path) if self.is_local else path.rstrip("/")
        self.url = url

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
            page = fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "list_objects_v2",
                                    Bucket=bucket, Prefix=prefix, MaxKeys=1)
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
            names = sorted((entry.name, entry.is_dir()) for entry in found)
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
                page = fsspec.asyn.sync(
                    self.fs.loop, self.fs._call_s3, "list_objects_v2", Bucket=bucket,
                    Prefix=prefix, Delimiter="/", StartAfter=prefix + after, **extra)
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
        """Open ``relative`` (binary modes only); parent directories are created on write."""
        target = self.path(relative)
        if "w" in mode and self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        self._forget(relative)
        with _storage_errors("open", target, "open", passes=(FileNotFoundError,)):
            handle = self.fs.open(target, mode)
        with handle:
            yield handle

    def read_bytes(self, relative: str) -> bytes:
        """Return the whole content of ``relative``.

        On object stores one GET (``cat_file``), not a HEAD for the size and then a GET.
        """
        return self._cat(relative)

    def read_small(self, relative: str) -> bytes:
        """Return the content of a small file (a manifest, a record) in one request.

        On S3 one GET without the HEAD s3fs sends first to split a large download into
        concurrent ranges; elsewhere the same as :meth:`read_bytes`.
        """
        if not self.is_local and self._protocol() in _CONDITIONAL_PROTOCOLS:
            return self._cat(relative, max_concurrency=1)
        return self._cat(relative)

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
        operation of the store (``O_CREAT | O_EXCL`` plus ``fsync`` locally, a PUT with
        ``If-None-Match: *`` on S3): of two writers, exactly one succeeds. Elsewhere the
        file is checked for, then written (a race window of one round trip).

        Raises:
            FileExistsError: Something is already at ``relative``; nothing was written.
            StorageError: The store refused the write.
        """
        target = self.path(relative)
        if self.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with _storage_errors("write", target, "write", passes=(FileExistsError,)), \
                    open(target, "xb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
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
            with _storage_errors("create directory", target, "mkdir"):
                os.mkdir(target)

    def remove_tree(self, relative: str) -> None:
        """Delete ``relative`` and everything below it; an absent path is not an error.

        Entries another process deletes meanwhile (two sweeps of one directory) are
        skipped, not the end of the deletion: each caller goes on to the end, so the
        directory is gone once either returns.
        """
        target = self.path(relative)
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
        """Delete the file ``relative``; an absent file is not an error."""
        target = self.path(relative)
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
