"""Format /5: a multi-agent buffer (``MultiAgentEpisodeReplayBuffer``, its prioritized subclass)
captured incrementally into format /4's two states, so that a save writes the new agent
timesteps' rows and a few log records, not the buffer's meta whole.

What differs from a single-agent buffer (:mod:`.incremental_capture`):

* rows are agent timesteps (every module's ``_module_to_indices``); a prioritized row's ``prio``
  columns are its leaf in its *module's* trees, whose changes (``update_priorities(..., module_id)``)
  go to the priority records as for a single-agent buffer (:mod:`.incremental_priorities`);
* an episode batch holds, per newly done ``MultiAgentEpisode``, its agents' episodes (the columnar
  table) and its own state (agents, mapping, hanging values, env-to-agent step maps); the meta
  record holds the running ones;
* RLlib's env-step index list ``_indices`` (one entry per env step, not per row) is logged as *env
  records*: each save appends the entries added since the previous one (with, prioritized, their
  env-tree leaves: RLlib sets those when it adds an env step and never updates them); a record
  leaves the log once all its entries' episodes are evicted (RLlib keeps the survivors in order);
* the prioritized buffer's ``_sample_idx_to_tree_idx`` (RLlib writes it and never reads it): its
  key order in the meta record as runs of keys while it has few, else as *key-order records*
  (:mod:`.key_order`: a base, then what each save changed); the meta record also holds the entries
  whose value is not the env step's own tree index (stale keys past the list's end), beside the
  per-module counters and trees' scalars.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....errors import UnsupportedTypeError
from ..base.names import REPLAY, REPLAY_META
from .buffers import _Kind, _attributes, buffer_kind, common_meta, extra_attrs, handled_attrs
from .episode_parts import LAYOUT, _EpisodeParts, _int32, _split_episode, _table
from .incremental_capture import (_Misaligned, _append_dict, _gather, changed_keys, _log_state, _static_of, append_records,
                                  forget_parts, live_spans, merge_cols, surviving, with_retry)
from ..journal.growth import appended, count, evicted_rows, same_rows, survivors
from .incremental_priorities import _hook, _priorities, _priority_record, check_freed, touched_by_group
from .incremental_state import ENV, META_FORMAT5, ORDER, Incremental, _leaf_codes, _raw, pack_ids
from .key_order import key_order_record, s2t_state
from .multi_agent import _ma_episode_state, _ma_rows, module_counters, module_order
from .priorities import MODULE_MAPS, module_scalars, modules_of, tree_scalars
from .row_ids import RowIds
from .segment_trees import _check_maps, _check_neutral
from .values import _type_name

MA_STATIC_KEYS = ("config", "spaces", "extra_attrs")  # the module counters change every save: meta record
ENV_LIST = "_env"  # RowIds' name of the env-step index list (its cache ids are not row ids)
SPOT = 64


def capture_ma_states(buffer: Any, rid: RowIds) -> Dict[str, Any]:
    """The states of a multi-agent buffer (``replay``, ``replay_meta``); advances its caches (``rid``)."""
    kind = buffer_kind(buffer)
    attrs = _attributes(buffer)
    bname = _type_name(buffer)
    meta = common_meta(buffer, attrs, bname, META_FORMAT5)
    meta["module_counters"] = module_counters(attrs)
    meta["extra_attrs"] = extra_attrs(attrs, handled_attrs(kind), bname)
    replay, log = with_retry(lambda: _capture(buffer, rid, kind, bname, dict(meta)), rid, bname)
    return {REPLAY: replay, REPLAY_META: log}


def _capture(buffer: Any, rid: RowIds, kind: _Kind, bname: str, meta: Dict[str, Any]):
    evicted = int(buffer._num_episodes_evicted)
    full = rid.inc is None
    inc, newly_done = _split_changed(buffer, rid, evicted, bname)
    replay, entries = _new_rows(buffer, rid, inc, kind, full, evicted, bname)
    forget_parts(rid, [p.key for _, parts, _ in newly_done for p in parts])
    env = _new_env(buffer, rid, inc, kind, full, evicted, bname)
    order = key_order_record(inc, _s2t_keys(buffer), full) if kind.prioritized else None
    n = len(replay["row_id"])
    ep_raw = _raw(_batch(newly_done, bname)) if newly_done else None
    prio = _priority_record(inc, entries, n) if kind.prioritized else None
    static = _static_of(inc, meta, rid, MA_STATIC_KEYS)
    if inc.refresh or not inc.dicts:  # a dictionary first: this save's records are compressed with it
        provisional = _raw(_packed_meta(buffer, rid, inc, kind, dict(meta), n, bname))
        _append_dict(inc, [ep_raw or b"", prio[0] if prio else b"", provisional])
    append_records(inc, ep_raw, [k for k, _, _ in newly_done], prio, static, evicted)
    if env is not None:
        first, m = inc.append_raw(ENV, env[0])
        inc.env_recs.append([first, m, env[1]])
    if order is not None:
        first, m = inc.append(ORDER, order[0])
        inc.s2t_recs.append([first, m, order[1]])
    inc.env_recs = [r for r in inc.env_recs if r[2] >= evicted]  # all their episodes evicted: they leave
    rid.spaces.prune()
    inc.keep_rows(live_spans(inc))
    rid.inc = inc
    rid.floors = None
    return replay, _log_state(rid, inc, _packed_meta(buffer, rid, inc, kind, meta, n, bname), n, bname,
                              META_FORMAT5)


def _split_changed(buffer: Any, rid: RowIds, evicted: int, bname: str
                   ) -> Tuple[Incremental, List[Tuple[int, List[_EpisodeParts], Dict[str, Any]]]]:
    """Split the episodes that may have changed since the previous capture (all on a full one; else
    the running ones and those added since) into their agents' parts and their own state; forget
    the evicted ones. Returns the cache to advance and the episodes that became done."""
    inc, todo = changed_keys(buffer, rid, evicted, bname)
    episodes = buffer.episodes
    E = len(episodes)
    for k in range(inc.evicted, evicted):  # forget evicted episodes
        for a in inc.ep_agents.pop(k, ()):
            rid.parts.pop((k, a), None)
        inc.logged.discard(k)
        inc.open_keys.discard(k)
        inc.running_ma.pop(k, None)
    newly_done = []
    for key in todo:
        ep = episodes[key - evicted]
        if buffer.episode_id_to_index.get(ep.id_) != key:
            raise UnsupportedTypeError(f"{bname}: episode_id_to_index[{ep.id_!r}] is "
                                       f"{buffer.episode_id_to_index.get(ep.id_)}, expected {key}")
        done = bool(ep.is_done)
        where = f"{bname} episode {key}"
        state = _ma_episode_state(ep, rid, rid.spaces, where)
        parts, codes = [], []
        for aid, sa in ep.agent_episodes.items():
            c = rid.agent_code(aid)
            hit = rid.parts.get((key, c))
            p = hit[1] if hit is not None and hit[0] is sa and hit[1].done and done else \
                _split_episode(sa, (key, c), rid.spaces, f"{where} agent {aid!r}")
            rid.parts[(key, c)] = (sa, p)
            parts.append(p)
            codes.append(c)
        inc.ep_agents[key] = codes
        if done:
            inc.open_keys.discard(key)
            inc.running_ma.pop(key, None)
            if key not in inc.logged:
                newly_done.append((key, parts, state))
        else:
            inc.open_keys.add(key)
            inc.running_ma[key] = state
    inc.max_key = max(inc.max_key, evicted + E - 1)
    return inc, newly_done


def _batch(done: List[Tuple[int, List[_EpisodeParts], Dict[str, Any]]], bname: str) -> Dict[str, Any]:
    """An episode batch: the done episodes' indices, their agents' episodes, their own states."""
    done = sorted(done, key=lambda x: x[0])
    parts = [p for _, ps, _ in done for p in ps]
    return {"keys": np.array([k for k, _, _ in done], np.int64), "agents": pack_ids(_table(parts, bname)),
            "ma": [st for _, _, st in done]}


def _new_rows(buffer: Any, rid: RowIds, inc: Incremental, kind: _Kind, full: bool, evicted: int,
              bname: str) -> Tuple[Dict[str, Any], List[Dict[str, np.ndarray]]]:
    """The live rows (survivors first, then the new ones gathered from their agent episodes) and the
    priority entries of the survivors whose module-tree leaves changed."""
    keys, ids = _ma_rows(buffer, rid, evicted, kind)
    sel, s = surviving(inc, full, evicted)
    if not full and (len(ids) < s or not same_rows(ids[:s], inc.ids[sel])):
        raise _Misaligned("its module index lists changed other than by appends and evictions")
    nk = keys[s:]
    new = _gather(nk[:, 0], nk[:, 1], nk[:, 2], rid.parts, inc, bname)
    new["episode"] = nk[:, 0].copy()
    new["agent"] = _int32(nk[:, 1], "agent")
    new["t"] = _int32(nk[:, 2], "t")
    new["module"] = _int32(nk[:, 3], "module")
    entries: List[Dict[str, np.ndarray]] = []
    if kind.prioritized:
        new["tree"] = _int32(nk[:, 4], "tree")
        hooked = _hook(buffer, inc, multi_agent=True)
        trees = {rid.module_code(m): (st, buffer._module_to_min_segment[m])
                 for m, st in buffer._module_to_sum_segment.items() if m in buffer._module_to_min_segment}
        entries = _priorities(trees, inc, sel, new, ids, s, full, hooked, touched_by_group(inc, rid.module_code),
                              bname)
    merge_cols(inc, new, sel, full)
    inc.ids, inc.evicted = ids, evicted
    return {"row_id": ids, **inc.cols, "layout": LAYOUT}, entries


def _new_env(buffer: Any, rid: RowIds, inc: Incremental, kind: _Kind, full: bool, evicted: int,
             bname: str) -> Optional[Tuple[bytes, int]]:
    """The env-step entries added since the previous capture as an env record's bytes, with the
    highest episode index among them (None: none added)."""
    width = 3 if kind.prioritized else 2
    if full or inc.env_keys is None:
        rid.lists.pop(ENV_LIST, None)
        inc.env_keys = np.empty((0, width), np.int64)
    keys, ids, known = rid.update(ENV_LIST, buffer._indices, width, tuple, evicted)
    sel = survivors(inc.env_keys[:, 0] >= evicted)
    s = count(sel)
    if known is None:  # one id per key, -1 for a new one: the survivors' must come first
        if int(np.count_nonzero(ids >= 0)) != s or not np.all(ids[:s] >= 0):
            raise _Misaligned("its env-step index list changed other than by appends and evictions")
        ids = ids[:s]
    elif known != s:
        raise _Misaligned("its env-step index list changed other than by appends and evictions")
    ids = appended(ids, np.arange(inc.next_env, inc.next_env + len(keys) - s, dtype=np.int64))
    inc.next_env += len(keys) - s
    rid.commit(ENV_LIST, keys, ids)
    new = keys[s:]
    rec: Dict[str, Any] = {"e": new[:, 0].copy(), "t": new[:, 1].copy()}
    if kind.prioritized:
        rec.update(_env_leaves(buffer, inc, keys, sel, s, full, bname))
    inc.env_keys = keys
    if not len(new):
        return None
    return _raw(rec), int(new[:, 0].max())


def _env_leaves(buffer: Any, inc: Incremental, keys: np.ndarray, sel: Any, s: int, full: bool,
                bname: str) -> Dict[str, np.ndarray]:
    """The new env steps' tree indices and env-tree leaves; the survivors' leaves spot-checked (RLlib
    never changes them: a change makes this save a full one)."""
    st, mt = buffer._sum_segment, buffer._min_segment
    tnew = keys[s:, 2]
    if full:
        _check_neutral(st, keys[:, 2], f"{bname}._sum_segment")
        _check_neutral(mt, keys[:, 2], f"{bname}._min_segment")
        old = {k: np.empty(0, np.float64 if k[1] == "v" else np.int8) for k in ("sv", "sk", "mv", "mk")}
    else:
        check_freed((st, mt), np.setdiff1d(inc.env_keys[evicted_rows(sel), 2], tnew), f"{bname} env-step trees")
        old = {k: v[sel] for k, v in inc.env_leaves.items()}
        if s:
            spot = np.unique(np.linspace(0, s - 1, min(s, SPOT)).astype(np.int64))
            v, k = _leaf_codes(st, keys[spot, 2], "_sum_segment")
            if np.any(v != old["sv"][spot]) or np.any(k != old["sk"][spot]):
                raise _Misaligned("an env step's priority changed")
    sv, sk = _leaf_codes(st, tnew, "_sum_segment")
    mv, mk = _leaf_codes(mt, tnew, "_min_segment")
    inc.env_leaves = {k: appended(old[k], v) for k, v in (("sv", sv), ("sk", sk), ("mv", mv), ("mk", mk))}
    rec = {"tree": tnew.copy(), "sv": sv, "sk": sk}
    if not (np.array_equal(sv, mv, equal_nan=True) and np.array_equal(sk, mk)):
        rec["mv"], rec["mk"] = mv, mk
    return rec


def _packed_meta(buffer: Any, rid: RowIds, inc: Incremental, kind: _Kind, meta: Dict[str, Any], n: int,
                 bname: str) -> Dict[str, Any]:
    """The meta record's state: counters, generator, metrics, module counters, the running
    episodes, the live records, the trees' scalars."""
    running = sorted(inc.open_keys)
    parts = [rid.parts[(k, c)][1] for k in running for c in inc.ep_agents[k]]
    meta["rows"] = {"next_row_id": int(rid.next_id), "n_rows": int(n), "agent_ids": list(rid.agents),
                    "module_ids": list(rid.modules), "module_order": module_order(buffer, rid),
                    "n_env": int(len(inc.env_keys))}
    meta["static"] = list(inc.static)
    meta["dicts"] = np.array(inc.dicts, np.int64).reshape(len(inc.dicts), 2)
    meta["running"] = _table(parts, bname)
    meta["running_ma"] = {"keys": np.array(running, np.int64), "states": [inc.running_ma[k] for k in running]}
    meta["episode_log"] = {"batches": np.array(inc.batches, np.int64).reshape(len(inc.batches), 4),
                           "next_batch": inc.next_batch}
    meta["env_log"] = np.array(inc.env_recs, np.int64).reshape(len(inc.env_recs), 3)
    if kind.prioritized:
        meta["priority"] = _priority_scalars(buffer, rid, inc, bname)
    return {k: v for k, v in meta.items() if k not in ("format", "buffer_type")}


