"""A restore's exchange of metadata parts when ``.metadata`` is laid out by rank.

``schema_version`` 5 (:mod:`resumekit.tensors.metadata_file`): the rank that reads the
checkpoint's ``.metadata`` first (group rank 0) reads only its head (the skeleton, the
items every rank needs and the table of the writing ranks' parts) and sends it in the
skeleton's place. When the load plans, every rank reads its own part's bytes (rank ``r``
the part of writing rank ``r``), checks them against the head's checksum, and asks
:func:`~resumekit.tensors.metadata_file.covers`: a run sharded as its checkpoint needs
nothing more, and plans from the head's shared items and its part alone.

The ranks still make the one gather and the one scatter of
:func:`~resumekit.tensors.metadata_parts.exchange_over_group` (no collective is added):

* a covered rank sends a :class:`Covered` mark instead of its request (a few bytes,
  whatever the checkpoint), saying whether it reads a shared item that is not sent read;
* a rank that is not covered (another world size, another sharding, no part of its own)
  sends its request, as before schema 5;
* a rank whose part is damaged sends the error for every rank (as a damaged ``.metadata``
  fails every rank), naming the file, the step and the rank.

Group rank 0 answers with :class:`PartsAnswerer`: when every rank is covered, one reply
for all (the small shared items read once, the same object, pickled once), so its side
costs the same at W = 8 and W = 1,024; otherwise it reads and parses the whole file
(:attr:`PartsAnswerer.whole_reads`) and answers every rank that is not covered from it,
exactly as before schema 5, and the covered ones as when all are. Every rank learns the
outcome from the same scatter: the ranks never disagree on it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resumekit.tensors.metadata_file import Head, Row, covers, rows_metadata
from resumekit.tensors.metadata_parts import (
    PREREAD_MAX_BYTES,
    PREREAD_MAX_PART_BYTES,
    EveryRank,
    ItemKey,
    MetadataServer,
    Part,
    Request,
    ValueReader,
    packed,
)

__all__ = ["Covered", "PartsAnswerer", "covered_exchange", "small_shared_items"]

logger = logging.getLogger("resumekit")


@dataclasses.dataclass(frozen=True)
class Covered:
    """A rank's mark in the gather: its part and the shared items cover its request.

    Attributes:
        reads_shared: It reads a shared item that rank 0 does not send read (a larger
            one stored whole): then another rank may read it too.
    """

    reads_shared: bool


def small_shared_items(head: Head) -> list[ItemKey]:
    """The shared items rank 0 reads once and sends every rank (the same on every rank).

    Non-tensor values and tensors stored as one chunk of the whole tensor, of at most
    :data:`~resumekit.tensors.metadata_parts.PREREAD_MAX_BYTES` each and
    :data:`~resumekit.tensors.metadata_parts.PREREAD_MAX_PART_BYTES` in all.
    """
    whole = head.shared_keys
    chosen: list[ItemKey] = []
    total = 0
    for key, number, offsets, _, _, offset, length, _ in head.shared:
        if key not in whole or number == -2 or offset < 0:
            continue
        if length > PREREAD_MAX_BYTES or total + length > PREREAD_MAX_PART_BYTES:
            continue
        total += length
        chosen.append((key, offsets))
    return chosen


def shared_metadata(head: Head, rows: Sequence[Row] = ()) -> Metadata:
    """A copy of the head's skeleton filled with its shared rows (and ``rows``)."""
    return rows_metadata(copy.deepcopy(head.skeleton), [*head.shared, *rows])


