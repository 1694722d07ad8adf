"""RLlib's prioritized segment trees and free-node deques <-> their row leaves. Inner nodes are not
stored: each is ``op(left, right)`` of its children, so they are recomputed from the leaves, with the
same values and the same Python/numpy types.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Dict

import numpy as np

from ....errors import UnsupportedTypeError
from ..journal.trees import (free_nodes_from as _free_nodes_from, free_nodes_state as _free_nodes_state,  # noqa: F401
                             rebuild_tree as _rebuild_tree)
from ..journal.values import same_packed
from .values import pack_scalars


def _tree_leaves(tree: Any, idx: np.ndarray, what: str) -> Dict[str, Any]:
    if len(idx) == 0:
        return pack_scalars([], what)
    got = operator.itemgetter(*(idx + tree.capacity).tolist())(tree.value)
    return pack_scalars(list(got) if len(idx) > 1 else [got], what)


def _check_neutral(tree: Any, used: np.ndarray, what: str) -> None:
    """Leaves that belong to no row must hold the neutral element (else they could not be rebuilt)."""
    cap = tree.capacity
    leaves = np.fromiter(itertools.islice(tree.value, cap, 2 * cap), np.float64, cap)
    mask = np.ones(cap, bool)
    mask[used] = False
    bad = np.flatnonzero(mask & (leaves != tree.neutral_element))
    if len(bad):
        raise UnsupportedTypeError(f"replay buffer: {what}: leaves {bad[:5].tolist()} belong to no stored timestep "
                                   f"but hold {leaves[bad[:5]].tolist()} (expected {tree.neutral_element}): the "
                                   f"tree cannot be rebuilt from its rows")


def _same_leaves(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """``b`` (a min tree's row leaves), or a marker where it equals ``a`` (the sum tree's): RLlib sets
    both trees' leaf of a row to the same value, so this halves the per-row meta."""
    return {"same_as_sum": True} if same_packed(a, b) else b


def _leaves_of(packed: Dict[str, Any], sum_packed: Dict[str, Any]) -> Dict[str, Any]:
    return sum_packed if packed.get("same_as_sum") else packed


pos0 = np.empty(0, np.int64)


def _check_maps(mapping: Dict[int, int], tidx: np.ndarray, what: str) -> None:
    """``mapping`` must be {tree index of entry i: i} (it is then rebuilt from the rows)."""
    if len(mapping) != len(tidx):
        raise UnsupportedTypeError(f"replay buffer: {what} has {len(mapping)} entries for {len(tidx)} indices")
    # spot checks (evenly spaced, first and last): RLlib's add/evict keep this map in step with the
    # index list; a full check per save would cost O(rows) of Python on the training thread
    pos = np.unique(np.linspace(0, len(tidx) - 1, min(len(tidx), 257)).astype(np.int64)) if len(tidx) else pos0
    got = np.fromiter((mapping.get(t, -1) for t in tidx[pos].tolist()), np.int64, len(pos))
    bad = pos[got != pos]
    if len(bad):
        i = int(bad[0])
        raise UnsupportedTypeError(f"replay buffer: {what}[{int(tidx[i])}] is {mapping.get(int(tidx[i]))}, "
                                   f"expected {i}")
