"""Writer actors: serialise a snapshot, checksum it while writing, persist it to the local tier, and
upload committed files to the remote tier.

``PartWriter`` is the plain object that does the work (unit-testable without Ray); ``WriterActor`` is
the thin Ray shell, created in two pools by the coordinator: a critical pool and a smaller,
lower-priority best-effort pool, each with its own resources.
"""
from __future__ import annotations

import dataclasses
import os
import time
import uuid
import asyncio
import concurrent.futures
import logging
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoint_io import content_hash, delete_version, shard_record, write_append_only, write_flat
from .errors import CheckpointError, IntegrityError, SaveError, UnsupportedTypeError, one_line
from .formats.manifest import FileEntry
from .formats.tree import Flat
from .protocol import WrittenPart
from .snapshot_mailbox import PendingSnapshot, resolve_snapshot
from .storage.durable_batch import DurableBatch, remove_temporaries
from .storage.tier import RateLimit, Tier

log = logging.getLogger("ray_ckpt.writers")


class PartWriter:
    def __init__(self, local: Tier, remote: Optional[Tier] = None, *, upload_retries: int = 4,
                 retry_base_s: float = 0.25, nice: int = 0, write_threads: int = 1,
                 direct_io: bool = False, max_bytes_per_s: Optional[float] = None,
                 upload_bytes_per_s: Optional[float] = None):
        self.local = local
        if max_bytes_per_s:
            local.rate_limit = RateLimit(max_bytes_per_s)
        if remote is not None and upload_bytes_per_s:
            remote.rate_limit = RateLimit(upload_bytes_per_s)  # shared by this writer's upload threads
        self.write_threads = write_threads
        self.direct_io = direct_io
        self.remote = remote
        self.upload_retries = upload_retries
        self.retry_base_s = retry_base_s
        if nice:
            try:
                os.nice(nice)  # below training: checkpoint I/O must not slow the learner
            except OSError:
                pass

    def write_part(self, version: int, name: str, rank: int, flat: Flat, *,
                   reuse: Optional[Dict[str, List[dict]]] = None,
                   compression: Optional[str] = None,
                   append_base: Optional[List[dict]] = None) -> WrittenPart:
        """Write one (state, rank) part to the local tier.

        ``reuse`` maps content hashes already stored (RELOADABLE states) to their files: when this
        part's content hash is among them, nothing is written and the old files are referenced.
        ``append_base`` (an append-only state): the files of the newest committed version's part
        (maybe none); only the rows added since then are written (``formats.segments``).
        """
        t0 = time.perf_counter()
        if append_base is not None:
            files, written = write_append_only(self.local, version, name, rank, flat,
                                               [_entry(f) for f in append_base], compression,
                                               self.write_threads, self.direct_io)
            return WrittenPart(tuple(files), written, write_s=time.perf_counter() - t0)
        chash = None
        if reuse is not None:
            chash = content_hash(flat)
            if chash in reuse:
                files = tuple(_entry(f) for f in reuse[chash])
                return WrittenPart(files, 0, chash, reused=True, write_s=time.perf_counter() - t0,
                                   shards=_shards_of(flat, files))
        files = write_flat(self.local, version, name, rank, flat, compression, self.write_threads, self.direct_io)
        return WrittenPart(tuple(files), sum(f.size for f in files), chash, write_s=time.perf_counter() - t0,
                           shards=_shards_of(flat, files))

    def write_parts(self, version: int, parts: List[Tuple[str, int, Union[Flat, BaseException]]], *,
                    compression: Optional[str] = None) -> List[Union[WrittenPart, BaseException]]:
        """Write many (state, rank) parts of ``version`` as one durable batch (``DurableBatch``):
        every file under a temporary name, then their contents synced together, renamed, and each
        directory fsynced once. Returns, per part in order, its WrittenPart or the error that
        stopped it (a part given as an exception: its snapshot failed). Nothing is reported
        written before the whole batch is durable; if the batch's sync fails, every part fails."""
        t0 = time.perf_counter()
        batch = DurableBatch()
        out: List[Union[WrittenPart, BaseException]] = []
        try:
            for name, rank, flat in parts:
                if isinstance(flat, BaseException):
                    out.append(flat)
                    continue
                try:
                    files = write_flat(self.local, version, name, rank, flat, compression, self.write_threads,
                                       self.direct_io, batch=batch)
                    out.append(WrittenPart(tuple(files), sum(f.size for f in files), None,
                                           shards=_shards_of(flat, files)))
                except Exception as exc:  # this part fails; the batch's other parts go on
                    out.append(exc if isinstance(exc, CheckpointError) else
                               SaveError(f"writing state {name!r} rank {rank} failed: {one_line(exc)}"))
            batch.commit()
        except OSError as exc:
            batch.abort()
            err = SaveError(f"making {len(batch)} file(s) of version {version} durable on "
                            f"{self.local.describe('')} failed: {one_line(exc)}")
            return [r if isinstance(r, BaseException) else err for r in out] + [err] * (len(parts) - len(out))
        except BaseException:
            batch.abort()
            raise
        write_s = time.perf_counter() - t0  # the batch's time: each part was durable only at its end
        return [r if isinstance(r, BaseException) else dataclasses.replace(r, write_s=write_s) for r in out]

    def upload(self, files: Iterable[Union[FileEntry, dict]]) -> int:
        """Copy committed local files to the remote tier, verifying each against its manifest
        checksum while streaming. Transient errors retry with exponential backoff."""
        if self.remote is None:
            raise SaveError("no remote tier is configured")
        total = 0
        for f in map(_entry, files):
            for attempt in range(self.upload_retries + 1):
                try:
                    size, digest = self.local.copy_to(self.remote, f.path)
                    break
                except FileNotFoundError:
                    raise IntegrityError(f"cannot upload {f.path}: the local copy is missing") from None
                except OSError as exc:
                    if attempt == self.upload_retries:
                        raise SaveError(f"uploading {f.path} to {self.remote.describe(f.path)} failed after "
                                        f"{attempt + 1} attempts: {one_line(exc)}") from None
                    time.sleep(min(self.retry_base_s * (2 ** attempt), 5.0))
            if (size, digest) != (f.size, f.checksum):
                self.remote.delete_file(f.path)
                raise IntegrityError(f"local copy of {f.path} does not match its manifest; not uploaded")
            total += size
        return total


