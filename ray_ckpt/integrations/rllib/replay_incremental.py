"""Single-agent replay buffers (``EpisodeReplayBuffer``, ``PrioritizedEpisodeReplayBuffer``) captured
incrementally: a save converts, and writes, only what changed since the previous capture.

Four states (all but ``replay_meta`` registered ``append_only=True``, see ``formats/segments.py``):

``replay``            one row per stored timestep (:mod:`.replay`'s layout), plus for prioritized
                      buffers ``prio`` / ``prio_k``: the row's sum-tree leaf *when the row was first
                      captured* (value as float64, type code in :data:`KINDS`). Never changes.
``replay_episodes``   a log of the episodes that are done (RLlib only ever concatenates to running
                      episodes, so a done episode never changes): each capture appends one *batch*
                      holding the episodes that became done since the previous one, as the columnar
                      episode table of :mod:`.replay` serialised with ray_ckpt's own safetensors
                      format and cut into rows of :data:`CHUNK` bytes (``row_id``, ``batch``,
                      ``blob``). A batch leaves the live set once all its episodes are evicted.
``replay_priorities`` prioritized only: a change log of tree leaves (``row``: the replay row id,
                      ``which``: 0 both trees / 1 the sum tree / 2 the min tree, ``v``, ``k``), one
                      entry per leaf that changed since the previous capture. The changes are
                      recorded by wrapping the buffer instance's ``update_priorities`` (the only
                      RLlib path that changes a stored row's leaf) and spot-checked against the
                      trees each capture; a buffer whose trees were replaced, or whose recorder is
                      gone, is compared row by row once. When the log holds more than twice as many
                      entries as the buffer has rows it is compacted: one entry per row whose leaves
                      differ from its ``prio``, under new ids (the older entries leave the live set).
``replay_meta``       small, written whole: the format, the buffer type, the row count, the next ids
                      of the rows and the two logs (read to decide whether a buffer's ids are the
                      run's, :func:`.replay._row_floor`), and ``packed``: config, counters, sampling
                      generator, metrics, the spaces table, the running episodes' table, the live
                      batches and the trees' scalars, as one zlib-compressed safetensors blob (it is
                      mostly structure JSON: ~6 KB a save uncompressed, most of it the metrics
                      logger's windows).

A restore turns the four back into :mod:`.replay`'s single ``(replay, replay_meta)`` form
(:func:`states_to_v1`) and restores that; it then seeds the caches below so the next save goes on
appending to the same logs. Multi-agent buffers are captured whole by :mod:`.replay` (format /1).
"""
from __future__ import annotations

import io
import itertools
import operator
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from ...errors import RestoreError, UnsupportedTypeError
from .conversion import from_storable
from .names import log
from . import replay as R

REPLAY_EPISODES = "replay_episodes"
REPLAY_PRIORITIES = "replay_priorities"
META_FORMAT2 = "ray_ckpt.rllib.replay/2"
EPISODE_LOG = "rllib_episode_log/1"
PRIORITY_LOG = "rllib_priority_log/1"
CHUNK = 256  # bytes of a serialised episode batch per row of ``replay_episodes``
KINDS = ("float", "np:<f8", "np:<f4", "int", "np:<f2", "bool")  # a tree leaf's exact type, by code
_CODE = {k: i for i, k in enumerate(KINDS)}
COMPACT_FACTOR = 2
COMPACT_MIN = 4096
SPOT = 64  # leaves compared against the cache at every capture


@dataclass
class Incremental:
    """What the previous capture of one buffer produced, kept beside it (``RowIds.inc``)."""

    ids: np.ndarray                                 # row ids of the live rows, in order
    cols: Dict[str, np.ndarray]                     # every replay column of those rows (ids aside)
    sig: Dict[str, Tuple[Any, Tuple[int, ...]]]     # column -> (dtype, per-row shape)
    templates: Dict[str, Any]
    open_keys: Set[int] = field(default_factory=set)  # episodes that were running when captured
    max_key: int = -1                                 # highest episode index captured
    logged: Set[int] = field(default_factory=set)     # episode indices in the episodes log
    evicted: int = 0
    ep_log: Dict[str, np.ndarray] = field(default_factory=dict)
    batches: List[List[int]] = field(default_factory=list)  # [batch, highest episode index in it]
    next_chunk: int = 0
    next_batch: int = 0
    # prioritized
    leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # sv, sk, mv, mk per live row
    tree_to_row: Optional[np.ndarray] = None
    plog: Dict[str, np.ndarray] = field(default_factory=dict)
    next_log: int = 0
    touched: List[List[int]] = field(default_factory=list)
    trees: Tuple[Any, ...] = ()


