"""Local-disk I/O of the local tier: atomic files (temporary name, fsync, rename, directory fsync),
block-parallel and O_DIRECT writes with checksums computed on the way, a write-rate limit, private
mappings for verified reads. Files are opened through ``confined`` (never through a link). Plain
``os``/``mmap``; no pyarrow, no Ray."""
from __future__ import annotations

import bisect
import errno
import contextlib
import itertools
import mmap
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from ..formats.checksum import BLOCK, STRIDE, block_hasher, combine, map_blocks, num_blocks
from .confined import open_regular_path

TMP_MARK = ".tmp-"  # temporary files: <final name>.tmp-<random>; never listed as checkpoint files
_IOV_MAX = 512  # well under Linux's IOV_MAX (1024)
_POPULATE_FROM = 32 << 20


class RateLimit:
    """At most ``bytes_per_s`` on average: call ``before(n)`` before writing n bytes; it sleeps until
    those bytes' slot begins. Idle time earns no credit, so a limited writer never bursts.

    Why: best-effort state (replay buffers can be gigabytes) must not take the disk from training
    or from critical saves; a writer with a limit spreads its writes out instead. Shared by the
    threads of one writer (a lock keeps the schedule)."""

    def __init__(self, bytes_per_s: float):
        if not bytes_per_s > 0:
            raise ValueError(f"a rate limit must be > 0 bytes/s, got {bytes_per_s!r}")
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the next byte may be written

    def before(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now)
            self._free_at = start + n / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


@contextlib.contextmanager
def local_atomic(final: str) -> Iterator[str]:
    """Yield a temporary path next to ``final``; on success it is renamed to ``final`` and the
    directory fsynced (the caller fsyncs the file), on failure it is removed."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    try:
        yield tmp
        os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class WholeWrites:
    """A file that writes all it is given (unbuffered local files may return short writes); with
    a ``limit``, 8 MiB at a time at the limit's pace. Also wraps object-store output streams when
    uploads are rate-limited.

    No ``sync_file_range`` writeback windows: waiting for the previous window stalls the writer
    while the object-store copy could go on, which costs more inside the engine than it saves.
    """

    def __init__(self, f: Any, limit: Optional[RateLimit] = None):
        self.f = f
        self.limit = limit

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            end = len(mv) if self.limit is None else min(len(mv), done + STRIDE)
            if self.limit is not None:
                self.limit.before(end - done)  # a limited write goes out 8 MiB at a time, never in bursts
            n = self.f.write(mv[done:end])
            if not n:
                raise OSError(errno.EIO, f"write to {getattr(self.f, 'name', 'a file')} made no progress")
            done += n
        return done


def _slice(views: List[memoryview], starts: List[int], start: int, end: int) -> List[memoryview]:
    """The pieces of the concatenation of ``views`` covering bytes [start, end); ``starts[k]`` is
    where ``views[k]`` begins (a state may have thousands of pieces: found by bisection)."""
    out = []
    k = bisect.bisect_right(starts, start) - 1
    while k < len(views) and starts[k] < end:
        v, pos = views[k], starts[k]
        lo, hi = max(start, pos), min(end, pos + len(v))
        if lo < hi:
            out.append(v[lo - pos: hi - pos])
        k += 1
    return out


def _pwrite_all(fd: int, pieces: List[memoryview], offset: int) -> None:
    """pwritev every piece at ``offset``, resuming after short writes."""
    pieces = [p for p in pieces if len(p)]
    while pieces:
        n = os.pwritev(fd, pieces[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        while pieces and n >= len(pieces[0]):
            n -= len(pieces[0])
            pieces.pop(0)
        if n:
            pieces[0] = pieces[0][n:]


_ALIGN = 4096  # O_DIRECT: a multiple of every common logical block size (512, 4096)
_SUB = 512 << 10  # O_DIRECT strides are copied and hashed in steps of this size (see write_hashed)


class BounceBuffers:
    """Page-aligned ``STRIDE`` buffers for O_DIRECT writes, kept between writes (at most ``keep``).

    Why kept: a fresh anonymous 8 MiB mapping per write thread per file is 2048 page faults, each
    zero-filling a page, and an munmap, for every large save: ~4100 of the ~5100 minor faults a
    critical writer took per 512 MB save (``benchmarks/writer_cpu.py``). Kept, a writer holds
    ``keep`` x 8 MiB of its own memory between saves. A buffer whose write failed is not kept (a
    traceback may still view it)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: List[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, STRIDE)  # page-aligned

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
                return
        with contextlib.suppress(BufferError):  # still viewed by its writer: freed with the views
            buf.close()


