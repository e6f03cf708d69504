"""A distributed sampler that resumes mid-epoch, on any number of ranks.

:class:`ResumableDistributedSampler` orders an epoch the way
``torch.utils.data.DistributedSampler`` does (``torch.randperm`` with a generator seeded
``seed + epoch``) but keeps its position as *global* samples consumed in the current
epoch, so a checkpoint taken mid-epoch resumes exactly where it stopped, even when the
resumed job has a different number of ranks.

The position invariant
----------------------
Let ``order`` be the epoch's permutation of ``range(len(dataset))``, ``W`` the world size
and ``c`` the global samples consumed so far this epoch. Every rank has consumed the same
number of samples (training steps are collective), and the consumed samples are exactly
``order[:c]``. The remaining tail ``order[c:]`` is dealt round-robin: rank ``r`` next
yields positions ``c + r, c + r + W, c + r + 2W, ...``. After each rank consumes ``k``
more samples, ``c`` grows by ``k * W`` and the consumed set is again a prefix of
``order``. A resume on ``W'`` ranks deals the same tail ``order[c:]`` over ``W'`` ranks:
no sample is repeated and none is skipped.

The tail of an epoch (every rank must yield the same number of samples, or collectives
hang): with ``drop_last=False`` the remaining tail is padded to a multiple of the world
size with samples from the start of the epoch's order (as ``DistributedSampler`` pads),
so at most ``W - 1`` samples are seen twice in the epoch; with ``drop_last=True`` the
last ``len(tail) % W`` samples of the order are left out of this epoch. A resume on a
different world size applies the same rule to what remains, with the new ``W``.

Why the trainer reports progress
--------------------------------
``DataLoader`` pulls indices ahead of training (prefetching, ``num_workers > 0``), so the
number of indices the sampler has *yielded* is larger than the number of samples whose
gradients are in the weights. The trainer is the only party that knows when a micro-batch
is really consumed, so it calls ``sampler.advance(n)`` with the number of samples of the
micro-batch this rank just trained on. Deriving the position from the step number at save
time instead would need the batch size, the gradient-accumulation factor, the epoch length
and the size of every partial batch, and breaks as soon as any of them varies;
``advance`` needs none of them.

Typical loop::

    sampler = ResumableDistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=4)
    # the checkpoint manager saves sampler.state_dict() and calls load_state_dict()
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)  # the restored epoch: keeps its position
        for inputs, targets in loader:
            train_step(inputs, targets)
            sampler.advance(inputs.shape[0])  # this micro-batch is now in the weights

The state (:meth:`ResumableDistributedSampler.state_dict`) is the same on every rank and
holds only ints and bools, so any rank's copy (rank 0's, when resharding) restores any
rank, and ``torch.load(weights_only=True)`` reads it back.

Composing with other loaders
----------------------------
* **Map-style dataset with DataLoader**: use :class:`ResumableDistributedSampler`. It is
  the only option here that survives a change of world size.
* **Your own sampler or batch sampler**: :func:`wrap_sampler` returns a
  :class:`SkipAheadSampler` that counts what the trainer reports through ``advance`` and,
  on resume, skips that many items of the inner sampler's output (indices, or batches for
  a batch sampler) without touching the dataset. The inner sampler must produce the same
  order for the same epoch (seed it from its epoch, as ``DistributedSampler`` does), and
  the world size must not change: a skip count cannot re-partition someone else's order.
  A different world size is refused on load.
* **IterableDataset / streaming sources**: the position lives in the stream, not in a
  sampler. Give the object that owns it ``state_dict()`` / ``load_state_dict()`` methods
  (counting what the trainer reports consumed, not what was read ahead) and register it
  with the checkpoint manager as ``"data"``; any object with those two methods is saved
  per rank like this sampler. With ``num_workers > 0`` every worker holds its own copy of
  the dataset, so keep the count in the main process (or use a loader whose state covers
  its workers, such as torchdata's ``StatefulDataLoader``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from itertools import islice
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from resumekit.errors import ConfigurationError, DistributedSetupError, IncompatibleCheckpointError

__all__ = [
    "SAMPLER_STATE_VERSION",
    "ResumableDistributedSampler",
    "SkipAheadSampler",
    "wrap_sampler",
]

SAMPLER_STATE_VERSION = 1
"""Version of the dictionaries the samplers of this module return from ``state_dict``."""

T = TypeVar("T")


def _default_world() -> tuple[int, int]:
    """World size and rank of the default process group; (1, 0) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    declared = os.environ.get("WORLD_SIZE", "1")
    if declared.strip() not in {"", "0", "1"}:
        raise DistributedSetupError(
            f"WORLD_SIZE={declared} but no process group is initialised: call "
            f"init_distributed() before building the sampler, or pass num_replicas and rank",
            variable="WORLD_SIZE",
        )
    return 1, 0


