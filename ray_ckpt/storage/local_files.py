"""Local-disk primitives of the local tier: atomic files (temporary name, fsync, rename, directory
fsync), block-parallel and O_DIRECT writes with checksums computed on the way, a write-rate limit,
private mappings for verified reads, and listing, opening and deleting under a run root without
ever following a symbolic link. Plain ``os``/``mmap``; no pyarrow, no Ray."""
from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import mmap
import os
import stat
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..errors import IntegrityError
from ..formats.checksum import BLOCK, CHUNK, block_hasher, combine, map_blocks, num_blocks

TMP_MARK = ".tmp-"  # temporary files: <final name>.tmp-<random>; never listed as checkpoint files
_IOV_MAX = 512  # well under Linux's IOV_MAX (1024)
_POPULATE_FROM = 32 << 20


class NotOurs(IntegrityError):
    """A path under a run root that ray_ckpt will not follow or read: a symbolic link, a FIFO, a
    socket, a device, or a non-directory where a directory should be. Nothing behind it is read,
    written or deleted; the message names the path."""


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def kind_of(mode: int) -> str:
    """'a symbolic link', 'a FIFO', ... 'a regular file' for an ``st_mode``."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode)
                else "a special file")


def _parts(rel: str) -> List[str]:
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise NotOurs(f"{rel!r}: '.' or '..' in a path under a run root")
    return parts


def _join(root: str, parts: List[str]) -> str:
    return "/".join([root.rstrip("/")] + list(parts)) if parts else root


def open_dir(root: str, parts: List[str]) -> int:
    """A descriptor of the directory ``root/parts...``, each component below ``root`` opened
    without following a symbolic link (``root`` itself is the trusted run root and may be one).
    Raises FileNotFoundError, or NotOurs when a component is a link or not a directory."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    where = _join(root, parts[:i + 1])
                    try:
                        what = kind_of(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                    except OSError:
                        what = "not a directory"
                    raise NotOurs(f"{where} is {what}, not a directory: ray_ckpt never follows or enters "
                                  f"one under a run root") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_under(root: str, rel: str) -> Optional[os.stat_result]:
    """``lstat`` of ``root/rel`` reached without following links (None when it is not there or
    lies behind a link)."""
    parts = _parts(rel)
    if not parts:
        return os.stat(root) if os.path.isdir(root) else None
    try:
        dfd = open_dir(root, parts[:-1])
    except (FileNotFoundError, NotOurs):
        return None
    try:
        return os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def open_regular(root: str, rel: str) -> int:
    """A read-only descriptor of the regular file ``root/rel``. Never follows a link, never opens a
    FIFO, socket or device (a FIFO's open would block until a writer comes): the entry is lstat-ed
    first, then opened with O_NOFOLLOW | O_NONBLOCK and checked to be the same regular file.
    Raises FileNotFoundError, or NotOurs (an IntegrityError) naming the path."""
    parts = _parts(rel)
    if not parts:
        raise NotOurs(f"{root}: a run root is not a file")
    path = _join(root, parts)
    dfd = open_dir(root, parts[:-1])
    try:
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise NotOurs(f"{path} is {kind_of(st.st_mode)}, not a regular file: refused (a checkpoint file is "
                          f"only ever a regular file)")
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _CLOEXEC | _NOFOLLOW | _NONBLOCK, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # replaced by a link / a socket meanwhile
                raise NotOurs(f"{path} changed into a link or special file while being opened: refused") from None
            raise
    finally:
        os.close(dfd)
    try:
        st2 = os.fstat(fd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise NotOurs(f"{path} was replaced while being opened (now {kind_of(st2.st_mode)}): refused")
        if _NONBLOCK:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_path(path: str) -> int:
    """``open_regular`` of an absolute path: the last component only is checked (its directory is
    trusted). For callers that hold a path, not a run root and a relative path."""
    head, tail = os.path.split(os.path.abspath(path))
    return open_regular(head or "/", tail)


def list_under(root: str, rel: str = "") -> List[str]:
    """Every entry below ``root/rel`` that is not a directory (regular files, and links and special
    files as entries of their own), as paths relative to ``root``. Links are never followed and
    linked directories never entered; ``rel`` missing, or itself behind a link: []."""
    parts = _parts(rel)
    try:
        fd = open_dir(root, parts)
    except (FileNotFoundError, NotADirectoryError, NotOurs):
        return []
    out: List[str] = []
    _list_fd(fd, "/".join(parts), out)
    return out


def _list_fd(fd: int, prefix: str, out: List[str]) -> None:
    try:
        with os.scandir(fd) as it:  # scandir(fd) works on a duplicate: fd stays ours to close
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            rel = f"{prefix}/{e.name}" if prefix else e.name
            if e.is_dir(follow_symlinks=False):
                try:
                    sub = os.open(e.name, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # removed or replaced meanwhile
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        out.append(rel)  # replaced by a link meanwhile: an entry, never entered
                        continue
                    raise
                _list_fd(sub, rel, out)
            else:
                out.append(rel)
    finally:
        os.close(fd)


def unlink_under(root: str, rel: str) -> bool:
    """Remove the entry ``root/rel`` (a link is removed itself, never what it points to). Nothing
    is removed through a linked directory: such a path, or a missing one, returns False."""
    parts = _parts(rel)
    if not parts:
        return False
    try:
        dfd = open_dir(root, parts[:-1])
    except (FileNotFoundError, NotOurs):
        return False
    try:
        os.unlink(parts[-1], dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


def prune_under(root: str, rel: str) -> None:
    """Remove ``root/rel`` and the directories below it that hold nothing, keeping any that do.
    Linked directories are neither entered nor removed; ``rel`` behind a link: nothing happens."""
    parts = _parts(rel)
    try:
        fd = open_dir(root, parts)
    except (FileNotFoundError, NotADirectoryError, NotOurs):
        return
    _prune_fd(fd)
    if parts:
        try:
            pfd = open_dir(root, parts[:-1])
        except (FileNotFoundError, NotOurs):
            return
        try:
            with contextlib.suppress(OSError):  # fails (and is kept) when not empty
                os.rmdir(parts[-1], dir_fd=pfd)
        finally:
            os.close(pfd)


def _prune_fd(fd: int) -> None:
    try:
        with os.scandir(fd) as it:
            subdirs = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        for name in subdirs:
            try:
                sub = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            _prune_fd(sub)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


def make_dirs_under(root: str, rel_dir: str) -> None:
    """Create ``root/rel_dir`` (``root`` included), refusing (NotOurs) to create or write through a
    link or a non-directory below ``root``: a file is never written outside the run root."""
    os.makedirs(root, exist_ok=True)
    parts = _parts(rel_dir)
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotOurs(f"{_join(root, parts[:i + 1])} is a link or not a directory: ray_ckpt "
                                  f"never writes through one under a run root") from None
                raise
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


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

    (Tried and measured, then dropped: queueing each 64 MiB window for writeback with
    sync_file_range and waiting for the one before. It won 0.83 s vs 1.31 s for 2 GiB in a loop
    alone, but lost inside the engine, 1.76-1.85 s without vs 2.14-2.88 s with, A/B in one session:
    the waits stall the writer while the object-store copy could go on. See RESULTS.md.)
    """

    def __init__(self, f: Any, limit: Optional[RateLimit] = None):
        self.f = f
        self.limit = limit

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            end = len(mv) if self.limit is None else min(len(mv), done + CHUNK)
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


def write_chunks(fd: int, views: List[memoryview], size: int, threads: int,
                  limit: Optional[RateLimit], aligned: bool) -> List[bytes]:
    """Hash and write the concatenation of ``views`` into ``fd`` at its offsets: each checksum
    block by one of ``threads`` threads, ``CHUNK`` (8 MiB) at a time, hashed while in cache and
    then written. Returns the blocks' digests.

    ``aligned`` (for O_DIRECT, which needs aligned memory, offsets and lengths; the build VM's disk
    wants 512-byte aligned memory and snapshot buffers in the object store are only 64-byte
    aligned): each chunk is first copied into the thread's own page-aligned buffer and hashed
    there (the bytes hashed are the bytes written); the file's last chunk is padded to the
    alignment, so the caller truncates the file to ``size`` afterwards."""
    padded = -(-size // _ALIGN) * _ALIGN
    buffers: Dict[int, mmap.mmap] = {}
    starts = list(itertools.accumulate((len(v) for v in views), initial=0))[:-1]

    def block(i: int) -> bytes:
        h = block_hasher()
        end = min(size, (i + 1) * BLOCK)
        for pos in range(i * BLOCK, end, CHUNK):
            n = min(CHUNK, end - pos)
            pieces = _slice(views, starts, pos, pos + n)
            if aligned:
                buf = buffers.get(threading.get_ident())
                if buf is None:
                    buf = buffers[threading.get_ident()] = mmap.mmap(-1, CHUNK)  # page-aligned
                mv = memoryview(buf)
                at = 0
                for piece in pieces:
                    mv[at:at + len(piece)] = piece
                    at += len(piece)
                w = min(CHUNK, padded - pos) if n % _ALIGN else n
                mv[n:w] = bytes(w - n)
                pieces, out = [mv[:n]], [mv[:w]]
            else:
                out = pieces
            for p in pieces:
                h.update(p)
            if limit is not None:
                limit.before(n)
            _pwrite_all(fd, out, pos)
        return h.digest()

    try:
        return map_blocks(block, num_blocks(size), threads)
    finally:
        for b in buffers.values():
            with contextlib.suppress(BufferError):  # still viewed by a failed block's traceback:
                b.close()  # freed with it; the error in flight is the one that matters


def write_direct(path: str, views: List[memoryview], size: int, threads: int,
                  limit: Optional[RateLimit]) -> Optional[List[bytes]]:
    """``write_chunks`` with O_DIRECT into a new file at ``path``, fsynced; None when this platform
    or filesystem refuses O_DIRECT (the caller then writes through the page cache).

    Why: no page-cache pages are allocated, filled and written back for the checkpoint. Measured
    on the build VM (``benchmarks/write_path.py``, a 2 GB state, two write threads, A/B in one run):
    time to durable 1.14 s and 0.78 CPU seconds against 1.58 s and 0.92 s buffered, and 1.63 s
    against 5.34 s (4.5 CPU seconds) in a run where the VM's page cache was slow."""
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
            digests = write_chunks(fd, views, size, threads, limit, aligned=True)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # opened, but the filesystem refuses unbuffered I/O
                return None
            raise
        if size % _ALIGN:
            os.ftruncate(fd, size)  # cut the last chunk's padding
        os.fsync(fd)
    finally:
        os.close(fd)
    return digests


def hash_file(path: Any, threads: int, on_bytes: Optional[Callable[[int], None]] = None) -> Tuple[int, str]:
    """(size, digest) of a local file, its checksum blocks read and hashed by ``threads`` threads
    (``pread`` into one reused 8 MiB buffer per block; ``on_bytes(n)`` after each piece, from any
    thread). ``path``: a path (a link or a non-regular file there is refused with NotOurs, an
    IntegrityError) or a descriptor from ``open_regular``, which this closes. Several reads in flight: a single stream is the slowest and least steady way to read
    this build VM's disk (``benchmarks/restore_read.py``)."""
    fd = path if isinstance(path, int) else open_regular_path(path)  # never a link, FIFO or device
    try:
        size = os.fstat(fd).st_size

        def block(i: int) -> bytes:
            buf = memoryview(bytearray(min(CHUNK, size) or 1))
            h = block_hasher()
            pos, end = i * BLOCK, min(size, (i + 1) * BLOCK)
            while pos < end:
                n = os.preadv(fd, [buf[:min(CHUNK, end - pos)]], pos)
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
    anonymous pages (2.6 s on the build VM against 0.9 s for dd); a private mapping reuses the page
    cache's pages, so restore costs about one disk read plus the copy into the parameters (1.1 s).
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
    in one kernel call instead of one fault per page while reading, which measured 0.85 s against
    1.5 s for a zero-filled bytearray of 2 GiB on the build VM."""
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
