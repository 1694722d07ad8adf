"""Format /2 back to the two-state form: the four states of a single-agent buffer turned into the
``(replay, replay_meta)`` that :func:`.two_state.restore_replay` takes, and the caches seeded after
the restore so the next save goes on appending to the same logs.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from ....errors import RestoreError
from ..conversion import from_storable
from ..names import REPLAY, REPLAY_META
from .buffers import META_FORMAT
from .episode_parts import _EpisodeParts, _parts_from_table, _table
from .incremental_priorities import _hook
from .incremental_state import (EPISODE_LOG, KINDS, META_FORMAT2, PRIORITY_LOG, REPLAY_EPISODES, REPLAY_PRIORITIES,
                                Incremental, _decode, _empty_plog)
from .row_ids import RowIds
from .values import _Spaces


def states_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """``(replay, replay_meta)`` in the two-state form (what :func:`.two_state.restore_replay` takes) from
    the four states, and (``seed``) what :func:`seed` needs to continue the logs."""
    replay, meta = dict(states[REPLAY]), from_storable(states[REPLAY_META])
    if meta.get("format") != META_FORMAT2:
        raise RestoreError(f"replay_meta has format {meta.get('format')!r}, expected {META_FORMAT2!r}")
    meta.update(_decode(np.asarray(meta.pop("packed"), np.uint8), "replay_meta.packed"))
    bname = meta["buffer_type"]
    templates = meta["rows"]["templates"]
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    ep = states.get(REPLAY_EPISODES)
    if ep is None or ep.get("layout") != EPISODE_LOG:
        raise RestoreError(f"the version's {REPLAY_EPISODES} state is missing or not an episode log")
    batch = np.asarray(ep["batch"], np.int64)
    blob = np.asarray(ep["blob"])
    want = [int(b) for b, _ in np.asarray(meta["episode_log"]["batches"], np.int64).reshape(-1, 2).tolist()]
    if sorted(set(batch.tolist())) != sorted(want):
        raise RestoreError(f"{REPLAY_EPISODES}: batches {sorted(set(batch.tolist()))[:5]} stored, "
                           f"replay_meta lists {want[:5]}")
    parts: List[_EpisodeParts] = []
    starts = np.flatnonzero(np.diff(batch, prepend=-1) != 0)
    ends = np.append(starts[1:], len(batch))
    for a, b in zip(starts.tolist(), ends.tolist()):
        table = _decode(blob[a:b], f"{REPLAY_EPISODES} batch {int(batch[a])}")
        parts += [p for p in _parts_from_table(table, templates, True) if p.key[0] >= evicted]
    running = _parts_from_table(meta["running"], templates, False)
    logged = {p.key[0] for p in parts}
    parts = sorted(parts + running, key=lambda p: p.key)
    v1 = {k: v for k, v in meta.items() if k not in ("running", "episode_log")}
    v1["format"] = META_FORMAT
    v1["episodes"] = _table(parts, bname)
    stored_replay = replay
    replay = {k: v for k, v in replay.items() if k not in ("prio", "prio_k")}
    if "priority" in meta:
        pl = states.get(REPLAY_PRIORITIES)
        if pl is None or pl.get("layout") != PRIORITY_LOG:
            raise RestoreError(f"the version's {REPLAY_PRIORITIES} state is missing or not a priority log")
        leaves = final_leaves(stored_replay, pl)
        pr = dict(meta["priority"])
        pr.pop("next_log", None)
        pr["sum"] = _pack(leaves["sv"], leaves["sk"])
        mn = _pack(leaves["mv"], leaves["mk"])
        pr["min"] = {"same_as_sum": True} if (np.array_equal(leaves["sv"], leaves["mv"], equal_nan=True)
                                              and np.array_equal(leaves["sk"], leaves["mk"])) else mn
        v1["priority"] = pr
    else:
        leaves, pl = None, None
    if not seed:
        return replay, v1, None
    return replay, v1, {"replay": stored_replay, "meta": meta, "episodes": ep, "plog": pl, "leaves": leaves,
                        "logged": logged, "running": {p.key[0] for p in running}}


def final_leaves(replay: Dict[str, Any], pl: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Each row's sum/min leaves: its ``prio``, then the log's entries for it in order."""
    ids = np.asarray(replay["row_id"], np.int64)
    sv = np.asarray(replay["prio"], np.float64).copy()
    sk = np.asarray(replay["prio_k"], np.int8).copy()
    mv, mk = sv.copy(), sk.copy()
    rows = np.asarray(pl["row"], np.int64)
    which = np.asarray(pl["which"], np.int8)
    v, k = np.asarray(pl["v"], np.float64), np.asarray(pl["k"], np.int8)
    pos = np.searchsorted(ids, rows)
    ok = pos < len(ids)
    ok[ok] = ids[pos[ok]] == rows[ok]
    for tv, tk, sel in ((sv, sk, ok & (which != 2)), (mv, mk, ok & (which != 1))):
        idx = np.flatnonzero(sel)
        if not len(idx):
            continue
        p = pos[idx]
        _, last_rev = np.unique(p[::-1], return_index=True)  # the last entry per row wins
        last = idx[len(idx) - 1 - last_rev]
        tv[pos[last]] = v[last]
        tk[pos[last]] = k[last]
    return {"sv": sv, "sk": sk, "mv": mv, "mk": mk}


