"""Writer actors: ``WriterActor`` is the thin Ray shell over ``part_writer.PartWriter`` (the plain
object that does the work), created in two pools by the coordinator (``WriterPools``): a critical
pool and a smaller, lower-priority best-effort pool, each with its own resources.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..capture.mailbox import PendingSnapshot, resolve_snapshot
from ..capture.priority import lower_process_priority
from ..errors import SaveError, UnsupportedTypeError, one_line
from ..formats.manifest import FileEntry
from ..protocol import WrittenPart
from ..ray_internals import object_locations
from ..storage.checkpoint_io import delete_version
from ..storage.durable_batch import remove_temporaries
from .part_writer import PartWriter
from .replicas import send_files

log = logging.getLogger("ray_ckpt.writers")


# a preemption notice's uploads at once on one writer: as many as the evacuation runs moves side by side,
# so the newest version's copy (committed during the notice, after older ones began) starts at once too
URGENT_UPLOADS = 4


@ray.remote(max_restarts=-1, max_task_retries=2,
            concurrency_groups={"upload": 2, "urgent": URGENT_UPLOADS, "replicate": 1})
class WriterActor:
    """Ray shell over PartWriter. Snapshot refs arrive inside a list so Ray does not resolve them in
    the coordinator; the writer fetches them from the object store (zero-copy on its node).

    Uploads run in their own concurrency group: a slow or unreachable remote store never delays
    the local writes that commits wait for. A preemption notice's uploads have a group of their own
    (``upload_urgent``, ``URGENT_UPLOADS`` slots): they never queue behind the run's routine uploads
    on this writer, nor the newest behind older ones."""

    def __init__(self, config: Any, pool: str, nice: int = 0):
        # tiers are resolved here, in the writer's own process: a local_dir with "{node_id}" is this node's
        self.pool = pool
        self.node = ray.get_runtime_context().get_node_id()
        # Ray restarted this writer (max_restarts): a call it retries may have left temporaries
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        limit = config.best_effort_max_mb_s if pool == "best_effort" else None
        lower_process_priority(nice)  # every thread below training (capture/priority.py)
        self.writer = PartWriter(config.local_tier(), config.remote_tier(),
                                 upload_retries=config.upload_retries, write_threads=config.write_threads,
                                 direct_io=config.direct_io,
                                 max_bytes_per_s=None if limit is None else limit * 1e6,
                                 upload_bytes_per_s=None if config.upload_max_mb_s is None
                                 else config.upload_max_mb_s * 1e6)

    def write_part(self, version: int, name: str, rank: int, refs: List[Any], **kw) -> WrittenPart:
        t0 = time.perf_counter()
        flat = self._snapshot(name, rank, refs[0])
        waited = time.perf_counter() - t0
        return self.writer.write_part(version, name, rank, flat, **kw).with_node(self.node, waited, self.restarted)

    def write_parts(self, version: int, keys: List[Tuple[str, int]], refs: List[Any],
                    compression: Optional[str] = None) -> List[Union[WrittenPart, BaseException]]:
        """Many parts of one version (``keys[i]`` is ``refs[i]``'s (state, rank)) written as one
        durable batch (``PartWriter.write_parts``); per part, its WrittenPart or its error."""
        t0 = time.perf_counter()
        flats: List[Any] = []
        try:
            # one call for the batch (the small snapshots came inline: capture.calls._sendable); per
            # part below only if one of them failed
            got = iter(ray.get([r for r in refs if isinstance(r, ray.ObjectRef)]))
            flats = [next(got) if isinstance(r, ray.ObjectRef) else r for r in refs]
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
        return [w if isinstance(w, BaseException) else w.with_node(self.node, waited, self.restarted) for w in written]

    @staticmethod
    def _snapshot(name: str, rank: int, ref: Any) -> Any:
        try:
            # an ObjectRef, or a small snapshot that came inline; an overlapped one waits for its copy
            return resolve_snapshot(ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref)
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

    @ray.method(concurrency_group="urgent", max_task_retries=0)
    def upload_urgent(self, files: List[FileEntry]) -> int:
        """:meth:`upload` in a slot of its own, for a version a preemption notice copies away: with
        uploads every version, the two routine slots can hold a queue of older versions' calls
        (Ray runs a group's calls in arrival order), behind which the newest version's copy would
        wait past the deadline; and the notice's own copies run side by side, so that the last save's
        (committed during the notice, after older copies began) does not wait for them either. A
        routine call for the same files queued before it skips what it copied."""
        return self.writer.upload(files, urgent=True)

    @ray.method(concurrency_group="replicate", max_task_retries=0)
    def replicate(self, version: int, files: List[FileEntry], holder: Any) -> int:
        """Send ``files`` of ``version`` from this node's local tier to a replica holder on
        another node (``replicas.send_files``); its own group, so local writes never wait for it."""
        return send_files(self.writer.local, version, files, holder)

    def node_id(self) -> str:
        return self.node

    def pid(self) -> int:
        return os.getpid()


RETRY_PLACEMENT_MAX_S = 600.0  # the longest wait between two placement attempts on an unplaced node


@dataclass
class _Retry:
    """The next attempt to place an unplaced node's critical pool (see ``WriterPools._retry_unplaced``)."""

    next_at: float
    backoff: float
    pool: Optional[list] = None
    calls: List[Any] = field(default_factory=list)
    started: float = 0.0


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
        self._retries: Dict[str, _Retry] = {}  # unplaced node -> its next placement attempt
        # nodes Ray drains (coordinator/evacuation.py): no new pool there (Ray refuses new actors on
        # them); a pool already there keeps writing until the node goes
        self.draining: Set[str] = set()

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
        if node and node in self.unplaced and node not in self.draining:
            self._retry_unplaced(node)
        if node and node not in self.critical_by_node and node not in self.unplaced and node not in self.draining:
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
        writer that cannot start. A pool Ray refuses to place (its node is drained or gone:
        ``ActorUnschedulableError``) is given up the same way, at once. The node is tried again
        later (``_retry_unplaced``)."""
        pool = self.critical_on(node)
        calls = self._placing.get(node) if node else None
        if not calls:
            return pool
        try:
            await asyncio.wait_for(asyncio.gather(*calls), self.cfg.writer_placement_s)
            self._placing.pop(node, None)
            return pool
        except asyncio.TimeoutError:
            why = (f"no critical writer placed within {self.cfg.writer_placement_s:g}s (each needs "
                   f"num_cpus={self.cfg.critical_cpus:g} free on that node)")
        except Exception as exc:  # Ray refused the placement: a drained node takes no new actor
            why = f"Ray could not place its critical writers ({one_line(exc)})"
        if self._placing.pop(node, None) is not None:  # the first waiter gives the pool up
            for w in self.critical_by_node.pop(node, []):
                ray.kill(w)
            self.unplaced[node] = (f"{why}; its parts are written by writers on node {self.node_id[:12]}, reading "
                                   f"over the network, until a later attempt places them")
            log.error("node %s: %s", node[:12], self.unplaced[node])
            wait = 2 * self.cfg.writer_placement_s
            self._retries[node] = _Retry(time.monotonic() + wait, wait)
        return self.critical_by_node[self.node_id]

    def _retry_unplaced(self, node: str) -> None:
        """Try an unplaced node's pool again, in the background: its CPUs may have been freed (a
        learner gone). The node's parts keep going to this node's writers until the new pool runs;
        a pool that does not start within ``writer_placement_s`` is given up again, and the next
        attempt waits twice as long (up to ``RETRY_PLACEMENT_MAX_S``)."""
        r = self._retries.get(node)
        now = time.monotonic()
        if r is None:
            return
        if r.pool is None:
            if now >= r.next_at and node in self._alive_nodes():
                r.pool, r.started = self._make_pool(node), now
                r.calls = [w.node_id.remote() for w in r.pool]
            return
        ready, _ = ray.wait(r.calls, num_returns=len(r.calls), timeout=0)
        try:
            placed = len(ready) == len(r.calls) and bool(ray.get(ready, timeout=0))
        except Exception:  # Ray refused the placement (the node drained or gone): a failed attempt
            placed, r.started = False, float("-inf")
        if placed:
            self.critical_by_node[node] = r.pool
            del self.unplaced[node], self._retries[node]
            log.warning("node %s: its critical writers are placed now; its parts are written there again", node[:12])
        elif now - r.started > self.cfg.writer_placement_s:
            for w in r.pool:
                ray.kill(w)
            r.backoff = min(2 * r.backoff, RETRY_PLACEMENT_MAX_S)
            r.pool, r.calls, r.next_at = None, [], now + r.backoff

    def least_busy(self, pool: list) -> Any:
        return min(pool, key=self._load)

    def _load(self, writer: Any) -> Tuple[int, int]:
        return self.queued.get(id(writer), 0), self.queued_parts.get(id(writer), 0)

    def add_queued(self, writer: Any, nbytes: int, parts: int = 0) -> None:
        self.queued[id(writer)] = max(0, self.queued.get(id(writer), 0) + nbytes)
        self.queued_parts[id(writer)] = max(0, self.queued_parts.get(id(writer), 0) + parts)

    def spread(self, pool: list, items: List[Any], most: int) -> List[Tuple[Any, List[Any]]]:
        """``items`` (parts of one version) in writer calls of at most ``most`` parts, spread over
        ``pool``'s writers, least busy first: a version's parts are written by all of a node's
        writers at once, not queued on one."""
        if not items:
            return []
        n = max(-(-len(items) // most), min(len(pool), len(items)))
        size = -(-len(items) // n)
        order = sorted(pool, key=self._load)
        return [(order[i % len(order)], items[i * size:(i + 1) * size]) for i in range(n) if items[i * size:]]

    def queued_bytes(self, pool: list) -> int:
        return sum(self.queued.get(id(w), 0) for w in pool)

    def forget_nodes(self, nodes: Set[str]) -> None:
        """Nodes judged lost: their writers went with them. Nothing is asked of them again (each
        retention pass asked every lost node's writer to delete, and logged Ray's refusal, node
        after node); a replacement node is a new node and gets a new pool."""
        for node in nodes:
            if node == self.node_id:
                continue
            self.critical_by_node.pop(node, None)
            self._placing.pop(node, None)
            self.unplaced.pop(node, None)
            self._retries.pop(node, None)

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
            locs = object_locations([ref]).get(ref) or {}
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
            locs = object_locations([refs[i] for i in todo])
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
        """``locate`` for the parts of one batch (one thread-pool call, not one per part). A
        snapshot that came inline (not an ObjectRef) has no node to prefer."""
        at = [i for i, r in enumerate(refs) if isinstance(r, ray.ObjectRef)]
        out: List[Optional[str]] = [None] * len(refs)
        if not at or len(self._alive_nodes()) <= 1:
            return out
        try:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(self._locator, self._locate_many_blocking, [refs[i] for i in at])
        except Exception as exc:  # a failed snapshot has no location: the writer reports its error
            log.info("no location for %d snapshot(s) (%s); writing them from this node", len(at), one_line(exc))
            return out
        for i, node in zip(at, found):
            out[i] = node
        return out

    async def locate(self, ref: Any) -> Optional[str]:
        """The node holding a snapshot once it is ready (not fetched here: fetch_local=False).

        The wait may last as long as the provider's current training call, so it runs on its own
        thread pool, never on the one that writes manifests."""
        if not isinstance(ref, ray.ObjectRef) or len(self._alive_nodes()) <= 1:
            return None  # a snapshot that came inline has no node to prefer
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._locator, self._locate_blocking, ref)
        except Exception as exc:  # a failed snapshot has no location: the writer reports its error
            log.info("no location for a snapshot (%s); writing it from this node", one_line(exc))
            return None


def preload() -> None:
    """Does nothing. Run as a Ray task, it has an idle worker process import this module (what a
    writer needs) before a writer actor takes that process: ``run_lifetime.start_run``."""