def _empty_ep_log() -> Dict[str, np.ndarray]:
    return {"row_id": np.empty(0, np.int64), "batch": np.empty(0, np.int64), "blob": np.empty((0, CHUNK), np.uint8)}


def _empty_plog() -> Dict[str, np.ndarray]:
    return {"row_id": np.empty(0, np.int64), "row": np.empty(0, np.int64), "which": np.empty(0, np.int8),
            "v": np.empty(0, np.float64), "k": np.empty(0, np.int8)}


# ---------------------------------------------------------------------------- leaves
def _leaf_codes(tree: Any, tidx: np.ndarray, what: str) -> Tuple[np.ndarray, np.ndarray]:
    """(value as float64, type code) of the leaves ``tidx`` of ``tree``."""
    if len(tidx) == 0:
        return np.empty(0, np.float64), np.empty(0, np.int8)
    got = operator.itemgetter(*(tidx + tree.capacity).tolist())(tree.value)
    vals = list(got) if len(tidx) > 1 else [got]
    codes = np.empty(len(vals), np.int8)
    kind_of: Dict[type, int] = {}
    for i, x in enumerate(vals):
        t = type(x)
        c = kind_of.get(t)
        if c is None:
            try:
                c = kind_of[t] = _CODE[R._kind_of(x)]
            except (TypeError, KeyError):
                raise UnsupportedTypeError(f"replay buffer: {what} leaf {int(tidx[i])} is a {R._type_name(x)} "
                                           f"(stored: {', '.join(KINDS)})") from None
        codes[i] = c
    return np.array(vals, np.float64), codes


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


# ---------------------------------------------------------------------------- episode batches
def _field_meta(parts: List[R._EpisodeParts]) -> Dict[str, List[Tuple[int, R._Field]]]:
    fm: Dict[str, List[Tuple[int, R._Field]]] = {}
    for r, p in enumerate(parts):
        for f in p.fields:
            fm.setdefault(f.name, []).append((r, f))
    return fm


def _table(parts: List[R._EpisodeParts], bname: str) -> Dict[str, Any]:
    return R._episode_table(parts, _field_meta(parts), bname)


def _encode(state: Any, width: int = CHUNK) -> np.ndarray:
    """A nested state as rows of ``width`` bytes: an 8-byte length, then ray_ckpt's safetensors bytes
    of it, zlib-compressed (an episode table is mostly the structure's JSON: it compresses ~5x)."""
    from ...formats import safetensors_io
    from ...formats.tree import flatten
    sink = io.BytesIO()
    safetensors_io.write(flatten(state, state_name=REPLAY_EPISODES), sink)
    packed = zlib.compress(sink.getvalue(), 6)
    raw = len(packed).to_bytes(8, "little") + packed
    raw += b"\0" * (-len(raw) % width)
    return np.frombuffer(raw, np.uint8).reshape(-1, width)


def _decode(rows: np.ndarray, where: str) -> Any:
    from ...formats import safetensors_io
    from ...formats.tree import unflatten
    raw = np.ascontiguousarray(rows).reshape(-1).tobytes()
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise RestoreError(f"{where}: says {n} bytes but has {len(raw) - 8}")
    try:
        data = zlib.decompress(raw[8:8 + n])
    except zlib.error as exc:
        raise RestoreError(f"{where}: {exc}") from None
    structure, views = safetensors_io.read(bytearray(data), path=where)
    return unflatten(structure, views, [])


