"""A rank's tensor bytes written by another process: the request, the reply, both ends.

DCP plans a save on the trainer (local plan, the global plan's collectives, ``.metadata``
on the coordinating rank); only ``write_data``, where every byte is hashed and written,
is handed to a writer process. :class:`ShippedRawTensorWriter` and
:class:`ShippedCheckedDcpWriter` are the raw and DCP writers with that one method
replaced: each item's data is described, not copied (a tensor staged in a
:class:`~resumekit.tensors.staging.SharedSegment` travels as the segment's key and the
tensor's place in it; a blob travels as its bytes) and the :class:`WriteRequest` goes to a
:class:`RemoteWrites` (:class:`resumekit.background.process.WriterProcess`). There
:func:`perform` builds the same writer and runs its own ``write_data`` over the mapped
segments, so the files, their checksums and the :class:`WriteReply` are the ones the
writer would have produced on the trainer.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resumekit.tensors.raw import CheckedDcpWriter, RawTensorWriter, WrittenFile
from resumekit.tensors.staging import SharedSegment

__all__ = [
    "RemoteWrites",
    "SharedTensor",
    "ShippedCheckedDcpWriter",
    "ShippedRawTensorWriter",
    "WriteReply",
    "WriteRequest",
    "WriterSpec",
    "perform",
]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class WriterSpec:
    """How to build the writer on the other side: the arguments the trainer's was built with.

    Attributes:
        kind: ``"raw"`` (:class:`RawTensorWriter`) or ``"dcp"`` (:class:`CheckedDcpWriter`).
        path: The directory (or URL) written into.
        thread_count: Writer threads per rank (raw: parts of its one file; DCP: files).
        sync_files: fsync each file (local paths).
        background: Writer threads at idle CPU priority (raw writer).
        storage_options: fsspec options (DCP writer at a URL).
    """

    kind: Literal["raw", "dcp"]
    path: str
    thread_count: int
    sync_files: bool
    background: bool = False
    storage_options: dict[str, Any] | None = None

    def build(self) -> RawTensorWriter | CheckedDcpWriter:
        """The writer these arguments make."""
        if self.kind == "raw":
            return RawTensorWriter(self.path, thread_count=self.thread_count,
                                   sync_files=self.sync_files, background=self.background)
        return CheckedDcpWriter(self.path, thread_count=self.thread_count,
                                sync_files=self.sync_files,
                                storage_options=self.storage_options)


@dataclass(frozen=True)
class SharedTensor:
    """A tensor that lies in a shared segment: where, and how to view it.

    Attributes:
        segment: The segment's :attr:`~resumekit.tensors.staging.SharedSegment.key`.
        offset: Elements from the segment's start to the tensor's first (in ``dtype``).
        dtype: Its dtype.
        shape: Its shape.
        stride: Its strides (elements).
    """

    segment: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def view(self, segments: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The tensor, over the mapping of its segment (``segments[key]``, ``uint8``)."""
        return segments[self.segment].view(self.dtype).as_strided(
            self.shape, self.stride, self.offset)


@dataclass(frozen=True)
class WriteRequest:
    """One rank's ``write_data``: the final local plan and each item's data, in order.

    Attributes:
        writer: The writer to build.
        plan: DCP's final local plan for this rank.
        data: Per item of ``plan.items``: a :class:`SharedTensor`, the bytes of a blob,
            or a tensor sent by value (one staged outside every segment).
        segments: Keys of every segment the sender still uses; the receiver unmaps the
            others.
    """

    writer: WriterSpec
    plan: SavePlan
    data: list[SharedTensor | bytes | torch.Tensor]
    segments: tuple[int, ...]


@dataclass(frozen=True)
class WriteReply:
    """What the writer's ``write_data`` produced: its results and the files it wrote."""

    results: list[WriteResult]
    written: list[WrittenFile]


class RemoteWrites(Protocol):
    """Where a shipped writer sends its :class:`WriteRequest` (the writer process)."""

    def segments(self) -> Sequence[SharedSegment]:
        """The shared segments staged tensors may lie in (sent before a request)."""

    def write(self, request: WriteRequest) -> WriteReply:
        """Have ``request`` written; its errors are raised here."""