def _pack(v: np.ndarray, k: np.ndarray) -> Dict[str, Any]:
    """Leaves in :func:`.values.pack_scalars`'s form (only the kinds used, so the fast rebuild applies)."""
    used = sorted(set(np.unique(k).tolist()))
    kinds = [KINDS[c] for c in used]
    out: Dict[str, Any] = {"v": v, "kinds": kinds}
    if len(used) > 1:
        remap = np.zeros(len(KINDS), np.int8)
        remap[used] = np.arange(len(used))
        out["k"] = remap[k]
    return out


def seed(rid: RowIds, s: Dict[str, Any], buffer: Any) -> None:
    """After a restore: the caches as if this buffer had made the restored version's capture."""
    replay, meta = s["replay"], s["meta"]
    ids = np.asarray(replay["row_id"], np.int64).copy()
    cols = {c: np.array(v) for c, v in replay.items() if isinstance(v, np.ndarray) and c != "row_id"}
    sig = {c: (v.dtype, v.shape[1:]) for c, v in cols.items()
           if c not in ("episode", "t", "tree", "prio", "prio_k")}
    inc = Incremental(ids, cols, sig, dict(meta["rows"]["templates"]))
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    inc.evicted = evicted
    inc.open_keys = set(s["running"])
    inc.logged = set(s["logged"])
    inc.max_key = max([evicted - 1] + list(inc.open_keys) + list(inc.logged) +
                      ([int(cols["episode"].max())] if len(ids) else []))
    el = meta["episode_log"]
    inc.ep_log = {k: np.array(s["episodes"][k]) for k in ("row_id", "batch", "blob")}
    inc.batches = [list(map(int, x)) for x in np.asarray(el["batches"], np.int64).reshape(-1, 2).tolist()]
    inc.next_chunk, inc.next_batch = int(el["next_chunk"]), int(el["next_batch"])
    if s["plog"] is not None:
        inc.plog = {k: np.array(s["plog"][k]) for k in ("row_id", "row", "which", "v", "k")}
        inc.next_log = int(meta["priority"]["next_log"])
        inc.leaves = {k: np.array(v) for k, v in s["leaves"].items()}
    else:
        inc.plog = _empty_plog()
    if s["plog"] is not None:  # the restored trees, and the recorder of their changes
        st, mt = buffer._sum_segment, buffer._min_segment
        inc.tree_to_row = np.full(st.capacity, -1, np.int64)
        inc.tree_to_row[cols["tree"].astype(np.int64)] = ids
        inc.trees = (st, mt, st.value, mt.value)
        _hook(buffer, inc)
    rid.spaces = _Spaces(meta["spaces"])
    rid.inc = inc
