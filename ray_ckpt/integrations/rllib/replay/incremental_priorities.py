"""Prioritized single-agent buffers, incrementally: each new row's ``prio`` columns, and the priority
records of the ``replay_meta`` log (the tree leaves that changed) fed by a recorder around the
instance's ``update_priorities`` and spot-checked against the trees at each capture; compacted when
they outgrow the buffer.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from ..names import log
from .incremental_state import Incremental, _leaf_codes, _raw
from .segment_trees import _check_maps, _check_neutral, _free_nodes_state
from .values import _pack_one

# the log is compacted when it holds more than COMPACT_FACTOR entries per row (plus COMPACT_MIN)
COMPACT_FACTOR = 2
COMPACT_MIN = 4096
SPOT = 64  # leaves compared against the cache at every capture


def _hook(buffer: Any, inc: Incremental) -> bool:
    """Record the tree indices ``update_priorities`` changes (True: the recorder was in place)."""
    cur = buffer.__dict__.get("update_priorities")
    if getattr(cur, "_ray_ckpt_inc", None) is inc:
        return True
    orig = type(buffer).update_priorities.__get__(buffer)
    touched = inc.touched
    last = lambda: buffer._last_sampled_indices  # noqa: E731

    def update_priorities(*args: Any, **kw: Any) -> Any:
        touched.append(list(last()))
        return orig(*args, **kw)
    update_priorities._ray_ckpt_hook = True
    update_priorities._ray_ckpt_inc = inc
    buffer.update_priorities = update_priorities
    return False


def _priorities(buffer: Any, inc: Incremental, keep: np.ndarray, new: Dict[str, np.ndarray], ids: np.ndarray,
                s: int, full: bool, bname: str) -> List[Dict[str, np.ndarray]]:
    """New rows' ``prio`` columns; the log entries of the old rows whose leaves changed."""
    st, mt = buffer._sum_segment, buffer._min_segment
    cap = st.capacity
    tnew = new["tree"].astype(np.int64)
    sv, sk = _leaf_codes(st, tnew, "_sum_segment")
    mv, mk = _leaf_codes(mt, tnew, "_min_segment")
    new["prio"], new["prio_k"] = sv, sk
    entries = []
    differ = np.flatnonzero((mv != sv) | (mk != sk))
    if len(differ):  # RLlib sets both leaves alike: a min leaf of its own is logged
        entries.append(_entries(ids[s + differ], 2, mv[differ], mk[differ]))
    trees = (st, mt, st.value, mt.value)
    hooked = _hook(buffer, inc)
    if full or inc.tree_to_row is None or len(inc.tree_to_row) != cap:
        _check_neutral(st, np.concatenate([inc.cols["tree"][keep].astype(np.int64) if not full else
                                             np.empty(0, np.int64), tnew]), f"{bname}._sum_segment")
        _check_neutral(mt, np.concatenate([inc.cols["tree"][keep].astype(np.int64) if not full else
                                             np.empty(0, np.int64), tnew]), f"{bname}._min_segment")
        inc.tree_to_row = np.full(cap, -1, np.int64)
        changed_pos = np.empty(0, np.int64)
        if not full:
            changed_pos = np.arange(s)  # compare every surviving row once
    else:
        gone = inc.cols["tree"][~keep].astype(np.int64)
        inc.tree_to_row[gone] = -1
        free = np.setdiff1d(gone, tnew)
        for tr, what in ((st, "_sum_segment"), (mt, "_min_segment")):
            if len(free):
                v, _ = _leaf_codes(tr, free, what)
                if np.any(v != tr.neutral_element):
                    raise UnsupportedTypeError(f"replay buffer: {bname}.{what}: a freed leaf does not hold "
                                               f"{tr.neutral_element}: the tree cannot be rebuilt from its rows")
        touched = np.unique(np.array(list(itertools.chain.from_iterable(inc.touched)), np.int64))
        rows = inc.tree_to_row[touched[(touched >= 0) & (touched < cap)]] if len(touched) else touched
        rows = rows[rows >= 0]
        changed_pos = np.searchsorted(ids[:s], rows)
        intact = hooked and inc.trees[:2] == trees[:2] and inc.trees[2] is trees[2] and inc.trees[3] is trees[3]
        if not intact:
            log.info("ray_ckpt: replay buffer %s: its trees were replaced or update_priorities was not "
                     "recorded: every row's leaves are compared once", bname)
            changed_pos = np.arange(s)
        elif s:
            spot = np.unique(np.linspace(0, s - 1, min(s, SPOT)).astype(np.int64))
            old_pos = np.flatnonzero(keep)[spot]
            v, k = _leaf_codes(st, inc.cols["tree"][old_pos].astype(np.int64), "_sum_segment")
            if np.any(v != inc.leaves["sv"][old_pos]) or np.any(k != inc.leaves["sk"][old_pos]):
                untracked = np.setdiff1d(spot, changed_pos)
                if len(untracked) and (np.any(v[np.isin(spot, untracked)] !=
                                              inc.leaves["sv"][old_pos][np.isin(spot, untracked)])):
                    log.warning("ray_ckpt: replay buffer %s: a priority changed outside update_priorities: "
                                "every row's leaves are compared", bname)
                    changed_pos = np.arange(s)
    inc.touched.clear()
    inc.trees = trees
    # leaves of the surviving rows, then the changed ones compared with what was stored
    lv = {k: (v[keep] if not full else v[:0]) for k, v in inc.leaves.items()} if inc.leaves else \
        {"sv": np.empty(0), "sk": np.empty(0, np.int8), "mv": np.empty(0), "mk": np.empty(0, np.int8)}
    if len(changed_pos):
        tr_old = (inc.cols["tree"][keep] if not full else new["tree"][:0]).astype(np.int64)[changed_pos]
        csv, csk = _leaf_codes(st, tr_old, "_sum_segment")
        cmv, cmk = _leaf_codes(mt, tr_old, "_min_segment")
        ds = (csv != lv["sv"][changed_pos]) | (csk != lv["sk"][changed_pos])
        dm = (cmv != lv["mv"][changed_pos]) | (cmk != lv["mk"][changed_pos])
        both = (ds | dm) & (csv == cmv) & (csk == cmk)
        only_s, only_m = ds & ~both, dm & ~both
        rid_of = ids[changed_pos]
        for sel, which, v, k in ((both, 0, csv, csk), (only_s, 1, csv, csk), (only_m, 2, cmv, cmk)):
            if np.any(sel):
                entries.append(_entries(rid_of[sel], which, v[sel], k[sel]))
        lv["sv"][changed_pos], lv["sk"][changed_pos] = csv, csk
        lv["mv"][changed_pos], lv["mk"][changed_pos] = cmv, cmk
    inc.leaves = {"sv": np.concatenate([lv["sv"], sv]), "sk": np.concatenate([lv["sk"], sk]),
                  "mv": np.concatenate([lv["mv"], mv]), "mk": np.concatenate([lv["mk"], mk])}
    inc.tree_to_row[tnew] = ids[s:]
    return entries


