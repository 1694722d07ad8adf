"""A ``replay_journal`` state -> a buffer, through RLlib's own API (the package docstring says how),
and the journal seeded so the next save writes only what arrives after the restore. Everything is
read and checked before the buffer is touched: a state that does not fit raises RestoreError and
leaves the buffer as it was.
"""
from __future__ import annotations

import base64
import collections
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ....capture.gc_pause import collections_paused
from ....errors import RestoreError
from ..base import _rllib_internals as internals
from ..base.conversion import from_storable
from .episodes import rebuild_episodes
from .journal import (ADD, FORMAT, PRIO, STATE, Family, Journal, Record, base_state, family_of,
                      full_state, install, record_of)
from .records import ROW_BYTES, bytes_state, decode, rows_of
from .trees import free_nodes_from, rebuild_tree
from .values import Spaces, pack_scalars, type_name, unpack_one, unpack_scalars


def read_meta(state: Dict[str, Any]) -> Dict[str, Any]:
    if state.get("format") != FORMAT:
        raise RestoreError(f"replay journal: format {state.get('format')!r}, expected {FORMAT!r}")
    try:
        return bytes_state(zlib.decompress(base64.b64decode(state["meta"], validate=True)), "replay_journal meta")
    except RestoreError:
        raise
    except Exception as exc:
        raise RestoreError(f"replay journal: its meta cannot be read ({type(exc).__name__}: {exc})") from None


def read_records(ids: np.ndarray, blob: np.ndarray) -> List[Tuple[Record, Dict[str, Any]]]:
    """The live records of the rows, in row order (RestoreError naming the first that is not whole)."""
    ids = np.asarray(ids, np.int64)
    blob = np.asarray(blob, np.uint8).reshape(-1, ROW_BYTES)
    out, i = [], 0
    while i < len(ids):
        n = rows_of(blob[i])
        where = f"replay journal record at row {int(ids[i])}"
        if i + n > len(ids) or int(ids[i + n - 1]) - int(ids[i]) != n - 1:
            raise RestoreError(f"{where}: spans {n} rows, which are not all stored")
        kind, raw = decode(blob[i:i + n], where)
        if kind not in (ADD, PRIO, STATE):
            raise RestoreError(f"{where}: unknown kind {kind}")
        st = bytes_state(raw, where)
        out.append((record_of(kind, int(ids[i]), n, st), st))
        i += n
    return out


