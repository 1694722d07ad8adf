"""The CheckpointCoordinator: a named, detached, restartable Ray actor.

A thin asyncio shell over :class:`~ray_ckpt.catalogue.Catalogue`: it assigns versions, hands
snapshot refs (still inside lists, never resolved here) to the writer pools, writes the manifest
last when every critical part is durable, uploads committed versions to the remote tier in the
background, and applies retention. It holds nothing that storage does not also hold: restarted, it
rebuilds its catalogue from the manifests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from typing import Any, Dict, List, Optional, Set

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .catalogue import Catalogue, PendingVersion, meta_of
from .checkpoint_io import delete_version, scan, write_manifest
from .config import EngineConfig
from .errors import CheckpointError, IntegrityError, SaveError, UnsupportedTypeError, one_line
from .formats.manifest import Manifest
from .metrics import Metrics
from .storage.retention import VersionInfo, plan_deletions
from .storage.tier import Tier
from .types import Strategy
from .writers import WriterActor

log = logging.getLogger("ray_ckpt.coordinator")
NAMESPACE = "ray_ckpt"
DECLARED = "declared_states.json"  # pushed-state declarations, so a restarted coordinator knows them


def _root_cause(exc: BaseException) -> BaseException:
    """A provider's or writer's error comes wrapped once per Ray task it crossed."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def actor_name(run: str) -> str:
    return f"ray_ckpt.coordinator.{run}"


