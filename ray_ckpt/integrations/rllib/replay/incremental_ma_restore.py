"""Format /5 back to the two-state form: a multi-agent buffer's rows and ``replay_meta`` log turned
into the ``(replay, replay_meta)`` that :func:`.two_state.restore_replay` takes (the episodes from
the live episode batches and the meta record's running ones, RLlib's env-step index list from the
live env records, the module trees' leaves per row), and the caches seeded after the restore so
the next save goes on appending to the same log. :func:`log_to_v1` reads either log format.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

from ....errors import RestoreError
from ..base.conversion import from_storable
from ..base.names import REPLAY, REPLAY_META
from .buffers import META_FORMAT
from .episode_parts import _EpisodeParts, _parts_from_table, _table
from .incremental_multi_agent import ENV_LIST
from .incremental_restore import _record, open_log, row_leaves, seed, seed_state, states_to_v1, sum_min
from .incremental_state import ENV, EPISODES, META_FORMAT5, ORDER, unpack_ids
from .key_order import keys_from_records, keys_of, s2t_pairs
from .row_ids import RowIds, _IndexList

_LOG_ONLY = ("running", "running_ma", "episode_log", "env_log", "static", "dicts")


def log_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """:func:`ma_states_to_v1` for a multi-agent log (format /5), else
    :func:`.incremental_restore.states_to_v1`."""
    meta = states[REPLAY_META]
    if isinstance(meta, dict) and from_storable(meta).get("format") == META_FORMAT5:
        return ma_states_to_v1(states, seed=seed)
    return states_to_v1(states, seed=seed)


def seed_log(rid: RowIds, s: Dict[str, Any], buffer: Any) -> None:
    """After a restore of either log format: the caches as if this buffer had made the capture."""
    inc = seed(rid, s, buffer)
    if "env_keys" not in s:
        return
    inc.env_keys = s["env_keys"]
    inc.env_leaves = s["env_leaves"]
    inc.env_recs = [list(map(int, r)) for r in np.asarray(s["meta"]["env_log"], np.int64).reshape(-1, 3).tolist()]
    inc.next_env = len(inc.env_keys)
    inc.running_ma = dict(s["running_ma"])
    inc.s2t_keys, inc.s2t_recs = s["s2t_keys"], [list(r) for r in s["s2t_recs"]]
    for e, a in s["agent_keys"]:
        inc.ep_agents.setdefault(e, []).append(a)
    lst = rid.lists[ENV_LIST] = _IndexList(inc.env_keys.shape[1])
    lst.keys, lst.ids = inc.env_keys.copy(), np.arange(len(inc.env_keys), dtype=np.int64)


def ma_states_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """``(replay, replay_meta)`` in the two-state form from a multi-agent buffer's two states, and
    (``seed``) what :func:`seed_log` needs to continue the log."""
    replay = dict(states[REPLAY])
    log, meta, rows, dicts, seeds = open_log(states)
    bname = meta["buffer_type"]
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    parts, own, logged = _episodes(meta, rows, dicts, evicted)
    running = _parts_from_table(meta["running"], meta["rows"]["templates"], False)
    running_keys = np.asarray(meta["running_ma"]["keys"], np.int64).tolist()
    own.update(zip(running_keys, meta["running_ma"]["states"]))
    if sorted(own) != list(range(evicted, evicted + len(own))):
        raise RestoreError(f"replay_meta: the log holds episodes {sorted(own)[:3]}...{sorted(own)[-3:]}, not every "
                           f"episode from {evicted} on")
    parts = sorted(parts + running, key=lambda p: p.key)
    prioritized = "priority" in meta
    env = _env_entries(meta, rows, dicts, evicted, prioritized)
    v1 = {k: v for k, v in meta.items() if k not in _LOG_ONLY}
    v1["format"] = META_FORMAT
    v1["episodes"] = _table(parts, bname)
    v1["ma_episodes"] = [own[k] for k in sorted(own)]
    keys = [env["e"], env["t"]] + ([env["tree"]] if prioritized else [])
    v1["rows"] = dict(meta["rows"], env_indices=np.stack(keys, 1).reshape(len(env["e"]), len(keys)))
    stored_replay = replay
    replay = {k: v for k, v in replay.items() if k not in ("prio", "prio_k")}
    leaves, s2t_keys, s2t_recs = None, None, []
    if prioritized:
        leaves = row_leaves(meta, rows, dicts, stored_replay)
        s2t_keys, s2t_recs = _s2t_keys(meta["priority"]["s2t"], rows, dicts)
        v1["priority"] = _priority_v1(meta["priority"], np.asarray(replay["module"]), leaves, env, s2t_keys)
    if not seed:
        return replay, v1, None
    seeds = seed_state(seeds, log, rows, meta, stored_replay, leaves, logged, running_keys)
    seeds.update({"env_keys": v1["rows"]["env_indices"].copy(),
                  "env_leaves": {k: env[k] for k in ("sv", "sk", "mv", "mk")} if prioritized else {},
                  "running_ma": {k: own[k] for k in running_keys}, "agent_keys": [p.key for p in parts],
                  "s2t_keys": s2t_keys, "s2t_recs": s2t_recs})
    return replay, v1, seeds


def _episodes(meta: Dict[str, Any], rows: Dict[str, np.ndarray], dicts: Dict[int, bytes], evicted: int
              ) -> Tuple[List[_EpisodeParts], Dict[int, Any], set]:
    """The live episode batches' agent episodes (as parts), the episodes' own states by index, and
    the indices the batches hold."""
    parts: List[_EpisodeParts] = []
    own: Dict[int, Any] = {}
    batches = np.asarray(meta["episode_log"]["batches"], np.int64).reshape(-1, 4)
    for b, _, first, m in batches.tolist():
        rec = _record(rows, first, m, EPISODES, f"replay_meta episode batch {b}", dicts)
        parts += [p for p in _parts_from_table(unpack_ids(rec["agents"]), meta["rows"]["templates"], True)
                  if p.key[0] >= evicted]
        own.update((k, st) for k, st in zip(np.asarray(rec["keys"], np.int64).tolist(), rec["ma"]) if k >= evicted)
    return parts, own, set(own)


def _env_entries(meta: Dict[str, Any], rows: Dict[str, np.ndarray], dicts: Dict[int, bytes], evicted: int,
                 prioritized: bool) -> Dict[str, np.ndarray]:
    """The live env-step entries (columns ``e``, ``t``; prioritized: ``tree`` and the env-tree
    leaves ``sv``, ``sk``, ``mv``, ``mk``), in RLlib's order."""
    names = ("e", "t", "tree", "sv", "sk", "mv", "mk") if prioritized else ("e", "t")
    got: Dict[str, List[np.ndarray]] = {k: [] for k in names}
    for first, m, _ in np.asarray(meta["env_log"], np.int64).reshape(-1, 3).tolist():
        rec = _record(rows, first, m, ENV, f"replay_meta env record at {first}", dicts)
        for k in names:
            alt = {"mv": "sv", "mk": "sk"}.get(k, k)
            got[k].append(np.asarray(rec[k] if k in rec else rec[alt]))
    dt = {"sv": np.float64, "mv": np.float64, "sk": np.int8, "mk": np.int8}
    out = {k: np.concatenate(v).astype(dt.get(k, np.int64)) if v else np.empty(0, dt.get(k, np.int64))
           for k, v in got.items()}
    live = out["e"] >= evicted
    out = {k: v[live] for k, v in out.items()}
    if len(out["e"]) != int(meta["rows"]["n_env"]):
        raise RestoreError(f"replay_meta: the live env records hold {len(out['e'])} env steps, the meta record "
                           f"says {meta['rows']['n_env']}")
    return out


