"""``<run>/gc_notice.json``: how ``ray-ckpt gc --force`` tells a live engine which versions it is
about to delete, so that the engine's catalogue stops listing them before their files go.

gc writes the notice (merged with the one there) and waits ``NOTICE_WAIT_S`` before deleting; the
coordinator reads it every ``POLL_S`` on each of its tiers and forgets every listed version whose
manifest it holds is the one gc named (same step and creation time: a version number reused after
a rewind is a different version and stays). Plain Python, no Ray.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, Iterable, List, Tuple

from .layout import NOTICE_FILE

POLL_S = 2.0        # how often a live coordinator reads the notice
NOTICE_WAIT_S = 2 * POLL_S + 1.0  # how long gc --force waits between the notice and the first deletion
MAX_ENTRIES = 10_000  # the newest entries kept in the file

Removed = Tuple[int, int, float]  # (version, step, created_at)


def read_notice(tier: Any) -> List[Removed]:
    """The versions the notice on ``tier`` names ([] without one; a malformed file reads as [])."""
    if not tier.exists(NOTICE_FILE):
        return []
    try:
        doc = json.loads(bytes(tier.read_bytes(NOTICE_FILE)))
        return [(int(e["version"]), int(e["step"]), float(e["created_at"])) for e in doc["removed"]]
    except (ValueError, KeyError, TypeError):
        return []


def write_notice(tier: Any, removed: Iterable[Removed], now: float = None) -> None:
    """Add ``removed`` to the notice on ``tier`` (replaced atomically where the tier allows)."""
    now = time.time() if now is None else now
    entries: Dict[Tuple[int, int, float], Dict[str, Any]] = {}
    for v, step, created in read_notice(tier):
        entries[(v, step, created)] = {"version": v, "step": step, "created_at": created}
    for v, step, created in removed:
        entries[(v, step, created)] = {"version": v, "step": step, "created_at": created, "at": now}
    kept = list(entries.values())[-MAX_ENTRIES:]
    tier.put_bytes(NOTICE_FILE, json.dumps({"removed": kept}, sort_keys=True).encode())
