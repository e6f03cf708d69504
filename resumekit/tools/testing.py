"""A resume-equivalence harness to point at your own training loop.

Trust in a checkpointing library comes from one experiment: train N steps without
interruption; train again, interrupted and resumed; compare. This module runs that
experiment for any loop that follows a three-line contract::

    def train(root: str, num_steps: int, probe: resumekit.testing.Probe) -> dict:
        ...build model, optimizer, CheckpointManager(root, ...)...
        for step in range(ckpt.restore(), num_steps):
            loss = one_optimizer_step()
            ckpt.step_end(step + 1)
            probe.after_step(step + 1, loss, ckpt)      # may stop or "crash" the run here
        ckpt.close()
        return {"model": model, "optimizer": optimizer}

    report = resumekit.testing.check_resume_equivalence(
        train, num_steps=20, interruptions=[stop_after(7), crash_after(13)], workdir=tmp)
    assert report.equivalent, report.describe()

Interruptions:

* :func:`stop_after` (k): a clean stop — the probe saves step k, closes the manager and
  leaves the loop, as a graceful preemption would;
* :func:`crash_after` (k): a crash — the probe leaves the loop after step k without saving
  anything more (pending background saves are finished first, so "the process was killed
  after the last committed save" is deterministic). The resumed run replays the steps
  since the last checkpoint; their losses must match the first time too.

The comparison is bitwise by default (``atol=0``): per-step losses, then every tensor of
the returned objects' state (model parameters and optimizer state, sharded or not), and
the report names the first step and the first key that differ.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from resumekit import tensors
from resumekit.tensors import state_dicts

__all__ = [
    "EquivalenceReport",
    "Interruption",
    "Probe",
    "check_resume_equivalence",
    "crash_after",
    "flat_state",
    "stop_after",
]


@dataclass(frozen=True)
class Interruption:
    """Where and how a run is interrupted.

    Attributes:
        step: The optimizer step after which it happens.
        kind: ``"stop"`` (clean: saved first) or ``"crash"`` (nothing more saved).
    """

    step: int
    kind: str


def stop_after(step: int) -> Interruption:
    """A clean stop after ``step``: save, close, leave (a graceful preemption)."""
    return Interruption(step, "stop")


def crash_after(step: int) -> Interruption:
    """A crash after ``step``: leave without saving (a SIGKILL after the last save)."""
    return Interruption(step, "crash")


class _Interrupted(BaseException):
    """Leaves the user's loop; a BaseException so ``except Exception`` cannot eat it."""


class Probe:
    """Records losses and interrupts the run where the experiment says."""

    def __init__(self, interruption: Interruption | None = None) -> None:
        self.losses: dict[int, float] = {}
        self.replayed: dict[int, float] = {}
        self._interruption = interruption

    def after_step(self, step: int, loss: float | torch.Tensor, manager: Any) -> None:
        """Call after each optimizer step (after ``manager.step_end(step)``).

        Args:
            step: Optimizer steps completed.
            loss: That step's loss.
            manager: The run's ``CheckpointManager``.
        """
        value = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)
        if step in self.losses:
            self.replayed[step] = value
        else:
            self.losses[step] = value
        interruption = self._interruption
        if interruption is None or step != interruption.step:
            return
        self._interruption = None
        if interruption.kind == "stop":
            if manager.last_saved_step != step:
                manager.save(step, reason="manual", blocking=True)
            manager.close()
        else:
            manager.wait()
        raise _Interrupted


