"""Every error resumekit raises, under one base class.

Each subclass also derives from the built-in exception a caller would naturally catch
(``CheckpointNotFoundError`` is a ``FileNotFoundError``), carries the data of the failure
as attributes (path, step, file, key) and pickles, because errors cross process
boundaries: background save threads, worker processes and test harnesses re-raise them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AsyncSaveError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DistributedSetupError",
    "FencedWriterError",
    "ForeignCheckpointError",
    "IncompatibleCheckpointError",
    "IncompatibleVersionError",
    "IncompleteCheckpointError",
    "ManifestError",
    "MissingDependencyError",
    "PreemptionError",
    "ResumeStepError",
    "ResumekitError",
    "StepCollisionError",
    "StorageError",
    "UnreadableFormatError",
    "UnsafeCheckpointError",
    "UnsupportedSchemaError",
    "WriterProcessError",
]


def _rebuild(cls: type[ResumekitError], message: str, fields: dict[str, Any]) -> ResumekitError:
    error = cls.__new__(cls)
    ResumekitError.__init__(error, message, **fields)
    return error


class ResumekitError(Exception):
    """Base class of every resumekit error.

    Args:
        message: One line that names the file, step or key at fault.
        **fields: Data of the failure, exposed as attributes (``error.path``, ``error.step``).
    """

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = dict(fields)
        for name, value in fields.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.fields))

    def __str__(self) -> str:
        return self.message


class CheckpointNotFoundError(ResumekitError, FileNotFoundError):
    """No checkpoint where one was asked for (``path``, optionally ``step``)."""


class StepCollisionError(ResumekitError, FileExistsError):
    """A save asked for a step that is not newer than the newest committed one.

    Attributes ``step`` (asked for) and ``newest`` (newest committed step).
    """


class IncompleteCheckpointError(ResumekitError, FileNotFoundError):
    """A file the manifest lists is missing or shorter than recorded (``path``, ``file``)."""


class CorruptCheckpointError(ResumekitError, ValueError):
    """A file's bytes do not match its recorded checksum (``path``, ``file``)."""


class UnreadableFormatError(CorruptCheckpointError):
    """A checkpoint file whose bytes this reader cannot interpret (``path``, ``file``).

    Not a checksum or size failure: a pickle whose objects do not build here (a field,
    class or constructor signature this torch does not have), a storage descriptor or
    checksum file of a format this resumekit does not know, DCP's own reading failing on
    what it was given (when nothing checked its bytes first: after restore checked them
    against their checksums, that is a :class:`CheckpointLoadError`). It can be damage,
    or a format written by another torch or resumekit version: restore refuses it as an
    :class:`IncompatibleVersionError` when the writer's versions differ from this
    process's, and sets nothing aside.
    """


class CheckpointLoadError(ResumekitError, RuntimeError):
    """A checkpoint whose bytes match their checksums failed to load: not damage.

    Raised by restore (and by :func:`resumekit.tensors.load` with ``verified=True``) when
    loading a checkpoint whose every file was first checked against the checksums
    recorded when it was written (``verify_on_restore``, the default) raises an
    exception of its own: an ``AttributeError``, ``TypeError`` or ``KeyError`` from a bug
    in resumekit's planner or reader, or in code of the run that the load calls (its
    scheduler's ``load_state_dict``). The bytes are the ones that were written, so the
    checkpoint is not taken for damaged: it is not set aside, and restore does not fall
    back to an older step past it (that would hide a good step because of a bug). Where
    the checkpoint records other torch or resumekit versions than this process's, restore
    raises :class:`IncompatibleVersionError` instead (nothing set aside either). Without
    ``verify_on_restore`` nothing says the bytes are intact, and the same failure is an
    :class:`UnreadableFormatError` (set aside and fallen back from), as before.

    Attributes ``path`` (the checkpoint: its step directory once restore names it, else
    its tensors directory), ``step`` (None outside a restore), ``rank`` (the rank whose
    load failed, when known), ``file`` (the file whose loading failed, when one is
    known: ``train_state.pt`` when the run's scheduler failed on it) and ``cause`` (what
    raised: ``"AttributeError: ..."``, ``"StepLR.load_state_dict raised KeyError: ..."``;
    the exception itself is the ``__cause__`` chain's end on the rank that raised it).
    """


