"""``ReplicaHolder``: the Ray shell over a :class:`~ray_ckpt.writers.replica_store.ReplicaStore`, one
per node that holds peer replicas of a run (``create(..., peer_replicas=N)``).

Placed on its node by the coordinator (node affinity, no CPU reserved: it only holds bytes and
answers reads) and named (``capture.peer_reads.holder_name``) so that any process of the cluster
finds it to read; restarted by Ray if its process dies (it comes back empty and its spill directory
is cleared: the coordinator's repair pass sends the newest versions again). Detached from the
coordinator's process: a coordinator that Ray restarts finds its holders by name and adopts what
they hold.

Files arrive from a writer on the node that wrote them (``send_files``: read from that node's local
tier, verified, passed as arguments: Ray's object transfer moves them) or from another holder
(``copy_to``: re-replication after a node loss).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import ray

from ..capture.peer_reads import NAMESPACE, holder_handles, holder_name
from ..formats.manifest import FileEntry
from ..protocol import actor_name
from ..storage.layout import join_uri, peer_spill_dir
from ..storage.tier import Tier
from .replica_store import ReplicaStore, StoreUsage

WATCH_S = 5.0  # how often a holder checks that its run's coordinator still exists
DEFAULT_MEMORY_FRACTION = 0.1  # of the node's physical memory, when peer_memory_mb is not given


def default_budget() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_MEMORY_FRACTION)
    except (ValueError, OSError):
        return 1 << 30


def _as_array(buf: Any) -> np.ndarray:
    """Bytes as a uint8 array: Ray moves arrays through the object store without pickling a copy."""
    return np.frombuffer(buf, dtype=np.uint8)


def send_files(tier: Tier, version: int, files: Sequence[FileEntry], holder: Any) -> int:
    """Read ``files`` from ``tier`` (each verified against its entry) and have ``holder`` keep them
    for ``version``. Returns the bytes the holder newly stored."""
    blobs = [_as_array(tier.read_verified(f.path, f.size, f.checksum)) for f in files]
    return ray.get(holder.hold.remote(version, list(files), *blobs))


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=8)
class ReplicaHolder:
    def __init__(self, config: Any, key: str, budget: Optional[int] = None):
        self.node = ray.get_runtime_context().get_node_id()
        self.key = key
        spill = Tier(join_uri(config.local_base(self.node), peer_spill_dir(config.run, key)), "peer-spill")
        for path in spill.list_files(""):  # a restarted holder: what it spilled before is not indexed
            spill.delete_file(path)
        if budget is None:
            budget = default_budget() if config.peer_memory_mb is None else int(config.peer_memory_mb * 1e6)
        self.store = ReplicaStore(budget, config.peer_keep, spill)
        self.refs: Dict[str, Any] = {}  # path -> the object in this node's store that holds it
        threading.Thread(target=_exit_without_coordinator, args=(config.run,), name="ray_ckpt-holder-watch",
                         daemon=True).start()

    def hold(self, version: int, files: List[FileEntry], *blobs: Any) -> int:
        """Keep ``files`` (``blobs``: their bytes) for ``version``. What stays in memory is put in
        this node's object store as objects this holder owns (they outlive the sender: its node may
        be the one lost), so a reader pulls each one straight from the store (``ref_of``) and the
        holder copies nothing per read."""
        owned = []
        for f, b in zip(files, blobs):
            if len(b) != f.size:  # checked again (with the checksum) by the store
                owned.append((None, b))
                continue
            ref = ray.put(b)
            owned.append((ref, ray.get(ref)))
        added = self.store.put(version, files, [view for _, view in owned])
        self.refs.update({f.path: ref for f, (ref, _) in zip(files, owned) if ref is not None})
        self.refs = {p: r for p, r in self.refs.items() if self.store.in_memory(p)}
        return added

    def ref_of(self, path: str) -> Optional[List[Any]]:
        """[the object holding ``path``] when it is held in memory (in a list: Ray hands the ref
        over, not its bytes), None otherwise (spilled or not held: read it with ``get``)."""
        ref = self.refs.get(path)
        return None if ref is None else [ref]

    def get(self, path: str) -> Optional[Any]:
        data = self.store.get(path)
        return None if data is None else _as_array(data)

    def get_range(self, path: str, begin: int, end: int) -> Optional[Any]:
        data = self.store.get_range(path, begin, end)
        return None if data is None else _as_array(data)

    def index(self) -> Dict[int, List[str]]:
        return self.store.index()

    def checksums(self) -> Dict[int, Dict[str, str]]:
        return self.store.checksums()

    def verify(self, files: Dict[str, str]) -> Dict[str, Optional[str]]:
        """path -> why the copy held is not good (None: it verifies), for ``files`` (path -> the
        checksum the manifest names): the coordinator asks before it counts a copy as the last one."""
        return {path: self.store.verify(path, checksum) for path, checksum in files.items()}

    def usage(self) -> StoreUsage:
        return self.store.usage()

    def drop(self, versions: List[int]) -> None:
        self.store.drop(versions)
        self.refs = {p: r for p, r in self.refs.items() if self.store.in_memory(p)}

    def copy_to(self, version: int, other: Any) -> int:
        """Send every file held for ``version`` to holder ``other`` (after a node loss)."""
        files = self.store.entries(version)
        blobs = [self.store.get(f.path) for f in files]
        kept = [(f, b) for f, b in zip(files, blobs) if b is not None]
        return ray.get(other.hold.remote(version, [f for f, _ in kept], *[_as_array(b) for _, b in kept]))

    def node_id(self) -> str:
        return self.node


def _exit_without_coordinator(run: str) -> None:
    """Stop this (detached) holder once its run's coordinator is gone for good: a coordinator Ray
    restarts keeps its name meanwhile, one killed or stopped releases it."""
    name, seen = actor_name(run), False
    while True:
        time.sleep(WATCH_S)
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            seen = True
        except ValueError:
            if seen:  # (a holder started by hand, with no coordinator, is left alone)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return
        except Exception:  # the GCS busy or restarting: ask again at the next turn
            continue


def start_holder(config: Any, node: str) -> Any:
    """The holder of ``config.run`` on ``node`` (get-or-create by name). Detached, so that it
    outlives a restart of the coordinator that started it (a restarted coordinator adopts what it
    holds: ``coordinator/replication.py``); it stops itself when the coordinator is gone for good,
    and ``shutdown()`` stops it (``stop_holders``)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ReplicaHolder.options(name=holder_name(config.run, node[:12]), namespace=NAMESPACE, get_if_exists=True,
                                 lifetime="detached",
                                 scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                                 ).remote(config, node[:12])


def stop_holders(run: str) -> None:
    """Kill every replica holder of ``run`` (the run is being shut down)."""
    for handle in holder_handles(run).values():
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
