from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import resumekit
from resumekit.errors import (
    AsyncSaveError,
    IncompatibleCheckpointError,
    StepCollisionError,
)
from resumekit.manager import CheckpointManager
from resumekit.store.catalog import list_checkpoints
from resumekit.store.retention import keep_last
from resumekit.warnings import ResumekitWarning


def _build(seed: int = 0, hidden: int = 8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(1234)
    return model, opt, sched, gen


def _train_step(model, opt, sched, gen) -> float:
    x = torch.randn(16, 4, generator=gen)
    noise = torch.randn(16, 2) * 0.01 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
    loss = ((model(x) - noise) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _manager(root: Path, model, opt, sched, gen, **kwargs) -> CheckpointManager:
    return CheckpointManager(root, model=model, optimizer=opt, scheduler=sched,
                             generators={"noise": gen}, **kwargs)


def test_a_fresh_root_restores_to_step_zero(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    assert _manager(tmp_path, model, opt, sched, gen).restore() == 0


def test_restore_brings_back_weights_optimizer_scheduler_step_rng_and_extras(
        tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen, extras={"wandb_run_id": "abc"})
    for _ in range(1, 4):
        _train_step(model, opt, sched, gen)
    ckpt.save(3)
    ckpt.close()
    expected_next = [_train_step(model, opt, sched, gen) for _ in range(3)]

    model2, opt2, sched2, gen2 = _build(seed=99)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    again = _manager(tmp_path, model2, opt2, sched2, gen2)
    assert again.restore() == 3
    assert again.extras == {"wandb_run_id": "abc"}
    assert sched2.last_epoch == 3
    assert [_train_step(model2, opt2, sched2, gen2) for _ in range(3)] == expected_next


def test_saving_a_step_not_newer_than_the_newest_is_a_collision(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen)
    ckpt.save(10)
    with pytest.raises(StepCollisionError) as caught:
        ckpt.save(10)
    assert caught.value.step == 10 and caught.value.newest == 10
    fresh = _manager(tmp_path, *_build())
    with pytest.raises(StepCollisionError):
        fresh.save(5)  # a restarted run that forgot to restore cannot overwrite
    ckpt.save(10, replace=True)
    assert [e.step for e in list_checkpoints(ckpt.storage)] == [10]


def test_step_end_saves_on_the_interval_and_prunes_old_checkpoints(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen, save_every=2, retention=keep_last(2))
    for step in range(1, 8):
        _train_step(model, opt, sched, gen)
        assert ckpt.step_end(step) is False
    ckpt.close()
    committed = [e.step for e in list_checkpoints(ckpt.storage) if e.status == "committed"]
    assert committed == [4, 6]
    assert ckpt.latest() is not None and ckpt.latest().manifest.reason.value == "interval"


def test_an_async_save_holds_the_state_at_the_moment_of_the_call(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen, async_save=True)
    _train_step(model, opt, sched, gen)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1)
    for _ in range(3):  # training goes on while the save is written
        _train_step(model, opt, sched, gen)
    ckpt.wait()
    ckpt.wait()  # idempotent
    ckpt.close()
    ckpt.close()
    model2, opt2, sched2, gen2 = _build(seed=3)
    assert _manager(tmp_path, model2, opt2, sched2, gen2).restore() == 1
    for key, value in model2.state_dict().items():
        assert torch.equal(value, snapshot[key]), key


def test_a_background_write_failure_surfaces_on_the_next_call(tmp_path: Path, monkeypatch) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen, async_save=True)
    from resumekit import tensors

    def broken_save(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(tensors, "save", broken_save)
    ckpt.save(1)
    with pytest.raises(AsyncSaveError, match="disk on fire"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.save(2)
    ckpt.close()
    assert [e.step for e in list_checkpoints(ckpt.storage) if e.status == "committed"] == [2]
    assert not [e for e in list_checkpoints(ckpt.storage) if e.status != "committed"]


def test_a_renamed_parameter_is_refused_before_anything_loads(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    _manager(tmp_path, model, opt, sched, gen).save(1)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    other.add_module("head", nn.Linear(8, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    opt2 = torch.optim.AdamW(other.parameters())
    with pytest.raises(IncompatibleCheckpointError, match=r"head\.weight"):
        CheckpointManager(tmp_path, model=other, optimizer=opt2).restore()
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_a_changed_shape_is_refused(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    _manager(tmp_path, model, opt, sched, gen).save(1)
    wider = _build(hidden=16)
    with pytest.raises(IncompatibleCheckpointError, match=r"0\.weight"):
        _manager(tmp_path, *wider).restore()


def test_a_changed_config_is_an_error_by_default_and_a_warning_on_request(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    _manager(tmp_path, model, opt, sched, gen, config={"lr": 3e-5, "warmup": 200}).save(1)
    with pytest.raises(IncompatibleCheckpointError, match=r"config\.warmup"):
        _manager(tmp_path, *_build(), config={"lr": 3e-5, "warmup": 100}).restore()
    with pytest.warns(ResumekitWarning, match="config.warmup"):
        assert _manager(tmp_path, *_build(), config={"lr": 3e-5, "warmup": 100},
                        on_mismatch="warn").restore() == 1


def test_restore_falls_back_to_the_previous_checkpoint_when_the_newest_is_corrupt(
        tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen)
    ckpt.save(1)
    _train_step(model, opt, sched, gen)
    ckpt.save(2)
    victim = next((tmp_path / "step_000000002" / "tensors").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(resumekit.CorruptCheckpointError, match="distcp"):
        _manager(tmp_path, *_build(), fallback=False).restore()
    with pytest.warns(ResumekitWarning, match="step 2"):
        assert _manager(tmp_path, *_build()).restore() == 1


def test_when_every_checkpoint_fails_to_load_restore_raises_and_says_the_model_is_partly_loaded(
        tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen)
    ckpt.save(1)
    for victim in (tmp_path / "step_000000001" / "tensors").glob("*.distcp"):
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    with pytest.warns(ResumekitWarning), pytest.raises(resumekit.ResumekitError) as caught:
        _manager(tmp_path, *_build()).restore()
    assert "no checkpoint under" in str(caught.value) and "step 1" in str(caught.value)
    assert "may now hold part of a checkpoint" in str(caught.value)
    assert "build them again" in str(caught.value)


def test_the_manifest_records_reason_lineage_and_contents(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "111882")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen)
    ckpt.save(7, reason="final")
    manifest = ckpt.latest().manifest
    assert manifest.reason.value == "final"
    assert manifest.lineage.slurm_job_id == "111882" and manifest.lineage.slurm_restart_count == 2
    assert manifest.state["optimizer"] is True and manifest.state["generators"] == ["noise"]
    assert any(f.path.startswith("tensors/") for f in manifest.files)
    assert {"train_state.pt", "rank_state/rank_00000.pt"} <= {f.path for f in manifest.files}


def test_a_preemption_signal_makes_step_end_save_and_say_stop(tmp_path: Path) -> None:
    import os
    import signal

    from resumekit.runtime.preemption import PreemptionHandler

    previous = signal.getsignal(signal.SIGUSR1)
    model, opt, sched, gen = _build()
    handler = PreemptionHandler(signals=("SIGUSR1",))
    ckpt = _manager(tmp_path, model, opt, sched, gen, save_every=100, preemption=handler)
    assert signal.getsignal(signal.SIGUSR1) != previous  # installed by the manager
    _train_step(model, opt, sched, gen)
    assert ckpt.step_end(1) is False
    os.kill(os.getpid(), signal.SIGUSR1)
    _train_step(model, opt, sched, gen)
    assert ckpt.step_end(2) is True
    latest = ckpt.latest()
    assert latest is not None and latest.step == 2
    assert latest.manifest.reason.value == "preemption"
    ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) == previous  # and removed again


def test_a_corrupt_newest_checkpoint_is_set_aside_so_the_resumed_run_can_save_its_step_again(
    tmp_path: Path,
) -> None:
    model, opt, sched, gen = _build()
    ckpt = _manager(tmp_path, model, opt, sched, gen)
    ckpt.save(100)
    ckpt.save(200)
    victim = tmp_path / "step_000000200" / "train_state.pt"
    victim.write_bytes(victim.read_bytes()[:-3])
    resumed = _manager(tmp_path, *_build())
    with pytest.warns(ResumekitWarning, match="set aside"):
        assert resumed.restore() == 100
    resumed.save(150)
    resumed.save(200)  # no StepCollisionError: the bad 200 no longer counts as committed
    entries = {e.name: e.status for e in list_checkpoints(resumed.storage)}
    assert entries["step_000000200"] == "committed"
    aside = [name for name in entries if name.startswith(".step_000000200.bad-")]
    assert len(aside) == 1 and entries[aside[0]] == "corrupt"
    assert (tmp_path / aside[0] / "tensors").is_dir()  # kept, not deleted


def test_a_fresh_start_next_to_checkpoints_of_another_name_format_warns(tmp_path: Path) -> None:
    model, opt, sched, gen = _build()
    _manager(tmp_path, model, opt, sched, gen, name_format="checkpoint_step_{step}").save(5)
    with pytest.warns(ResumekitWarning, match="checkpoint_step_5"):
        assert _manager(tmp_path, *_build()).restore() == 0
