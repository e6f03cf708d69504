"""The restore's choice across tiers, against a brute-force reading of its rule.

Budget: 300 random worlds (1-6 ranks, steps 0-12, random own copies and replicas), about
2 s.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resumekit.local.tier_choice import Holdings, decide

STEPS = st.frozensets(st.integers(min_value=0, max_value=12), max_size=5)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[Holdings], int | None]:
    world = draw(st.integers(min_value=1, max_value=6))
    holdings = []
    for rank in range(world):
        sources = draw(st.lists(st.integers(min_value=0, max_value=world), max_size=3))
        replicas = {source: draw(STEPS) for source in sources}
        holdings.append(Holdings(draw(STEPS), replicas))
        del rank
    return holdings, draw(st.one_of(st.none(), st.integers(min_value=0, max_value=12)))


def _gettable(holdings: list[Holdings], rank: int, step: int) -> bool:
    """Rank ``rank`` can get ``step``: its own copy, or another rank keeps a replica."""
    return step in holdings[rank].own or any(
        step in held.replicas.get(rank, frozenset())
        for holder, held in enumerate(holdings) if holder != rank)


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_the_candidates_are_exactly_the_steps_every_rank_can_get_not_older_than_durable(
        world: tuple[list[Holdings], int | None]) -> None:
    holdings, durable = world
    everything = set().union(*(held.own for held in holdings),
                             *(steps for held in holdings for steps in held.replicas.values()))
    expected = sorted((step for step in everything
                       if all(_gettable(holdings, rank, step) for rank in range(len(holdings)))
                       and (durable is None or step >= durable)), reverse=True)
    choice = decide(holdings, durable)
    assert [candidate.step for candidate in choice.candidates] == expected
    assert choice.durable_step == durable


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_every_candidate_fetches_only_what_a_rank_lacks_from_a_rank_that_keeps_it(
        world: tuple[list[Holdings], int | None]) -> None:
    holdings, durable = world
    for candidate in decide(holdings, durable).candidates:
        assert (candidate.tier == "local") == (not candidate.fetches)
        for rank, held in enumerate(holdings):
            if candidate.step in held.own:
                assert rank not in candidate.fetches  # an own copy is never fetched
            else:
                holder = candidate.fetches[rank]
                assert holder != rank
                assert candidate.step in holdings[holder].replicas[rank]
                assert holder == min(  # the lowest rank keeping it: the same on every rank
                    other for other, kept in enumerate(holdings) if other != rank
                    and candidate.step in kept.replicas.get(rank, frozenset()))


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_a_rank_reading_its_own_copy_has_as_spare_the_lowest_rank_keeping_its_replica(
        world: tuple[list[Holdings], int | None]) -> None:
    holdings, durable = world
    for candidate in decide(holdings, durable).candidates:
        for rank, held in enumerate(holdings):
            keepers = [other for other, kept in enumerate(holdings) if other != rank
                       and candidate.step in kept.replicas.get(rank, frozenset())]
            if candidate.step in held.own and keepers:
                assert candidate.spares[rank] == min(keepers)
            else:
                assert rank not in candidate.spares  # a fetching rank has no spare
