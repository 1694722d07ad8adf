"""The CheckpointCoordinator: a named, detached, restartable Ray actor.

A thin asyncio shell over plain objects — the :class:`~ray_ckpt.catalogue.Catalogue` (versions,
parts, the commit rule, manifests, local retention), the :class:`~ray_ckpt.upload_plan.UploadPlan`
(what is owed to the remote tier) and the :class:`~ray_ckpt.writers.WriterPools` (``pools``) — that carries
out what they decide. It holds nothing that storage does not also hold: restarted, it rebuilds its
catalogue and upload plan from the manifests of both tiers.

A version's life, in call order:

1. **open** — ``save()`` (the driver's parts, refs still inside lists, never resolved here) or a
   rank's first pushed part (``submit_parts``: the parts one engine pushed for the version within a
   few ms, in one call): ``Catalogue.begin`` / ``accept_push``; ``UploadPlan.opened`` notes
   whether the engine counted it as an upload turn. A rank that never pushes fails the version
   after ``rank_timeout_s`` (``_deadline``).
2. **parts dispatched** — ``WriteDispatch`` (``write_dispatch.py``): snapshot refs go in batches to
   the writers of the node that holds them (critical) or of the best-effort pool.
3. **written** — ``_record``: the writer's :class:`~ray_ckpt.protocol.WrittenPart` (or its error)
   goes to ``Catalogue.part_written`` / ``part_failed``.
4. **manifest** — ``_progress``: once every critical part is written the manifest is written to
   the local tier, last and atomically: it is the commit marker.
5. **committed** — the version's commit future resolves with a :class:`~ray_ckpt.protocol.SaveOutcome`
   (the driver's ``save()`` call returns it; a rank's ``submit_parts()`` returned at once,
   and its handle learns of the commit through ``wait()``, one call per version per process);
   best-effort parts that land later rewrite the manifest. A failed version's files are removed
   before its handle raises.
6. **uploaded** — ``Uploader`` (``uploader.py``): if the upload plan says it is this version's turn, writers copy its
   files (verified while streaming) and the remote manifest is written last.
7. **retained** — ``_apply_retention`` / ``_apply_remote_retention``: the policies of each tier
   delete what they no longer keep (files another version refers to stay).
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

from .catalogue import Catalogue, PendingVersion, meta_of
from .checkpoint_io import delete_version, scan, write_manifest
from .config import EngineConfig
from .errors import CheckpointError, IntegrityError, SaveError, UnsupportedTypeError, one_line
from .formats.manifest import Manifest, chain_suspects
from .lease import ray_identity, read_owner
from .metrics import Metrics
from .ownership import fence_error
from .protocol import (CoordinatorStatus, Declaration, PartPlan, SaveOutcome, StoredState, SubmitAck,
                       VersionStatus)
from .push_batch import PushedPart, SubmitBatchResult
from .storage.durable_batch import remove_temporaries
from .storage.tier import Tier
from .upload_plan import UploadPlan
from .uploader import Uploader, root_cause
from .write_dispatch import WriteDispatch
from .writers import WriterPools

log = logging.getLogger("ray_ckpt.coordinator")
NAMESPACE = "ray_ckpt"
DECLARED = "declared_states.json"  # pushed-state declarations, so a restarted coordinator knows them
SWEEP_TIMEOUT_S = 60.0  # removing a finished version's temporary files (a writer busy with later batches)
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval of the coordinator's process (see __init__)
DRIVER_STATES = "driver_states.json"  # the states the driver's save() brings (Catalogue.expect_driver)


def actor_name(run: str) -> str:
    return f"ray_ckpt.coordinator.{run}"


def _problems_by_version(problems: List[str]) -> Dict[int, str]:
    """scan()'s problems ("version N: why") by version."""
    out: Dict[int, str] = {}
    for p in problems:
        head, _, why = p.partition(": ")
        if head.startswith("version ") and head[8:].isdigit():
            out[int(head[8:])] = why
    return out


def outcome_of(m: Manifest, durability: str, bytes_written: Optional[int] = None, **extra: Any) -> SaveOutcome:
    """A committed manifest as the outcome a handle returns."""
    missing = tuple(sorted(n for n, e in m.states.items() if e.status == "missing"))
    pending = tuple(sorted(n for n, e in m.states.items() if e.status == "pending"))
    return SaveOutcome(m.version, m.step, durability, m.bytes if bytes_written is None else bytes_written,
                       tuple(sorted(m.states)), missing=missing, pending=pending, **extra)


