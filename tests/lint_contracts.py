"""A custom import-linter contract: a sub-package of an external package, by importer.

import-linter sees an external package only as its top level (``torch``), so "only
``resumekit.tensors`` and ``resumekit.tensors.raw`` import
``torch.distributed.checkpoint``" cannot be a stock contract. This one reads the import
lines the graph records for every import of the top-level package and checks the dotted
names they import. It is registered in pyproject.toml (``[tool.importlinter]
contract_types``) and runs with the others in ``make lint``.
"""

from __future__ import annotations

import re
from typing import Any

import grimp
from importlinter import Contract, ContractCheck, fields, output

_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+\(?\s*(.+?)\s*\)?\s*$")
_IMPORT = re.compile(r"^\s*import\s+(.+?)\s*$")


def imported_names(line: str) -> list[str]:
    """The dotted names an import line reaches (``from a.b import c`` reaches ``a.b.c``).

    >>> imported_names("from torch.distributed import checkpoint as dcp, rpc")
    ['torch.distributed', 'torch.distributed.checkpoint', 'torch.distributed.rpc']
    >>> imported_names("import torch.distributed.checkpoint as dcp")
    ['torch.distributed.checkpoint']
    """
    match = _FROM.match(line)
    if match is not None:
        package = match.group(1)
        names = [part.split(" as ")[0].strip() for part in match.group(2).split(",")]
        return [package] + [f"{package}.{name}" for name in names if name and name != "*"]
    match = _IMPORT.match(line)
    if match is not None:
        return [part.split(" as ")[0].strip() for part in match.group(1).split(",")]
    return []


def _within(name: str, modules: list[str]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)


class ExternalSubpackageContract(Contract):
    """Only ``allowed_importers`` import ``protected`` (a dotted external sub-package).

    Configuration options:
        - protected: e.g. ``torch.distributed.checkpoint``.
        - allowed_importers: The modules (or packages, with all below them) of the root
          package that may import it.
        - ignore_imports: Declared exceptions, ``"importer -> dotted.module"``: that
          importer may import that part of ``protected`` (and what is below it). (Optional.)
    """

    type_name = "external_subpackage"

    protected = fields.StringField()
    allowed_importers = fields.ListField(subfield=fields.StringField())
    ignore_imports = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        """Find every import line outside the allowed importers that reaches ``protected``."""
        protected = str(self.protected)
        top = protected.split(".", 1)[0]
        allowed = {str(name) for name in self.allowed_importers}  # type: ignore[attr-defined]
        excepted: dict[str, list[str]] = {}
        for rule in self.ignore_imports or []:  # type: ignore[attr-defined]
            importer, _, module = str(rule).partition("->")
            excepted.setdefault(importer.strip(), []).append(module.strip())
        illegal: list[dict[str, Any]] = []
        for importer in sorted(graph.find_modules_that_directly_import(top)):
            if _within(importer, sorted(allowed)):
                continue
            for detail in graph.get_import_details(importer=importer, imported=top):
                reached = [name for name in imported_names(str(detail["line_contents"]))
                           if name == protected or name.startswith(protected + ".")]
                ok = excepted.get(importer, [])
                if any(not _within(name, ok) for name in reached):
                    illegal.append({"importer": importer, "line": detail["line_number"],
                                    "contents": detail["line_contents"]})
        return ContractCheck(kept=not illegal, metadata={"illegal": illegal})

    def render_broken_contract(self, check: ContractCheck) -> None:
        """Name each illegal import by module, line and text."""
        for item in check.metadata["illegal"]:
            output.print_error(
                f"{item['importer']} (l.{item['line']}) imports {self.protected}: "
                f"{item['contents']}", bold=False)
            output.new_line()
