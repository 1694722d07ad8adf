"""A storage tier: one run root on any ``pyarrow.fs`` filesystem, with atomic puts and verified reads.

Local disk: files are written to a temporary name, fsynced, then renamed (and the directory
fsynced), so a crash never leaves a half file under a final name (see ``local_files``). Object
stores: an object appears only when its upload completes, so a single PUT is atomic. Reads return
writable memory (the restored tensors own it) and are verified against the manifest's size and
checksum before use.

Odd or hostile local storage: a local tier never follows a symbolic link below its root (the root
itself may be one), never enters a linked directory, reads only regular files (a link, FIFO,
socket or device in a checkpoint file's place is an IntegrityError naming it, never a hang), and
deletes links themselves, never their targets: nothing outside the run root is read, written or
deleted (see ``confined.open_regular``, ``list_under``, ``unlink_under``).
"""
from __future__ import annotations

import contextlib
import os
import stat
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pyarrow.fs as pafs

from ..errors import CheckpointError, IntegrityError, one_line
from ..formats.checksum import HashingSink, combine, digest
from ..interfaces import StorageTier
from .filesystems import OBJECT_STORES, redact_uri, resolve_filesystem, s3_hint, scrub
from .layout import MANIFEST, manifest_path, parse_version_dir
from .range_source import RangeSource
from .confined import (NotOurs, kind_of, list_under, lstat_under, make_dirs_under, open_regular, prune_under,
                       unlink_under)
from .local_files import (TMP_MARK, RateLimit, WholeWrites, hash_file, host_buffer, local_atomic, map_fd,
                          write_hashed, write_direct)

_COPY_BUFFER = 16 << 20
VERIFY_THREADS = 4  # threads hashing one large file being restored (I/O-bound: more reads in flight)
_MAP_FROM = 1 << 20  # local files from 1 MiB are mapped for reading, not copied

__all__ = ["Tier", "RateLimit", "TMP_MARK", "NotOurs", "resolve_filesystem"]


def farther(a: str, b: str) -> str:
    """Of two tier names, the one farther from the reader (local < peer:<node> < remote): a state
    read from several tiers reports the farthest it had to go."""
    def rank(t: str) -> int:
        return 2 if t == "remote" else 1 if t.startswith("peer") else 0
    return a if rank(a) >= rank(b) else b