class CheckpointCoordinator:
    def __init__(self, config: EngineConfig):
        self.cfg = config
        self.local = config.local_tier()
        self.remote = config.remote_tier()
        self.local.check_writable()  # the remote tier is checked by create(): it may be down at a restart
        committed, partial, bad = scan(self.local)
        for problem in bad:
            log.warning("ignoring %s", problem)
        self.catalogue = Catalogue(config.run, committed)
        self._remove_partial(self.local, partial, self.catalogue.kept_paths(set()))
        if self.local.exists(DECLARED):
            for name, d in json.loads(bytes(self.local.read_bytes(DECLARED))).items():
                try:
                    self.catalogue.declare(name, **{k: d[k] for k in ("strategy", "world_size", "replicated",
                                                                      "allow_pickle")})
                except (CheckpointError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring the declaration of %r in %s: %s", name, DECLARED, one_line(exc))
        self.remote_committed: Dict[int, Manifest] = {}
        remote_partial: List[int] = []
        if self.remote is not None:
            try:
                self.remote_committed, remote_partial, _ = scan(self.remote)
            except Exception as exc:  # remote down at (re)start: local checkpointing goes on
                log.warning("cannot list the remote tier %s: %s", self.remote.uri, one_line(exc))
        self.remote_paths: Set[str] = {p for m in self.remote_committed.values() for p in m.referenced_paths()}
        self._remove_partial(self.remote, remote_partial, self.remote_paths)
        # remote_every: the engine counts its saves and marks every M-th (see _plan_remote). A
        # restarted coordinator uploads the newest local version if at least remote_every versions
        # are newer than the remote's newest (an upload its predecessor was killed before finishing)
        newest_remote = max(self.remote_committed, default=0)
        newer = sorted(v for v in self.catalogue.committed if v > newest_remote)
        self.resume_uploads: List[int] = (
            [newer[-1]] if self.remote is not None and len(newer) >= config.remote_every else [])
        self.upload_due: Set[int] = set()  # versions whose save was marked for upload, until planned
        self.node_id = ray.get_runtime_context().get_node_id()
        # critical writers per node (they write where the snapshot lies); best-effort ones run here
        self.pools: Dict[str, list] = {self.node_id: self._make_pool(self.node_id)}
        self.best_effort = [self._writer("best_effort", config.best_effort_cpus, config.best_effort_nice)
                            for _ in range(config.best_effort_writers)]
        self.file_nodes: Dict[str, str] = {}  # local file path -> node whose local tier holds it
        self._locator = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="locate")
        self._nodes: Set[str] = set()
        self._nodes_at = 0.0
        self.outstanding: Dict[int, int] = {}  # id(writer) -> bytes queued
        self.commit_futures: Dict[int, asyncio.Future] = {}
        self.remote_futures: Dict[int, asyncio.Future] = {}
        self.remote_pending: Set[int] = set(self.resume_uploads)  # protected from local retention already
        self.remote_errors: Dict[int, str] = {}
        self.remote_given_up: Set[int] = set()  # uploads that cannot be made (the local copy is bad)
        self.version_locks: Dict[int, asyncio.Lock] = {}
        self.remote_locks: Dict[int, asyncio.Lock] = {}  # one upload sequence per version at a time
        self.commits = 0
        # a version due for upload failed (or its upload could not be made): the next one to commit goes instead
        self.remote_owed = False
        self.unsupported: Set[int] = set()  # failed versions whose cause was an unsupported object
        self.failures = 0
        self.last_error: Optional[str] = None
        self.started_at = time.time()
        self.metrics = Metrics(config.run)
        self.accepted_at: Dict[int, float] = {}
        self.remote_bytes: Dict[int, int] = {}  # bytes uploaded per version (files + manifest)
        self.settled_futures: Dict[int, asyncio.Future] = {}  # every part, best-effort too, is done
        self.background: Set[asyncio.Future] = set()  # writes (with commit and retention), uploads

    @staticmethod
    def _remove_partial(tier: Tier, partial: List[int], keep: Set[str]) -> None:
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

    def _writer(self, pool: str, cpus: float, nice: int, node: Optional[str] = None):
        opts: Dict[str, Any] = {"num_cpus": cpus}
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        return WriterActor.options(**opts).remote(self.cfg, pool, nice)

    def _make_pool(self, node: str) -> list:
        return [self._writer("critical", self.cfg.critical_cpus, self.cfg.critical_nice, node)
                for _ in range(self.cfg.critical_writers)]

    @property
    def critical(self) -> list:
        return [w for pool in self.pools.values() for w in pool]

    def _critical_on(self, node: Optional[str]) -> list:
        """The critical pool of ``node`` (created on first use), or this node's when unknown/gone."""
        if node and node not in self.pools:
            self._nodes_at = 0.0
            if node in self._alive_nodes():
                self.pools[node] = self._make_pool(node)
        return self.pools.get(node) or self.pools[self.node_id]

    def _alive_nodes(self) -> Set[str]:
        now = time.monotonic()
        if now - self._nodes_at > 5.0:
            self._nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            self._nodes_at = now
        return self._nodes

    @staticmethod
    def _locate_blocking(ref: Any) -> Optional[str]:
        ray.wait([ref], num_returns=1, fetch_local=False)
        # this actor only borrows the ref: the owner's location report can lag the object's
        # readiness a little (more on a busy head node), so ask again for a bounded moment (3 s)
        # before giving up on affinity
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            locs = ray.experimental.get_object_locations([ref]).get(ref) or {}
            if locs.get("node_ids"):
                return locs["node_ids"][0]
            if 0 < (locs.get("object_size") or 0) < 100 * 1024:
                return None  # small objects are inlined in their owner's memory: no node to prefer
            time.sleep(0.025)
        return None

    async def _locate(self, ref: Any) -> Optional[str]:
        """The node holding a snapshot once it is ready (not fetched here: fetch_local=False).

        The wait may last as long as the provider's current training call, so it runs on its own
        thread pool, never on the one that writes manifests."""
        if len(self._alive_nodes()) <= 1:
            return None
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._locator, self._locate_blocking, ref)
        except Exception as exc:  # a failed snapshot has no location: the writer reports its error
            log.info("no location for a snapshot (%s); writing it from this node", one_line(exc))
            return None

    # ------------------------------------------------------------------ queries
    def config(self) -> EngineConfig:
        return self.cfg

    def last_version(self) -> int:
        return max([self.catalogue.last_version] + list(self.remote_committed))

    def list(self) -> list:
        versions = set(self.catalogue.committed) | set(self.remote_committed)
        out = []
        for v in sorted(versions):
            tiers = tuple(t for t, d in (("local", self.catalogue.committed), ("remote", self.remote_committed))
                          if v in d)
            m = self.catalogue.committed.get(v) or self.remote_committed[v]
            out.append(meta_of(m, tiers))
        return out

    def manifest(self, version: int = -1, step: Optional[int] = None) -> Optional[Manifest]:
        """The manifest of ``version`` (-1: latest committed), or of the version at ``step``."""
        allv = {**self.remote_committed, **self.catalogue.committed}
        if step is not None:
            allv = {v: m for v, m in allv.items() if m.step == step}
            return allv[max(allv)] if allv else None
        if version == -1:
            return allv[max(allv)] if allv else None
        return allv.get(version)

    def status(self) -> Dict[str, Any]:
        in_flight = {}
        for v, pv in self.catalogue.pending.items():
            in_flight[v] = {"step": pv.step, "stage": pv.stage(),
                            "parts": {f"{p.name}/rank{p.rank}": p.status for p in pv.parts.values()}}
        for v in self.remote_pending:
            in_flight.setdefault(v, {"stage": "committed"})["remote"] = (
                "uploading" + (f" (last error: {self.remote_errors[v]})" if v in self.remote_errors else ""))
        return {
            "run": self.cfg.run, "in_flight": in_flight,
            "queued_bytes": {"critical": sum(self.outstanding.get(id(w), 0) for w in self.critical),
                             "best_effort": sum(self.outstanding.get(id(w), 0) for w in self.best_effort)},
            "committed": len(self.catalogue.committed), "remote_committed": len(self.remote_committed),
            "commits": self.commits, "failures": self.failures, "last_error": self.last_error,
            "started_at": self.started_at, "node": self.node_id,
            "writer_nodes": {n[:12]: len(p) for n, p in self.pools.items()},
            "upload_owed": self.remote_owed,  # a due version failed: the next to commit is uploaded
        }

    def writers(self) -> Dict[str, list]:
        return {"critical": list(self.critical), "best_effort": list(self.best_effort),
                "nodes": {n: len(p) for n, p in self.pools.items()}}

    # ------------------------------------------------------------------ saving
    async def save(self, step: int, parts: List[dict], refs: List[Any],
                   metrics: Optional[Dict[str, float]] = None, upload: bool = False) -> Dict[str, Any]:
        """Accept a version and return its SaveResult (as a dict) once it is committed locally.

        ``parts[i]`` describes ``refs[i]`` (name, rank, strategy, size); parts with ``loader=True``
        have no ref. ``upload``: whether it is this version's turn to be uploaded (``remote_every``),
        as the caller counted its saves. Raises SaveError if the version cannot commit."""
        if self.resume_uploads:
            self._resume()
        t0 = time.perf_counter()
        version = step
        merged = version in self.catalogue.pending
        self.catalogue.begin(version, step, parts, metrics)
        if not merged:
            self._opened(version, upload)
        stored = [p for p in parts if not p.get("loader")]
        if len(stored) != len(refs):
            self.catalogue.fail(version, "internal: parts and refs differ in number")
        for p, ref in zip(stored, refs):
            self._dispatch(version, p["name"], int(p.get("rank", 0)), ref, int(p.get("nbytes", 0)))
        self._watch_pushed(version)
        await self._progress(version)
        result = await self.commit_futures[version]
        result["seconds"] = time.perf_counter() - t0
        return result

    def _opened(self, version: int, upload: bool = False) -> None:
        if self.remote is not None and upload:
            self.upload_due.add(version)
        self.commit_futures[version] = asyncio.get_running_loop().create_future()
        self.settled_futures[version] = asyncio.get_running_loop().create_future()
        self.version_locks[version] = asyncio.Lock()
        self.accepted_at[version] = time.perf_counter()
        self.metrics.set_in_flight(len(self.catalogue.pending))

    def _dispatch(self, version: int, name: str, rank: int, ref: Any, size: int) -> None:
        """Send one part's snapshot ref (inside a list: not resolved here) to the least busy writer."""
        part = self.catalogue.pending[version].parts[(name, rank)]
        part.submitted = True
        self._in_background(self._write(version, part, ref, size))

    async def _write(self, version: int, part: Any, ref: Any, size: int) -> None:
        if part.strategy is Strategy.BEST_EFFORT and self.best_effort:
            pool = self.best_effort  # may run anywhere: reads the snapshot over the network if needed
        else:
            pool = self._critical_on(await self._locate(ref))  # node affinity: a shared-memory read
        writer = min(pool, key=lambda w: self.outstanding.get(id(w), 0))
        self.outstanding[id(writer)] = self.outstanding.get(id(writer), 0) + size
        reuse = self.catalogue.reuse_for(part) if part.strategy is Strategy.RELOADABLE else None
        obj = writer.write_part.remote(version, part.name, part.rank, [ref], reuse=reuse,
                                       compression=self.cfg.compression)
        await self._track(version, part.name, part.rank, obj, writer, size)

    # ------------------------------------------------------------------ pushed states (ranks)
    def declare(self, name: str, strategy: str, world_size: int, replicated: bool = False,
                allow_pickle: bool = False) -> None:
        self.catalogue.declare(name, strategy, world_size, replicated, allow_pickle)
        self.local.put_bytes(DECLARED, json.dumps(self.catalogue.declared, sort_keys=True).encode())

    def declared(self) -> Dict[str, dict]:
        return dict(self.catalogue.declared)

    async def submit(self, step: int, name: str, rank: int, refs: List[Any], nbytes: int = 0,
                     upload: bool = False, after: int = -1) -> Dict[str, Any]:
        """A rank's part of ``name`` at ``step``; returns the SaveResult once the version commits.
        ``upload``: as in :meth:`save`, counted by the rank (the part that opens a version decides).
        ``after``: the step this rank pushed before (see ``Catalogue.barrier_violations``)."""
        if self.resume_uploads:
            self._resume()
        version = step
        d = self.catalogue.declared.get(name)
        if d is not None and d["replicated"] and rank != 0:
            rank_zero_only = True  # DDP-style replicas: rank 0's copy is the one stored
        else:
            rank_zero_only = False
            is_new = version not in self.catalogue.pending
            self.catalogue.accept_push(version, step, name, rank)
            if is_new:
                self._opened(version, upload)
                self._watch_pushed(version)
            for v in self.catalogue.barrier_violations(version, name, rank, after):
                pv = self.catalogue.pending[v]
                self.catalogue.fail(v, f"ranks disagree on the step: state {name!r} rank {rank} submitted step "
                                       f"{step} while version {v} (step {pv.step}) still awaits its part")
                log.error("version %d: %s", v, pv.error)
                await self._progress(v)
            self._dispatch(version, name, rank, refs[0], nbytes)
            await self._progress(version)
        while version not in self.commit_futures:  # a non-zero replica rank ran ahead of rank 0
            await asyncio.sleep(0.05)
        result = await self.commit_futures[version]
        return dict(result, rank_zero_only=rank_zero_only)

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
        why = f"no part arrived within rank_timeout_s={self.cfg.rank_timeout_s}s"
        log.error("version %d: %s from %s", version, why, ", ".join(pv.missing_submits()))
        for p in list(pv.parts.values()):
            if not p.submitted:
                p.submitted = True
                self.catalogue.part_failed(version, p.name, p.rank, why)
        await self._progress(version)

    async def _track(self, version: int, name: str, rank: int, obj, writer, size: int) -> None:
        try:
            result = await obj
            for f in result["files"]:
                if not result.get("reused"):
                    self.file_nodes[f["path"]] = result.get("node", self.node_id)
            self.catalogue.part_written(version, name, rank, result)
        except Exception as exc:  # reaches the handle through the commit future
            if isinstance(_root_cause(exc), UnsupportedTypeError):
                self.unsupported.add(version)  # the handle raises the same class as an in-process save
            msg = one_line(getattr(exc, "cause", None) or exc)
            log.error("version %d: state %r rank %d failed: %s", version, name, rank, msg)
            self.last_error = f"version {version} state {name!r} rank {rank}: {msg}"
            self.catalogue.part_failed(version, name, rank, msg)
        finally:
            self.outstanding[id(writer)] = max(0, self.outstanding.get(id(writer), 0) - size)
        await self._progress(version)

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
                manifest = self.catalogue.manifest_for(version)
                t_commit = time.perf_counter()
                try:
                    await asyncio.to_thread(write_manifest, self.local, manifest)
                except Exception as exc:  # reported below, once its files are removed
                    self.catalogue.fail(version, f"writing the manifest failed: {one_line(exc)}")
                else:
                    self.catalogue.mark_committed(version, manifest)
                    self.commits += 1
                    self.metrics.committed("local", time.perf_counter() - self.accepted_at.get(version, 0.0),
                                           self.catalogue.bytes_written(version))
                    fut.set_result({"version": version, "step": pv.step, "durability": "local",
                                    "bytes_written": self.catalogue.bytes_written(version) + len(manifest.to_json()),
                                    "states": sorted(pv.strategies),
                                    "stages": dict(pv.stages(),
                                                   manifest_s=time.perf_counter() - t_commit)})
                    self._plan_remote(version)
            # best-effort parts that landed after the commit (or while its manifest was being written)
            # join the manifest; loop, because another may land during the rewrite
            while pv.committed and version in self.catalogue.committed:
                manifest = self.catalogue.manifest_for(version)
                if manifest.to_json() == self.catalogue.committed[version].to_json():
                    break
                try:
                    await asyncio.to_thread(write_manifest, self.local, manifest)
                    self.catalogue.committed[version] = manifest
                except Exception as exc:  # the committed manifest stays; the late part is reported
                    self.last_error = f"version {version}: adding best-effort parts to the manifest " \
                                      f"failed: {one_line(exc)}"
                    log.error(self.last_error)
                    break
            if not self.catalogue.settled(version):
                return
            self.catalogue.finish(version)
            if not pv.error:
                self.unsupported.discard(version)
            settled = self.settled_futures.get(version)
            if settled is not None and not settled.done():
                settled.set_result(True)
            self.metrics.set_in_flight(len(self.catalogue.pending))
            self._prune_bookkeeping()
        if pv.error:  # never listed: remove what its parts wrote, then fail the handle (if not yet)
            try:
                await self._delete_everywhere(version, self.catalogue.kept_paths(set()), [])
            finally:
                if not fut.done():
                    self._fail_handle(version, pv, fut)
        else:
            uploaded = self.remote_committed.get(version)
            current = self.catalogue.committed.get(version)
            if version in self.remote_pending or (uploaded is not None and current is not None
                                                  and uploaded.to_json() != current.to_json()):
                self._in_background(self._sync_remote(version))  # best-effort parts landed since
            await self._apply_retention()

    def _fail_handle(self, version: int, pv: PendingVersion, fut: asyncio.Future) -> None:
        """Fail the save's handle with the version's error. A handle raising once every part has
        ended is raised after the failed version's files are removed: a user who looks at the disk
        then finds none of them."""
        self._missed_remote(version)
        self.failures += 1
        self.metrics.failed("save")
        error = UnsupportedTypeError if version in self.unsupported else SaveError
        self.unsupported.discard(version)
        fut.set_exception(
            error(f"version {version} (step {pv.step}) of run {self.cfg.run!r} failed and is not listed: {pv.error}"))

    def _prune_bookkeeping(self, keep: int = 32) -> None:
        """Forget futures and locks of old, finished versions (wait() answers those from the catalogue)."""
        for v in sorted(self.commit_futures)[:-keep]:
            remote = self.remote_futures.get(v)
            if v in self.catalogue.pending or v in self.remote_pending or (remote is not None and not remote.done()):
                continue
            for d in (self.commit_futures, self.remote_futures, self.version_locks, self.accepted_at,
                      self.remote_bytes, self.settled_futures):
                d.pop(v, None)
            self.remote_locks.pop(v, None)

    async def _delete_everywhere(self, version: int, keep: Set[str], referenced: List[str]) -> None:
        """Delete a version from every node's local tier (each node's local tier is its own disk)."""
        await asyncio.to_thread(delete_version, self.local, version, keep, referenced)
        others = [pool[0] for node, pool in self.pools.items() if node != self.node_id and pool]
        results = await asyncio.gather(*[w.delete_version.remote(version, keep, referenced) for w in others],
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, Exception):
                log.warning("version %d: deleting on another node failed: %s", version, one_line(r))
        for path in [p for p in self.file_nodes if p.startswith(f"v{version:012d}/") or p in referenced]:
            if path not in keep:
                self.file_nodes.pop(path, None)

    # ------------------------------------------------------------------ remote tier
    def _plan_remote(self, version: int) -> None:
        """Upload ``version`` (just committed) if its turn has come.

        Turns go by the order of the engine's save() calls (every ``remote_every``-th; the engine
        counts and says so with each call, since this actor may run concurrent calls in any order),
        not by the order versions commit in: versions written in parallel commit in any order, and
        "every M-th" must name the same versions on every run. A version whose turn it was and that failed (or
        whose upload cannot be made) passes its turn to the next version to commit."""
        if self.remote is None:
            return
        loop = asyncio.get_running_loop()
        self.remote_futures.setdefault(version, loop.create_future())
        every = self.cfg.remote_every
        if version not in self.upload_due and not self.remote_owed:
            self.remote_futures[version].set_exception(SaveError(
                f"version {version} is not uploaded: remote_every={every} uploads one in every {every} versions "
                f"saved: save() calls number {every}, {2 * every}, {3 * every}, ... (or the next to commit after "
                f"such a one failed)"))
            return
        self.upload_due.discard(version)
        self.remote_owed = False
        self.remote_pending.add(version)
        self._in_background(self._sync_remote(version))

    def _missed_remote(self, version: int, due: bool = False) -> None:
        """A version failed (or its upload did): if it was ``due`` for upload, the remote tier must
        not wait M more versions for a copy."""
        if self.remote is not None and (due or version in self.upload_due):
            self.remote_owed = True
        self.upload_due.discard(version)

    async def _sync_remote(self, version: int) -> None:
        lock = self.remote_locks.setdefault(version, asyncio.Lock())
        backoff = 0.5
        async with lock:
            while True:
                manifest = self.catalogue.committed.get(version)
                if manifest is None or version in self.remote_given_up:  # a re-sync queued behind the failure
                    self.remote_pending.discard(version)
                    return
                uploaded = self.remote_committed.get(version)
                if uploaded is not None and uploaded.to_json() == manifest.to_json():
                    self.remote_pending.discard(version)
                    return
                files = [f.__dict__ for s in manifest.states.values() for f in s.all_files()
                         if f.path not in self.remote_paths]
                try:
                    by_node: Dict[str, list] = {}
                    for f in files:  # upload from the node whose local tier holds the file
                        by_node.setdefault(self.file_nodes.get(f["path"], self.node_id), []).append(f)
                    await asyncio.gather(*[
                        min(self._critical_on(node), key=lambda w: self.outstanding.get(id(w), 0)).upload.remote(fs)
                        for node, fs in by_node.items()])
                    self.remote_paths.update(f["path"] for f in files)
                    await asyncio.to_thread(write_manifest, self.remote, manifest)
                except Exception as exc:
                    msg = one_line(getattr(exc, "cause", None) or exc)
                    self.remote_errors[version] = msg
                    self.last_error = f"version {version} upload: {msg}"
                    self.metrics.failed("upload")
                    if isinstance(_root_cause(exc), IntegrityError):  # the local copy is bad: no retry helps
                        log.error("version %d: not uploaded, its local copy cannot be: %s", version, msg)
                        self.remote_given_up.add(version)
                        self.remote_pending.discard(version)
                        self._missed_remote(version, due=True)
                        try:  # what this version's attempts left on the remote tier (never listed: no manifest)
                            kept = {p for m in self.remote_committed.values() for p in m.referenced_paths()}
                            await asyncio.to_thread(delete_version, self.remote, version, kept, [])
                        except Exception as cleanup:
                            log.warning("version %d: removing its partial upload failed: %s", version,
                                        one_line(cleanup))
                        fut = self.remote_futures.setdefault(version, asyncio.get_running_loop().create_future())
                        if not fut.done():  # raised once the leftovers are gone
                            fut.set_exception(SaveError(f"version {version} of run {self.cfg.run!r} cannot be "
                                                        f"uploaded: {msg}"))
                        break
                    log.warning("version %d: remote upload failed, retrying in %.1fs: %s", version, backoff, msg)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                self.remote_committed[version] = manifest
                self.remote_errors.pop(version, None)
                uploaded_bytes = sum(f["size"] for f in files) + len(manifest.to_json())
                self.remote_bytes[version] = self.remote_bytes.get(version, 0) + uploaded_bytes
                self.metrics.committed("remote", time.perf_counter() - self.accepted_at.get(version, 0.0),
                                       uploaded_bytes)
                self.remote_pending.discard(version)
                fut = self.remote_futures.setdefault(version, asyncio.get_running_loop().create_future())
                if not fut.done():
                    fut.set_result({"version": version, "step": manifest.step, "durability": "remote",
                                    "bytes_written": self.remote_bytes.get(version, 0),
                                    "states": sorted(manifest.states)})
                break
        await self._apply_remote_retention()
        await self._apply_retention()  # a local version held back for its upload may go now

    async def wait(self, version: int, durability: str = "local", best_effort: bool = False) -> Dict[str, Any]:
        """The SaveResult once ``version`` is committed on the ``durability`` tier; with
        ``best_effort=True`` also once its best-effort parts are written (or reported missing)."""
        if self.resume_uploads:
            self._resume()
        if durability not in ("local", "remote"):
            raise SaveError(f"durability must be 'local' or 'remote', got {durability!r}")
        if best_effort:
            result = await self.wait(version, "local")
            settled = self.settled_futures.get(version)
            if settled is not None:
                await settled
            if durability == "local":
                m = self.catalogue.committed.get(version)
                return dict(result, missing=sorted(n for n, e in m.states.items() if e.status == "missing")
                            if m else [])
            # a manifest updated by late best-effort parts is uploaded again: wait for that copy
            while version in self.remote_pending or (
                    version in self.catalogue.committed and version in self.remote_committed
                    and self.remote_committed[version].to_json() != self.catalogue.committed[version].to_json()):
                await asyncio.sleep(0.05)
            return await self.wait(version, "remote")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        # an async actor may run this call before the save() submitted just before it: wait a little
        while (version not in self.commit_futures and version not in self.catalogue.committed
               and version not in self.remote_committed and version not in self.catalogue.failed
               and loop.time() < deadline):
            await asyncio.sleep(0.02)
        if version in self.catalogue.failed and version not in self.commit_futures:
            raise SaveError(f"version {version} of run {self.cfg.run!r} failed: {self.catalogue.failed[version]}")
        if version not in self.commit_futures:
            if version in self.catalogue.committed and durability == "local":
                m = self.catalogue.committed[version]
                return {"version": version, "step": m.step, "durability": "local", "bytes_written": m.bytes,
                        "states": sorted(m.states)}
            if version in self.remote_committed:
                m = self.remote_committed[version]
                return {"version": version, "step": m.step, "durability": durability,
                        "bytes_written": m.bytes, "states": sorted(m.states)}
            if version in self.remote_futures and version in self.catalogue.committed:  # resumed upload
                return await self.remote_futures[version]
            raise SaveError(f"version {version} is unknown to the coordinator of run {self.cfg.run!r} "
                            f"(it may have restarted while the save was in flight)")
        result = await self.commit_futures[version]
        if durability == "local":
            return result
        if self.remote is None:
            raise SaveError(f"run {self.cfg.run!r} has no remote tier (remote_uri was not given)")
        fut = self.remote_futures.setdefault(version, asyncio.get_running_loop().create_future())
        return await fut

    def remote_error(self, version: int) -> Optional[str]:
        return self.remote_errors.get(version)

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
        newer_remote = sorted(v for v in self.remote_committed if v > version)
        if newer_remote:
            keep_r = {p for v, m in self.remote_committed.items() if v <= version for p in m.referenced_paths()}
            for v in newer_remote:
                m = self.remote_committed.pop(v)
                self.remote_pending.discard(v)
                await asyncio.to_thread(delete_version, self.remote, v, keep_r, m.referenced_paths())
                self.remote_paths -= set(m.referenced_paths()) - keep_r
        gone = sorted(set(newer_local) | set(newer_remote))
        if gone:
            log.warning("rewind to version %d deleted versions %s", version, gone)
        return gone

    # ------------------------------------------------------------------ retention
    async def _apply_retention(self) -> None:
        doomed = self.catalogue.plan_retention(self.cfg.local_policy(), protect=self.remote_pending)
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
        if self.remote is None:
            return
        infos = [VersionInfo(v, m.step, m.metrics) for v, m in self.remote_committed.items()]
        doomed = plan_deletions(self.cfg.remote_policy(), infos, self.remote_pending)
        if not doomed:
            return
        keep = {p for v, m in self.remote_committed.items() if v not in doomed for p in m.referenced_paths()}
        keep |= {p for v in self.remote_pending for p in self.catalogue.committed.get(v, Manifest("", v, 0, 0)).referenced_paths()}
        for v in doomed:
            m = self.remote_committed.pop(v)
            await asyncio.to_thread(delete_version, self.remote, v, keep, m.referenced_paths())
            self.remote_paths -= set(m.referenced_paths()) - keep

    def _resume(self) -> None:
        """Start the uploads found undone at start-up (needs the event loop: first async call)."""
        versions, self.resume_uploads = self.resume_uploads, []
        for v in versions:
            log.warning("version %d: committed locally but not uploaded before a restart; uploading it now", v)
            self.remote_futures.setdefault(v, asyncio.get_running_loop().create_future())
            self._in_background(self._sync_remote(v))

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
        if self.resume_uploads:
            self._resume()
        deadline = time.monotonic() + timeout
        while self.background:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(list(self.background), timeout=left)
        unfinished = [f"version {v}: {pv.stage()}" for v, pv in sorted(self.catalogue.pending.items())]
        unfinished += [f"version {v}: upload" for v in sorted(self.remote_pending)]
        return unfinished if self.background else []

    async def ready(self) -> bool:
        """Wait until every writer has started, so the first save does not pay for worker start-up."""
        if self.resume_uploads:
            self._resume()
        await asyncio.gather(*[w.__ray_ready__.remote() for w in self.critical + self.best_effort])
        return True


CoordinatorActor = ray.remote(CheckpointCoordinator)
