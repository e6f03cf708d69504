"""DCP storage readers that read resumekit checkpoints safely, and :class:`StorageReader`.

``.metadata`` is read with :mod:`resumekit.tensors.safe_pickle` (an allow-list unpickler),
checked against the manifest's checksum when there is one, and non-tensor values with
``torch.load(weights_only=True)``: nothing in a tampered checkpoint runs code. Raw tensor
files are verified block by block as they are read (:mod:`resumekit.tensors.raw`).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from resumekit import _compat
from resumekit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ResumekitError,
    UnsafeCheckpointError,
)
from resumekit.store.layout import DCP_METADATA_FILE
from resumekit.store.manifest import checksum_chunks
from resumekit.store.retry import read_with_retry
from resumekit.store.targets import locate_tensor_data
from resumekit.tensors import metadata_file
from resumekit.tensors.context import directory_str, local_path, paused_collection
from resumekit.tensors.metadata_parts import ItemKey, MetadataServer, serve_values, skeleton
from resumekit.tensors.parts_exchange import PartsAnswerer
from resumekit.tensors.raw import FsspecFiles, RawTensorReading, raw_files
from resumekit.tensors.safe_pickle import load_dcp_metadata
from resumekit.tensors.shared_reads import SharedReads

__all__ = ["CheckedMetadata", "SafeReader", "StorageReader", "load_plain_value", "make_reader",
           "read_whole_items"]


def read_metadata_bytes(data: bytes, source: str) -> Metadata:
    """The whole metadata of a ``.metadata``'s bytes: DCP's pickle, or laid out by rank.

    Both are read with the allow-list unpickler
    (:mod:`resumekit.tensors.metadata_file`: ``schema_version`` 5's raw format).

    Raises:
        UnsafeCheckpointError: A pickle references a disallowed global.
        CorruptCheckpointError: It is unreadable, or a piece's checksum differs.
    """
    if metadata_file.is_framed(data):
        return metadata_file.decode(data, source)
    return cast(Metadata, load_dcp_metadata(data, source=source))


def _skeleton_of(head: metadata_file.Head) -> Metadata:
    """A copy of ``head``'s skeleton of this rank's own (its load fills it in place)."""
    found = copy.deepcopy(head.skeleton)
    if getattr(found, "storage_meta", None) is None:
        found.storage_meta = StorageMeta()
    return found


class CheckedMetadata:
    """A checkpoint's ``.metadata`` read and checked once, for every reader of one restore.

    A restore reads the file on one rank (checked against the manifest there, and parsed
    there, so an unsafe or unreadable pickle fails on that rank) and each rank's readers
    take the metadata from this object instead of opening the file: the store serves it
    once per restore, not once per rank.

    Over a group of several ranks (:meth:`for_ranks`), the other ranks do not receive the
    whole file, whose size grows with the number of ranks that wrote the checkpoint: they
    receive its :func:`~resumekit.tensors.metadata_parts.skeleton` (every key's size,
    dtype and nesting) and the names of its raw tensor files, and when the load plans,
    each gets from the reading rank the part its shards need
    (:mod:`resumekit.tensors.metadata_parts`). Otherwise only the bytes travel (pickling
    drops the parsed copy); each process parses them once, on first use, and its readers
    share that parse.

    Args:
        data: The file's bytes (None on a rank that holds the skeleton only).
        source: Its path or URL (named in errors).
        digest: Its checksum (``xxh3_128:<hex>``).
    """

    def __init__(self, data: bytes | None, source: str, digest: str) -> None:
        self.data = data
        self.source = source
        self.digest = digest
        self.exchanged = False
        """Whether the ranks of a group plan from their parts (:meth:`for_ranks`)."""
        self.head: metadata_file.Head | None = None
        """The head of a ``.metadata`` laid out by rank, where only it was read
        (:meth:`from_head`): every rank then reads its own part (:attr:`read_part`)."""
        self.leader = False
        """Whether this rank read the head and answers the others' requests."""
        self.read_part: Callable[[int], list[metadata_file.Row] | None] | None = None
        """Reads and checks writing rank ``r``'s part (set on every rank where it is
        received: :func:`resumekit.restore.verification.share_metadata`; the leader's
        holds the bytes of its own part, read in the same open of the file as the head)."""
        self.read_whole: Callable[[], Metadata] | None = None
        """Reads, checks and parses the whole file (the leader's, when a rank's request
        is not covered by its part)."""
        self._parsed: Metadata | None = None
        self._raw_files: set[str] | None = None
        self._server: MetadataServer | None = None
        self._answerer: PartsAnswerer | None = None

    @classmethod
    def parse(cls, data: bytes, source: str) -> CheckedMetadata:
        """The checked copy of ``data``, parsed now (with the allow-list unpickler).

        Raises:
            UnsafeCheckpointError: The pickle references a disallowed global.
            CorruptCheckpointError: It is unreadable.
        """
        checked = cls(data, source, checksum_chunks([data]))
        checked.parsed()
        return checked

    @classmethod
    def from_parsed(cls, metadata: Metadata, source: str, digest: str,
                    raw_files: set[str]) -> CheckedMetadata:
        """A copy holding ``metadata`` already parsed, without the file's bytes.

        What a rank holds when it did not read the file whole: a skeleton, or the
        metadata its load filled in with the parts it was given. ``metadata`` is used as
        it is (not copied); its readers take it from here and open no ``.metadata``.

        Args:
            metadata: The parsed metadata (a skeleton, or one filled in).
            source: The file's path or URL (named in errors).
            digest: Its checksum in the manifest (``xxh3_128:<hex>``).
            raw_files: The checkpoint's raw tensor files (verified block by block).
        """
        checked = cls(None, source, digest)
        checked._parsed = metadata
        checked._raw_files = raw_files
        return checked

    @classmethod
    def from_head(cls, head: metadata_file.Head, source: str, digest: str
                  ) -> CheckedMetadata:
        """The leader's copy of a ``.metadata`` laid out by rank of which it read the head.

        ``digest``: the file's checksum in the manifest (it names the checkpoint).
        """
        checked = cls.from_parsed(_skeleton_of(head), source, digest, set(head.raw_files))
        checked.head = head
        checked.leader = True
        checked.exchanged = True
        return checked

    def answerer(self, read_small: Callable[[Metadata, Sequence[ItemKey]], dict[ItemKey, Any]]
                 ) -> PartsAnswerer:
        """The leader's answerer of a ``.metadata`` laid out by rank (built once)."""
        assert self.head is not None and self.read_whole is not None
        if self._answerer is None:
            self._answerer = PartsAnswerer(self.head, self.source, self.read_whole,
                                           read_small)
        return self._answerer

    @property
    def whole(self) -> bool:
        """Whether this object holds the whole metadata (not a skeleton)."""
        return self.data is not None

    def for_ranks(self) -> CheckedMetadata:
        """What the reading rank sends the other ranks of a group: the skeleton.

        This object (the reading rank's) is marked to answer their requests for parts.
        """
        parsed = self.parsed()
        self.exchanged = True
        sent = CheckedMetadata.from_parsed(
            copy.deepcopy(parsed) if self.head is not None else skeleton(parsed),
            self.source, self.digest, self.raw_files())
        sent.exchanged = True
        sent.head = self.head
        return sent

    def parsed(self) -> Metadata:
        """The metadata, unpickled on first use with the allow-list unpickler.

        On a rank that holds the skeleton only: the skeleton (the load fills it with
        this rank's part).
        """
        if self._parsed is None:
            assert self.data is not None  # a skeleton is never without its parse
            with paused_collection(False):
                metadata = read_metadata_bytes(self.data, self.source)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._parsed = metadata
        return self._parsed

    def raw_files(self) -> set[str]:
        """The raw tensor files of the checkpoint (those verified block by block on read)."""
        if self._raw_files is None:
            self._raw_files = raw_files(self.parsed().storage_data or {})
        return self._raw_files

    def server(self) -> MetadataServer:
        """The answerer of the other ranks' requests (only where the whole file is)."""
        if self._server is None:
            self._server = MetadataServer(self.parsed(), self.source)
        return self._server

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {"data": self.data, "source": self.source,
                                 "digest": self.digest, "exchanged": self.exchanged}
        if self.data is None:  # a skeleton: sent as it is (it is small)
            state["skeleton"] = self._parsed if self.head is None else None
            state["raw_files"] = self._raw_files
            state["head"] = self.head
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data, self.source, self.digest = state["data"], state["source"], state["digest"]
        self.exchanged = bool(state.get("exchanged", False))
        self._parsed = state.get("skeleton")
        self._raw_files = state.get("raw_files")
        self._server = None
        self.head = state.get("head")
        if self.head is not None and self._parsed is None:  # the head carries it
            self._parsed = _skeleton_of(self.head)
        self.leader = False
        self.read_part = None
        self.read_whole = None
        self._answerer = None


class _SafeReaderMixin:
    """Reads ``.metadata`` with the allow-list unpickler, once, and remembers failures."""

    fs: Any
    path: Any
    load_id: str
    _metadata: Metadata | None = None
    metadata_error: ResumekitError | None = None
    verify: bool = True
    file_checksums: Mapping[str, str] | None = None
    metadata_digest: str | None = None
    checked_metadata: CheckedMetadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Return the checkpoint metadata, read safely on first use."""
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            return self._metadata
        if self.checked_metadata is not None and rank is None:
            try:
                metadata = self.checked_metadata.parsed()
            except ResumekitError as error:
                self.metadata_error = error
                raise
            self.metadata_digest = self.checked_metadata.digest
            cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
            self._metadata = metadata
            return metadata
        data, source, _ = self.metadata_bytes(rank)
        return self._parse_metadata(data, source, rank)

    def metadata_bytes(self, rank: int | None = None) -> tuple[bytes, str, str]:
        """``.metadata``'s bytes, path and checksum; with a manifest, checked against it.

        Raises:
            CheckpointNotFoundError: No metadata file.
            CorruptCheckpointError: It does not match the manifest.
        """
        checked = self.checked_metadata
        if checked is not None and checked.data is not None and rank is None:
            self.metadata_digest = checked.digest
            return checked.data, checked.source, checked.digest
        source = os.fspath(_compat.dcp_metadata_path(cast(FileSystemReader, self), rank))

        def read() -> bytes:
            with self.fs.create_stream(source, "rb") as stream:
                return cast(bytes, stream.read())

        try:
            data = read_with_retry(source, read)
        except FileNotFoundError as error:
            found = CheckpointNotFoundError(
                f"no checkpoint metadata at {source}", path=os.fspath(self.path), file=source
            )
            if rank is None:
                self.metadata_error = found
            raise found from error
        try:
            digest = checksum_chunks([data])
            if rank is None:
                self.metadata_digest = digest
                self._check_metadata_bytes(data, source, digest)
        except ResumekitError as error:
            self.metadata_error = error
            raise
        return data, source, digest

    def _parse_metadata(self, data: bytes, source: str, rank: int | None) -> Metadata:
        try:
            with paused_collection(False):
                metadata = read_metadata_bytes(data, source)
        except ResumekitError as error:
            self.metadata_error = error
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata

    def _check_metadata_bytes(self, data: bytes, source: str, actual: str) -> None:
        """With ``verify`` and a manifest, ``.metadata`` must match its recorded checksum.

        The checksums of raw tensor blocks are in it, so it is checked before any is used.
        """
        if not self.verify or self.file_checksums is None:
            return
        expected = self.file_checksums.get(DCP_METADATA_FILE)
        if expected is None:
            raise CorruptCheckpointError(
                f"{source} is not listed in the checkpoint's manifest, so it cannot be "
                "verified", path=os.fspath(self.path), file=source)
        if actual != expected:
            raise CorruptCheckpointError(
                f"{source} does not match its checksum in the manifest (expected "
                f"{expected}, got {actual})", path=os.fspath(self.path), file=source)


class SafeReader(_SafeReaderMixin, RawTensorReading, FileSystemReader):
    """resumekit's own reader of a restore: safe ``.metadata``, checked reads.

    DCP's filesystem reader of a local path or, through :class:`FsspecFiles`, a URL.

    :func:`make_reader` builds it and :func:`resumekit.tensors.load.load` reads with it;
    :class:`StorageReader` is the same reading for stock DCP tools.

    With ``shared`` (a :class:`~resumekit.tensors.shared_reads.SharedReads`), the pieces
    several ranks want are read by one of them and sent to the others.
    """

    shared: SharedReads | None = None

    def __init__(self, directory: str, storage_options: Mapping[str, Any] | None = None
                 ) -> None:
        local = local_path(directory)
        super().__init__(local or directory)
        if local is None:
            self.fs = FsspecFiles()
            self.path = self.fs.init_path(directory, **dict(storage_options or {}))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items; with ``shared``, this rank's share of them, then exchange.

        The items the planner received read in its part of ``.metadata`` (its ``values``:
        :func:`~resumekit.tensors.metadata_parts.serve_values`) are loaded from there.
        """
        plan = serve_values(plan, planner, getattr(planner, "values", None) or {})
        if self.shared is None:
            return super().read_data(plan, planner)
        read = super().read_data
        self.shared.read(plan, planner, lambda part, into: read(part, into).wait(),
                         source=self.metadata_digest or str(os.fspath(self.path)))
        done: Future[None] = Future()
        done.set_result(None)
        return done


class StorageReader(_SafeReaderMixin, RawTensorReading, FileSystemReader):
    """A DCP ``StorageReader`` for resumekit checkpoints: stock DCP tools read ours with it.

    Pass it wherever DCP takes a reader::

        dcp.load(state_dict, storage_reader=resumekit.StorageReader(step_dir))

    It loads the model and optimizer tensors of a committed checkpoint (``state_dict``
    as :func:`model_and_optimizer_state` or DCP's ``get_state_dict`` builds it:
    ``{"model": ..., "optimizer": ...}``), in either tensor format: resumekit's raw tensor
    files and DCP's own (``tensor_format="dcp"``, object stores, earlier versions).
    Resharding works as in DCP (a checkpoint of N ranks loads on M). The step, scheduler,
    RNG and data position are not DCP data; restore them with
    :class:`~resumekit.CheckpointManager`.

    With ``verify`` (the default) every byte read is checked: ``.metadata`` against the
    manifest before anything else, raw tensor files block by block as they are read, and
    each file in DCP's own format hashed whole against the manifest before DCP reads it.
    A mismatch raises :class:`~resumekit.errors.CorruptCheckpointError` naming the file
    and key (``dcp.load`` reports a reader's error wrapped in its ``CheckpointException``,
    whose ``failures`` hold it by rank). ``.metadata`` and non-tensor values are read
    without unrestricted unpickling (see the module docstring); the latter only when the
    planner is resumekit's, as DCP's default planner unpickles them itself.

    Args:
        path: The step directory (holding ``manifest.json``) or its ``tensors/`` folder
            (``attempt-<token>/tensors`` on object stores): a local path, ``file://`` URL
            or fsspec URL (``s3://bucket/run/step_000001000``).
        storage_options: fsspec options for URLs (credentials, endpoint).
        verify: Check every byte read against the checksums recorded at save time.

    Attributes:
        step_dir: The step directory of the checkpoint being read.

    Raises:
        CheckpointNotFoundError: ``path`` is not a resumekit checkpoint (no
            ``manifest.json`` in it or in a step directory above it).
        ManifestError: The manifest is unreadable or invalid.
        IncompleteCheckpointError: The checkpoint holds no tensor data.
    """

    step_dir: str

    def __init__(self, path: str | os.PathLike[str], *,
                 storage_options: Mapping[str, Any] | None = None,
                 verify: bool = True) -> None:
        self._options = dict(storage_options or {})
        self.verify = verify
        url = self._locate(path)
        super().__init__(local_path(url) or url)
        self._point_at(url)

    def _locate(self, path: str | os.PathLike[str]) -> str:
        data = locate_tensor_data(directory_str(path), self._options)
        self.step_dir = data.step_dir
        self.file_checksums = dict(data.checksums)
        self._metadata = None
        self.metadata_error = None
        self.__dict__.pop("_verified_files", None)
        return data.url

    def _point_at(self, url: str) -> None:
        local = local_path(url)
        if local is None:
            self.fs = FsspecFiles()
            self.path = self.fs.init_path(url, **self._options)
        else:
            self.fs = LocalFileSystem()
            self.path = self.fs.init_path(local)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; with ``checkpoint_id``, of that step (or tensor) directory."""
        super().reset()
        self._metadata = None
        self.metadata_error = None
        if checkpoint_id is not None:
            self._point_at(self._locate(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path or an fsspec URL."""
        return bool(FsspecFiles.validate_checkpoint_id(os.fspath(checkpoint_id)))


def make_reader(directory: str, storage_options: Mapping[str, Any] | None, *,
                verify: bool = True, shared: SharedReads | None = None,
                metadata: CheckedMetadata | None = None) -> SafeReader:
    """The safe DCP reader of ``directory`` (a local path or fsspec URL; no manifest needed).

    Args:
        directory: The DCP directory.
        storage_options: fsspec options for URLs.
        verify: Check every byte read against its recorded checksum.
        shared: Split the reads of pieces several ranks want among them (see
            :mod:`resumekit.tensors.shared_reads`).
        metadata: ``directory``'s ``.metadata``, already read and checked (on another
            rank): the reader never opens the file.
    """
    reader = SafeReader(directory, storage_options)
    reader.verify = verify
    reader.shared = shared
    reader.checked_metadata = metadata
    return reader


class _Collected:
    """The planner side of :func:`read_whole_items`: each item read into its own buffer."""

    def __init__(self, buffers: dict[ItemKey, Any]) -> None:
        self.buffers = buffers

    @staticmethod
    def _key(item: ReadItem) -> ItemKey:
        index = item.storage_index
        return (index.fqn, None if index.offset is None
                else tuple(int(o) for o in index.offset))

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return cast(torch.Tensor, self.buffers[self._key(item)])

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: the tensor was read into its buffer."""

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.buffers[self._key(item)] = value.getvalue()


def read_whole_items(reader: SafeReader, metadata: Metadata, items: Sequence[ItemKey]
                     ) -> dict[ItemKey, Any]:
    """Read stored ``items`` whole with ``reader``, checked as every read is.

    For :class:`~resumekit.tensors.metadata_parts.MetadataServer`: the rank that answers
    the other ranks' requests reads the small items they ask for whole, once for all.

    Returns:
        Per item, a tensor of its stored chunk's size (a tensor item) or its stored bytes
        (a non-tensor value).
    """
    stored = metadata.state_dict_metadata
    buffers: dict[ItemKey, Any] = {}
    reads: list[ReadItem] = []
    for key, offsets in items:
        entry = stored[key]
        if offsets is None:
            reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)),
                                  storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            continue
        if not isinstance(entry, TensorStorageMetadata):  # the caller chose a tensor's chunk
            raise CorruptCheckpointError(
                f"{key}: asked for its chunk at {list(offsets)}, but .metadata stores it as "
                f"{type(entry).__name__}, not a tensor", key=key)
        index = MetadataIndex(key, torch.Size(offsets))
        buffers[(key, offsets)] = torch.empty(entry.size, dtype=entry.properties.dtype)
        reads.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index,
                              dest_offsets=torch.Size((0,) * len(offsets)),
                              storage_index=index,
                              storage_offsets=torch.Size((0,) * len(offsets)),
                              lengths=entry.size))
    reader.set_up_storage_reader(metadata, False)
    reader.read_data(LoadPlan(reads), cast(LoadPlanner, _Collected(buffers))).wait()
    return buffers


def load_plain_value(directory: str, fqn: str, value: io.BytesIO) -> Any:
    """Load one non-tensor value with ``weights_only=True``: never code from a checkpoint.

    Stock DCP unpickles non-tensor values (learning rates, ``param_groups``) with
    ``torch.load(weights_only=False)``; both load planners here read them through this.
    """
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{directory}: value {fqn!r} is not a plain Python value and would "
            f"need unrestricted unpickling ({error})",
            path=directory,
            key=fqn,
        ) from error


