"""What a restore does with the root's entries besides loading one.

:class:`EntryKeeper` claims the run's writer generation and drops what fenced writers
committed, reads the step directories below the top for a fallback, judges and sets
aside a committed checkpoint that failed to restore, and reports (or sets aside) the
leftovers. The decisions are :mod:`resumekit.restore.plan`'s; the keeper runs each on the
leader of the manager's main channel and says the outcome, the same on every rank.
Nothing here loads a tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resumekit.errors import FencedWriterError
from resumekit.restore import plan as restore_plan
from resumekit.restore.plan import Survey
from resumekit.runtime.channels import Channel
from resumekit.store import generations
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.coordination import run_on_leader
from resumekit.store.layout import MANIFEST_NAME, NameFormat
from resumekit.store.recovery import set_aside
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

__all__ = ["EntryKeeper"]

logger = logging.getLogger("resumekit")


@dataclass(frozen=True)
class EntryKeeper:
    """The root's entries, as one restore of a manager handles them.

    The manager builds one per call, so that ``read_only`` is the manager's current
    setting. Its warnings point at the manager's caller: each method sits where the
    manager's own method did, one frame below the public call.

    Attributes:
        storage: The root.
        name_format: Its step directory names.
        channel: The manager's main channel (leader, commit protocol).
        read_only: Claim nothing and set nothing aside (only warn).
    """

    storage: Storage
    name_format: NameFormat
    channel: Channel
    read_only: bool

    def claim_generation(self, entries: list[CheckpointEntry],
                         claimed: tuple[str, Any] | None = None) -> list[CheckpointEntry]:
        """Claim this run's writer generation; drop checkpoints fenced writers committed.

        The claim fences every older writer of the root (see ``resumekit.store.commit``). A
        root that does not exist yet is claimed by the first save; one that cannot be
        written (an eval job's) is restored from anyway, with a warning.

        Args:
            entries: The survey's entries.
            claimed: What :meth:`claim_on_leader` returned on the leader, when the
                survey's broadcast carried it (every rank has it); None claims now (one
                more broadcast).
        """
        if claimed is None:
            claimed = run_on_leader(self.channel.coordinator,
                                    lambda: self.claim_on_leader(entries))
        status, value = claimed
        if status == "error":
            if isinstance(value, FencedWriterError) or not isinstance(value, OSError) \
                    or self.read_only:
                raise value
            _warn(f"cannot record this run's writer generation in "
                  f"{self.storage.path()} ({value}); restoring anyway: a save from this "
                  "manager claims it first (and fails the same way while the root "
                  "cannot be written)")
            return entries
        if not self.read_only:
            self.channel.protocol.take_claim(value)
        return self._without_zombies(entries, value[1])

    def claim_on_leader(self, entries: list[CheckpointEntry]) -> tuple[str, Any]:
        """The leader's part of :meth:`claim_generation` (leader only; no collective).

        Returns ``("ok", (generation, {name: reason}))`` (read-only: no generation, the
        fenced writers' commits among ``entries``) or ``("error", error)``, for every
        rank to pass to :meth:`claim_generation`.
        """
        try:
            if self.read_only:
                return "ok", (None, self.channel.protocol.fenced_commits(entries))
            return "ok", self.channel.protocol.claim_on_leader(if_root_exists=True)
        except Exception as error:  # noqa: BLE001 - raised on every rank by claim_generation
            return "error", error

    def survey_below(self, found: Survey) -> list[CheckpointEntry]:
        """The step directories below the top a survey read, for a fallback (all ranks).

        Checkpoints fenced writers committed there are warned about and left out.
        """
        below: list[CheckpointEntry] = run_on_leader(
            self.channel.coordinator,
            lambda: restore_plan.survey_below(self.storage, self.name_format, found))
        zombies = generations.zombie_commits(below, found.reference)
        for name in sorted(zombies):
            _warn(f"not restoring from {self.storage.path(name)}: it was {zombies[name]}")
        return [entry for entry in below if entry.name not in zombies]

    def unusable_committed(self, entry: CheckpointEntry, error: BaseException, *,
                           may_fall_back: bool) -> tuple[str, bool]:
        """Judge a committed checkpoint that failed to restore; set it aside and warn.

        Returns a one-line account, and whether its step is free again (deleted or set
        aside); raises what may not be fallen back from
        (:func:`resumekit.restore.plan.judge_failure`).
        """
        gone = run_on_leader(self.channel.coordinator, lambda: not self.storage.exists(
            f"{entry.name}/{MANIFEST_NAME}"))
        unusable = restore_plan.judge_failure(entry, error, gone=gone,
                                              may_fall_back=may_fall_back)
        aside, why_not = (None, None) if unusable.deleted else self.set_aside(entry)
        _warn(unusable.warning(aside, why_not), stacklevel=6)
        return unusable.account(aside), unusable.deleted or aside is not None

    def report_leftovers(self, entries: list[CheckpointEntry], *, above: int,
                         foreign: bool = True, stacklevel: int = 5) -> None:
        """Say what :func:`resumekit.restore.plan.leftovers` lists; set aside what it says."""
        for leftover in restore_plan.leftovers(entries, self.storage, above=above,
                                               foreign=foreign):
            if leftover.action == "log":
                logger.info("resumekit: %s", leftover.message)
            elif leftover.action == "warn":
                _warn(leftover.message, stacklevel=stacklevel)
            else:
                _warn(leftover.warning(*self.set_aside(leftover.entry)),
                      stacklevel=stacklevel)

    def set_aside(self, entry: CheckpointEntry) -> tuple[str | None, str | None]:
        """Set ``entry`` aside on the leader (:func:`~resumekit.store.recovery.set_aside`).

        Nothing is set aside when the manager is read-only.

        Returns:
            ``(hidden name, None)`` once set aside, else ``(None, why not)``.
        """
        if self.read_only:
            return None, "this manager is read_only: move it out of the root by hand"
        outcome: tuple[str | None, str | None] = run_on_leader(
            self.channel.coordinator, lambda: set_aside(self.storage, self.name_format, entry))
        return outcome

    def _without_zombies(self, entries: list[CheckpointEntry], zombies: Mapping[str, str]
                         ) -> list[CheckpointEntry]:
        for name in sorted(zombies):
            _warn(f"not restoring from {self.storage.path(name)}: it was {zombies[name]}")
        return [entry for entry in entries if entry.name not in zombies]


def _warn(message: str, *, stacklevel: int = 5) -> None:
    warn(message, ResumekitWarning, stacklevel=stacklevel)
