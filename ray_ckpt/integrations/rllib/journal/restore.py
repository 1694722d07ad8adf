"""A ``replay_journal`` state -> a buffer, through RLlib's own API: the episodes rebuilt chunk by
chunk (``from_state`` + ``concat_episode``), then ``set_state()`` with the index list and the tree
values the records give, then the sampling generator and the metrics; the journal is seeded so the
next save writes only what arrives after the restore.

Everything is read and checked before the buffer is touched: a state that does not fit raises
RestoreError and leaves the buffer as it was.
"""
from __future__ import annotations

import base64
import collections
import zlib
from typing import Any, Dict, List, Tuple

import numpy as np

from ....errors import RestoreError
from ..base import _rllib_internals as internals
from ..base.conversion import from_storable
from .episodes import rebuild_episodes
from .journal import ADD, FORMAT, KIND_NAMES, PRIO, STATE, Journal, Record, install, is_prioritized
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
        if kind not in KIND_NAMES:
            raise RestoreError(f"{where}: unknown kind {kind}")
        st = bytes_state(raw, where)
        seq = st["seq"] if kind != PRIO else st["calls"][-1]["seq"]
        rec = Record(kind, int(ids[i]), n, int(seq))
        if kind == ADD:
            rec.last_episode = int(np.max(st["eps"])) if len(st["eps"]) else -1
        elif kind == STATE:
            rec.last_episode = int(np.max(st["indices"][:, 0])) if len(st["indices"]) else -1
        else:
            rec.entries = sum(len(c["idx"]) for c in st["calls"])
        out.append((rec, st))
        i += n
    return out


def restore_journal(buf: Any, state: Dict[str, Any]) -> None:
    """Restore ``buf`` (a fresh or used buffer of the saved type and capacity) from a
    ``replay_journal`` state, and seed its journal."""
    meta = read_meta(state)
    want = meta["buffer_type"]
    if type_name(buf) != want:
        raise RestoreError(f"replay journal: saved from a {want}, restoring into a {type_name(buf)}; nothing was changed")
    for k, v in meta["config"].items():
        have = internals.replay_alpha(buf) if k == "alpha" else getattr(buf, k)
        if have != v:
            raise RestoreError(f"replay journal: the buffer's {k} is {have!r}, the saved one's {v!r}; nothing was changed")
    records = read_records(state["row_id"], state["blob"])
    counters = meta["state"]
    first = int(counters["_num_episodes_evicted"])
    spaces = Spaces(meta["spaces"])
    prioritized = is_prioritized(buf)

    states = [r for r in records if r[0].kind == STATE]
    base = states[-1] if states else None
    base_seq = base[0].seq if base else -1
    chunks: Dict[int, List[Dict[str, Any]]] = collections.defaultdict(list)
    tails = [base[1]["indices"]] if base else []
    events: List[Tuple[int, Any]] = []  # (seq, ("add", tree indices, weight) | ("prio", indices, priorities))
    for rec, st in records:
        if rec.kind == ADD:
            for c, e in zip(st["chunks"], st["eps"].tolist()):
                if e >= first:
                    chunks[e].append(c)
            if rec.seq > base_seq:
                if st["tail"] is None:
                    raise RestoreError(f"replay journal: record at row {rec.first} holds whole episodes but no "
                                       f"STATE record gives their index entries")
                tails.append(st["tail"])
                if prioritized:
                    events.append((rec.seq, ("add", st["tail"][:, 2], unpack_one(st["w"]))))
        elif rec.kind == PRIO and rec.seq > base_seq:
            for call in st["calls"]:
                p = call["p"]
                events.append((int(call["seq"]), ("prio", call["idx"], p["array"] if "array" in p
                                                  else unpack_scalars(p))))
    width = 3 if prioritized else 2
    allidx = np.concatenate(tails) if tails else np.empty((0, width), np.int64)
    indices = allidx[allidx[:, 0] >= first] if len(allidx) else allidx
    try:
        episodes = rebuild_episodes(chunks, first, spaces)
    except RestoreError:
        raise
    except Exception as exc:  # RLlib's own checks (concat_episode's asserts, validate())
        raise RestoreError(f"replay journal: its episodes cannot be rebuilt ({type(exc).__name__}: {exc})") from None
    n_steps = sum(len(e) for e in episodes)
    if n_steps != int(counters["_num_timesteps"]) or len(indices) != n_steps:
        raise RestoreError(f"replay journal: {n_steps} timesteps in {len(episodes)} episodes and {len(indices)} index "
                           f"entries, the buffer had {counters['_num_timesteps']}")
    rl_state: Dict[str, Any] = dict(counters)
    rl_state.update(episodes=[], episode_id_to_index=[(e.id_, first + i) for i, e in enumerate(episodes)],
                    _indices=[tuple(x) for x in indices.tolist()])
    if prioritized:
        rl_state.update(_per_state(buf, meta, base, events, indices))
    buf.episodes = collections.deque(episodes)
    type(buf).set_state(buf, rl_state)
    if prioritized:
        internals.set_per_free_nodes(buf, free_nodes_from(meta["per"]["_free_nodes"]))
    buf.rng.bit_generator.state = meta["rng"]
    if meta.get("metrics") is not None:
        buf.metrics.set_state(from_storable(meta["metrics"]))
    seed_journal(buf, meta, records, state, spaces)