@ray.remote(max_restarts=-1, max_task_retries=2, concurrency_groups={"upload": 2})
class WriterActor:
    """Ray shell over PartWriter. Snapshot refs arrive inside a list so Ray does not resolve them in
    the coordinator; the writer fetches them from the object store (zero-copy on its node).

    Uploads run in their own concurrency group: a slow or unreachable remote store never delays
    the local writes that commits wait for."""

    def __init__(self, config: Any, pool: str, nice: int = 0):
        # tiers are resolved here, in the writer's own process: a local_dir with "{node_id}" is this node's
        self.pool = pool
        self.node = ray.get_runtime_context().get_node_id()
        limit = config.best_effort_max_mb_s if pool == "best_effort" else None
        self.writer = PartWriter(config.local_tier(), config.remote_tier(), nice=nice,
                                 upload_retries=config.upload_retries, write_threads=config.write_threads,
                                 direct_io=config.direct_io,
                                 max_bytes_per_s=None if limit is None else limit * 1e6,
                                 upload_bytes_per_s=None if config.upload_max_mb_s is None
                                 else config.upload_max_mb_s * 1e6)

    def write_part(self, version: int, name: str, rank: int, refs: List[Any], **kw) -> WrittenPart:
        t0 = time.perf_counter()
        flat = self._snapshot(name, rank, refs[0])
        waited = time.perf_counter() - t0
        return self.writer.write_part(version, name, rank, flat, **kw).with_node(self.node, waited)

    def write_parts(self, version: int, keys: List[Tuple[str, int]], refs: List[Any],
                    compression: Optional[str] = None) -> List[Union[WrittenPart, BaseException]]:
        """Many parts of one version (``keys[i]`` is ``refs[i]``'s (state, rank)) written as one
        durable batch (``PartWriter.write_parts``); per part, its WrittenPart or its error."""
        t0 = time.perf_counter()
        flats: List[Any] = []
        try:
            flats = ray.get(refs)  # one call for the batch; per part below only if one of them failed
            if any(isinstance(f, PendingSnapshot) for f in flats):
                raise ray.exceptions.RayError("overlapped snapshots are resolved one by one")
        except ray.exceptions.RayError:
            flats = []
            for (name, rank), ref in zip(keys, refs):
                try:
                    flats.append(self._snapshot(name, rank, ref))
                except (SaveError, UnsupportedTypeError) as exc:
                    flats.append(exc)
        waited = time.perf_counter() - t0
        written = self.writer.write_parts(version, [(n, r, f) for (n, r), f in zip(keys, flats)],
                                          compression=compression)
        return [w if isinstance(w, BaseException) else w.with_node(self.node, waited) for w in written]

    @staticmethod
    def _snapshot(name: str, rank: int, ref: Any) -> Any:
        try:
            return resolve_snapshot(ray.get(ref))  # an overlapped snapshot: waits for its copy
        except ray.exceptions.RayTaskError as exc:  # the snapshot itself failed in the provider
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            error = UnsupportedTypeError if isinstance(cause, UnsupportedTypeError) else SaveError
            raise error(f"snapshot of state {name!r} (rank {rank}) failed: {one_line(cause)}") from None
        except ray.exceptions.RayError as exc:
            raise SaveError(f"snapshot of state {name!r} (rank {rank}) was lost: {one_line(exc)}") from None

    def delete_version(self, version: int, keep_paths: set, referenced: List[str]) -> List[str]:
        """Retention on this node's local tier (each node's local tier is its own disk)."""
        return delete_version(self.writer.local, version, keep_paths, referenced)

    def remove_temporaries(self, version: int) -> List[str]:
        """The ``*.tmp-*`` files a killed writer left in ``version`` on this node (see
        ``durable_batch.remove_temporaries``)."""
        return remove_temporaries(self.writer.local, version)

    @ray.method(concurrency_group="upload", max_task_retries=0)  # the coordinator retries uploads itself
    def upload(self, files: List[FileEntry]) -> int:
        return self.writer.upload(files)

    def node_id(self) -> str:
        return self.node

    def pid(self) -> int:
        return os.getpid()


