"""The manifest: what a checkpoint holds, and the marker that it exists at all.

``manifest.json`` is written last, after every data file is durable. A directory without
a valid manifest is not a checkpoint. The models are pydantic v2; the file is plain JSON,
safe to read from an untrusted checkpoint (no pickle).

Checksums are XXH3-128 (the ``xxhash`` package): a non-cryptographic hash that runs at
about memory speed, so verifying a checkpoint costs about as much as reading it
(``docs/performance.md``). It detects torn writes, truncation and bit rot; it is not a
defence against a deliberate forger (nothing stored next to the data could be).
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Literal

import xxhash
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from resumekit._version import __version__
from resumekit.errors import (
    CorruptCheckpointError,
    ManifestError,
    UnsafeCheckpointError,
    UnsupportedSchemaError,
)
from resumekit.store.layout import MANIFEST_NAME
from resumekit.store.storage import parse_json
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "CHECKSUM_ALGORITHM",
    "MANIFEST_NAME",
    "PARTS_ALGORITHM",
    "SCHEMA_HISTORY",
    "SCHEMA_VERSION",
    "Checksum",
    "FileEntry",
    "Lineage",
    "LocalPart",
    "Manifest",
    "SaveInterval",
    "SaveReason",
    "SaveStalls",
    "SaveThroughput",
    "WriterGeneration",
    "checksum_chunks",
    "hex_digest",
    "parse_manifest",
    "parse_parts_checksum",
    "parts_checksum",
    "running_versions",
    "safe_relative_path",
    "throughput_problem",
    "version_skew",
]

SCHEMA_VERSION = 5
"""The format version every checkpoint this release writes records (``schema_version``).

It moves whenever a write uses anything an older release cannot read, so that an older
release refuses the checkpoint by its manifest (``UnsupportedSchemaError``: nothing set
aside, no fallback past it, no fresh start beside it) instead of failing inside its files
and setting it aside as damaged. Every older version is still read. :data:`SCHEMA_HISTORY`
says what each version added; ``tests/unit/test_schema_version.py`` fails when the writer
emits a format the current version does not name.
"""
SCHEMA_HISTORY: Mapping[int, str] = MappingProxyType({
    1: "the manifest and the raw tensor format before issue 29 (e.g. commit b0a6499, a 0.2 "
       "release): items stored alone ('resumekit-raw/1'), packed regions ('resumekit-raw/2', "
       "'resumekit-raw/3' with the checksum files 'resumekit-raw-checksums/1')",
    2: "the members of a packed region after its first carry the descriptor "
       "'resumekit-raw/member' (issue 29), which readers of version 1 cannot parse; "
       "checkpoints written with it before 0.3.0 record schema_version 1",
    3: "items stored alone record the shared descriptor 'resumekit-raw/4;<checksum file>' "
       "(issue 40): their block size and block checksums moved out of .metadata into the "
       "writing rank's checksum file, now 'resumekit-raw-checksums/2' (packed regions and "
       "items stored alone), which readers of version 2 cannot parse",
    4: "one raw data file per rank, written by several threads at set offsets (issue 40): "
       "its checksums in a trailer at its end ('resumekit-raw-trailer/1'; descriptors "
       "'resumekit-raw/5' for items stored alone and 'resumekit-raw/6;<region length>' "
       "for packed regions), no checksum file, and its manifest checksum of parts "
       "('xxh3_128-parts:<length>:<hex>,...'), which readers of version 3 cannot parse",
    5: "the raw format's tensors/.metadata laid out by rank (issue 40, "
       "'resumekit-metadata/1': a frame, a head of the skeleton, the items every rank "
       "needs and a table of each writing rank's part, then the parts), so a restore "
       "reads only the parts it needs; readers of version 4 (and DCP's stock reader) "
       "expect one pickle of the whole metadata",
})
"""What each ``schema_version`` added to what an older one holds."""
CHECKSUM_ALGORITHM = "xxh3_128"
PARTS_ALGORITHM = f"{CHECKSUM_ALGORITHM}-parts"
"""A file checksummed in consecutive parts (``schema_version`` 4): ``"xxh3_128-parts:<length>:
<hex>,<length>:<hex>,..."``, the XXH3-128 of each part in file order, their lengths adding
up to the file's size. Several threads write one file, each its own part, and each hashes
what it writes: no thread waits for another to hash the file in order. A verifier reading
the file from its start checks it as well as a whole-file checksum (:meth:`Checksum.like`)."""


class SaveReason(str, enum.Enum):
    """Why a checkpoint was written."""

    INTERVAL = "interval"
    PREEMPTION = "preemption"
    FINAL = "final"
    MANUAL = "manual"
    IMPORTED = "imported"


def safe_relative_path(path: str) -> str:
    """Return ``path`` if it stays inside its checkpoint directory, else raise.

    Raises:
        UnsafeCheckpointError: For absolute paths, ``..`` components, backslashes, drive
            letters or NUL bytes.
    """
    parts = path.split("/")
    if "\0" in path:
        raise UnsafeCheckpointError(
            f"manifest lists an unsafe path {path!r} (it holds a NUL byte)", path=path)
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or (len(path) > 1 and path[1] == ":")
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UnsafeCheckpointError(
            f"manifest lists an unsafe path {path!r} (absolute or outside its directory)",
            path=path,
        )
    return path


class FileEntry(BaseModel):
    """One data file of a checkpoint.

    Attributes:
        path: Path relative to the checkpoint's data directory, ``/``-separated.
        size: Size in bytes.
        checksum: ``"<algorithm>:<hex digest>"`` of the whole file.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    path: str
    size: int = Field(ge=0)
    checksum: str

    @field_validator("path")
    @classmethod
    def _path_stays_inside(cls, value: str) -> str:
        return safe_relative_path(value)


