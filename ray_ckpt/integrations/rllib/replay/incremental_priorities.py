"""Prioritized buffers, incrementally: each new row's ``prio`` columns, and the priority records of
the ``replay_meta`` log (the tree leaves that changed) fed by a recorder around the instance's
``update_priorities`` and spot-checked against the trees at each capture; compacted when they
outgrow the buffer.

A row's leaves live in one pair of sum/min trees: the buffer's (single-agent; group 0) or its
module's (multi-agent; the group is the row's ``module`` code). The multi-agent buffer's env-step
trees are not per row: :mod:`.incremental_multi_agent` keeps their leaves with the env steps.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from ..base.names import log
from ..journal.growth import appended, evicted_rows, positions
from .incremental_state import Incremental, _leaf_codes, _raw
from .priorities import tree_scalars
from .segment_trees import _check_maps, _check_neutral

# the log is compacted when it holds more than COMPACT_FACTOR entries per row (plus COMPACT_MIN)
COMPACT_FACTOR = 2
COMPACT_MIN = 4096
SPOT = 64  # leaves compared against the cache at every capture

Trees = Dict[int, Tuple[Any, Any]]  # group (module code; 0 single-agent) -> (sum tree, min tree)


def _hook(buffer: Any, inc: Incremental, multi_agent: bool = False) -> bool:
    """Record the tree indices ``update_priorities`` changes, as (module id or None, indices)
    (True: the recorder was in place)."""
    cur = buffer.__dict__.get("update_priorities")
    if getattr(cur, "_ray_ckpt_inc", None) is inc:
        return True
    orig = type(buffer).update_priorities.__get__(buffer)
    touched = inc.touched

    def update_priorities(*args: Any, **kw: Any) -> Any:
        if multi_agent:
            mid = kw["module_id"] if "module_id" in kw else args[1]
            touched.append((mid, list(buffer._module_to_last_sampled_indices[mid])))
        else:
            touched.append((None, list(buffer._last_sampled_indices)))
        return orig(*args, **kw)
    update_priorities._ray_ckpt_hook = True
    update_priorities._ray_ckpt_inc = inc
    buffer.update_priorities = update_priorities
    return False


def _group_leaves(trees: Trees, groups: np.ndarray, tidx: np.ndarray) -> Tuple[np.ndarray, ...]:
    """(sum value, sum kind, min value, min kind) of the leaves ``tidx`` in each row's group's trees."""
    sv, mv = np.empty(len(tidx), np.float64), np.empty(len(tidx), np.float64)
    sk, mk = np.empty(len(tidx), np.int8), np.empty(len(tidx), np.int8)
    for g in np.unique(groups).tolist():
        sel = groups == g
        if g not in trees:
            raise UnsupportedTypeError(f"replay buffer: rows of module {g} but no segment trees for it")
        st, mt = trees[g]
        sv[sel], sk[sel] = _leaf_codes(st, tidx[sel], "sum tree")
        mv[sel], mk[sel] = _leaf_codes(mt, tidx[sel], "min tree")
    return sv, sk, mv, mk


def _groups_of(cols: Dict[str, np.ndarray], n: int) -> np.ndarray:
    return cols["module"].astype(np.int64) if "module" in cols else np.zeros(n, np.int64)


def check_freed(trees: Tuple[Any, ...], freed: np.ndarray, what: str) -> None:
    """Leaves no row holds any more must hold the neutral element (else the trees cannot be rebuilt)."""
    for tr in trees:
        if len(freed):
            v, _ = _leaf_codes(tr, freed, what)
            if np.any(v != tr.neutral_element):
                raise UnsupportedTypeError(f"replay buffer: {what}: a freed leaf does not hold "
                                           f"{tr.neutral_element}: the tree cannot be rebuilt from its rows")


def _priorities(trees: Trees, inc: Incremental, sel: Any, new: Dict[str, np.ndarray], ids: np.ndarray,
                s: int, full: bool, hooked: bool, touched: Dict[int, List[int]], bname: str
                ) -> List[Dict[str, np.ndarray]]:
    """New rows' ``prio`` columns; the log entries of the old rows whose leaves changed (``touched``:
    tree indices ``update_priorities`` was given since the last capture, per group). ``sel``: the
    surviving cached rows (:func:`.growth.survivors`): where it is a slice the
    survivors' columns are views, and the work per save is O(new and touched rows)."""
    tnew = new["tree"].astype(np.int64)
    gnew = _groups_of(new, len(tnew))
    sv, sk, mv, mk = _group_leaves(trees, gnew, tnew)
    new["prio"], new["prio_k"] = sv, sk
    entries = []
    differ = np.flatnonzero((mv != sv) | (mk != sk))
    if len(differ):  # RLlib sets both leaves alike: a min leaf of its own is logged
        entries.append(_entries(ids[s + differ], 2, mv[differ], mk[differ]))
    now = {g: (st, mt, st.value, mt.value) for g, (st, mt) in trees.items()}
    told = inc.cols["tree"][sel] if not full else np.empty(0, np.int32)  # int32, a view where sel is a slice
    gold = inc.cols["module"][sel] if not full and "module" in inc.cols else None  # None: group 0 only

    def at(pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:  # (groups, tree indices) of survivors pos
        return (np.zeros(len(pos), np.int64) if gold is None else gold[pos].astype(np.int64),
                told[pos].astype(np.int64))

    def of_group(arr: np.ndarray, g: int) -> np.ndarray:  # the survivors' arr where their group is g
        return (arr if g == 0 else arr[:0]) if gold is None else arr[gold == g]

    if full or any(g not in inc.tree_to_row or len(inc.tree_to_row[g]) != st.capacity
                   for g, (st, _) in trees.items() if g in inc.trees):
        for g, (st, mt) in trees.items():
            used = np.concatenate([of_group(told, g).astype(np.int64), tnew[gnew == g]])
            _check_neutral(st, used, f"{bname} sum tree {g}")
            _check_neutral(mt, used, f"{bname} min tree {g}")
        inc.tree_to_row = {}
        changed_pos = np.arange(s) if not full else np.empty(0, np.int64)
    else:
        ev = evicted_rows(sel)
        gone = inc.cols["tree"][ev].astype(np.int64)
        ggone = inc.cols["module"][ev].astype(np.int64) if "module" in inc.cols else np.zeros(len(gone), np.int64)
        rows = []
        for g, (st, mt) in trees.items():
            t2r = inc.tree_to_row.get(g)
            if t2r is None:
                continue
            if len(gone):  # rows evicted since the last capture: their leaves are freed
                t2r[gone[ggone == g]] = -1
                check_freed((st, mt), np.setdiff1d(gone[ggone == g], tnew[gnew == g]), f"{bname} trees {g}")
            tt = np.unique(np.array(touched.get(g, []), np.int64))
            r = t2r[tt[(tt >= 0) & (tt < len(t2r))]] if len(tt) else tt
            rows.append(r[r >= 0])
        rows = np.sort(np.concatenate(rows)) if rows else np.empty(0, np.int64)
        changed_pos = np.searchsorted(ids[:s], rows)
        intact = hooked and all(_same_trees(inc.trees.get(g, t), t) for g, t in now.items())
        if not intact:
            log.info("ray_ckpt: replay buffer %s: its trees were replaced or update_priorities was not "
                     "recorded: every row's leaves are compared once", bname)
            changed_pos = np.arange(s)
        elif s:
            spot = np.unique(np.linspace(0, s - 1, min(s, SPOT)).astype(np.int64))
            old_pos = positions(sel, spot)
            v, k, _, _ = _group_leaves(trees, *at(spot))
            untracked = ~np.isin(spot, changed_pos)
            if np.any(untracked & ((v != inc.leaves["sv"][old_pos]) | (k != inc.leaves["sk"][old_pos]))):
                log.warning("ray_ckpt: replay buffer %s: a priority changed outside update_priorities: "
                            "every row's leaves are compared", bname)
                changed_pos = np.arange(s)
    inc.trees = now
    # views of inc.leaves' own arrays where sel is a slice: only this cache holds them, extended below
    lv = {k: (v[sel] if not full else v[:0]) for k, v in inc.leaves.items()} if inc.leaves else \
        {"sv": np.empty(0), "sk": np.empty(0, np.int8), "mv": np.empty(0), "mk": np.empty(0, np.int8)}
    if len(changed_pos):
        csv, csk, cmv, cmk = _group_leaves(trees, *at(changed_pos))
        ds = (csv != lv["sv"][changed_pos]) | (csk != lv["sk"][changed_pos])
        dm = (cmv != lv["mv"][changed_pos]) | (cmk != lv["mk"][changed_pos])
        both = (ds | dm) & (csv == cmv) & (csk == cmk)
        only_s, only_m = ds & ~both, dm & ~both
        rid_of = ids[changed_pos]
        for pick, which, v, k in ((both, 0, csv, csk), (only_s, 1, csv, csk), (only_m, 2, cmv, cmk)):
            if np.any(pick):
                entries.append(_entries(rid_of[pick], which, v[pick], k[pick]))
        lv["sv"][changed_pos], lv["sk"][changed_pos] = csv, csk
        lv["mv"][changed_pos], lv["mk"][changed_pos] = cmv, cmk
    inc.leaves = {"sv": appended(lv["sv"], sv), "sk": appended(lv["sk"], sk),
                  "mv": appended(lv["mv"], mv), "mk": appended(lv["mk"], mk)}
    for g, (st, _) in trees.items():
        t2r = inc.tree_to_row.get(g)
        if t2r is None:  # (re)built from every row: the survivors', then the new ones'
            t2r = inc.tree_to_row[g] = np.full(st.capacity, -1, np.int64)
            t2r[of_group(told, g)] = of_group(ids[:s], g)
        pick = gnew == g
        t2r[tnew[pick]] = ids[s:][pick]
    return entries


def _same_trees(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> bool:
    """The same tree objects holding the same value lists (RLlib's set_state replaces them)."""
    return all(x is y for x, y in zip(a, b))


def touched_by_group(inc: Incremental, code_of: Any) -> Dict[int, List[int]]:
    """The recorder's tree indices since the last capture, per group (``code_of``: module id -> code)."""
    out: Dict[int, List[int]] = {}
    for mid, idx in inc.touched:
        out.setdefault(0 if mid is None else code_of(mid), []).extend(idx)
    inc.touched.clear()
    return out
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
    _check_maps(buffer._tree_idx_to_sample_idx, inc.cols["tree"],  # spot checks: no int64 copy of every row
                f"{bname}._tree_idx_to_sample_idx")
    return {**tree_scalars(buffer), "records": np.array(inc.precs, np.int64).reshape(len(inc.precs), 3)}