def _state_value(state: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in state:
        raise IncompatibleCheckpointError(
            f"sampler state has no '{key}' (keys: {sorted(state)})",
            key=key,
            differences=[f"{key}: missing"],
        )
    value = state[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise IncompatibleCheckpointError(
            f"sampler state '{key}' is {value!r}, expected {kind.__name__}",
            key=key,
            differences=[f"{key}: {value!r} is not {kind.__name__}"],
        )
    return value


def _check_version(state: Mapping[str, Any]) -> None:
    version = _state_value(state, "version", int)
    if version != SAMPLER_STATE_VERSION:
        raise IncompatibleCheckpointError(
            f"sampler state 'version' is {version}, this resumekit reads "
            f"{SAMPLER_STATE_VERSION} (written by a newer resumekit?)",
            key="version",
            differences=[f"version: {version} != {SAMPLER_STATE_VERSION}"],
        )


def _non_negative(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{name} must be an int >= 0, got {value!r}", name=name, value=value
        )
    return value


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler``'s epoch order, with a global position that reshards.

    Args:
        dataset_or_len: The dataset (anything with ``len``) or its length. Only the
            length is kept; the dataset is never indexed by the sampler.
        num_replicas: World size. Default: the default process group's, or 1 without one.
        rank: This process's rank. Default: the default process group's, or 0 without one.
        shuffle: Permute each epoch (``torch.randperm`` seeded ``seed + epoch``); else
            the order is ``0, 1, 2, ...``.
        seed: Base seed; must be the same on every rank and across resumes.
        drop_last: Leave out the ragged end of the tail instead of padding it (see the
            module docstring).

    Raises:
        ConfigurationError: ``rank`` is outside ``[0, num_replicas)`` or a count is negative.
        DistributedSetupError: ``WORLD_SIZE`` says several ranks but no process group is
            initialised and ``num_replicas``/``rank`` were not given.
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        length = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self._dataset_len = _non_negative("dataset_or_len", length)
        if num_replicas is None or rank is None:
            world, own_rank = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = own_rank if rank is None else rank
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigurationError(
                f"num_replicas must be an int >= 1, got {num_replicas!r}",
                name="num_replicas",
                value=num_replicas,
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ConfigurationError(
                f"rank must be in [0, {num_replicas}), got {rank!r}", name="rank", value=rank
            )
        self._num_replicas = num_replicas
        self._rank = rank
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._consumed = 0

    # ------------------------------------------------------------------ read-only view

    @property
    def epoch(self) -> int:
        """The current epoch (what ``set_epoch`` or ``load_state_dict`` last set)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Global samples consumed this epoch, over all ranks (``dataset_len`` when done)."""
        return self._consumed

    @property
    def num_replicas(self) -> int:
        """The world size this sampler deals the epoch over."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """The rank whose share this sampler yields."""
        return self._rank

    @property
    def dataset_len(self) -> int:
        """The length of the dataset the epoch permutes."""
        return self._dataset_len

    def epoch_order(self) -> list[int]:
        """The whole epoch's order, before it is dealt over the ranks.

        Returns:
            A permutation of ``range(dataset_len)``: ``torch.randperm`` with a CPU
            generator seeded ``seed + epoch`` when shuffling, else the identity.
        """
        order: list[int] = self._order_tensor().tolist()
        return order

    def _order_tensor(self) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._dataset_len)
        generator = torch.Generator()
        generator.manual_seed(self._seed + self._epoch)
        return torch.randperm(self._dataset_len, generator=generator)

    # ------------------------------------------------------------------ Sampler protocol

    def _per_rank_remaining(self) -> int:
        return self._per_rank(self._dataset_len - self._consumed)

    def _per_rank(self, samples: int) -> int:
        if self._drop_last:
            return samples // self._num_replicas
        return math.ceil(samples / self._num_replicas)

    def __len__(self) -> int:
        """This rank's share of a whole epoch, as ``DistributedSampler``'s ``len()``.

        ``ceil(dataset_len / num_replicas)`` (``floor`` with ``drop_last``), whatever the
        position: code written for ``DistributedSampler`` (``steps_per_epoch =
        len(loader)``, a schedule's total) counts the same epochs. After a mid-epoch
        resume the next ``iter()`` yields only the rest of the epoch: :attr:`remaining`.
        """
        return self._per_rank(self._dataset_len)

    @property
    def remaining(self) -> int:
        """Indices the next ``iter()`` yields on this rank: its share of the epoch's rest."""
        return self._per_rank_remaining()

    def __iter__(self) -> Iterator[int]:
        """This rank's share of the remaining tail, fixed when ``iter()`` is called.

        Later ``advance`` calls (made while a ``DataLoader`` still iterates) do not
        change an iteration already started; they change what the next one yields.
        """
        per_rank = self._per_rank_remaining()
        total = per_rank * self._num_replicas
        if total == 0:
            return iter(())
        order = self._order_tensor()
        parts = [order[self._consumed : self._consumed + total]]
        missing = total - parts[0].numel()
        while missing > 0:  # pad from the start of the epoch, cycling if tiny
            parts.append(order[:missing])
            missing -= parts[-1].numel()
        share: list[int] = torch.cat(parts)[self._rank :: self._num_replicas].tolist()
        return iter(share)

    # ------------------------------------------------------------------ progress

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; a new epoch starts at its beginning.

        Setting the epoch the sampler is already in keeps its position: that is how a
        loop ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch)`` resumes
        mid-epoch after ``load_state_dict``. To replay an epoch from its start, set
        another epoch first or load a state with ``consumed=0``.

        Args:
            epoch: The epoch number, the same on every rank.

        Raises:
            ConfigurationError: ``epoch`` is negative.
        """
        _non_negative("epoch", epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def advance(self, num_samples: int) -> None:
        """Record that this rank trained on ``num_samples`` more samples of its share.

        Call it once per consumed micro-batch, after the samples are in the weights and
        before a checkpoint is taken, on every rank with that rank's micro-batch size
        (equal on every rank, as collective training steps require). The global position
        grows by ``num_samples * num_replicas``.

        Args:
            num_samples: Samples in the micro-batch this rank just consumed (not the
                global batch, not the number of tensors in the batch tuple).

        Raises:
            ConfigurationError: ``num_samples`` is negative or more than this rank has
                left in the epoch (the trainer counted something the sampler never gave).
        """
        _non_negative("num_samples", num_samples)
        left = self._per_rank_remaining()
        if num_samples > left:
            raise ConfigurationError(
                f"advance({num_samples}) on rank {self._rank}: only {left} samples of "
                f"epoch {self._epoch} remain for this rank ({self._consumed} of "
                f"{self._dataset_len} consumed globally); call set_epoch() for the next epoch",
                name="num_samples",
                value=num_samples,
            )
        if num_samples == left:
            self._consumed = self._dataset_len  # the epoch is done (padding or drop included)
        else:
            self._consumed += num_samples * self._num_replicas

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """The position, identical on every rank; only ints and bools.

        Returns:
            ``version``, ``epoch``, ``consumed`` (global samples this epoch),
            ``dataset_len``, ``seed``, ``shuffle``, ``drop_last`` and ``num_replicas``
            (the world size that wrote it; informational, a resume may use another).
        """
        return {
            "version": SAMPLER_STATE_VERSION,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "dataset_len": self._dataset_len,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "num_replicas": self._num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position, on this sampler's world size and rank.

        The saved epoch order must be the one this sampler would produce: same dataset
        length, same ``shuffle`` and, when shuffling, same ``seed``. ``drop_last`` and the
        world size may differ; the remaining tail is dealt with this sampler's.

        Args:
            state: What :meth:`state_dict` returned on any rank of the saved run.

        Raises:
            IncompatibleCheckpointError: the state is malformed, from a newer layout, or
                describes another epoch order (``differences`` lists each mismatch).
        """
        _check_version(state)
        epoch = _state_value(state, "epoch", int)
        consumed = _state_value(state, "consumed", int)
        saved_len = _state_value(state, "dataset_len", int)
        saved_seed = _state_value(state, "seed", int)
        saved_shuffle = _state_value(state, "shuffle", bool)
        differences = []
        if saved_len != self._dataset_len:
            differences.append(f"dataset_len: saved {saved_len}, now {self._dataset_len}")
        if saved_shuffle != self._shuffle:
            differences.append(f"shuffle: saved {saved_shuffle}, now {self._shuffle}")
        elif self._shuffle and saved_seed != self._seed:
            differences.append(f"seed: saved {saved_seed}, now {self._seed}")
        if epoch < 0 or not 0 <= consumed <= saved_len:
            differences.append(f"epoch/consumed: {epoch}/{consumed} out of range")
        if differences:
            raise IncompatibleCheckpointError(
                "sampler state describes another epoch order: " + "; ".join(differences),
                key=differences[0].split(":", 1)[0],
                differences=differences,
            )
        self._epoch = epoch
        self._consumed = consumed


class SkipAheadSampler(Sampler[T], Generic[T]):
    """Make any deterministic sampler resumable by skipping what was consumed.

    Counts what the trainer reports through :meth:`advance` and, on the next ``iter()``,
    drops that many items from the front of the inner sampler's output (indices, or
    whole batches for a batch sampler), without touching the dataset. See "Composing
    with other loaders" in the module docstring for when to prefer
    :class:`ResumableDistributedSampler`.

    Args:
        sampler: The inner sampler. It must yield the same order for the same epoch.
        world_size: The world size, recorded so that a resume on another one is refused.
            Default: the default process group's, or 1 without one.
    """

    def __init__(self, sampler: Iterable[T], *, world_size: int | None = None) -> None:
        self._inner = sampler
        self._world_size = _default_world()[0] if world_size is None else world_size
        self._epoch = 0
        self._consumed = 0

    @property
    def inner(self) -> Iterable[T]:
        """The wrapped sampler."""
        return self._inner

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Items of the inner sampler's output consumed this epoch on this rank."""
        return self._consumed

    def __len__(self) -> int:
        """The inner sampler's ``len()``: a whole epoch, whatever the position.

        Raises:
            TypeError: The inner sampler has no ``len()``.
        """
        if not isinstance(self._inner, Sized):
            raise TypeError(f"{type(self._inner).__name__} has no len()")
        return len(self._inner)

    @property
    def remaining(self) -> int:
        """Items the next ``iter()`` yields (needs a sized inner sampler).

        Raises:
            TypeError: The inner sampler has no ``len()``.
        """
        return max(0, len(self) - self._consumed)

    def __iter__(self) -> Iterator[T]:
        """The inner sampler's output after the consumed items (skip fixed at ``iter()``)."""
        return islice(iter(self._inner), self._consumed, None)

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (forwarded to the inner sampler); a new epoch starts at 0.

        Args:
            epoch: The epoch number; setting the current one keeps the position.

        Raises:
            ConfigurationError: ``epoch`` is negative.
        """
        _non_negative("epoch", epoch)
        if epoch != self._epoch:
            self._consumed = 0
        self._epoch = epoch
        set_inner = getattr(self._inner, "set_epoch", None)
        if callable(set_inner):
            set_inner(epoch)

    def advance(self, num_items: int = 1) -> None:
        """Record that the trainer consumed ``num_items`` more items of the inner output.

        Args:
            num_items: Indices consumed (index sampler) or batches (batch sampler).

        Raises:
            ConfigurationError: ``num_items`` is negative.
        """
        self._consumed += _non_negative("num_items", num_items)

    def state_dict(self) -> dict[str, Any]:
        """``version``, ``epoch``, ``consumed``, ``world_size`` and the inner sampler's state.

        Returns:
            A dictionary of plain values; ``inner`` is the inner sampler's own
            ``state_dict()`` when it has one, else ``None``.
        """
        inner_state = getattr(self._inner, "state_dict", None)
        return {
            "version": SAMPLER_STATE_VERSION,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "world_size": self._world_size,
            "inner": inner_state() if callable(inner_state) else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position (same world size only).

        Args:
            state: What :meth:`state_dict` returned on this rank of the saved run.

        Raises:
            IncompatibleCheckpointError: the state is malformed, was written by another
                world size (a skip count cannot be re-partitioned), or its position does
                not fit the inner sampler (more consumed than it yields now: the dataset
                shrank), as :class:`ResumableDistributedSampler` refuses it.
        """
        _check_version(state)
        epoch = _state_value(state, "epoch", int)
        consumed = _state_value(state, "consumed", int)
        world_size = _state_value(state, "world_size", int)
        length = len(self._inner) if isinstance(self._inner, Sized) else None
        if epoch < 0 or consumed < 0 or (length is not None and consumed > length):
            fits = "" if length is None else f" of the {length} the sampler yields now"
            raise IncompatibleCheckpointError(
                f"sampler state 'consumed' is {consumed} in epoch {epoch}, a position that "
                f"does not fit this sampler ({consumed} items consumed{fits}; the dataset "
                "changed since the save?): resuming there would skip the epoch silently",
                key="consumed",
                differences=[f"epoch/consumed: {epoch}/{consumed} out of range"
                             + ("" if length is None else f" (length now {length})")],
            )
        if world_size != self._world_size:
            raise IncompatibleCheckpointError(
                f"sampler state 'world_size' is {world_size}, this run has "
                f"{self._world_size}: a wrapped sampler cannot reshard its position; "
                f"use ResumableDistributedSampler to change the world size mid-epoch",
                key="world_size",
                differences=[f"world_size: saved {world_size}, now {self._world_size}"],
            )
        load_inner = getattr(self._inner, "load_state_dict", None)
        if state.get("inner") is not None and callable(load_inner):
            load_inner(state["inner"])
        self.set_epoch(epoch)
        self._consumed = _non_negative("consumed", consumed)


def wrap_sampler(sampler: Iterable[T], *, world_size: int | None = None) -> Sampler[T]:
    """Make ``sampler`` resumable; samplers of this module are returned unchanged.

    Args:
        sampler: A sampler or batch sampler whose order depends only on its epoch.
        world_size: See :class:`SkipAheadSampler`.

    Returns:
        ``sampler`` itself when it already is a :class:`ResumableDistributedSampler` or
        :class:`SkipAheadSampler`, else a :class:`SkipAheadSampler` around it.
    """
    if isinstance(sampler, (ResumableDistributedSampler, SkipAheadSampler)):
        return sampler
    return SkipAheadSampler(sampler, world_size=world_size)
