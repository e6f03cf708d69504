"""``ResumekitCheckpointIO``: a real Lightning Trainer, interrupted and resumed, ends bit for
bit where the same run resumed from Lightning's own ``.ckpt`` ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from resumekit.errors import StepCollisionError
from resumekit.integrations.lightning import ResumekitCheckpointIO
from resumekit.store.catalog import list_checkpoints, verify_checkpoint
from resumekit.store.manifest import SaveReason
from resumekit.store.retention import keep_best, keep_last, prune
from resumekit.store.storage import Storage
from resumekit.tools.importers import import_checkpoint
from resumekit.warnings import ResumekitWarning
from tests.limits import HANG_S


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


class Interrupt(Callback):
    """Stops the run with an exception after ``at`` optimizer steps (a killed job)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("interrupted")


def _data() -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=generator),
                                             torch.randn(32, 1, generator=generator))
    return torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))


def _trainer(tmp: Path, max_steps: int, callbacks: list[Callback],
             plugins: list[Any]) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, default_root_dir=tmp, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", callbacks=callbacks, plugins=plugins,
                     num_sanity_val_steps=0)


def _interrupted_then_resumed(tmp: Path, plugins: list[Any], resume_from: Any) -> Module:
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = Module()
    with pytest.raises(RuntimeError, match="interrupted"):
        _trainer(tmp, 12, [every, Interrupt(6)], plugins).fit(first, _data())
    L.seed_everything(0, verbose=False)
    resumed = Module()
    again = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp, 12, [again], plugins).fit(resumed, _data(), ckpt_path=resume_from(tmp))
    return resumed


def test_an_interrupted_lightning_run_resumed_from_resumekit_equals_lightnings_own_resume(
    tmp_path: Path
) -> None:
    own = _interrupted_then_resumed(tmp_path / "own", [],
                                    lambda tmp: tmp / "ckpt" / "epoch=0-step=4.ckpt")
    root = tmp_path / "root"
    ours = _interrupted_then_resumed(tmp_path / "ours", [ResumekitCheckpointIO(root)],
                                     lambda tmp: root)
    expected = own.state_dict()
    got = ours.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    # Lightning saved through atomic commits: retention kept the newest three.
    entries = [e for e in list_checkpoints(Storage(root)) if e.status == "committed"]
    assert [e.step for e in entries] == [4, 8, 12]
    for entry in entries:
        assert entry.manifest is not None and entry.manifest.reason == SaveReason.INTERVAL
        assert str(entry.manifest.state["lightning_name"]).endswith(f"step={entry.step}.ckpt")
        verify_checkpoint(Storage(root), entry.name)
    assert not (tmp_path / "ours" / "ckpt").exists() or not any(
        (tmp_path / "ours" / "ckpt").glob("*.ckpt"))


