"""Steps 3 to 5 of a version's life (see ``actor.py``): parts written, manifest, committed.

:class:`VersionCommits` keeps, per version in flight, the futures its handles await and the lock
that orders its commit, and carries out what the :class:`~ray_ckpt.coordinator.catalogue.Catalogue`
decides: the manifest is written to the local tier last and atomically (it is the commit marker),
best-effort parts that land later rewrite it, a failed version's files are removed before its
handle raises. Kept apart from the actor so that the commit rule's side effects read in one place;
it needs an event loop, not Ray.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, Optional, Set

from ..config import EngineConfig
from ..errors import SaveError, UnsupportedTypeError, one_line
from ..metrics import Metrics
from ..types import step_label
from ..storage.checkpoint_io import write_manifest
from ..storage.tier import Tier
from .catalogue import Catalogue
from .deletions import Deletions
from .pending import PendingVersion
from .rank_deadline import expire_missing
from .upload_plan import UploadPlan
from .uploader import Uploader, root_cause
from .waits import outcome_of

log = logging.getLogger("ray_ckpt.coordinator")


class VersionCommits:
    """The commit of each version in flight, and the bookkeeping its handles wait on.

    ``accepted_at`` and ``file_nodes`` are the coordinator's (shared with the uploader, not copies);
    ``fence(tier)`` says why not to commit (a run taken over), ``raise_head(tier, version)`` is the
    coroutine that moves the tier's head record, ``in_background(coro)`` runs one that quiesce()
    waits for, ``set_error(msg)`` is what status() reports."""

    def __init__(self, cfg: EngineConfig, local: Tier, catalogue: Catalogue, uploads: UploadPlan,
                 uploader: Uploader, deletions: Deletions, metrics: Metrics, node_id: str,
                 file_nodes: Dict[str, str], accepted_at: Dict[int, float], fence: Callable[[Tier], Optional[str]],
                 raise_head: Callable[[Tier, int], Any], in_background: Callable[[Any], Any],
                 set_error: Callable[[str], None], on_commit: Optional[Callable[[int], None]] = None):
        self.cfg, self.local, self.catalogue, self.uploads = cfg, local, catalogue, uploads
        self.uploader, self.deletions, self.metrics, self.node_id = uploader, deletions, metrics, node_id
        self.file_nodes, self.accepted_at, self._fence = file_nodes, accepted_at, fence
        self._raise_head, self._in_background, self._set_error = raise_head, in_background, set_error
        self._on_commit = on_commit  # the peer replicas' send (replication.py)
        self.commit_futures: Dict[int, asyncio.Future] = {}
        self.settled_futures: Dict[int, asyncio.Future] = {}  # every part, best-effort too, is done
        self.version_locks: Dict[int, asyncio.Lock] = {}
        self.manifest_revision: Dict[int, int] = {}  # version -> PendingVersion.revision its manifest shows
        self.unsupported: Set[int] = set()  # failed versions whose cause was an unsupported object
        self.commits = 0
        self.failures = 0
        self._sweeps: Set[asyncio.Future] = set()  # removals of killed writers' temporary files
        # versions a killed writer may have left temporary files in: a part failed, or was written
        # by a writer Ray restarted (its call retried). Only those are swept: one call less per save
        self._to_sweep: Set[int] = set()

    # ------------------------------------------------------------------ 1: opened
    def opened(self, version: int, upload: bool = False) -> None:
        """Bookkeeping for a version the catalogue just opened (``upload``: its upload turn)."""
        loop = asyncio.get_running_loop()
        self.uploads.opened(version, upload)
        self.commit_futures[version] = loop.create_future()
        self.settled_futures[version] = loop.create_future()
        self.version_locks[version] = asyncio.Lock()
        self.accepted_at[version] = time.perf_counter()
        self.metrics.set_in_flight(len(self.catalogue.pending))

    def watch_pushed(self, version: int) -> None:
        pv = self.catalogue.pending.get(version)
        if pv is not None and pv.missing_submits():
            asyncio.ensure_future(self._deadline(version))

    async def _deadline(self, version: int) -> None:
        """A rank that never submits fails its version loudly after rank_timeout_s (a best-effort
        part is reported missing instead); later versions are not blocked."""
        await asyncio.sleep(self.cfg.rank_timeout_s)
        expired = expire_missing(self.catalogue, version, self.cfg.rank_timeout_s)  # rank_deadline.py
        if expired is None:
            return
        what, fails = expired
        log.error("version %d: %s", version, what)
        if fails:
            self._set_error(f"step {version}: {what}")
        await self.progress(version)

    # ------------------------------------------------------------------ 3: written
    def record(self, version: int, name: str, rank: int, result: Any) -> None:
        """A part's WrittenPart, or the error that stopped it, into the catalogue."""
        if isinstance(result, BaseException) or result.after_restart:
            self._to_sweep.add(version)
        if not isinstance(result, BaseException):
            if not result.reused:
                for f in result.files:  # in the manifest too: a restarted coordinator reads it back
                    f.node = f.node or result.node or self.node_id  # an append base keeps its own writer's
                    self.file_nodes[f.path] = f.node
            self.catalogue.part_written(version, name, rank, result)
        else:  # reaches the handle through the commit future
            exc = result
            if isinstance(root_cause(exc), UnsupportedTypeError):
                self.unsupported.add(version)  # the handle raises the same class as an in-process save
            msg = one_line(getattr(exc, "cause", None) or exc)
            log.error("version %d: state %r rank %d failed: %s", version, name, rank, msg)
            self._set_error(f"step {version} state {name!r} rank {rank}: {msg}")
            self.catalogue.part_failed(version, name, rank, msg)

    # ------------------------------------------------------------------ 4-5: manifest, committed
    async def progress(self, version: int) -> None:
        """Commit, update, fail or finish ``version`` according to the catalogue."""
        pv = self.catalogue.pending.get(version)
        if pv is None:
            return
        fut = self.commit_futures[version]
        async with self.version_locks[version]:
            if version not in self.catalogue.pending:  # finished by a call that held the lock before us
                return
            if pv.error and not fut.done() and not self.catalogue.settled(version):
                self._fail_handle(version, pv, fut)  # parts still running: report now; their files go when they end
            elif not pv.committed and self.catalogue.ready_to_commit(version):
                await self._commit(version, pv, fut)
            await self._add_late_parts(version, pv)
            if not self.catalogue.settled(version):
                return
            self._finish(version, pv)
        if pv.error:  # never listed: remove what its parts wrote, then fail the handle (if not yet)
            try:
                await self.deletions.everywhere(version, self.catalogue.kept_paths(set()), [])
            finally:
                if not fut.done():
                    self._fail_handle(version, pv, fut)
        else:
            if self.uploads.needs_resync(version, self.catalogue.committed.get(version)):
                self.uploader.start(version)  # best-effort parts landed since
            await self.deletions.apply_retention()

    async def _commit(self, version: int, pv: PendingVersion, fut: asyncio.Future) -> None:
        revision = pv.revision
        manifest = self.catalogue.manifest_for(version)
        t_commit = time.perf_counter()
        taken_over = await asyncio.to_thread(self._fence, self.local)
        if taken_over:
            self.catalogue.fail(version, taken_over)
            return
        try:
            await asyncio.to_thread(write_manifest, self.local, manifest)
        except Exception as exc:  # reported once its files are removed
            self.catalogue.fail(version, f"writing the manifest failed: {one_line(exc)}")
            return
        self.catalogue.mark_committed(version, manifest)
        self.manifest_revision[version] = revision
        self.commits += 1
        written = self.catalogue.bytes_written(version)
        self.metrics.committed("local", time.perf_counter() - self.accepted_at.get(version, 0.0), written)
        fut.set_result(outcome_of(manifest, "local", written + len(manifest.to_json()),
                                  stages=dict(pv.stages(), manifest_s=time.perf_counter() - t_commit)))
        self.uploader.on_commit(version)
        if self._on_commit is not None:
            self._on_commit(version)
        # in the background: the version's bookkeeping (finish, retention) does not wait for it
        self._in_background(self._raise_head(self.local, version))

    async def _add_late_parts(self, version: int, pv: PendingVersion) -> None:
        """Best-effort parts that landed after the commit (or while its manifest was being written)
        join the manifest; loop, because another may land during the rewrite."""
        while pv.committed and version in self.catalogue.committed:
            if self.manifest_revision.get(version) == pv.revision:
                return  # no part ended since the manifest was written: nothing to add (O(1) per part)
            revision = pv.revision
            manifest = self.catalogue.manifest_for(version)
            if manifest.to_json() == self.catalogue.committed[version].to_json():
                self.manifest_revision[version] = revision
                return
            try:
                await asyncio.to_thread(write_manifest, self.local, manifest)
                self.catalogue.committed[version] = manifest
                self.manifest_revision[version] = revision
            except Exception as exc:  # the committed manifest stays; the late part is reported
                msg = f"step {version}: adding best-effort parts to the manifest failed: {one_line(exc)}"
                self._set_error(msg)
                log.error(msg)
                return

    def _finish(self, version: int, pv: PendingVersion) -> None:
        self.catalogue.finish(version)
        if not pv.error:
            self.unsupported.discard(version)
        if not pv.error and version in self._to_sweep:
            # garbage only: quiesce does not wait for it
            sweep = asyncio.ensure_future(self.deletions.sweep_temporaries(version))
            self._sweeps.add(sweep)
            sweep.add_done_callback(self._sweeps.discard)
        self._to_sweep.discard(version)
        settled = self.settled_futures.get(version)
        if settled is not None and not settled.done():
            settled.set_result(True)
        self.metrics.set_in_flight(len(self.catalogue.pending))
        self._prune_bookkeeping()

    def _fail_handle(self, version: int, pv: PendingVersion, fut: asyncio.Future) -> None:
        """Fail the save's handle with the version's error. A handle raising once every part has
        ended is raised after the failed version's files are removed: a user who looks at the disk
        then finds none of them."""
        self.uploads.missed(version)
        self.failures += 1
        self.metrics.failed("save")
        error = UnsupportedTypeError if version in self.unsupported else SaveError
        self.unsupported.discard(version)
        fut.set_exception(
            error(f"{step_label(pv.step, version)} of run {self.cfg.run!r} failed and is not listed: {pv.error}"))

    def _prune_bookkeeping(self, keep: int = 32) -> None:
        """Forget futures and locks of old, finished versions (wait() answers those from the catalogue)."""
        for v in sorted(self.commit_futures)[:-keep]:
            remote = self.uploader.futures.get(v)
            if v in self.catalogue.pending or v in self.uploads.uploading or (remote is not None and not remote.done()):
                continue
            for d in (self.commit_futures, self.version_locks, self.accepted_at, self.settled_futures,
                      self.manifest_revision):
                d.pop(v, None)
            self.uploader.forget(v)
            self.uploads.bytes.pop(v, None)
