"""Range verification: one xxh3-128 digest per piece (``PIECE_SIZE`` bytes) of a stored chunk.

Why pieces and not one checksum per file: a rank of a resharded restore reads only the byte ranges
its new shard needs (``formats.shards``); a whole-file checksum would make it read the whole file to
check them. With a digest per MiB it reads and verifies the whole pieces its ranges touch, at most
one piece more on each side of a range. No Ray, no storage, no torch.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import xxhash

from ..errors import IntegrityError

PIECE_SIZE = 1 << 20  # default unit of range verification: one xxh3-128 digest per MiB of chunk data



class PieceHasher:
    """Streaming :func:`piece_digests`: ``update`` with consecutive bytes, then ``hexdigests()``
    (or ``digests()``, the raw bytes; a file checksum's blocks are such pieces: ``checksum.py``)."""

    def __init__(self, piece_size: int = PIECE_SIZE):
        if piece_size <= 0:
            raise ValueError("piece_size must be positive")
        self.piece_size = piece_size
        self._h = xxhash.xxh3_128()
        self._in = 0
        self._digests: List[bytes] = []
        self.size = 0

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        off = 0
        while off < len(mv):
            take = min(len(mv) - off, self.piece_size - self._in)
            self._h.update(mv[off: off + take])
            off += take
            self._in += take
            if self._in == self.piece_size:
                self._digests.append(self._h.digest())
                self._h = xxhash.xxh3_128()
                self._in = 0
        self.size += len(mv)

    def digests(self) -> List[bytes]:
        return self._digests + ([self._h.digest()] if self._in else [])

    def hexdigests(self) -> List[str]:
        return [d.hex() for d in self.digests()]


def piece_digests(data: Any, piece_size: int = PIECE_SIZE) -> List[str]:
    """xxh3-128 (hex) of every ``piece_size`` bytes of ``data``; the last piece may be shorter."""
    mv = memoryview(data).cast("B")
    return [xxhash.xxh3_128_hexdigest(mv[i: i + piece_size]) for i in range(0, len(mv), piece_size)]


def pieces_for_range(begin: int, end: int, piece_size: int = PIECE_SIZE) -> range:
    """Indices of the pieces that bytes ``[begin, end)`` touch (empty for an empty range)."""
    if end <= begin:
        return range(0)
    return range(begin // piece_size, (end - 1) // piece_size + 1)


def verify_pieces(data: Any, first_piece: int, digests: Sequence[str], piece_size: int = PIECE_SIZE, *,
                  file: str = "<buffer>", what: str = "") -> None:
    """Check ``data``, which starts at piece ``first_piece`` and spans whole pieces (the region's last
    one may be short), against ``digests`` (all the region's piece digests). Raises
    :class:`IntegrityError` naming the file and the first piece that does not match."""
    mv = memoryview(data).cast("B")
    for j, i in enumerate(range(0, len(mv), piece_size)):
        k = first_piece + j
        piece = mv[i: i + piece_size]
        if k >= len(digests) or (len(piece) < piece_size and k != len(digests) - 1):
            raise IntegrityError(f"{file}: {what + ': ' if what else ''}piece {k} ({len(piece)} bytes) "
                                 f"is not one of the {len(digests)} recorded pieces")
        if xxhash.xxh3_128_hexdigest(piece) != digests[k]:
            raise IntegrityError(f"{file}: {what + ': ' if what else ''}checksum mismatch in piece {k} "
                                 f"(bytes {k * piece_size}..{k * piece_size + len(piece)} of the chunk's data)")
