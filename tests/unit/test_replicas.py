"""Peer replicas without a process group: who keeps whose copies, and what a rank holds.

The transfers themselves run on real gloo ranks in tests/dist/test_replicas_dist.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from resumekit.errors import ConfigurationError
from resumekit.local import replicas
from resumekit.local.replicas import (
    NODE_NAME_ENV,
    Partners,
    fetch,
    holdings,
    parse_replica_dir,
    replica_dir,
    replicate,
)
from resumekit.store.commit import CommitProtocol
from resumekit.store.manifest import Manifest
from resumekit.store.storage import Storage


def _layout(nodes: int, per_node: int, *, interleaved: bool = False) -> list[str]:
    """The node of each rank: blocks (torchrun's order) or round-robin placement."""
    if interleaved:
        return [f"node{rank % nodes}" for rank in range(nodes * per_node)]
    return [f"node{rank // per_node}" for rank in range(nodes * per_node)]


@pytest.mark.parametrize(("nodes", "per_node", "interleaved"),
                         [(n, p, i) for n, p, i in itertools.product(
                             range(1, 5), range(1, 5), (False, True))])
def test_a_replica_is_never_on_its_own_node_and_losing_one_node_loses_no_copy(
        nodes: int, per_node: int, interleaved: bool) -> None:
    layout = _layout(nodes, per_node, interleaved=interleaved)
    plans = [Partners.plan(layout, rank) for rank in range(len(layout))]
    assert all(plan.partners == plans[0].partners for plan in plans)  # one view
    partners = plans[0].partners
    if nodes == 1:
        assert all(keeper is None for keeper in partners)
        assert all(plan.partner is None and plan.sources == [] for plan in plans)
        return
    for rank, keeper in enumerate(partners):
        assert keeper is not None
        assert layout[keeper] != layout[rank], (rank, keeper)
        assert rank in plans[keeper].sources
        assert plans[rank].partner == keeper == plans[rank].holder_of(rank)
    # equal nodes: every rank keeps exactly one other rank's copies
    assert sorted(len(plan.sources) for plan in plans) == [1] * len(layout)
    for lost in set(layout):
        for rank, keeper in enumerate(partners):
            assert layout[rank] != lost or layout[keeper] != lost  # one of them survives


def test_the_partner_is_the_same_local_index_on_the_next_node_in_order_of_lowest_rank() -> None:
    # node "b" holds rank 0, so it comes first; local index = position among its ranks
    plan = Partners.plan(["b", "a", "b", "a", "c", "c"], rank=0)
    assert plan.partners == (1, 4, 3, 5, 0, 2)
    assert plan.node_count() == 3
    assert plan.world_size == 6


def test_a_node_with_fewer_ranks_wraps_its_local_index_and_one_with_more_keeps_fewer() -> None:
    plan = Partners.plan(["a", "a", "a", "b"], rank=3)
    assert plan.partners == (3, 3, 3, 0)  # rank 3 keeps all of node a's copies
    assert plan.sources == [0, 1, 2]
    assert Partners.plan(["a", "a", "a", "b"], rank=1).sources == []
    assert Partners.plan(["a", "b", "b", "b"], rank=0).sources == [1, 2, 3]


def test_a_rank_outside_the_nodes_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="rank 2 is not one of the 2 ranks"):
        Partners.plan(["a", "b"], rank=2)


def test_without_a_process_group_the_node_name_comes_from_the_environment_when_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_NAME_ENV, "drill-node-7")
    assert Partners.of().nodes == ("drill-node-7",)
    assert Partners.of(node="given").nodes == ("given",)
    monkeypatch.delenv(NODE_NAME_ENV)
    assert replicas.node_name() != "drill-node-7"


def test_replica_directory_names_parse_back_to_their_rank() -> None:
    assert replica_dir(3) == "replica_of_rank_00003"
    assert parse_replica_dir(replica_dir(123456)) == 123456
    assert parse_replica_dir("rank_00003") is None
    assert parse_replica_dir("replica_of_rank_3") is None


def _commit(root: Path, step: int, files: dict[str, bytes]) -> None:
    protocol = CommitProtocol(Storage(root))
    pending = protocol.begin(step)
    for path, data in files.items():
        protocol.storage.write_bytes(f"{pending.staging}/{path}", data)
    protocol.publish(pending, Manifest(step=step))


def test_holdings_lists_the_committed_steps_of_each_replica_root_only(tmp_path: Path) -> None:
    _commit(tmp_path / replica_dir(3), 10, {"a.bin": b"x"})
    _commit(tmp_path / replica_dir(3), 20, {"a.bin": b"y"})
    (tmp_path / replica_dir(3) / ".step_000000030.tmp-abc").mkdir()  # a receive in flight
    (tmp_path / replica_dir(3) / "step_000000040").mkdir()  # no manifest: not committed
    _commit(tmp_path / "rank_00001", 10, {"a.bin": b"own"})  # its own copies: not replicas
    (tmp_path / replica_dir(5)).mkdir()  # nothing committed
    (tmp_path / replica_dir(6)).write_bytes(b"a file, not a root")
    assert holdings(tmp_path) == {3: [10, 20]}
    assert holdings(Storage(tmp_path)) == {3: [10, 20]}
    assert holdings(tmp_path / "absent") == {}


def test_one_process_has_no_partner_so_replicate_moves_nothing(tmp_path: Path) -> None:
    _commit(tmp_path / "rank_00000", 10, {"a.bin": b"x"})
    partners = Partners.of(node="only")
    replicate(Storage(tmp_path / "rank_00000"), "step_000000010", partners,
              lambda rank: Storage(tmp_path / replica_dir(rank)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_00000"]


def test_fetch_refuses_a_rank_without_a_holder_or_holding_its_own_replica(
        tmp_path: Path) -> None:
    own = Storage(tmp_path / "rank_00000")
    with pytest.raises(ConfigurationError, match="rank 0's step 10: no holder given"):
        fetch({0: (10, "step_000000010")}, {}, own, lambda rank: own)
    with pytest.raises(ConfigurationError, match="cannot hold its own replica"):
        fetch({0: (10, "step_000000010")}, {0: 0}, own, lambda rank: own)


def test_replicate_refuses_to_keep_fewer_than_one_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="keep=0"):
        replicate(Storage(tmp_path), "step_000000010", Partners.of(node="only"),
                  lambda rank: Storage(tmp_path), keep=0)


def test_the_stream_plan_cuts_files_in_chunks_and_keeps_empty_files(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas, "CHUNK_BYTES", 4)
    manifest = Manifest(step=1, files=[
        {"path": "a", "size": 9, "checksum": "x"}, {"path": "b", "size": 0, "checksum": "y"},
        {"path": "c", "size": 4, "checksum": "z"}])
    assert replicas._plan(manifest) == [(0, 0, 4), (0, 4, 4), (0, 8, 1), (1, 0, 0),
                                        (2, 0, 4)]