def test_lightning_can_name_a_resumekit_checkpoint_by_its_own_file_name(
    tmp_path: Path
) -> None:
    io = ResumekitCheckpointIO(tmp_path / "root", retention=None)
    checkpoint = {"global_step": 3, "epoch": 0, "state_dict": {"w": torch.ones(2)}}
    io.save_checkpoint(checkpoint, tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    io.save_checkpoint({**checkpoint, "global_step": 5}, tmp_path / "ckpt" / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")["global_step"] == 3
    assert io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 5
    assert io.load_checkpoint(tmp_path / "root")["global_step"] == 5
    io.remove_checkpoint(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert [e.step for e in list_checkpoints(Storage(tmp_path / "root"))
            if e.status == "committed"] == [5]


def test_importing_resumekit_and_its_integrations_package_imports_no_framework() -> None:
    code = ("import sys, resumekit, resumekit.integrations; "
            "print(sorted(m for m in ('lightning', 'accelerate', 'transformers') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=HANG_S)
    assert done.stdout.strip() == "[]"


# -- a run that starts over, a fresh root, an imported .ckpt, what the trainer names ----


def _committed(root: Path) -> dict[int, Any]:
    """Committed step -> its manifest."""
    return {e.step: e.manifest for e in list_checkpoints(Storage(root))
            if e.status == "committed"}


@pytest.mark.parametrize(("same_plugin", "ckpt_path"), [(True, None), (False, None),
                                                       (False, "last")],
                         ids=["same-plugin", "new-plugin", "new-plugin-last"])
def test_a_run_that_starts_over_on_a_root_with_checkpoints_is_refused_and_replaces_nothing(
    tmp_path: Path, same_plugin: bool, ckpt_path: str | None
) -> None:
    root = tmp_path / "root"
    first_io = ResumekitCheckpointIO(root)
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    with pytest.raises(RuntimeError, match="interrupted"):
        _trainer(tmp_path, 12, [every, Interrupt(6)], [first_io]).fit(Module(), _data())
    before = (root / "step_000000004" / "manifest.json").read_bytes()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    io = first_io if same_plugin else ResumekitCheckpointIO(root)
    with pytest.raises(StepCollisionError) as refused:
        _trainer(tmp_path, 12, [again], [io]).fit(Module(), _data(), ckpt_path=ckpt_path)
    message = str(refused.value)
    assert f"cannot save step 4 under {root}" in message
    assert "earlier run, the newest step 4" in message
    assert f"ckpt_path={str(root)!r}" in message
    assert (root / "step_000000004" / "manifest.json").read_bytes() == before
    assert list(_committed(root)) == [4]


def test_fit_with_ckpt_path_the_root_starts_fresh_on_an_empty_root_and_says_so(
    tmp_path: Path
) -> None:
    root = tmp_path / "root"
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    with pytest.warns(ResumekitWarning, match=f"no committed checkpoint under {root}: "
                                              "Lightning starts fresh"):
        _trainer(tmp_path, 8, [every], [ResumekitCheckpointIO(root)]).fit(
            Module(), _data(), ckpt_path=root)
    assert list(_committed(root)) == [4, 8]
    # The next job of the same command line resumes from step 8.
    resumed = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4,
                              save_top_k=-1)
    trainer = _trainer(tmp_path, 12, [resumed], [ResumekitCheckpointIO(root)])
    trainer.fit(Module(), _data(), ckpt_path=root)
    assert list(_committed(root)) == [4, 8, 12]
    assert _committed(root)[12].lineage.resumed_from_step == 8


def test_a_lightning_ckpt_imported_by_resumekit_resumes_on_lightning_as_the_ckpt_would(
    tmp_path: Path
) -> None:
    own = _interrupted_then_resumed(tmp_path / "own", [],
                                    lambda tmp: tmp / "ckpt" / "epoch=0-step=4.ckpt")
    root = tmp_path / "root"
    with pytest.warns(ResumekitWarning, match="imported lightning checkpoint"):
        import_checkpoint(tmp_path / "own" / "ckpt" / "epoch=0-step=4.ckpt", root)
    L.seed_everything(0, verbose=False)
    ours = Module()
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path, 12, [again], [ResumekitCheckpointIO(root)]).fit(
        ours, _data(), ckpt_path=root)
    expected = own.state_dict()
    got = ours.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert list(_committed(root)) == [4, 8, 12]


class Scored(Module):
    """Logs ``score``: ``scores[k]`` at the optimizer step that makes ``global_step`` k+1."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        self.log("score", self.scores[self.global_step])
        return super().training_step(batch, index)


def test_retention_never_deletes_the_checkpoint_model_checkpoint_names_as_best(
    tmp_path: Path
) -> None:
    root = tmp_path / "root"
    io = ResumekitCheckpointIO(root)  # keep_last(3)
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="score", mode="min",
                           save_top_k=1, every_n_train_steps=1, save_last=True)
    _trainer(tmp_path, 6, [best], [io]).fit(Scored([0.0, 5, 4, 3, 2, 1]), _data())
    assert best.best_model_path.endswith("step=1.ckpt")
    assert list(_committed(root)) == [1, 4, 5, 6]
    assert io.load_checkpoint(best.best_model_path)["global_step"] == 1
    assert io.load_checkpoint(best.last_model_path)["global_step"] == 6
    # The score ModelCheckpoint gave step 1 survived the save of last.ckpt at step 1.
    assert _committed(root)[1].metrics == {"score": 0.0}


def test_keep_best_ranks_lightning_checkpoints_by_the_score_model_checkpoint_recorded(
    tmp_path: Path
) -> None:
    root = tmp_path / "root"
    scored = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="score", mode="min",
                             save_top_k=-1, every_n_train_steps=1)
    _trainer(tmp_path, 6, [scored], [ResumekitCheckpointIO(root, retention=None)]).fit(
        Scored([9.0, 4, 1, 0, 1, 4]), _data())
    assert {step: m.metrics for step, m in _committed(root).items()} == {
        1: {"score": 9.0}, 2: {"score": 4.0}, 3: {"score": 1.0}, 4: {"score": 0.0},
        5: {"score": 1.0}, 6: {"score": 4.0}}
    report = prune(Storage(root), keep_best(2, metric="score") | keep_last(1))
    assert report.deleted == [1, 2, 3]  # of the equal scores of 3 and 5, 5 is newer
    assert list(_committed(root)) == [4, 5, 6]


def test_a_file_model_checkpoint_removes_is_kept_with_a_warning_while_another_name_holds_it(
    tmp_path: Path
) -> None:
    io = ResumekitCheckpointIO(tmp_path / "root", retention=None)

    def states(best_of_a: int) -> dict[str, Any]:
        return {"A": {"best_k_models": {f"/a/epoch=0-step={best_of_a}.ckpt": 1.0},
                      "best_model_path": f"/a/epoch=0-step={best_of_a}.ckpt"},
                "B": {"best_k_models": {"/b/b-step=3.ckpt": 0.5},
                      "best_model_path": "/b/b-step=3.ckpt"}}

    io.save_checkpoint({"global_step": 3, "callbacks": states(3)}, "/a/epoch=0-step=3.ckpt")
    io.save_checkpoint({"global_step": 5, "callbacks": states(5)}, "/a/epoch=0-step=5.ckpt")
    with pytest.warns(ResumekitWarning, match=r"\(step 3\) as epoch=0-step=3.ckpt; it is kept: "
                                              r"the trainer still names it \(.*b-step=3.ckpt"):
        io.remove_checkpoint("/a/epoch=0-step=3.ckpt")
    assert list(_committed(tmp_path / "root")) == [3, 5]


def test_a_score_that_is_not_a_finite_number_is_left_out_of_the_manifest_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    io = ResumekitCheckpointIO(tmp_path / "root", retention=None)
    state = {"monitor": "val_loss", "best_k_models": {"/a/epoch=0-step=2.ckpt": float("nan")}}
    with caplog.at_level("WARNING", logger="resumekit"):
        io.save_checkpoint({"global_step": 2, "callbacks": {"A": state}},
                           "/a/epoch=0-step=2.ckpt")
    assert "val_loss of step 2 is nan: not recorded in its manifest" in caplog.text
    assert _committed(tmp_path / "root")[2].metrics == {}