class PartsAnswerer:
    """Group rank 0's answers in the exchange of a ``.metadata`` laid out by rank.

    Args:
        head: The head it read.
        source: The file (named in errors and logs).
        read_whole: Reads, checks and parses the whole file (only when a rank is not
            covered).
        read_small: Reads stored items whole, given the metadata that says where they are.
    """

    def __init__(self, head: Head, source: str,
                 read_whole: Callable[[], Metadata],
                 read_small: Callable[[Metadata, Sequence[ItemKey]], dict[ItemKey, Any]]
                 ) -> None:
        self.head = head
        self.source = source
        self._read_whole = read_whole
        self._read_small = read_small
        self._server: MetadataServer | None = None
        self._whole: Metadata | None = None
        self._values: dict[ItemKey, Any] | None = None
        self.whole_reads = 0
        """How many times the whole file was read and parsed here (0 when every rank was
        covered by its part)."""
        self.answers = 0
        """Parts worked out from the whole file (one per distinct request not covered)."""

    def _shared_values(self) -> dict[ItemKey, Any]:
        if self._values is None:
            items = small_shared_items(self.head)
            found = self._read_small(shared_metadata(self.head), items) if items else {}
            self._values = {item: packed(found[item]) for item in items if item in found}
        return self._values

    def parts_for(self, requests: Sequence[Any], read_values: ValueReader | None = None
                  ) -> list[Part | None]:
        """Every rank's reply, in rank order (see the module docstring).

        Raises:
            ResumekitError: Reading the whole file or a small item failed.
        """
        values = self._shared_values()
        if all(isinstance(request, Covered | BaseException) for request in requests):
            alone = not any(isinstance(request, BaseException) or request.reads_shared
                            for request in requests)
            reply = Part(chunks={}, storage=[], values=values, alone=alone)
            return [None if isinstance(request, BaseException) else reply
                    for request in requests]
        asked = [index for index, request in enumerate(requests)
                 if not isinstance(request, Covered | BaseException)]
        if self._server is None:
            logger.info("resumekit: %s: rank%s %s not covered by %s own part%s of the "
                        ".metadata laid out by rank (another world size or sharding): "
                        "reading it whole to answer", self.source,
                        "s" if len(asked) > 1 else "", ", ".join(map(str, asked[:8])),
                        "their" if len(asked) > 1 else "its", "s" if len(asked) > 1 else "")
            self.whole_reads += 1
            self._whole = self._read_whole()
            self._server = MetadataServer(self._whole, self.source)

        def read_whole_values(items: Sequence[ItemKey]) -> dict[ItemKey, Any]:
            assert self._whole is not None
            return self._read_small(self._whole, items)

        answered = self._server.parts_for(
            [request if index in asked else {} for index, request in enumerate(requests)],
            read_whole_values)
        self.answers = self._server.answers
        covered = Part(chunks={}, storage=[], values=values, alone=False)
        replies: list[Part | None] = []
        for index, request in enumerate(requests):
            part = answered[index]
            if isinstance(request, Covered):
                replies.append(covered)
            else:
                if part is not None:
                    part.alone = False
                replies.append(part)
        return replies


def covered_exchange(exchange: Callable[[Any], Part], head: Head, source: str,
                     read_part: Callable[[int], list[Row] | None], rank: int
                     ) -> Callable[[Request | BaseException | EveryRank], Part]:
    """``exchange`` (one gather, one scatter) for a rank holding ``head``.

    Args:
        exchange: :func:`~resumekit.tensors.metadata_parts.exchange_over_group`'s.
        head: The head of the ``.metadata`` laid out by rank.
        source: The file (named in errors).
        read_part: Reads, checks and parses writing rank ``r``'s part (None when there
            is none).
        rank: This rank (of the group).
    """
    shared = head.shared_keys
    values = set(small_shared_items(head))

    def run(request: Request | BaseException | EveryRank) -> Part:
        if isinstance(request, BaseException | EveryRank):
            return exchange(request)
        try:
            rows = read_part(rank) if rank < len(head.parts) else None
        except Exception as error:  # noqa: BLE001 - every rank's, as a damaged .metadata
            return exchange(EveryRank(error))
        if rows is None or not covers(request, shared, rows):
            return exchange(request)
        mine = shared_metadata(head, rows)
        own = MetadataServer(mine, source).part_for(request)
        reads_shared = _reads_shared(mine, request, shared, values)
        reply = exchange(Covered(reads_shared))
        own.values = reply.values
        own.alone = reply.alone
        return own

    return run


def _reads_shared(metadata: Metadata, request: Request, shared: set[str],
                  values: set[ItemKey]) -> bool:
    """Whether ``request`` asks for a shared item not in ``values`` (read by the rank)."""
    stored = metadata.state_dict_metadata
    for key, wanted in request.items():
        if key not in shared:
            continue
        entry = stored.get(key)
        if isinstance(entry, TensorStorageMetadata):
            if wanted is not None and all(not all(sizes) for _, sizes in wanted):
                continue  # empty shards read nothing
            item: ItemKey = (key, tuple(int(o) for o in entry.chunks[0].offsets)
                             if entry.chunks else ())
        else:
            item = (key, None)
        if item not in values:
            return True
    return False
