"""Names of step directories: building, parsing and the hidden names of work in progress.

A checkpoint root holds one directory per committed step, named by a :class:`NameFormat`
(default ``step_{step:09d}``; LingBot-VA's tooling expects ``checkpoint_step_{step}``).
Work in progress uses hidden names that never parse as a step:

* ``.<name>.tmp-<token>``: a staging directory being written (POSIX protocol);
* ``.<name>.old-<token>``: a committed directory being replaced or deleted;
* ``.<name>.bad-<token>``: a committed directory that failed verification on restore,
  set aside (never swept) so later saves of that step are possible.

Listing sorts numerically, never lexicographically; names that do not parse are ignored.

What a committed step directory holds (every name is a constant of this module)::

    step_000001000/
      manifest.json              MANIFEST_NAME: the commit marker, written last
      tensors/                   TENSORS_DIR: model + optimizer, a DCP directory
        .metadata                DCP_METADATA_FILE: DCP's index of every tensor
        __0_0.distcp ...         a rank's tensor data (named as DCP names it), one file
                                 per rank, its checksums in a trailer at its end
                                 (up to schema_version 3: __0_0 .. __0_3.distcp and
                                 __0_checksums.json, raw_checksums_file(prefix))
      train_state.pt             TRAIN_STATE_FILE: step, micro_step, scheduler (rank 0)
      rank_state/rank_00000.pt   RANK_STATE_DIR, rank_state_file(rank): RNG, data position

On an object store the data sits one level down, under ``attempt-<token>/``
(ATTEMPT_PREFIX), and ``manifest.json`` names that directory as its ``data_dir``. A
staging directory (or attempt) also holds ``.writer.json`` (WRITER_FILE: host, pid and
token of its writer) until it is published, so a sweep can tell a dead writer's leftovers
from a live one's.

The root also holds ``.resumekit-generations/``: one small record per writer generation
that claimed the root (``000000000007.json``), see :mod:`resumekit.store.generations`.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Literal

from resumekit.errors import ConfigurationError, CorruptCheckpointError

__all__ = [
    "ATTEMPT_PREFIX",
    "DCP_METADATA_FILE",
    "DEFAULT_NAME_FORMAT",
    "GENERATIONS_DIR",
    "LEGACY_NAME_FORMAT",
    "LIGHTNING_CHECKPOINT_FILE",
    "MANIFEST_NAME",
    "MAX_STEP",
    "NEWEST_HINT_FILE",
    "RANK_STATE_DIR",
    "TENSORS_DIR",
    "TRAIN_STATE_FILE",
    "WRITER_FILE",
    "HiddenName",
    "NameFormat",
    "checked_step",
    "generation_record_name",
    "parse_generation_record_name",
    "parse_rank_state_file",
    "rank_state_file",
    "raw_checksums_file",
]

DEFAULT_NAME_FORMAT = "step_{step:09d}"
#: Object stores: each save attempt writes its data under ``<step dir>/attempt-<token>/``.
ATTEMPT_PREFIX = "attempt-"
LEGACY_NAME_FORMAT = "checkpoint_step_{step}"
#: Inside a step's data directory: model + optimizer tensors, a DCP checkpoint directory.
TENSORS_DIR = "tensors"
#: The file DCP writes last in a checkpoint directory, describing every tensor.
DCP_METADATA_FILE = ".metadata"
#: A rank's checksum file among the tensors: the XXH3-128 of each packed region of small
#: tensors that rank wrote (raw tensor format 3), kept out of ``.metadata`` so that its
#: bytes depend only on the state's structure.
RAW_CHECKSUMS_SUFFIX = "checksums.json"
#: Directory (under the root) of the writer generation records, one file per claim.
GENERATIONS_DIR = ".resumekit-generations"
#: Object stores with range listings: the name of the newest committed step directory, a
#: hint written after each commit (never trusted over a manifest; see ``catalog``). It
#: lives with the generation records (resumekit's bookkeeping), not as a root entry.
NEWEST_HINT_FILE = f"{GENERATIONS_DIR}/newest-step.json"
_GENERATION_RECORD = re.compile(r"^(?P<number>\d{12})\.json$")
#: The Lightning checkpoint dict inside a step directory written by
#: ``resumekit.integrations.lightning.ResumekitCheckpointIO``.
LIGHTNING_CHECKPOINT_FILE = "lightning.ckpt"

#: A step directory's commit marker: the manifest, written last (see :mod:`resumekit.store.commit`).
MANIFEST_NAME = "manifest.json"
#: Rank 0's plain state: step, micro_step, scheduler, world size (a ``torch.save`` file).
TRAIN_STATE_FILE = "train_state.pt"
#: Directory of the per-rank state files (RNG streams, data position).
RANK_STATE_DIR = "rank_state"
#: In a staging directory or attempt: its writer's host, pid and token, for the sweep.
WRITER_FILE = ".writer.json"

_RANK_STATE_FILE = re.compile(rf"^{re.escape(RANK_STATE_DIR)}/rank_(?P<rank>\d+)\.pt$")
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|bad)-(?P<token>[A-Za-z0-9_]+)$")


@dataclass(frozen=True)
class HiddenName:
    """A parsed work-in-progress name.

    Attributes:
        name: The step directory name it belongs to.
        kind: ``"tmp"`` for a staging directory, ``"old"`` for one being retired,
            ``"bad"`` for one set aside after failing verification.
        token: The unique token of the writer that made it.
    """

    name: str
    kind: Literal["tmp", "old", "bad"]
    token: str


@dataclass(frozen=True)
class NameFormat:
    """How step numbers become directory names and back.

    Args:
        template: A ``str.format`` template with exactly one ``{step}`` field, which may
            carry a zero-padded integer format spec (``{step:09d}``).

    Raises:
        ConfigurationError: A template without exactly one ``{step}`` field, with a
            non-integer or space-padded spec, a ``/`` or a leading dot, or whose names
            do not parse back to their step.

    Example:
        >>> fmt = NameFormat("checkpoint_step_{step}")
        >>> fmt.build(200)
        'checkpoint_step_200'
        >>> fmt.parse("checkpoint_step_200"), fmt.parse("checkpoint_step_x")
        (200, None)
    """

    template: str = DEFAULT_NAME_FORMAT
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        template = self.template
        try:
            fields = [
                (literal, name, spec)
                for literal, name, spec, _ in string.Formatter().parse(template)
            ]
        except ValueError as error:
            raise _bad_template(template, f"is not a valid format string ({error})") from None
        names = [name for _, name, _ in fields if name is not None]
        if names != ["step"]:
            raise _bad_template(template, "must contain exactly one {step} field")
        if "/" in template or "\\" in template or template.startswith("."):
            raise _bad_template(template, "must be a plain, visible directory name")
        regex = ""
        for literal, name, spec in fields:
            regex += re.escape(literal)
            if name is not None:
                # Zero padding only: space padding ({step:9}) builds names that never
                # parse back, so their checkpoints would be written and never found.
                if spec and not re.fullmatch(r"(0\d+)?d?", spec):
                    raise _bad_template(
                        template, f"{{step:{spec}}} is not a zero-padded integer format"
                    )
                regex += r"(?P<step>\d+)"
        object.__setattr__(self, "_pattern", re.compile(f"^{regex}$"))
        for step in (0, 7, 1000, 10**12):
            if self.parse(self.build(step)) != step:
                raise _bad_template(template, f"builds names that do not parse back ({step})")

    def build(self, step: int) -> str:
        """Return the directory name of ``step``."""
        if step < 0:
            raise ConfigurationError(
                f"step must be >= 0, got {step} (name format {self.template!r})",
                name="step", value=step,
            )
        return self.template.format(step=step)

    def parse(self, name: str) -> int | None:
        """Return the step a directory name stands for, or None if it is not one of ours.

        Only canonical names parse (``build(parse(name)) == name``), so ``step_1`` is not a
        step under ``step_{step:09d}``.
        """
        match = self._pattern.match(name)
        if match is None:
            return None
        step = int(match.group("step"))
        return step if self.build(step) == name else None

    def staging_name(self, step: int, token: str) -> str:
        """Return the hidden staging directory name of ``step`` for writer ``token``."""
        return f".{self.build(step)}.tmp-{token}"

    def retired_name(self, step: int, token: str) -> str:
        """Return the hidden name a committed directory takes while it is replaced/deleted."""
        return f".{self.build(step)}.old-{token}"

    def quarantine_name(self, step: int, token: str) -> str:
        """Return the hidden name a checkpoint takes when set aside as corrupt."""
        return f".{self.build(step)}.bad-{token}"

    def parse_hidden(self, name: str) -> tuple[int, HiddenName] | None:
        """Parse a hidden work-in-progress name into ``(step, HiddenName)``, else None."""
        match = _HIDDEN.match(name)
        if match is None:
            return None
        step = self.parse(match.group("name"))
        if step is None:
            return None
        kind: Literal["tmp", "old", "bad"] = match.group("kind")  # type: ignore[assignment]
        return step, HiddenName(match.group("name"), kind, match.group("token"))


#: The highest step a step number read from a file may name: every :class:`NameFormat` is
#: checked to build names that parse back up to it.
MAX_STEP = 10**12


def checked_step(value: object, *, source: str, key: str) -> int:
    """Return ``value``, a step number read from the file ``source``, if it is one.

    Args:
        value: What the file holds under ``key``.
        source: The file, named in the error.
        key: Where in the file (``global_step``).

    Raises:
        CorruptCheckpointError: Not an integer (a JSON ``true`` is not step 1), negative
            or above :data:`MAX_STEP`; names the file, the key and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else f"{shown[:40]}..."
        raise CorruptCheckpointError(
            f"{source}: {key} {shown} is not a step number (an integer from 0 to "
            f"{MAX_STEP})", path=source, key=key)
    return value


