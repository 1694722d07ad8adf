"""A storage tier: one run root on any ``pyarrow.fs`` filesystem, with atomic puts and verified reads.

Local disk: files are written to a temporary name, fsynced, then renamed (and the directory
fsynced), so a crash never leaves a half file under a final name. Object stores: an object appears
only when its upload completes, so a single PUT is atomic. Reads return writable memory (the
restored tensors own it) and are verified against the manifest's size and checksum before use.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import pyarrow.fs as pafs

from ..errors import CheckpointError, IntegrityError, InvalidArgumentError
from ..formats.checksum import BLOCK, CHUNK, HashingSink, block_hasher, combine, digest, num_blocks
from .layout import MANIFEST, parse_version_dir, version_dir

TMP_MARK = ".tmp-"
_OBJECT_STORES = tuple(c for c in (getattr(pafs, "S3FileSystem", None), getattr(pafs, "GcsFileSystem", None)) if c)
_COPY_CHUNK = 16 << 20
_IOV_MAX = 512  # well under Linux's IOV_MAX (1024)
VERIFY_THREADS = 4  # threads hashing one large file being restored (I/O-bound: more reads in flight)
_MAP_FROM = 1 << 20  # local files from 1 MiB are mapped for reading, not copied


# S3: fail in seconds, not minutes, on a dead endpoint or wrong credentials (auth errors are not
# retried at all; connection errors are retried max_attempts - 1 times with the SDK's backoff).
# Anything given in ``options`` wins over these defaults.
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 20.0  # curl low-speed limit: fail when < 1 byte/s moves for this long
S3_MAX_ATTEMPTS = 3


def _s3_defaults() -> Dict[str, Any]:
    return {"connect_timeout": S3_CONNECT_TIMEOUT_S, "request_timeout": S3_REQUEST_TIMEOUT_S,
            "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)}


def _s3_env_endpoint() -> Dict[str, Any]:
    """``AWS_ENDPOINT_URL_S3`` (else ``AWS_ENDPOINT_URL``) as S3FileSystem arguments, or {}."""
    url = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "").strip()
    if not url:
        return {}
    parsed = urlparse(url if "://" in url else f"https://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"AWS_ENDPOINT_URL(_S3)={url!r} is not an http(s)://host[:port] URL")
    return {"endpoint_override": parsed.netloc, "scheme": parsed.scheme}


def _s3_filesystem(uri: str, options: Dict[str, Any]) -> Tuple[pafs.FileSystem, str]:
    parsed = urlparse(uri)
    path = (parsed.netloc + parsed.path).strip("/")
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise ValueError("no bucket in the URI")
    if not options and (parsed.query or "@" in parsed.netloc):
        # settings carried by the URI itself (?endpoint_override=..., key:secret@bucket): pyarrow's syntax
        fs, p = pafs.FileSystem.from_uri(uri)
        return fs, p.rstrip("/")
    kwargs = _s3_defaults()
    if "endpoint_override" not in options:
        kwargs.update(_s3_env_endpoint())
    kwargs.update(options)
    if not options and kwargs.get("region") is None:  # explicit options are passed on as given
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not region and kwargs.get("endpoint_override"):
            region = "us-east-1"  # S3-compatible servers: any region signs; skip the lookup
        if not region:
            with contextlib.suppress(OSError, ValueError):  # what from_uri does; may need network
                region = pafs.resolve_s3_region(bucket)
        if region:
            kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), path


def resolve_filesystem(uri: str, options: Optional[Dict[str, Any]] = None) -> Tuple[pafs.FileSystem, str]:
    """``uri`` -> (filesystem, path). ``options`` go to the filesystem's constructor (S3: endpoint_override,
    scheme, region, access_key, secret_key, ...); without them the usual environment is read (AWS_* for
    S3, including AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for S3-compatible servers). S3 filesystems get
    short connect timeouts and a bounded retry strategy unless ``options`` set their own.

    Raises InvalidArgumentError (a ValueError) for a URI or options that cannot be used."""
    if not isinstance(uri, str) or not uri:
        raise InvalidArgumentError(f"storage URI must be a non-empty string, got {uri!r}")
    scheme = urlparse(uri).scheme if "://" in uri else ""
    try:
        if scheme == "s3":
            return _s3_filesystem(uri, dict(options or {}))
        if options:
            if scheme in ("gs", "gcs"):
                return pafs.GcsFileSystem(**options), uri.split("://", 1)[1].rstrip("/")
            raise ValueError(f"storage options are only understood for s3:// and gs:// URIs, not {uri!r}")
        if scheme == "":
            return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path.rstrip("/") or "/"
    except (ValueError, OSError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InvalidArgumentError(f"cannot open storage URI {uri!r}: {_one_line(exc)}") from None


def _s3_hint(exc: BaseException) -> str:
    """A hint for the usual causes of an S3 failure, from the SDK's error text ('' if none)."""
    text = str(exc)
    if any(k in text for k in ("ACCESS_DENIED", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH")):
        return (" (access denied: check access_key / secret_key in remote_options or the AWS_* "
                "environment, and that they may write to this bucket)")
    if any(k in text for k in ("NETWORK_CONNECTION", "Could not connect", "Couldn't connect", "curlCode: 7",
                               "curlCode: 28", "Timeout", "timed out")):
        return " (the S3 endpoint cannot be reached: check endpoint_override / scheme and that the server is up)"
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text or "Bucket" in text and "not found" in text:
        return " (the bucket does not exist: create it first)"
    return ""


class Tier:
    """The run root ``<uri>`` on one filesystem. Paths given to methods are relative to it."""

    def __init__(self, uri: str, name: str = "local", options: Optional[Dict[str, Any]] = None):
        self.uri = uri
        self.name = name
        self.options = dict(options or {})
        self.fs, self.root = resolve_filesystem(uri, self.options)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        # keys, not directories: "creating" a parent directory there writes an empty marker object
        # per level (requests, and objects a plain listing shows)
        self.is_object_store = isinstance(self.fs, _OBJECT_STORES)
        self.rate_limit: Optional[RateLimit] = None  # local writes only; set per process (not pickled)

    def __repr__(self) -> str:
        return f"Tier({self.name}, {self.uri!r})"

    def __reduce__(self):  # filesystems are re-resolved in the receiving process
        return (Tier, (self.uri, self.name, self.options))

    def abspath(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def describe(self, rel: str) -> str:
        return f"{self.name} tier {self.abspath(rel)}"

    # ---------------------------------------------------------------- writing
    @contextlib.contextmanager
    def open_atomic(self, rel: str) -> Iterator[HashingSink]:
        """Yield a hashing sink; the file appears under ``rel`` only if the block succeeds."""
        final = self.abspath(rel)
        if self.is_local:
            with _local_atomic(final) as tmp, open(tmp, "wb", buffering=0) as f:
                sink = HashingSink(_WholeWrites(f, self.rate_limit))
                yield sink
                os.fsync(f.fileno())
        else:
            if not self.is_object_store:  # object stores have no directories to create
                self.fs.create_dir(os.path.dirname(final), recursive=True)
            out = self.fs.open_output_stream(final)
            try:
                sink = HashingSink(out)
                yield sink
            except BaseException:
                # pyarrow exposes no abort(): closing an object store stream *completes* the upload
                # with the bytes written so far, so remove that partial object from under the final name
                with contextlib.suppress(Exception):
                    out.close()
                with contextlib.suppress(Exception):
                    self.fs.delete_file(final)
                raise
            out.close()

    def write_blocks(self, rel: str, segments: List[Any], threads: int,
                     direct: bool = False) -> Tuple[int, str]:
        """Write the concatenation of ``segments`` (bytes-like, in file order) to ``rel`` with
        ``threads`` threads, each hashing and writing whole checksum blocks at their offsets.

        Why threads: one thread copying into the page cache is CPU-bound well below what the disk
        takes (build VM, 2 GiB: 1.10 s with one thread, 0.88 s with two, 0.82 s with four).

        ``direct=True`` writes with O_DIRECT through small page-aligned buffers (see
        ``_write_direct``): no page-cache pages are allocated, filled and written back for the
        checkpoint, which costs a fraction of the CPU and keeps the training process's page
        cache. A filesystem that refuses O_DIRECT gets the buffered write instead.

        The digest is the same as streaming the bytes through ``open_atomic``. Local tiers only
        (object stores take a single stream); atomic like ``open_atomic``: temporary name, fsync,
        rename."""
        if not self.is_local:
            raise CheckpointError("write_blocks is for local tiers; object stores take one stream")
        views = [memoryview(x).cast("B") for x in segments]
        size = sum(len(v) for v in views)
        with _local_atomic(self.abspath(rel)) as tmp:
            digests = _write_direct(tmp, views, size, threads, self.rate_limit) if direct and size else None
            if digests is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    if size:
                        os.ftruncate(fd, size)
                    digests = _write_chunks(fd, views, size, threads, self.rate_limit, aligned=False)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return size, combine(digests, size)

    def put_bytes(self, rel: str, data: bytes) -> Tuple[int, str]:
        with self.open_atomic(rel) as sink:
            sink.write(data)
        return sink.size, sink.digest()

    def copy_to(self, dest: "Tier", rel: str) -> Tuple[int, str]:
        """Stream ``rel`` from this tier to ``dest`` (same relative path); returns (size, checksum)."""
        with self._open_input(rel) as src, dest.open_atomic(rel) as sink:
            while True:
                chunk = src.read(_COPY_CHUNK)
                if not chunk:
                    break
                sink.write(chunk)
        return sink.size, sink.digest()

    # ---------------------------------------------------------------- reading
    @contextlib.contextmanager
    def _open_input(self, rel: str):
        path = self.abspath(rel)
        if self.is_local:
            with open(path, "rb") as f:
                yield f
        else:
            # open_input_file: one GET for the whole object (open_input_stream issues many ranged GETs)
            f = self.fs.open_input_file(path)
            try:
                yield f
            finally:
                f.close()

    def read_bytes(self, rel: str) -> Any:
        with self._open_input(rel) as f:
            size = os.fstat(f.fileno()).st_size if self.is_local else f.size()
            buf = _host_buffer(size)
            mv = memoryview(buf)
            got = 0
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    break
                got += n
        if got != size:
            raise IntegrityError(f"{self.describe(rel)}: short read ({got} of {size} bytes)")
        return buf

    def read_verified(self, rel: str, size: int, checksum: str) -> Any:
        """Read ``rel`` and check it against the manifest. Raises FileNotFoundError or IntegrityError.

        Large local files are mapped rather than read (see ``_map_file``): the checksum pass pulls
        the pages in, and the tensors decoded from the result share the page cache until written."""
        buf = None
        if self.is_local and size >= _MAP_FROM:
            buf = _map_file(self.abspath(rel))
        if buf is None:
            buf = self.read_bytes(rel)
        if len(buf) != size:
            raise IntegrityError(f"{self.describe(rel)}: size {len(buf)} != manifest size {size}")
        if digest(buf, VERIFY_THREADS) != checksum:
            raise IntegrityError(f"{self.describe(rel)}: checksum mismatch (file is corrupt)")
        return buf

    # ---------------------------------------------------------------- listing / deleting
    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.abspath(rel)).type != pafs.FileType.NotFound

    def version_dirs(self) -> Dict[int, bool]:
        """version -> whether it has a manifest (committed). Missing root: empty.

        Object stores are listed once, recursively (a page per 1,000 keys), rather than asked
        about each version's manifest (one request per version: 200 versions on S3 took 200
        round trips before any catalogue was built)."""
        out: Dict[int, bool] = {}
        recursive = not self.is_local
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True, recursive=recursive))
        except FileNotFoundError:
            return out
        base = self.root.rstrip("/") + "/"
        for info in infos:
            rel = info.path[len(base):] if info.path.startswith(base) else info.base_name
            top, _, rest = rel.partition("/")
            v = parse_version_dir(top)
            if v is None:
                continue
            if not rest and info.type == pafs.FileType.Directory:
                out.setdefault(v, False)
            elif rest == MANIFEST and info.type == pafs.FileType.File:
                out[v] = True
        if not recursive:
            out = {v: self.exists(f"{version_dir(v)}/{MANIFEST}") for v in out}
        return out

    def list_files(self, rel: str) -> List[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.abspath(rel), recursive=True,
                                                            allow_not_found=True))
        except FileNotFoundError:
            return []
        base = self.root.rstrip("/") + "/"
        return [i.path[len(base):] if i.path.startswith(base) else i.path
                for i in infos if i.type == pafs.FileType.File]

    def delete_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.abspath(rel))

    def prune_empty_dirs(self, rel: str) -> None:
        """Remove ``rel`` and its subdirectories that hold no file; keep any that still do."""
        if self.is_local:
            top = self.abspath(rel)
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)  # fails (and is kept) when not empty
        elif not self.list_files(rel):
            with contextlib.suppress(OSError, FileNotFoundError):
                self.fs.delete_dir(self.abspath(rel))

    def check_writable(self) -> None:
        """Fail fast (at create) on a tier that cannot be written: bad credentials, read-only disk."""
        probe = f".ray_ckpt_probe{TMP_MARK}{uuid.uuid4().hex[:8]}"
        try:
            if self.is_object_store:  # some S3-compatible servers create a missing bucket on a PUT
                bucket = self.root.split("/", 1)[0]
                if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise FileNotFoundError(f"NoSuchBucket: the bucket {bucket!r} was not found")
            self.put_bytes(probe, b"ok")
            self.delete_file(probe)
        except Exception as exc:
            hint = "" if self.is_local else _s3_hint(exc) if isinstance(self.fs, pafs.S3FileSystem) else ""
            raise CheckpointError(f"{self.name} tier {self.uri!r} is not writable: {_one_line(exc)}{hint}") from None


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
def _local_atomic(final: str) -> Iterator[str]:
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


