"""The ``resumekit`` command line: ``inspect | verify | export | import | diff | prune``.

Exit status everywhere: 0 ok; 1 a problem found (verification failed, not a checkpoint,
checkpoints differ, corrupt checkpoint); 2 a usage error (argparse's convention). Errors
are one line on stderr (``resumekit: error: ...``); ``--debug`` shows the traceback.
Human output is rich tables on stdout (colour only on a TTY); ``--json`` prints one JSON
document instead, and progress bars are drawn on stderr only when it is a terminal.
Reference: docs/cli.md.

Each command lives in its own module, registered in :data:`COMMANDS` by module path and
imported only when it runs: ``resumekit --help`` imports none of them, and ``inspect``
of a root, ``verify`` and ``prune`` import no torch (only ``export``, ``diff``, ``import``
and ``inspect`` of one checkpoint's state or tensors do).

Where to start reading: :func:`main` and :data:`COMMANDS` here, then the command in
question; :mod:`._common` holds what they share.

What it may import: every layer of resumekit below it (it is the top layer, beside
``integrations``), with three limits checked by contracts in pyproject.toml: this module,
``_common``, ``verify`` and ``prune`` import no torch and nothing of ``tools``,
``tensors`` or ``state``; only ``export`` and ``import_`` reach the exporter.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple

from resumekit._version import __version__
from resumekit.cli._common import UsageError, error_line
from resumekit.errors import ResumekitError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]


class Command(NamedTuple):
    """One subcommand: the module that implements it and its line in ``--help``.

    Attributes:
        module: The module path; it is imported only when the command runs (or its own
            ``--help`` is asked for), so ``resumekit --help`` and the commands that only
            read the store (``inspect ROOT``, ``verify``, ``prune``) import no torch.
        summary: The one line ``resumekit --help`` shows for it.
    """

    module: str
    summary: str


#: Every subcommand, in ``--help`` order (pip's ``commands/__init__.py`` pattern).
COMMANDS: dict[str, Command] = {
    "inspect": Command("resumekit.cli.inspect",
                       "list the checkpoints of a root, or describe one checkpoint"),
    "verify": Command("resumekit.cli.verify",
                      "re-hash a checkpoint's files against its manifest"),
    "export": Command("resumekit.cli.export",
                      "consolidate a checkpoint's model weights into safetensors"),
    "import": Command("resumekit.cli.import_",
                      "convert a DCP, torchtitan, Accelerate, Lightning, HF Trainer or "
                      "LingBot checkpoint into one committed resumekit checkpoint"),
    "diff": Command("resumekit.cli.diff", "compare two checkpoints tensor by tensor"),
    "prune": Command("resumekit.cli.prune",
                     "delete committed checkpoints a retention policy does not keep"),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The command named on a command line (the top level takes no option values)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the ``resumekit`` argument parser.

    Args:
        command: The command whose options are registered in full (its module is
            imported); every other command is registered by name and summary only, so
            ``resumekit --help`` (None) imports no command module at all.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="resumekit",
        description="Inspect, verify, export, import, compare and prune resumekit checkpoints "
        "(local paths or fsspec URLs such as s3://bucket/run).",
    )
    parser.add_argument("--version", action="version", version=f"resumekit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in COMMANDS.items():
        if name == command:
            importlib.import_module(spec.module).add_parser(subparsers, spec.summary)
        else:
            subparsers.add_parser(name, help=spec.summary, add_help=False)
    return parser


def _parse(parser: argparse.ArgumentParser, arguments: Sequence[str]
           ) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status argparse (or an unknown argument) ended with."""
    try:
        args, extras = parser.parse_known_args(arguments)
    except SystemExit as stop:  # argparse: --help/--version (0) or a usage error (2)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    if extras:
        return _unrecognized(_command_parser(parser, args.command) or parser, extras)
    return args


def _command_parser(parser: argparse.ArgumentParser, command: str
                    ) -> argparse.ArgumentParser | None:
    """The sub-parser of ``command`` in ``parser`` (None if it has none)."""
    for action in parser._actions:  # argparse lists no sub-parsers publicly
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(command)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None


def _unrecognized(command: argparse.ArgumentParser, extras: Sequence[str]) -> int:
    """Report arguments ``command`` does not take with its own usage line; return 2.

    argparse reports them with the top-level usage and ``resumekit: error:``; the
    command's own usage names the options it does take, and a near miss is suggested.
    """
    options = [option for action in command._actions for option in action.option_strings
               if option.startswith("--")]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        message += " (" + "; ".join(hints) + ")"
    command.print_usage(sys.stderr)
    print(f"{command.prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 problem found, 2 usage).

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(arguments)
    try:
        parser = build_parser(chosen)
    except ImportError as error:  # e.g. export/diff in an environment without torch
        print(error_line(f"resumekit {chosen} cannot run here: {error}"), file=sys.stderr)
        return 1
    args = _parse(parser, arguments)
    if isinstance(args, int):
        return args
    try:
        status: int = args.run(args)
    except UsageError as error:
        if args.debug:
            raise
        message = error_line(str(error)).removeprefix("resumekit: ")
        print(f"{parser.prog} {args.command}: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(error_line("interrupted"), file=sys.stderr)
        return 130
    except Exception as error:  # one line per failure; the traceback with --debug
        if args.debug:
            raise
        message = str(error) or type(error).__name__
        if not isinstance(error, (ResumekitError, OSError)):
            message = f"{type(error).__name__}: {message} (rerun with --debug for details)"
        print(error_line(message), file=sys.stderr)
        return 1
    return status