class Lineage(BaseModel):
    """Which process, job and restart wrote a checkpoint, and where its run came from.

    Attributes:
        hostname: Host of the rank that published the checkpoint.
        pid: Its process id.
        slurm_job_id: ``SLURM_JOB_ID`` when running under SLURM.
        slurm_restart_count: ``SLURM_RESTART_COUNT`` (0 on the first run of a job).
        slurm_nodelist: ``SLURM_JOB_NODELIST`` (compact form, e.g. ``host[1-2]``): the
            nodes of the allocation that wrote it; a requeued job may get other nodes.
        resumed_from_step: Step this run restored from; None for a fresh start.
        launcher: ``torchrun``, ``slurm`` or ``single``, when known.
        imported_from: For a checkpoint converted by ``resumekit import``: the source
            as the user gave it, ``{"path": ..., "format": ...}`` (the path is recorded
            verbatim, never made absolute); None otherwise.
        initialized_from: For a run whose weights came from another run's checkpoint
            (:meth:`~resumekit.CheckpointManager.load_weights`): ``{"path": ..., "step":
            ...}`` of that checkpoint; None otherwise.
        restored_from_tier: For a run with a local tier (``LocalTier``): the tier its
            restore read from: ``"local"`` (every rank's own node-local copy),
            ``"replica"`` (some rank's copy came from its partner's replica) or
            ``"durable"`` (the durable root); None when the run had no local tier or
            started fresh.
        started_at: UTC time this launch's checkpoint manager was created (the launch as
            resumekit sees it: after the process started and built its model, before its
            restore); what ``resumekit inspect`` measures a restart gap to. None in
            manifests written before resumekit recorded it.
    """

    model_config = ConfigDict(extra="ignore")

    hostname: str
    pid: int
    slurm_job_id: str | None = None
    slurm_restart_count: int | None = None
    slurm_nodelist: str | None = None
    resumed_from_step: int | None = None
    launcher: str | None = None
    imported_from: dict[str, str] | None = None
    initialized_from: dict[str, str | int] | None = None
    restored_from_tier: Literal["local", "replica", "durable"] | None = None
    started_at: datetime | None = None

    @classmethod
    def current(cls, *, resumed_from_step: int | None = None, launcher: str | None = None
                ) -> Lineage:
        """Describe this process from its environment."""
        job = os.environ.get("SLURM_JOB_ID")
        restarts = os.environ.get("SLURM_RESTART_COUNT")
        return cls(
            hostname=socket.gethostname(),
            pid=os.getpid(),
            slurm_job_id=job,
            slurm_restart_count=int(restarts) if restarts and restarts.isdigit()
            else (0 if job else None),
            slurm_nodelist=os.environ.get("SLURM_JOB_NODELIST") if job else None,
            resumed_from_step=resumed_from_step,
            launcher=launcher,
        )


