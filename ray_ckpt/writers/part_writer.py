"""``PartWriter``: serialise a snapshot, checksum it while writing, persist it to the local tier, and
upload committed files to the remote tier. A plain object (no Ray), unit-tested without a cluster;
``pools.WriterActor`` is its Ray shell."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple, Union

from ..errors import CheckpointError, IntegrityError, SaveError, one_line
from ..formats.manifest import ROLE_TENSORS, FileEntry
from ..formats.flat import Flat
from ..protocol import ShardRecord, WrittenPart
from ..storage.checkpoint_io import content_hash, shard_record, write_append_only, write_flat
from ..storage.durable_batch import DurableBatch
from ..storage.tier import RateLimit, Tier


COPIED_URGENTLY_KEPT = 4096  # files an urgent upload copied, remembered for the routine calls behind it
YIELD_MAX_S = 30.0  # a routine upload gives way to urgent ones on its writer for at most this long at a time


class PartWriter:
    def __init__(self, local: Tier, remote: Optional[Tier] = None, *, upload_retries: int = 4,
                 retry_base_s: float = 0.25, write_threads: int = 1,
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
        # files an urgent upload copied, (path, checksum): a routine call for them queued earlier skips them
        self._copied_urgently: "collections.OrderedDict[Tuple[str, str], None]" = collections.OrderedDict()
        self._copied_lock = threading.Lock()
        self._urgent_now = 0  # urgent uploads in progress on this writer: routine ones give way to them
        self._urgent_done = threading.Condition(self._copied_lock)

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

    def upload(self, files: Iterable[Union[FileEntry, dict]], urgent: bool = False) -> int:
        """Copy committed local files to the remote tier, verifying each against its manifest
        checksum while streaming; returns the bytes copied. Transient errors retry with exponential
        backoff. ``urgent``: a preemption notice's copy (``WriterActor.upload_urgent``), sent beside
        a routine call for the same files still queued: the routine call, when its turn comes, skips
        what the urgent one copied (the version may be committed and even deleted by retention by
        then: copying it again would leave files no manifest names), and routine uploads running on
        this writer pause between chunks while urgent ones run (:meth:`_give_way`)."""
        if self.remote is None:
            raise SaveError("no remote tier is configured")
        if urgent:
            with self._copied_lock:
                self._urgent_now += 1
            try:
                return self._upload(files, True)
            finally:
                with self._copied_lock:
                    self._urgent_now -= 1
                    self._urgent_done.notify_all()
        return self._upload(files, False)

    def _give_way(self) -> None:
        """Between two chunks of a routine upload: wait while urgent uploads run on this writer (a
        notice's copies then have the writer's bandwidth to themselves: shared, the newest version's
        copy crawled with the older ones' and none ended by the deadline), at most ``YIELD_MAX_S``."""
        with self._copied_lock:
            if self._urgent_now:
                self._urgent_done.wait_for(lambda: not self._urgent_now, timeout=YIELD_MAX_S)

    def _upload(self, files: Iterable[Union[FileEntry, dict]], urgent: bool) -> int:
        total = 0
        for f in map(_entry, files):
            key = (f.path, f.checksum)
            if not urgent:
                with self._copied_lock:
                    if key in self._copied_urgently:
                        del self._copied_urgently[key]
                        continue
            for attempt in range(self.upload_retries + 1):
                try:
                    size, digest = self.local.copy_to(self.remote, f.path, None if urgent else self._give_way)
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
            if urgent:
                with self._copied_lock:
                    self._copied_urgently[key] = None
                    while len(self._copied_urgently) > COPIED_URGENTLY_KEPT:
                        self._copied_urgently.popitem(last=False)
        return total


def _shards_of(flat: Flat, files: Iterable[FileEntry]) -> Optional[ShardRecord]:
    """The shard record of a part with DTensor leaves (None otherwise): where its chunks lie in its
    tensors file, so that the manifest can index the state for resharded, ranged restores."""
    tensors = [f for f in files if f.role == ROLE_TENSORS]
    return shard_record(flat, tensors[0].path) if len(tensors) == 1 else None


def _entry(f: Union[FileEntry, dict]) -> FileEntry:
    return f if isinstance(f, FileEntry) else FileEntry(**f)
