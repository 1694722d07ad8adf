"""Paths under a run root, opened, listed, created and deleted without ever following a symbolic link.

Why a module of its own: a local tier's root may sit on storage another process can write to (a
shared scratch disk, a second driver's run). Every operation here walks the path one directory
descriptor at a time with ``O_NOFOLLOW`` (``openat``-style), so a link, FIFO, socket or device put
under the root is refused with :class:`NotOurs` naming it, and nothing behind it is read, written or
deleted. Plain ``os``; no pyarrow, no Ray. The fast reads and writes of files found here are in
``local_files``.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import List, Optional

from ..errors import IntegrityError

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
