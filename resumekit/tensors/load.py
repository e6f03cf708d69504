"""Loading a checkpoint's tensors: one path, ``dcp.load`` with a checking planner.

Both tensor formats load the same way: DCP's ``load`` with :class:`_CheckedLoadPlanner`
(DCP's default planner, which first checks every key, shape and dtype of the state
against the checkpoint and loads non-tensor values without running code) and the safe
reader of :mod:`resumekit.tensors.reader` (raw tensor files verified as they are read).
The only choice is whether DCP's collectives run (``plan_locally``).
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from resumekit.errors import CheckpointLoadError, CorruptCheckpointError, ResumekitError
from resumekit.tensors.context import (
    NO_DIST_WARNING,
    directory_str,
    paused_collection,
    quiet_no_dist,
    resolve_group,
)
from resumekit.tensors.failures import first_cause, from_failures, incompatible, load_error
from resumekit.tensors.fit import check_against_metadata
from resumekit.tensors.index import tensor_index_of
from resumekit.tensors.metadata_parts import (
    EveryRank,
    ItemKey,
    Part,
    RanksFailed,
    Request,
    complete,
    exchange_frame_bytes,
    exchange_over_group,
    request_of,
    skeleton,
)
from resumekit.tensors.parts_exchange import covered_exchange
from resumekit.tensors.raw import raw_files
from resumekit.tensors.reader import (
    CheckedMetadata,
    SafeReader,
    load_plain_value,
    make_reader,
    read_whole_items,
)
from resumekit.tensors.shared_reads import SharedReads
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["iter_full_tensors", "load", "load_subset", "read_full_state"]

logger = logging.getLogger("resumekit")


def load(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
    plan_locally: bool = False,
    read_once: bool = False,
    alone: bool = False,
    metadata: CheckedMetadata | None = None,
    verified: bool = False,
    failure: BaseException | None = None,
) -> None:
    """Read the checkpoint in ``directory`` into ``state_dict``, in place.

    Destination tensors (``DTensor`` shards included) must already exist with their final
    shape and placement; each rank reads only what its shards need, so a checkpoint saved
    by N ranks loads on M. Before any tensor is read, the keys, shapes and dtypes of
    ``state_dict`` are checked against the checkpoint: every key asked for must exist, and
    under each top-level key asked for (``"model"``, ``"optimizer"``) the checkpoint must
    hold nothing more. Non-tensor leaves are replaced by the checkpoint's values.

    Args:
        state_dict: Destination; typically :func:`model_and_optimizer_state` output,
            possibly with more top-level entries.
        directory: A local path, ``file://`` URL or fsspec URL.
        process_group: As for :func:`save`.
        storage_options: fsspec options for URLs.
        verify: Check every byte read from raw tensor files against the checksum recorded
            when it was written. A mismatch may be found after other tensors were already
            read into ``state_dict``.
        plan_locally: Each rank plans and reads its own part alone, without DCP's plan
            gather, scatter and final all-gather (DCP's load plans need no coordination:
            its global load plan is the local plans). The caller then agrees on the
            outcome, since an error raises on the failing rank only (the manager runs it
            under :func:`resumekit.store.coordination.run_on_every_rank`).
        read_once: Bytes that several ranks of the group want (replicated parameters:
            DDP, HSDP) are read by one of them and sent to the others over the group, each
            reading about its share (:mod:`resumekit.tensors.shared_reads`). A failure on
            the reading rank raises on every rank. False, or a group that cannot move CPU
            tensors (NCCL only; said in a ``ResumekitWarning``): every rank reads all it
            needs.
        alone: This rank reads by itself, whatever group exists (a node-local copy of
            its own part, written by ``save(..., alone=True)``): no collective runs and
            nothing is read once for others (``read_once`` is ignored).
        metadata: ``directory``'s ``.metadata``, already read and checked (a restore reads
            it on one rank and sends it to the others): this rank never opens the file.
        verified: Every file of ``directory`` was already checked against the checksums
            recorded when it was written (a restore with ``verify_on_restore`` checks them
            first; raw tensor files are then checked as they are read, with ``verify``).
            An exception the load raises that is not resumekit's nor a storage error is
            then a :class:`~resumekit.errors.CheckpointLoadError` (the bytes are intact:
            what failed is code interpreting them), not an
            :class:`~resumekit.errors.UnreadableFormatError` (which means damage may be).
        failure: This rank's failure before the load (a restore's check of its share of
            the files), to be every rank's: it is sent in the metadata parts' exchange
            (``metadata`` exchanged over the group, which the caller makes sure of),
            which raises it on every rank before anything is read.

    Raises:
        CheckpointNotFoundError: ``directory`` holds no DCP metadata.
        IncompatibleCheckpointError: Keys, shapes or dtypes differ (nothing was loaded).
        UnsafeCheckpointError: The metadata or a stored value would execute code.
        IncompleteCheckpointError: A shard file is missing.
        CorruptCheckpointError: The checkpoint could not be read.
        CheckpointLoadError: With ``verified``: loading failed on bytes that match their
            checksums.
    """
    _load_checked(state_dict, directory, process_group, storage_options, verify,
                  reject_unexpected=True, plan_locally=plan_locally, read_once=read_once,
                  alone=alone, metadata=metadata, verified=verified, failure=failure)


def load_subset(
    state_dict: dict[str, Any],
    directory: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
    read_once: bool = False,
    verified: bool = False,
) -> None:
    """As :func:`load`, but the checkpoint may hold more than ``state_dict`` asks for.

    Every key asked for must still exist with its shape and dtype (weights-only loads:
    the optimizer and any unused model tensor are not read). ``read_once`` and
    ``verified`` as for :func:`load`.
    """
    _load_checked(state_dict, directory, process_group, storage_options, verify,
                  reject_unexpected=False, read_once=read_once, verified=verified)


def _load_checked(state_dict: dict[str, Any], directory: str | os.PathLike[str],
                  process_group: dist.ProcessGroup | None,
                  storage_options: Mapping[str, Any] | None, verify: bool, *,
                  reject_unexpected: bool, plan_locally: bool = False,
                  read_once: bool = False, alone: bool = False,
                  metadata: CheckedMetadata | None = None, verified: bool = False,
                  failure: BaseException | None = None) -> None:
    group, no_dist = (None, True) if alone else resolve_group(process_group)
    target = directory_str(directory)
    shared = None
    if read_once and group is not None:
        if SharedReads.can_run_on(group):
            shared = SharedReads(group)
        else:
            warn(f"restoring {target}: every rank reads all the bytes it needs (read once "
                 f"was asked for, but the process group is {dist.get_backend(group)!r}, "
                 "which cannot move CPU tensors between ranks; the checkpoint group of "
                 "init_distributed() can)", ResumekitWarning, stacklevel=3)
    reader = make_reader(target, storage_options, verify=verify, shared=shared,
                         metadata=metadata)
    exchange: Callable[[Request | BaseException], Part] | None = None
    whole = False
    carried: list[BaseException] = []  # a rank's failure the exchange raised on every rank
    if metadata is not None and metadata.exchanged and not alone:
        whole = metadata.head is None and metadata.whole
        exchange = _carrying(_exchange_of(metadata, group, target, storage_options, verify),
                             failure, carried)
        if shared is not None:
            exchange = _telling(exchange, shared)
    if failure is not None and exchange is None:
        raise failure  # the caller agrees on it (no collective of the group runs here)
    planner = _CheckedLoadPlanner(target, reject_unexpected=reject_unexpected,
                                  exchange=exchange, whole=whole)
    try:
        _run_load(
            state_dict=state_dict, reader=reader, planner=planner, target=target,
            group=group, no_dist=no_dist or plan_locally, verified=verified,
        )
    except ResumekitError as error:
        if shared is not None:  # ranks waiting for this one's reads raise it too
            shared.settle(error)
        if carried and carried[0] is not error:  # as raised on its rank, not as DCP told it
            raise carried[0] from None
        raise
    if logger.isEnabledFor(logging.DEBUG):
        read = reader.read_metadata()
        logger.debug(
            "tensor load: %s format, DCP load %s, %d items of %s%s",
            "raw" if raw_files(read.storage_data or {}) else "dcp",
            "without collectives" if no_dist or plan_locally else "on the process group",
            len(planner.state_dict), target,
            "" if shared is None else f", read once: {shared.stats}")


def _exchange_of(metadata: CheckedMetadata, group: dist.ProcessGroup | None, target: str,
                 storage_options: Mapping[str, Any] | None, verify: bool
                 ) -> Callable[[Request | BaseException | EveryRank], Part]:
    """The exchange of metadata parts of a load whose ``metadata`` was shared.

    Of a ``.metadata`` laid out by rank (:mod:`.parts_exchange`): each rank reads its own
    part, and rank 0 answers from the head alone when every rank's part covers its
    request. Otherwise the skeleton's holders get their part from the rank that read the
    whole file, which reads the small items asked for whole once and sends them in the
    parts.
    """
    head = metadata.head
    if head is None:
        whole = metadata.whole
        read_values = None
        if whole:
            def read_values(items: Sequence[ItemKey]) -> dict[ItemKey, Any]:
                return read_whole_items(
                    make_reader(target, storage_options, verify=verify, metadata=metadata),
                    metadata.parsed(), items)

        return exchange_over_group(
            group, metadata.server() if whole else None, read_values,
            frame_bytes=exchange_frame_bytes(len(metadata.parsed().state_dict_metadata)))
    answerer = None
    if metadata.leader:
        raw = metadata.raw_files()

        def read_small(found: Metadata, items: Sequence[ItemKey]) -> dict[ItemKey, Any]:
            holder = CheckedMetadata.from_parsed(found, metadata.source, metadata.digest, raw)
            return read_whole_items(make_reader(target, storage_options, verify=verify,
                                                metadata=holder), found, items)

        answerer = metadata.answerer(read_small)
    inner = exchange_over_group(group, answerer, None, frame_bytes=exchange_frame_bytes(
        len(head.skeleton.state_dict_metadata)))
    return covered_exchange(inner, head, metadata.source,
                            metadata.read_part or (lambda rank: None), dist.get_rank(group))


def _telling(exchange: Callable[[Request | BaseException], Part], shared: SharedReads
             ) -> Callable[[Request | BaseException], Part]:
    """``exchange``, which tells ``shared`` when no rank reads what another one does."""

    def told(request: Request | BaseException) -> Part:
        part = exchange(request)
        if part.alone:
            shared.read_alone()
        return part

    return told


def _carrying(exchange: Callable[[Request | BaseException | EveryRank], Part],
              failure: BaseException | None, carried: list[BaseException]
              ) -> Callable[[Request | BaseException], Part]:
    """``exchange``, sending ``failure`` (if any) instead of the request, for every rank.

    A rank's failure the exchange raises on every rank (this one's or another's) is put
    in ``carried`` and raised as it is: the load raises it, not DCP's wrapping of it.
    """

    def run(request: Request | BaseException) -> Part:
        try:
            return exchange(request if failure is None else EveryRank(failure))
        except RanksFailed as failed:
            carried.append(failed.error)
            raise failed.error from None

    return run


def _run_load(
    *,
    state_dict: dict[str, Any],
    reader: SafeReader,
    planner: _CheckedLoadPlanner,
    target: str,
    group: dist.ProcessGroup | None,
    no_dist: bool,
    verified: bool = False,
) -> None:
    # Without collectives DCP numbers every process rank 0: a failure is this process's.
    own = (dist.get_rank() if dist.is_available() and dist.is_initialized() else None) \
        if no_dist else None
    try:
        with quiet_no_dist(no_dist), paused_collection(False):
            dcp_load(
                state_dict,
                storage_reader=cast(FileSystemReader, reader),
                planner=planner,
                process_group=group,
                no_dist=no_dist,
            )
    except CheckpointException as error:
        failure = from_failures(error, "load", target, reader, verified=verified, rank=own)
        if isinstance(failure, CheckpointLoadError):
            raise failure from first_cause(error)
        raise failure from None
    except ResumekitError:
        raise
    except Exception as error:
        raise load_error(error, target, reader, rank=own, verified=verified) from error


def iter_full_tensors(
    directory: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each tensor of a checkpoint whole (all shards assembled), one at a time.

    Needs no process group and uses none. Only one full tensor is allocated at a time
    (plus the shard being copied into it), so peak memory is bounded by the largest
    tensor, not the checkpoint; the caller should drop each tensor before the next.

    Args:
        directory: A local path, ``file://`` URL or fsspec URL.
        names: Fully qualified names to yield, in this order; ``None`` for every tensor
            in the checkpoint's order.
        storage_options: fsspec options for URLs.

    Yields:
        ``(fqn, tensor)`` with a CPU tensor of the stored global shape and dtype.

    Raises:
        IncompatibleCheckpointError: A requested name is not a tensor of the checkpoint
            (raised before anything is yielded).
    """
    target = directory_str(directory)
    reader = make_reader(target, storage_options)
    index = tensor_index_of(reader.read_metadata())
    wanted = list(index) if names is None else list(names)
    unknown = [name for name in wanted if name not in index]
    if unknown:
        raise incompatible(
            target, [f"not a tensor of the checkpoint: {name}" for name in unknown]
        )
    for name in wanted:
        info = index[name]
        holder: dict[str, Any] = {name: torch.empty(info.shape, dtype=info.dtype)}
        # The holder is flat already (one tensor under its checkpoint name), so nothing is
        # flattened: DCP's flattening walks the dict with self-recursive closures, and
        # before torch 2.10 those closures form reference cycles that keep each flattened
        # dict (and so each tensor) alive until the cycle collector happens to run.
        planner = _CheckedLoadPlanner(target, reject_unexpected=False, flatten=False)
        _run_load(
            state_dict=holder, reader=reader, planner=planner, target=target,
            group=None, no_dist=True,
        )
        # No local name for the tensor: the planner (whose state_dict is the holder) goes
        # first, so once the caller drops the tensor, it is freed before the next one is
        # allocated (peak memory: one tensor).
        del planner
        yield name, holder.pop(name)


