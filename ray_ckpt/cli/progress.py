"""One shape for every long CLI command: ``--progress`` / ``--no-progress``, on by itself past a
threshold the command chooses; the lines themselves are :class:`ray_ckpt.client.progress.Progress`'s."""
from __future__ import annotations

import argparse
from typing import Any

from ..client.progress import Progress  # noqa: F401  (the commands import it from here)

AUTO_BYTES = 256 << 20  # commands that move bytes show progress by themselves from this many on


def add_progress_flags(parser: Any, auto: str) -> None:
    """``--progress`` / ``--no-progress`` (dest ``progress``: True, False, or None = automatic)."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help=f"always show progress (rate, time left) on stderr (default: {auto})")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


def wanted(args: argparse.Namespace, automatic: bool) -> bool:
    flag = getattr(args, "progress", None)
    return automatic if flag is None else bool(flag)
