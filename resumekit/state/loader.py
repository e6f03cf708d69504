"""A ``DataLoader``'s resumable position: what ``data=loader`` saves and restores.

:class:`LoaderPosition` adopts the trainer's own ``DataLoader`` (or torchdata's
``StatefulDataLoader``) so that the loop the documentation shows resumes bit for bit as
written, with no ``sampler.advance()`` calls and no ``generator=`` argument:

* **the generator**: ``iter(loader)`` draws its workers' base seed from
  ``loader.generator``, or from torch's *global* generator when it has none. The global
  one is part of the checkpoint, so an uninterrupted run and a resumed one would draw
  that seed at different points of the global stream and every later random number
  (dropout masks) would differ. A loader without a generator is given one, seeded from
  ``torch.initial_seed()`` and the rank (the global stream is not consumed). The state
  saved is the generator's as it was just before the last draw of a base seed (the
  iteration in progress, or the one that started persistent workers), so the resumed
  ``iter(loader)`` draws the same base seed again and later epochs the same seeds as the
  uninterrupted run. A generator the user set is saved and restored the same way: it
  must serve the loader only.
* **the position**: the instance's class is swapped for a subclass made here whose
  ``__iter__`` wraps the parent's (public API only); each batch handed to the loop
  advances the loader's resumable sampler by that batch's samples (``batch_size``, or
  what is left of this rank's share for a last partial batch; one item for a
  :class:`~resumekit.state.sampler.SkipAheadSampler` used as ``batch_sampler``). Batches that
  workers prefetched but the loop has not taken do not count. A batch handed to the loop
  counts as consumed by the next save, so the loop must train it before ``step_end``
  and must not fetch the next batch before ``step_end``. A ``sampler.advance()`` made by
  the loop as well would count batches twice: it is refused at the next batch or save.
* **torchdata's StatefulDataLoader** keeps its own position (``state_dict()``, batches
  handed to the loop); only the generator is added.

A loader whose position cannot be saved (a plain ``SequentialSampler``/``RandomSampler``,
torch's ``DistributedSampler``, an ``IterableDataset``) is refused when adopted, naming
what to pass instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader

from resumekit.errors import ConfigurationError, IncompatibleCheckpointError
from resumekit.state.sampler import ResumableDistributedSampler, SkipAheadSampler

__all__ = ["LOADER_STATE_KIND", "LoaderPosition"]

#: ``kind`` of the state a :class:`LoaderPosition` saves (a sampler's state has none).
LOADER_STATE_KIND = "resumekit.DataLoader/1"

_Target = ResumableDistributedSampler | SkipAheadSampler[Any]

# Seeds of adopted generators stay below 2**63: manual_seed takes any of them.
_SEED_RANGE = 2**63


class LoaderPosition:
    """The resumable position of one ``DataLoader``: generator, sampler, batches taken.

    Args:
        loader: The loader the training loop iterates (``for batch in loader``). Its
            class is swapped for a subclass that counts the batches it hands out; it is
            given a ``torch.Generator`` when it has none.
        rank: This process's rank, to seed an adopted generator (default: the default
            process group's rank, or 0).

    Raises:
        ConfigurationError: The loader's position cannot be saved: its sampler (or batch
            sampler) is not resumable and it is not a ``StatefulDataLoader``.
    """

    def __init__(self, loader: DataLoader[Any], *, rank: int | None = None) -> None:
        self.loader = loader
        self._stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None))
        self._target: _Target | None = None
        self._per_batch = 0
        if not self._stateful:
            self._target, self._per_batch = _counted(loader)
        if loader.generator is None:
            own = rank if rank is not None else (
                dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
            generator = torch.Generator()
            generator.manual_seed((torch.initial_seed() + own) % _SEED_RANGE)
            loader.generator = generator
        self.generator: torch.Generator = loader.generator
        # The generator's state just before the last base-seed draw (None: no draw yet).
        self._before_draw: torch.Tensor | None = None
        self._expected = self._position()
        _swap_class(loader, self)

    # -- what the loop does -------------------------------------------------------------
    def iteration_starting(self) -> torch.Tensor:
        """Called by ``iter(loader)`` before the parent's: the generator's state now."""
        return self.generator.get_state()

    def iteration_started(self, before: torch.Tensor) -> None:
        """Called by ``iter(loader)`` after the parent's: remember a base-seed draw."""
        if not torch.equal(before, self.generator.get_state()):
            self._before_draw = before

    def handed_out(self) -> None:
        """Count one batch handed to the loop: advance the sampler by its samples."""
        if self._target is None:
            return
        self._check_unmoved()
        if isinstance(self._target, SkipAheadSampler) and self._per_batch == 0:
            self._target.advance(1)  # a batch sampler: one item is one batch
        else:
            count = self._per_batch
            left = _left(self._target)
            self._target.advance(count if left is None else min(count, left))
        self._expected = self._position()

    # -- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the sampler's (or StatefulDataLoader's) and the generator's.

        Raises:
            ConfigurationError: The sampler moved without this loader (``advance()``
                called by the loop as well).
        """
        self._check_unmoved()
        position = self.loader.state_dict() if self._stateful else None  # type: ignore[attr-defined]
        return {
            "kind": LOADER_STATE_KIND,
            "sampler": None if self._target is None else self._target.state_dict(),
            "loader": position,
            "generator": (self.generator.get_state() if self._before_draw is None
                          else self._before_draw.clone()),
        }

    def load_state_dict(self, state: Mapping[str, Any],
                        generator: Mapping[str, Any] | None = None) -> None:
        """Resume at a saved position.

        Args:
            state: What :meth:`state_dict` returned (on this rank, or on rank 0 when the
                world size changed), or a sampler's own state (a checkpoint written with
                ``data=sampler``): then only the sampler is restored.
            generator: The saved state whose generator this rank takes (this rank's own;
                default ``state``); an empty one, or a sampler's state, leaves the
                generator as it is.

        Raises:
            IncompatibleCheckpointError: The state is not one this loader can take.
        """
        ours = state.get("kind") == LOADER_STATE_KIND
        if not ours and self._target is None:
            raise IncompatibleCheckpointError(
                "the checkpoint's data position is a sampler's, not the state of a "
                f"{type(self.loader).__name__}: restore with the data= the checkpoint "
                "was written with", key="data")
        saved = state.get("loader" if self._stateful else "sampler") if ours else state
        if saved is None:
            raise IncompatibleCheckpointError(
                "the checkpoint's data position was written by another kind of data= "
                f"than this run's {type(self.loader).__name__} ("
                + ("a DataLoader over a resumable sampler)" if self._stateful
                   else "a StatefulDataLoader)"), key="data")
        if self._stateful:
            self.loader.load_state_dict(saved)  # type: ignore[attr-defined]
        else:
            assert self._target is not None
            self._target.load_state_dict(saved)
        seeds = (state if generator is None else generator).get("generator")
        if isinstance(seeds, torch.Tensor):
            self.generator.set_state(seeds)
        self._before_draw = None
        self._expected = self._position()

    @property
    def keeps_global_position(self) -> bool:
        """True when the position re-partitions over another world size."""
        return isinstance(self._target, ResumableDistributedSampler)

    # -- internals ----------------------------------------------------------------------
    def _position(self) -> tuple[int, int] | None:
        target = self._target
        return None if target is None else (target.epoch, target.consumed)

    def _check_unmoved(self) -> None:
        now, expected = self._position(), self._expected
        if now is None or expected is None or now[0] != expected[0]:
            self._expected = now  # nothing counted, or set_epoch(): a new epoch
            return
        if now[1] != expected[1]:
            raise ConfigurationError(
                f"the {type(self._target).__name__} of data=DataLoader moved from "
                f"{expected[1]} to {now[1]} consumed in epoch {now[0]} without the loader: "
                "resumekit already advances it by every batch the loop takes, so a "
                "sampler.advance() in the loop counts batches twice; remove the advance() "
                "calls (or pass data=sampler to count them yourself)",
                name="data", value=type(self.loader).__name__)


def _counted(loader: DataLoader[Any]) -> tuple[_Target, int]:
    """The resumable sampler a loader's batches advance, and the samples per batch.

    ``0`` samples per batch: the target is a batch sampler, advanced by one per batch.
    """
    batches = loader.batch_sampler
    if batches is None:  # no automatic batching: each item is one sample
        sampler: Any = loader.sampler
        per_batch = 1
    elif isinstance(batches, SkipAheadSampler):
        return batches, 0
    elif isinstance(batches, BatchSampler):
        sampler, per_batch = batches.sampler, batches.batch_size
    else:
        sampler, per_batch = batches, 0
    if isinstance(sampler, (ResumableDistributedSampler, SkipAheadSampler)):
        return sampler, per_batch
    kind = type(sampler).__name__
    raise ConfigurationError(
        f"data={type(loader).__name__} cannot be checkpointed: its "
        f"{'batch sampler' if per_batch == 0 else 'sampler'} {kind} has no resumable "
        "position; build it with sampler=resumekit.ResumableDistributedSampler(dataset, "
        "...) (in place of torch's DistributedSampler, RandomSampler or the default "
        "SequentialSampler), or sampler=resumekit.wrap_sampler(sampler) (batch_sampler="
        "wrap_sampler(batch_sampler) for a batch sampler); for an IterableDataset pass "
        "torchdata's StatefulDataLoader", name="data", value=kind)


def _left(sampler: _Target) -> int | None:
    """Samples this rank has left in the epoch; None when the sampler cannot say."""
    try:
        return sampler.remaining
    except TypeError:
        return None


class _CountingIterator:
    """The iterator ``iter(loader)`` returns: the parent's, counting what it hands out."""

    def __init__(self, inner: Iterator[Any], position: LoaderPosition) -> None:
        self._inner = inner
        self._position = position

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._position.handed_out()
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


def _swap_class(loader: DataLoader[Any], position: LoaderPosition) -> None:
    """Give ``loader`` a class whose ``__iter__`` reports to ``position``."""
    base: type[Any] = getattr(type(loader), "_resumekit_base", type(loader))

    def __iter__(self: DataLoader[Any]) -> _CountingIterator:
        before = position.iteration_starting()
        inner = base.__iter__(self)
        position.iteration_started(before)
        return _CountingIterator(inner, position)

    loader.__class__ = type(base.__name__, (base,), {
        "__iter__": __iter__, "_resumekit_base": base,
        "__module__": base.__module__, "__qualname__": base.__qualname__})
