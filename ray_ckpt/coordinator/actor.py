"""The CheckpointCoordinator: a named, detached, restartable Ray actor.

A thin asyncio shell over plain objects — the :class:`~ray_ckpt.coordinator.catalogue.Catalogue` (versions,
parts, the commit rule, manifests, local retention), the :class:`~ray_ckpt.coordinator.upload_plan.UploadPlan`
(what is owed to the remote tier) and the :class:`~ray_ckpt.writers.pools.WriterPools` (``pools``) — that carries
out what they decide. It holds nothing that storage does not also hold: restarted, it rebuilds its
catalogue and upload plan from the manifests of both tiers.

A version's life, in call order:

1. **open** — ``save()`` (the driver's parts, refs still inside lists, never resolved here) or a
   rank's first pushed part (``submit_parts``: the parts one engine pushed for the version within a
   few ms, in one call): ``Catalogue.begin`` / ``accept_push``; ``UploadPlan.opened`` notes
   whether the engine counted it as an upload turn. A rank that never pushes fails the version
   after ``rank_timeout_s`` (``commits.py``, ``rank_deadline.py``).
2. **parts dispatched** — ``WriteDispatch`` (``write_dispatch.py``): snapshot refs go in batches to
   the writers of the node that holds them (critical) or of the best-effort pool.
3. **written** — ``VersionCommits.record`` (``commits.py``, with steps 4 and 5): the writer's
   :class:`~ray_ckpt.protocol.WrittenPart` (or its error) goes to ``Catalogue.part_written`` /
   ``part_failed``.
4. **manifest** — ``VersionCommits.progress``: once every critical part is written the manifest is
   written to the local tier, last and atomically: it is the commit marker.
5. **committed** — the version's commit future resolves with a :class:`~ray_ckpt.protocol.SaveOutcome`
   (the driver's ``save()`` call returns it; a rank's ``submit_parts()`` returned at once,
   and its handle learns of the commit through ``wait()``, one call per version per process, by ``waits.py``);
   best-effort parts that land later rewrite the manifest. A failed version's files are removed
   before its handle raises.
6. **uploaded** — ``Uploader`` (``uploader.py``): if the upload plan says it is this version's turn, writers copy its
   files (verified while streaming) and the remote manifest is written last.
7. **retained** — ``Deletions`` (``deletions.py``): the policies of each tier delete what they
   no longer keep (files another version refers to stay); ``rewind`` and a failed version's files
   go the same way.

Start-up (``recovery.py``) rebuilds the catalogue and upload plan from both tiers; the read-only
calls (``queries.py``) answer on their own thread; ``run_guards.py`` fences a run another job took
over and forgets the versions ``ray-ckpt gc --force`` deletes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import ray

from .commits import VersionCommits
from ..config import EngineConfig
from .live_options import applied, shown
from ..storage.head import HeadRecords
from .queries import CoordinatorQueries
from .deletions import Deletions
from ..errors import SaveError, one_line
from ..formats.manifest import Manifest
from .lease import ray_identity
from ..metrics import Metrics
from ..types import PreemptionNotice, step_label
from ..ray_internals import actor_ready
from ..protocol import (CoordinatorStatus, Declaration, PartPlan, PushedPart, SaveOutcome, StoredState, SubmitAck,
                        SubmitBatchResult)
from .recovery import DECLARED, DRIVER_STATES, recover
from .evacuation import Evacuation
from .recheck import recheck
from .replication import Replication
from .run_guards import GcNoticeWatch, OwnerFence
from .uploader import Uploader
from .write_dispatch import WriteDispatch
from .waits import VersionWaits, outcome_of
from ..capture.priority import lower_process_priority
from ..writers.pools import WriterPools

log = logging.getLogger("ray_ckpt.coordinator")
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval of the coordinator's process (see __init__)


class CheckpointCoordinator:
    def __init__(self, config: EngineConfig):
        # Every call crosses threads of this process (Ray's task thread, each concurrency group's
        # event loop) that take turns holding the GIL: at Python's default turn a query waits
        # behind thousands of pushes' turns; a shorter turn keeps list/status quick
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        lower_process_priority(config.critical_nice)  # below training, like the writers it feeds
        self.init_times = {"init": time.time()}  # wall clock of start-up steps (benchmarks/create_cost.py)
        self.cfg = config
        self.local = config.local_tier()
        self.remote = config.remote_tier()
        self.local.check_writable()  # the remote tier is checked by create(): it may be down at a restart
        # the writers' processes start while the tiers are scanned below (Ray starts them in the
        # background, in the idle processes create() prestarted for them, see client/run_lifetime.py;
        # engine.create() waits for them with ready()); owned by this actor, they go with it if
        # anything below raises
        self.pools = WriterPools(config)
        self.node_id = self.pools.node_id
        self.init_times["pools"] = time.time()
        found = recover(config, self.local, self.remote)  # recovery.py: both tiers' manifests, cleaned
        self.init_times["recovered"] = time.time()
        self.catalogue, self.uploads, self.skipped = found.catalogue, found.uploads, found.skipped
        self.heads = HeadRecords(config.run, found.heads)  # storage/head.py: a rollback is seen at the next start
        self.queries = CoordinatorQueries(config.run, self.catalogue, self.uploads, self.skipped, self.pools)
        self.file_nodes: Dict[str, str] = found.file_nodes  # local file path -> node whose local tier holds it
        self.accepted_at: Dict[int, float] = {}  # version -> when it opened (commit latency metrics)
        self.counts: Dict[str, int] = {"pushed_parts": 0, "submit_calls": 0}
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self.metrics = Metrics(config.run)
        for tier, found in (("local", self.catalogue.committed), ("remote", self.uploads.committed)):
            if found:  # a restarted coordinator: "no checkpoint in N minutes" alerts see the real age
                self.metrics.last_committed(tier, found[max(found)].created_at)
        self.background: Set[asyncio.Future] = set()  # writes (with commit and retention), uploads
        # the run's fencing token (see storage/ownership.py and run_guards.py)
        self.fence = OwnerFence(config.run, self.local, ray_identity)
        self.gc_watch = GcNoticeWatch(config.run, self.local, self.remote, self.catalogue, self.uploads)
        self.uploader = Uploader(config.run, self.remote, self.uploads, self.catalogue, self.pools, self.file_nodes,
                                 self.metrics, self.fence, outcome_of, self.accepted_at, self._in_background,
                                 self._after_upload, self._set_error)
        self.deletions = Deletions(config, self.local, self.remote, self.catalogue, self.uploads, self.pools,
                                   self.file_nodes)
        self.replication = Replication(config, self.local, self.pools, self.catalogue, self.uploads, self.skipped,
                                       self.file_nodes, self.node_id, self._in_background, self._set_error)
        self.queries.replication = self.replication
        # preemption notices (evacuation.py): a drained node's only copies go elsewhere before its deadline
        self.evacuation = Evacuation(config.on_preemption, self.catalogue, self.uploads,
                                     self.uploader if self.remote is not None else None, self.replication,
                                     self.file_nodes, self.node_id, self.pools, self.metrics, self._in_background,
                                     self._set_error)
        self.queries.evacuation = self.evacuation
        self.versions = VersionCommits(config, self.local, self.catalogue, self.uploads, self.uploader, self.deletions,
                                       self.metrics, self.node_id, self.file_nodes, self.accepted_at, self.fence,
                                       self._raise_head, self._in_background, self._set_error,
                                       on_commit=self.replication.on_commit)
        self.writes = WriteDispatch(self.pools, self.catalogue, config.compression, self.versions.record,
                                    self.versions.progress, self._in_background)
        self.waits = VersionWaits(config.run, self.remote, config.rank_timeout_s, self.catalogue, self.uploads,
                                  self.uploader, self.versions.commit_futures, self.versions.settled_futures,
                                  self.replication)

    def set_owner(self, token: int) -> None:
        """The token of the job that owns the run (create() wrote its record before calling this)."""
        self.fence.token = token

    async def reconfigure(self, changes: Dict[str, Any]) -> EngineConfig:
        """Change live options of the run (``live_options.LIVE``; ``create(..., reconfigure=True)``
        checked them): set in place on the configuration that retention (``Deletions``) reads at
        every commit, and handed to the helpers that keep a copy (the waits' ``rank_timeout_s``,
        the catalogue's signing key, the write dispatch's compression). A new retention rule also
        prunes at once, in the background (as after a commit). Returns the new config."""
        applied(self.cfg, changes)  # live_options.py: validated, then set in place
        self.waits.rank_timeout_s = self.cfg.rank_timeout_s
        self.catalogue.signing_key = self.cfg.signing_key
        self.writes.compression = self.cfg.compression
        log.warning("run %r reconfigured live: %s", self.cfg.run, ", ".join(shown(changes)))
        if any(name.startswith(("keep_", "remote_keep_")) for name in changes):
            self._in_background(self._after_upload())  # remote retention, then local
        return self.cfg

    # ------------------------------------------------------------------ queries (queries.py)
    # Queries run in their own concurrency group (QUERIES): their own thread and event loop, so that
    # they answer within milliseconds while thousands of ranks' submit() calls queue on the main loop.
    @ray.method(concurrency_group="queries")
    def config(self) -> EngineConfig:
        return self.cfg

    @ray.method(concurrency_group="queries")
    def last_version(self) -> int:
        return self.queries.last_version()

    @ray.method(concurrency_group="queries")
    def list(self) -> list:
        return self.queries.list()

    @ray.method(concurrency_group="queries")
    def manifest(self, version: int = -1, step: Optional[int] = None) -> Optional[Manifest]:
        """The manifest of ``version`` (-1: latest committed), or of the version at ``step``."""
        return self.queries.manifest(version, step)

    def skipped_versions(self) -> Dict[int, str]:
        return self.queries.skipped_versions()

    @ray.method(concurrency_group="queries")
    def stored_state(self, name: str, version: int = -1, step: Optional[int] = None) -> Optional[StoredState]:
        return self.queries.stored_state(name, version, step)

    @ray.method(concurrency_group="queries")
    def manifests(self) -> List[Manifest]:
        return self.queries.manifests()

    @ray.method(concurrency_group="queries")
    def status(self) -> CoordinatorStatus:
        return self.queries.status(commits=self.versions.commits, failures=self.versions.failures,
                                   last_error=self.last_error, started_at=self.started_at, node=self.node_id)

    @ray.method(concurrency_group="queries")
    def preemption(self, node: Optional[str] = None) -> Optional[PreemptionNotice]:
        """The preemption notice in force (a drained node of the run), or None (evacuation.py).
        ``node``: the asking process's node, counted as the run's from the next poll on."""
        self.evacuation.asked_from(node)
        return self.evacuation.active()

    @ray.method(concurrency_group="queries")
    def cpu_seconds(self) -> float:
        """CPU time this coordinator process has used (all threads), for benchmarks/scale.py."""
        return time.process_time()

    @ray.method(concurrency_group="queries")
    def call_counts(self) -> Dict[str, int]:
        """Calls in and out since start (benchmarks/scale.py reports parts per call): pushed parts
        and the ``submit_parts`` calls that brought them, parts sent to writers in batches and the
        ``write_parts`` calls that took them."""
        return {**self.counts, **self.writes.counts}

    def writers(self) -> Dict[str, Any]:
        w = self.pools
        return {"critical": list(w.critical), "best_effort": list(w.best_effort),
                "nodes": {n: len(p) for n, p in w.critical_by_node.items()}}

    # ------------------------------------------------------------------ 1-2: open, dispatch
    async def save(self, step: int, parts: List[PartPlan], refs: List[Any],
                   metrics: Optional[Dict[str, float]] = None, upload: bool = False,
                   token: Optional[int] = None) -> SaveOutcome:
        """Accept a version and return its outcome once it is committed locally.

        ``parts[i]`` describes ``refs[i]``; parts with ``loader=True`` have no ref. ``upload``:
        whether it is this version's turn to be uploaded (``remote_every``), as the caller counted
        its saves. Raises SaveError if the version cannot commit."""
        self._resume_uploads()
        self.gc_watch.start()
        self.replication.start()
        self.evacuation.start()
        self.fence.check_caller(token)
        t0 = time.perf_counter()
        version = step
        if not parts and version in self.catalogue.committed and version not in self.catalogue.pending:
            # nothing of the driver's own: its ranks' pushes already committed the version it opens
            return outcome_of(self.catalogue.committed[version], "local", seconds=time.perf_counter() - t0)
        merged = version in self.catalogue.pending
        self.catalogue.begin(version, step, parts, metrics)
        if not merged:
            self.versions.opened(version, upload)
        stored = [p for p in parts if not p.loader]
        if len(stored) != len(refs):
            self.catalogue.fail(version, "internal: parts and refs differ in number")
        for p, ref in zip(stored, refs):
            self.writes.dispatch(version, p.name, p.rank, ref, p.nbytes)
        self.versions.watch_pushed(version)
        await self.versions.progress(version)
        outcome = await self.versions.commit_futures[version]
        return dataclasses.replace(outcome, seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------ pushed states (ranks)
    def declare(self, name: str, strategy: str, world_size: int, replicated: bool = False,
                allow_pickle: bool = False, append_only: bool = False) -> None:
        self.catalogue.declare(name, strategy, world_size, replicated, allow_pickle, append_only)
        self.local.put_bytes(DECLARED, json.dumps({n: d.to_json() for n, d in self.catalogue.declared.items()},
                                                  sort_keys=True).encode())

    def expect_driver(self, names: List[str]) -> None:
        """The owning engine's driver-side states: a version its ranks open waits for its save()."""
        self.catalogue.expect_driver(list(names))
        self.local.put_bytes(DRIVER_STATES, json.dumps(self.catalogue.driver_states).encode())

    def declared(self) -> Dict[str, Declaration]:
        return dict(self.catalogue.declared)

    async def submit(self, step: int, name: str, rank: int, refs: List[Any], nbytes: int = 0,
                     upload: bool = False, after: int = -1) -> SubmitAck:
        """One rank's part of ``name`` at ``step`` (a bad push raises here); ``submit_parts`` is the
        form engines use, many parts per call. Kept for callers of one part."""
        self._resume_uploads()
        return self._accept_push(step, PushedPart(name, rank, refs[0] if refs else None, nbytes, upload, after))

    async def submit_parts(self, step: int, parts: List[PushedPart]) -> SubmitBatchResult:
        """Ranks' parts of ``step`` pushed by one engine within a short window (``client/push_batch.py``):
        one call for a host process's ranks instead of one per part, recorded in one pass.
        Each part is accepted and sent to a writer, then this returns at once: it never waits for
        the commit (thousands of ranks push each version, and a call that waited would hold one of
        the actor's concurrency slots until the parts that complete the version arrived). A part
        refused (pushed twice, rank out of range here, version committed) is named in the result
        with the error its own call would have raised; the others go on. The ranks' handles learn
        of the commit through :meth:`wait` (one call per version and process). Nothing in it
        awaits: it holds no slot beyond its own run."""
        self._resume_uploads()
        self.gc_watch.start()
        self.replication.start()
        self.evacuation.start()
        self.counts["submit_calls"] += 1
        self.counts["pushed_parts"] += len(parts)
        rejected: Dict[int, str] = {}
        for i, part in enumerate(parts):
            try:
                self._accept_push(step, part)
            except Exception as exc:  # that rank's handle raises it; the batch's other parts go on
                rejected[i] = one_line(exc)
        return SubmitBatchResult(step, rejected)

    def _accept_push(self, step: int, part: PushedPart) -> SubmitAck:
        """A rank's part: open the version if it is the first, check the barrier (``after``: the
        step this rank pushed before, see ``Catalogue.barrier_violations``), dispatch it.
        ``upload``: as in :meth:`save`, counted by the rank (the part that opens a version decides)."""
        version, name, rank = step, part.name, part.rank
        d = self.catalogue.declared.get(name)
        if d is not None and d.replicated and rank != 0:
            return SubmitAck(version, rank_zero_only=True)  # DDP replicas: rank 0's copy is stored
        if part.ref is None:
            raise SaveError(f"state {name!r} rank {rank}: the push of step {version} carries no snapshot")
        is_new = version not in self.catalogue.pending
        pv = self.catalogue.accept_push(version, step, name, rank)
        if part.metrics:
            pv.metrics.update(part.metrics)  # into the manifest at the commit (keep_best ranks by them)
        if is_new:
            self.versions.opened(version, part.upload)
            self.versions.watch_pushed(version)
        for v in self.catalogue.barrier_violations(version, name, rank, part.after):
            pv = self.catalogue.pending[v]
            self.catalogue.fail(v, f"ranks disagree on the step: state {name!r} rank {rank} submitted step "
                                   f"{step} while {step_label(pv.step, v)} still awaits its part")
            log.error("version %d: %s", v, pv.error)
            self.last_error = f"step {v}: {pv.error}"
            self._in_background(self.versions.progress(v))
        self.writes.dispatch(version, name, rank, part.ref, part.nbytes)
        return SubmitAck(version)

    # ------------------------------------------------------------------ 6: uploaded (uploader.py)
    @ray.method(concurrency_group="queries")
    def upload_progress(self, version: int) -> Optional[Tuple[int, int]]:
        """(bytes uploaded, bytes to upload) of ``version``'s current upload attempt, or None
        before it starts (``SaveHandle.wait(durability="remote", progress=True)`` shows it)."""
        return self.uploader.progress(version)

    def _resume_uploads(self) -> None:
        self.uploader.resume()

    async def _after_upload(self) -> None:
        if self.uploads.committed:
            self._in_background(self._raise_head(self.remote, max(self.uploads.committed)))
        await self.deletions.apply_remote_retention()
        await self.deletions.apply_retention()  # a local version held back for its upload may go now

    def _set_error(self, msg: str) -> None:
        self.last_error = msg

    # ------------------------------------------------------------------ waiting (waits.py)
    async def wait(self, version: int, durability: str = "local", best_effort: bool = False,
                   pushed: bool = False) -> SaveOutcome:
        """The outcome once ``version`` is committed on the ``durability`` tier; with
        ``best_effort=True`` also once its best-effort parts are written (or reported missing).
        ``pushed``: asked for ranks' pushes (one call per version and process serves them all),
        whose version may open only when another rank pushes (a replica rank's push does not
        open it): an unknown version is waited for up to ``rank_timeout_s``, not 30 s."""
        self._resume_uploads()
        return await self.waits.wait(version, durability, best_effort, pushed)

    def remote_error(self, version: int) -> Optional[str]:
        return self.uploads.errors.get(version)

    async def recheck(self, version: int) -> Optional[str]:
        """A restore found no good copy of a critical file of ``version``: why it cannot be restored
        after it left the list for that reason, None when a copy still verifies (``recheck.py``)."""
        return await recheck(version, self.replication, self.remote)

    # ------------------------------------------------------------------ rewind (deletions.py)
    async def rewind(self, version: int) -> List[int]:
        """Delete every committed version after ``version`` from both tiers, so that training can
        go on from ``version`` with the same step numbers (a roll-back after divergence). Refused
        while saves are in flight. Returns the versions deleted."""
        gone = await self.deletions.rewind(version)
        self.replication.rewound(gone)
        for tier in (self.local, self.remote):  # the heads come down with the versions: steps are reused
            if tier is not None:
                await asyncio.to_thread(self.heads.set_to, tier, version, self.cfg.signing_key)
        if self.catalogue.reserved_through > version:  # a rollback found at the start: accepted now
            self.skipped.pop(self.catalogue.reserved_through, None)
            self.catalogue.reserved_through = -1
        return gone

    async def _raise_head(self, tier: Any, step: int) -> None:
        """The tier's head record names ``step`` once it is committed there (storage/head.py). A
        failed write leaves the version committed and is reported in status()."""
        try:
            local = tier is self.local
            await asyncio.to_thread(self.heads.raise_to, tier, step, self.cfg.signing_key, lambda: step in (
                self.catalogue.committed if local else self.uploads.committed))
        except Exception as exc:
            self._set_error(f"writing the head record (step {step}) on the {tier.name} tier failed: "
                            f"{tier.scrub(one_line(exc))}")
            log.warning(self.last_error)

    # ------------------------------------------------------------------ lifetime
    def _in_background(self, coro: Any) -> asyncio.Future:
        """Run ``coro`` in the background and remember it until it ends (see ``quiesce``)."""
        fut = asyncio.ensure_future(coro)
        self.background.add(fut)
        fut.add_done_callback(self.background.discard)
        return fut

    async def quiesce(self, timeout: float) -> List[str]:
        """Wait, at most ``timeout`` seconds, for the writes, commits, retention deletions and uploads
        in progress (and any they start); returns what is still running (empty when all ended).
        Called before the coordinator is stopped, so that no writer is still deleting or writing
        files when ``shutdown()`` returns and no upload is cut off."""
        self._resume_uploads()
        deadline = time.monotonic() + timeout
        while self.background:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(list(self.background), timeout=left)
        unfinished = [f"step {v}: {pv.stage()}" for v, pv in sorted(self.catalogue.pending.items())]
        unfinished += [f"step {v}: upload" for v in sorted(self.uploads.uploading)]
        return unfinished if self.background else []

    async def ready(self) -> bool:
        """Wait until every writer has started, so the first save does not pay for worker start-up."""
        self._resume_uploads()
        self.gc_watch.start()
        self.replication.start()
        self.evacuation.start()
        await asyncio.gather(*[actor_ready(w) for w in self.pools.all()])
        return True


# "queries": list / status / manifests answer on their own thread while the main loop is busy
CoordinatorActor = ray.remote(concurrency_groups={"queries": 4})(CheckpointCoordinator)
