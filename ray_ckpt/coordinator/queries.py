"""What the coordinator answers without changing anything: versions, manifests, one stored
state's entry, status. A plain object over the coordinator's catalogue, upload plan and writer
pools, so the answers are computed the same way whoever asks and are testable without Ray.

The actor runs these calls in their own concurrency group ("queries": their own thread and event
loop), so that they answer within milliseconds while thousands of ranks' submit() calls queue on
the main loop. They only read, and copy a dict (one C-level step under the GIL) before
iterating it in Python, since the main loop may change it meanwhile.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional

from .catalogue import Catalogue, meta_of
from ..formats.manifest import Manifest
from ..protocol import CoordinatorStatus, StoredState, VersionStatus
from .upload_plan import UploadPlan
from ..writers.pools import WriterPools


class CoordinatorQueries:
    """Read-only answers about a run's versions (both tiers) and its coordinator's state."""

    def __init__(self, run: str, catalogue: Catalogue, uploads: UploadPlan, skipped: Dict[int, str],
                 pools: WriterPools):
        self.run, self.catalogue, self.uploads, self.skipped, self.pools = run, catalogue, uploads, skipped, pools
        self.replication: Any = None  # replication.Replication, set by the actor (peer copies in list/status)
        self.evacuation: Any = None  # evacuation.Evacuation, set by the actor (the preemption notice in status)

    def last_version(self) -> int:
        return max([self.catalogue.last_version] + list(self.uploads.committed))

    def _unjudged(self) -> Dict[int, str]:
        """Versions whose only copy was on a node Ray now lists dead, not judged yet (replication.py)."""
        return self.replication.unjudged_losses() if self.replication is not None else {}

    def _restorable(self) -> Dict[int, Manifest]:
        """Every listed version's manifest (the local tier's where both tiers hold it)."""
        allv = {**self.uploads.committed, **self.catalogue.committed}
        for v in self._unjudged():
            allv.pop(v, None)
        return allv

    def list(self) -> list:
        local, remote = dict(self.catalogue.committed), dict(self.uploads.committed)
        unjudged = self._unjudged()
        out = []
        for v in sorted((set(local) | set(remote)) - set(unjudged)):
            tiers = tuple(t for t, d in (("local", local), ("remote", remote)) if v in d)
            if self.replication is not None and self.replication.enabled and self.replication.fully_replicated(v):
                tiers = tiers[:1] + ("peer",) + tiers[1:] if "local" in tiers else ("peer",) + tiers
            out.append(meta_of(local.get(v) or remote[v], tiers))
        return out

    def manifest(self, version: int = -1, step: Optional[int] = None) -> Optional[Manifest]:
        """The manifest of ``version`` (-1: latest committed), or of the version at ``step``."""
        allv = self._restorable()
        if step is not None:
            allv = {v: m for v, m in allv.items() if m.step == step}
            return allv[max(allv)] if allv else None
        if version == -1:
            return allv[max(allv)] if allv else None
        return allv.get(version)

    def stored_state(self, name: str, version: int = -1, step: Optional[int] = None) -> Optional[StoredState]:
        """State ``name`` of ``version`` (or of the version at ``step``) without the other states'
        entries (see :class:`StoredState`); None when no such version is committed."""
        m = self.manifest(version, step)
        if m is None:
            return None
        return StoredState(m.version, m.step, tuple(sorted(m.states)), m.states.get(name))

    def manifests(self) -> List[Manifest]:
        """Every listed manifest, newest first (a restore that falls back walks them)."""
        allv = self._restorable()
        return [allv[v] for v in sorted(allv, reverse=True)]

    def skipped_versions(self) -> Dict[int, str]:
        """Versions not listed (and not committed on another tier): why. Found in storage but not
        trusted, lost with a node, or (not judged yet) depending on a node Ray lists dead."""
        out = {v: why for v, why in self.skipped.items()
               if v not in self.catalogue.committed and v not in self.uploads.committed}
        return {**out, **self._unjudged()}

    def status(self, *, commits: int, failures: int, last_error: Optional[str], started_at: float,
               node: str) -> CoordinatorStatus:
        for attempt in range(5):  # a driver's save merging parts into a version meanwhile: read again
            try:
                return self._status(commits, failures, last_error, started_at, node)
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == 4:
                    raise
                time.sleep(0.01)

    def _status(self, commits: int, failures: int, last_error: Optional[str], started_at: float,
                node: str) -> CoordinatorStatus:
        in_flight = {v: pv.status() for v, pv in list(self.catalogue.pending.items())}
        for v in list(self.uploads.uploading):
            upload = self.uploads.upload_state(v)
            in_flight[v] = dataclasses.replace(in_flight[v], upload=upload) if v in in_flight else \
                VersionStatus(v, None, "committed", upload=upload)
        return CoordinatorStatus(
            run=self.run, in_flight=tuple(in_flight[v] for v in sorted(in_flight)),
            queued_bytes_critical=self.pools.queued_bytes(self.pools.critical),
            queued_bytes_best_effort=self.pools.queued_bytes(self.pools.best_effort),
            committed=len(self.catalogue.committed), remote_committed=len(self.uploads.committed),
            commits=commits, failures=failures, last_error=last_error,
            started_at=started_at, node=node,
            writer_nodes={n[:12]: len(p) for n, p in self.pools.critical_by_node.items()},
            unplaced_writers={n[:12]: why for n, why in self.pools.unplaced.items()},
            upload_owed=self.uploads.owed, skipped_versions=self.skipped_versions(),
            replicas=self.replication.replicas() if self.replication is not None else {},
            replica_problems=dict(self.replication.short) if self.replication is not None else {},
            preemption=self.evacuation.status() if self.evacuation is not None else None)
