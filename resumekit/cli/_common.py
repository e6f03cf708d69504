"""Shared pieces of the command line: options, output, progress, JSON helpers."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from resumekit.errors import ConfigurationError
from resumekit.store import tree as _tree
from resumekit.store.layout import NameFormat

__all__ = [
    "JSON_SCHEMA_PREFIX",
    "STATUS_STYLES",
    "UsageError",
    "add_common_options",
    "console",
    "emit_json",
    "error_line",
    "fail",
    "flatten",
    "format_bytes",
    "format_seconds",
    "format_time",
    "or_dash",
    "parse_storage_option",
    "plain",
    "progress_bar",
    "running_progress",
    "status_text",
    "storage_options",
    "table",
]

JSON_SCHEMA_PREFIX = "resumekit"
"""``schema`` of every JSON document is ``resumekit.<command>/<version>``."""

STATUS_STYLES = {
    "committed": "green",
    "partial": "yellow",
    "corrupt": "bold red",
    "legacy": "cyan",
    "foreign": "magenta",
}

_PIPE_WIDTH = 160


class UsageError(ConfigurationError):
    """Arguments that cannot work together; the command line exits with status 2."""


def _name_format(value: str) -> str:
    try:
        NameFormat(value)
    except ConfigurationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def parse_storage_option(text: str) -> tuple[str, Any]:
    """Parse ``KEY=VALUE``; VALUE is JSON when it parses as JSON (``true``, ``3``), else text.

    Raises:
        argparse.ArgumentTypeError: No ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"--storage-option expects KEY=VALUE (e.g. endpoint_url=http://host:9000), "
            f"got {text!r}"
        )
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def storage_options(pairs: list[tuple[str, Any]] | None) -> dict[str, Any]:
    """Build fsspec options from ``KEY=VALUE`` pairs; dotted keys nest (``a.b=1``)."""
    options: dict[str, Any] = {}
    for key, value in pairs or []:
        node = options
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigurationError(
                    f"--storage-option {key}: {part!r} is already a value, not a group",
                    name="storage_option", value=key,
                )
            node = child
        node[parts[-1]] = value
    return options


def add_common_options(parser: argparse.ArgumentParser, *, json_help: str) -> None:
    """Add the options every command takes."""
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument(
        "--storage-option", dest="storage_option", metavar="KEY=VALUE", action="append",
        type=parse_storage_option, default=[],
        help="fsspec option for remote roots (repeatable), e.g. "
        "endpoint_url=http://127.0.0.1:9000; dotted keys nest "
        "(client_kwargs.region_name=us-east-1); values parse as JSON when they can",
    )
    parser.add_argument(
        "--name-format", dest="name_format", metavar="TEMPLATE", type=_name_format,
        default=None,
        help="step directory name template (default: detect step_{step:09d} or "
        "checkpoint_step_{step})",
    )
    parser.add_argument("--no-progress", action="store_true",
                        help="never draw a progress bar (it is drawn only on a TTY)")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors")


def console(stream: IO[str] | None = None) -> Console:
    """A rich console on stdout: colour only on a TTY, no markup, wide when piped."""
    file = stream if stream is not None else sys.stdout
    tty = bool(getattr(file, "isatty", lambda: False)())
    return Console(file=file, markup=False, highlight=False, soft_wrap=True,
                   width=None if tty else _PIPE_WIDTH, emoji=False)


def table(*columns: str, title: str | None = None) -> Table:
    """A plain table in the CLI's style."""
    result = Table(*columns, title=title, box=box.SIMPLE, title_justify="left",
                   pad_edge=False, show_edge=False)
    return result


def status_text(status: str) -> Text:
    """A checkpoint status, coloured (colour shows only on a TTY)."""
    return Text(status, style=STATUS_STYLES.get(status, ""))


def error_line(message: str) -> str:
    """The one-line form of an error message (``resumekit: error: ...``)."""
    return "resumekit: error: " + " ".join(str(message).split())


def fail(message: str) -> int:
    """Print a one-line error to stderr and return exit status 1 (a problem found)."""
    print(error_line(message), file=sys.stderr)
    return 1


def emit_json(document: Mapping[str, Any], stream: IO[str] | None = None) -> None:
    """Write one JSON document (and a newline) to stdout."""
    file = stream if stream is not None else sys.stdout
    file.write(json.dumps(document, indent=2, allow_nan=False, default=str) + "\n")
    file.flush()


@contextmanager
def progress_bar(
    total: int, description: str, *, enabled: bool
) -> Iterator[Callable[[int], None]]:
    """Yield a callback advancing a byte progress bar on stderr (a no-op when disabled).

    The bar is drawn only when ``enabled`` and stderr is a terminal, so piped and
    ``--json`` output never carries control characters.
    """
    show = enabled and sys.stderr.isatty()
    if not show:
        yield lambda _count: None
        return
    from tqdm import tqdm  # noqa: PLC0415 - only needed on a terminal

    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield bar.update


@contextmanager
def running_progress(description: str, *, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """Yield a ``callback(done, total)`` drawing a byte progress bar on a TTY stderr.

    The bar is created on the first call, when the total is known.
    """
    if not (enabled and sys.stderr.isatty()):
        yield lambda _done, _total: None
        return
    from tqdm import tqdm  # noqa: PLC0415 - only needed on a terminal

    bars: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc=description, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, leave=False,
                             dynamic_ncols=True))
        bars[0].update(done - bars[0].n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()


def format_bytes(count: int | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; None -> ``'-'``."""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"  # pragma: no cover - the loop always returns


def format_seconds(seconds: float | None) -> str:
    """``3725.0`` -> ``'1:02:05'``; None -> ``'-'``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    sign = "-" if seconds < 0 else ""
    total = round(abs(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{sign}{hours}:{minutes:02d}:{secs:02d}"


def format_time(moment: datetime | None) -> str:
    """A UTC timestamp to the second, or ``'-'``."""
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S")


def or_dash(value: object) -> str:
    """``str(value)``, or ``'-'`` for None."""
    return "-" if value is None else str(value)


def plain(value: Any, *, depth: int = 0) -> Any:  # noqa: PLR0911 - one return per kind
    """Turn loaded checkpoint data into JSON-able values; tensors become short summaries."""
    if depth > 12:
        return "..."
    # torch is not imported for commands that read only the store: a value can only be a
    # tensor when torch was imported to load it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            return value.item()
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping):
        return {str(key): plain(item, depth=depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > 16 and all(isinstance(item, (int, float)) for item in value):
            return f"<{len(value)} numbers>"
        return [plain(item, depth=depth + 1) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """Flatten nested dicts and lists to dotted keys (leaves: tensors, scalars, None).

    Every list is expanded (``resumekit diff`` names the element that differs) and empty
    containers stay as leaves (``{}`` differs from a missing key).
    """
    return _tree.flatten(value, prefix, keep_empty=True)
