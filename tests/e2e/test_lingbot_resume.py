"""LingBot-VA tiny on real torchrun launches: preempted and crashed runs change nothing.

One uninterrupted 2-rank run is the reference (module fixture). The other tests interrupt
the same command - SIGTERM to the torchrun agent, SIGKILL to the whole process tree -
relaunch it unchanged, and compare per-step metrics and the final checkpoints bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from examples.lingbot.config import get_config
from examples.lingbot.drill import Launch, compare_runs, run_segment
from examples.lingbot.model import LingBotVA
from examples.lingbot.train import (
    CHECKPOINT_DIR,
    EXPORT_CONFIG_FILE,
    EXPORT_WEIGHTS_FILE,
    METRIC_KEYS,
    METRICS_FILE,
    read_metrics,
)
from resumekit import tensors
from resumekit.manager import CheckpointManager
from resumekit.warnings import ResumekitWarning
from tests.limits import HANG_S, TEST_HANG_S

pytestmark = pytest.mark.timeout(TEST_HANG_S)

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 12
SAVE_INTERVAL = 4
TRAIN_ARGS = ("--num-steps", str(NUM_STEPS), "--save-interval", str(SAVE_INTERVAL),
              "--keep-last", "0", "--no-progress")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run of NUM_STEPS steps."""
    root = tmp_path_factory.mktemp("lingbot") / "reference"
    segment = run_segment("A", 1, Launch(root, nproc=2, train_args=TRAIN_ARGS),
                          log_dir=root / "logs", timeout=HANG_S)
    assert segment.returncode == 0
    return root


def _final_tensors(root: Path) -> Path:
    return root / CHECKPOINT_DIR / f"checkpoint_step_{NUM_STEPS}" / "tensors"