def _entries(rows: np.ndarray, which: int, v: np.ndarray, k: np.ndarray) -> Dict[str, np.ndarray]:
    return {"row": rows.astype(np.int64), "which": np.full(len(rows), which, np.int8),
            "v": v.astype(np.float64), "k": k.astype(np.int8)}


def _priority_record(inc: Incremental, entries: List[Dict[str, np.ndarray]], n_rows: int
                     ) -> Optional[Tuple[bytes, int]]:
    """This save's changed leaves as a priority record's bytes and its entry count (None: no change);
    when the live records would hold more than COMPACT_FACTOR entries per row, one record of the rows
    whose leaves are not their ``prio`` replaces them all (``inc.precs`` is emptied: the caller
    appends the record)."""
    m = sum(len(e["row"]) for e in entries)
    if inc.log_entries + m > COMPACT_FACTOR * n_rows + COMPACT_MIN:
        sv, sk, mv, mk = (inc.leaves[k] for k in ("sv", "sk", "mv", "mk"))
        p, pk = inc.cols["prio"], inc.cols["prio_k"]
        same = (sv == mv) & (sk == mk)
        off_s = (sv != p) | (sk != pk)
        off_m = (mv != p) | (mk != pk)
        entries = []
        for sel, which, v, k in ((same & (off_s | off_m), 0, sv, sk), (~same & off_s, 1, sv, sk),
                                 (~same & off_m, 2, mv, mk)):
            if np.any(sel):
                entries.append(_entries(inc.ids[sel], which, v[sel], k[sel]))
        inc.precs = []
        m = sum(len(e["row"]) for e in entries)
    if not m:
        return None
    add = {k: np.concatenate([e[k] for e in entries]) for k in ("row", "which", "v", "k")}
    # in row order (small differences): a row has one entry per tree in a record, so order within it
    # does not change which entry is a tree's last
    order = np.argsort(add["row"], kind="stable")
    return _raw(_pack_entries({k: v[order] for k, v in add.items()})), m


def _pack_entries(e: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Entries as stored: row ids as differences (small numbers: they compress), values as float32
    where that is exact (RLlib's TD errors are float32)."""
    v = e["v"]
    v32 = v.astype(np.float32)
    exact = bool(np.array_equal(v32.astype(np.float64), v, equal_nan=True))
    return {"row": np.diff(e["row"], prepend=np.int64(0)), "which": e["which"], "v": v32 if exact else v,
            "k": e["k"]}


def unpack_entries(e: Dict[str, Any]) -> Dict[str, np.ndarray]:
    return {"row": np.cumsum(np.asarray(e["row"], np.int64)), "which": np.asarray(e["which"], np.int8),
            "v": np.asarray(e["v"]).astype(np.float64), "k": np.asarray(e["k"], np.int8)}


def _priority_scalars(buffer: Any, inc: Incremental, bname: str) -> Dict[str, Any]:
    _check_maps(buffer._tree_idx_to_sample_idx, inc.cols["tree"].astype(np.int64),
                  f"{bname}._tree_idx_to_sample_idx")
    return {"max_priority": _pack_one(buffer._max_priority, "_max_priority"),
            "max_idx": int(buffer._max_idx),
            "free_nodes": _free_nodes_state(buffer._free_nodes),
            "last_sampled": [int(i) for i in buffer._last_sampled_indices],
            "tree_capacity": int(buffer._sum_segment.capacity),
            "records": np.array(inc.precs, np.int64).reshape(len(inc.precs), 3)}
