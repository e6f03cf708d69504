"""``resumekit inspect <local_root>``: the sub-roots of a local tier's directory.

A local tier's directory (``LocalTier.root``) holds one resumekit root per rank
(``rank_XXXXX/``, its own copies) and per rank whose replicas the node keeps
(``replica_of_rank_XXXXX/``). Each is a root like any other (``resumekit inspect
<local_root>/rank_00003``); this is the table of all of them: committed steps, the newest
one's size, world size, node and durable root, and what is not committed.
"""

from __future__ import annotations

import argparse
from typing import Any

from resumekit.cli._common import console, emit_json, format_bytes, or_dash, table
from resumekit.errors import CorruptCheckpointError
from resumekit.local.roots import SubRoot, sub_roots
from resumekit.store.catalog import list_checkpoints
from resumekit.store.layout import GENERATIONS_DIR, NameFormat
from resumekit.store.storage import Storage

__all__ = ["is_local_root", "misplaced_sub_roots", "run_local_root"]


def is_local_root(storage: Storage, name_format: NameFormat | None = None) -> bool:
    """Whether ``storage`` is a local tier's directory: it holds sub-roots and nothing else.

    A directory that also holds anything of a checkpoint root (writer generations, a step
    directory of either name format, committed or not, another tool's checkpoint) is a
    root, whatever else lies beside its entries: ``inspect`` lists its checkpoints and
    names a sub-root in it as a problem (:func:`misplaced_sub_roots`).
    """
    if not storage.is_dir() or storage.exists("manifest.json"):
        return False
    if not sub_roots(storage) or storage.exists(GENERATIONS_DIR):
        return False
    return not list_checkpoints(storage, name_format)


def misplaced_sub_roots(storage: Storage) -> list[dict[str, str]]:
    """A local tier's directories inside the checkpoint root ``storage``, each a problem.

    Node-local copies do not belong among durable checkpoints (a local root that was the
    durable root through a link left them there, or a directory was made by hand); they
    are named, never read as the root's kind, never touched.

    Returns:
        ``{"name", "path", "problem"}`` of each (the ``problems`` of ``inspect --json``).
    """
    return [{"name": sub.name, "path": storage.path(sub.name),
             "problem": (f"a local tier's directory ({_holds(sub)}) inside a checkpoint "
                         "root: node-local copies do not belong among durable checkpoints "
                         "(LocalTier.root must be a directory of its own); restore ignores "
                         "it. Move it out of the root")}
            for sub in sub_roots(storage)]


def _holds(sub: SubRoot) -> str:
    return (f"rank {sub.rank}'s own copies" if sub.kind == "own"
            else f"rank {sub.rank}'s replicas")


def _sub_root_json(storage: Storage, sub: SubRoot, name_format: NameFormat | None
                   ) -> dict[str, Any]:
    root = Storage(storage.url_of(sub.name), storage.storage_options)
    entries = list_checkpoints(root, name_format)
    committed = [entry for entry in entries if entry.status == "committed"]
    newest = committed[-1].manifest if committed else None
    part = None if newest is None else newest.local
    return {
        "name": sub.name,
        "path": root.path(),
        "kind": sub.kind,
        "rank": sub.rank,
        "steps": [entry.step for entry in committed],
        "newest": None if newest is None else newest.step,
        "bytes": None if newest is None else newest.total_bytes,
        "world_size": None if part is None else part.world_size,
        "node": None if part is None else part.node,
        "durable_root": None if part is None else part.durable_root,
        "other": [{"name": entry.name, "status": entry.status, "problem": entry.problem}
                  for entry in entries if entry.status != "committed"],
    }


def run_local_root(storage: Storage, args: argparse.Namespace, schema: str) -> int:
    """Print (or emit as JSON) the table of a local tier's sub-roots; return the exit code.

    Exit 1 when a sub-root holds a corrupt entry, as for a root.
    """
    name_format = NameFormat(args.name_format) if args.name_format else None
    rows = [_sub_root_json(storage, sub, name_format) for sub in sub_roots(storage)]
    if args.json:
        emit_json({"schema": schema, "kind": "local_root", "root": storage.path(),
                   "sub_roots": rows})
    else:
        out = console()
        out.print(f"Local tier directory {storage.path()}: {len(rows)} sub-root(s), each "
                  "a resumekit root (resumekit inspect <sub-root> lists its checkpoints)")
        grid = table("sub-root", "holds", "committed steps", "newest size", "world",
                     "node", "durable root", "not committed")
        for row in rows:
            holds = _holds(SubRoot(row["name"], row["kind"], row["rank"]))
            grid.add_row(row["name"], holds,
                         ", ".join(str(step) for step in row["steps"]) or "-",
                         "-" if row["bytes"] is None else format_bytes(row["bytes"]),
                         or_dash(row["world_size"]), or_dash(row["node"]),
                         or_dash(row["durable_root"]),
                         ", ".join(f"{other['name']} ({other['status']})"
                                   for other in row["other"]) or "-")
        out.print(grid)
    corrupt = [(row, other) for row in rows for other in row["other"]
               if other["status"] == "corrupt"]
    if corrupt:
        row, other = corrupt[0]
        raise CorruptCheckpointError(
            f"{len(corrupt)} corrupt checkpoint(s) under {storage.path()}; first: "
            f"{row['name']}/{other['name']}: {other['problem']}",
            path=f"{row['path']}/{other['name']}")
    return 0