@collections_paused()  # millions of new objects, none of them garbage
def restore_journal(buf: Any, state: Dict[str, Any], agent_to_module_mapping_fn: Optional[Callable] = None) -> None:
    """Restore ``buf`` (a fresh or used buffer of the saved type and capacity) from a
    ``replay_journal`` state, and seed its journal. Multi-agent episodes get
    ``agent_to_module_mapping_fn`` (the algorithm's ``policy_mapping_fn``)."""
    meta = read_meta(state)
    if type_name(buf) != meta["buffer_type"]:
        raise RestoreError(f"replay journal: saved from a {meta['buffer_type']}, restoring into a {type_name(buf)}; "
                           f"nothing was changed")
    fam = family_of(buf)
    for k, v in meta["config"].items():
        have = internals.replay_alpha(buf) if k == "alpha" else getattr(buf, k)
        if have != v:
            raise RestoreError(f"replay journal: the buffer's {k} is {have!r}, the saved one's {v!r}; nothing was changed")
    records = read_records(state["row_id"], state["blob"])
    first = int(meta["state"]["_num_episodes_evicted"])
    spaces = Spaces(meta["spaces"])
    agents = list(meta["agents"])
    keys = [None] + list(meta["modules"])

    base = next((r for r in reversed(records) if r[0].kind == STATE), None)
    base_seq = base[0].seq if base else -1
    chunks: Dict[int, List[Dict[str, Any]]] = collections.defaultdict(list)
    parts: Dict[Any, List[np.ndarray]] = {k: [] for k in keys}
    leaves: Dict[Any, Tuple[Dict[int, Any], Dict[int, Any]]] = {k: ({}, {}) for k in keys}
    events: List[Tuple[int, Any, str, Any, Any]] = []  # (seq, key, "add" | "prio", leaf indices, weight | priorities)
    if base is not None:
        for x in base[1]["lists"]:
            parts[x["key"]].append(x["indices"])
            if fam.prioritized:
                t0 = x["indices"][:, -1].tolist()
                leaves[x["key"]][0].update(zip(t0, unpack_scalars(x["sum"])))
                leaves[x["key"]][1].update(zip(t0, unpack_scalars(x.get("min", x["sum"]))))
    for rec, st in records:
        if rec.kind == ADD:
            for c, e in zip(st["chunks"], st["eps"].tolist()):
                if e >= first:
                    chunks[e].append(c)
            if rec.seq <= base_seq:
                continue
            if st["tails"] is None:
                raise RestoreError(f"replay journal: record at row {rec.first} holds whole episodes but no STATE "
                                   f"record gives their index entries")
            weights = dict(st.get("w") or ())
            for key, tail in st["tails"]:
                parts.setdefault(key, []).append(tail)
                if fam.prioritized:
                    events.append((rec.seq, key, "add", tail[:, -1], unpack_one(weights[key])))
        elif rec.kind == PRIO and rec.seq > base_seq:
            for c in st["calls"]:
                p = c["p"]
                events.append((int(c["seq"]), c["key"], "prio", c["idx"], p["array"] if "array" in p
                               else unpack_scalars(p)))
    lists = {}
    for key in keys:
        arr = np.concatenate(parts[key]) if parts.get(key) else np.empty((0, fam.width(key)), np.int64)
        lists[key] = arr[arr[:, 0] >= first]
    try:
        episodes = rebuild_episodes(chunks, first, spaces, agent_to_module_mapping_fn)
    except RestoreError:
        raise
    except Exception as exc:  # RLlib's own checks (concat_episode's asserts, validate())
        raise RestoreError(f"replay journal: its episodes cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    n_steps = sum(len(e) for e in episodes)
    if len(lists[None]) != n_steps:  # (RLlib's own _num_timesteps counter may differ from both: restored as saved)
        raise RestoreError(f"replay journal: {n_steps} steps in {len(episodes)} episodes but {len(lists[None])} index "
                           f"entries")

    def entries(key: Any) -> list:
        rows = lists[key].tolist()
        return [tuple(r) for r in rows] if key is None else [(r[0], agents[r[1]], *r[2:]) for r in rows]

    rl_state: Dict[str, Any] = dict(meta["state"])
    rl_state.update(episodes=[], episode_id_to_index=[(e.id_, first + i) for i, e in enumerate(episodes)],
                    _indices=entries(None))
    if fam.multi_agent:
        rl_state["_module_to_indices"] = [(m, entries(m)) for m in keys[1:]]
    fresh = _fresh_lists(buf) if fam.prioritized else None
    if fam.prioritized:
        rl_state.update(_trees(meta, fam, keys, lists, leaves, events, fresh))
    # what RLlib's set_state() gets wrong, from the restoring buffer as RLlib built it
    if fam.multi_agent:
        sampled_factory = buf.sampled_timesteps_per_module.default_factory
        min_factory = internals.module_min_tree_factory(buf) if fam.prioritized else None
    buf.episodes = collections.deque(episodes)
    type(buf).set_state(buf, rl_state)
    if fam.prioritized:
        internals.set_free_nodes(buf, free_nodes_from(meta["per"]["_free_nodes"], fresh[2] if fresh else None))
    if fam.multi_agent:
        buf.sampled_timesteps_per_module = collections.defaultdict(sampled_factory, buf.sampled_timesteps_per_module)
        if fam.prioritized:
            internals.fix_module_trees(buf, min_factory, {i: t for i, t in enumerate(lists[None][:, -1].tolist())})
    buf.rng.bit_generator.state = meta["rng"]
    if meta.get("metrics") is not None:
        buf.metrics.set_state(from_storable(meta["metrics"]))
    _seed(buf, fam, meta, records, state, spaces, agents)


def _fresh_lists(buf: Any) -> Optional[Tuple[list, list, Any]]:
    """A prioritized buffer that never had a step added (a resume builds its algorithm anew): its
    env trees' value lists (all neutral: each root is) and its free-node deque, which the restore
    then writes in place, O(what the journal holds) rather than O(capacity) (a 1M-capacity buffer's
    trees are 4M-node lists). None for a buffer in use."""
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer
    if EpisodeReplayBuffer.get_added_timesteps(buf) != 0:
        return None
    st = full_state(buf)
    sums, mins = internals.tree_values(st, False)[None]
    if len(sums) < 2 or len(sums) != len(mins) or sums[1] != 0.0 or mins[1] != float("inf"):
        return None
    return sums, mins, internals.per_scalars(buf)["_free_nodes"]


def _trees(meta: Dict[str, Any], fam: Family, keys: list, lists: Dict[Any, np.ndarray],
           leaves: Dict[Any, Tuple[Dict[int, Any], Dict[int, Any]]], events: list,
           fresh: Optional[Tuple[list, list, Any]]) -> Dict[str, Any]:
    """The prioritized get_state() keys: each live leaf as the last event left it (the newest STATE
    record's value, then the add() weights and update_priorities() values after it, computed as
    RLlib computes them), every other leaf neutral; the inner nodes recomputed (the env trees into
    ``fresh``'s lists when given)."""
    from ray.rllib.execution.segment_tree import MinSegmentTree, SumSegmentTree
    alpha = meta["config"]["alpha"]
    for _, key, what, idx, x in sorted(events, key=lambda e: e[0]):
        sums, mins = leaves[key]
        if what == "add":
            for t in idx.tolist():
                sums[t] = mins[t] = x ** alpha
        else:
            for t, p in zip(idx.tolist(), x):
                sums[t] = mins[t] = max(p, 1e-12) ** alpha
    cap = 2 * int(2 ** np.ceil(np.log2(meta["config"]["capacity"])))
    live = {}
    for key in keys:
        try:
            live[key] = [pack_scalars([d[t] for t in lists[key][:, -1].tolist()], "tree leaves") for d in leaves[key]]
        except KeyError as exc:
            raise RestoreError(f"replay journal: no record gives the priority of tree leaf {exc}") from None
    built = {}
    for key in keys:  # nothing raises from here on: the fresh buffer's lists may be written
        pair = []
        for i, (cls, packed) in enumerate(zip((SumSegmentTree, MinSegmentTree), live[key])):
            tree = cls(1)  # not cls(cap): its 2 * cap neutral values would be thrown away at once
            tree.capacity = cap
            into = fresh[i] if fresh is not None and key is None and len(fresh[i]) == 2 * cap else None
            rebuild_tree(tree, lists[key][:, -1], packed, into)
            pair.append(tree)
        built[key] = pair
    per = meta["per"]
    env_tidx = lists[None][:, -1].tolist()
    # "_free_nodes": set after set_state() as it was (RLlib's own drops the deque's maxlen)
    out = {"_sum_segment": built[None][0].value, "_min_segment": built[None][1].value,
           "_free_nodes": (), "_max_priority": unpack_one(per["_max_priority"]),
           "_max_idx": per["_max_idx"], "_tree_idx_to_sample_idx": [(t, i) for i, t in enumerate(env_tidx)],
           "_last_sampled_indices": list(per["_last_sampled_indices"])}
    if fam.multi_agent:
        mods = keys[1:]
        mp = meta["module_per"]
        out.update(
            _module_to_sum_segment=[(m, built[m][0]) for m in mods],
            _module_to_min_segment=[(m, built[m][1]) for m in mods],
            _module_to_tree_idx_to_sample_idx=[(m, {t: i for i, t in enumerate(lists[m][:, -1].tolist())})
                                               for m in mods],
            _module_to_max_priority=[(m, unpack_one(v["_max_priority"])) for m, v in mp["_module_to_max_priority"]],
            _module_to_max_idx=[(m, v["_max_idx"]) for m, v in mp["_module_to_max_idx"]],
            _module_to_free_nodes=[(m, free_nodes_from(v["_free_nodes"])) for m, v in mp["_module_to_free_nodes"]],
            _module_to_last_sampled_indices=[(m, list(v["_last_sampled_indices"]))
                                             for m, v in mp["_module_to_last_sampled_indices"]])
    return out


def _seed(buf: Any, fam: Family, meta: Dict[str, Any], records: List[Tuple[Record, Any]], state: Dict[str, Any],
          spaces: Spaces, agents: List[Any]) -> None:
    """A journal for the restored buffer that holds the restored records: the next save keeps their
    rows (same ids) and adds only what arrives after the restore."""
    j = Journal(buf)
    j.spaces, j.agent_codes = spaces, {a: i for i, a in enumerate(agents)}
    j.records = [r for r, _ in records]
    j.ids = np.asarray(state["row_id"], np.int64)
    j.rows = np.asarray(state["blob"], np.uint8).reshape(-1, ROW_BYTES)
    j.next_row_id = int(meta["next_row_id"])
    j.seq = int(meta["seq"])
    j.full_because = None
    j.synced(base_state(buf, fam))
    install(buf, j)
