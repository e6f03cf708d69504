"""Copies set aside by another resumekit version: which this one puts back, and why not.

A restore sets a checkpoint it cannot use aside under a hidden ``.<step name>.bad-<token>``
name (:func:`resumekit.store.recovery.set_aside`). A release that could not read a newer
format took such a checkpoint for damage (issue 37: the release before ``schema_version`` 2
set aside every checkpoint of a root written with the packed members' descriptor, then
started at step 0). So the token says which version set it aside: ``s<schema_version>_<hex>``
(:func:`aside_token`); a token without that mark is an older release's.

On restore (the leader, before anything is read: :func:`put_back_set_aside`) a copy that
another version set aside, and that this one reads (a manifest of a schema it knows naming
that step, every listed file there at its size), is renamed back to its step name with a
warning naming both paths, when that name is free; the restore then verifies it like any
committed checkpoint (one that fails is set aside again, marked as this version's). A copy
this version set aside itself is never put back automatically: it could not read it.
:func:`copies_set_aside` says, for each copy, why it was not put back; the refusal of a
fresh start beside copies of a newer step than anything committed names them with it.

Nothing here deletes anything, and nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
from dataclasses import dataclass

from resumekit.errors import ResumekitError
from resumekit.store import generations
from resumekit.store.catalog import Listing, list_root, read_manifest, verify_checkpoint
from resumekit.store.layout import NameFormat
from resumekit.store.manifest import SCHEMA_VERSION, Manifest, WriterGeneration
from resumekit.store.newest import forget_newest_hint
from resumekit.store.storage import Storage
from resumekit.warnings import ResumekitWarning, warn

__all__ = [
    "SetAsideCopy",
    "aside_token",
    "copies_set_aside",
    "put_back_set_aside",
    "refuse_fresh_start_beside",
    "set_aside_by",
]

logger = logging.getLogger("resumekit")

_MARK = re.compile(r"^s(?P<schema>[0-9]+)_")


def aside_token(random_hex: str) -> str:
    """The token of a name this version sets a copy aside under: ``s<SCHEMA_VERSION>_<hex>``."""
    return f"s{SCHEMA_VERSION}_{random_hex}"


def set_aside_by(token: str) -> int | None:
    """The ``schema_version`` of the resumekit that set a copy aside (None: an older one)."""
    match = _MARK.match(token)
    return None if match is None else int(match.group("schema"))


@dataclass(frozen=True)
class SetAsideCopy:
    """A hidden ``.bad-`` copy of a step, and whether this version puts it back.

    Attributes:
        step: The step its name stands for.
        name: Its hidden name, relative to the root.
        target: The step directory name it would go back to.
        setter: The ``schema_version`` of the resumekit that set it aside (None: a
            release before the mark).
        manifest: Its manifest, when this version reads it.
        why_not: Why it is not put back (None: it is).
        fenced: It would read as a fenced writer's checkpoint in this root (restore it
            from a new root instead).
    """

    step: int
    name: str
    target: str
    setter: int | None
    manifest: Manifest | None
    why_not: str | None
    fenced: bool = False

    def who(self) -> str:
        """Which version set it aside, in words."""
        if self.setter is None:
            return "an older resumekit (one that did not mark what it set aside)"
        if self.setter == SCHEMA_VERSION:
            return f"this resumekit (schema_version {SCHEMA_VERSION})"
        return f"a resumekit of schema_version {self.setter}"


def copies_set_aside(storage: Storage, name_format: NameFormat, listing: Listing
                     ) -> list[SetAsideCopy]:
    """Every ``.bad-`` copy of the listing, newest step first, judged (leader only).

    A copy is put back when another version set it aside, its step name is free, this
    version reads its manifest (of that step, not a node-local part), every file it lists
    is there at its size, the root's newest writer claim would not take it for a fenced
    writer's commit, and it is the newest such copy of its step (by ``created_at``).
    """
    names = {name for name, _ in listing}
    found: list[SetAsideCopy] = []
    chosen: dict[int, SetAsideCopy] = {}
    claims: list[WriterGeneration | None] = []  # the root's newest claim, read once if needed
    for name in sorted(names):
        parsed = name_format.parse_hidden(name)
        if parsed is None or parsed[1].kind != "bad":
            continue
        step, hidden = parsed
        copy = _judge(storage, SetAsideCopy(step, name, hidden.name, set_aside_by(hidden.token),
                                            None, None), names, claims)
        held = chosen.get(step)
        if copy.why_not is not None or copy.manifest is None:
            pass
        elif held is not None and held.manifest is not None and \
                held.manifest.created_at >= copy.manifest.created_at:
            copy = _not_chosen(copy, held)
        else:
            if held is not None:
                found[found.index(held)] = _not_chosen(held, copy)
            chosen[step] = copy
        found.append(copy)
    return sorted(found, key=lambda c: (c.step, c.name), reverse=True)


def _judge(storage: Storage, copy: SetAsideCopy, names: set[str],
           claims: list[WriterGeneration | None]) -> SetAsideCopy:
    """``copy`` with its manifest and why it is not put back (:func:`copies_set_aside`)."""
    if copy.setter == SCHEMA_VERSION:
        return dataclasses.replace(
            copy, why_not="this resumekit set it aside itself: it could not restore it")
    if copy.target in names:
        return dataclasses.replace(
            copy, why_not=f"{storage.path(copy.target)} holds its step name")
    try:
        manifest = read_manifest(storage, copy.name)
        verify_checkpoint(storage, copy.name, manifest=manifest,
                          sizes_only=[entry.path for entry in manifest.files])
    except (ResumekitError, OSError) as error:
        return dataclasses.replace(copy, why_not=f"this resumekit cannot read it: {error}")
    if manifest.step != copy.step or manifest.local is not None:
        what = f"names step {manifest.step}" if manifest.step != copy.step else \
            "is a node-local copy of one rank's part"
        return dataclasses.replace(copy, why_not=f"its manifest {what}")
    if not claims:
        claims.append(generations.newest_generation(storage))
    claim = claims[0]
    if claim is not None and generations.zombie_reason(manifest, claim) is not None:
        seen = "no step" if claim.newest_step is None else \
            f"step {claim.newest_step} as the newest"
        return dataclasses.replace(
            copy, manifest=manifest, fenced=True,
            why_not=f"writer generation {claim.number} claimed the root after it was set "
                    f"aside, seeing {seen}, so in this root it would read as a fenced "
                    "writer's checkpoint")
    return dataclasses.replace(copy, manifest=manifest)


def _not_chosen(copy: SetAsideCopy, newer: SetAsideCopy) -> SetAsideCopy:
    return dataclasses.replace(
        copy, why_not=f"{newer.name}, a newer copy of step {copy.step}, is put back")


def put_back_set_aside(storage: Storage, name_format: NameFormat, listing: Listing
                       ) -> list[str]:
    """Put back every copy :func:`copies_set_aside` says to, each with a warning (leader).

    Only on a root whose directories rename atomically (elsewhere nothing is set aside).

    Returns:
        The step directory names put back.
    """
    if not storage.atomic_rename:
        return []
    put: list[str] = []
    for copy in copies_set_aside(storage, name_format, listing):
        if copy.why_not is not None:
            if copy.setter != SCHEMA_VERSION:
                logger.info("resumekit: not putting back %s (step %d): %s",
                            storage.path(copy.name), copy.step, copy.why_not)
            continue
        assert copy.manifest is not None
        if not put:
            forget_newest_hint(storage)
        storage.rename_dir(copy.name, copy.target)
        put.append(copy.target)
        written = copy.manifest.versions.get("resumekit", "a version it did not record")
        warn(f"put {storage.path(copy.name)} back as {storage.path(copy.target)}: it is "
             f"committed step {copy.step} (schema_version {copy.manifest.schema_version}, "
             f"written by resumekit {written}), set aside by {copy.who()}, and this "
             "resumekit reads its manifest and finds every file it lists at its size "
             "(restore verifies it like any committed checkpoint)",
             ResumekitWarning, stacklevel=7)
    if put:
        storage.fsync_dir()
    return put


def refuse_fresh_start_beside(storage: Storage, name_format: NameFormat, newest: int) -> None:
    """Never start at step 0 beside set-aside copies of a newer step than ``newest`` (leader).

    A restore that starts fresh there would train again the steps those copies hold,
    silently; each copy is named with who set it aside, why it was not put back, and the
    command that puts it back.

    Args:
        storage: The root.
        name_format: Its step directory names.
        newest: The newest committed step (-1: none).

    Raises:
        ResumekitError: There are such copies (``path``: the root, ``steps``, ``commands``).
    """
    copies = [copy for copy in copies_set_aside(storage, name_format, list_root(storage))
              if copy.step > newest]
    if not copies:
        return
    commands: list[str] = []
    listed: list[str] = []
    for copy in copies:
        source = shlex.quote(storage.path(copy.name))
        if copy.fenced:
            fresh = storage.path().rstrip("/") + f"-step-{copy.step}"
            command = (f"mkdir {shlex.quote(fresh)} && mv {source} "
                       f"{shlex.quote(fresh + '/' + copy.target)}")
            then = f" (then restore from {fresh})"
        else:
            command = f"mv {source} {shlex.quote(storage.path(copy.target))}"
            then = ""
        commands.append(command)
        listed.append(f"{storage.path(copy.name)} (step {copy.step}, set aside by "
                      f"{copy.who()}; not put back: {copy.why_not}; to put it back: "
                      f"{command}{then})")
    steps = sorted({copy.step for copy in copies}, reverse=True)
    held = "nothing committed" if newest < 0 else f"step {newest} as the newest committed"
    raise ResumekitError(
        f"refusing to start fresh at step 0: {storage.path()} holds {held}, but copies of "
        f"newer steps were set aside by an earlier restore: {'; '.join(listed)}. Starting "
        "at step 0 beside them would train those steps again and hide them. Put the one to "
        "resume from back and restore again, or move them all out of the root to start "
        "fresh without them",
        path=storage.path(), steps=steps, commands=commands,
    )