class Tier(StorageTier):
    """The run root ``<uri>`` on one ``pyarrow.fs`` filesystem (the :class:`~ray_ckpt.interfaces.StorageTier`
    every tier is). Paths given to methods are relative to it."""

    def __init__(self, uri: str, name: str = "local", options: Optional[Dict[str, Any]] = None):
        self.uri = uri
        self.name = name
        self.options = dict(options or {})
        self.fs, self.root = resolve_filesystem(uri, self.options)
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self.is_object_store = isinstance(self.fs, OBJECT_STORES)  # keys, no directories to create
        self.rate_limit: Optional[RateLimit] = None  # this process's writes to this tier (not pickled)

    @property
    def display(self) -> str:
        """The URI for messages and logs: credentials and secret query values replaced by ***."""
        return redact_uri(self.uri)

    def __repr__(self) -> str:
        return f"Tier({self.name}, {self.display!r})"

    def scrub(self, text: str) -> str:
        """``text`` (an error message, perhaps from the SDK) without this tier's URI secrets."""
        return scrub(text, self.uri)

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
            self._local_parent(rel)
            with local_atomic(final) as tmp, open(tmp, "wb", buffering=0) as f:
                sink = HashingSink(WholeWrites(f, self.rate_limit))
                yield sink
                os.fsync(f.fileno())
        else:
            if not self.is_object_store:  # object stores have no directories to create
                self.fs.create_dir(os.path.dirname(final), recursive=True)
            out = self.fs.open_output_stream(final)
            try:
                sink = HashingSink(WholeWrites(out, self.rate_limit) if self.rate_limit else out)
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

    def write_blocks(self, rel: str, buffers: List[Any], threads: int,
                     direct: bool = False) -> Tuple[int, str]:
        """Write the concatenation of ``buffers`` (bytes-like, in file order) to ``rel`` with
        ``threads`` threads, each hashing and writing whole checksum blocks at their offsets.

        Why threads: one thread copying into the page cache is CPU-bound well below what the disk
        takes (``benchmarks/write_path.py``).

        ``direct=True`` writes with O_DIRECT through small page-aligned buffers (see
        ``write_direct``): no page-cache pages are allocated, filled and written back for the
        checkpoint, which costs a fraction of the CPU and keeps the training process's page
        cache. A filesystem that refuses O_DIRECT gets the buffered write instead.

        The digest is the same as streaming the bytes through ``open_atomic``. Local tiers only
        (object stores take a single stream); atomic like ``open_atomic``: temporary name, fsync,
        rename."""
        if not self.is_local:
            raise CheckpointError("write_blocks is for local tiers; object stores take one stream")
        views = [memoryview(x).cast("B") for x in buffers]
        size = sum(len(v) for v in views)
        self._local_parent(rel)
        with local_atomic(self.abspath(rel)) as tmp:
            digests = write_direct(tmp, views, size, threads, self.rate_limit) if direct and size else None
            if digests is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    if size:
                        os.ftruncate(fd, size)
                    digests = write_hashed(fd, views, size, threads, self.rate_limit, aligned=False)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return size, combine(digests, size)

    def _local_parent(self, rel: str) -> None:
        """Create the directories of local file ``rel``; NotOurs (an IntegrityError) where one of
        them is a link or not a directory: nothing is written through it."""
        make_dirs_under(self.root, rel.rpartition("/")[0])

    def put_bytes(self, rel: str, data: bytes) -> Tuple[int, str]:
        with self.open_atomic(rel) as sink:
            sink.write(data)
        return sink.size, sink.digest()

    def copy_to(self, dest: "Tier", rel: str, between: Optional[Callable[[], None]] = None) -> Tuple[int, str]:
        """Stream ``rel`` from this tier to ``dest`` (same relative path); returns (size, checksum).
        ``between()`` is called before each chunk (a copy that should give way to others waits there)."""
        with self._open_input(rel) as src, dest.open_atomic(rel) as sink:
            while True:
                if between is not None:
                    between()
                data = src.read(_COPY_BUFFER)
                if not data:
                    break
                sink.write(data)
        return sink.size, sink.digest()

    # ---------------------------------------------------------------- reading
    @contextlib.contextmanager
    def _open_input(self, rel: str):
        path = self.abspath(rel)
        if self.is_local:  # a regular file reached without following links, or NotOurs
            with os.fdopen(open_regular(self.root, rel), "rb") as f:
                yield f
        else:
            # open_input_file: one GET for the whole object (open_input_stream issues many ranged GETs)
            f = self.fs.open_input_file(path)
            try:
                yield f
            finally:
                f.close()

    def read_bytes(self, rel: str) -> Any:
        """The whole file ``rel`` in fresh writable memory. Raises FileNotFoundError, IntegrityError
        (a short read; locally: a link or special file in its place), or the filesystem's OSError."""
        with self._open_input(rel) as f:
            return self._read_all(rel, f)

    def _read_all(self, rel: str, f: Any) -> Any:
        size = os.fstat(f.fileno()).st_size if self.is_local else f.size()
        buf = host_buffer(size)
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

    def read_range(self, rel: str, begin: int, end: int) -> Any:
        """Bytes ``[begin, end)`` of ``rel`` in fresh writable memory: one ranged read (locally a
        ``pread`` of the regular file reached without following links; on an object store a ranged
        GET). Not verified here: the caller checks them against per-piece digests (``formats.pieces``).
        Raises FileNotFoundError, IntegrityError (a short read: the file is shorter than ``end``;
        locally a link or special file in its place) or the filesystem's OSError."""
        if begin < 0 or end < begin:
            raise ValueError(f"bad byte range [{begin}, {end}) of {rel}")
        buf = bytearray(end - begin)
        self.read_range_into(rel, begin, memoryview(buf))
        return buf

    def read_range_into(self, rel: str, begin: int, out: Any) -> None:
        """Bytes ``[begin, begin + len(out))`` of ``rel`` into the writable buffer ``out`` (e.g. the
        memory of the tensor they restore, so they are not copied again), as :meth:`read_range`
        reads them; not verified here either. Same errors as :meth:`read_range`."""
        with self.open_ranges(rel) as src:
            src.read_into(begin, out)

    def open_ranges(self, rel: str) -> RangeSource:
        """``rel`` opened once for many ranged reads (``RangeSource.read_into``; close it). Raises
        what :meth:`read_range` raises for a missing file or one that is not a regular file."""
        return RangeSource(self, rel)

    def read_verified(self, rel: str, size: int, checksum: str) -> Any:
        """Read ``rel`` and check it against the manifest. Raises FileNotFoundError or IntegrityError.

        Large local files are mapped rather than read (see ``map_file``): the checksum pass pulls
        the pages in, and the tensors decoded from the result share the page cache until written."""
        if self.is_local:
            with os.fdopen(open_regular(self.root, rel), "rb") as f:
                st_size = os.fstat(f.fileno()).st_size
                if st_size != size:  # before mapping or reading a byte of it
                    raise IntegrityError(f"{self.describe(rel)}: size {st_size} != manifest size {size}")
                buf = map_fd(f.fileno()) if size >= _MAP_FROM else None
                if buf is None:
                    buf = self._read_all(rel, f)
        else:
            buf = self.read_bytes(rel)
        if len(buf) != size:
            raise IntegrityError(f"{self.describe(rel)}: size {len(buf)} != manifest size {size}")
        if digest(buf, VERIFY_THREADS) != checksum:
            raise IntegrityError(f"{self.describe(rel)}: checksum mismatch (file is corrupt)")
        return buf

    def hash_file(self, rel: str, threads: int = VERIFY_THREADS, on_bytes: Any = None) -> Tuple[int, str]:
        """(size, digest) of a local file ``rel``, hashed by blocks in parallel (``local_files.hash_file``),
        reached like a read: no links followed, only a regular file (else NotOurs)."""
        if not self.is_local:
            raise CheckpointError("hash_file is for local tiers")
        return hash_file(open_regular(self.root, rel), threads, on_bytes)

    # ---------------------------------------------------------------- listing / deleting
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is there (locally: an entry of any kind, links not followed; one that
        lies behind a linked directory is not)."""
        if self.is_local:
            return lstat_under(self.root, rel) is not None
        return self.fs.get_file_info(self.abspath(rel)).type != pafs.FileType.NotFound

    def version_dirs(self) -> Dict[int, bool]:
        """version -> whether it has a manifest (committed). Missing root: empty.

        Locally, only real directories count: a version-named link or file in the root is not a
        version of this run (``odd_entries`` names them), so nothing treats it as one to list,
        restore or empty. A manifest.json that is a link or a special file counts as a manifest
        (reading it then fails: an unreadable version, never a partial one to remove).

        Object stores are listed once, recursively (a page per 1,000 keys), rather than asked
        about each version's manifest (one request per version: 200 versions on S3 took 200
        round trips before any catalogue was built)."""
        if self.is_local:
            return self._local_version_dirs()[0]
        out: Dict[int, bool] = {}
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True, recursive=True))
        except FileNotFoundError:
            return out
        base = self.root.rstrip("/") + "/"
        for info in infos:
            rel = info.path[len(base):] if info.path.startswith(base) else info.base_name
            top, _, rest = rel.partition("/")
            v = parse_version_dir(top)
            if v is None:
                continue
            if rest == MANIFEST and info.type == pafs.FileType.File:
                out[v] = True
            elif rest or info.type == pafs.FileType.Directory:  # anything under a version directory
                out.setdefault(v, False)
        return out

    def odd_entries(self) -> Dict[int, str]:
        """Version-named entries of a local root that are not directories (links, files, FIFOs):
        version -> what it is. Not versions of this run; left alone. Object stores: {}."""
        return self._local_version_dirs()[1] if self.is_local else {}

    def _local_version_dirs(self) -> Tuple[Dict[int, bool], Dict[int, str]]:
        out: Dict[int, bool] = {}
        odd: Dict[int, str] = {}
        try:
            with os.scandir(self.root) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return out, odd
        for name, is_dir, is_link in entries:
            v = parse_version_dir(name)
            if v is None:
                continue
            if not is_dir:
                st = lstat_under(self.root, name)
                odd[v] = kind_of(st.st_mode) if st is not None else ("a symbolic link" if is_link else "gone")
                continue
            st = lstat_under(self.root, manifest_path(v))
            out[v] = st is not None and not stat.S_ISDIR(st.st_mode)
        return out, odd

    def list_files(self, rel: str) -> List[str]:
        """Every file under ``rel`` (relative to the root). Locally: every entry that is not a
        directory, links and special files included as entries; linked directories are never
        entered (a link at ``rel`` itself: [])."""
        if self.is_local:
            return list_under(self.root, rel)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.abspath(rel), recursive=True,
                                                            allow_not_found=True))
        except FileNotFoundError:
            return []
        base = self.root.rstrip("/") + "/"
        return [i.path[len(base):] if i.path.startswith(base) else i.path
                for i in infos if i.type == pafs.FileType.File]

    def delete_file(self, rel: str) -> bool:
        """Delete ``rel`` if it is there; True if something was deleted. Locally a link is removed
        itself (never its target), and nothing is removed through a linked directory."""
        if self.is_local:
            return unlink_under(self.root, rel)
        try:
            self.fs.delete_file(self.abspath(rel))
            return True
        except FileNotFoundError:
            return False

    def prune_empty_dirs(self, rel: str) -> None:
        """Remove ``rel`` and its subdirectories that hold no file; keep any that still do (and,
        locally, never enter or remove a linked directory)."""
        if self.is_local:
            prune_under(self.root, rel)
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
            hint = "" if self.is_local else s3_hint(exc) if isinstance(self.fs, pafs.S3FileSystem) else ""
            raise CheckpointError(f"{self.name} tier {self.display!r} is not writable: "
                                  f"{self.scrub(one_line(exc))}{hint}") from None