class _ShippedWrites:
    """Mixin for a resumekit writer: ``write_data`` runs in another process."""

    spec: WriterSpec
    remote: RemoteWrites
    written: list[WrittenFile]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Describe each item's data, have the remote side write it; its files reported.

        Raises:
            Exception: What the remote side raised (see :class:`RemoteWrites`).
        """
        segments = list(self.remote.segments())
        starts = {segment.data.data_ptr(): segment for segment in segments}
        data = [_described(planner.resolve_data(item), starts) for item in plan.items]
        reply = self.remote.write(WriteRequest(
            writer=self.spec, plan=plan, data=data,
            segments=tuple(segment.key for segment in segments)))
        self.written = list(reply.written)
        # The results name the plan's own index objects again, as a writer here would:
        # .metadata pickles each object once, so its bytes depend on which objects repeat.
        own = {item.index: item.index for item in plan.items}
        results = [dataclasses.replace(result, index=own.get(result.index, result.index))
                   for result in reply.results]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class ShippedRawTensorWriter(_ShippedWrites, RawTensorWriter):
    """:class:`RawTensorWriter` whose bytes another process writes (``remote``)."""

    def __init__(self, spec: WriterSpec, remote: RemoteWrites) -> None:
        super().__init__(spec.path, thread_count=spec.thread_count,
                         sync_files=spec.sync_files, background=spec.background)
        self.spec, self.remote = spec, remote


class ShippedCheckedDcpWriter(_ShippedWrites, CheckedDcpWriter):
    """:class:`CheckedDcpWriter` whose bytes another process writes (``remote``)."""

    def __init__(self, spec: WriterSpec, remote: RemoteWrites) -> None:
        super().__init__(spec.path, thread_count=spec.thread_count,
                         sync_files=spec.sync_files, storage_options=spec.storage_options)
        self.spec, self.remote = spec, remote


def shipped(spec: WriterSpec, remote: RemoteWrites) -> FileSystemWriter:
    """The writer ``spec`` describes, its ``write_data`` sent to ``remote``."""
    if spec.kind == "raw":
        return ShippedRawTensorWriter(spec, remote)
    return ShippedCheckedDcpWriter(spec, remote)


def _described(data: Any, starts: Mapping[int, SharedSegment]
               ) -> SharedTensor | bytes | torch.Tensor:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    tensor: torch.Tensor = data.detach()
    if tensor.device.type != "cpu":
        raise TypeError(f"a shipped write gets CPU tensors (staged), not {tensor.device}")
    segment = starts.get(tensor.untyped_storage().data_ptr())
    if segment is None:  # not staged in shared memory: sent by value (a copy)
        logger.debug("resumekit: a %s tensor of %d bytes is not in shared memory; sent as a "
                     "copy", tensor.dtype, tensor.nbytes)
        return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes \
            else tensor
    return SharedTensor(segment.key, int(tensor.storage_offset()), tensor.dtype,
                        tuple(tensor.shape), tuple(tensor.stride()))


class _Resolved:
    """The planner of a remote ``write_data``: each item's data, as received."""

    def __init__(self, plan: SavePlan, data: Sequence[Any]) -> None:
        self._data = {id(item): value for item, value in zip(plan.items, data, strict=True)}

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self._data[id(item)]  # type: ignore[no-any-return]


def perform(request: WriteRequest, segments: Mapping[int, torch.Tensor]) -> WriteReply:
    """Write ``request`` here, its shared tensors viewed over ``segments`` (key: mapping).

    Returns:
        The writer's results and written files.

    Raises:
        StorageError: As the writer's ``write_data`` (a file could not be written).
    """
    data = [io.BytesIO(value) if isinstance(value, bytes)
            else value.view(segments) if isinstance(value, SharedTensor) else value
            for value in request.data]
    writer = request.writer.build()
    results = writer.write_data(request.plan, _Resolved(request.plan, data))  # type: ignore[arg-type]
    return WriteReply(results=results.value(), written=list(writer.written))
