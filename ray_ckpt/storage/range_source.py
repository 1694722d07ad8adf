"""One file of a tier opened once for many ranged reads.

Why: a sharded load reads one range per tensor of each rank file (hundreds per file). Opening the
file for each range costs a path walk, an open and an fstat locally (``confined.open_regular``) and
a request per range on an object store (``open_input_file``); a :class:`RangeSource` pays that once
per file and serves every range of it (``range_reader.RangeReader`` keeps one per tier and file).
The file is checked as ``Tier.read_range`` checks it (a regular file reached without following
links, locally); the bytes are verified by the caller.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import IntegrityError
from .confined import open_regular


class RangeSource:
    """``read_into(begin, out)``: bytes ``[begin, begin + len(out))`` of ``tier``'s file ``rel``."""

    def __init__(self, tier: Any, rel: str):
        self.tier, self.rel = tier, rel
        self.fd = open_regular(tier.root, rel) if tier.is_local else None
        self.file = None if tier.is_local else tier.fs.open_input_file(tier.abspath(rel))

    def read_into(self, begin: int, out: Any) -> None:
        """Fill ``out`` (a writable buffer) from byte ``begin``. Raises IntegrityError on a short
        read (the file is shorter than the range), or the filesystem's OSError."""
        mv = memoryview(out).cast("B")
        n = len(mv)
        if begin < 0:
            raise ValueError(f"bad byte range [{begin}, {begin + n}) of {self.rel}")
        got = 0
        if self.fd is not None:
            while got < n:
                k = os.preadv(self.fd, [mv[got:]], begin + got)
                if not k:
                    break
                got += k
        elif self.file is not None:
            while got < n:
                chunk = self.file.read_at(n - got, begin + got)
                if not len(chunk):
                    break
                mv[got: got + len(chunk)] = memoryview(chunk).cast("B")
                got += len(chunk)
        if got != n:
            raise IntegrityError(f"{self.tier.describe(self.rel)}: short read ({got} of {n} bytes at {begin}): "
                                 f"truncated?")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> "RangeSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