def test_a_run_preempted_by_sigterm_then_killed_by_sigkill_is_bit_identical_to_an_uninterrupted_one(
    reference: Path, tmp_path: Path,
) -> None:
    root = tmp_path / "interrupted"
    launch = Launch(root, nproc=2, train_args=TRAIN_ARGS)
    logs = root / "logs"

    # Signalled before the first interval save: the ranks agree on a step and stop there,
    # with a preemption save. Either the agreed step's own save (the step the run stopped
    # at), or - when the emergency capture of the last completed step committed it while
    # the step in progress ran - that capture, and the stopping step's save is skipped as
    # recent enough: the preemption costs at most the step in progress, and says so.
    term = run_segment("B", 1, launch, interruption="sigterm", signal_at=1, log_dir=logs)
    log = Path(term.log).read_text()
    assert term.returncode != 0, log
    assert term.newest_reason == "preemption", log
    assert term.newest_checkpoint is not None and term.last_step < NUM_STEPS
    if term.newest_checkpoint == term.last_step:
        assert f"saved checkpoint_step_{term.last_step}; exiting with status 75" in log
    else:
        assert term.newest_checkpoint == term.last_step - 1, log
        assert f"preempted at step {term.last_step} (" in log
        assert (f"emergency save skipped, newest checkpoint is step {term.newest_checkpoint}; "
                "exiting with status 75") in log

    # Just after the next interval checkpoint: the kill lands between two checkpoints.
    kill_at = (term.last_step // SAVE_INTERVAL + 1) * SAVE_INTERVAL + 1
    crash = run_segment("B", 2, launch, interruption="sigkill", signal_at=kill_at, log_dir=logs)
    assert crash.resumed_from == term.newest_checkpoint
    assert crash.returncode == -9
    assert crash.newest_checkpoint is not None
    assert crash.last_step > crash.newest_checkpoint  # steps past the checkpoint were lost

    finish = run_segment("B", 3, launch, log_dir=logs)
    assert finish.resumed_from == crash.newest_checkpoint
    assert finish.returncode == 0
    lost = crash.last_step - crash.newest_checkpoint
    assert f"{lost} metric record(s) after step {crash.newest_checkpoint} dropped" in \
        Path(finish.log).read_text()

    steps = [record["step"] for record in read_metrics(root / METRICS_FILE)]
    assert steps == list(range(1, NUM_STEPS + 1))  # one consistent history, no duplicates
    comparison = compare_runs(reference, root)
    assert comparison.first_metric_difference is None
    assert comparison.tensors_compared > 0
    assert comparison.different_tensors == []
    assert comparison.max_weight_difference == 0.0
    assert comparison.identical


def test_every_metric_record_carries_full_precision_floats_that_round_trip(
    reference: Path,
) -> None:
    lines = (reference / METRICS_FILE).read_text().splitlines()
    assert len(lines) == NUM_STEPS
    for line in lines:
        record = json.loads(line)
        assert set(METRIC_KEYS) <= set(record)
        assert json.dumps(record) == line
        assert all(isinstance(record[key], float) for key in METRIC_KEYS if key != "step")
    lrs = [json.loads(line)["lr"] for line in lines]
    warmup = get_config("tiny").optim.warmup_steps
    assert lrs[:warmup] == sorted(lrs[:warmup]) and lrs[warmup - 1] == lrs[-1]


def test_a_two_rank_run_resumes_on_one_process_and_exports_the_upstream_bf16_layout(
    reference: Path, tmp_path: Path,
) -> None:
    root = tmp_path / "one-process"
    shutil.copytree(reference, root, ignore=shutil.ignore_patterns("logs"))
    export = tmp_path / "export"
    extended = NUM_STEPS + 2
    completed = subprocess.run(
        [sys.executable, "-m", "examples.lingbot.train", "--config", "tiny", "--save-root",
         str(root), "--num-steps", str(extended), "--save-interval", str(SAVE_INTERVAL),
         "--keep-last", "0", "--no-progress", "--export", str(export)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_S, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert f"resumed at step {NUM_STEPS}" in completed.stderr
    records = read_metrics(root / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, extended + 1))
    assert [r["world_size"] for r in records[NUM_STEPS:]] == [1, 1]

    final = root / CHECKPOINT_DIR / f"checkpoint_step_{extended}" / "tensors"
    fp32 = {name.removeprefix("model."): tensor
            for name, tensor in tensors.iter_full_tensors(final)
            if name.startswith("model.")}
    exported = load_file(str(export / EXPORT_WEIGHTS_FILE))
    model_names = set(LingBotVA(get_config("tiny").model).state_dict())
    assert set(exported) == set(fp32) == model_names
    for name, value in exported.items():
        assert value.dtype == torch.bfloat16, name
        want = fp32[name]
        assert torch.equal(value, want.to(torch.bfloat16)), name
        # bf16 keeps 8 significant bits: relative rounding error at most 2**-8.
        assert torch.all((value.float() - want).abs() <= want.abs() * 2.0**-8), name
    config = json.loads((export / EXPORT_CONFIG_FILE).read_text())
    assert config["dim"] == get_config("tiny").model.dim
    assert config["num_layers"] == get_config("tiny").model.num_layers

    # The export is what resumekit imports as a legacy weights-only checkpoint.
    legacy_root = tmp_path / "legacy"
    shutil.copytree(export, legacy_root / f"checkpoint_step_{extended}")
    model = LingBotVA(get_config("tiny").model)
    manager = CheckpointManager(legacy_root, model=model, name_format="checkpoint_step_{step}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.restore() == extended
    assert any(issubclass(w.category, ResumekitWarning) for w in caught)
    for name, value in model.state_dict().items():
        assert torch.equal(value, exported[name].float()), name
    manager.close()


def test_a_relaunch_of_a_finished_run_trains_no_extra_step_and_exits_0(
    reference: Path, tmp_path: Path,
) -> None:
    root = tmp_path / "finished"
    shutil.copytree(reference, root, ignore=shutil.ignore_patterns("logs"))
    before = (root / METRICS_FILE).read_text()
    final = CheckpointManager(root / CHECKPOINT_DIR,
                              name_format="checkpoint_step_{step}").latest()
    assert final is not None and final.step == NUM_STEPS and final.manifest.reason == "final"
    completed = subprocess.run(
        [sys.executable, "-m", "examples.lingbot.train", "--config", "tiny", "--save-root",
         str(root), *TRAIN_ARGS], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=HANG_S, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert f"run already finished at step {NUM_STEPS}" in completed.stderr
    assert (root / METRICS_FILE).read_text() == before  # not one step trained
    again = CheckpointManager(root / CHECKPOINT_DIR,
                              name_format="checkpoint_step_{step}").latest()
    assert again is not None and again.path == final.path
    assert again.manifest.created_at == final.manifest.created_at  # nothing re-saved