class SaveThroughput(BaseModel):
    """How fast a save wrote its state: the write phase's bytes and seconds.

    Recorded in the manifest so that a run requeued onto a fresh process knows how fast
    its root takes a save before it made one (the emergency-save decision of
    :meth:`~resumekit.runtime.preemption.PreemptionHandler.should_skip_emergency_save`).

    Attributes:
        bytes: Bytes of tensor state the save wrote, all ranks together (each tensor
            once, at its global size).
        seconds: Seconds of its write phase: from the creation of its staging area to
            every rank's files written and durable (not the capture, an asynchronous
            save's copy to host memory, or the commit).
        blocking: Whether it was a blocking save (an asynchronous one overlapped
            training, so its rate is a lower bound).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    bytes: int = Field(ge=0)
    seconds: float = Field(gt=0)
    blocking: bool = True

    @field_validator("seconds")
    @classmethod
    def _usable_seconds(cls, value: float) -> float:
        if not math.isfinite(value) or not THROUGHPUT_SECONDS[0] <= value <= \
                THROUGHPUT_SECONDS[1]:
            raise ValueError(f"{value!r} seconds is not between {THROUGHPUT_SECONDS[0]} "
                             f"and {THROUGHPUT_SECONDS[1]:g}")
        return value

    @property
    def bytes_per_second(self) -> float:
        """The measured write throughput."""
        return self.bytes / self.seconds


#: The bounds of a recorded save's write seconds: 1 µs to about 116 days.
THROUGHPUT_SECONDS = (1e-6, 1e7)
#: The most bytes a recorded save may have written (4 EiB), and the highest rate it may
#: have written them at (1 PB/s: more than any storage system's).
THROUGHPUT_MAX_BYTES = 1 << 62
THROUGHPUT_MAX_RATE = 1e15


def throughput_problem(record: Any) -> str | None:
    """Why a ``save_throughput`` read from disk is not a usable rate (None: it is).

    Usable: an object whose ``bytes`` is an integer from 1 to
    :data:`THROUGHPUT_MAX_BYTES`, whose ``seconds`` is a finite number within
    :data:`THROUGHPUT_SECONDS` and whose rate is at most :data:`THROUGHPUT_MAX_RATE`
    (``blocking``, if there, a boolean).
    """
    if not isinstance(record, dict):
        return f"{type(record).__name__}, not an object"
    nbytes, seconds = record.get("bytes"), record.get("seconds")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or \
            not 0 < nbytes <= THROUGHPUT_MAX_BYTES:
        return f"bytes {nbytes!r} is not a whole number from 1 to {THROUGHPUT_MAX_BYTES}"
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or \
            not math.isfinite(seconds) or \
            not THROUGHPUT_SECONDS[0] <= seconds <= THROUGHPUT_SECONDS[1]:
        return (f"seconds {seconds!r} is not a finite number from {THROUGHPUT_SECONDS[0]} "
                f"to {THROUGHPUT_SECONDS[1]:g}")
    if nbytes / seconds > THROUGHPUT_MAX_RATE:
        return (f"{nbytes} bytes in {seconds!r} s is {nbytes / seconds:.3g} bytes/s, above "
                f"{THROUGHPUT_MAX_RATE:g}")
    if not isinstance(record.get("blocking", True), bool):
        return f"blocking {record.get('blocking')!r} is not true or false"
    return None


class SaveInterval(BaseModel):
    """The save interval in force when a checkpoint was written (``resumekit inspect``).

    Attributes:
        steps: Steps between interval saves (None: no interval save, or
            ``save_every="auto"`` before its first choice).
        auto: Whether ``save_every="auto"`` chose it.
        inputs: For ``"auto"``: the rule's inputs in words (step time, blocking and write
            seconds, interruptions and where that figure came from).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    steps: int | None = Field(default=None, ge=1)
    auto: bool = False
    inputs: str = ""


