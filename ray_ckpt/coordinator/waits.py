"""Answering ``wait()``: a version's outcome once it is committed on a tier.

Every handle's wait ends here (a driver's save, a rank's push: one call per version and process).
A version in flight is answered from its commit future (and the uploader's, for the remote tier); an
older one, or one committed before a restart, from the catalogue and the upload plan; a failed one
with its error. Kept apart from the actor because which source answers which version is a rule of
its own, read in one place; the futures it awaits are the coordinator's (shared dicts, not copies).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Dict, Optional

from .catalogue import Catalogue
from ..errors import SaveError
from ..formats.manifest import Manifest
from ..protocol import SaveOutcome
from ..storage.tier import Tier
from .upload_plan import UploadPlan
from .uploader import Uploader

UNKNOWN_WAIT_S = 30.0  # how long an unknown version is waited for (the save() call may come after)


def outcome_of(m: Manifest, durability: str, bytes_written: Optional[int] = None, **extra: Any) -> SaveOutcome:
    """A committed manifest as the outcome a handle returns."""
    missing = tuple(sorted(n for n, e in m.states.items() if e.status == "missing"))
    pending = tuple(sorted(n for n, e in m.states.items() if e.status == "pending"))
    return SaveOutcome(m.version, m.step, durability, m.bytes if bytes_written is None else bytes_written,
                       tuple(sorted(m.states)), missing=missing, pending=pending, **extra)


class VersionWaits:
    """The coordinator's ``wait()``: from the futures of versions in flight, or from what is committed."""

    def __init__(self, run: str, remote: Optional[Tier], rank_timeout_s: float, catalogue: Catalogue,
                 uploads: UploadPlan, uploader: Uploader, commit_futures: Dict[int, asyncio.Future],
                 settled_futures: Dict[int, asyncio.Future], replication: Any = None):
        self.run, self.remote, self.rank_timeout_s = run, remote, rank_timeout_s
        self.catalogue, self.uploads, self.uploader = catalogue, uploads, uploader
        self.commit_futures, self.settled_futures = commit_futures, settled_futures
        self.replication = replication  # replication.Replication: the "replicated" outcomes

    async def wait(self, version: int, durability: str = "local", best_effort: bool = False,
                   pushed: bool = False) -> SaveOutcome:
        """See ``CheckpointCoordinator.wait``. ``version`` is a save's, so its step names it in errors."""
        if durability not in ("local", "remote", "replicated"):
            raise SaveError(f"durability must be 'local', 'replicated' or 'remote', got {durability!r}")
        if durability == "replicated":
            return await self._wait_replicated(version, best_effort, pushed)
        if best_effort:
            return await self._wait_settled(version, durability)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (max(UNKNOWN_WAIT_S, self.rank_timeout_s) if pushed else UNKNOWN_WAIT_S)
        # an async actor may run this call before the save() submitted just before it: wait a little
        while (version not in self.commit_futures and version not in self.catalogue.committed
               and version not in self.uploads.committed and version not in self.catalogue.failed
               and loop.time() < deadline):
            await asyncio.sleep(0.02)
        if version in self.commit_futures:
            outcome = await self.commit_futures[version]
            if durability == "local":
                return outcome
            if self.remote is None:
                raise SaveError(f"run {self.run!r} has no remote tier (remote_uri was not given)")
            return await self.uploader.future(version)
        if version in self.catalogue.failed:
            raise SaveError(f"step {version} of run {self.run!r} failed: {self.catalogue.failed[version]}")
        if version in self.catalogue.committed and durability == "local":
            return outcome_of(self.catalogue.committed[version], "local")
        if version in self.uploads.committed:
            return outcome_of(self.uploads.committed[version], durability)
        if version in self.uploader.futures and version in self.catalogue.committed:  # resumed upload
            return await self.uploader.futures[version]
        raise SaveError(f"step {version} is unknown to the coordinator of run {self.run!r} "
                        f"(it may have restarted while the save was in flight)")

    async def _wait_replicated(self, version: int, best_effort: bool, pushed: bool) -> SaveOutcome:
        """Committed locally, and every critical file held by the run's peer replicas."""
        if self.replication is None or not self.replication.enabled:
            raise SaveError(f"run {self.run!r} keeps no peer replicas: create it with peer_replicas=1 (or more) "
                            f"to wait for durability='replicated'")
        outcome = await self.wait(version, "local", best_effort, pushed)
        fut = self.replication.futures.get(version)  # made at the commit, before the local outcome resolved
        if fut is None and not self.replication.fully_replicated(version):
            raise SaveError(f"step {version} of run {self.run!r} has no peer replicas: it was committed before the "
                            f"coordinator (re)started, or is older than the newest peer_keep="
                            f"{self.replication.cfg.peer_keep} versions the holders keep")
        if fut is not None:
            await fut
        return dataclasses.replace(outcome, durability="replicated")

    async def _wait_settled(self, version: int, durability: str) -> SaveOutcome:
        await self.wait(version, "local")
        settled = self.settled_futures.get(version)
        if settled is not None:
            await settled
        if durability == "local":
            m = self.catalogue.committed.get(version)
            outcome = await self.wait(version, "local")
            return outcome if m is None else outcome_of(m, "local", outcome.bytes_written,
                                                        seconds=outcome.seconds, stages=outcome.stages)
        # a manifest updated by late best-effort parts is uploaded again: wait for that copy
        while self.uploads.needs_resync(version, self.catalogue.committed.get(version)):
            await asyncio.sleep(0.05)
        return await self.wait(version, "remote")
