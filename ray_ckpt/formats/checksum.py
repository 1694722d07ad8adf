"""Checksums computed while bytes stream to storage (no second read of the data).

The digest of a file is a two-level xxh3-128: each 64 MiB block of the file is hashed on its own,
and the digest is the xxh3-128 of the blocks' digests followed by the file size. Why blocks: a
large file can then be written (and verified) by several threads at once, each hashing the blocks
it writes, and still get the same digest as a single stream over the file (an upload, ``ray-ckpt
verify``). xxh3 is memory-bound over a buffer much larger than the cache and several times faster
over one that sits in L2, which is why the O_DIRECT writer hashes each 512 KiB step right after
copying it (``storage.local_files``); either way hashing does not limit a disk write. The same digest is the content hash used to store a RELOADABLE state once.
"""
from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional

import xxhash

from .pieces import PieceHasher

ALGORITHM = "xxh3_128-blocks64m"
BLOCK = 64 << 20  # the unit of the two-level digest (fixed: changing it changes every digest)
STRIDE = 8 << 20  # hash and write in 8 MiB strides so each stride is hashed while still in cache


def block_hasher() -> Any:
    """The hasher of one block: ``update`` it with the block's bytes in order, then ``digest()``."""
    return xxhash.xxh3_128()


def block_digest(pieces: Iterable[Any]) -> bytes:
    """The digest of one block given as consecutive byte pieces."""
    h = block_hasher()
    for p in pieces:
        h.update(p)
    return h.digest()


def combine(block_digests: List[bytes], size: int) -> str:
    """The file digest from its blocks' digests, in file order."""
    h = xxhash.xxh3_128()
    for d in block_digests:
        h.update(d)
    h.update(struct.pack("<Q", size))
    return h.hexdigest()


class BlockHasher:
    """Streaming form of the digest: ``update`` with consecutive bytes, then ``hexdigest``. Its
    blocks are pieces of ``BLOCK`` bytes (``pieces.PieceHasher``); an empty file is one empty block."""

    def __init__(self):
        self._blocks = PieceHasher(BLOCK)

    @property
    def size(self) -> int:
        return self._blocks.size

    def update(self, data: Any) -> None:
        self._blocks.update(data)

    def hexdigest(self) -> str:
        return combine(self._blocks.digests() or [block_digest([])], self.size)


def digest(buf: Any, threads: int = 1) -> str:
    """The digest of the bytes in ``buf``, its blocks hashed by up to ``threads`` threads (xxhash
    releases the GIL; for a mapped file that also means several page-ins from the disk at once)."""
    mv = memoryview(buf).cast("B")
    digests = map_blocks(lambda i: block_digest([mv[i * BLOCK: (i + 1) * BLOCK]]), num_blocks(len(mv)), threads)
    return combine(digests, len(mv))


def map_blocks(fn: Callable[[int], Any], n: int, threads: int) -> List[Any]:
    """[fn(0), ..., fn(n - 1)] for the ``n`` blocks of a file, by up to ``threads`` threads (how
    files are hashed, written and read block-parallel)."""
    if threads <= 1 or n <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(min(threads, n), thread_name_prefix="ray_ckpt_blocks") as pool:
        return list(pool.map(fn, range(n)))


def new_hasher() -> BlockHasher:
    return BlockHasher()


def num_blocks(size: int) -> int:
    """Blocks of a file of ``size`` bytes (an empty file is one empty block)."""
    return max(1, -(-size // BLOCK))


class HashingSink:
    """A binary sink that hashes and counts every byte it forwards to ``target`` (or to nowhere)."""

    def __init__(self, target: Optional[Any] = None):
        self.target = target
        self.hasher = new_hasher()
        self.size = 0

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        for off in range(0, n, STRIDE):
            stride = mv[off: off + STRIDE]
            self.hasher.update(stride)
            if self.target is not None:
                self.target.write(stride)
        self.size += n
        return n

    # enough of the file protocol for pyarrow.PythonFile
    def flush(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:  # the owner of ``target`` closes it
        pass

    def digest(self) -> str:
        return self.hasher.hexdigest()