def _parts_from_table(t: Dict[str, Any], templates: Dict[str, Any], done: bool) -> List[R._EpisodeParts]:
    """The episodes of a stored table as parts (edges, no timestep bodies) for R._episode_table."""
    E = int(t["n"])
    keys = np.asarray(t["key"], np.int64).reshape(E, 2)
    lens = np.asarray(t["len"], np.int64)
    nums = {k: R.unpack_scalars(t[k]) for k in R._EP_NUMBERS}
    custom = {int(r): from_storable(v) for r, v in t["custom_data"]}
    sparse: Dict[int, List[Tuple[int, Any]]] = {}
    for r, i, x in t["infos"]["sparse"]:
        sparse.setdefault(int(r), []).append((int(i), from_storable(x)))
    keysets = [list(k) for k in t["emo_keysets"]]
    emo = np.asarray(t["emo_keys"], np.int64)
    fields: List[List[R._Field]] = [[] for _ in range(E)]
    for name, f in t["fields"].items():
        rec = np.asarray(f["rec"], np.int64)
        dl = np.asarray(f["data_len"], np.int64)
        elen = np.where(dl > 0, dl - lens[rec], 0) if len(rec) else np.zeros(0, np.int64)
        off = np.concatenate([[0], np.cumsum(elen)])
        for i, r in enumerate(rec.tolist()):
            a, b = int(off[i]), int(off[i + 1])
            fields[r].append(R._Field(name, int(f["lookback"][i]), bool(f["finalized"][i]), int(f["space"][i]),
                                      int(f["list_kind"][i]), int(dl[i]),
                                      templates.get(name) if dl[i] > 0 else None, {},
                                      {c: np.asarray(v)[a:b] for c, v in f["edge"].items()} if dl[i] > 0 else {}))
    infos = t["infos"]
    out = []
    for r in range(E):
        sc = {k: (t[k][r] if t[k] is not None else None) for k in R._EP_SCALARS}
        sc.update({k: nums[k][r] for k in R._EP_NUMBERS})
        sc["id_"] = t["id"][r]
        sc["obs_space"] = int(t["obs_space"][r])
        sc["act_space"] = int(t["act_space"][r])
        sc["custom_data"] = custom.get(r, {})
        out.append(R._EpisodeParts((int(keys[r][0]), int(keys[r][1])), int(lens[r]), done, sc, fields[r],
                                   keysets[int(emo[r])],
                                   {"lookback": int(infos["lookback"][r]), "len": int(infos["len"][r]),
                                    "sparse": sparse.get(r, []), "space": int(infos["space"][r])}))
    return out


# ---------------------------------------------------------------------------- capture
def capture_states(buffer: Any, rid: "R.RowIds") -> Dict[str, Any]:
    """The states of a single-agent buffer (names: ``replay``, ``replay_meta``, ``replay_episodes``,
    ``replay_priorities`` if prioritized); advances the buffer's caches (``rid``)."""
    from .names import REPLAY, REPLAY_META
    kind = R.buffer_kind(buffer)
    if kind.multi_agent:
        raise TypeError("capture_states is for single-agent buffers")
    attrs = R._attributes(buffer)
    bname = R._type_name(buffer)
    meta = R.common_meta(buffer, attrs, bname, META_FORMAT2)
    meta["module_counters"] = {}
    meta["extra_attrs"] = R.extra_attrs(attrs, R.handled_attrs(kind), bname)
    for _ in range(2):
        try:
            out = _capture(buffer, rid, kind, bname, meta)
            break
        except _Misaligned as exc:
            log.warning("ray_ckpt: replay buffer %s: %s: every row, episode and priority gets a new id "
                        "(this save rewrites the buffer)", bname, exc)
            rid.renumber(rid.next_id)
    else:  # pragma: no cover - a full capture never misaligns
        raise UnsupportedTypeError(f"replay buffer {bname}: could not be captured")
    replay, episodes, plog = out
    states = {REPLAY: replay, REPLAY_META: meta, REPLAY_EPISODES: episodes}
    if kind.prioritized:
        states[REPLAY_PRIORITIES] = plog
    return states


class _Misaligned(Exception):
    pass


