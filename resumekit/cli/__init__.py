"""The ``resumekit`` command line: ``inspect | verify | export | import | diff | prune``.

Exit status everywhere: 0 ok; 1 a problem found (verification failed, not a checkpoint,
checkpoints differ, corrupt checkpoint); 2 a usage error (argparse's convention). Errors
are one line on stderr (``resumekit: error: ...``); ``--debug`` shows the traceback.
Human output is rich tables on stdout (colour only on a TTY); ``--json`` prints one JSON
document instead, and progress bars are drawn on stderr only when it is a terminal.
Reference: docs/cli.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from resumekit._version import __version__
from resumekit.cli import diff, export, import_, inspect, prune, verify
from resumekit.cli._common import UsageError, error_line
from resumekit.errors import ResumekitError

__all__ = ["build_parser", "main"]

_COMMANDS = (inspect, verify, export, import_, diff, prune)


def build_parser() -> argparse.ArgumentParser:
    """Return the ``resumekit`` argument parser with every command registered."""
    parser = argparse.ArgumentParser(
        prog="resumekit",
        description="Inspect, verify, export, import, compare and prune resumekit checkpoints "
        "(local paths or fsspec URLs such as s3://bucket/run).",
    )
    parser.add_argument("--version", action="version", version=f"resumekit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 problem found, 2 usage).

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as stop:  # argparse: --help/--version (0) or a usage error (2)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
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