class ManifestError(CorruptCheckpointError):
    """``manifest.json`` is missing, unreadable or invalid (``path``)."""


class UnsupportedSchemaError(ManifestError):
    """A manifest written by a newer resumekit (``path``, ``schema_version``)."""


class UnsafeCheckpointError(ResumekitError, ValueError):
    """Checkpoint content that would escape its directory or execute code (``path``)."""


class StorageError(ResumekitError, OSError):
    """The storage backend refused an operation (``path``, ``operation``)."""


class ForeignCheckpointError(ResumekitError, FileExistsError):
    """A root holds another tool's checkpoint and no resumekit one (``path``, ``format``).

    Raised by ``CheckpointManager.restore()`` instead of starting from step 0; attributes
    ``path`` (the foreign checkpoint), ``format`` (``dcp``, ``torchtitan``, ...), ``step``
    (what it records, or None) and ``command`` (the ``resumekit import`` command line that
    converts it).
    """


class IncompatibleCheckpointError(ResumekitError, ValueError):
    """The checkpoint does not fit the run restoring it (``path``, ``differences``)."""


class IncompatibleVersionError(IncompatibleCheckpointError):
    """A checkpoint that another torch (or resumekit) version wrote and this one cannot read.

    Raised by restore instead of setting the checkpoint aside as corrupt: it is kept as it
    is, and restore stops (it does not fall back past it, nor start from step 0).
    Attributes ``path`` and ``step`` (the checkpoint), ``written_by`` (the writer's
    recorded ``{"torch": ..., "resumekit": ...}``; empty when its manifest records none),
    ``running`` (this process's) and ``differences`` (one line per library that differs).
    """


class AsyncSaveError(ResumekitError, RuntimeError):
    """A background save failed; raised on the next call into the manager (``step``)."""


class WriterProcessError(ResumekitError, RuntimeError):
    """The background writer process (``async_writer="process"``) failed or died.

    Attributes ``pid``; for an error raised there, ``remote_type`` (its class name) and
    ``remote_traceback`` (its traceback, as text); for a process that died,
    ``exit_code`` (negative: the signal) and ``signal`` (its name, or None).
    """


class DistributedSetupError(ResumekitError, RuntimeError):
    """The launch environment is missing or inconsistent (``variable``)."""


class ConfigurationError(ResumekitError, ValueError):
    """An argument or setting that cannot work: out of range, or contradicting another.

    Attributes ``name`` (the argument or setting) and ``value`` (what was given).
    """


class MissingDependencyError(ConfigurationError, ImportError):
    """A feature needs a package that is not installed, or that fails to import.

    The message is one line naming the feature, the package and the extra that installs it
    (``pip install 'resumekit[s3]'``). Attributes ``name`` (the missing module, as for any
    ``ImportError``), ``extra`` and ``feature``; ``value`` where a URL or path asked for it.
    A :class:`ConfigurationError` too: what the run asked for cannot work here as installed.
    """


class ResumeStepError(ConfigurationError):
    """The loop ignored the step :meth:`~resumekit.CheckpointManager.restore` returned.

    Raised by the first ``step_end(step)`` after a restore of step ``restored`` when
    ``step <= restored`` (attributes ``step``, ``restored``, ``path``): the loop counts from
    0 (or an older step) instead of from the step returned, so it would retrain steps.
    """


class CoordinationError(ResumekitError, RuntimeError):
    """Ranks failed to meet or agree at a coordination point (``reason``, ``rank``)."""


class PreemptionError(ResumekitError, RuntimeError):
    """Preemption handling could not be set up or carried out.

    A handler installed off the main thread or twice, ranks voting at different steps, or
    a failed ``scontrol requeue`` (attributes such as ``thread``, ``step``, ``command``,
    ``returncode``).
    """


class FencedWriterError(ResumekitError, PermissionError):
    """A writer of an older generation tried to commit into a root a newer one claimed.

    A zombie job (an old SLURM restart still alive after the requeue) is refused before
    it touches anything of the newer run. Attributes ``path`` (the root), ``step`` (the
    step it tried to save, when saving), ``generation`` (the fenced writer, described)
    and ``newer`` (the generation that fenced it, described).
    """
