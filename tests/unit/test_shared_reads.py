"""Who reads which shared piece of a restore (``assign_readers``), without processes."""

from __future__ import annotations

import random

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from resumekit.tensors.shared_reads import assign_readers, cut_rounds, piece_key

MiB = 1 << 20


def test_replicas_that_share_everything_each_read_about_their_share_of_the_bytes() -> None:
    sizes = [random.Random(7).randint(1, 64) * MiB for _ in range(200)]
    pieces = list(enumerate(sizes))
    for replicas in (2, 3, 8):
        readers, _ = assign_readers([pieces] * replicas)
        read = [0] * replicas
        for key, size in pieces:
            read[readers[key]] += size
        assert max(read) - min(read) <= max(sizes), (replicas, read)


def test_every_rank_computes_the_same_readers_and_transfers_from_the_same_offers() -> None:
    offers = [[(key, (key % 5 + 1) * MiB) for key in range(50)],
              [(key, (key % 5 + 1) * MiB) for key in range(25, 75)]]
    first = assign_readers(offers)
    shuffled = [list(reversed(offer)) for offer in offers]  # another plan order
    assert assign_readers(shuffled) == first


def test_a_piece_wanted_by_one_rank_is_not_shared_and_counts_toward_its_reads() -> None:
    # rank 0 alone wants a large piece; the pieces both want then go to rank 1
    offers = [[(1, 100 * MiB), (2, 10 * MiB), (3, 10 * MiB)], [(2, 10 * MiB), (3, 10 * MiB)]]
    readers, transfers = assign_readers(offers)
    assert readers == {2: 1, 3: 1}
    assert [(t.reader, t.members) for t in transfers] == [(1, (0, 1))] * 2  # each alone


def test_hsdp_replica_groups_exchange_only_within_themselves() -> None:
    # mesh (replicate=2, shard=2): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
    shard0, shard1 = [(10, 8 * MiB), (11, 8 * MiB)], [(20, 8 * MiB), (21, 8 * MiB)]
    readers, transfers = assign_readers([shard0, shard1, shard0, shard1])
    assert {readers[10], readers[11]} == {0, 2}
    assert {readers[20], readers[21]} == {1, 3}
    assert {t.members for t in transfers} == {(0, 2), (1, 3)}
    assert all(t.reader in t.members for t in transfers)


def test_small_pieces_travel_packed_and_large_ones_alone() -> None:
    offers = [[(key, MiB // 2) for key in range(10)] + [(98, MiB), (99, 100 * MiB)]] * 2
    _, transfers = assign_readers(offers, bucket_bytes=2 * MiB, alone_bytes=MiB)
    counts = sorted(len(t.pieces) for t in transfers)
    assert counts == [1, 1, 2, 4, 4]  # 99 (rank 0), 98 alone; the ten small ones packed
    assert sum(size for t in transfers for _, size in t.pieces) == 106 * MiB


def test_rounds_give_each_reader_about_the_round_size_and_keep_the_order() -> None:
    pieces = [(key, 4 * MiB) for key in range(40)]
    _, transfers = assign_readers([pieces, pieces])
    rounds = cut_rounds(transfers, round_bytes=16 * MiB)
    assert [t for one in rounds for t in one] == transfers
    for one in rounds:
        per_reader = [sum(s for t in one if t.reader == r for _, s in t.pieces) for r in (0, 1)]
        assert per_reader == [16 * MiB, 16 * MiB] or one is rounds[-1], per_reader


def test_a_piece_key_names_the_stored_bytes_not_the_destination() -> None:
    def item(dest: tuple[int, ...], storage: tuple[int, ...]) -> ReadItem:
        return ReadItem(type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex("w", dest), dest_offsets=torch.Size(dest),
                        storage_index=MetadataIndex("w", (0, 0)),
                        storage_offsets=torch.Size(storage), lengths=torch.Size((4, 4)))

    assert piece_key(item((0, 0), (4, 0))) == piece_key(item((8, 0), (4, 0)))
    assert piece_key(item((0, 0), (4, 0))) != piece_key(item((0, 0), (0, 0)))
