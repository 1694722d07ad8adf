"""The multi-agent prioritized buffer's ``_sample_idx_to_tree_idx`` in format /5's log: its key order
as runs of keys in the meta record or, when long, as *key-order records* (a base, then what changed
since); its values from the env steps' tree indices.

RLlib writes this map and never reads it; an exact restore keeps it, key order included. Its values
need no storing: the value of key ``k`` is the tree index of env step ``k`` (RLlib sets ``map[i]`` for
every survivor ``i`` on an eviction and for every new step), except for stale keys past the end of
the env-step list (positions of survivors before a shorter renumbering), which the meta record
lists. Its key order is what costs: an eviction pops the evicted steps' old positions and renumbers
the survivors, so popped positions below the new length come back at the end; with episodes whose
chunks interleave, the order breaks into runs of consecutive keys -- about as many as the chunks
of the episodes evicted together (parallel episodes times chunks per episode), whatever the
capacity -- and stored whole at every save it would cost that at every save, not what the save added.

So, once the order holds more than :data:`INLINE_RUNS` runs, the log holds a chain of key-order
records: a *base* (the order as runs of consecutive keys), then one *delta* per save whose order
changed: the keys dropped from the previous order (as sorted runs) and the keys appended after the
ones kept. Every change RLlib makes is of that form between two saves (a key is either never
popped, and keeps its place, or popped and later re-appended), so a delta holds only the keys
evictions touched and the new steps' keys. When the live deltas hold more runs than
:data:`COMPACT_FACTOR` times the order's own, or the chain reaches :data:`MAX_RECORDS` records, one
base replaces the chain. A shorter order is cheaper in the meta record itself (as runs) than in
records of its own (at least one log row each), so it stays there and the chain leaves the log.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....errors import RestoreError

# an order of at most this many runs stays in the meta record: there it costs ~2 bytes a run at
# every save, a key-order record at least a log row (256 bytes) at every save whose order changed
INLINE_RUNS = 256
COMPACT_FACTOR = 2
MAX_RECORDS = 64   # live key-order records at most (the meta record lists each one)


def runs_of(keys: np.ndarray) -> np.ndarray:
    """Keys as runs of consecutive integers: a (2, runs) array of first keys and lengths."""
    n = len(keys)
    if not n:
        return np.empty((2, 0), np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(keys) != 1) + 1])
    lens = np.diff(np.concatenate([starts, [n]]))
    return np.stack([keys[starts], lens]).astype(np.int64)


def keys_of(runs: Any) -> np.ndarray:
    """:func:`runs_of` back."""
    r = np.asarray(runs, np.int64).reshape(2, -1)
    if not r.shape[1]:
        return np.empty(0, np.int64)
    lens = r[1]
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(r[0], lens) + offsets


def order_delta(old: np.ndarray, new: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(the keys to drop from ``old``, sorted; the keys to append after the rest): ``new`` is
    ``old`` without the dropped keys, in ``old``'s order, then the appended ones. The kept part is
    the longest prefix of ``new`` that appears in ``old`` in the same order."""
    if len(old) and len(new) and min(int(old.min()), int(new.min())) >= 0:
        top = max(int(old.max()), int(new.max())) + 1
        pos_of = np.full(top, -1, np.int64)
        pos_of[old] = np.arange(len(old))
        pos = pos_of[new]
        bad = (pos < 0) | (np.diff(pos, prepend=np.int64(-1)) <= 0)
        m = int(np.argmax(bad)) if bad.any() else len(new)
    else:
        m = 0
    kept = new[:m]
    return np.setdiff1d(old, kept), new[m:].copy()


def apply_delta(old: np.ndarray, drop: np.ndarray, add: np.ndarray) -> np.ndarray:
    return np.concatenate([old[~np.isin(old, drop)], add]).astype(np.int64)


def key_order_record(inc: Any, keys: np.ndarray, full: bool) -> Optional[Tuple[Dict[str, Any], int]]:
    """This save's key-order record (a base or a delta) and its runs; None where the order did not
    change or is short enough for the meta record (then ``inc.s2t_recs`` is emptied: the chain
    leaves). On a base the live records leave too (the caller appends the base). Advances
    ``inc.s2t_keys``."""
    old = inc.s2t_keys
    inc.s2t_keys = keys
    runs = runs_of(keys).shape[1]
    if runs <= INLINE_RUNS:
        inc.s2t_recs = []
        return None
    if not full and old is not None and inc.s2t_recs:
        if np.array_equal(old, keys):
            return None
        drop, add = order_delta(old, keys)
        rec = {"drop": runs_of(drop), "add": runs_of(add)}
        n = rec["drop"].shape[1] + rec["add"].shape[1]
        if sum(r[2] for r in inc.s2t_recs) + n <= COMPACT_FACTOR * runs and len(inc.s2t_recs) < MAX_RECORDS:
            return rec, n
    inc.s2t_recs = []
    return {"base": runs_of(keys)}, runs


def s2t_state(inc: Any, s2t: Dict[int, int], env_t: np.ndarray) -> Dict[str, Any]:
    """The meta record's part of ``_sample_idx_to_tree_idx``: its key order as runs (no live
    key-order records) or the live records' places and its length; the entries whose value is not
    derived (:func:`s2t_values`)."""
    keys = inc.s2t_keys
    out: Dict[str, Any] = {"runs": runs_of(keys)} if not inc.s2t_recs else \
        {"records": np.array(inc.s2t_recs, np.int64).reshape(len(inc.s2t_recs), 3), "n": len(keys)}
    out.update(s2t_values(s2t, keys, env_t))
    return out


def keys_from_records(recs: List[Dict[str, Any]], where: str) -> np.ndarray:
    """The key order of a chain of key-order records (decoded, oldest first)."""
    if not recs or "base" not in recs[0]:
        raise RestoreError(f"{where}: the key-order records do not start with a base")
    keys = keys_of(recs[0]["base"])
    for r in recs[1:]:
        if "base" in r:
            raise RestoreError(f"{where}: a base key-order record inside the chain")
        keys = apply_delta(keys, keys_of(r["drop"]), keys_of(r["add"]))
    return keys


def s2t_values(s2t: Dict[int, int], keys: np.ndarray, env_t: np.ndarray) -> Dict[str, np.ndarray]:
    """The map's entries whose value is not the tree index of the env step at the key's position
    (``keys``: the map's keys in its order): positions in that order and their values."""
    n = len(keys)
    v = np.fromiter(s2t.values(), np.int64, n)
    off = np.flatnonzero(v != derived_values(keys, env_t))
    return {"off_at": off, "off_v": v[off]}


def derived_values(keys: np.ndarray, env_t: np.ndarray) -> np.ndarray:
    v = np.full(len(keys), -1, np.int64)
    ok = (keys >= 0) & (keys < len(env_t))
    v[ok] = env_t[keys[ok]]
    return v


def s2t_pairs(keys: np.ndarray, off: Dict[str, Any], env_t: np.ndarray) -> np.ndarray:
    """The map as a (2, n) array of keys and values, in key order."""
    v = derived_values(keys, env_t)
    v[np.asarray(off["off_at"], np.int64)] = np.asarray(off["off_v"], np.int64)
    return np.stack([keys, v])