def _per_state(buf: Any, meta: Dict[str, Any], base: Any, events: List[Tuple[int, Any]],
               indices: np.ndarray) -> Dict[str, Any]:
    """The prioritized get_state() keys: each live leaf as the last event left it (the newest
    STATE record's value, then the add() weights and update_priorities() values after it, computed
    as RLlib computes them), every other leaf neutral; the inner nodes recomputed."""
    from ray.rllib.execution.segment_tree import MinSegmentTree, SumSegmentTree
    alpha = meta["config"]["alpha"]
    leaves: Dict[int, Any] = {}
    mins: Dict[int, Any] = {}
    if base is not None:
        st = base[1]
        t0 = st["indices"][:, 2].tolist()
        leaves.update(zip(t0, unpack_scalars(st["sum"])))
        mins.update(zip(t0, unpack_scalars(st["min"] if "min" in st else st["sum"])))
    for _, (what, idx, x) in sorted(events, key=lambda e: e[0]):
        if what == "add":
            for t in idx.tolist():
                leaves[t] = mins[t] = x ** alpha
        else:
            for t, p in zip(idx.tolist(), x):
                leaves[t] = mins[t] = max(p, 1e-12) ** alpha
    tidx = indices[:, 2]
    try:
        live_sum = [leaves[t] for t in tidx.tolist()]
        live_min = [mins[t] for t in tidx.tolist()]
    except KeyError as exc:
        raise RestoreError(f"replay journal: no record gives the priority of tree leaf {exc}") from None
    cap = 2 * int(2 ** np.ceil(np.log2(meta["config"]["capacity"])))
    trees = []
    for cls, values in ((SumSegmentTree, live_sum), (MinSegmentTree, live_min)):
        tree = cls(cap)
        rebuild_tree(tree, tidx, pack_scalars(values, "tree leaves"))
        trees.append(tree.value)
    per = meta["per"]
    return {"_sum_segment": trees[0], "_min_segment": trees[1],
            "_free_nodes": list(free_nodes_from(per["_free_nodes"])),
            "_max_priority": unpack_one(per["_max_priority"]), "_max_idx": per["_max_idx"],
            "_tree_idx_to_sample_idx": [(t, i) for i, t in enumerate(tidx.tolist())],
            "_last_sampled_indices": list(per["_last_sampled_indices"])}


def seed_journal(buf: Any, meta: Dict[str, Any], records: List[Tuple[Record, Any]], state: Dict[str, Any],
                 spaces: Spaces) -> None:
    """A journal for the restored buffer that holds the restored records: the next save keeps their
    rows (same ids) and adds only what arrives after the restore."""
    j = Journal(buf)
    j.spaces = spaces
    j.records = [r for r, _ in records]
    j.ids = np.asarray(state["row_id"], np.int64)
    j.rows = np.asarray(state["blob"], np.uint8).reshape(-1, ROW_BYTES)
    j.next_row_id = int(meta["next_row_id"])
    j.seq = int(meta["seq"])
    j.full_because = None
    j.added = int(meta["state"]["_num_timesteps_added"])
    j.indices_len = int(meta["state"]["_num_timesteps"])
    install(buf, j)
