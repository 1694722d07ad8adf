"""Format /3 or /4 back to the two-state form: the two states of a single-agent buffer (the rows and the
``replay_meta`` log) turned into the ``(replay, replay_meta)`` that :func:`.two_state.restore_replay`
takes, and the caches seeded after the restore so the next save goes on appending to the same log.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....errors import RestoreError
from ..base.conversion import from_storable
from ..base.names import REPLAY, REPLAY_META
from .buffers import META_FORMAT
from .episode_parts import _EpisodeParts, _parts_from_table, _table
from .incremental_priorities import _hook, unpack_entries
from .incremental_state import (DICT, EPISODES, KINDS, LOG_FORMATS, LOG_LAYOUT, META, META_FORMAT2, META_FORMAT3,
                                PRIORITIES, STATIC, Incremental, _raw, unpack_ids)
from .records import _decode, _decode_raw, dict_id
from .row_ids import RowIds
from .values import _Spaces


def read_log(log: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, np.ndarray], Dict[int, bytes]]:
    """(the meta record's state, the log's rows before it, the live dictionaries by id) of a
    ``replay_meta`` log, checked."""
    fmt = log.get("format") if isinstance(log, dict) else None
    if fmt == META_FORMAT2:
        raise RestoreError(f"replay_meta has format {META_FORMAT2!r} (four replay states, written by an earlier "
                           f"ray_ckpt): this version reads {' and '.join(map(repr, LOG_FORMATS))} only")
    if fmt not in LOG_FORMATS or log.get("layout") != LOG_LAYOUT:
        raise RestoreError(f"replay_meta has format {fmt!r}, expected one of {LOG_FORMATS!r}")
    ids = np.asarray(log["row_id"], np.int64)
    blob = np.asarray(log["blob"], np.uint8)
    at = int(np.searchsorted(ids, int(log["meta_at"])))
    if at >= len(ids) or ids[at] != int(log["meta_at"]) or int(ids[-1] - ids[at]) != len(ids) - 1 - at:
        raise RestoreError(f"replay_meta: the meta record at row {log['meta_at']} is not the log's last rows")
    rows = {"row_id": ids[:at], "blob": blob[:at]}
    dicts: Dict[int, bytes] = {}
    if fmt != META_FORMAT3:  # the meta record is compressed with the newest dictionary, named in the open
        _dictionary(rows, int(log["dict_at"]), int(log["dict_rows"]), dicts)
    meta = _decode(blob[at:], META, "replay_meta meta record", dicts)
    for first, m in np.asarray(meta.get("dicts", np.empty((0, 2))), np.int64).reshape(-1, 2).tolist():
        _dictionary(rows, first, m, dicts)
    meta["format"], meta["buffer_type"] = fmt, str(log["buffer_type"])
    return meta, rows, dicts


def _dictionary(rows: Dict[str, np.ndarray], first: int, m: int, dicts: Dict[int, bytes]) -> bytes:
    raw = _record(rows, first, m, DICT, f"replay_meta dictionary record at {first}", raw=True)
    dicts[dict_id(raw)] = raw
    return raw


def _record(rows: Dict[str, np.ndarray], first: int, m: int, kind: int, where: str,
            dicts: Optional[Dict[int, bytes]] = None, raw: bool = False) -> Any:
    ids = rows["row_id"]
    a = int(np.searchsorted(ids, first))
    if a + m > len(ids) or ids[a] != first or ids[a + m - 1] != first + m - 1:
        raise RestoreError(f"{where}: rows {first}..{first + m - 1} are not all in the log")
    return (_decode_raw if raw else _decode)(rows["blob"][a:a + m], kind, where, dicts)


def open_log(states: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, np.ndarray],
                                                Dict[int, bytes], Dict[str, Any]]:
    """(the log, its meta record with the static record's content merged in, the log's rows, the
    live dictionaries, where the static record is and its bytes) of the two states."""
    log = from_storable(states[REPLAY_META])
    meta, rows, dicts = read_log(log)
    static_at = [int(x) for x in meta.pop("static")]
    static = _record(rows, *static_at, STATIC, "replay_meta static record", dicts)
    static_raw = _raw(static)  # what the next capture compares its own with (equal: no new record)
    meta["rows"]["templates"] = static.pop("templates")
    meta.update(static)
    return log, meta, rows, dicts, {"static": (static_at, static_raw)}


def row_leaves(meta: Dict[str, Any], rows: Dict[str, np.ndarray], dicts: Dict[int, bytes],
               replay: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Each row's final sum/min leaves: its ``prio`` and the live priority records' entries."""
    recs = np.asarray(meta["priority"]["records"], np.int64).reshape(-1, 3)
    entries = [unpack_entries(_record(rows, first, m, PRIORITIES, f"replay_meta priority record at {first}", dicts))
               for first, m, _ in recs.tolist()]
    return final_leaves(replay, entries)


