"""The journal's cache of its live rows (their ids and 256-byte blobs) kept in step with the
buffer's evictions without copying every row each save.

Why: copying every cached row each save was ~90 ms of a 1M-row DQN buffer's ~120 ms ``save()``
(benchmarks/RESULTS.md). RLlib evicts oldest first, so the survivors are nearly always a suffix
(:func:`survivors`: a view), and new rows go into room kept after them (:func:`appended`: O(new
rows) per save, amortised).

The arrays handed out are plain numpy views that never change afterwards: a later append writes
only past their end, so a snapshot of an earlier capture (copied into the object store in the
background) reads the same bytes however many saves follow.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple, Union

import numpy as np

GROW = 1.5       # a new backing array holds this many times the rows it starts with
MIN_ROOM = 1024  # and at least this many rows of room

# id(backing array) -> (a weak reference to it, rows of it in use: the end of the newest view
# handed out); an entry leaves with its array (numpy arrays are not hashable: no WeakKeyDictionary)
_USED: Dict[int, Tuple["weakref.ref[np.ndarray]", int]] = {}


def _in_use(base: np.ndarray) -> Optional[int]:
    e = _USED.get(id(base))
    return e[1] if e is not None and e[0]() is base else None


def _mark(base: np.ndarray, rows: int) -> None:
    key = id(base)
    e = _USED.get(key)
    if e is not None and e[0]() is base:
        _USED[key] = (e[0], rows)
        return

    def gone(ref: "weakref.ref[np.ndarray]", key: int = key) -> None:
        if _USED.get(key, (None, 0))[0] is ref:
            del _USED[key]
    _USED[key] = (weakref.ref(base, gone), rows)


def survivors(keep: np.ndarray) -> Union[slice, np.ndarray]:
    """``keep`` (which cached rows survive) as a slice where it is one (every row kept, or the
    evicted ones a prefix: indexing then gives a view), else the mask itself."""
    n = len(keep)
    if n == 0:
        return slice(0, 0)
    first = int(np.argmax(keep))
    if not keep[first]:
        return slice(n, n)
    return slice(first, n) if keep[first:].all() else keep


def appended(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``np.concatenate([old, new])``, copying only ``new`` where ``old`` ends where the rows in use
    of a backing array made here end and there is room after it; else a new backing array with room."""
    new = np.asarray(new)
    if new.dtype != old.dtype or new.shape[1:] != old.shape[1:] or not old.flags.c_contiguous:
        return np.concatenate([old, new])
    k = len(new)
    base = old.base
    used = _in_use(base) if isinstance(base, np.ndarray) else None
    if used is not None and base.ndim == old.ndim and len(old):
        offset, rem = divmod(old.__array_interface__["data"][0] - base.__array_interface__["data"][0],
                             base.strides[0])
        end = offset + len(old)
        if rem == 0 and end == used and end + k <= len(base):
            base[end:end + k] = new
            _mark(base, end + k)
            return base[offset:end + k]
    n = len(old) + k
    fresh = _fresh(n, old)
    fresh[:len(old)] = old
    fresh[len(old):n] = new
    _mark(fresh, n)
    return fresh[:n]


def kept(old: np.ndarray, sel: Union[slice, np.ndarray], new: np.ndarray) -> np.ndarray:
    """``appended(old[sel], new)``; where ``sel`` is a mask (evictions spread among the rows) the
    survivors and the new rows are copied once, into a new backing array with room, not twice."""
    if isinstance(sel, slice):
        return appended(old[sel], new)
    new = np.asarray(new)
    if new.dtype != old.dtype or new.shape[1:] != old.shape[1:]:
        return np.concatenate([old[sel], new])
    s = int(np.count_nonzero(sel))
    n = s + len(new)
    fresh = _fresh(n, old)
    np.compress(sel, old, axis=0, out=fresh[:s])
    fresh[s:n] = new
    _mark(fresh, n)
    return fresh[:n]


def _fresh(n: int, like: np.ndarray) -> np.ndarray:
    return np.empty((max(int(n * GROW), n + MIN_ROOM),) + like.shape[1:], like.dtype)