def _s2t_keys(st: Dict[str, Any], rows: Dict[str, np.ndarray], dicts: Dict[int, bytes]
              ) -> Tuple[np.ndarray, List[List[int]]]:
    """``_sample_idx_to_tree_idx``'s keys in order, and the live key-order records they come from
    (none where the meta record holds the order itself, as runs)."""
    if "runs" in st:
        return keys_of(st["runs"]), []
    recs = np.asarray(st["records"], np.int64).reshape(-1, 3).tolist()
    chain = [_record(rows, first, m, ORDER, f"replay_meta key-order record at {first}", dicts)
             for first, m, _ in recs]
    keys = keys_from_records(chain, "replay_meta")
    if len(keys) != int(st["n"]):
        raise RestoreError(f"replay_meta: the key-order records hold {len(keys)} keys of "
                           f"_sample_idx_to_tree_idx, the meta record says {st['n']}")
    return keys, recs


def _priority_v1(pr: Dict[str, Any], codes: np.ndarray, leaves: Dict[str, np.ndarray],
                 env: Dict[str, np.ndarray], s2t_keys: np.ndarray) -> Dict[str, Any]:
    """Format /1's priority part: the env trees' leaves per env step, each module's per row."""
    out = {k: v for k, v in pr.items() if k not in ("records", "s2t", "modules")}
    out["sample_idx_to_tree_idx"] = s2t_pairs(s2t_keys, pr["s2t"], env["tree"])
    out["sum"], out["min"] = sum_min(env["sv"], env["sk"], env["mv"], env["mk"])
    modules = []
    for m in pr["modules"]:
        m = dict(m)
        rows = codes == int(m["module"])
        has_sum, has_min = m.pop("has_sum"), m.pop("has_min")
        s, mn = sum_min(*(leaves[k][rows] for k in ("sv", "sk", "mv", "mk")))
        if has_sum:
            m["sum"] = s
        if has_min:
            m["min"] = mn if has_sum else _unmarked(mn, s)
        m["rows"] = int(np.count_nonzero(rows))
        modules.append(m)
    out["modules"] = modules
    return out


def _unmarked(mn: Dict[str, Any], s: Dict[str, Any]) -> Dict[str, Any]:
    """Min leaves as they are (a module without a sum tree has no sum leaves to refer to)."""
    return s if mn.get("same_as_sum") else mn
