"""Progress of long work on stderr: ``verify: 1.2 GiB / 3.4 GiB (35%), 180 MiB/s, 12s left``.

Rewritten in place on a terminal (at most five times a second), one line per tenth otherwise, so a
CI log or ``2>file`` gets ten readable lines, not thousands of carriage returns. Used by the CLI
(verify, export, gc) and by ``SaveHandle.wait(durability="remote", progress=True)``. Hand-made on
purpose: the CLI starts without Ray or torch in a few hundred milliseconds and has no dependency
for this (tqdm is not among ours, and writes carriage returns to logs too).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional


def human(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        x /= 1024.0
        if x < 1024 or unit == "PiB":
            return f"{x:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


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
