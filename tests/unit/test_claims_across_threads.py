"""Two of one manager's channels claiming at once from two threads make one claim.

A manager's channels share one :class:`~resumekit.store.generations.Fence`; a background
save's thread, the emergency capture's and the training thread may each claim the root's
writer generation. Two claims of one process would fence the first (a newer generation
in the same process): the fence's lock makes each check-then-claim one step. And the
training thread's claim for the local tier's copies is made by every rank at its first
local save, whatever another thread already claimed: a claim is a collective, and a rank
that skipped it while its peer made it hung both.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from resumekit import CheckpointManager, LocalTier
from resumekit.store import generations
from resumekit.store.commit import CommitProtocol
from resumekit.store.manifest import WriterGeneration
from resumekit.store.storage import Storage
from tests.limits import HANG_S

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

def test_two_threads_claiming_through_one_fence_claim_one_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # While the first thread claims, the second tries the fence's lock without blocking:
    # guarded, it cannot get in and waits for the first claim, then finds it held; not
    # guarded, it gets in and claims beside the first (which waits for it to finish), so
    # the root gets two generations. Deterministic: no wait decides the outcome.
    storage = Storage(str(tmp_path / "root"))
    fence = generations.Fence()
    protocols = [CommitProtocol(storage, fence=fence) for _ in range(2)]
    real_claim = generations.claim
    claims: list[str] = []
    got_in: list[bool] = []
    entered = threading.Event()
    results: dict[str, WriterGeneration | None] = {}

    def second() -> None:
        got = fence.lock.acquire(blocking=False)
        got_in.append(got)
        entered.set()
        if not got:
            fence.lock.acquire()  # guarded: the first claim finishes first
        try:
            results["second"] = protocols[1].claim()[0]
        finally:
            fence.lock.release()

    threads: list[threading.Thread] = []

    def claim(*args: object, **kwargs: object) -> WriterGeneration:
        claims.append(threading.current_thread().name)
        if len(claims) == 1:
            thread = threading.Thread(target=second, name="second")
            threads.append(thread)
            thread.start()
            assert entered.wait(HANG_S)
            if got_in[0]:
                thread.join(HANG_S)  # it claims beside the first: let it finish first
        return real_claim(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(generations, "claim", claim)
    results["first"] = protocols[0].claim()[0]
    threads[0].join(HANG_S)
    assert not threads[0].is_alive()
    assert claims == ["MainThread"]
    assert results["first"] == results["second"] == fence.generation is not None


def test_every_first_local_save_claims_on_the_main_channel_even_when_another_thread_had(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 2)
    manager = CheckpointManager(tmp_path / "durable", model=model, retention=None,
                                save_every=100, local=LocalTier(tmp_path / "local",
                                                                save_every=1))
    claimed: list[int] = []
    real = CommitProtocol.claim

    def counting(self: CommitProtocol, **kwargs: bool) -> object:
        claimed.append(1)
        return real(self, **kwargs)

    monkeypatch.setattr(CommitProtocol, "claim", counting)
    manager.restore()
    claimed.clear()
    # As if a background save's thread had claimed already (on this rank, not yet on
    # its peer): the training thread's decision must not depend on it.
    manager._main.protocol.claim()
    claimed.clear()
    with torch.no_grad():
        model.weight.add_(1)
    manager.step_end(1)
    manager.step_end(2)
    manager.close()
    assert claimed == [1]  # the first local save's claim, on every rank; not again


def test_a_first_save_claiming_as_it_begins_and_another_threads_claim_make_one_claim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A save's begin looks at the root, then (no claim held) claims it. Another thread's
    # claim landing between the two made a second generation: the begin's claim, set on
    # the fence last, was then fenced by it, and every save of the process refused.
    storage = Storage(str(tmp_path / "root"))
    fence = generations.Fence()
    saving, claiming = (CommitProtocol(storage, fence=fence) for _ in range(2))
    real_claim = generations.claim
    claims: list[WriterGeneration] = []
    other: list[threading.Thread] = []
    entered = threading.Event()
    got_in: list[bool] = []

    def other_claim() -> None:
        got = fence.lock.acquire(blocking=False)  # the begin's claim is not guarded
        got_in.append(got)
        entered.set()
        if not got:
            fence.lock.acquire()  # guarded: wait for the begin to finish, then claim
        try:
            claiming.claim()
        finally:
            fence.lock.release()

    def claim(*args: object, **kwargs: object) -> WriterGeneration:
        made = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        claims.append(made)
        if len(claims) == 1:  # the begin's claim, not yet on the fence
            thread = threading.Thread(target=other_claim, name="other")
            other.append(thread)
            thread.start()
            assert entered.wait(HANG_S)
            if got_in[0]:
                thread.join(HANG_S)  # it claims beside the begin: let it finish first
        return made

    monkeypatch.setattr(generations, "claim", claim)
    pending = saving.begin(1)
    other[0].join(HANG_S)
    assert not other[0].is_alive()
    assert len(claims) == 1
    assert pending.generation == fence.generation == generations.newest_generation(storage)