def _capture(buffer: Any, rid: "R.RowIds", kind: "R._Kind", bname: str, meta: Dict[str, Any]):
    inc = rid.inc
    full = inc is None
    evicted = int(buffer._num_episodes_evicted)
    episodes = buffer.episodes
    E = len(episodes)
    if len(buffer.episode_id_to_index) != E:
        raise UnsupportedTypeError(f"{bname}: episode_id_to_index has {len(buffer.episode_id_to_index)} entries "
                                   f"for {E} episodes")
    spaces = rid.spaces
    # ---- episodes to split now: all (full) or the running ones and those added since
    if full:
        todo = list(range(evicted, evicted + E))
        floors = getattr(rid, "floors", None) or {}
        inc = Incremental(np.empty(0, np.int64), {}, {}, {}, evicted=evicted)
        inc.ep_log = _empty_ep_log()
        inc.plog = _empty_plog()
        inc.next_chunk = int(floors.get("chunk", 0))
        inc.next_log = int(floors.get("log", 0))
        rid.parts = {}
    else:
        todo = sorted(k for k in inc.open_keys if k >= evicted)
        todo += list(range(max(inc.max_key + 1, evicted), evicted + E))
    for k in range(inc.evicted, evicted):  # forget evicted episodes
        rid.parts.pop((k, -1), None)
        inc.logged.discard(k)
        inc.open_keys.discard(k)
    newly_done: List[R._EpisodeParts] = []
    for key in todo:
        ep = episodes[key - evicted]
        if buffer.episode_id_to_index.get(ep.id_) != key:
            raise UnsupportedTypeError(f"{bname}: episode_id_to_index[{ep.id_!r}] is "
                                       f"{buffer.episode_id_to_index.get(ep.id_)}, expected {key}")
        hit = rid.parts.get((key, -1))
        done = bool(ep.is_done)
        p = hit[1] if hit is not None and hit[0] is ep and hit[1].done and done else \
            R._split_episode(ep, (key, -1), spaces, f"{bname} episode {key}")
        rid.parts[(key, -1)] = (ep, p)
        if done:
            inc.open_keys.discard(key)
            if key not in inc.logged:
                newly_done.append(p)
        else:
            inc.open_keys.add(key)
    inc.max_key = max(inc.max_key, evicted + E - 1)

    # ---- rows: keys and ids (survivors keep theirs, new ones follow)
    width = 3 if kind.prioritized else 2
    keys, ids = R._update_ids(rid, buffer, [("_indices", buffer._indices, width, tuple)], evicted,
                              int(buffer._num_timesteps_added))
    n = len(ids)
    if n != int(buffer._num_timesteps):
        raise UnsupportedTypeError(f"{bname}: {n} index entries for {buffer._num_timesteps} timesteps")
    if full:
        keep = np.zeros(0, bool)
        s = 0
    else:
        keep = inc.cols["episode"] >= evicted
        s = int(np.count_nonzero(keep))
        if n < s or not np.array_equal(ids[:s], inc.ids[keep]):
            raise _Misaligned("its index list changed other than by appends and evictions")
    new_keys = keys[s:]
    new = _gather(new_keys, rid.parts, inc, bname)
    new["episode"] = new_keys[:, 0].copy()
    new["t"] = R._int32(new_keys[:, 1], "t")
    if kind.prioritized:
        new["tree"] = R._int32(new_keys[:, 2], "tree")
    entries: List[Dict[str, np.ndarray]] = []
    if kind.prioritized:
        entries = _priorities(buffer, inc, keep, new, ids, s, full, bname)
    cols = {}
    for c, v in new.items():
        cols[c] = v if full else (np.concatenate([inc.cols[c][keep], v]) if s < len(keep)
                                  else np.concatenate([inc.cols[c], v]))
    if not full and set(cols) != set(inc.cols):
        raise _Misaligned(f"its columns changed ({sorted(set(cols) ^ set(inc.cols))})")
    inc.cols, inc.ids, inc.evicted = cols, ids, evicted

    replay: Dict[str, Any] = {"row_id": ids, **cols, "layout": R.LAYOUT}
    # ---- episodes log: a batch of the newly done episodes; batches all evicted leave
    newly_done.sort(key=lambda p: p.key)
    if newly_done:
        blob = _encode(_table(newly_done, bname))
        m = len(blob)
        add = {"row_id": np.arange(inc.next_chunk, inc.next_chunk + m, dtype=np.int64),
               "batch": np.full(m, inc.next_batch, np.int64), "blob": blob}
        inc.ep_log = {k: np.concatenate([inc.ep_log[k], add[k]]) for k in add}
        inc.batches.append([inc.next_batch, newly_done[-1].key[0]])
        inc.logged.update(p.key[0] for p in newly_done)
        inc.next_chunk += m
        inc.next_batch += 1
    dead = [b for b, top in inc.batches if top < evicted]
    if dead:
        inc.batches = [x for x in inc.batches if x[1] >= evicted]
        alive = ~np.isin(inc.ep_log["batch"], np.array(dead, np.int64))
        inc.ep_log = {k: v[alive] for k, v in inc.ep_log.items()}
    episodes_state = {**inc.ep_log, "layout": EPISODE_LOG}
    # ---- priority log
    plog_state = None
    if kind.prioritized:
        _append_log(inc, entries, n)
        plog_state = {**inc.plog, "layout": PRIORITY_LOG}
    rid.inc = inc
    rid.floors = None

    running = [rid.parts[(k, -1)][1] for k in sorted(inc.open_keys)]
    meta["rows"] = {"next_row_id": int(rid.next_id), "n_rows": int(n), "agent_ids": [], "module_ids": [],
                    "templates": inc.templates}
    meta["spaces"] = spaces.table
    meta["running"] = _table(running, bname)
    meta["episode_log"] = {"batches": np.array(inc.batches, np.int64).reshape(len(inc.batches), 2),
                           "next_chunk": inc.next_chunk, "next_batch": inc.next_batch, "chunk": CHUNK}
    if kind.prioritized:
        meta["priority"] = _priority_scalars(buffer, inc, bname)
    spaces.prune()
    # all of it but the ids' floors as one compressed blob: the metrics logger's windows and the
    # running episodes' table are small but mostly structure JSON (~6 KB a save otherwise)
    packed = {k: v for k, v in meta.items() if k not in ("format", "buffer_type")}
    meta.clear()
    meta.update({"format": META_FORMAT2, "buffer_type": bname, "n_rows": int(n),
                 "next_ids": {"row": int(rid.next_id), "chunk": int(inc.next_chunk), "log": int(inc.next_log)},
                 "packed": _encode(packed, 1).reshape(-1)})
    return replay, episodes_state, plog_state


