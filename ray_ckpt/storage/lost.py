"""The record of versions lost with a node, so that no later reader lists them again.

A version committed on a node's local disk only (not uploaded, no live peer replica) is lost when
that node dies; the coordinator stops listing it at once (``coordinator/replication.py``). Its
manifest may still lie on another node's disk (the head's, when the coordinator wrote it there), and
a scan of storage alone would find it committed: a restarted coordinator, ``ray-ckpt ls``. This
record (``lost_versions.json`` at the run's root on the local tier) says which manifests are lost
and why. Each entry names the manifest's ``created_at`` too, so a version number written again
later (after a rewind) is not hidden by an older loss.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Dict, Mapping

from ..errors import IntegrityError, one_line
from ..formats.manifest import Manifest
from .layout import LOST_FILE
from .tier import Tier

log = logging.getLogger("ray_ckpt.storage")
FORMAT = "ray_ckpt.lost/1"


@dataclass(frozen=True)
class LostVersion:
    """Why a version is lost (``why``), and which manifest of that number (``created_at``)."""

    why: str
    created_at: float

    def matches(self, m: Manifest) -> bool:
        return float(m.created_at) == self.created_at


def read_lost(tier: Tier) -> Dict[int, LostVersion]:
    """The versions recorded lost on ``tier`` (empty when there is no record; an unreadable record
    is logged and ignored: it can only hide versions, never bring bytes in)."""
    try:
        if not tier.exists(LOST_FILE):
            return {}
        doc = json.loads(bytes(tier.read_bytes(LOST_FILE)))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("versions"), dict):
            raise ValueError(f"not a {FORMAT} record")
        return {int(v): LostVersion(str(e["why"]), float(e["created_at"])) for v, e in doc["versions"].items()}
    except (IntegrityError, ValueError, OSError, KeyError, TypeError) as exc:
        log.error("ignoring %s: %s", tier.describe(LOST_FILE), one_line(exc))
        return {}


def record_lost(tier: Tier, lost: Mapping[int, LostVersion]) -> None:
    """Add ``lost`` to the record on ``tier`` (written atomically; earlier entries kept)."""
    if not lost:
        return
    merged = {**read_lost(tier), **lost}
    doc = {"format": FORMAT, "versions": {str(v): {"why": e.why, "created_at": e.created_at}
                                          for v, e in sorted(merged.items())}}
    tier.put_bytes(LOST_FILE, json.dumps(doc, indent=1).encode())


def hide_lost(committed: Dict[int, Manifest], lost: Mapping[int, LostVersion]) -> Dict[int, str]:
    """Take the lost manifests out of ``committed`` (in place); version -> why, for those taken."""
    hidden = {}
    for v, e in lost.items():
        m = committed.get(v)
        if m is not None and e.matches(m):
            del committed[v]
            hidden[v] = e.why
    return hidden
