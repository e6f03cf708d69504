"""One rank of a 2-process Lightning DDP run (gloo, CPU), launched as torchrun would.

``python lightning_ddp_worker.py ROOT OUT STEPS ACTION`` with RANK / WORLD_SIZE /
LOCAL_RANK / GROUP_RANK / MASTER_ADDR / MASTER_PORT / TORCHELASTIC_RUN_ID set. ACTION is
``none``, ``sigterm:STEP:RANK`` (that rank sends itself SIGTERM after that optimizer step)
or ``sigkill:STEP:RANK``. The run resumes from ROOT (``ckpt_path="last"``); rank 0 writes
the final weights to OUT when the run ends.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from resumekit.integrations.lightning import ResumekitCallback, ResumekitCheckpointIO
from resumekit.runtime.preemption import PreemptionHandler
from tests.lightning_noisy import Noisy


class Signal(Callback):
    def __init__(self, signum: int, step: int, rank: int) -> None:
        self.signum, self.step, self.rank = signum, step, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def main(root: str, out: str, steps: int, action: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # a relaunch seeds the same way: the checkpoint decides
    model = Noisy(64)
    callbacks: list[Callback] = []
    if action != "none":
        kind, step, who = action.split(":")
        callbacks.append(Signal(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL,
                                int(step), int(who)))
    preemption = PreemptionHandler(poll_every=1, overlap=False)  # stop at the signal's step
    callbacks += [ResumekitCallback(data=lambda trainer: model.sampler, preemption=preemption),
                  ModelCheckpoint(dirpath=os.path.join(root, "..", "ckpt"),
                                  every_n_train_steps=4, save_top_k=-1)]
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps,
                        plugins=[ResumekitCheckpointIO(root, retention=None)],
                        callbacks=callbacks, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=os.path.join(root, ".."), num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=os.environ.get("RESUME_FROM", "last"))  # or the root
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