def _priority_scalars(buffer: Any, rid: RowIds, inc: Incremental, bname: str) -> Dict[str, Any]:
    env_t = inc.env_keys[:, 2]
    _check_maps(buffer._tree_idx_to_sample_idx, env_t, f"{bname}._tree_idx_to_sample_idx")
    out = tree_scalars(buffer)
    out["records"] = np.array(inc.precs, np.int64).reshape(len(inc.precs), 3)
    out["s2t"] = s2t_state(inc, buffer._sample_idx_to_tree_idx, env_t)
    out["module_key_order"] = {k: [rid.module_code(m) for m in getattr(buffer, k)] for k in MODULE_MAPS}
    codes, trees = inc.cols.get("module", np.empty(0, np.int32)), inc.cols.get("tree", np.empty(0, np.int32))
    modules = []
    for mid in modules_of(buffer):
        mc = rid.module_code(mid)
        m = {"module": mc, "has_sum": mid in buffer._module_to_sum_segment,
             "has_min": mid in buffer._module_to_min_segment}
        m.update(module_scalars(buffer, mid, trees[codes == mc], bname))
        modules.append(m)
    out["modules"] = modules
    return out


def _s2t_keys(buffer: Any) -> np.ndarray:
    s2t = buffer._sample_idx_to_tree_idx
    return np.fromiter(s2t.keys(), np.int64, len(s2t))
