"""Writer generations: which run owns a checkpoint root now, and fencing the older ones.

The rule is written down once, in :mod:`resumekit.store.commit`; this module is its mechanism.

Every claim of a root is a record ``<root>/.resumekit-generations/<number:012d>.json``
(a :class:`~resumekit.store.manifest.WriterGeneration`), created exclusively
(:meth:`~resumekit.store.storage.Storage.write_bytes_exclusive`) with ``number`` = newest + 1,
retried on a lost race. Numbers are therefore unique and consecutive, and generations are
totally ordered by them. Two managers of one run share one generation: of one SLURM
allocation (same job id and restart count), or outside SLURM of one process (same host
and pid — a zombie is always another process than the run that replaced it); a claim
from an older restart of a job whose newer restart already claimed is refused.

The order of two racing claims is decided by the exclusive create, never by when each
claimer happened to read: a claim lists the records once, reads every record listed,
and creates the number after the highest one listed. A record appears whole (locally
written aside and hard-linked in; one ``PUT`` on S3), so a record that is listed is read
complete. A claimer whose listing missed a newer record (it was created after the
listing, or the listing was stale) asks for a number that record already holds: the
create fails, and the claimer reads that number before it tries again. So a claim that
succeeds has read every record below its own, and an older restart that raced a newer
one of its job is refused, whichever read first. A claimer whose own run holds the newest
record listed creates nothing: it reads the number after that record once more (a claim
made after its listing is there), and with a record there it goes on as after a lost
create, so an older restart holding the newest claim is refused too. Where the store cannot create
exclusively the claimer reads its record back once (the record that stays decides).

A writer holding generation ``n`` may commit while record ``n`` still holds its token and
no record ``n + 1`` exists. Records are pruned oldest first, keeping the newest
:data:`RECORDS_KEPT`, so a writer whose successor's record was pruned lost its own record
too and is still fenced.

Reading a record is retried after transient errors
(:func:`~resumekit.store.retry.read_with_retry`); a record that still cannot be read raises
:class:`~resumekit.errors.StorageError` saying the generations could not be checked: an
I/O error is never taken for a newer claim (fencing), nor skipped as if the record were
not there. Only a record whose bytes do not parse (torn by a claimer of an older
resumekit killed while writing it) is skipped when read, with a warning; its number
still fences the generations below it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterable

from resumekit.errors import FencedWriterError, StorageError, UnsafeCheckpointError
from resumekit.store.catalog import CheckpointEntry
from resumekit.store.layout import (
    GENERATIONS_DIR,
    NameFormat,
    generation_record_name,
)
from resumekit.store.manifest import SCHEMA_VERSION, Lineage, Manifest, WriterGeneration
from resumekit.store.newest import generation_record_numbers, newest_committed
from resumekit.store.retry import READ_ATTEMPTS, is_transient, read_with_retry
from resumekit.store.storage import RECORD_LIMIT, Storage, parse_json

__all__ = [
    "RECORDS_KEPT",
    "Fence",
    "check",
    "claim",
    "claims",
    "fenced_by",
    "newest_generation",
    "newest_restorable",
    "zombie_commits",
    "zombie_reason",
]

logger = logging.getLogger("resumekit")

#: Generation records kept in a root (older ones are deleted by the next claim).
RECORDS_KEPT = 16
_CLAIM_ATTEMPTS = 64


class Fence:
    """The generation a writer claimed in one root, shared by a manager's protocols.

    A manager's channels claim from several threads (the training thread, a background
    save's, the emergency capture's): ``lock`` makes each check-then-claim one step, so a
    process never claims twice and fences itself.

    Attributes:
        generation: The claim, once made (None before the first restore or save).
        lock: Held while a claim is checked or made.
    """

    def __init__(self) -> None:
        self.generation: WriterGeneration | None = None
        self.lock = threading.RLock()


def _numbers(storage: Storage) -> list[int]:
    return generation_record_numbers(storage)


#: What :func:`_fetch` returns for a record whose bytes do not parse.
_TORN = "torn"


def _fetch(storage: Storage, number: int) -> WriterGeneration | str | None:
    """Read record ``number``: the record, None when absent, :data:`_TORN` when torn.

    Transient errors are retried; an error that outlives the retries (or one that is
    not transient, such as ``EACCES``) raises: it says nothing about the record.

    Raises:
        StorageError: The record could not be read; the message says the generations
            could not be checked and that this is not fencing.
    """
    name = generation_record_name(number)
    where = storage.path(name)
    try:
        try:
            # the first try without the retry machinery
            data = storage.read_small(name, limit=RECORD_LIMIT)
        except Exception as error:
            if isinstance(error, (FileNotFoundError, UnsafeCheckpointError)) or \
                    not is_transient(error):
                raise
            logger.warning("resumekit: reading %s failed (%s: %s); retrying it up to %d "
                           "times", where, type(error).__name__, error, READ_ATTEMPTS)
            data = read_with_retry(where, lambda: storage.read_small(name, limit=RECORD_LIMIT))
    except FileNotFoundError:
        return None
    except UnsafeCheckpointError as error:  # not a regular file, or far too large
        logger.warning("resumekit: ignoring generation record %s (its number still fences "
                       "the generations below it): %s", where, error)
        return _TORN
    except Exception as error:
        if not isinstance(error, StorageError) and not is_transient(error):
            raise
        raise StorageError(
            f"could not check the writer generations of {storage.path()}: reading "
            f"generation record {where} failed ({error}). This is a storage error, not "
            "fencing: no newer claim was seen, so this writer is not fenced by it; "
            "nothing was set aside or deleted - check the storage and run again",
            path=where, operation="read", attempts=getattr(error, "attempts", None),
        ) from error
    try:
        return WriterGeneration.model_validate(parse_json(data, source=where))
    except ValueError as error:
        logger.warning("resumekit: ignoring unreadable generation record %s (its bytes do "
                       "not parse; its number still fences the generations below it): %s",
                       where, error)
        return _TORN


def _read(storage: Storage, number: int) -> WriterGeneration | None:
    """Read record ``number``; None when absent or torn (the latter logged).

    Raises:
        StorageError: It could not be read (see :func:`_fetch`).
    """
    record = _fetch(storage, number)
    return record if isinstance(record, WriterGeneration) else None


def newest_generation(storage: Storage) -> WriterGeneration | None:
    """Return the newest readable generation record of the root (None if there is none)."""
    return _newest_readable(storage, _numbers(storage))


def claims(storage: Storage) -> list[WriterGeneration]:
    """Every readable generation record kept in the root, oldest first (the run's history).

    At most :data:`RECORDS_KEPT`; a torn record is left out (logged).
    """
    found = (_read(storage, number) for number in _numbers(storage))
    return sorted((record for record in found if record is not None),
                  key=lambda record: record.number)


def _newest_readable(storage: Storage, numbers: list[int]) -> WriterGeneration | None:
    for number in reversed(numbers):
        record = _read(storage, number)
        if record is not None:
            return record
    return None


def fenced_by(generation: WriterGeneration, current: WriterGeneration) -> bool:
    """Whether ``generation`` is older than ``current``, the root's newest claim.

    Older means a lower number, or the same number with another token (a claim that lost
    a race on a store without conditional create: the record that stayed is the claim).
    """
    return generation.number < current.number or (
        generation.number == current.number and generation.token != current.token)


def zombie_reason(manifest: Manifest, current: WriterGeneration | None) -> str | None:
    """Why the checkpoint of ``manifest`` was committed by a fenced writer, else None.

    A checkpoint of an older generation whose step is above the newest step the current
    generation saw when it claimed the root was committed after that claim: by a writer
    that had been fenced (a zombie, inside the race window of the commit, or a resumekit
    without fencing). Manifests without a generation are never a zombie's, nor is one of a
    newer ``schema_version`` than the claimer reads (an older release took it for no
    checkpoint: :attr:`~resumekit.store.manifest.WriterGeneration.reads_schema`).
    """
    written = manifest.generation
    if current is None or written is None or not fenced_by(written, current):
        return None
    if manifest.schema_version > (current.reads_schema or 1):
        return None  # the claimer could not read it: its newest_step says nothing of it
    if current.newest_step is not None and manifest.step <= current.newest_step:
        return None  # committed before the claim: part of the history the claimer saw
    seen = ("an empty root" if current.newest_step is None
            else f"step {current.newest_step} as the newest")
    return (f"committed by {written.describe()} after {current.describe()} had claimed the "
            f"root (seeing {seen}): a fenced writer's checkpoint")


def newest_restorable(storage: Storage, name_format: NameFormat | None = None
                      ) -> tuple[CheckpointEntry | None, dict[str, str]]:
    """The committed checkpoint a restore would start from, and the zombie commits above it.

    The newest committed checkpoint that no fenced writer committed (:func:`zombie_reason`
    against the root's newest claim), read from the top down like
    :func:`~resumekit.store.newest.newest_committed`. A commit that landed in the race window of
    a fenced writer is committed on disk but never restored; ``latest()`` and ``resumekit
    inspect`` name the same checkpoint a restore would, and say which ones they passed.

    Returns:
        The entry (None when nothing restorable is committed) and ``{path: reason}`` of
        each fenced writer's commit above it.
    """
    # An absent root lists as empty: no generation (no is_dir() first, one request less).
    # The records are listed once: for the zombie check and for the stamped hint's.
    numbers = _numbers(storage)
    current = _newest_readable(storage, numbers)
    passed: dict[str, str] = {}

    def fenced(entry: CheckpointEntry) -> bool:
        reason = None if entry.manifest is None else zombie_reason(entry.manifest, current)
        if reason is not None:
            passed[entry.path] = reason
        return reason is not None

    return newest_committed(storage, name_format, skip=fenced,
                            newest_record=numbers[-1] if numbers else None), passed


def zombie_commits(entries: Iterable[CheckpointEntry], current: WriterGeneration | None
                   ) -> dict[str, str]:
    """Return ``{name: reason}`` of the committed entries a fenced writer committed."""
    found = {}
    for entry in entries:
        if entry.status == "committed" and entry.manifest is not None:
            reason = zombie_reason(entry.manifest, current)
            if reason is not None:
                found[entry.name] = reason
    return found


def claim(storage: Storage, *, newest_step: int | None,
          identity: Lineage | None = None) -> WriterGeneration:
    """Claim the root for this process (call on rank 0 only); return the generation.

    Args:
        storage: The checkpoint root (created if absent).
        newest_step: Newest step committed by a not-fenced writer, as the caller listed it
            (see :func:`zombie_commits`).
        identity: Whose claim it is (default: this process, from its environment).

    Returns:
        A new generation, or the current one when it belongs to the same run (see
        :meth:`~resumekit.store.manifest.WriterGeneration.same_run`).

    Raises:
        FencedWriterError: A newer restart of this SLURM job already claimed the root.
        StorageError: The root cannot be written, or a record cannot be read (its
            transient errors outlived their retries): nothing was claimed.
    """
    me = identity or Lineage.current()
    taken: set[int] = set()  # numbers a create found taken although no listing had them
    for _ in range(_CLAIM_ATTEMPTS):
        # One listing, and every record it holds read whole: what decides this claim.
        numbers = sorted(set(_numbers(storage)) | taken)
        found = {number: _fetch(storage, number) for number in numbers}
        records = [record for record in found.values() if isinstance(record, WriterGeneration)]
        _refuse_an_older_restart(storage, me, records)
        top = numbers[-1] if numbers else 0
        newest = found.get(top)
        mine = WriterGeneration(
            number=top + 1, token=secrets.token_hex(8),
            slurm_job_id=me.slurm_job_id, slurm_restart_count=me.slurm_restart_count,
            hostname=me.hostname, pid=me.pid, newest_step=newest_step,
            reads_schema=SCHEMA_VERSION,
        )
        if isinstance(newest, WriterGeneration) and newest.same_run(mine):
            # The same run holds the newest record listed; a claim created after the
            # listing (a newer restart of the job, between the listing and the reads)
            # is read before the claim is taken over: no create decides this path.
            if _fetch(storage, top + 1) is not None:
                taken.add(top + 1)
                continue
            return newest
        storage.make_dirs()
        name = generation_record_name(mine.number)
        try:
            storage.write_bytes_exclusive(name, mine.model_dump_json(indent=2).encode())
        except FileExistsError:
            taken.add(mine.number)  # another claimer took it first: read it, try the next
            continue
        if not storage.conditional_create:
            # A check-then-write store: a racing claim of this number may have replaced
            # the record. Read it back; the record that stays decides.
            stayed = _read(storage, mine.number)
            if stayed is None or stayed.token != mine.token:
                taken.add(mine.number)
                continue
        _prune_records(storage, mine.number)
        logger.info("resumekit: %s claimed %s", mine.describe(), storage.path())
        return mine
    raise StorageError(
        f"cannot claim a writer generation in {storage.path()}: {_CLAIM_ATTEMPTS} claims "
        "raced with others and lost", path=storage.path(), operation="claim",
    )


def _refuse_an_older_restart(storage: Storage, me: Lineage,
                             records: Iterable[WriterGeneration]) -> None:
    """Raise when a newer restart of ``me``'s SLURM job holds one of ``records``."""
    if me.slurm_job_id is None:
        return
    for record in records:
        if record.slurm_job_id == me.slurm_job_id \
                and (record.slurm_restart_count or 0) > (me.slurm_restart_count or 0):
            raise FencedWriterError(
                f"cannot claim {storage.path()}: this process is SLURM job "
                f"{me.slurm_job_id} restart {me.slurm_restart_count}, and "
                f"{record.describe()} of a later restart of the same job already "
                "claimed it (this process is a zombie of the requeued job: stop it)",
                path=storage.path(), step=None,
                generation=f"SLURM job {me.slurm_job_id} restart "
                           f"{me.slurm_restart_count}",
                newer=record.describe(),
            )


def _prune_records(storage: Storage, newest: int) -> None:
    for number in _numbers(storage):
        if number <= newest - RECORDS_KEPT:
            try:
                storage.remove_file(generation_record_name(number))
            except StorageError as error:  # kept records only cost a few bytes
                logger.warning("resumekit: cannot delete old generation record %s: %s",
                               storage.path(generation_record_name(number)), error)


def check(storage: Storage, generation: WriterGeneration, *, action: str,
          step: int | None = None) -> None:
    """Raise unless ``generation`` is still the root's newest claim.

    Reads two names: the writer's own record (it must still hold its token) and its
    successor's (it must not exist; a torn one counts). Both reads are retried after
    transient errors; an error that outlives them is not taken for a newer claim.

    Args:
        storage: The checkpoint root.
        generation: The writer's claim.
        action: What the writer is about to do, for the error (``"commit step 300"``).
        step: The step concerned, if any.

    Raises:
        FencedWriterError: A newer generation has claimed the root.
        StorageError: A record could not be read, or the writer's own record is torn:
            whether a newer generation claimed the root is not known (and not assumed).
    """
    own = _fetch(storage, generation.number)
    successor = _fetch(storage, generation.number + 1) is not None
    if own == _TORN and not successor:
        where = storage.path(generation_record_name(generation.number))
        raise StorageError(
            f"could not check the writer generations of {storage.path()} before this "
            f"writer's attempt to {action}: its own generation record {where} does not "
            "parse (damaged after it was written). This is not fencing: no newer claim was "
            "seen, so this writer is not fenced by it; nothing was set aside or deleted. "
            "A new claim (a restarted run's restore) writes a new record",
            path=where, operation="read", step=step,
        )
    if isinstance(own, WriterGeneration) and own.token == generation.token and not successor:
        return
    try:
        newer = newest_generation(storage)  # only to name it: fenced either way
    except StorageError:
        newer = None
    newer_text = newer.describe() if newer is not None and newer.token != generation.token \
        else f"a newer claim (record {generation.number} or {generation.number + 1} of " \
             f"{storage.path(GENERATIONS_DIR)})"
    raise FencedWriterError(
        f"refusing to {action} under {storage.path()}: this writer's "
        f"{generation.describe()} is fenced by {newer_text}; a newer run restored or "
        "committed here since (e.g. a SLURM requeue while this process was still alive). "
        "Nothing of the newer run was touched; stop this process",
        path=storage.path(), step=step, generation=generation.describe(), newer=newer_text,
    )
