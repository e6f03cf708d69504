"""The local tier in one process: options, local saves, restore across tiers, fencing.

Two ranks, replicas and FSDP2 are tests/dist/test_local_tier_dist.py's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import resumekit
from resumekit.errors import ConfigurationError
from resumekit.local.roots import unusable_reason
from resumekit.local.saves import LocalSaves
from resumekit.store import generations
from resumekit.store.manifest import Lineage, LocalPart, Manifest, WriterGeneration
from resumekit.store.newest import latest_committed
from resumekit.store.storage import Storage
from resumekit.warnings import LocalTierMissWarning, ResumekitWarning
from tests.limits import HANG_S
from tests.unit.test_cli_support import run_cli, run_json


def _objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _manager(tmp: Path, model: nn.Module, opt: torch.optim.Optimizer, *,
             durable: str = "durable", save_every: int = 4, keep: int = 2
             ) -> resumekit.CheckpointManager:
    return resumekit.CheckpointManager(
        tmp / durable, model=model, optimizer=opt, save_every=save_every,
        local=resumekit.LocalTier(tmp / "local", save_every=2, keep=keep, replicas=False))


def _train(tmp: Path, steps: int, **knobs: object) -> dict[int, torch.Tensor]:
    """Train ``steps`` steps from scratch; return the weight after each step."""
    model, opt = _objects()
    weights = {}
    with _manager(tmp, model, opt, **knobs) as ckpt:  # type: ignore[arg-type]
        for step in range(ckpt.restore(), steps):
            model(torch.full((1, 4), float(step))).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_end(step + 1)
            weights[step + 1] = model.weight.detach().clone()
    return weights


def _restore(tmp: Path, **knobs: object) -> tuple[int, str | None, torch.Tensor]:
    model, opt = _objects()
    with _manager(tmp, model, opt, **knobs) as ckpt:  # type: ignore[arg-type]
        step = ckpt.restore()
        return step, ckpt.restored_from_tier, model.weight.detach().clone()


def _steps(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("step_"))


def _corrupt(step_dir: Path) -> None:
    """Flip one byte in the middle of the copy's largest tensor file."""
    files = sorted((path for path in (step_dir / "tensors").iterdir() if path.is_file()),
                   key=lambda path: path.stat().st_size)
    data = bytearray(files[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[-1].write_bytes(bytes(data))


# -- options ----------------------------------------------------------------------------


@pytest.mark.parametrize(("knobs", "name", "said"), [
    ({"root": "s3://bucket/run", "save_every": 2}, "local.root", "node-local"),
    ({"root": "", "save_every": 2}, "local.root", "local directory path"),
    ({"root": "/tmp/x", "save_every": 0}, "local.save_every", "greater than or equal to 1"),
    ({"root": "/tmp/x", "save_every": True}, "local.save_every", "not a bool"),
    ({"root": "/tmp/x", "save_every": 2, "keep": 0}, "local.keep", "greater than or equal"),
    ({"root": "/tmp/x", "save_every": 2, "replicas": "yes please"}, "local.replicas",
     "boolean"),
    ({"root": "/tmp/x", "save_every": 2, "shared": True}, "local.shared", "not an option"),
])
def test_a_local_tier_knob_that_cannot_work_is_refused_naming_it(
        knobs: dict[str, object], name: str, said: str) -> None:
    with pytest.raises(ConfigurationError, match=said) as raised:
        resumekit.LocalTier(**knobs)  # type: ignore[arg-type]
    assert raised.value.fields["name"] == name


def test_a_local_tier_takes_its_root_and_interval_by_position_and_keeps_two_by_default(
        tmp_path: Path) -> None:
    tier = resumekit.LocalTier(tmp_path / "local", 50)
    assert (tier.root, tier.save_every, tier.keep, tier.replicas) == (
        str(tmp_path / "local"), 50, 2, True)
    assert resumekit.CheckpointOptions(local=tier).local is tier


def test_a_read_only_manager_or_a_local_root_that_is_the_durable_root_is_refused(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="read_only") as raised:
        resumekit.CheckpointOptions(read_only=True,
                                    local=resumekit.LocalTier(tmp_path, 2))
    assert raised.value.fields["name"] == "local"
    with pytest.raises(ConfigurationError, match="not the durable root") as raised:
        resumekit.CheckpointManager(tmp_path, local=resumekit.LocalTier(tmp_path, 2))
    assert raised.value.fields["name"] == "local.root"


# -- saving and restoring ---------------------------------------------------------------


def test_local_saves_commit_on_their_interval_and_keep_the_newest_two(tmp_path: Path) -> None:
    _train(tmp_path, 7)
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000004", "step_000000006"]
    assert _steps(tmp_path / "durable") == ["step_000000004"]  # its own interval
    manifest = resumekit.CheckpointManager(tmp_path / "local" / "rank_00000").latest()
    assert manifest is not None  # a resumekit root like any other
    part = manifest.manifest.local
    assert part is not None and part.rank == 0 and part.world_size == 1
    assert part.durable_root == Storage(tmp_path / "durable").url_of()
    assert part.durable_generation is not None


def test_restore_reads_the_newest_local_step_logs_the_choice_and_records_the_tier(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weights = _train(tmp_path, 7)
    with caplog.at_level(logging.INFO, logger="resumekit"):
        step, tier, weight = _restore(tmp_path)
    assert (step, tier) == (6, "local")
    assert torch.equal(weight, weights[6])
    said = [r.getMessage() for r in caplog.records if "resumekit: restore:" in r.getMessage()]
    assert said == ["resumekit: restore: step 6 from the local tier (every rank holds its "
                    "own copy; newer than the durable root's newest (step 4))"]
    _train(tmp_path, 8)  # resumes at 6, saves 8 durably and locally
    for root in (tmp_path / "durable", tmp_path / "local" / "rank_00000"):
        info = resumekit.CheckpointManager(root).latest()
        assert info is not None and info.step == 8
        assert info.manifest.lineage.restored_from_tier == "local"
        assert info.manifest.lineage.resumed_from_step == 6


def test_a_local_step_equal_to_the_durable_newest_is_read_from_the_local_tier(
        tmp_path: Path) -> None:
    _train(tmp_path, 4)
    assert _restore(tmp_path)[:2] == (4, "local")


def test_a_durable_step_newer_than_every_local_copy_is_read_from_the_durable_tier(
        tmp_path: Path) -> None:
    weights = _train(tmp_path, 5, save_every=5)  # durable 5, local 2 and 4
    step, tier, weight = _restore(tmp_path, save_every=5)
    assert (step, tier) == (5, "durable")
    assert torch.equal(weight, weights[5])


def test_a_corrupted_local_copy_falls_back_to_the_next_candidate_with_a_warning(
        tmp_path: Path) -> None:
    weights = _train(tmp_path, 7, save_every=100)  # local 4 and 6, nothing durable
    _corrupt(tmp_path / "local" / "rank_00000" / "step_000000006")
    with pytest.warns(ResumekitWarning) as caught:
        step, tier, weight = _restore(tmp_path, save_every=100)
    assert (step, tier) == (4, "local")
    assert torch.equal(weight, weights[4])
    said = [str(w.message) for w in caught if "not restoring step 6" in str(w.message)]
    assert len(said) == 1
    assert "step_000000006" in said[0] and "trying step 4 next" in said[0]
    # The copy the run left behind is deleted: its step is saved again as training replays.
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000004"]


def test_every_local_copy_failing_falls_back_to_the_durable_root_with_a_warning(
        tmp_path: Path) -> None:
    weights = _train(tmp_path, 7, save_every=3)  # durable 3 and 6, local 4 and 6
    for step in (4, 6):
        _corrupt(tmp_path / "local" / "rank_00000" / f"step_00000000{step}")
    with pytest.warns(ResumekitWarning, match="restoring from the durable root instead"):
        step, tier, weight = _restore(tmp_path, save_every=3)
    assert (step, tier) == (6, "durable")
    assert torch.equal(weight, weights[6])


def test_an_in_job_restart_that_reads_the_durable_root_warns_that_it_missed_the_local_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _train(tmp_path, 7, save_every=3)  # durable 3 and 6, local 4 and 6
    for step in (4, 6):
        _corrupt(tmp_path / "local" / "rank_00000" / f"step_00000000{step}")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # torchrun's second restart
    with pytest.warns(LocalTierMissWarning) as caught:
        step, tier, weight = _restore(tmp_path, save_every=3)
    assert (step, tier) == (6, "durable")
    assert torch.equal(weight, weights[6])
    said = [str(w.message) for w in caught if "in-job restart" in str(w.message)]
    assert said == ["in-job restart 2 (torchrun --max-restarts) found no usable node-local "
                    "copy: no node-local step could be restored; the durable root's newest "
                    "restorable is step 6; restoring step 6 from the durable root, the steps "
                    "since are trained again"]


def test_an_in_job_restart_with_nothing_anywhere_warns_that_it_starts_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.warns(ResumekitWarning, match=r"in-job restart 1 .*no rank holds a usable "
                      r"node-local copy.*starting over from step 0"):
        assert _restore(tmp_path)[:2] == (0, None)


def test_a_first_attempt_or_a_local_restore_says_nothing_of_in_job_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    _train(tmp_path, 5, save_every=3)  # durable 3, local 2 and 4
    assert _restore(tmp_path, save_every=3)[:2] == (4, "local")  # no restart: no warning
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _restore(tmp_path, save_every=3)[:2] == (4, "local")  # the restart's promise kept
    assert not [w for w in recwarn if "in-job restart" in str(w.message)]


def test_in_job_restarts_reads_torchruns_count_and_takes_a_bad_value_as_none() -> None:
    from resumekit.local.restore_across import in_job_restarts

    assert in_job_restarts({}) == 0
    assert in_job_restarts({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
    assert in_job_restarts({"TORCHELASTIC_RESTART_COUNT": "three"}) == 0


def test_a_fenced_writers_local_copies_are_never_resumed(tmp_path: Path) -> None:
    _train(tmp_path, 4, save_every=100)  # local 2 and 4 under the durable generation 1
    # A requeued run (another process) claims the durable root; then the zombie of the
    # first run goes on and commits a local copy of step 6 under its fenced generation.
    zombie, opt = _objects()
    with _manager(tmp_path, zombie, opt, save_every=100) as ckpt:
        start = ckpt.restore()
        generations.claim(Storage(tmp_path / "durable"), newest_step=None,
                          identity=Lineage(hostname="elsewhere", pid=4242))
        for step in range(start, 6):
            ckpt.step_end(step + 1)
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000004", "step_000000006"]
    with pytest.warns(ResumekitWarning, match="fenced writer's copy is never resumed"):
        step, tier, _ = _restore(tmp_path, save_every=100)
    assert (step, tier) == (0, None)  # nothing durable: a fresh start, not the zombie's 6
    assert _steps(tmp_path / "local" / "rank_00000") == []


def test_copies_of_another_durable_root_are_not_restored_and_say_why(tmp_path: Path) -> None:
    _train(tmp_path, 4, durable="first")
    with pytest.warns(ResumekitWarning, match="belongs to the run of durable root"):
        step, tier, _ = _restore(tmp_path, durable="second")
    assert (step, tier) == (0, None)


def test_an_explicit_step_restores_from_the_durable_root_and_drops_newer_local_copies(
        tmp_path: Path) -> None:
    weights = _train(tmp_path, 8)  # durable 4 and 8, local 6 and 8
    model, opt = _objects()
    with _manager(tmp_path, model, opt) as ckpt:
        assert ckpt.restore(4) == 4
        assert ckpt.restored_from_tier == "durable"
        assert torch.equal(model.weight, weights[4])
        # The local copies of the timeline it left (6 and 8) are gone: 6 saves again.
        assert _steps(tmp_path / "local" / "rank_00000") == []
        for step in range(4, 6):
            ckpt.step_end(step + 1)
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000006"]


def test_a_failed_local_save_is_a_warning_and_training_and_durable_saves_go_on(
        tmp_path: Path) -> None:
    (tmp_path / "local").write_text("a file where the local tier's directory should be")
    with pytest.warns(ResumekitWarning, match="local save of step 2 under .* failed"):
        _train(tmp_path, 4)
    assert _steps(tmp_path / "durable") == ["step_000000004"]


def test_replicas_on_one_process_say_once_that_nothing_is_replicated(tmp_path: Path) -> None:
    model, opt = _objects()
    with pytest.warns(ResumekitWarning, match="no copy is replicated") as caught, \
            resumekit.CheckpointManager(tmp_path / "durable", model=model, optimizer=opt,
                                        local=resumekit.LocalTier(tmp_path / "l", 1)) as ckpt:
        for step in range(3):
            ckpt.step_end(step + 1)
    assert sum("no copy is replicated" in str(w.message) for w in caught) == 1
    assert _steps(tmp_path / "l" / "rank_00000") == ["step_000000002", "step_000000003"]


# -- which copies a run may use -----------------------------------------------------------


def _copy(**part: object) -> Manifest:
    generation = WriterGeneration(number=3, token="t3")
    fields: dict[str, object] = {"rank": 1, "world_size": 4, "node": "n1",
                                 "durable_root": "file:///d", "durable_generation": generation}
    fields.update(part)
    return Manifest(step=10, local=LocalPart(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("manifest", "current", "said"), [
    (_copy(), WriterGeneration(number=3, token="t3"), None),
    (_copy(), None, None),
    (_copy(rank=2), None, "rank 2's part, not rank 1's"),
    (_copy(durable_root="file:///other"), None, "durable root file:///other"),
    (_copy(world_size=8), None, "world size 8; this run has 4"),
    (_copy(durable_generation=None), None, "no writer generation"),
    (_copy(), WriterGeneration(number=4, token="t4"), "fenced"),
    (Manifest(step=10), None, "not say it is a node-local copy"),
])
def test_a_copy_is_usable_only_by_its_rank_of_its_run_under_the_newest_claim(
        manifest: Manifest, current: WriterGeneration | None, said: str | None) -> None:
    why = unusable_reason(manifest, rank=1, world_size=4, durable_root="file:///d",
                          current=current)
    assert (why is None) if said is None else (why is not None and said in why)


# -- resumekit inspect ------------------------------------------------------------------


def test_inspect_of_a_local_root_lists_its_sub_roots(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _train(tmp_path, 7)
    code, document, _ = run_json(capsys, "inspect", str(tmp_path / "local"))
    assert code == 0 and document["kind"] == "local_root"
    [row] = document["sub_roots"]
    assert (row["name"], row["kind"], row["rank"], row["steps"], row["world_size"]) == (
        "rank_00000", "own", 0, [4, 6], 1)
    assert row["durable_root"] == Storage(tmp_path / "durable").url_of()
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path / "local"))
    assert code == 0 and "rank_00000" in out and "rank 0's own copies" in out and "4, 6" in out
    code, document, _ = run_json(capsys, "inspect", str(tmp_path / "local" / "rank_00000"))
    assert code == 0 and document["kind"] == "root" and document["resume_from"] == 6


def test_a_local_save_holds_training_for_its_staging_copy_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.local.site import LocalSite  # noqa: PLC0415 - the class patched

    release = threading.Event()
    writing: list[int] = []
    real = LocalSite._write

    def held_write(self: LocalSite, job: object, manifest: object) -> str:
        writing.append(job.step)  # type: ignore[attr-defined]
        # Held until the test releases it, unless training itself writes (then the test
        # fails below rather than waiting for itself).
        assert threading.current_thread() is not threading.main_thread(), \
            "the local save wrote on the training thread"
        assert release.wait(timeout=HANG_S), "the test never released the write"
        return real(self, job, manifest)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalSite, "_write", held_write)
    model, opt = _objects()
    ckpt = _manager(tmp_path, model, opt, save_every=100)
    ckpt.restore()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ckpt.step_end(1)
    at_one = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    at_two = model.weight.detach().clone()
    ckpt.step_end(2)  # a local save is due: it returns while its write is held
    with torch.no_grad():  # training goes on and changes the weights meanwhile
        model.weight.add_(1.0)
    own = tmp_path / "local" / "rank_00000"
    assert not own.exists() or _steps(own) == []
    release.set()
    ckpt.wait()  # waits for the local save too
    assert writing == [2]
    assert _steps(own) == ["step_000000002"]
    ckpt.close()
    # The copy is of step 2 as it was staged, not of the weights changed after.
    step, tier, weight = _restore(tmp_path, save_every=100)
    assert (step, tier) == (2, "local")
    assert torch.equal(weight, at_two) and not torch.equal(weight, at_one)
    assert not torch.equal(weight, model.weight.detach())


def test_a_restore_waits_for_the_local_save_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.local.site import LocalSite  # noqa: PLC0415 - the class patched

    order: list[str] = []
    calling, waiting, restoring = threading.Event(), threading.Event(), threading.Event()
    real = LocalSite._write
    real_autos = resumekit.CheckpointManager._autos
    real_wait = LocalSaves.wait

    def held_write(self: LocalSite, job: object, manifest: object) -> str:
        # Held until the restore is inside its wait for this write (then it goes on), or
        # got past that point without waiting (then the order says so): an event either
        # way, whatever the machine's load.
        if threading.current_thread() is not threading.main_thread():
            assert calling.wait(timeout=HANG_S), "the test never called restore()"
            deadline = time.monotonic() + HANG_S  # a hang detector
            while not (waiting.is_set() or restoring.is_set()):
                assert time.monotonic() < deadline, "the restore neither waited nor read"
                time.sleep(0.01)
            if restoring.is_set():
                order.append("the restore began while the write was held")
        name = real(self, job, manifest)  # type: ignore[arg-type]
        order.append("written")
        return name

    def wait(self: LocalSaves) -> None:
        if calling.is_set():
            waiting.set()  # the restore waits for the local save in flight
        real_wait(self)

    def autos(self: resumekit.CheckpointManager) -> object:
        restoring.set()  # the restore, past its wait for the local save
        return real_autos(self)

    monkeypatch.setattr(LocalSite, "_write", held_write)
    monkeypatch.setattr(LocalSaves, "wait", wait)
    model, opt = _objects()
    with _manager(tmp_path, model, opt, save_every=100) as ckpt:
        ckpt.restore()
        for step in (1, 2):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            ckpt.step_end(step)
        order.append("restoring")
        monkeypatch.setattr(resumekit.CheckpointManager, "_autos", autos)
        calling.set()
        assert ckpt.restore() == 2  # the copy of step 2 was committed before it read
        assert ckpt.restored_from_tier == "local"
    assert order == ["restoring", "written"]


def test_a_failed_background_local_save_is_one_warning_and_hides_no_committed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.local.site import LocalSite  # noqa: PLC0415 - the class patched

    real = LocalSite._write

    def full_at_four(self: LocalSite, job: object, manifest: object) -> str:
        if job.step == 4:  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        return real(self, job, manifest)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalSite, "_write", full_at_four)
    with pytest.warns(ResumekitWarning) as caught:
        weights = _train(tmp_path, 7, save_every=100)
    said = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(said) == 1, said
    assert "local save of step 4 under" in said[0] and "No space left on device" in said[0]
    # Step 2 stays committed beside 6 (the failed step 4 took nothing away), and the
    # newest copy is what a restore reads.
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000002", "step_000000006"]
    step, tier, weight = _restore(tmp_path, save_every=100)
    assert (step, tier) == (6, "local") and torch.equal(weight, weights[6])


def test_an_unexpected_error_of_a_background_local_save_is_raised_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.errors import AsyncSaveError  # noqa: PLC0415
    from resumekit.local.site import LocalSite  # noqa: PLC0415 - the class patched

    def broken(self: LocalSite, job: object, manifest: object) -> str:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(LocalSite, "_write", broken)
    model, opt = _objects()
    ckpt = _manager(tmp_path, model, opt, save_every=100)
    ckpt.restore()
    for step in (1, 2):
        ckpt.step_end(step)
    with pytest.raises(AsyncSaveError, match=r"local save of step 2 failed: RuntimeError: "
                                             r"a bug in the writer") as raised:
        ckpt.wait()
    assert raised.value.fields["step"] == 2
    ckpt.wait()  # raised once
    ckpt.close()


def test_a_failed_background_local_save_does_not_stop_a_preemptions_durable_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumekit.local.site import LocalSite  # noqa: PLC0415 - the class patched

    def broken(self: LocalSite, job: object, manifest: object) -> str:
        raise RuntimeError("a bug in the writer")

    monkeypatch.setattr(LocalSite, "_write", broken)
    model, opt = _objects()
    handler = resumekit.PreemptionHandler()
    ckpt = resumekit.CheckpointManager(
        tmp_path / "durable", model=model, optimizer=opt, save_every=100, preemption=handler,
        local=resumekit.LocalTier(tmp_path / "local", save_every=2, replicas=False))
    ckpt.restore()
    for step in (1, 2):
        ckpt.step_end(step)
    ckpt._local_saves.join()  # the local save of step 2 has failed by now
    handler.request()
    with pytest.warns(ResumekitWarning, match=r"local save of step 2 failed: RuntimeError: a "
                      r"bug in the writer; the preemption's save to the durable root goes on"):
        assert ckpt.step_end(3) is True
    ckpt.close()
    entry = latest_committed(Storage(tmp_path / "durable"))
    assert entry is not None and entry.step == 3 and entry.manifest is not None
    assert entry.manifest.reason == "preemption"


_KILLED_MID_WRITE = """
import os, sys, threading, torch
from torch import nn
import resumekit
from resumekit.local.site import LocalSite

real = LocalSite._write
def held(self, job, manifest):
    if job.step == 4:
        print("writing 4", flush=True)
        threading.Event().wait()  # killed here
    return real(self, job, manifest)
LocalSite._write = held
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
ckpt = resumekit.CheckpointManager(
    sys.argv[1] + "/durable", model=model, optimizer=opt, save_every=3,
    local=resumekit.LocalTier(sys.argv[1] + "/local", save_every=2, keep=1, replicas=False))
ckpt.restore()
for step in range(1, 7):
    model(torch.full((1, 4), float(step))).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.step_end(step)
    if step == 3:
        ckpt.wait()
        torch.save(model.weight.detach(), sys.argv[1] + "/weight3.pt")
print("not killed", flush=True)
"""


def test_a_kill_while_a_local_save_writes_in_the_background_leaves_the_newest_committed(
        tmp_path: Path) -> None:
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    worker = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()  # blocks until the write of step 4 is held
        assert line == "writing 4\n", line
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait(timeout=HANG_S)
    # keep=1: step 2's copy stays until step 4's commits; durable step 3 is newer.
    assert _steps(tmp_path / "local" / "rank_00000") == ["step_000000002"]
    step, tier, weight = _restore(tmp_path, save_every=3, keep=1)
    assert (step, tier) == (3, "durable")
    assert torch.equal(weight, torch.load(tmp_path / "weight3.pt"))


def test_local_saves_reuse_their_plan_until_the_layout_changes_and_each_copy_restores(
        tmp_path: Path) -> None:
    model, opt = _objects()
    model.register_buffer("scale", torch.ones(2))
    with _manager(tmp_path, model, opt, save_every=100) as ckpt:  # local: every 2 steps
        for step in range(ckpt.restore(), 6):
            if step == 4:  # the state's layout changes before the third local save
                model.scale = torch.arange(3, dtype=torch.float64)
            model(torch.full((1, 4), float(step))).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_end(step + 1)
        ckpt.wait()
        weight = model.weight.detach().clone()
        local = ckpt._local
        assert local is not None
        assert (local.plans.misses, local.plans.hits) == (2, 1)  # steps 2 and 6; 4 reused
    model, opt = _objects()
    model.register_buffer("scale", torch.zeros(3, dtype=torch.float64))
    with _manager(tmp_path, model, opt, save_every=100) as ckpt:
        assert ckpt.restore() == 6 and ckpt.restored_from_tier == "local"
    assert torch.equal(model.scale, torch.arange(3, dtype=torch.float64))
    assert torch.equal(model.weight, weight)
