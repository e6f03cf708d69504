"""CPU staging buffers for asynchronous saves: a state copied once, written in the background."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from resumekit import _compat
from resumekit.tensors.raw import aligned_empty

__all__ = ["CpuStager"]


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
    """

    def __init__(self, *, pin_memory: bool | None = None, page_aligned: bool = True) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._aligned = page_aligned
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self._wrappers: dict[tuple[str, ...], tuple[DTensor, torch.Tensor, Any]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def close(self) -> None:
        """Release every buffer (the next :meth:`stage` allocates afresh)."""
        self._buffers.clear()
        self._wrappers.clear()

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
        before = self.nbytes
        seen: set[int] = set()
        for key, value in state_dict.items():
            self._prepare(value, (str(key),), seen)
        return self.nbytes - before

    def _prepare(self, value: Any, path: tuple[str, ...], seen: set[int]) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:  # tied weights share one buffer, as in stage()
                return
            seen.add(id(value))
            local = value.to_local() if isinstance(value, DTensor) else value
            self._buffer_for(local, path, touch=True)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._prepare(v, (*path, str(k)), seen)
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                self._prepare(v, (*path, str(i)), seen)
        elif isinstance(value, Stateful) and not isinstance(value, type):
            self._prepare(value.state_dict(), path, seen)

    def _buffer_for(self, source: torch.Tensor, path: tuple[str, ...], *,
                    touch: bool = False) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = (aligned_empty(source.shape, source.dtype, pin_memory=self._pin)
                      if self._aligned else
                      torch.empty(source.shape, dtype=source.dtype, pin_memory=self._pin))
            if touch and buffer.numel():
                buffer.view(-1).view(torch.uint8).zero_()  # every page mapped now
            self._buffers[path] = buffer
            self._wrappers.pop(path, None)
        return buffer

    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Return a copy of ``state_dict`` whose tensors live in this stager's CPU buffers.

        Args:
            state_dict: Nested dicts/lists/tuples of tensors, ``DTensor``s, ``Stateful``s
                and other (deep-copyable) values.

        Returns:
            The same structure, detached from the originals.
        """
        seen: dict[int, tuple[Any, Any]] = {}
        staged = {
            key: self._stage(value, (str(key),), seen) for key, value in state_dict.items()
        }
        if any(
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
        if isinstance(value, Stateful) and not isinstance(value, type):
            return self._stage(value.state_dict(), path, seen)
        return copy.deepcopy(value)

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
