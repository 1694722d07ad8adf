"""One owner per run: an owner record with a fencing token on the run's tiers.

Two drivers saving into one run (a job relaunched while the old one still runs, on another Ray
cluster or the same one) would overwrite each other's acknowledged versions. So a run has an
owner — a Ray *job* (cluster + job id), not an engine object — recorded in ``<run>/owner.json`` on
each tier, with a lease the owning driver renews and a token that only grows:

- ``create()`` from the owning job, from a job whose lease expired (the driver is gone) or on a run
  without a record proceeds (a new or the same token); from any other job it is refused with an
  :class:`~ray_ckpt.errors.OwnershipError` naming the owner, unless ``takeover=True``, which writes
  a record with the next token.
- The coordinator fences every commit: before it writes a manifest it reads the record, and a
  token newer than its own means the run was taken over: the version fails, never committed.
  Saves sent with an older token (the old job's engine on the same cluster) are refused at the call.

Guarantees: on a local or network filesystem the record is replaced atomically (rename); the check
before a manifest write and the write are two steps, so a takeover landing between them lets one
last version of the old owner commit (it is older than every version of the new one). Object stores
reached through ``pyarrow.fs`` offer no conditional PUT, so on S3 the record is read-check-write:
two ``takeover=True`` calls in the same instant can both succeed; the later record wins and the
other driver's next commit fails. This module is plain Python: no Ray, no storage I/O of its own.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from ..errors import IntegrityError, OwnershipError
from .layout import OWNER_FILE

DEFAULT_LEASE_S = 60.0


@dataclass(frozen=True)
class OwnerRecord:
    cluster: str         # the Ray cluster's id (GCS address where the id is not available)
    job: str             # the Ray job id of the owning driver
    token: int           # fencing token: grows by one at every change of owner
    host: str
    pid: int
    since: float         # when this owner took the run
    renewed: float       # the owner's last lease renewal (unix seconds)
    lease_s: float = DEFAULT_LEASE_S

    def same_job(self, cluster: str, job: str) -> bool:
        return self.cluster == cluster and self.job == job

    def expired(self, now: float) -> bool:
        return now - self.renewed > self.lease_s

    def describe(self, now: Optional[float] = None) -> str:
        now = time.time() if now is None else now
        return (f"job {self.job} of Ray cluster {self.cluster[:16]} on host {self.host} (pid {self.pid}), owner "
                f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}, lease renewed "
                f"{max(0.0, now - self.renewed):.0f}s ago, token {self.token}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = OWNER_FILE) -> "OwnerRecord":
        try:
            d = json.loads(bytes(data))
            rec = cls(str(d["cluster"]), str(d["job"]), int(d["token"]), str(d["host"]), int(d["pid"]),
                      float(d["since"]), float(d["renewed"]), float(d.get("lease_s", DEFAULT_LEASE_S)))
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{where}: unreadable owner record ({exc})") from None
        if rec.token < 1:
            raise IntegrityError(f"{where}: owner token must be >= 1, got {rec.token}")
        return rec


def claim(current: Optional[OwnerRecord], cluster: str, job: str, *, takeover: bool, run: str,
          lease_s: float = DEFAULT_LEASE_S, now: Optional[float] = None,
          job_alive: Optional[Callable[[str], Optional[bool]]] = None) -> OwnerRecord:
    """The record ``create()`` writes for job ``job`` of ``cluster``, or OwnershipError.

    ``job_alive(job)``: whether a job of *this* cluster still runs (None: unknown); it lets a
    driver restarted on the same cluster go on at once when its predecessor's job is dead."""
    now = time.time() if now is None else now
    mine = OwnerRecord(cluster, job, 1, socket.gethostname(), os.getpid(), now, now, lease_s)
    if current is None:
        return mine
    if current.same_job(cluster, job):
        return replace(current, host=mine.host, pid=mine.pid, renewed=now, lease_s=lease_s)
    gone = current.expired(now) or (current.cluster == cluster and job_alive is not None
                                    and job_alive(current.job) is False)
    if takeover or gone:
        return replace(mine, token=current.token + 1)
    raise OwnershipError(
        f"run {run!r} is owned by {current.describe(now)}; a second driver would overwrite its checkpoints. "
        f"Stop that job (its lease expires {current.lease_s:.0f}s after its last renewal), or take the run over "
        f"with CheckpointEngine.create(..., takeover=True): its later saves then fail instead of committing")


def fence_error(record: Optional[OwnerRecord], token: Optional[int], run: str) -> Optional[str]:
    """Why a commit by the holder of ``token`` must not happen now (None: it may)."""
    if record is None or token is None or record.token <= token:
        return None
    return (f"run {run!r} was taken over by {record.describe()}; this driver's token {token} is stale, so its "
            f"saves no longer commit")