BOUNCE = BounceBuffers()


def _copy_and_hash(buf: mmap.mmap, pieces: List[memoryview], h: Any) -> None:
    """Copy ``pieces`` one after the other to the start of ``buf`` and hash the copy, ``_SUB``
    bytes at a time: each step is hashed right after it is copied, while it is still in the
    core's L2 cache, instead of reading the whole 8 MiB stride
    back from L3 or memory, where a learner streaming its own state evicts it. The bytes hashed
    are the bytes written. ``numpy.copyto`` releases the GIL while it copies (a memoryview slice
    assignment holds it), so a writer's threads copy at the same time."""
    dst = np.frombuffer(buf, dtype=np.uint8)
    mv = memoryview(buf)
    at = 0
    for piece in pieces:
        src = np.frombuffer(piece, dtype=np.uint8)
        for j in range(0, len(src), _SUB):
            step = src[j:j + _SUB]
            k = at + len(step)
            np.copyto(dst[at:k], step)
            h.update(mv[at:k])
            at = k


def write_hashed(fd: int, views: List[memoryview], size: int, threads: int,
                  limit: Optional[RateLimit], aligned: bool) -> List[bytes]:
    """Hash and write the concatenation of ``views`` into ``fd`` at its offsets: each checksum
    block by one of ``threads`` threads, ``STRIDE`` (8 MiB) at a time, hashed while in cache and
    then written. Returns the blocks' digests.

    ``aligned`` (for O_DIRECT, which needs aligned memory, offsets and lengths; disks want at
    least 512-byte aligned memory and snapshot buffers in the object store are only 64-byte
    aligned): each stride is first copied into a page-aligned buffer of ``BOUNCE`` and hashed
    there (``_copy_and_hash``: the bytes hashed are the bytes written); the file's last stride is
    padded to the alignment, so the caller truncates the file to ``size`` afterwards."""
    padded = -(-size // _ALIGN) * _ALIGN
    starts = list(itertools.accumulate((len(v) for v in views), initial=0))[:-1]

    def block(i: int) -> bytes:
        h = block_hasher()
        end = min(size, (i + 1) * BLOCK)
        buf = BOUNCE.take() if aligned else None
        for pos in range(i * BLOCK, end, STRIDE):
            n = min(STRIDE, end - pos)
            pieces = _slice(views, starts, pos, pos + n)
            if buf is not None:
                _copy_and_hash(buf, pieces, h)
                mv = memoryview(buf)
                w = min(STRIDE, padded - pos) if n % _ALIGN else n
                mv[n:w] = bytes(w - n)
                out = [mv[:w]]
            else:
                out = pieces
                for p in pieces:
                    h.update(p)
            if limit is not None:
                limit.before(n)
            _pwrite_all(fd, out, pos)
        if buf is not None:
            BOUNCE.give(buf)  # not reached when the block failed: that buffer is dropped
        return h.digest()

    return map_blocks(block, num_blocks(size), threads)


def write_direct(path: str, views: List[memoryview], size: int, threads: int,
                  limit: Optional[RateLimit]) -> Optional[List[bytes]]:
    """``write_hashed`` with O_DIRECT into a new file at ``path``, fsynced; None when this platform
    or filesystem refuses O_DIRECT (the caller then writes through the page cache).

    Why: no page-cache pages are allocated, filled and written back for the checkpoint, which
    saves time and CPU, most where the page cache is slow (``benchmarks/write_path.py``)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    try:
        try:
            digests = write_hashed(fd, views, size, threads, limit, aligned=True)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # opened, but the filesystem refuses unbuffered I/O
                return None
            raise
        if size % _ALIGN:
            os.ftruncate(fd, size)  # cut the last stride's padding
        os.fsync(fd)
    finally:
        os.close(fd)
    return digests


def hash_file(path: Any, threads: int, on_bytes: Optional[Callable[[int], None]] = None) -> Tuple[int, str]:
    """(size, digest) of a local file, its checksum blocks read and hashed by ``threads`` threads
    (``pread`` into one reused 8 MiB buffer per block; ``on_bytes(n)`` after each piece, from any
    thread). ``path``: a path (a link or a non-regular file there is refused with NotOurs, an
    IntegrityError) or a descriptor from ``open_regular``, which this closes. Several reads in
    flight: a single stream is the slowest and least steady way to read a virtual disk
    (``benchmarks/restore_read.py``)."""
    fd = path if isinstance(path, int) else open_regular_path(path)  # never a link, FIFO or device
    try:
        size = os.fstat(fd).st_size

        def block(i: int) -> bytes:
            buf = memoryview(bytearray(min(STRIDE, size) or 1))
            h = block_hasher()
            pos, end = i * BLOCK, min(size, (i + 1) * BLOCK)
            while pos < end:
                n = os.preadv(fd, [buf[:min(STRIDE, end - pos)]], pos)
                if n <= 0:
                    raise OSError(errno.EIO, f"{path} ended at {pos} bytes while being read ({size} expected)")
                h.update(buf[:n])
                pos += n
                if on_bytes is not None:
                    on_bytes(n)
            return h.digest()

        return size, combine(map_blocks(block, num_blocks(size), threads), size)
    finally:
        os.close(fd)


def map_file(path: str) -> Optional[mmap.mmap]:
    """A private, copy-on-write mapping of a local file (None if it cannot be mapped).

    Why not read(): reading 2 GiB into fresh memory costs the copy *and* faulting in 2 GiB of new
    anonymous pages; a private mapping reuses the page cache's pages, so restore costs about one
    disk read plus the copy into the parameters (``benchmarks/restore_read.py``).
    Writable (tensors built on it are ordinary writable tensors), private (a write copies that page
    and never reaches the file). Not populated up front: MAP_POPULATE on a writable private
    mapping copies every page. Checkpoint files are replaced by rename and deleted by unlink, never
    rewritten or truncated in place, so the verified bytes stay the bytes that are used.
    """
    fd = open_regular_path(path)  # a missing file raises here, as a read would; a link or FIFO: NotOurs
    try:
        return map_fd(fd)
    finally:
        os.close(fd)


def map_fd(fd: int) -> Optional[mmap.mmap]:
    """``map_file`` of an open descriptor (which stays the caller's to close)."""
    try:
        m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (ValueError, OSError):  # empty file, or a filesystem that cannot map: read it instead
        return None
    # No MADV_SEQUENTIAL: with several threads hashing different blocks it made the cold read
    # slower: 1.71 s vs 0.99 s (2 threads) and 0.92 s (4) for 2 GiB (benchmarks/restore_read.py)
    return m


def host_buffer(size: int) -> Any:
    """Writable host memory for a file being restored; the restored tensors own it.

    Large buffers are anonymous mappings populated up front (MAP_POPULATE): page tables are filled
    in one kernel call instead of one fault per page while reading, markedly faster than a
    zero-filled bytearray for buffers of GiBs."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size >= _POPULATE_FROM and populate:
        try:
            return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except (OSError, ValueError):
            pass
    return bytearray(size)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