class SaveStalls(BaseModel):
    """The seconds a launch's saves held training, up to and including one checkpoint.

    Counted by the launch's checkpoint manager (one process), from its creation: each
    save from its call to the moment training could go on (a blocking save: the whole
    save, with any wait for the previous one; an asynchronous one: that wait and the
    staging copy; a local tier's save: its staging). The checkpoint's own save counts up
    to its publication. An emergency save at a signal overlaps the step in progress and
    holds nothing. Recorded for ``resumekit inspect``'s goodput; the newest checkpoint a
    launch kept says its total.

    Attributes:
        seconds: Seconds training was held by saves.
        saves: How many saves those seconds count.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    seconds: float = Field(ge=0, allow_inf_nan=False)
    saves: int = Field(default=0, ge=0)


class WriterGeneration(BaseModel):
    """A writer generation: one claim of a checkpoint root by one run.

    Generations of a root are totally ordered by ``number`` (each claim takes the next
    one, see :mod:`resumekit.store.generations`); the newest claim owns the root and every older
    generation is fenced. Two managers of one SLURM allocation (same job id and restart
    count) share a generation.

    Attributes:
        number: Position in the root's order of claims (1, 2, ...).
        token: Unique token of the claim (tells apart claims that raced for a number on
            a store without conditional create).
        slurm_job_id: ``SLURM_JOB_ID`` of the claimer, when under SLURM.
        slurm_restart_count: ``SLURM_RESTART_COUNT`` of the claimer (0 on a first run).
        hostname: Host of the claiming process (rank 0).
        pid: Its process id.
        claimed_at: UTC time of the claim.
        newest_step: Newest step committed by a not-fenced writer when the claim was made
            (None for an empty root): a checkpoint of an older generation with a higher
            step was committed after this claim, by a zombie.
        reads_schema: The newest ``schema_version`` the claimer reads (None: recorded by a
            release before 0.3.0, which reads up to 1). A checkpoint of a newer schema
            was not seen by the claim (it was no checkpoint to it), so ``newest_step``
            says nothing about it.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    number: int = Field(ge=1)
    token: str
    slurm_job_id: str | None = None
    slurm_restart_count: int | None = None
    hostname: str = ""
    pid: int = 0
    claimed_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    newest_step: int | None = None
    reads_schema: int | None = None

    def same_run(self, other: WriterGeneration) -> bool:
        """Whether both describe one run.

        One run is one SLURM allocation (same job and restart count), or outside SLURM
        one process (same host and pid).

        A zombie is always another process than the run that replaced it, so managers a
        process builds one after another on one root (an eval loop, a benchmark) share
        its generation instead of fencing each other.
        """
        if self.slurm_job_id is not None or other.slurm_job_id is not None:
            return (self.slurm_job_id == other.slurm_job_id
                    and self.slurm_restart_count == other.slurm_restart_count)
        return (bool(self.hostname) and self.hostname == other.hostname
                and self.pid == other.pid)

    def describe(self) -> str:
        """One line naming the generation and who claimed it (for errors and warnings)."""
        who = (f"SLURM job {self.slurm_job_id} restart {self.slurm_restart_count}, "
               if self.slurm_job_id is not None else "")
        return (f"generation {self.number} ({who}host {self.hostname or '?'} pid {self.pid}, "
                f"claimed {self.claimed_at.isoformat(timespec='seconds')})")


