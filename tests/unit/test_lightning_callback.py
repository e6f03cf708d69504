"""``ResumekitCallback``: RNG streams, the data position, the agreed emergency save with
exit 75, and ``ckpt_path="last"``, on a real Lightning Trainer in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from resumekit.errors import CheckpointNotFoundError, ConfigurationError
from resumekit.integrations.lightning import LAST_MARKER, ResumekitCallback, ResumekitCheckpointIO
from resumekit.runtime.preemption import EXIT_CODE_PREEMPTED
from resumekit.store.catalog import list_checkpoints
from resumekit.store.manifest import SaveReason
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning
from tests.lightning_noisy import Noisy


class At(Callback):
    """At ``step`` optimizer steps: raise (a crashed job) or send this process a signal."""

    def __init__(self, step: int, signum: int | None = None) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            if self.signum is None:
                raise RuntimeError("interrupted")
            os.kill(os.getpid(), self.signum)


def _fit(tmp: Path, root: Path | None, steps: int, extra: list[Callback],
         ckpt_path: Any = None, callback: ResumekitCallback | None = None) -> Noisy:
    model = Noisy()
    torch.manual_seed(1234)  # a relaunch seeds the same way; the checkpoint decides
    callbacks: list[Callback] = [*extra]
    plugins: list[Any] = []
    if root is not None:
        callbacks += [callback or ResumekitCallback(data=lambda trainer: model.sampler),
                      ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4,
                                      save_top_k=-1)]
        plugins = [ResumekitCheckpointIO(root, retention=None)]
    L.Trainer(max_steps=steps, default_root_dir=tmp, logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu", callbacks=callbacks,
              plugins=plugins, num_sanity_val_steps=0).fit(model, ckpt_path=ckpt_path)
    return model


def _same_weights(a: Noisy, b: Noisy) -> None:
    for key, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], tensor), key


def _committed(root: Path) -> dict[int, Any]:
    return {e.step: e.manifest for e in list_checkpoints(Storage(root))
            if e.status == "committed"}


@pytest.mark.parametrize("crash_at", [6, 10], ids=["mid-epoch", "after-an-epoch-end"])
def test_a_crashed_lightning_run_resumed_with_the_callback_ends_bit_for_bit_as_uninterrupted(
    tmp_path: Path, crash_at: int
) -> None:
    reference = _fit(tmp_path / "ref", None, 20, [])
    root = tmp_path / "root"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(tmp_path, root, 20, [At(crash_at)])
    # 8 batches an epoch: step 4 is mid-epoch, step 8 the end of epoch 0.
    resumed = _fit(tmp_path, root, 20, [], ckpt_path=root)
    _same_weights(reference, resumed)
    assert list(_committed(root)) == [4, 8, 12, 16, 20]


def test_sigterm_makes_the_emergency_save_and_exits_75_and_the_relaunch_ends_bit_for_bit(
    tmp_path: Path
) -> None:
    reference = _fit(tmp_path / "ref", None, 20, [])
    root = tmp_path / "root"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        _fit(tmp_path, root, 20, [At(6, signal.SIGTERM)])
    assert stopped.value.code == EXIT_CODE_PREEMPTED
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning's and ours both gone
    committed = _committed(root)
    assert list(committed) == [4, 6]
    assert committed[6].reason == SaveReason.PREEMPTION
    resumed = _fit(tmp_path, root, 20, [], ckpt_path="last")
    _same_weights(reference, resumed)
    assert _committed(root)[8].lineage.resumed_from_step == 6


def test_ckpt_path_last_resumes_the_newest_committed_checkpoint_of_the_root(
    tmp_path: Path
) -> None:
    root = tmp_path / "root"
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        _fit(tmp_path, root, 8, [], ckpt_path="last")  # the first job: nothing yet
    assert (tmp_path / "ckpt" / LAST_MARKER).is_file()
    _fit(tmp_path, root, 12, [], ckpt_path="last")
    assert _committed(root)[12].lineage.resumed_from_step == 8


def test_a_last_marker_naming_another_root_is_refused(tmp_path: Path) -> None:
    _fit(tmp_path, tmp_path / "a", 4, [])
    with pytest.raises(CheckpointNotFoundError, match=r"names the checkpoint root .*a', not this"):
        _fit(tmp_path, tmp_path / "b", 8, [], ckpt_path="last")


def test_the_callback_refuses_lightnings_slurm_auto_requeue_and_a_trainer_without_the_plugin(
    tmp_path: Path
) -> None:
    model = Noisy()
    callback = ResumekitCallback(data=lambda trainer: model.sampler)
    trainer = L.Trainer(max_steps=1, logger=False, accelerator="cpu", callbacks=[callback],
                        enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigurationError, match=r"needs Trainer\(plugins=\[ResumekitCheckpointIO"):
        trainer.fit(model)
    trainer = L.Trainer(max_steps=1, logger=False, accelerator="cpu", callbacks=[callback],
                        enable_progress_bar=False, default_root_dir=tmp_path,
                        plugins=[ResumekitCheckpointIO(tmp_path / "root"),
                                 SLURMEnvironment(auto_requeue=True)])
    with pytest.raises(ConfigurationError, match=r"SLURMEnvironment\(auto_requeue=False\)"):
        trainer.fit(model)


@pytest.mark.parametrize("moved", ["lightning_combined_loader", "lightning_data_fetcher"])
def test_a_lightning_whose_fit_loop_lost_a_private_attribute_warns_on_a_mid_epoch_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved: str
) -> None:
    root = tmp_path / "root"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(tmp_path, root, 20, [At(6)])  # committed: step 4, mid-epoch
    # what resumekit._compat answers when a Lightning release renames the attribute
    monkeypatch.setattr(f"resumekit.integrations.lightning.{moved}", lambda fit_loop: None)
    with pytest.warns(ResumekitWarning, match="expects the short epoch it counted"):
        _fit(tmp_path, root, 12, [], ckpt_path=root)
    assert list(_committed(root)) == [4, 8, 12]  # warned, and trained on


def test_a_lightning_whose_cluster_environment_moved_is_warned_about_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("resumekit.integrations.lightning.lightning_cluster_environment",
                        lambda trainer: None)
    with pytest.warns(ResumekitWarning, match=r"SLURMEnvironment\(auto_requeue=False\)"):
        _fit(tmp_path, tmp_path / "root", 4, [])
    assert list(_committed(tmp_path / "root")) == [4]


def test_a_signal_that_arrives_after_the_last_vote_is_warned_about_not_swallowed(
    tmp_path: Path
) -> None:
    model = Noisy()
    late = At(8, signal.SIGTERM)  # after the callback voted at step 8, the last one
    trainer = L.Trainer(max_steps=8, default_root_dir=tmp_path, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", num_sanity_val_steps=0,
                        plugins=[ResumekitCheckpointIO(tmp_path / "root")],
                        callbacks=[ResumekitCallback(data=lambda trainer: model.sampler), late])
    with pytest.warns(ResumekitWarning, match="SIGTERM arrived but training ended at step 8 "
                                              "before the ranks agreed to stop"):
        trainer.fit(model)


def test_with_async_checkpoint_io_a_crashed_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    reference = _fit(tmp_path / "ref", None, 12, [])
    root = tmp_path / "root"

    def fit(extra: list[Callback], ckpt_path: Any) -> Noisy:
        model = Noisy()
        torch.manual_seed(1234)
        L.Trainer(max_steps=12, default_root_dir=tmp_path, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                  num_sanity_val_steps=0,
                  plugins=[AsyncCheckpointIO(ResumekitCheckpointIO(root, retention=None))],
                  callbacks=[*extra, ResumekitCallback(data=lambda trainer: model.sampler),
                             ModelCheckpoint(dirpath=tmp_path / "ckpt",
                                             every_n_train_steps=4, save_top_k=-1)],
                  ).fit(model, ckpt_path=ckpt_path)
        return model

    with pytest.raises(RuntimeError, match="interrupted"):
        fit([At(6)], None)
    assert list(_committed(root)) == [4]
    _same_weights(reference, fit([], "last"))
    assert list(_committed(root)) == [4, 8, 12]


class Weights(Callback):
    """Records the module's weights when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_a_fine_tune_starts_from_init_weights_and_its_relaunch_resumes_its_own_checkpoint(
    tmp_path: Path
) -> None:
    pretrained = _fit(tmp_path / "pre", tmp_path / "pre" / "root", 8, [])

    def tune(root: Path, extra: list[Callback], ckpt_path: Any) -> tuple[Noisy, Weights]:
        seen = Weights()
        model = Noisy()
        callback = ResumekitCallback(data=lambda trainer: model.sampler,
                                     init_weights=tmp_path / "pre" / "root")
        torch.manual_seed(1234)
        L.Trainer(max_steps=12, default_root_dir=tmp_path, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                  num_sanity_val_steps=0,
                  plugins=[ResumekitCheckpointIO(root, retention=None)],
                  callbacks=[*extra, seen, callback,
                             ModelCheckpoint(dirpath=root.with_name(f"{root.name}-ckpt"),
                                             every_n_train_steps=4, save_top_k=-1)],
                  ).fit(model, ckpt_path=ckpt_path)
        return model, seen

    whole, seen = tune(tmp_path / "whole", [], None)
    for key, tensor in pretrained.state_dict().items():
        assert torch.equal(seen.at_start[key], tensor), key
    with pytest.raises(RuntimeError, match="interrupted"):
        tune(tmp_path / "tune", [At(6)], tmp_path / "tune")
    # The relaunch resumes step 4 of its own root: the pretrained weights are not reloaded.
    resumed, _ = tune(tmp_path / "tune", [], tmp_path / "tune")
    _same_weights(whole, resumed)
    assert _committed(tmp_path / "tune")[8].lineage.resumed_from_step == 4