def generation_record_name(number: int) -> str:
    """Return the path, relative to the root, of the record of generation ``number``.

    Example:
        >>> generation_record_name(7)
        '.resumekit-generations/000000000007.json'
    """
    if number < 1:
        raise ConfigurationError(f"a generation number is >= 1, got {number}",
                                 name="generation", value=number)
    return f"{GENERATIONS_DIR}/{number:012d}.json"


def parse_generation_record_name(name: str) -> int | None:
    """Return the generation number of a record's base name, or None if it is not one."""
    match = _GENERATION_RECORD.match(name)
    return int(match.group("number")) if match else None


def rank_state_file(rank: int) -> str:
    """Return the per-rank state file of ``rank``, relative to the step's data directory.

    Example:
        >>> rank_state_file(3)
        'rank_state/rank_00003.pt'
    """
    return f"{RANK_STATE_DIR}/rank_{rank:05d}.pt"


def parse_rank_state_file(path: str) -> int | None:
    """Return the rank of a per-rank state file path, or None if it is not one.

    Example:
        >>> parse_rank_state_file("rank_state/rank_00003.pt"), parse_rank_state_file("x.pt")
        (3, None)
    """
    match = _RANK_STATE_FILE.match(path)
    return int(match.group("rank")) if match else None


def _bad_template(template: str, problem: str) -> ConfigurationError:
    return ConfigurationError(
        f"name format {template!r} {problem}", name="name_format", value=template
    )


def raw_checksums_file(prefix: str) -> str:
    """The checksum file of the rank whose DCP data files start with ``prefix`` (``__0_``)."""
    return f"{prefix}{RAW_CHECKSUMS_SUFFIX}"
