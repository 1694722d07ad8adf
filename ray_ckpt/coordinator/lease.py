"""The owning driver's side of run ownership (see ``storage/ownership.py``): who this process is in Ray,
the owner record on the tiers, and the lease the driver renews while it lives."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from ..errors import IntegrityError, one_line
from ..ray_internals import cluster_id
from ..storage.ownership import OWNER_FILE, OwnerRecord
from ..storage.tier import Tier

log = logging.getLogger("ray_ckpt.lease")


def ray_identity() -> Tuple[str, str]:
    """(cluster, job) of this process: the job that owns what it creates."""
    import ray

    ctx = ray.get_runtime_context()
    # where Ray moved its cluster id, the GCS address tells clusters apart on one host too
    return cluster_id() or str(getattr(ctx, "gcs_address", "unknown")), ctx.get_job_id()


def read_owner(tiers: Sequence[Tier], quiet: bool = False) -> Optional[OwnerRecord]:
    """The newest owner record on any of ``tiers`` (the highest token), or None. ``quiet``: a tier
    that cannot be read is logged at debug level (the lease renewal, every few seconds)."""
    found: List[OwnerRecord] = []
    for tier in tiers:
        try:
            if tier.exists(OWNER_FILE):
                found.append(OwnerRecord.from_json(bytes(tier.read_bytes(OWNER_FILE)), f"{tier.display}/{OWNER_FILE}"))
        except IntegrityError as exc:
            log.warning("ignoring %s", exc)
        except Exception as exc:  # e.g. the remote tier is down: the others decide
            (log.debug if quiet else log.warning)("cannot read the owner record on the %s tier: %s", tier.name,
                                                  tier.scrub(one_line(exc)))
    return max(found, key=lambda r: (r.token, r.renewed), default=None)


def write_owner(tiers: Sequence[Tier], record: OwnerRecord) -> None:
    for tier in tiers:
        tier.put_bytes(OWNER_FILE, record.to_json())


def release(tiers: Sequence[Tier], record: OwnerRecord) -> None:
    """Remove the record if it is still this owner's (a clean shutdown frees the run at once)."""
    current = read_owner(tiers)
    if current is not None and current.token == record.token and current.same_job(record.cluster, record.job):
        for tier in tiers:
            try:
                tier.delete_file(OWNER_FILE)
            except Exception as exc:
                log.warning("cannot remove the owner record on the %s tier: %s", tier.name, one_line(exc))


class OwnerLease:
    """Renews the owner record every ``lease_s / 4`` seconds from a daemon thread while this driver
    lives; stops (and says so) once another job took the run over."""

    def __init__(self, tiers: Sequence[Tier], record: OwnerRecord, run: str):
        self.tiers = list(tiers)
        self.record = record
        self.run = run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ray_ckpt-lease-{run}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(self.record.lease_s / 4):
            current = read_owner(self.tiers, quiet=True)
            if current is not None and current.token > self.record.token:
                log.error("run %r was taken over by %s; this driver's saves no longer commit", self.run,
                          current.describe())
                return
            self.record = replace(self.record, renewed=time.time())
            try:
                write_owner(self.tiers, self.record)
                if failing:
                    log.warning("the lease of run %r is renewed again", self.run)
                failing = False
            except Exception as exc:  # a tier down for a moment: the next renewal tries again
                if not failing:  # once per outage, not every renewal
                    log.warning("cannot renew the lease of run %r (retrying every %.0fs): %s", self.run,
                                self.record.lease_s / 4, one_line(exc))
                failing = True

    def stop(self, release_record: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if release_record:
            try:
                release(self.tiers, self.record)
            except Exception as exc:
                log.warning("cannot release run %r: %s", self.run, one_line(exc))
