"""Peer replicas on real gloo ranks, several "nodes" on one machine (RESUMEKIT_NODE_NAME).

Each simulated node has its own local root (``<tmp>/node<N>/``) holding ``rank_XXXXX/``
(a rank's own checkpoints) and ``replica_of_rank_XXXXX/`` (its sources' copies). The chunk
size is cut to a few KB so that every file travels in several chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from resumekit.errors import (
    CoordinationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StepCollisionError,
)
from resumekit.local import replicas
from resumekit.local.replicas import NODE_NAME_ENV, Partners, fetch, holdings, replicate
from resumekit.store.catalog import verify_checkpoint
from resumekit.store.commit import CommitProtocol
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage
from tests.distributed_harness import run_ranks

_CHUNK = 3000


def _name(step: int) -> str:
    return f"step_{step:09d}"


def _files(rank: int, step: int) -> dict[str, bytes]:
    """A rank's files of a step: several chunks, one chunk exactly, nested, empty."""
    seed = hashlib.sha256(f"{rank}/{step}".encode()).digest()
    return {"tensors/__0_0.distcp": seed * (400 + 37 * rank),
            "tensors/.metadata": seed[:8] * (_CHUNK // 8),
            "rank_state/rank_00000.pt": seed[:5],
            "empty.bin": b""}


def _node_root(base: str, rank: int, per_node: int) -> Path:
    return Path(base) / f"node{rank // per_node}"


def _setup(rank: int, base: str, per_node: int) -> tuple[Storage, Partners, Any]:
    """Name this rank's node, shrink the chunk, commit nothing yet."""
    os.environ[NODE_NAME_ENV] = f"node{rank // per_node}"
    replicas.CHUNK_BYTES = _CHUNK
    local = _node_root(base, rank, per_node)
    own = Storage(local / f"rank_{rank:05d}")
    return own, Partners.of(), lambda source: Storage(local / replicas.replica_dir(source))


def _commit(own: Storage, rank: int, step: int) -> None:
    protocol = CommitProtocol(own)
    pending = protocol.begin(step)
    for path, data in _files(rank, step).items():
        own.write_bytes(f"{pending.staging}/{path}", data)
    protocol.publish(pending, Manifest(step=step))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _round_trip(rank: int, world_size: int, base: str) -> dict[str, Any]:
    own, partners, replica_root = _setup(rank, base, per_node=2)
    _commit(own, rank, 10)
    replicate(own, _name(10), partners, replica_root, keep=2)
    dist.barrier()
    result: dict[str, Any] = {"partner": partners.partner, "sources": partners.sources,
                              "holdings": holdings(own.path("..")), "identical": {}}
    for source in partners.sources:  # what this rank keeps: byte for byte the source's
        node = _node_root(base, source, 2)
        theirs = _tree(node / f"rank_{source:05d}" / _name(10))
        mine = _tree(Path(replica_root(source).path(_name(10))))
        result["identical"][source] = theirs == mine and len(mine) == 5
        verify_checkpoint(replica_root(source), _name(10))
        result["leftovers"] = sorted(p.name for p in Path(replica_root(source).path()).iterdir()
                                     if p.name.startswith("."))
    # the same step again: the copy held is the same, so nothing is sent or touched
    held = Path(replica_root(partners.sources[0]).path(_name(10))).stat().st_ino
    replicate(own, _name(10), partners, replica_root, keep=2)
    result["kept_as_is"] = held == Path(replica_root(partners.sources[0]).path(
        _name(10))).stat().st_ino
    # rank 1 loses its own copy; its partner's replica brings it back, bit for bit
    before = _tree(Path(own.path(_name(10))))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(own.path(_name(10)))
    dist.barrier()
    fetch({1: (10, _name(10))}, {1: partners.holder_of(1)}, own, replica_root)
    result["fetched_identical"] = _tree(Path(own.path(_name(10)))) == before
    verify_checkpoint(own, _name(10))
    # newer steps: each replica root keeps the newest two
    for step in (20, 30):
        _commit(own, rank, step)
        replicate(own, _name(step), partners, replica_root, keep=2)
    dist.barrier()
    result["after_keep"] = holdings(own.path(".."))
    return result


def test_four_ranks_on_two_nodes_replicate_and_fetch_bit_identical(tmp_path: Path) -> None:
    results = run_ranks(_round_trip, world_size=4, args=(str(tmp_path),))
    assert [r["partner"] for r in results] == [2, 3, 0, 1]
    assert [r["sources"] for r in results] == [[2], [3], [0], [1]]
    for rank, result in enumerate(results):
        source = result["sources"][0]
        assert result["identical"] == {source: True}, rank
        assert result["leftovers"] == [], rank  # no staging left behind
        assert result["kept_as_is"], rank
        assert result["fetched_identical"], rank
    # a node's holdings: the replicas its two ranks keep, newest two steps each
    assert results[0]["holdings"] == {2: [10], 3: [10]}
    assert results[0]["after_keep"] == {2: [20, 30], 3: [20, 30]}
    assert results[2]["after_keep"] == {0: [20, 30], 1: [20, 30]}


def _uneven(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """Ranks 0 and 1 on node0, rank 2 alone on node1: rank 2 keeps both of node0's."""
    own, partners, replica_root = _setup(rank, base, per_node=2)
    _commit(own, rank, 10)
    crashed = Path(replica_root(0).path(".step_000000005.tmp-deadbeef"))
    if rank == 2:  # a receive of this host whose process is gone left its staging
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        (crashed / "tensors").mkdir(parents=True)
        (crashed / "tensors" / "__0_0.distcp").write_bytes(b"half")
        (crashed / ".writer.json").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": gone.pid, "token": "deadbeef"}))
    replicate(own, _name(10), partners, replica_root)
    dist.barrier()
    identical = {"swept": not crashed.exists()} if rank == 2 else {}
    for source in partners.sources:
        theirs = _node_root(base, source, 2) / f"rank_{source:05d}" / _name(10)
        identical[source] = _tree(theirs) == _tree(Path(replica_root(source).path(_name(10))))
    return {"sources": partners.sources, "identical": identical}


def test_a_rank_alone_on_its_node_keeps_the_copies_of_both_ranks_of_the_other(
        tmp_path: Path) -> None:
    results = run_ranks(_uneven, world_size=3, args=(str(tmp_path),))
    assert [r["sources"] for r in results] == [[2], [], [0, 1]]
    assert [r["identical"] for r in results] == [{2: True}, {},
                                                  {"swept": True, 0: True, 1: True}]


def _missing_file(rank: int, world_size: int, base: str) -> str:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    if rank == 1:
        os.remove(own.path(f"{_name(10)}/rank_state/rank_00000.pt"))
    try:
        replicate(own, _name(10), partners, replica_root)
    except IncompleteCheckpointError as error:
        return str(error)
    return "no error"


def test_a_sender_missing_a_file_fails_every_rank_before_a_byte_moves(tmp_path: Path) -> None:
    for message in run_ranks(_missing_file, world_size=2, args=(str(tmp_path),)):
        assert message.startswith("rank 1 (sender of rank 1's step_000000010, step 10, file "
                                  "rank_state/rank_00000.pt): "), message
        assert message.endswith("rank_state/rank_00000.pt is missing"), message
    assert not any(".tmp-" in p.name for p in tmp_path.rglob("*"))


def _corrupted_in_transit(rank: int, world_size: int, base: str) -> dict[str, Any]:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    if rank == 0:  # rank 0's 5th message (the manifest, then files by name: the 2nd chunk
        # of tensors/__0_0.distcp) loses a bit on the way
        sent = dist.isend
        count = [0]

        def flipping(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == 5:
                tensor = tensor.clone()
                tensor[17] ^= 1
            return sent(tensor, *args, **kwargs)

        dist.isend = flipping
    try:
        replicate(own, _name(10), partners, replica_root)
    except CorruptCheckpointError as error:
        outcome = str(error)
    else:
        outcome = "no error"
    return {"error": outcome, "replica": sorted(
        p.name for p in Path(replica_root(partners.sources[0]).path()).iterdir())}


def test_a_byte_corrupted_in_transit_is_named_on_every_rank_and_nothing_is_committed(
        tmp_path: Path) -> None:
    results = run_ranks(_corrupted_in_transit, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert "rank 1 (receiver of rank 0's step_000000010, step 10, file " \
            "tensors/__0_0.distcp)" in result["error"], result["error"]
        assert "arrived corrupt" in result["error"]
    assert results[1]["replica"] == []  # staging removed, nothing committed
    assert results[0]["replica"] == ["step_000000010"]  # the other way went through


def _corrupted_replica(rank: int, world_size: int, base: str) -> dict[str, Any]:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    replicate(own, _name(10), partners, replica_root)
    dist.barrier()
    if rank == 1:  # rank 0's replica on rank 1 rots; rank 0 loses its own copy
        victim = Path(replica_root(0).path(f"{_name(10)}/tensors/__0_0.distcp"))
        data = bytearray(victim.read_bytes())
        data[5000] ^= 0x40
        victim.write_bytes(bytes(data))
    else:
        shutil.rmtree(own.path(_name(10)))
    dist.barrier()
    try:
        fetch({0: (10, _name(10))}, {0: 1}, own, replica_root)
    except CorruptCheckpointError as error:
        outcome = str(error)
    else:
        outcome = "no error"
    return {"error": outcome, "own": sorted(p.name for p in Path(own.path()).iterdir())}


def test_a_corrupted_replica_is_named_on_every_rank_and_the_needing_rank_gets_nothing(
        tmp_path: Path) -> None:
    results = run_ranks(_corrupted_replica, world_size=2, args=(str(tmp_path),))
    for result in results:
        assert result["error"].startswith(
            "rank 0 (receiver of rank 0's step_000000010, step 10, file "
            "tensors/__0_0.distcp): tensors/__0_0.distcp: it arrived corrupt"), result["error"]
        assert ("rank 1 (sender of rank 0's step_000000010, step 10, file "
                "tensors/__0_0.distcp): tensors/__0_0.distcp: its copy ") in result["error"]
        assert "replica_of_rank_00000/step_000000010/tensors/__0_0.distcp fails its " \
            "checksum" in result["error"]
    assert [n for n in results[0]["own"] if n.startswith("step_") or ".tmp-" in n] == []


def _collision(rank: int, world_size: int, base: str) -> str:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    replicate(own, _name(10), partners, replica_root)
    dist.barrier()
    if rank == 0:  # rank 0 saves step 10 again (another checkpoint of that step)
        shutil.rmtree(own.path(_name(10)))
        _commit(own, 7, 10)
    try:
        replicate(own, _name(10), partners, replica_root)
    except StepCollisionError as error:
        return str(error)
    return "no error"


def test_another_copy_of_a_held_step_is_never_overwritten(tmp_path: Path) -> None:
    for message in run_ranks(_collision, world_size=2, args=(str(tmp_path),)):
        assert message.startswith("rank 1 (receiver of rank 0's step_000000010, step 10)")
        assert "holding another checkpoint of that step: never overwritten" in message


def _dies_mid_stream(rank: int, world_size: int, base: str) -> str:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    if rank == 1:  # rank 1 dies while rank 0's files are on their way to it
        received = dist.irecv
        count = [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == 4:
                os._exit(0)
            return received(*args, **kwargs)

        dist.irecv = dying
    try:
        replicate(own, _name(10), partners, replica_root)
    except CoordinationError as error:
        return str(error)
    return "no error"


def test_a_peer_dying_mid_stream_raises_a_coordination_error_instead_of_hanging(
        tmp_path: Path) -> None:
    results = run_ranks(_dies_mid_stream, world_size=2, args=(str(tmp_path),),
                        may_exit=(1,), group_timeout_s=20)
    assert results[1] is None
    assert "replication of step_000000010 failed on rank 0 of 2: the send/recv" in results[0]


def _post_fails_mid_stream(rank: int, world_size: int, base: str) -> str:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    if rank == 1:  # rank 1 dies while rank 0's files are on their way to it
        received, posts = dist.irecv, [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            posts[0] += 1
            if posts[0] == 4:
                os._exit(0)
            return received(*args, **kwargs)

        dist.irecv = dying
    else:  # and rank 0 sees it as gloo does when the connection closed first: at the post
        sent, posts = dist.isend, [0]

        def refused(*args: Any, **kwargs: Any) -> Any:
            posts[0] += 1
            if posts[0] == 4:
                raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by "
                                   "peer [127.0.0.1]:24985")
            return sent(*args, **kwargs)

        dist.isend = refused
    try:
        replicate(own, _name(10), partners, replica_root)
    except CoordinationError as error:
        return str(error)
    return "no error"


def test_a_peer_found_gone_when_the_next_send_is_posted_raises_a_coordination_error(
        tmp_path: Path) -> None:
    # gloo reports a closed connection at whichever comes first, the wait for a transfer
    # under way or the post of the next one: both are the same CoordinationError.
    results = run_ranks(_post_fails_mid_stream, world_size=2, args=(str(tmp_path),),
                        may_exit=(1,), group_timeout_s=20)
    assert results[1] is None
    assert "replication of step_000000010 failed on rank 0 of 2: the send/recv" in results[0]
    assert "closed its connection" in results[0], results[0]


def _hangs_mid_stream(rank: int, world_size: int, base: str) -> str:
    own, partners, replica_root = _setup(rank, base, per_node=1)
    _commit(own, rank, 10)
    if rank == 1:  # rank 1 stops answering (alive, stuck) halfway through the stream
        received = dist.irecv
        count = [0]

        def stuck(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == 4:
                time.sleep(12)  # past rank 0's group timeout (3 s), then gone
                os._exit(0)
            return received(*args, **kwargs)

        dist.irecv = stuck
    try:
        replicate(own, _name(10), partners, replica_root)
    except CoordinationError as error:
        return str(error)
    return "no error"


def test_a_peer_that_stops_answering_mid_stream_raises_after_the_group_timeout(
        tmp_path: Path) -> None:
    results = run_ranks(_hangs_mid_stream, world_size=2, args=(str(tmp_path),),
                        may_exit=(1,), group_timeout_s=3)
    assert results[1] is None
    assert "replication of step_000000010 failed on rank 0 of 2: the send/recv" in results[0]
    assert "did not answer within" in results[0], results[0]
    # rank 0 removed its staging of rank 1's copy (rank 1's is left to the sweep: killed)
    assert not any(".tmp-" in p.name for p in (tmp_path / "node0").rglob("*"))