def _shards_of(flat: Flat, files: Iterable[FileEntry]) -> Optional[dict]:
    """The shard record of a part with DTensor leaves (None otherwise): where its chunks lie in its
    tensors file, so that the manifest can index the state for resharded, ranged restores."""
    tensors = [f for f in files if f.role == "tensors"]
    return shard_record(flat, tensors[0].path) if len(tensors) == 1 else None


def _entry(f: Union[FileEntry, dict]) -> FileEntry:
    return f if isinstance(f, FileEntry) else FileEntry(**f)


class WriterPools:
    """The coordinator's writers: a critical pool per node that holds snapshots (created on first
    use: each node's local tier is its own disk, and a writer beside the snapshot reads it from
    shared memory), and one best-effort pool that runs anywhere. Each writer's queued bytes decide
    which one gets the next part."""

    def __init__(self, config: Any):
        self.cfg = config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.critical_by_node: Dict[str, list] = {self.node_id: self._make_pool(self.node_id)}
        self.best_effort = [self._writer("best_effort", config.best_effort_cpus, config.best_effort_nice)
                            for _ in range(config.best_effort_writers)]
        self.queued: Dict[int, int] = {}  # id(writer) -> bytes queued
        self.queued_parts: Dict[int, int] = {}  # id(writer) -> parts queued (pushes may not say their size)
        self._locator = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="locate")
        self._nodes: Set[str] = set()
        self._nodes_at = 0.0
        self._placing: Dict[str, List[Any]] = {}  # node -> its writers' node_id() calls, until answered
        self.unplaced: Dict[str, str] = {}  # node -> why its writers could not be placed (status())

    def _writer(self, pool: str, cpus: float, nice: int, node: Optional[str] = None):
        opts: Dict[str, Any] = {"num_cpus": cpus}
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        # named per run and pool, so the Ray dashboard tells runs and pools apart (a suffix keeps the
        # name unique while a restarted coordinator's old writers are still going away)
        opts["name"] = f"ray_ckpt.writer.{self.cfg.run}.{pool}.{(node or self.node_id)[:8]}.{uuid.uuid4().hex[:6]}"
        opts["namespace"] = "ray_ckpt"
        return WriterActor.options(**opts).remote(self.cfg, pool, nice)

    def _make_pool(self, node: str) -> list:
        return [self._writer("critical", self.cfg.critical_cpus, self.cfg.critical_nice, node)
                for _ in range(self.cfg.critical_writers)]

    @property
    def critical(self) -> list:
        return [w for pool in self.critical_by_node.values() for w in pool]

    def all(self) -> list:
        return self.critical + self.best_effort

    def critical_on(self, node: Optional[str]) -> list:
        """The critical pool of ``node`` (created on first use), or this node's when unknown/gone."""
        if node and node not in self.critical_by_node and node not in self.unplaced:
            self._nodes_at = 0.0
            if node in self._alive_nodes():
                self.critical_by_node[node] = self._make_pool(node)
                self._placing[node] = [w.node_id.remote() for w in self.critical_by_node[node]]
        return self.critical_by_node.get(node) or self.critical_by_node[self.node_id]

    async def critical_placed(self, node: Optional[str]) -> list:
        """``critical_on(node)`` once its writers run. A pool not placed within
        ``writer_placement_s`` (no CPU left on that node for ``critical_cpus``) is given up: its
        actors are killed, the node is listed in ``unplaced`` (status()) and this node's pool is
        returned, whose writers read the snapshot over the network: a save never waits for a
        writer that cannot start."""
        pool = self.critical_on(node)
        calls = self._placing.get(node) if node else None
        if not calls:
            return pool
        try:
            await asyncio.wait_for(asyncio.gather(*calls), self.cfg.writer_placement_s)
            self._placing.pop(node, None)
            return pool
        except asyncio.TimeoutError:
            pass
        if self._placing.pop(node, None) is not None:  # the first waiter gives the pool up
            for w in self.critical_by_node.pop(node, []):
                ray.kill(w)
            self.unplaced[node] = (f"no critical writer placed within {self.cfg.writer_placement_s:g}s (each needs "
                                   f"num_cpus={self.cfg.critical_cpus:g} free on that node); its parts are written "
                                   f"by writers on node {self.node_id[:12]}, reading over the network")
            log.error("node %s: %s", node[:12], self.unplaced[node])
        return self.critical_by_node[self.node_id]

    def least_busy(self, pool: list) -> Any:
        return min(pool, key=self._load)

    def _load(self, writer: Any) -> Tuple[int, int]:
        return self.queued.get(id(writer), 0), self.queued_parts.get(id(writer), 0)

    def add_queued(self, writer: Any, nbytes: int, parts: int = 0) -> None:
        self.queued[id(writer)] = max(0, self.queued.get(id(writer), 0) + nbytes)
        self.queued_parts[id(writer)] = max(0, self.queued_parts.get(id(writer), 0) + parts)

    def spread(self, pool: list, items: List[Any], most: int) -> List[Tuple[Any, List[Any]]]:
        """``items`` (parts of one version) in chunks of at most ``most``, spread over ``pool``'s
        writers, least busy first: a version's parts are written by all of a node's writers at
        once, not queued on one."""
        if not items:
            return []
        n = max(-(-len(items) // most), min(len(pool), len(items)))
        size = -(-len(items) // n)
        order = sorted(pool, key=self._load)
        return [(order[i % len(order)], items[i * size:(i + 1) * size]) for i in range(n) if items[i * size:]]

    def queued_bytes(self, pool: list) -> int:
        return sum(self.queued.get(id(w), 0) for w in pool)

    def other_nodes(self) -> list:
        """One critical writer on every node but this one (for deletions on their local tiers)."""
        return [pool[0] for node, pool in self.critical_by_node.items() if node != self.node_id and pool]

    def _alive_nodes(self) -> Set[str]:
        now = time.monotonic()
        if now - self._nodes_at > 5.0:
            self._nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            self._nodes_at = now
        return self._nodes

    @staticmethod
    def _locate_blocking(ref: Any) -> Optional[str]:
        ray.wait([ref], num_returns=1, fetch_local=False)
        # the coordinator only borrows the ref: the owner's location report can lag the object's
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

    @staticmethod
    def _locate_many_blocking(refs: List[Any]) -> List[Optional[str]]:
        """``_locate_blocking`` for many refs with one wait and one location query per round."""
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        out: List[Optional[str]] = [None] * len(refs)
        todo = list(range(len(refs)))
        deadline = time.monotonic() + 3.0
        while todo and time.monotonic() < deadline:
            locs = ray.experimental.get_object_locations([refs[i] for i in todo])
            rest = []
            for i in todo:
                loc = locs.get(refs[i]) or {}
                if loc.get("node_ids"):
                    out[i] = loc["node_ids"][0]
                elif not 0 < (loc.get("object_size") or 0) < 100 * 1024:  # small ones are inlined: no node
                    rest.append(i)
            todo = rest
            if todo:
                time.sleep(0.025)
        return out

    async def locate_many(self, refs: List[Any]) -> List[Optional[str]]:
        """``locate`` for the parts of one batch (one thread-pool call, not one per part)."""
        if len(self._alive_nodes()) <= 1:
            return [None] * len(refs)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._locator, self._locate_many_blocking, refs)
        except Exception as exc:  # a failed snapshot has no location: the writer reports its error
            log.info("no location for %d snapshot(s) (%s); writing them from this node", len(refs), one_line(exc))
            return [None] * len(refs)

    async def locate(self, ref: Any) -> Optional[str]:
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


def preload() -> None:
    """Does nothing. Run as a Ray task, it has an idle worker process import this module (what a
    writer needs) before a writer actor takes that process: ``run_lifetime.start_run``."""
