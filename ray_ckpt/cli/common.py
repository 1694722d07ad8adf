"""What every command shares: exit codes, the one-line failure, and plain-text output that is safe
to print (sizes, times, tables, lists; no terminal control characters from storage ever reach the
terminal)."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from typing import Any, Callable, List, Optional, Sequence

from ..client.progress import human  # noqa: F401  (the commands import it from here)

PROG = "ray-ckpt"
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A failure reported as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


class UsageError(CliError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


# ---------------------------------------------------------------- safe text
def _escape(ch: str) -> str:
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def printable(text: Any) -> str:
    """``text`` with every non-printable character (escape codes, newlines, tabs, ...) written as a
    visible escape (``\\x1b``): names, paths and messages read from storage cannot drive the terminal."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in s)


def say(line: Any = "") -> None:
    """Print one line of human-readable output (escaped: see ``printable``)."""
    print(printable(line))


def warn(line: Any) -> None:
    print(printable(line), file=sys.stderr)


def print_json(doc: Any) -> None:
    """Machine-readable output; ``json`` escapes every control character itself."""
    print(json.dumps(doc, indent=1, sort_keys=True))


# ---------------------------------------------------------------- formatting
def iso_time(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return "-"


def table(rows: List[List[Any]], header: List[str]) -> List[str]:
    """The lines of a left-aligned table, every cell escaped (see ``printable``)."""
    cells = [[printable(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def vlist(vs: Sequence[Any], limit: int = 12) -> str:
    vs = list(vs)
    if len(vs) > limit:
        return ", ".join(map(str, vs[: limit // 2])) + ", ..., " + ", ".join(map(str, vs[-limit // 2:]))
    return ", ".join(map(str, vs))


def rank_order(ranks: Any) -> List[Any]:
    """A state's rank keys in numeric order."""
    return sorted(ranks, key=lambda r: int(r) if str(r).isdigit() else 0)


# ---------------------------------------------------------------- argument types
def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, else 'expected <what>, got ...'."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "an integer >= 0")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
