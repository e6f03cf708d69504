"""CPU staging buffers for asynchronous saves: a state copied once, written in the background.

With ``shared=True`` the buffers are carved out of :class:`SharedSegment` s: anonymous
shared memory (``memfd``) that the background writer process maps too, so the staged
state reaches it without a second copy (:mod:`resumekit.background.process`).
"""

from __future__ import annotations

import copy
import math
import mmap
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from resumekit import _compat
from resumekit.tensors.raw import aligned_empty
from resumekit.tensors.raw.format import ALIGNMENT

__all__ = ["CpuStager", "SharedSegment"]

#: Leaves staged as they are: immutable (``copy.deepcopy`` returns them) and never a
#: ``Stateful``, whose ``isinstance`` check (a runtime protocol) costs tens of
#: microseconds a leaf: an optimizer's hyperparameters made it half a small state's
#: staging (issue 38.2).
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None)})


class SharedSegment:
    """Anonymous shared memory (a ``memfd``) mapped here, as one ``uint8`` tensor.

    Its descriptor (:attr:`fd`) can be handed to another process (``socket.send_fds``),
    which maps the same pages: what one process writes there the other reads, no copy.
    The memory is freed when the last descriptor is closed and the last mapping is gone,
    so a process that dies leaves nothing behind (no file in ``/dev/shm``). Linux only.

    Args:
        nbytes: Its size (> 0), rounded up to whole pages.
        key: A number naming it between the processes, never reused by its owner.

    Attributes:
        key: The number naming it.
        nbytes: Its size.
        data: The mapping, as a ``uint8`` tensor of ``nbytes`` elements (page-aligned).
        fd: Its descriptor (close-on-exec); -1 once closed.
    """

    def __init__(self, nbytes: int, key: int) -> None:
        self.key = key
        self.nbytes = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        self.fd = os.memfd_create("resumekit-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.data = attach(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        """Close the descriptor; the memory lives on while :attr:`data` (or a view) does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(fd: int, nbytes: int) -> torch.Tensor:
    """Map ``nbytes`` of the shared memory ``fd`` (a :class:`SharedSegment`'s) here.

    Returns:
        The mapping as a ``uint8`` tensor, which keeps it mapped while it (or a view of
        it) lives; ``fd`` may be closed at once.
    """
    mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8)


