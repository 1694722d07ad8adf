"""Many small local files made durable together: one writer call's files, synced as a group.

Why: a version of 1,000 ranks x 2 states of 1 KB is 2,000 tiny files. Written one by one with
``Tier.open_atomic`` each costs an fsync of the file and an fsync of its directory (two journal
commits on ext4), longer than all the rest of a small file's write. A batch writes every file to
a temporary name first, then syncs the contents of all of them at once from a pool of threads (the
filesystem folds concurrent syncs into one journal commit), then renames them, then fsyncs each
directory once (figures: ``benchmarks/RESULTS.md``, scale section). ``syncfs`` would be a little
faster but also flushes every other process's dirty data on the disk: not used.

The guarantee, exactly (the same as ``open_atomic``'s, for the batch as a whole):

- while ``commit()`` has not returned, no file of the batch exists under its final name with
  content that is not on stable storage: a file's content is ``fdatasync``-ed before it is renamed
  to its final name (fdatasync also writes the size, the metadata needed to read the data back);
- when ``commit()`` returns, every final name is durable too: each directory that received a
  rename is fsynced after all renames into it, and so are its parents up to the tier's root (a
  new state or version directory's own entry), once each;
- a writer killed at any point leaves at most ``<final>.tmp-<random>`` names (never listed as
  checkpoint files, removed with their failed version) and final names whose content is durable;
  the caller learns nothing was written, so no manifest names them: the commit marker (the
  manifest, written later by the coordinator) only ever points at files ``commit()`` returned for.

An fsync of a directory makes the names in it durable, never the contents of the files they
name: that is why the contents are synced first and separately.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import uuid
from typing import Any, Iterator, List, Set, Tuple

from ..formats.checksum import HashingSink
from .local_files import TMP_MARK, WholeWrites

SYNC_THREADS = 16  # concurrent fdatasync calls: enough for ext4/xfs to fold them into one journal commit
MAX_OPEN = 256     # files held open before their contents are synced early (stays under fd limits)


class DurableBatch:
    """Write local files under temporary names, then make them all durable and visible at once.

    Use ``open_atomic(tier, rel)`` like ``Tier.open_atomic`` for each file, then ``commit()`` once
    (or ``abort()``). Files of a non-local tier are written by ``Tier.open_atomic`` at once (an
    object store has no rename: its PUT is atomic by itself)."""

    def __init__(self, threads: int = SYNC_THREADS):
        self.threads = threads
        self._open: List[int] = []                  # descriptors whose contents are not synced yet
        self._files: List[Tuple[str, str]] = []     # (temporary path, final path), in write order
        self._roots: Set[str] = set()               # tier roots: directory fsyncs stop there
        self.closed = False

    def __len__(self) -> int:
        return len(self._files)

    @contextlib.contextmanager
    def open_atomic(self, tier: Any, rel: str) -> Iterator[HashingSink]:
        """Yield a hashing sink that writes ``rel`` under a temporary name; it gets its final
        name at ``commit()``. A block that raises leaves nothing behind."""
        if self.closed:
            raise RuntimeError("this batch was already committed or aborted")
        if not tier.is_local:
            with tier.open_atomic(rel) as sink:
                yield sink
            return
        tier._local_parent(rel)  # directories created without following a link (NotOurs otherwise)
        final = tier.abspath(rel)
        tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            with open(fd, "wb", buffering=0, closefd=False) as f:
                sink = HashingSink(WholeWrites(f, tier.rate_limit))
                yield sink
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._open.append(fd)
        self._files.append((tmp, final))
        self._roots.add(os.path.normpath(tier.root))
        if len(self._open) >= MAX_OPEN:
            self._sync_open()

    def _sync_open(self) -> None:
        """fdatasync every open file (in threads), then close them."""
        fds, self._open = self._open, []
        try:
            if len(fds) == 1:
                os.fdatasync(fds[0])
            elif fds:
                with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(fds))) as pool:
                    list(pool.map(os.fdatasync, fds))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def commit(self) -> None:
        """Sync every file's content, rename each to its final name, fsync each directory once
        (and its parents up to the tier root). On an error, the files not yet renamed are removed
        and the error is raised: the caller reports the batch as not written."""
        if self.closed:
            raise RuntimeError("this batch was already committed or aborted")
        self.closed = True
        renamed = 0
        try:
            self._sync_open()
            for tmp, final in self._files:
                os.replace(tmp, final)
                renamed += 1
            for d in self._dirs():
                _fsync_dir(d)
        except BaseException:
            self._remove(self._files[renamed:])
            raise

    def abort(self) -> None:
        """Drop the batch: close and remove every temporary file."""
        if self.closed:
            return
        self.closed = True
        for fd in self._open:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._open = []
        self._remove(self._files)

    def _dirs(self) -> List[str]:
        """Directories that received a rename, then their parents up to a tier root, deepest
        first: an entry is made durable in its directory before that directory's own entry."""
        out: Set[str] = set()
        for _tmp, final in self._files:
            d = os.path.dirname(final)
            while d and d not in out:
                out.add(d)
                if d in self._roots or os.path.dirname(d) == d:
                    break
                d = os.path.dirname(d)
        return sorted(out, key=lambda p: (-p.count("/"), p))

    @staticmethod
    def _remove(files: List[Tuple[str, str]]) -> None:
        for tmp, _final in files:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def remove_temporaries(tier: Any, version: int) -> List[str]:
    """Remove the ``*.tmp-*`` files left in ``version``'s directory by a writer killed mid-batch
    (a restarted writer redoes the batch under new names, so a committed version may hold the dead
    one's). Call it only when no writer writes into that version any more: once every part of it
    has ended, or at a coordinator's start for its committed versions. Returns the paths removed."""
    from . import layout

    removed = [rel for rel in tier.list_files(layout.version_dir(version))
               if TMP_MARK in rel.rsplit("/", 1)[-1] and tier.delete_file(rel)]
    return removed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories (nothing more to do there)
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)