class _CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus a strict fit check and safe non-tensor loading.

    ``flatten=False`` is for a state dict that is flat already (names as the checkpoint
    stores them, plain tensors): DCP then flattens nothing and keeps no copy of it.

    With ``exchange`` (:mod:`resumekit.tensors.metadata_parts`), the metadata it is set
    up with is the skeleton (or, on the rank that read the file, the whole of it): it
    sends this rank's request, gets its part back and plans from the skeleton filled
    with it, so planning looks at the chunks this rank's shards overlap, not at every
    rank's. Every rank of the group calls ``set_up_planner`` once, and takes part in the
    exchange even when its own set-up failed (then raising its error). ``whole``: the
    metadata it is set up with is the whole file (this rank read it), kept as it is.
    """

    def __init__(self, directory: str, *, reject_unexpected: bool, flatten: bool = True,
                 exchange: Callable[[Request | BaseException], Part] | None = None,
                 whole: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten, flatten_sharded_tensors=flatten,
                         allow_partial_load=False)
        self._directory = directory
        self._reject_unexpected = reject_unexpected
        self._exchange = exchange
        self._whole = whole
        self.values: dict[ItemKey, Any] = {}
        """Items the exchange brought read (:attr:`Part.values`): loaded from here."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten ``state_dict`` as DCP does, then check it against ``metadata``.

        With an exchange, this rank's part of the chunks is fetched first (see the class).
        """
        if self._exchange is not None and metadata is not None:
            try:
                super().set_up_planner(state_dict, metadata, is_coordinator)
                request: Request | BaseException = request_of(self.state_dict, metadata)
            except Exception as error:  # noqa: BLE001 - raised by the exchange, after it
                request = error
            part = self._exchange(request)
            self.values = part.values  # read for this rank (its reader loads them)
            # The rank that read the file keeps it whole (it answers the others); it plans
            # from a skeleton of its own, like every rank.
            metadata = complete(skeleton(metadata) if self._whole else metadata, part)
            self.metadata = metadata
        else:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        differences = check_against_metadata(
            self.state_dict,
            metadata,
            scope=set(self.original_state_dict) if self._reject_unexpected else None,
        )
        if differences:
            raise incompatible(self._directory, differences)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load a non-tensor value with ``weights_only=True`` (no arbitrary code)."""
        fqn = read_item.dest_index.fqn
        loaded = load_plain_value(self._directory, fqn, value)
        if self.flatten_state_dict:
            set_at_path(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def set_at_path(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """Set ``value`` in nested ``root`` at a flattening path (str keys: dicts, int: lists).

    The inverse of DCP's ``flatten_state_dict`` for one value, as its planners use it;
    containers missing along the path are created (a dict for a str key, a list for an
    int, lists padded with None).
    """
    container: Any = root
    for key, following in itertools.pairwise(path):
        empty: Any = {} if isinstance(following, str) else []
        if isinstance(container, dict):
            container = container.setdefault(key, empty)
        else:
            index = int(key)
            container.extend([None] * (index + 1 - len(container)))
            if container[index] is None:
                container[index] = empty
            container = container[index]
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (int(last) + 1 - len(container)))
    container[last] = value


class _SafeFromMetadataLoadPlanner(DefaultLoadPlanner):
    """A load planner that builds the whole state dict from the metadata, loading safely.

    It does what DCP's ``format_utils.dcp_to_torch_save`` reads a checkpoint with (an
    empty tensor for every stored tensor, the nesting rebuilt from ``planner_data``), on
    DCP's public planner API; non-tensor values (learning rates, ``param_groups``) are
    read with ``torch.load(weights_only=True)``, where stock DCP unpickles them with
    ``weights_only=False``. After ``dcp.load``, :attr:`original_state_dict` holds the
    state read (``dcp.load`` fills a copy of the dict it is given).
    """

    def __init__(self, directory: str) -> None:
        super().__init__()
        self._directory = directory

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Fill the empty ``state_dict`` with a placeholder for every stored value."""
        if metadata is None:
            raise CorruptCheckpointError(f"{self._directory}: no checkpoint metadata to "
                                         "rebuild the state from", path=self._directory)
        paths = metadata.planner_data or {}
        for key, stored in metadata.state_dict_metadata.items():
            value: Any = stored
            if isinstance(stored, TensorStorageMetadata):
                value = torch.empty(stored.size, dtype=stored.properties.dtype)
            if key in paths:
                set_at_path(state_dict, paths[key], value)
            else:
                state_dict[key] = value
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor value without running code from the checkpoint."""
        fqn = read_item.dest_index.fqn
        loaded = load_plain_value(self._directory, fqn, value)
        set_at_path(self.original_state_dict, self.mappings[fqn], loaded)


def read_full_state(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Read a whole DCP checkpoint into one nested state dict, without a process group.

    The same structure ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    builds (every tensor whole, nesting rebuilt from the metadata), read safely: the
    metadata through the allow-list unpickler, non-tensor values with
    ``torch.load(weights_only=True)``. Works on stock DCP directories (``dcp.save``,
    torchtitan ``step-N``) and on a resumekit checkpoint's ``tensors/`` directory, whose
    raw tensor files are verified against their checksums as they are read. Holds the whole
    checkpoint in memory.

    Args:
        directory: The DCP directory (the one holding ``.metadata``): a local path or URL.
        storage_options: fsspec options for URLs.

    Returns:
        The nested state dict, e.g. ``{"model": {...}, "optimizer": {...}}``.

    Raises:
        CheckpointNotFoundError: No ``.metadata`` in ``directory``.
        UnsafeCheckpointError: The metadata or a stored value would run code.
        CorruptCheckpointError: A file is unreadable or fails its checksum.
    """
    target = os.fspath(directory)
    reader = make_reader(target, storage_options)
    planner = _SafeFromMetadataLoadPlanner(target)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            dcp_load({}, storage_reader=reader, planner=planner, no_dist=True)
    except ResumekitError:
        raise
    except CheckpointException as error:
        causes = [cause for cause, _ in error.failures.values()]
        found = next((c for c in causes if isinstance(c, ResumekitError)), None)
        if found is not None:
            raise found from None
        if reader.metadata_error is not None:
            raise reader.metadata_error from None
        raise CorruptCheckpointError(
            f"reading checkpoint {target} failed: {causes[0] if causes else error}",
            path=target,
        ) from None
    except Exception as error:
        if reader.metadata_error is not None:
            raise reader.metadata_error from error
        raise CorruptCheckpointError(
            f"reading checkpoint {target} failed: {type(error).__name__}: {error}",
            path=target,
        ) from error
    state: dict[str, Any] = planner.original_state_dict
    return state
