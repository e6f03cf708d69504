"""``ResumekitCheckpointer`` built from its config as torchtitan's trainer builds it, one process.

torchtitan's real llama3 (stock, fused QKV), ``OptimizersContainer`` and
``LRSchedulersContainer``; each torchtitan ``[checkpoint]`` field's mapping. The loop on
2 FSDP2 ranks, with SIGTERM and SIGKILL, is tests/dist/test_torchtitan_checkpointer.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from resumekit import ConfigurationError, ResumekitWarning
from resumekit.cli import main as cli_main
from resumekit.store.catalog import list_checkpoints
from resumekit.store.storage import Storage
from tests.distributed_harness import run_ranks
from tests.torchtitan_models import (
    TrainProgress,
    fake_steps,
    llama3,
    optimizers_container,
    write_torchtitan_checkpoints,
)


class Run:
    """torchtitan's components and the checkpointer its trainer would build from ``fields``."""

    def __init__(self, folder: Path, *, seed: int = 0, parts: int = 1, n_layers: int = 1,
                 **fields: Any) -> None:
        from torchtitan.components.optimizer import LRSchedulersContainer

        from resumekit.integrations.torchtitan import ResumekitCheckpointer

        self.model = llama3(n_layers=n_layers, seed=seed)
        self.optimizers = optimizers_container(self.model)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10)
        self.train_state = TrainProgress()
        fields = {"enable": True, "interval": 2, "preemption": False, **fields}
        self.config = ResumekitCheckpointer.Config(**fields)
        self.checkpointer = self.config.build(
            dataloader=None, model_parts=[self.model] * parts, optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.train_state},
            sd_adapter=None, base_folder=str(folder))

    def train(self, steps: int, *, last: int = 10) -> None:
        for _ in range(steps):
            self.train_state.step += 1
            fake_steps(self.model, self.optimizers, 1, seed=self.train_state.step)
            self.schedulers.step()
            self.train_state.ntokens_seen += 512
            self.checkpointer.save(self.train_state.step,
                                   last_step=self.train_state.step == last)


def _committed(root: Path) -> list[tuple[int, str]]:
    return [(entry.step, str(entry.manifest.reason.value))
            for entry in list_checkpoints(Storage(root))
            if entry.status == "committed" and entry.manifest is not None]


def _same_weights(left: torch.nn.Module, right: torch.nn.Module) -> None:
    for (name, want), (_, have) in zip(left.named_parameters(), right.named_parameters(),
                                       strict=True):
        assert torch.equal(want, have), name


def test_torchtitans_build_makes_the_checkpointer_and_a_fresh_process_resumes_everything(
        tmp_path: Path) -> None:
    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    run = Run(tmp_path)
    assert isinstance(run.checkpointer, ResumekitCheckpointer)
    assert run.checkpointer.load(step=-1) is False  # a fresh start
    run.train(4)
    run.checkpointer.close()
    assert _committed(tmp_path / "checkpoint") == [(2, "interval"), (4, "interval")]

    fresh = Run(tmp_path, seed=1)
    assert fresh.checkpointer.load(step=-1) is True
    assert fresh.train_state.state_dict() == {"step": 4, "ntokens_seen": 2048}
    _same_weights(run.model, fresh.model)
    assert fresh.schedulers.state_dict() == run.schedulers.state_dict()
    for mine, theirs in zip(run.optimizers.optimizers, fresh.optimizers.optimizers,
                            strict=True):
        for want, have in zip(mine.state.values(), theirs.state.values(), strict=True):
            assert torch.equal(want["exp_avg"], have["exp_avg"])
    fresh.train(1)  # the loop counts on from the restored step
    fresh.checkpointer.close()


