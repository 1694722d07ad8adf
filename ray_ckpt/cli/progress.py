"""Progress of long CLI work on stderr: ``verify: 1.2 GiB / 3.4 GiB (35%), 180 MiB/s, 12s left``.

Rewritten in place on a terminal (at most five times a second), one line per tenth otherwise, so a
CI log or ``2>file`` gets ten readable lines, not thousands of carriage returns. Hand-made on
purpose: the CLI starts without Ray or torch in a few hundred milliseconds and has no dependency
for this (tqdm is not among ours, and writes carriage returns to logs too). One shape for every
command: ``--progress`` / ``--no-progress``, on by itself past a threshold the command chooses.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from .common import human

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


def _count(n: float) -> str:
    return f"{n:.0f}" if n >= 10 or n == int(n) else f"{n:.1f}"


class Progress:
    """``add(n)`` as work is done (thread-safe: verify hashes blocks on several threads);
    ``finish()`` ends the line. ``unit``: ``"bytes"`` (shown as KiB/MiB/...) or a plural noun
    (``"versions"``) for counted items."""

    def __init__(self, total: int, enabled: bool, label: str, unit: str = "bytes"):
        self.total, self.enabled, self.label, self.unit = total, enabled and total > 0, label, unit
        self.done = 0
        self.tty = sys.stderr.isatty()
        self._last_t = 0.0
        self._last_decile = -1
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def _amount(self, n: float) -> str:
        return human(int(n)) if self.unit == "bytes" else _count(n)

    def _rate_eta(self) -> str:
        """', 180 MiB/s, 12s left' once a rate can be told (after a quarter of a second)."""
        elapsed = time.monotonic() - self._t0
        if elapsed < 0.25 or not self.done:
            return ""
        rate = self.done / elapsed
        left = max(0.0, (self.total - self.done) / rate)
        per = f"{self._amount(rate)}/s" if self.unit == "bytes" else f"{_count(rate)} {self.unit}/s"
        return f", {per}, {left:.0f}s left"

    def line(self) -> str:
        pct = int(100 * self.done / self.total) if self.total else 100
        what = f"{self._amount(self.done)} / {self._amount(self.total)}"
        if self.unit != "bytes":
            what += f" {self.unit}"
        return f"{self.label}: {what} ({pct}%){self._rate_eta()}"

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if not self.enabled:
                return
            pct = int(100 * self.done / self.total) if self.total else 100
            if self.tty:
                now = time.monotonic()
                if now - self._last_t >= 0.2 or self.done >= self.total:
                    self._last_t = now
                    sys.stderr.write(f"\r{self.line()}   ")
                    sys.stderr.flush()
            elif pct // 10 > self._last_decile:
                self._last_decile = pct // 10
                sys.stderr.write(f"{self.line()}\n")
                sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