def flat_state(objects: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten the state of models/optimizers/stateful objects into ``{key: value}``.

    Models and optimizers go through the same sharded state-dict path as a checkpoint
    (so FSDP2 shards compare shard by shard on each rank).
    """
    flat: dict[str, Any] = {}
    model = objects.get("model")
    optimizer = objects.get("optimizer")
    if isinstance(model, torch.nn.Module):
        flat.update(tensors.flatten_state(state_dicts.model_and_optimizer_state(model, optimizer)))
    for name, value in objects.items():
        if name in ("model", "optimizer") and isinstance(model, torch.nn.Module):
            continue
        state = value.state_dict() if hasattr(value, "state_dict") else value
        flat.update(tensors.flatten_state(state, name))
    return flat


def _local(value: Any) -> Any:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


@dataclass
class EquivalenceReport:
    """The outcome of :func:`check_resume_equivalence`.

    Attributes:
        equivalent: True when losses and final state match within ``atol``.
        first_step: First step whose loss differs (None if none).
        first_key: First state key that differs (None if none).
        max_abs_diff: Largest absolute difference over losses and state tensors.
        restarts: How many times the interrupted run was started.
        replayed_steps: Steps the interrupted run computed twice (after a crash).
        reference_losses: Losses of the uninterrupted run, by step.
        resumed_losses: Losses of the interrupted run, by step (first computation).
        details: Human-readable lines describing each difference found.
    """

    equivalent: bool
    first_step: int | None = None
    first_key: str | None = None
    max_abs_diff: float = 0.0
    restarts: int = 0
    replayed_steps: list[int] = field(default_factory=list)
    reference_losses: dict[int, float] = field(default_factory=dict)
    resumed_losses: dict[int, float] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One paragraph saying whether and where the runs diverge."""
        if self.equivalent:
            return (f"equivalent: {len(self.reference_losses)} steps, {self.restarts} "
                    f"restarts, max abs diff {self.max_abs_diff:g}")
        return "NOT equivalent: " + "; ".join(self.details[:5])


def check_resume_equivalence(
    train: Callable[[str, int, Probe], Mapping[str, Any]],
    *,
    num_steps: int,
    interruptions: Sequence[Interruption],
    workdir: str | os.PathLike[str],
    atol: float = 0.0,
) -> EquivalenceReport:
    """Run ``train`` uninterrupted and interrupted; compare losses and final state.

    Args:
        train: The user's loop (see the module docstring for its contract).
        num_steps: Optimizer steps of a full run.
        interruptions: Where to interrupt the second run (sorted by step).
        workdir: An empty directory; two checkpoint roots are created inside.
        atol: Allowed absolute difference (0: bitwise).

    Returns:
        The report; ``report.equivalent`` says whether they match.
    """
    workdir = os.fspath(workdir)
    reference_probe = Probe()
    reference = flat_state(train(os.path.join(workdir, "uninterrupted"), num_steps,
                                 reference_probe))
    resumed_probe = Probe()
    root = os.path.join(workdir, "interrupted")
    restarts = 0
    final: Mapping[str, Any] | None = None
    pending = sorted(interruptions, key=lambda item: item.step)
    while final is None:
        resumed_probe._interruption = pending.pop(0) if pending else None
        try:
            final = train(root, num_steps, resumed_probe)
        except _Interrupted:
            restarts += 1
    report = EquivalenceReport(
        equivalent=True, restarts=restarts,
        replayed_steps=sorted(resumed_probe.replayed),
        reference_losses=dict(reference_probe.losses),
        resumed_losses=dict(resumed_probe.losses),
    )
    _compare_losses(report, reference_probe.losses, resumed_probe, atol)
    _compare_state(report, reference, flat_state(final), atol)
    return report


def _differs(a: float, b: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return not (math.isnan(a) and math.isnan(b))
    return abs(a - b) > atol if atol else a != b


def _note(report: EquivalenceReport, line: str, *, step: int | None = None,
          key: str | None = None) -> None:
    report.equivalent = False
    report.details.append(line)
    if step is not None and report.first_step is None:
        report.first_step = step
    if key is not None and report.first_key is None:
        report.first_key = key


def _compare_losses(report: EquivalenceReport, reference: Mapping[int, float],
                    resumed: Probe, atol: float) -> None:
    for step in sorted(set(reference) | set(resumed.losses)):
        if step not in reference or step not in resumed.losses:
            _note(report, f"step {step}: present in only one run", step=step)
            continue
        for label, value in (("", resumed.losses[step]),
                             (" (replayed)", resumed.replayed.get(step))):
            if value is None:
                continue
            diff = abs(reference[step] - value)
            report.max_abs_diff = max(report.max_abs_diff, diff)
            if _differs(reference[step], value, atol):
                _note(report, f"step {step}{label}: loss {value!r} vs uninterrupted "
                      f"{reference[step]!r}", step=step)


def _compare_state(report: EquivalenceReport, reference: Mapping[str, Any],
                   resumed: Mapping[str, Any], atol: float) -> None:
    for key in sorted(set(reference) | set(resumed)):
        if key not in reference or key not in resumed:
            _note(report, f"{key}: present in only one run's final state", key=key)
            continue
        a, b = _local(reference[key]), _local(resumed[key])
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                _note(report, f"{key}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/"
                      f"{b.dtype}", key=key)
                continue
            if a.numel() == 0:
                continue
            diff = float((a.double() - b.double()).abs().max())
            report.max_abs_diff = max(report.max_abs_diff, diff)
            if (diff > atol) if atol else not torch.equal(a, b):
                _note(report, f"{key}: max abs diff {diff:g}", key=key)
        elif a != b:
            _note(report, f"{key}: {a!r} vs {b!r}", key=key)