class _SignalsOfWorkers(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each item says whether the process that made it ignores SIGTERM and SIGUSR1."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        ignored = [signal.getsignal(sig) == signal.SIG_IGN
                   for sig in (signal.SIGTERM, signal.SIGUSR1)]
        return torch.tensor([index, os.getpid(), *ignored], dtype=torch.float64)


class _WithWorkers(Noisy):
    """``Noisy`` whose train loader has a worker process; it records what the items say."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(_SignalsOfWorkers(), batch_size=4,
                                           sampler=self.sampler, num_workers=1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        self.seen.append(batch)
        return self.net(batch[:, :1].float().repeat(1, 8)).pow(2).mean()


@pytest.mark.parametrize("preemption", [True, None], ids=["with-preemption", "without"])
def test_the_callback_makes_the_train_loaders_workers_ignore_the_preemption_signals(
    tmp_path: Path, preemption: bool | None
) -> None:
    # Lightning starts the workers of the first epoch before on_train_start: the callback
    # protects the loaders its fit loop makes (a SIGTERM to the job reaches the workers).
    model = _WithWorkers()
    callback = ResumekitCallback(data=lambda trainer: model.sampler, preemption=preemption)
    L.Trainer(max_steps=10, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu", callbacks=[callback],
              plugins=[ResumekitCheckpointIO(tmp_path / "root", retention=None)],
              num_sanity_val_steps=0).fit(model)
    rows = torch.cat(model.seen)
    assert len(model.seen) == 10 and (rows[:, 1] != os.getpid()).all()  # made by workers
    expected = 1.0 if preemption else 0.0
    assert (rows[:, 2:] == expected).all()  # across two epochs (8 batches an epoch)


def test_a_lightning_whose_train_data_source_moved_is_warned_about_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("resumekit.integrations.lightning.lightning_train_source",
                        lambda fit_loop: None)
    with pytest.warns(ResumekitWarning, match="protect_loader_workers"):
        _fit(tmp_path, tmp_path / "root", 4, [])
    assert list(_committed(tmp_path / "root")) == [4]
