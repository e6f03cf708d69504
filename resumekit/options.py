"""``CheckpointOptions``: the manager's policy knobs, validated in one place.

:class:`~resumekit.CheckpointManager` takes the objects it saves (model, optimizer, data,
...) as keyword arguments and everything that says *how* it saves and restores as one
:class:`CheckpointOptions` (``options=``), or as the same names given as keywords. Each
knob is validated when the options are built, and a knob that cannot work is a
:class:`~resumekit.errors.ConfigurationError` naming it. Imports no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from fsspec.core import split_protocol
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from resumekit.errors import ConfigurationError, ResumekitError
from resumekit.store.layout import DEFAULT_NAME_FORMAT, NameFormat
from resumekit.store.retention import RetentionPolicy, keep_last

__all__ = ["AsyncWriter", "CheckpointOptions", "ForeignPolicy", "LocalTier", "MismatchPolicy",
           "OptionKeywords"]

MismatchPolicy = Literal["error", "warn", "ignore"]
ForeignPolicy = Literal["error", "ignore"]
AsyncWriter = Literal["thread", "process"]

#: Retention when none is given: the three newest committed checkpoints.
DEFAULT_RETENTION = keep_last(3)


class LocalTier(BaseModel):
    """A node-local checkpoint tier: frequent saves to a directory of each node.

    Every ``save_every`` steps each rank commits its own part of the state (its shards,
    the training state, its RNG and data position) under ``<root>/rank_XXXXX/`` through
    the same commit protocol, manifest and checksums as the durable root: each such
    directory is a resumekit root of its own. With ``replicas`` each rank's copy is also
    sent to a partner rank on another node, which keeps it under
    ``<root>/replica_of_rank_XXXXX/``. :meth:`~resumekit.CheckpointManager.restore`
    resumes from the newest step every rank can get (its own copy or a partner's
    replica) when it is at least as new as the durable root's newest, else from the
    durable root. Durable saves keep their own ``save_every``, preemption saves and
    :meth:`~resumekit.CheckpointManager.finish`. See ``docs/local-tier.md``.

    Frozen and validated when built: a value that cannot work raises
    :class:`~resumekit.errors.ConfigurationError` naming the knob (``local.save_every``).

    Attributes:
        root: The node-local directory, the same path on every node (``$SLURM_TMPDIR/ckpt``,
            ``/dev/shm/run``, a local NVMe): a local filesystem path, one per run.
        save_every: Save to the local tier every this many steps; ``"auto"``: the
            Young/Daly interval from the measured local save (as the durable
            ``save_every="auto"``, with the same interruptions figure).
        keep: Committed local steps kept per sub-root (own copies and each replica root).
        replicas: Send each rank's copy to a partner rank on another node.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str
    save_every: int | Literal["auto"]
    keep: int = Field(default=2, ge=1)
    replicas: bool = True

    if not TYPE_CHECKING:
        def __init__(self, root: Any = None, save_every: Any = None, **options: Any) -> None:
            if root is not None:
                options["root"] = root
            if save_every is not None:
                options["save_every"] = save_every
            try:
                super().__init__(**options)
            except ValidationError as error:
                raise _refusal(error, prefix="local.") from None
    else:
        def __init__(self, root: str | os.PathLike[str], save_every: int | Literal["auto"],
                     keep: int = 2, replicas: bool = True) -> None: ...

    @field_validator("root", mode="before")
    @classmethod
    def _a_local_directory(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value:
            raise ValueError("a local directory path (str or os.PathLike)")
        protocol, _ = split_protocol(value)
        if protocol not in (None, "file", "local"):
            raise ValueError(f"a node-local filesystem path, not a {protocol}:// URL "
                             "(the durable root is where URLs go)")
        return value

    @field_validator("save_every", "keep", mode="before")
    @classmethod
    def _a_count_not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):
            raise ValueError("a number, not a bool")
        if info.field_name == "save_every":
            if isinstance(value, int) and value < 1:
                raise ValueError("input should be greater than or equal to 1")
            if isinstance(value, str) and value != "auto":
                raise ValueError("a number of steps or 'auto'")
        return value