def running_versions() -> dict[str, str]:
    """This process's resumekit, python and (once imported) torch versions."""
    versions = {"resumekit": __version__, "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    return versions


#: The libraries whose versions decide whether a process can read a checkpoint's files.
_FORMAT_LIBRARIES = ("torch", "resumekit")


def version_skew(written: Mapping[str, str], running: Mapping[str, str] | None = None
                 ) -> list[str]:
    """Each library whose version differs between a checkpoint's writer and this process.

    The one comparison of versions: restore asks it when a checkpoint's files could not
    be interpreted, to tell a format of another torch or resumekit from damage. Releases
    are compared without their local part (``2.13.0+cpu`` and ``2.13.0`` are one
    release); a version the writer did not record counts as a difference (it may have
    been another). Python's version is not compared.

    Args:
        written: The checkpoint's :attr:`Manifest.versions`.
        running: The reader's; :func:`running_versions` by default.

    Returns:
        One line per library that differs, e.g. ``"torch: checkpoint 2.15.0, now
        2.13.0+cpu"``; empty when they agree.
    """
    now = running_versions() if running is None else running
    differences = []
    for library in _FORMAT_LIBRARIES:
        if library not in now:
            continue
        theirs = written.get(library)
        if theirs is None:
            differences.append(f"{library}: not recorded by the checkpoint, now "
                               f"{now[library]}")
        elif theirs.split("+")[0] != now[library].split("+")[0]:
            differences.append(f"{library}: checkpoint {theirs}, now {now[library]}")
    return differences


class LocalPart(BaseModel):
    """What a node-local checkpoint is: one rank's part of a run's state, kept on its node.

    A checkpoint under a local tier's sub-root (``<local_root>/rank_XXXXX/``, or a
    partner's ``replica_of_rank_XXXXX/``) records it; a restore uses it only for the run
    whose durable root and world size it names, and only when ``durable_generation`` is
    still the durable root's newest claim (an older one is a fenced writer's copy).

    Attributes:
        rank: The rank whose part it holds.
        world_size: The world size of the run that wrote it.
        node: Hostname of the node that wrote it.
        durable_root: URL of the durable root of the run that wrote it.
        durable_generation: The writer generation the run held on its durable root when
            it wrote this copy.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    node: str
    durable_root: str
    durable_generation: WriterGeneration | None = None


class Manifest(BaseModel):
    """The JSON document that commits a checkpoint.

    Attributes:
        schema_version: Format version; a newer one than this library knows is refused.
        step: The training step the checkpoint was taken after.
        created_at: UTC time of publication.
        captured_at: UTC time at which the saved state was captured (``save()`` was
            called); with ``async_save`` the commit follows later, while training goes on.
            None in manifests written before resumekit recorded it.
        world_size: Number of ranks that wrote it.
        reason: Why it was written.
        files: Every data file with size and checksum.
        data_dir: Directory of the data files relative to the step directory (``"."``
            except on object stores, where each attempt writes under its own prefix).
        lineage: Which job and restart wrote it.
        generation: The writer generation that committed it (None in manifests written
            before generations existed).
        extras: JSON user data (e.g. a wandb run id).
        metrics: Finite numbers the trainer recorded for this checkpoint at save time,
            by name (e.g. ``{"val_loss": 0.31}``); what
            :func:`~resumekit.store.retention.keep_best` ranks by. Empty in manifests written
            before resumekit recorded them.
        state: What the checkpoint holds (e.g. ``{"model": true, "optimizer": true}``).
        fingerprint: Configuration fingerprint compared on restore.
        versions: Library, torch and python versions of the writer
            (``{"resumekit": ..., "python": ..., "torch": ...}``; torch is absent when
            the writer had not imported it). Empty in a manifest that records none: a
            parsed manifest never takes the reader's versions for the writer's.
        tensor_format: How ``tensors/`` was written: ``"raw"`` (resumekit's raw tensor
            files) or ``"dcp"`` (DCP's own format); ``None`` when the checkpoint has no
            tensors or was written before this field existed. Readers detect the format
            per item, so this is for people and tools, not needed to load.
        save_interval: The save interval in force when it was written (None: not
            recorded, an older resumekit).
        save_throughput: How fast this save wrote (bytes and seconds of its write
            phase); None in manifests written before resumekit recorded it, and for a
            save that wrote no tensors.
        local: For a node-local checkpoint (a local tier's, holding one rank's part):
            which rank, run and node it belongs to (:class:`LocalPart`); None for a
            checkpoint of the whole run.
        save_stalls: The seconds this launch's saves held training up to this checkpoint
            (:class:`SaveStalls`); None in manifests written before resumekit recorded it.
    """

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    step: int = Field(ge=0)
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    captured_at: datetime | None = None
    world_size: int = Field(default=1, ge=1)
    reason: SaveReason = SaveReason.MANUAL
    files: list[FileEntry] = Field(default_factory=list)
    data_dir: str = "."
    lineage: Lineage = Field(default_factory=Lineage.current)
    generation: WriterGeneration | None = None
    extras: dict[str, JsonValue] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    state: dict[str, JsonValue] = Field(default_factory=dict)
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=running_versions)
    tensor_format: Literal["raw", "dcp"] | None = None
    save_throughput: SaveThroughput | None = None
    save_interval: SaveInterval | None = None
    local: LocalPart | None = None
    save_stalls: SaveStalls | None = None

    @field_validator("data_dir")
    @classmethod
    def _data_dir_stays_inside(cls, value: str) -> str:
        return value if value == "." else safe_relative_path(value)

    @field_validator("metrics")
    @classmethod
    def _metrics_are_finite(cls, value: dict[str, float]) -> dict[str, float]:
        """NaN and infinities have no JSON form: refused before anything is written."""
        for name, number in value.items():
            if not math.isfinite(number):
                raise ValueError(f"metric {name!r} is {number}, not a finite number")
        return value

    @field_validator("fingerprint")
    @classmethod
    def _fingerprint_is_json(cls, value: dict[str, Any], info: ValidationInfo
                             ) -> dict[str, Any]:
        """The same check as the other JSON fields, skipped for a document JSON just parsed.

        A fingerprint lists every parameter tensor (tens of thousands in a large model);
        what ``json.loads`` returned is JSON already, so only a manifest built in Python
        (a save) is walked.
        """
        if not (isinstance(info.context, dict) and info.context.get(_FROM_JSON)):
            _JSON_OBJECT.validate_python(value)
        return value

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all data files."""
        return sum(entry.size for entry in self.files)

    def to_json(self) -> bytes:
        """Serialise to the on-disk JSON form."""
        return self.model_dump_json(indent=2).encode("utf-8") + b"\n"

    def data_path(self, relative: str) -> str:
        """Return the path of a data file relative to the step directory."""
        return relative if self.data_dir == "." else f"{self.data_dir}/{relative}"


_FROM_JSON = "resumekit_from_json"
_JSON_OBJECT: TypeAdapter[dict[str, JsonValue]] = TypeAdapter(dict[str, JsonValue])


def parse_manifest(raw: bytes, *, source: str) -> Manifest:
    """Parse and validate manifest bytes read from ``source`` (named in every error).

    Raises:
        UnsupportedSchemaError: Written by a newer resumekit.
        UnsafeCheckpointError: A listed path escapes the checkpoint directory or holds a
            NUL byte, or the document is nested too deep.
        ManifestError: Not JSON, or not a valid manifest.
    """
    try:
        document = parse_json(raw, source=source)
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError as error:
        raise ManifestError(str(error), path=source) from error
    if not isinstance(document, dict):
        raise ManifestError(f"{source}: expected a JSON object", path=source)
    version = document.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"{source}: missing or non-integer schema_version", path=source)
    if version > SCHEMA_VERSION:
        raise UnsupportedSchemaError(
            f"{source}: schema_version {version} is newer than this resumekit understands "
            f"({SCHEMA_VERSION}); upgrade resumekit to read it",
            path=source, schema_version=version,
        )
    # Defaults to the running process's versions in a manifest built here (a save);
    # one read from disk that records none must not claim to be this process's.
    document.setdefault("versions", {})
    _check_step_and_paths(document, source)
    _drop_unusable_throughput(document, source)
    _drop_unusable_advice(document, source, "save_interval", SaveInterval)
    _drop_unusable_advice(document, source, "save_stalls", SaveStalls)
    _drop_unusable_start(document, source)
    try:
        manifest = Manifest.model_validate(document, context={_FROM_JSON: True})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ManifestError(
            f"{source}: invalid field {where!r}: {first['msg']}", path=source, key=where
        ) from None
    return manifest


def _drop_unusable_throughput(document: dict[str, Any], source: str) -> None:
    """Ignore, with a warning naming ``source``, a recorded save rate that is not usable.

    ``save_throughput`` is advice (the emergency-save decision of a requeued process), never
    what makes a checkpoint: a value that is not a finite, positive, bounded rate
    (:func:`throughput_problem`: ``seconds`` of ``1e999`` or ``1e-320``) is dropped here,
    where it is read, and the checkpoint stays what the rest of its manifest says.
    """
    record = document.get("save_throughput")
    if record is None:
        return
    problem = throughput_problem(record)
    if problem is None:
        return
    document["save_throughput"] = None
    warn(f"{source}: ignoring its save_throughput ({problem}): the recorded save rate is "
         "not used (the checkpoint itself is unaffected)", ResumekitWarning, stacklevel=4)


def _drop_unusable_advice(document: dict[str, Any], source: str, key: str,
                          model: type[BaseModel]) -> None:
    """Ignore, with a warning naming ``source``, a recorded ``key`` that does not parse.

    ``save_interval`` (the interval in force) and ``save_stalls`` (what saves held
    training) are for ``resumekit inspect`` only; a value that does not parse never makes
    the checkpoint unreadable: it is dropped here.
    """
    record = document.get(key)
    if record is None:
        return
    try:
        model.model_validate(record)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or key
        document[key] = None
        warn(f"{source}: ignoring its {key} ({where}: {first['msg']}): the "
             "checkpoint itself is unaffected", ResumekitWarning, stacklevel=4)


_MOMENT: TypeAdapter[datetime | None] = TypeAdapter(datetime | None)


def _drop_unusable_start(document: dict[str, Any], source: str) -> None:
    """Ignore, with a warning naming ``source``, a ``lineage.started_at`` that is no time.

    The launch's start only feeds ``resumekit inspect``'s restart gaps: a value that does
    not parse never makes the checkpoint unreadable.
    """
    lineage = document.get("lineage")
    if not isinstance(lineage, dict) or lineage.get("started_at") is None:
        return
    try:
        _MOMENT.validate_python(lineage["started_at"])
    except ValidationError as error:
        document["lineage"] = {**lineage, "started_at": None}
        warn(f"{source}: ignoring its lineage.started_at ({error.errors()[0]['msg']}): the "
             "checkpoint itself is unaffected", ResumekitWarning, stacklevel=4)


def _check_step_and_paths(document: dict[str, Any], source: str) -> None:
    """Refuse a ``true`` step and every listed path that escapes, before validation.

    Raises:
        ManifestError: ``step`` is a JSON boolean (which pydantic would take for 0 or 1).
        UnsafeCheckpointError: A path escapes the directory or holds a NUL byte, named
            with ``source``.
    """
    step = document.get("step")
    if isinstance(step, bool):
        raise ManifestError(f"{source}: step is {step!r}, not a step number", path=source,
                            key="step")
    files = document.get("files")
    listed = [entry.get("path") for entry in files if isinstance(entry, dict)] \
        if isinstance(files, list) else []
    data_dir = document.get("data_dir", ".")
    for path in [*listed, None if data_dir == "." else data_dir]:
        if isinstance(path, str):
            try:
                safe_relative_path(path)
            except UnsafeCheckpointError as error:
                raise UnsafeCheckpointError(
                    f"{source}: {error}", path=source, file=path
                ) from None


class Checksum:
    """A running ``"xxh3_128:<hex>"`` checksum, fed chunk by chunk.

    The hash releases the GIL, so writer and reader threads can hash while other threads
    run Python.

    Example:
        >>> running = Checksum()
        >>> running.update(b"step ")
        >>> running.update(b"1000")
        >>> running.value() == checksum_chunks([b"step 1000"])
        True
    """

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()
        self._parts: list[int] | None = None  # lengths of the parts, for a parts checksum
        self._done: list[tuple[int, str]] = []
        self._count = 0  # bytes in the current part

    @classmethod
    def like(cls, expected: str) -> Checksum:
        """A running checksum of the kind of ``expected``, to compare with it.

        A whole-file checksum for ``"xxh3_128:<hex>"``; for a checksum of parts
        (:data:`PARTS_ALGORITHM`), each of ``expected``'s parts hashed on its own (the last
        part takes whatever follows), so that :meth:`value` equals ``expected`` exactly
        when every byte matches. Anything else: a whole-file checksum (which then differs).

        Example:
            >>> expected = parts_checksum([(4, hex_digest(b"step")), (5, hex_digest(b" 1000"))])
            >>> running = Checksum.like(expected)
            >>> running.update(b"step 1000")
            >>> running.value() == expected
            True
        """
        running = cls()
        parts = parse_parts_checksum(expected)
        if parts is not None:
            running._parts = [length for length, _ in parts]
        return running

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        """Add ``chunk`` (any buffer) to the checksum."""
        if self._parts is None:
            self._hasher.update(chunk)
            return
        view = memoryview(chunk).cast("B")
        while view:
            number = len(self._done)
            last = number >= len(self._parts) - 1
            take = len(view) if last else min(self._parts[number] - self._count, len(view))
            self._hasher.update(view[:take])
            view = view[take:]
            self._count += take
            if not last and self._count == self._parts[number]:
                self._done.append((self._count, self._hasher.hexdigest()))
                self._hasher = xxhash.xxh3_128()
                self._count = 0

    def value(self) -> str:
        """Return the checksum of everything added so far, as ``"xxh3_128:<hex>"``.

        For :meth:`like` a checksum of parts: ``"xxh3_128-parts:<length>:<hex>,..."``.
        """
        if self._parts is None:
            return f"{CHECKSUM_ALGORITHM}:{self._hasher.hexdigest()}"
        return parts_checksum([*self._done, (self._count, self._hasher.hexdigest())])


def parts_checksum(parts: Sequence[tuple[int, str]]) -> str:
    """The checksum of a file hashed in parts: ``"xxh3_128-parts:<length>:<hex>,..."``.

    Args:
        parts: ``(length, hex XXH3-128)`` of each part, in file order.
    """
    return f"{PARTS_ALGORITHM}:" + ",".join(f"{length}:{digest}" for length, digest in parts)


def parse_parts_checksum(checksum: str) -> list[tuple[int, str]] | None:
    """``[(length, hex)]`` of a checksum of parts; None for any other checksum."""
    algorithm, _, listed = checksum.partition(":")
    if algorithm != PARTS_ALGORITHM or not listed:
        return None
    parts: list[tuple[int, str]] = []
    for text in listed.split(","):
        length, _, digest = text.partition(":")
        if not length.isdigit() or not digest:
            return None
        parts.append((int(length), digest))
    return parts


def hex_digest(chunk: bytes | bytearray | memoryview) -> str:
    """Return the bare XXH3-128 hex digest of one buffer (no algorithm prefix)."""
    return str(xxhash.xxh3_128_hexdigest(chunk))


def checksum_chunks(chunks: Iterable[bytes], *, like: str | None = None) -> str:
    """Return the ``"xxh3_128:<hex>"`` checksum of a stream of byte chunks.

    With ``like`` (an expected checksum): one of its kind (:meth:`Checksum.like`), equal to
    it exactly when the bytes match.
    """
    running = Checksum() if like is None else Checksum.like(like)
    for chunk in chunks:
        running.update(chunk)
    return running.value()


def describe(manifest: Manifest) -> dict[str, Any]:
    """Return the manifest as plain JSON-able data (for ``--json`` output)."""
    return dict(json.loads(manifest.model_dump_json()))