class CpuStager:
    """Copies a state dict into CPU buffers that are allocated once and reused.

    An asynchronous save stages the state (a fast device-to-host copy), lets training
    mutate the originals, and writes the staged copy in the background. Buffers are keyed
    by their position in the state dict and reused while shape and dtype stay the same;
    they are pinned when CUDA is available so device copies run asynchronously.
    ``DTensor``s stay ``DTensor``s with the same mesh and placements over a CPU local
    shard. Non-tensor leaves are deep-copied; ``Stateful`` leaves are replaced by a staged
    copy of their ``state_dict()`` (what DCP would save of them).

    The staged dict aliases the buffers: wait for the save of one staged dict to finish
    before staging again.

    Args:
        pin_memory: Pin the buffers; ``None`` pins exactly when CUDA is available.
        page_aligned: Start every buffer on a page boundary, so the raw tensor writer
            sends it to a local disk with direct I/O without copying it. Leave it off for
            fsspec URLs: DCP's own writer copies a tensor whose storage is larger than it.
        shared: Carve the buffers out of :class:`SharedSegment` s (page-aligned, never
            pinned), one per :meth:`prepare` or :meth:`stage` that needs new buffers, for
            a writer in another process (:meth:`segments`). Linux only.
    """

    def __init__(self, *, pin_memory: bool | None = None, page_aligned: bool = True,
                 shared: bool = False) -> None:
        self._pin = (torch.cuda.is_available() if pin_memory is None else pin_memory) \
            and not shared
        self._aligned = page_aligned
        self._shared = shared
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self._wrappers: dict[tuple[str, ...], tuple[DTensor, torch.Tensor, Any]] = {}
        self._segment_of: dict[tuple[str, ...], SharedSegment] = {}
        self._segments: list[SharedSegment] = []  # every segment with an open descriptor
        self._carved = 0  # segments made so far: the next one's key

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    @property
    def shared(self) -> bool:
        """Whether the buffers live in shared memory (``shared=True``)."""
        return self._shared

    def segments(self) -> list[SharedSegment]:
        """The shared-memory segments the current buffers live in (``shared=True``)."""
        return list(self._segments)

    def close(self) -> None:
        """Release every buffer (the next :meth:`stage` allocates afresh)."""
        self._buffers.clear()
        self._wrappers.clear()
        segments, self._segments, self._segment_of = self._segments, [], {}
        for segment in segments:
            segment.close()

    def prepare(self, state_dict: Mapping[str, Any]) -> int:
        """Allocate and touch the buffers :meth:`stage` will use for ``state_dict``.

        The first stage of a state otherwise pays for the allocation and for the first
        write to every page of it (a page fault each; pinning, with CUDA), which made the
        first asynchronous save block many times longer than a copy. Nothing is copied;
        buffers that already fit are kept. Call it where a pause is expected (building a
        manager, restoring), with the state that will be staged.

        Args:
            state_dict: The same structure :meth:`stage` will get (or a part of it: a
                missing part is allocated when first staged).

        Returns:
            Bytes newly allocated.
        """
        with torch.no_grad():
            return self._allocate(state_dict, touch=True)

    def _allocate(self, state_dict: Mapping[str, Any], *, touch: bool) -> int:
        """Allocate every buffer ``state_dict`` needs and lacks (shared: in one segment)."""
        before = self.nbytes
        missing: dict[tuple[str, ...], torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in state_dict.items():
            self._missing(value, (str(key),), seen, missing)
        if self._shared:
            self._carve(missing, touch=touch)
        else:
            for path, source in missing.items():
                self._buffer_for(source, path, touch=touch)
        return self.nbytes - before

    def _missing(self, value: Any, path: tuple[str, ...], seen: set[int],
                 missing: dict[tuple[str, ...], torch.Tensor]) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:  # tied weights share one buffer, as in stage()
                return
            seen.add(id(value))
            local = value.to_local() if isinstance(value, DTensor) else value
            if not _fits(self._buffers.get(path), local):
                missing[path] = local
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._missing(v, (*path, str(k)), seen, missing)
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                self._missing(v, (*path, str(i)), seen, missing)
        elif type(value) not in _ATOMS and isinstance(value, Stateful) and not isinstance(
                value, type):
            self._missing(value.state_dict(), path, seen, missing)

    def _carve(self, missing: Mapping[tuple[str, ...], torch.Tensor], *, touch: bool) -> None:
        """Place the ``missing`` buffers in one new shared segment, each page-aligned."""
        offsets: dict[tuple[str, ...], int] = {}
        end = 0
        for path, source in missing.items():
            nbytes = math.prod(source.shape) * source.dtype.itemsize
            if nbytes:
                offsets[path] = end
                end += -(-nbytes // ALIGNMENT) * ALIGNMENT
        segment = None
        if end:
            self._carved += 1
            segment = SharedSegment(end, key=self._carved)
        if segment is not None and touch:
            segment.data.zero_()  # every page mapped now
        for path, source in missing.items():
            start = offsets.get(path)
            if segment is None or start is None:
                buffer = torch.empty(source.shape, dtype=source.dtype)
            else:
                nbytes = math.prod(source.shape) * source.dtype.itemsize
                buffer = segment.data[start:start + nbytes].view(source.dtype).view(
                    tuple(source.shape))
            self._replace(path, buffer)
            if segment is not None and start is not None:
                self._segment_of[path] = segment
        if segment is not None:
            self._segments.append(segment)
        self._release_unused()

    def _replace(self, path: tuple[str, ...], buffer: torch.Tensor) -> None:
        self._buffers[path] = buffer
        self._wrappers.pop(path, None)
        self._segment_of.pop(path, None)

    def _release_unused(self) -> None:
        """Close the descriptors of segments no buffer lives in any more."""
        live = {id(segment) for segment in self._segment_of.values()}
        for segment in self._segments:
            if id(segment) not in live:
                segment.close()
        self._segments = [segment for segment in self._segments if id(segment) in live]

    def _buffer_for(self, source: torch.Tensor, path: tuple[str, ...], *,
                    touch: bool = False) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if not _fits(buffer, source):
            if self._shared:
                self._carve({path: source}, touch=touch)
                return self._buffers[path]
            buffer = (aligned_empty(source.shape, source.dtype, pin_memory=self._pin)
                      if self._aligned else
                      torch.empty(source.shape, dtype=source.dtype, pin_memory=self._pin))
            if touch and buffer.numel():
                buffer.view(-1).view(torch.uint8).zero_()  # every page mapped now
            self._replace(path, buffer)
        assert buffer is not None
        return buffer

    def stage(self, state_dict: Mapping[str, Any], *, synchronize: bool = True
              ) -> dict[str, Any]:
        """Return a copy of ``state_dict`` whose tensors live in this stager's CPU buffers.

        Args:
            state_dict: Nested dicts/lists/tuples of tensors, ``DTensor``s, ``Stateful``s
                and other (deep-copyable) values.
            synchronize: Wait for the device-to-host copies (``torch.cuda.synchronize``).
                False: they are queued on the current stream, which the caller waits for
                (the emergency capture's own stream).

        Returns:
            The same structure, detached from the originals.
        """
        seen: dict[int, tuple[Any, Any]] = {}
        # Without autograd, DTensor.to_local() is the local shard itself, not a view made
        # by an autograd function (tens of microseconds each: most of a small state's
        # staging); the copies are the same.
        with torch.no_grad():
            if self._shared:  # every new buffer in one segment, not one segment each
                self._allocate(state_dict, touch=False)
            staged = {key: self._stage(value, (str(key),), seen)
                      for key, value in state_dict.items()}
        if synchronize and any(
            isinstance(source, torch.Tensor) and source.device.type == "cuda"
            for source, _ in seen.values()
        ):
            torch.cuda.synchronize()
        return staged

    def _stage(self, value: Any, path: tuple[str, ...], seen: dict[int, tuple[Any, Any]]) -> Any:
        if isinstance(value, torch.Tensor):
            hit = seen.get(id(value))
            if hit is not None and hit[0] is value:  # tied weights stay tied
                return hit[1]
            staged = (
                self._stage_dtensor(value, path)
                if isinstance(value, DTensor)
                else self._copy_into(value.detach(), path)
            )
            seen[id(value)] = (value, staged)
            return staged
        if isinstance(value, Mapping):
            return {k: self._stage(v, (*path, str(k)), seen) for k, v in value.items()}
        if type(value) in (list, tuple):
            items = [self._stage(v, (*path, str(i)), seen) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        atom = type(value) in _ATOMS  # immutable: its own copy (and never a Stateful)
        if not atom and isinstance(value, Stateful) and not isinstance(value, type):
            return self._stage(value.state_dict(), path, seen)
        return value if atom else copy.deepcopy(value)

    def _copy_into(self, source: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor:
        buffer = self._buffer_for(source, path)
        buffer.copy_(source, non_blocking=self._pin and source.device.type == "cuda")
        return buffer

    def _stage_dtensor(self, value: DTensor, path: tuple[str, ...]) -> DTensor:
        local = self._copy_into(value.to_local().detach(), path)
        layout = (value.device_mesh, tuple(value.placements), value.shape, value.stride())
        kept = self._wrappers.get(path)
        if kept is None or kept[1] is not local or kept[2] != layout:
            # Built over the buffer as it is (DTensor.from_local would move a CPU shard to
            # a CUDA mesh's device): DCP saves each rank's local shard as it is.
            kept = (_compat.dtensor_over(local, value), local, layout)
            self._wrappers[path] = kept
        return kept[0]


def _fits(buffer: torch.Tensor | None, source: torch.Tensor) -> bool:
    return buffer is not None and buffer.shape == source.shape and buffer.dtype == source.dtype
