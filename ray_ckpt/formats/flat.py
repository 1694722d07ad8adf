"""The flattened state (:class:`Flat`) and how its arrays travel through Ray's object store.

Ray copies each out-of-band buffer larger than 1 MiB with threads that it starts for that buffer
alone; for buffers of a few MiB starting them costs more than the copy. So arrays up to
``SPLIT_UP_TO`` travel as ``PIECE``-sized pieces, which Ray copies with one memcpy each; larger
arrays travel whole, where Ray's parallel copy pays off on machines with the cores for it (figures:
``benchmarks/transport_pieces.py``, RESULTS.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

import numpy as np

PIECE = 1 << 20
SPLIT_UP_TO = 4 << 20


class Pieces:
    """One array's bytes as consecutive pieces (views into the object store after transport)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: List[np.ndarray]):
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)


def pieces_of(arr: Any) -> List[Any]:
    """An entry of ``Flat.arrays`` as the consecutive byte pieces it holds (no copies)."""
    if isinstance(arr, Pieces):
        return arr.parts
    return [arr] if arr.nbytes else []


def _for_transport(arr: np.ndarray) -> Any:
    n = arr.nbytes
    if PIECE < n <= SPLIT_UP_TO and arr.ndim == 1:
        return [arr[i: i + PIECE] for i in range(0, n, PIECE)]
    return arr


def _from_transport(structure: Any, arrays: List[Any], tables: List[Any], leaf_info: List[dict]) -> "Flat":
    return Flat(structure, [Pieces(a) if isinstance(a, list) else a for a in arrays], tables, leaf_info)


@dataclass
class Flat:
    """A flattened state: what a snapshot carries and what formats serialise.

    After it has travelled through Ray, an entry of ``arrays`` may be :class:`Pieces` (see
    ``SPLIT_UP_TO``); formats read entries through :func:`pieces_of`."""

    structure: Any
    arrays: List[Any] = field(default_factory=list)  # flat uint8 views (or Pieces of them)
    tables: List[Any] = field(default_factory=list)  # pyarrow Tables
    leaf_info: List[dict] = field(default_factory=list)  # per array: name, st dtype, shape, itemsize
    # per array: its host address range [lo, hi) as flatten found it (what an overlapped copy reads,
    # for fences); not transported
    spans: List[tuple] = field(default_factory=list, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + sum(t.nbytes for t in self.tables)

    def __reduce__(self):
        return _from_transport, (self.structure, [_for_transport(a) for a in self.arrays], self.tables,
                                 self.leaf_info)


def owned_copy(flat: Flat) -> Flat:
    """``flat`` with its arrays copied into memory of its own: what it holds no longer changes with
    the state it was flattened from (views) once this returns. Tables are immutable, not copied."""
    return Flat(flat.structure, [np.array(a, copy=True) for a in flat.arrays], flat.tables, flat.leaf_info)
