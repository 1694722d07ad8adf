"""The run's head record: the newest step committed on a tier, so that a rollback is seen.

Versions deleted behind the engine's back (an operator's ``rm``, a bucket restored from an older
snapshot, a lifecycle rule) leave a run that looks whole, only older: its manifests still chain.
``<run>/head.json`` on each tier names the newest step committed there (HMAC-signed when the run
signs its manifests). The coordinator raises it after each commit on that tier and lowers it only
for ``rewind``; a recovery that finds no version as new as the head reports the head's step as
missing, and no step up to it is saved again (its number would name two different versions).
Deleting the head record along with the versions hides a rollback: only a record kept outside the
run's storage could see that. Plain Python over a Tier: no Ray.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import IntegrityError, one_line
from ..formats.manifest import sign_record, verify_signature
from .layout import HEAD_FILE
from .tier import Tier

log = logging.getLogger("ray_ckpt.coordinator")
HEAD_FORMAT = "ray_ckpt.head/1"


def head_bytes(run: str, step: int, key: Any = None) -> bytes:
    record = {"format": HEAD_FORMAT, "run": run, "step": step}
    return json.dumps(sign_record(record, key) if key else record, sort_keys=True).encode()


def parse_head(data: bytes, run: str, key: Any = None, where: str = HEAD_FILE) -> int:
    """The step a head record names. IntegrityError naming ``where``: unreadable, another run's,
    or (with ``key``) unsigned or mis-signed."""
    if key:
        verify_signature(data, key, where=where)
    try:
        d = json.loads(bytes(data))
        ok = isinstance(d, dict) and d.get("format") == HEAD_FORMAT and isinstance(d.get("step"), int) \
            and not isinstance(d["step"], bool) and d["step"] >= 0
    except ValueError:
        ok = False
    if not ok:
        raise IntegrityError(f"{where}: not a {HEAD_FORMAT} record")
    if d.get("run") != run:
        raise IntegrityError(f"{where}: the head record of run {d.get('run')!r}, not of {run!r}")
    return d["step"]


def read_heads(tiers: Sequence[Tier], run: str, key: Any = None) -> Tuple[Dict[str, int], List[str]]:
    """Each tier's head step (tiers without a record left out) and the problems met (a record that
    does not verify is not trusted, so it neither raises an alarm nor blocks a step)."""
    heads: Dict[str, int] = {}
    problems: List[str] = []
    for tier in tiers:
        where = f"{tier.display}/{HEAD_FILE}"
        try:
            if tier.exists(HEAD_FILE):
                heads[tier.name] = parse_head(bytes(tier.read_bytes(HEAD_FILE)), run, key, where)
        except IntegrityError as exc:
            problems.append(str(exc))
        except Exception as exc:  # e.g. the remote tier is down at a restart: the other tier decides
            problems.append(f"cannot read {tier.scrub(where)}: {tier.scrub(one_line(exc))}")
    return heads, problems


class HeadRecords:
    """The coordinator's side: the head step it last wrote per tier, and the writes (from
    ``asyncio.to_thread``, so a lock keeps two commits' writes in step order)."""

    def __init__(self, run: str, found: Dict[str, int]):
        self.run = run
        self.steps: Dict[str, int] = dict(found)
        self._lock = threading.Lock()

    def raise_to(self, tier: Tier, step: int, key: Any = None, still: Callable[[], bool] = lambda: True) -> None:
        """Name ``step`` if it is newer than the head, and ``still()`` holds under the lock (the
        version is still committed: a ``rewind`` may have deleted it since)."""
        with self._lock:
            if step > self.steps.get(tier.name, -1) and still():
                tier.put_bytes(HEAD_FILE, head_bytes(self.run, step, key))
                self.steps[tier.name] = step

    def set_to(self, tier: Tier, step: int, key: Any = None) -> None:
        """After ``rewind``: the head goes down to the version training goes on from."""
        with self._lock:
            tier.put_bytes(HEAD_FILE, head_bytes(self.run, step, key))
            self.steps[tier.name] = step


def missing_head(heads: Dict[str, int], newest: Optional[int]) -> Optional[Tuple[int, str]]:
    """``(step, why)`` when a tier's head names a step newer than every version found, else None."""
    if not heads:
        return None
    tier, step = max(heads.items(), key=lambda kv: kv[1])
    if newest is not None and step <= newest:
        return None
    found = f"the newest version found is {newest}" if newest is not None else "no version was found"
    return step, (f"committed before (the {tier} tier's head record names step {step}) and now missing: "
                  f"deleted or lost behind the engine's back; {found}, and no step up to {step} is saved again")