def test_load_step_restores_that_step_and_warns_of_the_newer_ones(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.train(4)
    run.checkpointer.close()
    fresh = Run(tmp_path, load_step=2)
    with pytest.warns(ResumekitWarning, match="4"):
        assert fresh.checkpointer.load(step=fresh.config.load_step) is True
    assert fresh.train_state.step == 2
    fresh.checkpointer.close()


def test_keep_latest_k_keeps_that_many_commits_and_zero_keeps_all(tmp_path: Path) -> None:
    run = Run(tmp_path / "two", interval=1, keep_latest_k=2)
    run.train(5)
    run.checkpointer.close()
    assert [step for step, _ in _committed(tmp_path / "two" / "checkpoint")] == [4, 5]
    run = Run(tmp_path / "all", interval=1, keep_latest_k=0)
    run.train(5)
    run.checkpointer.close()
    assert [step for step, _ in _committed(tmp_path / "all" / "checkpoint")] == [1, 2, 3, 4, 5]


def test_the_last_step_is_committed_as_final_and_step_1_when_asked(tmp_path: Path) -> None:
    run = Run(tmp_path, interval=4, enable_first_step_checkpoint=True)
    run.train(5, last=5)
    run.checkpointer.close()
    assert _committed(tmp_path / "checkpoint") == [(1, "interval"), (4, "interval"),
                                                   (5, "final")]


def test_a_disabled_checkpointer_loads_and_saves_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path, enable=False)
    assert run.checkpointer.load() is False
    run.train(4)
    run.checkpointer.maybe_wait_for_staging()
    run.checkpointer.close()
    assert not (tmp_path / "checkpoint").exists()