def _gather(new_keys: np.ndarray, parts: Dict[Tuple[int, int], Any], inc: Incremental,
            bname: str) -> Dict[str, np.ndarray]:
    """The data columns of the new rows, read from their episodes' timesteps."""
    m = len(new_keys)
    pieces: Dict[str, List[np.ndarray]] = {c: [] for c in inc.sig}
    if m == 0:
        return {c: np.empty((0,) + sh, dt) for c, (dt, sh) in inc.sig.items()}
    e, t = new_keys[:, 0], new_keys[:, 1]
    uniq, inv = np.unique(e, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv)
    start = 0
    for j, ek in enumerate(uniq.tolist()):
        hit = parts.get((ek, -1))
        if hit is None:
            raise UnsupportedTypeError(f"{bname}: an index refers to episode {ek}, which the buffer does not hold")
        p = hit[1]
        tt = t[order[start:start + counts[j]]]
        start += counts[j]
        if tt.max() >= p.n:
            raise UnsupportedTypeError(f"{bname}: an index refers to a timestep beyond episode {ek}'s end")
        for f in p.fields:
            if f.template is None:
                continue
            old = inc.templates.setdefault(f.name, f.template)
            if old != f.template:
                raise UnsupportedTypeError(f"replay buffer {bname}: {f.name} of episode {ek} has the structure "
                                           f"{f.template!r}, other episodes {old!r}")
            for col, arr in f.body.items():
                sg = (arr.dtype, arr.shape[1:])
                first = inc.sig.setdefault(col, sg)
                if first != sg:
                    raise UnsupportedTypeError(
                        f"replay buffer {bname}: column {col!r} of episode {ek} is {sg[0]}{list(sg[1])}, other "
                        f"episodes' {first[0]}{list(first[1])}")
                pieces.setdefault(col, []).append(arr[tt])
    back = np.empty_like(order)
    back[order] = np.arange(m)
    out = {}
    for col, ps in pieces.items():
        if sum(len(x) for x in ps) != m:
            raise UnsupportedTypeError(f"replay buffer {bname}: column {col!r} is missing from some episodes "
                                       f"(extra_model_outputs keys differ between episodes)")
        out[col] = np.concatenate(ps)[back]
    return out


