"""Writer actors: serialise a snapshot, checksum it while writing, persist it to the local tier, and
upload committed files to the remote tier.

``PartWriter`` is the plain object that does the work (unit-testable without Ray); ``WriterActor`` is
the thin Ray shell, created in two pools by the coordinator: a critical pool and a smaller,
lower-priority best-effort pool, each with its own resources.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import ray

from .checkpoint_io import content_hash, delete_version, write_flat
from .errors import IntegrityError, SaveError, UnsupportedTypeError, one_line
from .formats.manifest import FileEntry
from .formats.tree import Flat
from .storage.tier import RateLimit, Tier


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
                   compression: Optional[str] = None) -> Dict[str, Any]:
        """Write one (state, rank) part to the local tier.

        ``reuse`` maps content hashes already stored (RELOADABLE states) to their files: when this
        part's content hash is among them, nothing is written and the old files are referenced.
        """
        t0 = time.perf_counter()
        chash = None
        if reuse is not None:
            chash = content_hash(flat)
            if chash in reuse:
                return {"files": reuse[chash], "written": 0, "content_hash": chash, "reused": True,
                        "seconds": time.perf_counter() - t0}
        files = write_flat(self.local, version, name, rank, flat, compression, self.write_threads, self.direct_io)
        return {"files": [f.__dict__ for f in files], "written": sum(f.size for f in files),
                "content_hash": chash, "reused": False, "seconds": time.perf_counter() - t0}

    def upload(self, files: List[dict]) -> int:
        """Copy committed local files to the remote tier, verifying each against its manifest
        checksum while streaming. Transient errors retry with exponential backoff."""
        if self.remote is None:
            raise SaveError("no remote tier is configured")
        total = 0
        for f in map(lambda d: FileEntry(**d), files):
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

    def write_part(self, version: int, name: str, rank: int, refs: List[Any], **kw) -> Dict[str, Any]:
        t0 = time.perf_counter()
        try:
            flat = ray.get(refs[0])
        except ray.exceptions.RayTaskError as exc:  # the snapshot itself failed in the provider
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            error = UnsupportedTypeError if isinstance(cause, UnsupportedTypeError) else SaveError
            raise error(f"snapshot of state {name!r} (rank {rank}) failed: {one_line(cause)}") from None
        except ray.exceptions.RayError as exc:
            raise SaveError(f"snapshot of state {name!r} (rank {rank}) was lost: {one_line(exc)}") from None
        waited = time.perf_counter() - t0
        result = self.writer.write_part(version, name, rank, flat, **kw)
        result["node"] = self.node
        result["timings"] = {"snapshot_wait_s": waited, "write_s": result["seconds"]}
        return result

    def delete_version(self, version: int, keep_paths: set, referenced: List[str]) -> List[str]:
        """Retention on this node's local tier (each node's local tier is its own disk)."""
        return delete_version(self.writer.local, version, keep_paths, referenced)

    @ray.method(concurrency_group="upload", max_task_retries=0)  # the coordinator retries uploads itself
    def upload(self, files: List[dict]) -> int:
        return self.writer.upload(files)

    def node_id(self) -> str:
        return self.node

    def pid(self) -> int:
        return os.getpid()