def test_load_only_restores_and_never_saves(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.train(2)
    run.checkpointer.close()
    reader = Run(tmp_path, seed=1, load_only=True)
    assert reader.checkpointer.load() is True
    assert reader.train_state.step == 2
    reader.train(4)
    reader.checkpointer.close()
    assert _committed(tmp_path / "checkpoint") == [(2, "interval")]


def test_initial_load_path_model_only_takes_the_weights_alone(tmp_path: Path) -> None:
    source = Run(tmp_path / "pretrain")
    source.train(2)
    source.checkpointer.close()
    run = Run(tmp_path / "finetune", seed=1,
              initial_load_path=str(tmp_path / "pretrain" / "checkpoint"))
    assert run.checkpointer.load() is True
    assert run.train_state.state_dict() == {"step": 0, "ntokens_seen": 0}
    _same_weights(source.model, run.model)
    assert not any(part.state for part in run.optimizers.optimizers)
    run.train(2)
    run.checkpointer.close()
    assert _committed(tmp_path / "finetune" / "checkpoint") == [(2, "interval")]


def test_initial_load_path_with_the_whole_state_resumes_another_runs_checkpoint(
        tmp_path: Path) -> None:
    source = Run(tmp_path / "first")
    source.train(2)
    source.checkpointer.close()
    run = Run(tmp_path / "second", seed=1, initial_load_model_only=False,
              initial_load_path=str(tmp_path / "first" / "checkpoint"))
    assert run.checkpointer.load() is True
    assert run.train_state.state_dict() == {"step": 2, "ntokens_seen": 1024}
    _same_weights(source.model, run.model)
    run.train(2)
    run.checkpointer.close()
    assert _committed(tmp_path / "second" / "checkpoint") == [(4, "interval")]
    assert _committed(tmp_path / "first" / "checkpoint") == [(2, "interval")]


def test_an_initial_load_path_without_a_resumekit_checkpoint_is_refused_by_name(
        tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    run = Run(tmp_path / "run", initial_load_model_only=False,
              initial_load_path=str(tmp_path / "empty"))
    with pytest.raises(ConfigurationError, match="initial_load_path"):
        run.checkpointer.load()
    run.checkpointer.close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"initial_load_in_hf": True}, "checkpoint.initial_load_in_hf"),
    ({"last_save_in_hf": True}, "checkpoint.last_save_in_hf"),
    ({"create_seed_checkpoint": True}, "checkpoint.create_seed_checkpoint"),
    ({"exclude_from_loading": ["optimizer"]}, "checkpoint.exclude_from_loading"),
    ({"parts": 2}, "model_parts"),
])
def test_what_resumekit_cannot_do_is_refused_when_the_trainer_builds_it(
        tmp_path: Path, fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Run(tmp_path, **fields)
    assert caught.value.name == named  # type: ignore[attr-defined]


def test_from_torchtitan_carries_every_field_of_torchtitans_own_config() -> None:
    from torchtitan.components.checkpoint import CheckpointManager

    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    theirs = CheckpointManager.Config(enable=True, folder="ckpt", interval=7, keep_latest_k=3,
                                      async_mode="async", load_step=5,
                                      last_save_model_only=False)
    ours = ResumekitCheckpointer.Config.from_torchtitan(theirs, local_folder="/tmp/x",
                                                        local_interval=2)
    assert {name: getattr(ours, name) for name in theirs.to_dict()} == theirs.to_dict()
    assert (ours.local_folder, ours.local_interval) == ("/tmp/x", 2)


def test_async_mode_async_saves_in_the_background_and_commits(tmp_path: Path) -> None:
    run = Run(tmp_path, async_mode="async")
    assert (run.checkpointer.manager.async_save, run.checkpointer.manager.async_writer) == (
        True, "thread")
    run.train(4)
    run.checkpointer.close()
    assert _committed(tmp_path / "checkpoint") == [(2, "interval"), (4, "interval")]


def _write_with_torchtitan(rank: int, world: int, folder: str) -> dict[str, Any]:
    return write_torchtitan_checkpoints(folder, fuse_qkv=True, steps=4, interval=4)


def test_a_torchtitan_run_imported_with_resumekit_import_resumes_in_the_checkpointer(
        tmp_path: Path) -> None:
    """The way over for a run torchtitan's own checkpointer saved: import, switch the line."""
    # torchtitan's checkpointer needs a process group (its purge asks dist.get_rank())
    reference = run_ranks(_write_with_torchtitan, 1, args=(str(tmp_path / "titan"),))[0]
    source = tmp_path / "titan" / "checkpoint" / "step-4"
    assert cli_main(["import", str(source), str(tmp_path / "run" / "checkpoint")]) == 0
    run = Run(tmp_path / "run", seed=5, n_layers=2)
    assert run.checkpointer.load() is True
    assert run.train_state.state_dict() == {"step": 4,
                                            "ntokens_seen": reference["ntokens_seen"]}
    for name, param in run.model.named_parameters():
        assert torch.equal(param, reference["params"][name]), name
    assert run.schedulers.state_dict()["last_epoch"] == reference["last_epoch"]
    run.train(2)
    run.checkpointer.close()
    assert _committed(tmp_path / "run" / "checkpoint")[-1] == (6, "interval")


def test_torchtitans_command_line_overrides_the_fields_of_the_switched_config() -> None:
    """tyro, with torchtitan's registry, parses ``--checkpoint.*`` into our config as set."""
    import dataclasses

    import tyro
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.config.manager import custom_registry

    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    # the trainer's field, as Trainer.Config declares it (a real type, not a string)
    TrainerConfig = dataclasses.make_dataclass(  # noqa: N806
        "TrainerConfig", [("checkpoint", BaseCheckpointManager.Config,
                           dataclasses.field(default_factory=CheckpointManager.Config))],
        kw_only=True, slots=True)
    switched = TrainerConfig(checkpoint=ResumekitCheckpointer.Config(enable=True, interval=5))
    parsed = tyro.cli(TrainerConfig, default=switched, registry=custom_registry, args=[
        "--checkpoint.interval", "3", "--checkpoint.local_folder", "/tmp/local",
        "--checkpoint.local_interval", "1"])
    assert isinstance(parsed.checkpoint, ResumekitCheckpointer.Config)
    assert (parsed.checkpoint.enable, parsed.checkpoint.interval,
            parsed.checkpoint.local_folder, parsed.checkpoint.local_interval) == (
        True, 3, "/tmp/local", 1)


def test_a_local_folder_without_its_interval_is_refused_by_name() -> None:
    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    with pytest.raises(ConfigurationError) as caught:
        ResumekitCheckpointer.Config(local_folder="/tmp/local")
    assert caught.value.name == "checkpoint.local_interval"  # type: ignore[attr-defined]


def test_local_folder_commits_each_ranks_copy_to_the_local_tier(tmp_path: Path) -> None:
    run = Run(tmp_path / "dump", interval=4, local_folder=str(tmp_path / "local"),
              local_interval=1)
    run.train(2)
    run.checkpointer.close()
    assert [step for step, _ in _committed(tmp_path / "local" / "rank_00000")] == [1, 2]
    assert _committed(tmp_path / "dump" / "checkpoint") == []


def test_async_mode_with_pinned_memory_commits_through_the_writer_process(
        tmp_path: Path) -> None:
    run = Run(tmp_path, async_mode="async_with_pinned_mem")
    assert run.checkpointer.manager.async_writer == "process"
    run.train(4)
    run.checkpointer.close()
    assert _committed(tmp_path / "checkpoint") == [(2, "interval"), (4, "interval")]


def test_an_unknown_async_mode_is_refused_by_name() -> None:
    from resumekit.integrations.torchtitan import ResumekitCheckpointer

    with pytest.raises(ConfigurationError) as caught:
        ResumekitCheckpointer.Config(async_mode="threads")  # type: ignore[arg-type]
    assert caught.value.name == "checkpoint.async_mode"  # type: ignore[attr-defined]