# ---------------------------------------------------------------------------- priorities
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
        R._check_neutral(st, np.concatenate([inc.cols["tree"][keep].astype(np.int64) if not full else
                                             np.empty(0, np.int64), tnew]), f"{bname}._sum_segment")
        R._check_neutral(mt, np.concatenate([inc.cols["tree"][keep].astype(np.int64) if not full else
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


def _append_log(inc: Incremental, entries: List[Dict[str, np.ndarray]], n_rows: int) -> None:
    m = sum(len(e["row"]) for e in entries)
    if len(inc.plog["row_id"]) + m > COMPACT_FACTOR * n_rows + COMPACT_MIN:
        # compaction: one entry per row whose leaves are not its prio, under new ids
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
        inc.plog = _empty_plog()
        m = sum(len(e["row"]) for e in entries)
    if not m:
        return
    add = {k: np.concatenate([e[k] for e in entries]) for k in ("row", "which", "v", "k")}
    add["row_id"] = np.arange(inc.next_log, inc.next_log + m, dtype=np.int64)
    inc.plog = {k: np.concatenate([inc.plog[k], add[k]]) for k in inc.plog}
    inc.next_log += m


def _priority_scalars(buffer: Any, inc: Incremental, bname: str) -> Dict[str, Any]:
    R._check_maps(buffer._tree_idx_to_sample_idx, inc.cols["tree"].astype(np.int64),
                  f"{bname}._tree_idx_to_sample_idx")
    return {"max_priority": R._pack_one(buffer._max_priority, "_max_priority"),
            "max_idx": int(buffer._max_idx),
            "free_nodes": R._free_nodes_state(buffer._free_nodes),
            "last_sampled": [int(i) for i in buffer._last_sampled_indices],
            "tree_capacity": int(buffer._sum_segment.capacity),
            "next_log": int(inc.next_log)}


# ---------------------------------------------------------------------------- back to one form
def states_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """``(replay, replay_meta)`` in :mod:`.replay`'s whole form (what ``restore_replay`` takes) from
    the four states, and (``seed``) what :func:`seed` needs to continue the logs."""
    from .names import REPLAY, REPLAY_META
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
    parts: List[R._EpisodeParts] = []
    starts = np.flatnonzero(np.diff(batch, prepend=-1) != 0)
    ends = np.append(starts[1:], len(batch))
    for a, b in zip(starts.tolist(), ends.tolist()):
        table = _decode(blob[a:b], f"{REPLAY_EPISODES} batch {int(batch[a])}")
        parts += [p for p in _parts_from_table(table, templates, True) if p.key[0] >= evicted]
    running = _parts_from_table(meta["running"], templates, False)
    logged = {p.key[0] for p in parts}
    parts = sorted(parts + running, key=lambda p: p.key)
    v1 = {k: v for k, v in meta.items() if k not in ("running", "episode_log")}
    v1["format"] = R.META_FORMAT
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
    """Leaves in :func:`replay.pack_scalars`'s form (only the kinds used, so the fast rebuild applies)."""
    used = sorted(set(np.unique(k).tolist()))
    kinds = [KINDS[c] for c in used]
    out: Dict[str, Any] = {"v": v, "kinds": kinds}
    if len(used) > 1:
        remap = np.zeros(len(KINDS), np.int8)
        remap[used] = np.arange(len(used))
        out["k"] = remap[k]
    return out


def seed(rid: "R.RowIds", s: Dict[str, Any], buffer: Any) -> None:
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
    rid.spaces = R._Spaces(meta["spaces"])
    rid.inc = inc