def sum_min(sv: np.ndarray, sk: np.ndarray, mv: np.ndarray, mk: np.ndarray) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Sum and min leaves in format /1's form (the min ones as a marker where they are the sum's)."""
    same = np.array_equal(sv, mv, equal_nan=True) and np.array_equal(sk, mk)
    return _pack(sv, sk), ({"same_as_sum": True} if same else _pack(mv, mk))


def states_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """``(replay, replay_meta)`` in the two-state form (what :func:`.two_state.restore_replay` takes) from
    the two states of a single-agent buffer, and (``seed``) what :func:`seed` needs to continue the log."""
    replay = dict(states[REPLAY])
    log, meta, rows, dicts, seeds = open_log(states)
    bname = meta["buffer_type"]
    templates = meta["rows"]["templates"]
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    batches = np.asarray(meta["episode_log"]["batches"], np.int64).reshape(-1, 4)
    parts: List[_EpisodeParts] = []
    for b, _, first, m in batches.tolist():
        table = unpack_ids(_record(rows, first, m, EPISODES, f"replay_meta episode batch {b}", dicts))
        parts += [p for p in _parts_from_table(table, templates, True) if p.key[0] >= evicted]
    running = _parts_from_table(meta["running"], templates, False)
    logged = {p.key[0] for p in parts}
    parts = sorted(parts + running, key=lambda p: p.key)
    v1 = {k: v for k, v in meta.items() if k not in ("running", "episode_log")}
    v1["format"] = META_FORMAT
    v1["episodes"] = _table(parts, bname)
    stored_replay = replay
    replay = {k: v for k, v in replay.items() if k not in ("prio", "prio_k")}
    leaves = None
    if "priority" in meta:
        leaves = row_leaves(meta, rows, dicts, stored_replay)
        pr = dict(meta["priority"])
        pr.pop("records", None)
        pr["sum"], pr["min"] = sum_min(leaves["sv"], leaves["sk"], leaves["mv"], leaves["mk"])
        v1["priority"] = pr
    if not seed:
        return replay, v1, None
    return replay, v1, seed_state(seeds, log, rows, meta, stored_replay, leaves, logged, {p.key[0] for p in running})


def seed_state(seeds: Dict[str, Any], log: Dict[str, Any], rows: Dict[str, np.ndarray], meta: Dict[str, Any],
               replay: Dict[str, Any], leaves: Optional[Dict[str, np.ndarray]], logged: Any, running: Any
               ) -> Dict[str, Any]:
    """What :func:`seed` takes (``seeds``: :func:`open_log`'s, updated)."""
    seeds.update({"replay": replay, "meta": meta, "log": rows, "leaves": leaves,
                  "next_chunk": int(log["next_chunk"]), "logged": set(logged), "running": set(running),
                  "dicts": np.asarray(meta.get("dicts", np.empty((0, 2))), np.int64).reshape(-1, 2).tolist(),
                  "zdict": _newest_dict(log, rows), "refresh": bool(log.get("refresh", False)),
                  "dict_base": int(log.get("dict_base", 0))})
    return seeds


def _newest_dict(log: Dict[str, Any], rows: Dict[str, np.ndarray]) -> bytes:
    """The dictionary the log's newest records are compressed with (none in format /3)."""
    if "dict_at" not in log:
        return b""
    return _record(rows, int(log["dict_at"]), int(log["dict_rows"]), DICT, "replay_meta dictionary record", raw=True)


def final_leaves(replay: Dict[str, Any], entries: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Each row's sum/min leaves: its ``prio``, then the priority records' entries for it in order."""
    ids = np.asarray(replay["row_id"], np.int64)
    sv = np.asarray(replay["prio"], np.float64).copy()
    sk = np.asarray(replay["prio_k"], np.int8).copy()
    mv, mk = sv.copy(), sk.copy()
    if not entries:
        return {"sv": sv, "sk": sk, "mv": mv, "mk": mk}
    rows = np.concatenate([e["row"] for e in entries])
    which = np.concatenate([e["which"] for e in entries])
    v, k = np.concatenate([e["v"] for e in entries]), np.concatenate([e["k"] for e in entries])
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


def seed(rid: RowIds, s: Dict[str, Any], buffer: Any) -> Incremental:
    """After a restore: the caches as if this buffer had made the restored version's capture."""
    replay, meta = s["replay"], s["meta"]
    ids = np.asarray(replay["row_id"], np.int64).copy()
    cols = {c: np.array(v) for c, v in replay.items() if isinstance(v, np.ndarray) and c != "row_id"}
    sig = {c: (v.dtype, v.shape[1:]) for c, v in cols.items()
           if c not in ("episode", "t", "tree", "prio", "prio_k", "agent", "module")}
    inc = Incremental(ids, cols, sig, dict(meta["rows"]["templates"]))
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    inc.evicted = evicted
    inc.open_keys = set(s["running"])
    inc.logged = set(s["logged"])
    inc.max_key = max([evicted - 1] + list(inc.open_keys) + list(inc.logged) +
                      ([int(cols["episode"].max())] if len(ids) else []))
    el = meta["episode_log"]
    inc.log = {k: np.array(v) for k, v in s["log"].items()}
    inc.batches = [list(map(int, x)) for x in np.asarray(el["batches"], np.int64).reshape(-1, 4).tolist()]
    inc.next_chunk, inc.next_batch = int(s["next_chunk"]), int(el["next_batch"])
    inc.static, inc.static_raw = list(s["static"][0]), s["static"][1]
    inc.dicts = [list(map(int, d)) for d in s["dicts"]]
    inc.zdict, inc.refresh, inc.dict_base = s["zdict"], s["refresh"], s["dict_base"]
    if s["leaves"] is not None:
        inc.precs = [list(map(int, x)) for x in np.asarray(meta["priority"]["records"], np.int64).reshape(-1, 3)]
        inc.leaves = {k: np.array(v) for k, v in s["leaves"].items()}
        # the restored trees (per module, multi-agent), and the recorder of their changes
        multi_agent = "module" in cols
        if multi_agent:
            trees = {rid.module_code(m): (st, buffer._module_to_min_segment[m])
                     for m, st in buffer._module_to_sum_segment.items() if m in buffer._module_to_min_segment}
        else:
            trees = {0: (buffer._sum_segment, buffer._min_segment)}
        groups = cols["module"].astype(np.int64) if multi_agent else np.zeros(len(ids), np.int64)
        for g, (st, mt) in trees.items():
            sel = groups == g
            inc.tree_to_row[g] = np.full(st.capacity, -1, np.int64)
            inc.tree_to_row[g][cols["tree"][sel].astype(np.int64)] = ids[sel]
            inc.trees[g] = (st, mt, st.value, mt.value)
        _hook(buffer, inc, multi_agent)
    rid.spaces = _Spaces(meta["spaces"])
    rid.inc = inc
    return inc
