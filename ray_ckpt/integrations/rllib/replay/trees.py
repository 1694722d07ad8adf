"""RLlib's prioritized segment trees and free-node deques from what the journal stores: a tree's
leaves (inner nodes are ``op(left, right)`` of their children, so they are recomputed, with the same
values and the same Python/numpy types) and a deque as ``prefix + range``.
"""
from __future__ import annotations

import collections
import itertools
import operator
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .values import unpack_scalars


def rebuild_tree(tree: Any, idx: np.ndarray, packed: Dict[str, Any], into: Optional[List[Any]] = None) -> None:
    """The tree's values from its row leaves (see the module docstring). Only the nodes from the
    lowest to the highest live leaf and their ancestors are computed (a 1M-capacity tree is 4M
    nodes; a buffer a few minutes into a run uses a few thousand); the others are the neutral value.
    ``into``: a fresh buffer's own all-neutral list of ``2 * capacity`` values, written in place:
    the restore is then O(live leaves), not O(capacity)."""
    cap = tree.capacity
    neutral = tree.neutral_element
    value = into if into is not None else [neutral] * (2 * cap)
    v = np.asarray(packed["v"])
    if len(idx) and set(packed["kinds"]) <= {"float", "np:<f8"} and type(neutral) is float and not np.isnan(v).any():
        _rebuild_f64(value, tree, idx, v, packed)
    elif len(idx):
        for i, x in zip(idx.tolist(), unpack_scalars(packed)):
            value[cap + i] = x
        op = tree.operation
        lo, hi = cap + int(idx.min()), cap + int(idx.max()) + 1
        while lo > 1:
            lo, hi = lo // 2, (hi - 1) // 2 + 1
            for i in range(lo, hi):
                value[i] = op(value[2 * i], value[2 * i + 1])
    tree.value = value


def _rebuild_f64(value: List[Any], tree: Any, idx: np.ndarray, v: np.ndarray, packed: Dict[str, Any]) -> None:
    """:func:`rebuild_tree` for leaves that are Python floats / ``np.float64`` (what RLlib's trees
    hold with float64 priorities), level by level in numpy: a Python float add and an ``np.float64``
    add are the same IEEE double add, so the values are identical; an inner node is an ``np.float64``
    where RLlib's would be one (sum: a child is; min: the child ``min`` returns is)."""
    neutral = tree.neutral_element
    lo, hi = int(idx.min()), int(idx.max()) + 1
    vals = np.full(hi - lo, neutral, np.float64)
    vals[idx - lo] = v
    is_np = np.zeros(hi - lo, bool)
    kinds = list(packed["kinds"])
    if "k" in packed:
        is_np[idx - lo] = np.asarray(packed["k"]) == kinds.index("np:<f8")
    elif kinds == ["np:<f8"]:
        is_np[idx - lo] = True
    is_sum = tree.operation is operator.add
    lo, hi = lo + tree.capacity, hi + tree.capacity
    while True:
        value[lo:hi] = vals.tolist()  # Python floats; then the nodes that are np.float64
        for j, x in zip(np.flatnonzero(is_np).tolist(), list(vals[is_np])):
            value[lo + j] = x
        if lo <= 1:
            return
        if lo % 2:  # widen to whole sibling pairs: the nodes outside [lo, hi) are neutral
            lo, vals, is_np = lo - 1, np.concatenate([[neutral], vals]), np.concatenate([[False], is_np])
        if hi % 2:
            hi, vals, is_np = hi + 1, np.concatenate([vals, [neutral]]), np.concatenate([is_np, [False]])
        left, right, lnp, rnp = vals[0::2], vals[1::2], is_np[0::2], is_np[1::2]
        if is_sum:
            vals, is_np = left + right, lnp | rnp
        else:  # Python's min(a, b) returns a unless b < a
            take_right = right < left
            vals, is_np = np.where(take_right, right, left), np.where(take_right, rnp, lnp)
        lo, hi = lo // 2, hi // 2


def free_nodes_state(dq: Any) -> Dict[str, Any]:
    """A free-node deque as ``prefix + range(start, stop)``: RLlib pops free nodes from the left and
    puts freed ones back on the left, so the deque is the freed nodes (LIFO) followed by the part of
    the initial ``range(2 * tree_capacity)`` not handed out yet."""
    n = len(dq)
    stop = dq.maxlen if dq.maxlen is not None else (max(dq) + 1 if n else 0)
    k = next((k for k, x in enumerate(dq) if x == stop - (n - k)), n)  # the freed nodes before the range
    prefix = list(itertools.islice(dq, k))
    start = stop - (n - k)
    if n - k <= 65536:
        tail_ok = list(itertools.islice(dq, k, n)) == list(range(start, stop))
    else:
        tail_ok = _long_tail_ok(dq, k, n, start, stop)
    if not tail_ok:
        return {"all": np.array(list(dq), np.int64), "maxlen": dq.maxlen}
    return {"prefix": np.array(prefix, np.int64), "start": int(start), "stop": int(stop), "maxlen": dq.maxlen}


# deque id -> (weak reference to it, the start and stop of its tail at its last spot check, saves since)
_CHECKED: Dict[int, Tuple[Any, int, int, int]] = {}
RECHECK_EVERY = 16  # saves between two spot checks of a long tail whose ends hold what they should


def _long_tail_ok(dq: Any, k: int, n: int, start: int, stop: int) -> bool:
    """Whether ``dq[k:n]`` (a long tail: a 1M-row buffer's deque holds ~2M nodes) is
    ``range(start, stop)``: its ends exactly; between them, spot checks (indexing a deque's middle
    is not O(1): 17 of them cost ~0.4 ms on a 2M deque, per tree per save). Since RLlib only pops
    and puts nodes at the left, a tail that is the end of the one spot-checked at an earlier save
    (same deque, same stop, a start not below it) is not spot-checked again but every
    RECHECK_EVERY saves."""
    if dq[k] != start or dq[n - 1] != stop - 1:
        return False
    key = id(dq)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0]() is dq and hit[2] == stop and hit[1] <= start and hit[3] < RECHECK_EVERY:
        _CHECKED[key] = (hit[0], hit[1], stop, hit[3] + 1)
        return True
    if not all(dq[k + j] == start + j for j in np.linspace(0, n - k - 1, 17).astype(int).tolist()):
        _CHECKED.pop(key, None)
        return False
    _CHECKED[key] = (weakref.ref(dq, lambda _, key=key: _CHECKED.pop(key, None)), start, stop, 0)
    return True


def free_nodes_from(st: Dict[str, Any], into: Optional[collections.deque] = None) -> collections.deque:
    """The free-node deque :func:`free_nodes_state` stored. ``into``: a fresh buffer's own deque,
    ``range(maxlen)`` as RLlib's ``__init__`` makes it, made the stored one in place: O(the nodes
    ever handed out), not O(capacity)."""
    maxlen = st["maxlen"]
    if "all" in st:
        return collections.deque(np.asarray(st["all"]).tolist(), maxlen=maxlen)
    start, stop = int(st["start"]), int(st["stop"])
    if into is not None and into.maxlen == maxlen == stop == len(into) and into[0] == 0 and into[-1] == stop - 1:
        for _ in range(start):
            into.popleft()
        into.extendleft(reversed(np.asarray(st["prefix"]).tolist()))
        return into
    return collections.deque(itertools.chain(np.asarray(st["prefix"]).tolist(), range(start, stop)), maxlen=maxlen)
