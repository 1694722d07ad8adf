"""RLlib's prioritized segment trees and free-node deques from what the journal stores: a tree's
leaves (inner nodes are ``op(left, right)`` of their children, so they are recomputed, with the same
values and the same Python/numpy types) and a deque as ``prefix + range``.
"""
from __future__ import annotations

import collections
import itertools
import operator
import weakref
from typing import Any, Dict, List, Tuple

import numpy as np

from .values import unpack_scalars

# a tree with fewer nodes off the neutral value than one in this many is built as the neutral list
# and those nodes (a 1M-capacity tree is 4M nodes: its tolist() cost ~0.1 s at each restore of a
# buffer holding a few thousand rows)
SPARSE_BELOW = 4


def rebuild_tree(tree: Any, idx: np.ndarray, packed: Dict[str, Any]) -> None:
    """The tree's values from its row leaves: the leaves, then every inner node as ``op(left, right)``
    of its children, as RLlib's ``__setitem__`` leaves them (same values, same Python/numpy types)."""
    cap = tree.capacity
    neutral = tree.neutral_element
    kinds = set(packed["kinds"])
    v = np.asarray(packed["v"])
    if kinds <= {"float", "np:<f8"} and type(neutral) is float and not np.isnan(v).any():
        tree.value = rebuild_tree_f64(tree, idx, v, packed)
        return
    value = [neutral] * (2 * cap)
    for i, x in zip(idx.tolist(), unpack_scalars(packed)):
        value[cap + i] = x
    op = tree.operation
    for i in range(cap - 1, 0, -1):
        value[i] = op(value[2 * i], value[2 * i + 1])
    tree.value = value


def rebuild_tree_f64(tree: Any, idx: np.ndarray, v: np.ndarray, packed: Dict[str, Any]) -> List[Any]:
    """:func:`rebuild_tree` for leaves that are Python floats / ``np.float64`` (what RLlib's trees
    hold with float64 priorities), level by level in numpy: a Python float add and an ``np.float64``
    add are the same IEEE double add, so the values are identical; an inner node is an ``np.float64``
    where RLlib's would be one (sum: a child is; min: the child ``min`` returns is)."""
    cap = tree.capacity
    vals = np.full(2 * cap, tree.neutral_element, np.float64)
    is_np = np.zeros(2 * cap, bool)
    vals[cap + idx] = v
    kinds = list(packed["kinds"])
    if "k" in packed:
        is_np[cap + idx] = np.asarray(packed["k"]) == kinds.index("np:<f8")
    elif kinds == ["np:<f8"]:
        is_np[cap + idx] = True
    is_sum = tree.operation is operator.add
    lo = cap
    while lo > 1:
        hi, lo = lo, lo // 2
        left, right = vals[2 * lo:2 * hi:2], vals[2 * lo + 1:2 * hi:2]
        lnp, rnp = is_np[2 * lo:2 * hi:2], is_np[2 * lo + 1:2 * hi:2]
        if is_sum:
            vals[lo:hi] = left + right
            is_np[lo:hi] = lnp | rnp
        else:  # Python's min(a, b) returns a unless b < a
            take_right = right < left
            vals[lo:hi] = np.where(take_right, right, left)
            is_np[lo:hi] = np.where(take_right, rnp, lnp)
    neutral = tree.neutral_element
    # the nodes that are not the neutral value, bit for bit (-0.0 is not 0.0): a live leaf's ancestors
    differs = vals.view(np.int64) != np.array(neutral, np.float64).view(np.int64)
    differs[0] = False  # index 0 is never written by RLlib
    at = np.flatnonzero(differs & ~is_np)
    if len(at) * SPARSE_BELOW < len(vals):  # a buffer far below its capacity: the neutral list, then its nodes
        out = [neutral] * len(vals)
        for i, x in zip(at.tolist(), vals[at].tolist()):
            out[i] = x
    else:
        out = vals.tolist()  # Python floats
        out[0] = neutral
    at = np.flatnonzero(is_np)  # then the nodes that are np.float64
    for i, x in zip(at.tolist(), list(vals[at])):
        out[i] = x
    return out


def free_nodes_state(dq: Any) -> Dict[str, Any]:
    """A free-node deque as ``prefix + range(start, stop)``: RLlib pops free nodes from the left and
    puts freed ones back on the left, so the deque is the freed nodes (LIFO) followed by the part of
    the initial ``range(2 * tree_capacity)`` not handed out yet."""
    n = len(dq)
    stop = dq.maxlen if dq.maxlen is not None else (max(dq) + 1 if n else 0)
    k = 0
    prefix = []
    for k, x in enumerate(dq):
        if x == stop - (n - k):
            break
        prefix.append(x)
    else:
        k = n
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


def free_nodes_from(st: Dict[str, Any]) -> collections.deque:
    """The free-node deque :func:`free_nodes_state` stored."""
    maxlen = st["maxlen"]
    if "all" in st:
        return collections.deque(np.asarray(st["all"]).tolist(), maxlen=maxlen)
    items = itertools.chain(np.asarray(st["prefix"]).tolist(), range(int(st["start"]), int(st["stop"])))
    return collections.deque(items, maxlen=maxlen)