class _WholeWrites:
    """A local file that writes all it is given: unbuffered files may return short writes.

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
        if self.limit is not None:
            self.limit.before(len(mv))
        done = 0
        while done < len(mv):
            n = self.f.write(mv[done:])
            if not n:
                raise OSError(errno.EIO, f"write to {self.f.name} made no progress")
            done += n
        return done


def _slice(views: List[memoryview], start: int, end: int) -> List[memoryview]:
    """The pieces of the concatenation of ``views`` covering bytes [start, end)."""
    out, pos = [], 0
    for v in views:
        lo, hi = max(start, pos), min(end, pos + len(v))
        if lo < hi:
            out.append(v[lo - pos: hi - pos])
        pos += len(v)
        if pos >= end:
            break
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


def _map_blocks(fn: Any, n: int, threads: int) -> List[Any]:
    """[fn(0), ..., fn(n - 1)], by up to ``threads`` threads."""
    if threads <= 1 or n <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(min(threads, n), thread_name_prefix="ray_ckpt_write") as pool:
        return list(pool.map(fn, range(n)))


_ALIGN = 4096  # O_DIRECT: a multiple of every common logical block size (512, 4096)


def _write_chunks(fd: int, views: List[memoryview], size: int, threads: int,
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

    def block(i: int) -> bytes:
        h = block_hasher()
        end = min(size, (i + 1) * BLOCK)
        for pos in range(i * BLOCK, end, CHUNK):
            n = min(CHUNK, end - pos)
            pieces = _slice(views, pos, pos + n)
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
        return _map_blocks(block, num_blocks(size), threads)
    finally:
        for b in buffers.values():
            with contextlib.suppress(BufferError):  # still viewed by a failed block's traceback:
                b.close()  # freed with it; the error in flight is the one that matters


def _write_direct(path: str, views: List[memoryview], size: int, threads: int,
                  limit: Optional[RateLimit]) -> Optional[List[bytes]]:
    """``_write_chunks`` with O_DIRECT into a new file at ``path``, fsynced; None when this platform
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
            digests = _write_chunks(fd, views, size, threads, limit, aligned=True)
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


def _map_file(path: str) -> Optional[mmap.mmap]:
    """A private, copy-on-write mapping of a local file (None if it cannot be mapped).

    Why not read(): reading 2 GiB into fresh memory costs the copy *and* faulting in 2 GiB of new
    anonymous pages (2.6 s on the build VM against 0.9 s for dd); a private mapping reuses the page
    cache's pages, so restore costs about one disk read plus the copy into the parameters (1.1 s).
    Writable (tensors built on it are ordinary writable tensors), private (a write copies that page
    and never reaches the file). Not populated up front: MAP_POPULATE on a writable private
    mapping copies every page. Checkpoint files are replaced by rename and deleted by unlink, never
    rewritten or truncated in place, so the verified bytes stay the bytes that are used.
    """
    with open(path, "rb") as f:  # a missing file raises here, as a read would
        try:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (ValueError, OSError):  # empty file, or a filesystem that cannot map: read it instead
            return None
    # No MADV_SEQUENTIAL: with several threads hashing different blocks it made the cold read
    # slower: 1.71 s vs 0.99 s (2 threads) and 0.92 s (4) for 2 GiB (benchmarks/restore_read.py)
    return m


def _host_buffer(size: int) -> Any:
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


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