class CheckpointOptions(BaseModel):
    """How a :class:`~resumekit.CheckpointManager` saves and restores: its policy knobs.

    Frozen and validated when built: a knob that cannot work raises
    :class:`~resumekit.errors.ConfigurationError` whose ``name`` is the knob (and
    ``value`` what was given). Give it to the manager as ``options=``; each field is also
    accepted as a keyword of the manager (``CheckpointManager(root, save_every=100)``),
    which fills a field the options left unset. A knob both set here and given as a
    keyword is refused.

    A new knob is a field of this class (and a key of :class:`OptionKeywords`, which
    ``tests/unit/test_options.py`` keeps in step), never a new parameter of the manager's
    ``__init__``.

    Attributes:
        save_every: Save every this many steps in
            :meth:`~resumekit.CheckpointManager.step_end` (None: only explicit saves and
            preemption saves). ``"auto"``: the Young/Daly interval from the measured step
            time, the time a save holds training and its write time, and how often this
            run loses work to an interruption (:mod:`resumekit.runtime.save_interval`),
            chosen again after each interval save and logged when it changes.
        interruptions_every: With ``save_every="auto"``: seconds between interruptions
            that cost the work since the last save, overriding the root's history and the
            prior (:data:`~resumekit.runtime.save_interval.INTERRUPTIONS_EVERY_PRIOR`).
        retention: Which committed checkpoints to keep after each save (default
            ``keep_last(3)``; None keeps all).
        name_format: Step directory names; ``"checkpoint_step_{step}"`` for LingBot-VA.
        async_save: Stage state to CPU memory and write in the background. Off by
            default: a blocking ``save(step)`` that returns has committed ``step``; with
            this on, ``save`` returns once the state is copied (one host copy of the
            state per rank, held) and the step is committed later (``wait()``);
            docs/performance.md weighs the two on the incident's week.
        async_writer: Where a background save's tensor bytes are hashed and written:
            ``"thread"`` (default), by writer threads of the training process, or
            ``"process"``, by a long-lived writer process per manager and rank, which
            reads the staged state from shared memory (no second copy) and so never
            holds the training process's GIL. Planning, the small files and the commit
            stay on the save thread either way; blocking saves are always written
            in-process. ``"process"`` needs ``async_save`` (a
            :class:`~resumekit.errors.ConfigurationError` without it) and Linux. When it
            pays: ``docs/performance.md``.
        background_priority: CPU priority of an async save's writer threads: ``"idle"``
            (default; ``SCHED_IDLE`` on Linux, else nice 19) leaves the cores to training,
            ``"normal"`` competes with it. Pick ``"normal"`` when other processes keep
            every core busy (CPU-heavy data loading): an idle-priority thread then gets
            little CPU, so the save takes longer, and a step that needs the GIL while such
            a thread holds it waits until the thread runs again.
        on_mismatch: What a configuration mismatch does on restore: ``"error"``
            (default), ``"warn"`` or ``"ignore"``. A world-size change is never an error:
            it warns that the run continues correctly but is not a bit-exact replay
            (``"ignore"`` silences that too). Parameter names and shapes must always
            match: a checkpoint never loads partially.
        fallback: If the newest checkpoint fails verification or loading, restore the
            previous one (logged). False raises instead.
        verify_on_restore: Check every byte loaded against its checksum: the small files
            and DCP's ``.metadata`` are hashed before loading (spread over ranks), raw
            tensor files are size-checked first and verified block by block as they are
            read. A mismatch found while loading leaves the model partly overwritten; with
            ``fallback`` the previous checkpoint is then loaded over it.
        storage_options: fsspec options (e.g. ``endpoint_url``).
        import_legacy: When no committed checkpoint exists, start from the newest
            weights-only ``checkpoint_step_N`` directory (weights only, with a warning).
        tensor_format: How model and optimizer tensors are written: ``"raw"``
            (resumekit's raw tensor files, hashed while written and verified block by
            block while read; local roots only) or ``"dcp"`` (DCP's own format, which
            stock DCP tools read unchanged; slower on local disks, see
            ``docs/performance.md``). None (default): ``"raw"`` on local roots, ``"dcp"``
            on object stores; an explicit ``"raw"`` on an object store warns and writes
            ``"dcp"``. Restore reads either, whatever this says.
        read_only: Restore without taking the root over, for eval jobs and tools that read
            a live run's root: no writer-generation claim (a claim would fence the run
            writing there, see ``docs/concepts.md``), no crash recovery or setting aside
            (broken entries are only warned about), and
            :meth:`~resumekit.CheckpointManager.save` raises.
        foreign: What :meth:`~resumekit.CheckpointManager.restore` does when the root
            holds no resumekit checkpoint but another tool's (plain DCP, torchtitan,
            Accelerate, Lightning, HF Trainer), or is one: ``"error"`` (default) raises
            :class:`~resumekit.errors.ForeignCheckpointError` with the ``resumekit
            import`` command that converts it; ``"ignore"`` warns and starts at step 0.
        stage_ahead: With ``async_save``, allocate and touch the CPU staging buffers
            (one copy of the model and optimizer tensors) when the manager is built and
            again at the end of :meth:`~resumekit.CheckpointManager.restore`, so that the
            first async save blocks no longer than a copy, like the later ones. An
            optimizer that has not stepped yet has no state to allocate for: its buffers
            come with the first save. False allocates at the first async save instead
            (the memory is held from then on either way).
        capture_at_signal: With a ``preemption`` handler (the default, True), copy the
            last completed step at the moment a signal arrives and write it while the step
            in progress runs (``resumekit.background.emergency``; docs/preemption.md, "The
            emergency save starts at the signal"). It costs a small serialisation of the
            step's small state at every ``step_end`` and one tiny all-reduce per save and
            at ``close()`` with several ranks. False: the emergency save is only the agreed
            save at the next step boundary. Without a handler it does nothing.
        restore_reads: Who reads tensor bytes that several ranks restore alike
            (replicated parameters: DDP, HSDP's replica groups), in ``restore`` and in
            ``load_weights``: ``"once"`` (default)
            has one of them read each piece and send it to the others over the
            checkpoint group, each rank reading about 1/R of what R replicas share;
            ``"every_rank"`` has every rank read all it needs from the store. A
            corrupt piece fails the restore on every rank either way. See
            ``docs/performance.md`` for when each is faster.
        local: A node-local tier (:class:`LocalTier`): frequent per-rank saves to a
            directory of each node (and partners' replicas), restored from when they are
            at least as new as the durable root's newest. None (default): durable only.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True,
                              validate_default=False)

    save_every: int | Literal["auto"] | None = None
    interruptions_every: float | None = Field(default=None, gt=0)
    retention: RetentionPolicy | None = DEFAULT_RETENTION
    name_format: str = DEFAULT_NAME_FORMAT
    async_save: bool = False
    async_writer: AsyncWriter = "thread"
    background_priority: Literal["idle", "normal"] = "idle"
    on_mismatch: MismatchPolicy = "error"
    fallback: bool = True
    verify_on_restore: bool = True
    storage_options: dict[str, Any] | None = None
    import_legacy: bool = True
    tensor_format: Literal["raw", "dcp"] | None = None
    read_only: bool = False
    foreign: ForeignPolicy = "error"
    stage_ahead: bool = True
    capture_at_signal: bool = True
    restore_reads: Literal["once", "every_rank"] = "once"
    local: LocalTier | None = None

    if not TYPE_CHECKING:  # type checkers read the fields' own signature, pydantic's
        def __init__(self, **options: Any) -> None:
            try:
                super().__init__(**options)
            except ValidationError as error:
                raise _refusal(error) from None

    @field_validator("save_every", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # True would read as every step
            raise ValueError("a number of steps, not a bool")
        if isinstance(value, int) and value < 1:
            raise ValueError("input should be greater than or equal to 1")
        if isinstance(value, str) and value != "auto":
            raise ValueError("a number of steps or 'auto'")
        return value

    @field_validator("name_format")
    @classmethod
    def _parses_back(cls, value: str) -> str:
        NameFormat(value)  # its ConfigurationError names the template's fault
        return value

    @model_validator(mode="after")
    def _writer_needs_async(self) -> CheckpointOptions:
        if self.async_writer == "process" and "async_writer" in self.model_fields_set:
            if not self.async_save:
                raise ConfigurationError(
                    "async_writer='process' writes background saves: it needs "
                    "async_save=True (blocking saves are always written in-process)",
                    name="async_writer", value="process")
            if not sys.platform.startswith("linux"):
                raise ConfigurationError(
                    f"async_writer='process' shares the staged state through Linux's "
                    f"memfd; not available on {sys.platform} (use 'thread')",
                    name="async_writer", value="process")
        return self

    @model_validator(mode="after")
    def _local_needs_a_writer(self) -> CheckpointOptions:
        if self.local is not None and self.read_only:
            raise ConfigurationError(
                "a local tier (local=...) saves: a read_only manager cannot have one",
                name="local", value=self.local)
        return self

    @classmethod
    def resolve(cls, options: CheckpointOptions | None,
                keywords: Mapping[str, Any]) -> CheckpointOptions:
        """The options a manager runs with: ``options`` (or the defaults) and its keywords.

        Args:
            options: What the manager was given as ``options=``.
            keywords: The manager's other keywords: knobs only.

        Raises:
            TypeError: A keyword that is not a knob (as for any unexpected keyword).
            ConfigurationError: ``options`` that are not options, or as :meth:`merged`.
        """
        unknown = sorted(keywords.keys() - cls.model_fields.keys())
        if unknown:
            raise TypeError(f"CheckpointManager() got an unexpected keyword argument "
                            f"{unknown[0]!r}")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise ConfigurationError(f"options must be a CheckpointOptions, not "
                                     f"{type(options).__name__}", name="options", value=options)
        return (options or cls()).merged(keywords)

    def merged(self, keywords: Mapping[str, Any]) -> CheckpointOptions:
        """These options with ``keywords`` filling the fields they left unset.

        Args:
            keywords: Knobs given as keywords of the manager.

        Returns:
            New, validated options (``self`` when ``keywords`` is empty).

        Raises:
            ConfigurationError: A knob is both set in these options and in ``keywords``,
                or a keyword's value cannot work.
        """
        both = sorted(self.model_fields_set & keywords.keys())
        if both:
            raise ConfigurationError(
                f"{', '.join(both)} given twice, in options= and as a keyword: give each "
                "knob once, in one of the two",
                name=both[0], value=keywords[both[0]])
        if not keywords:
            return self
        return CheckpointOptions(
            **{name: getattr(self, name) for name in self.model_fields_set}, **keywords)


class OptionKeywords(TypedDict, total=False):
    """The fields of :class:`CheckpointOptions`, as the manager's keyword arguments."""

    save_every: int | Literal["auto"] | None
    interruptions_every: float | None
    retention: RetentionPolicy | None
    name_format: str
    async_save: bool
    async_writer: AsyncWriter
    background_priority: Literal["idle", "normal"]
    on_mismatch: MismatchPolicy
    fallback: bool
    verify_on_restore: bool
    storage_options: dict[str, Any] | None
    import_legacy: bool
    tensor_format: Literal["raw", "dcp"] | None
    read_only: bool
    foreign: ForeignPolicy
    stage_ahead: bool
    capture_at_signal: bool
    restore_reads: Literal["once", "every_rank"]
    local: LocalTier | None


def _refusal(error: ValidationError, prefix: str = "") -> ResumekitError:
    """The :class:`ConfigurationError` of a failed validation, naming the first knob."""
    problems = error.errors()
    cause = problems[0].get("ctx", {}).get("error")
    if isinstance(cause, ResumekitError):  # already names what is wrong (name_format)
        return cause
    lines = []
    for problem in problems:
        name = prefix + ".".join(str(part) for part in problem["loc"]) or "options"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{name} is not an option of CheckpointOptions")
        else:
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{name}={problem['input']!r}: {message[:1].lower()}{message[1:]}")
    first = problems[0]
    return ConfigurationError("; ".join(lines), name=prefix + str(first["loc"][0])
                              if first["loc"] else prefix.rstrip(".") or "options",
                              value=first["input"])
