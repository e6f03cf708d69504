"""The choice across tiers in the cases a reader checks by eye (the rule: tests/property)."""

from __future__ import annotations

from resumekit.local.tier_choice import Candidate, Holdings, decide


def test_a_step_every_rank_holds_itself_is_the_local_tier_and_the_newest_comes_first() -> None:
    choice = decide([Holdings.of({10, 20}), Holdings.of({10, 20})], durable_step=5)
    assert choice.candidates == (Candidate(20, "local"), Candidate(10, "local"))


def test_a_rank_without_its_copy_fetches_it_from_the_rank_keeping_its_replica() -> None:
    choice = decide([Holdings.of({20}, {1: {20}}), Holdings.of({10}, {0: {20}})], None)
    # Rank 0 reads its own copy; rank 1 keeps a replica of it: rank 0's spare.
    assert choice.candidates[0] == Candidate(20, "replica", {1: 0}, spares={0: 1})
    assert "rank 1 from rank 0's replica" in choice.candidates[0].why(None)


def test_a_rank_whose_own_copy_is_also_kept_by_a_partner_has_that_partner_as_spare() -> None:
    choice = decide([Holdings.of({20}, {1: {20}}), Holdings.of({20}, {0: {10}})], None)
    assert choice.candidates == (Candidate(20, "local", spares={1: 0}),)


def test_a_step_one_rank_cannot_get_is_no_candidate_and_durable_explains_why() -> None:
    choice = decide([Holdings.of({20}), Holdings.of({10})], durable_step=15)
    assert choice.candidates == ()
    assert "no step at least as new as the durable root's" in choice.durable_why()
    assert "newest node-local copy: step 20" in choice.durable_why()


def test_a_local_step_equal_to_the_durable_newest_is_read_locally() -> None:
    choice = decide([Holdings.of({30}), Holdings.of({30})], durable_step=30)
    assert [candidate.step for candidate in choice.candidates] == [30]
    assert "the same step 30" in choice.candidates[0].why(30)


def test_local_steps_older_than_the_durable_newest_are_not_candidates() -> None:
    choice = decide([Holdings.of({10, 20}), Holdings.of({10, 20})], durable_step=25)
    assert choice.candidates == ()


def test_a_replica_a_rank_keeps_of_itself_is_not_a_source() -> None:
    choice = decide([Holdings.of(set(), {0: {20}}), Holdings.of({20})], None)
    assert choice.candidates == ()