class CheckpointCoordinator:
    def __init__(self, config: EngineConfig):
        # Every call crosses threads of this process (Ray's task thread, each concurrency group's
        # event loop) that take turns holding the GIL: at Python's default 5 ms per turn a query
        # waited behind thousands of pushes' turns; 0.5 ms keeps list/status quick (issue 15)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.cfg = config
        self.local = config.local_tier()
        self.remote = config.remote_tier()
        self.local.check_writable()  # the remote tier is checked by create(): it may be down at a restart
        # the writers' processes start while the tiers are scanned below (Ray starts them in the
        # background; engine.create() waits for them with ready()); owned by this actor, they go
        # with it if anything below raises
        self.pools = WriterPools(config)
        self.node_id = self.pools.node_id
        key = config.signing_key
        committed, partial, bad = scan(self.local, key)
        for problem in bad:
            log.warning("ignoring %s", problem)
        # versions found but not trusted (unreadable, mis-signed, or off the manifest chain): listed
        # by status() and by a restore that goes past them, never restored
        self.skipped: Dict[int, str] = _problems_by_version(bad)
        for v, why in chain_suspects(committed).items():
            log.error("version %d is not trusted: %s", v, why)
            self.skipped[v] = why
            committed.pop(v, None)
        self.catalogue = Catalogue(config.run, committed)
        self.catalogue.signing_key = key
        self._remove_partial(self.local, partial, self.catalogue.kept_paths(set()))
        self._remove_temporaries_at_start()
        self._load_declarations()
        self._load_driver_states()
        remote_committed: Dict[int, Manifest] = {}
        remote_partial: List[int] = []
        if self.remote is not None:
            try:
                remote_committed, remote_partial, remote_bad = scan(self.remote, key)
                for v, why in _problems_by_version(remote_bad).items():
                    self.skipped.setdefault(v, f"remote tier: {why}")
                for v, why in chain_suspects(remote_committed).items():
                    self.skipped.setdefault(v, f"remote tier: {why}")
                    remote_committed.pop(v, None)
            except Exception as exc:  # remote down at (re)start: local checkpointing goes on
                log.warning("cannot list the remote tier %s: %s", self.remote.display, self.remote.scrub(one_line(exc)))
        self.uploads = UploadPlan(config.remote_every, self.remote is not None, remote_committed,
                                  self.catalogue.committed)
        self._remove_partial(self.remote, remote_partial, self.uploads.paths)
        self.file_nodes: Dict[str, str] = {}  # local file path -> node whose local tier holds it
        self.commit_futures: Dict[int, asyncio.Future] = {}
        self.settled_futures: Dict[int, asyncio.Future] = {}  # every part, best-effort too, is done
        self.version_locks: Dict[int, asyncio.Lock] = {}
        self.accepted_at: Dict[int, float] = {}
        self.manifest_revision: Dict[int, int] = {}  # version -> PendingVersion.revision its manifest shows
        self.unsupported: Set[int] = set()  # failed versions whose cause was an unsupported object
        self.commits = 0
        self.failures = 0
        self.counts: Dict[str, int] = {"pushed_parts": 0, "submit_calls": 0}
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self.metrics = Metrics(config.run)
        for tier, found in (("local", self.catalogue.committed), ("remote", self.uploads.committed)):
            if found:  # a restarted coordinator: "no checkpoint in N minutes" alerts see the real age
                self.metrics.last_committed(tier, found[max(found)].created_at)
        self.background: Set[asyncio.Future] = set()  # writes (with commit and retention), uploads
        self._sweeps: Set[asyncio.Future] = set()  # removals of killed writers' temporary files
        self.writes = WriteDispatch(self.pools, self.catalogue, config.compression, self._record, self._progress,
                                    self._in_background)
        self.uploader = Uploader(config.run, self.remote, self.uploads, self.catalogue, self.pools, self.file_nodes,
                                 self.metrics, self._fence, outcome_of, self.accepted_at, self._in_background,
                                 self._after_upload, self._set_error)
        # the run's fencing token (see ownership.py): the creating engine sets it; a coordinator
        # Ray restarted takes it from the owner record if that record is its own job's
        self.owner_token: Optional[int] = None
        record = read_owner([self.local])
        if record is not None and record.same_job(*ray_identity()):
            self.owner_token = record.token

    def set_owner(self, token: int) -> None:
        """The token of the job that owns the run (create() wrote its record before calling this)."""
        self.owner_token = token

    def _fence(self, tier: Tier) -> Optional[str]:
        """Why this coordinator must not commit on ``tier`` now: another job took the run over."""
        return fence_error(read_owner([tier]), self.owner_token, self.cfg.run)

    def _load_declarations(self) -> None:
        try:
            if not self.local.exists(DECLARED):
                return
            declared = json.loads(bytes(self.local.read_bytes(DECLARED)))
            if not isinstance(declared, dict):
                raise ValueError("not a JSON object")
        except (IntegrityError, ValueError, OSError) as exc:  # a link, a FIFO, garbage: not ours to follow
            log.error("ignoring %s: %s", DECLARED, one_line(exc))
            return
        for name, d in declared.items():
            try:
                decl = Declaration.from_json(name, d)
                self.catalogue.declare(name, decl.strategy, decl.world_size, decl.replicated, decl.allow_pickle)
            except (CheckpointError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring the declaration of %r in %s: %s", name, DECLARED, one_line(exc))

    def _load_driver_states(self) -> None:
        try:
            if self.local.exists(DRIVER_STATES):
                self.catalogue.expect_driver(json.loads(bytes(self.local.read_bytes(DRIVER_STATES))))
        except (CheckpointError, IntegrityError, ValueError, OSError, TypeError) as exc:
            log.error("ignoring %s: %s", DRIVER_STATES, one_line(exc))

    def _remove_temporaries_at_start(self) -> None:
        """``*.tmp-*`` files a writer killed mid-batch left in committed versions (its restarted
        self redid the batch under other names; the previous coordinator stopped before sweeping
        them at the version's end): nothing writes into a committed version now."""
        for v in list(self.catalogue.committed):
            try:
                removed = remove_temporaries(self.local, v)
            except Exception as exc:  # only garbage: never a reason not to start
                log.warning("version %d: cannot remove temporary files: %s", v, one_line(exc))
                continue
            if removed:
                log.warning("version %d: removed %d temporary file(s) a killed writer left", v, len(removed))

    @staticmethod
    def _remove_partial(tier: Optional[Tier], partial: List[int], keep: Set[str]) -> None:
        """Version directories without a manifest at start-up are saves (local tier) or uploads
        (remote tier) that were in flight when the previous coordinator stopped (its writers stop
        with it): never listed, only taking space. Removed before this coordinator accepts a save
        that could write the same version again; files committed versions refer to (``keep``: a
        RELOADABLE state stored once) stay."""
        for v in partial:
            try:
                removed = delete_version(tier, v, keep, [])
            except Exception as exc:  # e.g. the remote tier down at a restart: they are only garbage
                log.warning("version %d: cannot remove its partial files on the %s tier: %s", v, tier.name,
                            one_line(exc))
                continue
            if removed:
                log.warning("version %d was not finished on the %s tier before the coordinator stopped; "
                            "removed its %d partial file(s)", v, tier.name, len(removed))

    # ------------------------------------------------------------------ queries
    # Queries run in their own concurrency group (QUERIES): their own thread and event loop, so that
    # they answer within milliseconds while thousands of ranks' submit() calls queue on the main
    # loop (issue 15). They only read, and copy a dict (one C-level step under the GIL) before
    # iterating it in Python, since the main loop may change it meanwhile.
    @ray.method(concurrency_group="queries")
    def config(self) -> EngineConfig:
        return self.cfg

    @ray.method(concurrency_group="queries")
    def last_version(self) -> int:
        return max([self.catalogue.last_version] + list(self.uploads.committed))

    @ray.method(concurrency_group="queries")
    def list(self) -> list:
        local, remote = dict(self.catalogue.committed), dict(self.uploads.committed)
        out = []
        for v in sorted(set(local) | set(remote)):
            tiers = tuple(t for t, d in (("local", local), ("remote", remote)) if v in d)
            out.append(meta_of(local.get(v) or remote[v], tiers))
        return out

    @ray.method(concurrency_group="queries")
    def manifest(self, version: int = -1, step: Optional[int] = None) -> Optional[Manifest]:
        """The manifest of ``version`` (-1: latest committed), or of the version at ``step``."""
        allv = {**self.uploads.committed, **self.catalogue.committed}
        if step is not None:
            allv = {v: m for v, m in allv.items() if m.step == step}
            return allv[max(allv)] if allv else None
        if version == -1:
            return allv[max(allv)] if allv else None
        return allv.get(version)

    def skipped_versions(self) -> Dict[int, str]:
        """Versions found in storage but not trusted (and not committed on another tier): why."""
        return {v: why for v, why in self.skipped.items()
                if v not in self.catalogue.committed and v not in self.uploads.committed}

    @ray.method(concurrency_group="queries")
    def stored_state(self, name: str, version: int = -1, step: Optional[int] = None) -> Optional[StoredState]:
        """State ``name`` of ``version`` (or of the version at ``step``) without the other states'
        entries (see :class:`StoredState`); None when no such version is committed."""
        m = self.manifest(version, step)
        if m is None:
            return None
        return StoredState(m.version, m.step, tuple(sorted(m.states)), m.states.get(name))

    @ray.method(concurrency_group="queries")
    def manifests(self) -> List[Manifest]:
        """Every committed manifest, newest first (a restore that falls back walks them)."""
        allv = {**self.uploads.committed, **self.catalogue.committed}
        return [allv[v] for v in sorted(allv, reverse=True)]

    @ray.method(concurrency_group="queries")
    def status(self) -> CoordinatorStatus:
        for attempt in range(5):  # a driver's save merging parts into a version meanwhile: read again
            try:
                return self._status()
            except RuntimeError:  # "dictionary changed size during iteration"
                if attempt == 4:
                    raise
                time.sleep(0.01)

    def _status(self) -> CoordinatorStatus:
        in_flight = {v: pv.status() for v, pv in list(self.catalogue.pending.items())}
        for v in list(self.uploads.uploading):
            upload = self.uploads.upload_state(v)
            in_flight[v] = dataclasses.replace(in_flight[v], upload=upload) if v in in_flight else \
                VersionStatus(v, None, "committed", upload=upload)
        return CoordinatorStatus(
            run=self.cfg.run, in_flight=tuple(in_flight[v] for v in sorted(in_flight)),
            queued_bytes_critical=self.pools.queued_bytes(self.pools.critical),
            queued_bytes_best_effort=self.pools.queued_bytes(self.pools.best_effort),
            committed=len(self.catalogue.committed), remote_committed=len(self.uploads.committed),
            commits=self.commits, failures=self.failures, last_error=self.last_error,
            started_at=self.started_at, node=self.node_id,
            writer_nodes={n[:12]: len(p) for n, p in self.pools.critical_by_node.items()},
            upload_owed=self.uploads.owed, skipped_versions=self.skipped_versions())

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
        if token is not None and self.owner_token is not None and token < self.owner_token:
            raise SaveError(f"run {self.cfg.run!r} was taken over (token {self.owner_token}); this engine's token "
                            f"{token} is stale, so its saves no longer commit")
        t0 = time.perf_counter()
        version = step
        if not parts and version in self.catalogue.committed and version not in self.catalogue.pending:
            # nothing of the driver's own: its ranks' pushes already committed the version it opens
            return outcome_of(self.catalogue.committed[version], "local", seconds=time.perf_counter() - t0)
        merged = version in self.catalogue.pending
        self.catalogue.begin(version, step, parts, metrics)
        if not merged:
            self._opened(version, upload)
        stored = [p for p in parts if not p.loader]
        if len(stored) != len(refs):
            self.catalogue.fail(version, "internal: parts and refs differ in number")
        for p, ref in zip(stored, refs):
            self.writes.dispatch(version, p.name, p.rank, ref, p.nbytes)
        self._watch_pushed(version)
        await self._progress(version)
        outcome = await self.commit_futures[version]
        return dataclasses.replace(outcome, seconds=time.perf_counter() - t0)

    def _opened(self, version: int, upload: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.uploads.opened(version, upload)
        self.commit_futures[version] = loop.create_future()
        self.settled_futures[version] = loop.create_future()
        self.version_locks[version] = asyncio.Lock()
        self.accepted_at[version] = time.perf_counter()
        self.metrics.set_in_flight(len(self.catalogue.pending))

    # ------------------------------------------------------------------ pushed states (ranks)
    def declare(self, name: str, strategy: str, world_size: int, replicated: bool = False,
                allow_pickle: bool = False) -> None:
        self.catalogue.declare(name, strategy, world_size, replicated, allow_pickle)
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
        """Ranks' parts of ``step`` pushed by one engine within a short window (``push_batch.py``):
        one call for a host process's ranks instead of one per part, recorded in one pass.
        Each part is accepted and sent to a writer, then this returns at once: it never waits for
        the commit (thousands of ranks push each version, and a call that waited would hold one of
        the actor's concurrency slots until the parts that complete the version arrived). A part
        refused (pushed twice, rank out of range here, version committed) is named in the result
        with the error its own call would have raised; the others go on. The ranks' handles learn
        of the commit through :meth:`wait` (one call per version and process). Nothing in it
        awaits: it holds no slot beyond its own run."""
        self._resume_uploads()
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
            raise SaveError(f"state {name!r} rank {rank}: the push of version {version} carries no snapshot")
        is_new = version not in self.catalogue.pending
        self.catalogue.accept_push(version, step, name, rank)
        if is_new:
            self._opened(version, part.upload)
            self._watch_pushed(version)
        for v in self.catalogue.barrier_violations(version, name, rank, part.after):
            pv = self.catalogue.pending[v]
            self.catalogue.fail(v, f"ranks disagree on the step: state {name!r} rank {rank} submitted step "
                                   f"{step} while version {v} (step {pv.step}) still awaits its part")
            log.error("version %d: %s", v, pv.error)
            self.last_error = f"version {v}: {pv.error}"
            self._in_background(self._progress(v))
        self.writes.dispatch(version, name, rank, part.ref, part.nbytes)
        return SubmitAck(version)

    def _watch_pushed(self, version: int) -> None:
        pv = self.catalogue.pending.get(version)
        if pv is not None and pv.missing_submits():
            asyncio.ensure_future(self._deadline(version))

    async def _deadline(self, version: int) -> None:
        """A rank that never submits fails its version loudly after rank_timeout_s (a best-effort
        part is reported missing instead); later versions are not blocked."""
        await asyncio.sleep(self.cfg.rank_timeout_s)
        pv = self.catalogue.pending.get(version)
        if pv is None or not pv.missing_submits():
            return
        missing = [p for p in pv.parts.values() if not p.submitted]
        driver = sorted(p.name for p in missing if p.placeholder)
        critical = [p for p in missing if p.blocks_commit and not p.placeholder]
        named = sorted(critical or [p for p in missing if not p.placeholder], key=lambda p: (p.name, p.rank))
        shown = ", ".join(f"{p.name!r} rank {p.rank}" for p in named[:8])
        more = f"+{len(named) - 8} more; " if len(named) > 8 else ""
        what = "; ".join(
            ([f"ranks did not push within rank_timeout_s={self.cfg.rank_timeout_s:g}s: {shown} "
              f"({more}{len(named)} of {len(pv.parts)} parts)"] if named else [])
            + ([f"the driver's save(step={pv.step}) did not arrive within rank_timeout_s="
                f"{self.cfg.rank_timeout_s:g}s (driver-side states {driver}: a version its ranks open "
                f"commits only with them)"] if driver else []))
        critical = critical or [p for p in missing if p.placeholder]
        log.error("version %d: %s", version, what)
        failed_before = pv.error
        why = f"no part arrived within rank_timeout_s={self.cfg.rank_timeout_s:g}s"
        for p in missing:
            p.submitted = True
            self.catalogue.part_failed(version, p.name, p.rank, why)
        if critical and not failed_before:  # the error names the missing ranks, not the last part failed
            pv.error = what
            self.last_error = f"version {version}: {what}"
        await self._progress(version)

    # ------------------------------------------------------------------ 3: written
    def _record(self, version: int, name: str, rank: int, result: Any) -> None:
        """A part's WrittenPart, or the error that stopped it, into the catalogue."""
        if not isinstance(result, BaseException):
            if not result.reused:
                for f in result.files:
                    self.file_nodes[f.path] = result.node or self.node_id
            self.catalogue.part_written(version, name, rank, result)
        else:  # reaches the handle through the commit future
            exc = result
            if isinstance(root_cause(exc), UnsupportedTypeError):
                self.unsupported.add(version)  # the handle raises the same class as an in-process save
            msg = one_line(getattr(exc, "cause", None) or exc)
            log.error("version %d: state %r rank %d failed: %s", version, name, rank, msg)
            self.last_error = f"version {version} state {name!r} rank {rank}: {msg}"
            self.catalogue.part_failed(version, name, rank, msg)

    # ------------------------------------------------------------------ 4-5: manifest, committed
    async def _progress(self, version: int) -> None:
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
                await self._delete_everywhere(version, self.catalogue.kept_paths(set()), [])
            finally:
                if not fut.done():
                    self._fail_handle(version, pv, fut)
        else:
            if self.uploads.needs_resync(version, self.catalogue.committed.get(version)):
                self.uploader.start(version)  # best-effort parts landed since
            await self._apply_retention()

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
                self.last_error = f"version {version}: adding best-effort parts to the manifest failed: " \
                                  f"{one_line(exc)}"
                log.error(self.last_error)
                return

    def _finish(self, version: int, pv: PendingVersion) -> None:
        self.catalogue.finish(version)
        if not pv.error:
            self.unsupported.discard(version)
            sweep = asyncio.ensure_future(self._sweep_temporaries(version))  # garbage only: quiesce does not wait
            self._sweeps.add(sweep)
            sweep.add_done_callback(self._sweeps.discard)
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
            error(f"version {version} (step {pv.step}) of run {self.cfg.run!r} failed and is not listed: {pv.error}"))

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

    async def _sweep_temporaries(self, version: int) -> None:
        """Every part of ``version`` ended: remove the ``*.tmp-*`` files a writer killed mid-batch
        left in it (one call to a writer of each node that holds its files)."""
        alive = await asyncio.to_thread(self.pools._alive_nodes)
        nodes = [n for n in self.pools.critical_by_node if n in alive]  # a lost node's writer would not answer
        calls = [self.pools.critical_on(n)[0].remove_temporaries.remote(version) for n in nodes]
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), SWEEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("version %d: removing temporary files did not end within %gs", version, SWEEP_TIMEOUT_S)
            return
        for node, r in zip(nodes, results):
            if isinstance(r, Exception):
                log.warning("version %d: removing temporary files on node %s failed: %s", version, node[:12],
                            one_line(r))
            elif r:
                log.warning("version %d: removed %d temporary file(s) a killed writer left on node %s",
                            version, len(r), node[:12])

    async def _delete_everywhere(self, version: int, keep: Set[str], referenced: List[str]) -> None:
        """Delete a version from every node's local tier (each node's local tier is its own disk)."""
        await asyncio.to_thread(delete_version, self.local, version, keep, referenced)
        results = await asyncio.gather(*[w.delete_version.remote(version, keep, referenced)
                                         for w in self.pools.other_nodes()], return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("version %d: deleting on another node failed: %s", version, one_line(r))
        for path in [p for p in self.file_nodes if p.startswith(f"v{version:012d}/") or p in referenced]:
            if path not in keep:
                self.file_nodes.pop(path, None)

    # ------------------------------------------------------------------ 6: uploaded (uploader.py)
    @ray.method(concurrency_group="queries")
    def upload_progress(self, version: int) -> Optional[Tuple[int, int]]:
        """(bytes uploaded, bytes to upload) of ``version``'s current upload attempt, or None
        before it starts (``SaveHandle.wait(durability="remote", progress=True)`` shows it)."""
        return self.uploader.progress(version)

    def _resume_uploads(self) -> None:
        self.uploader.resume()

    async def _after_upload(self) -> None:
        await self._apply_remote_retention()
        await self._apply_retention()  # a local version held back for its upload may go now

    def _set_error(self, msg: str) -> None:
        self.last_error = msg

    # ------------------------------------------------------------------ waiting
    async def wait(self, version: int, durability: str = "local", best_effort: bool = False,
                   pushed: bool = False) -> SaveOutcome:
        """The outcome once ``version`` is committed on the ``durability`` tier; with
        ``best_effort=True`` also once its best-effort parts are written (or reported missing).
        ``pushed``: asked for ranks' pushes (one call per version and process serves them all),
        whose version may open only when another rank pushes (a replica rank's push does not
        open it): an unknown version is waited for up to ``rank_timeout_s``, not 30 s."""
        self._resume_uploads()
        if durability not in ("local", "remote"):
            raise SaveError(f"durability must be 'local' or 'remote', got {durability!r}")
        if best_effort:
            return await self._wait_settled(version, durability)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (max(30.0, self.cfg.rank_timeout_s) if pushed else 30.0)
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
                raise SaveError(f"run {self.cfg.run!r} has no remote tier (remote_uri was not given)")
            return await self.uploader.future(version)
        if version in self.catalogue.failed:
            raise SaveError(f"version {version} of run {self.cfg.run!r} failed: {self.catalogue.failed[version]}")
        if version in self.catalogue.committed and durability == "local":
            return outcome_of(self.catalogue.committed[version], "local")
        if version in self.uploads.committed:
            return outcome_of(self.uploads.committed[version], durability)
        if version in self.uploader.futures and version in self.catalogue.committed:  # resumed upload
            return await self.uploader.futures[version]
        raise SaveError(f"version {version} is unknown to the coordinator of run {self.cfg.run!r} "
                        f"(it may have restarted while the save was in flight)")

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

    def remote_error(self, version: int) -> Optional[str]:
        return self.uploads.errors.get(version)

    # ------------------------------------------------------------------ rewind
    async def rewind(self, version: int) -> List[int]:
        """Delete every committed version after ``version`` from both tiers, so that training can
        go on from ``version`` with the same step numbers (a roll-back after divergence). Refused
        while saves are in flight. Returns the versions deleted."""
        busy = sorted(v for v in self.catalogue.pending if v > version)
        if busy:
            raise SaveError(f"cannot rewind run {self.cfg.run!r} to version {version}: versions {busy} are "
                            f"still being written; wait for their handles first")
        newer_local = sorted(v for v in self.catalogue.committed if v > version)
        keep = self.catalogue.kept_paths(set(newer_local))
        for v in newer_local:
            referenced = self.catalogue.committed[v].referenced_paths()
            self.catalogue.forget(v)
            await self._delete_everywhere(v, keep, referenced)
        newer_remote = self.uploads.plan_rewind(version)
        for d in newer_remote:
            await asyncio.to_thread(delete_version, self.remote, d.version, set(d.keep), list(d.referenced))
        gone = sorted(set(newer_local) | {d.version for d in newer_remote})
        if gone:
            log.warning("rewind to version %d deleted versions %s", version, gone)
        return gone

    # ------------------------------------------------------------------ 7: retained
    async def _apply_retention(self) -> None:
        doomed = self.catalogue.plan_retention(self.cfg.local_policy(), protect=self.uploads.uploading)
        if not doomed:
            return
        keep = self.catalogue.kept_paths(set(doomed))
        referenced = {v: self.catalogue.committed[v].referenced_paths() for v in doomed}
        for v in doomed:
            self.catalogue.forget(v)
        for v in doomed:
            await self._delete_everywhere(v, keep, referenced[v])
            log.info("retention: deleted version %d from the local tier", v)

    async def _apply_remote_retention(self) -> None:
        for d in self.uploads.plan_retention(self.cfg.remote_policy(), self.catalogue.committed):
            await asyncio.to_thread(delete_version, self.remote, d.version, set(d.keep), list(d.referenced))

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
        unfinished = [f"version {v}: {pv.stage()}" for v, pv in sorted(self.catalogue.pending.items())]
        unfinished += [f"version {v}: upload" for v in sorted(self.uploads.uploading)]
        return unfinished if self.background else []

    async def ready(self) -> bool:
        """Wait until every writer has started, so the first save does not pay for worker start-up."""
        self._resume_uploads()
        await asyncio.gather(*[w.__ray_ready__.remote() for w in self.pools.all()])
        return True


# "queries": list / status / manifests answer on their own thread while the main loop is busy
CoordinatorActor = ray.remote(concurrency_groups={"queries": 4})(CheckpointCoordinator)
