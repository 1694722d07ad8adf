"""The reader of the RLlib replay formats written before the replay journal, kept for
``ray-ckpt migrate`` only (:mod:`.migrate`): frozen, not used by saves or restores.

Versions written by ray_ckpt before the journal (``ray_ckpt.rllib.replay/6``) hold a buffer as two
states, ``replay`` (one row per stored timestep: ids, episode keys, leaves, the timestep's data) and
``replay_meta``: whole (format /1), or an append-only log of records compressed against dictionary
records (formats /3 and /4 single-agent, /5 multi-agent; /2 is refused by name). This module turns
the log back into the two-state form (:func:`log_to_v1`) and restores that into a fresh buffer of
the stored class (:func:`restore_replay`), as the integration restored them until it switched to
the journal; migrate then captures the buffer whole as a journal. It reads and writes RLlib's
buffer attributes directly (``_indices``, ``_sum_segment``, ``_tree_idx_to_sample_idx``, ...), as
that integration did: RLlib's ``set_state()`` cannot take these states.

Extracted from the removed package ``integrations/rllib/replay/`` (before the journal took its
name): its definitions that restoring reaches, in one module (they used each other's private names),
unchanged but for the names of the helpers they take from the journal's modules (public there). Tested on runs that package wrote (``tests/fixtures/replay_formats``); to be deleted
with ``migrate`` once no run in the old formats is left.
"""
from __future__ import annotations

import collections
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np
import tree as dm_tree

from ..errors import RestoreError, UnsupportedTypeError
from ..integrations.rllib.base.conversion import from_storable, to_storable
from ..integrations.rllib.base.names import REPLAY, REPLAY_META, log
from ..integrations.rllib.replay.growth import kept, survivors
from ..integrations.rllib.replay.records import bytes_state, state_bytes
from ..integrations.rllib.replay.trees import free_nodes_from, rebuild_tree
from ..integrations.rllib.replay.values import (Spaces, pack_scalars, space_tree_from_storable, type_name, unpack_one,
                                                unpack_scalars)


def count(sel):
    """How many rows :func:`survivors`' answer ``sel`` keeps."""
    return sel.stop - sel.start if isinstance(sel, slice) else int(np.count_nonzero(sel))


def positions(sel, idx):
    """Where the survivors ``idx`` (positions among them) were among the cached rows."""
    return sel.start + idx if isinstance(sel, slice) else np.flatnonzero(sel)[idx]


CHUNK = 256  # bytes of a record per row of the ``replay_meta`` log


def dict_id(zdict: bytes) -> int:
    """The id zlib writes into a stream compressed with ``zdict`` (its Adler-32)."""
    return zlib.adler32(zdict)


def _compress(data: bytes, zdict: Optional[bytes]) -> bytes:
    c = zlib.compressobj(9, zdict=zdict) if zdict else zlib.compressobj(9)
    return c.compress(data) + c.flush()


def _encode(kind: int, raw: bytes, width: int = CHUNK, zdict: Optional[bytes] = None) -> np.ndarray:
    """A record as rows of ``width`` bytes: a 4-byte length, then the kind byte and ``raw`` (a state's
    :func:`state_bytes` bytes), zlib-compressed, with ``zdict`` as the preset dictionary if given."""
    packed = _compress(bytes([kind]) + raw, zdict)
    raw = len(packed).to_bytes(4, "little") + packed
    raw += b"\0" * (-len(raw) % width)
    return np.frombuffer(raw, np.uint8).reshape(-1, width)


def _decode_raw(rows: np.ndarray, kind: int, where: str, dicts: Optional[Mapping[int, bytes]] = None) -> bytes:
    """The bytes :func:`state_bytes` made of a record (its rows, in order), checked to be of ``kind``; a
    record compressed with a dictionary takes it from ``dicts`` (id -> bytes, :func:`dict_id`)."""
    rows = np.asarray(rows, np.uint8)
    raw = np.ascontiguousarray(rows).reshape(-1).tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 <= len(raw) - 4 - n < rows.shape[-1]:  # its rows, no fewer and no more
        raise RestoreError(f"{where}: says {n} bytes but has {len(raw) - 4}")
    stream = raw[4:4 + n]
    zdict = None
    if len(stream) >= 6 and stream[1] & 0x20:  # FDICT: the dictionary's id follows the 2-byte header
        want = int.from_bytes(stream[2:6], "big")
        zdict = (dicts or {}).get(want)
        if zdict is None:
            raise RestoreError(f"{where}: compressed with dictionary {want:#010x}, which no live static "
                               f"record of the log holds")
    try:
        d = zlib.decompressobj(zdict=zdict) if zdict else zlib.decompressobj()
        data = d.decompress(stream) + d.flush()
        if not d.eof or d.unused_data:
            raise zlib.error("the stream is cut short or followed by other bytes")
    except zlib.error as exc:
        raise RestoreError(f"{where}: {exc}") from None
    if not data or data[0] != kind:
        raise RestoreError(f"{where}: a record of kind {data[:1].hex() or 'none'}, expected {kind}")
    return data[1:]


def _decode(rows: np.ndarray, kind: int, where: str, dicts: Optional[Mapping[int, bytes]] = None) -> Any:
    """The state of a record (its rows, in order), checked to be of ``kind``."""
    return bytes_state(_decode_raw(rows, kind, where, dicts), where)


def _leaves_of(packed: Dict[str, Any], sum_packed: Dict[str, Any]) -> Dict[str, Any]:
    return sum_packed if packed.get("same_as_sum") else packed


def keys_of(runs: Any) -> np.ndarray:
    """:func:`runs_of` back."""
    r = np.asarray(runs, np.int64).reshape(2, -1)
    if not r.shape[1]:
        return np.empty(0, np.int64)
    lens = r[1]
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(r[0], lens) + offsets


def apply_delta(old: np.ndarray, drop: np.ndarray, add: np.ndarray) -> np.ndarray:
    return np.concatenate([old[~np.isin(old, drop)], add]).astype(np.int64)


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


META_FORMAT = "ray_ckpt.rllib.replay/1"  # the two-state form (multi-agent buffers are saved in it)


def _classes():
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import \
        MultiAgentPrioritizedEpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer
    return (EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,
            MultiAgentPrioritizedEpisodeReplayBuffer)


@dataclass(frozen=True)
class _Kind:
    multi_agent: bool
    prioritized: bool


def buffer_kind(buffer: Any) -> _Kind:
    """Which of the supported families ``buffer`` is; UnsupportedTypeError naming its type if none."""
    era, per, ma, maper = _classes()
    if isinstance(buffer, maper):
        return _Kind(True, True)
    if isinstance(buffer, ma):
        return _Kind(True, False)
    if isinstance(buffer, per):
        return _Kind(False, True)
    if isinstance(buffer, era):
        return _Kind(False, False)
    t = type(buffer)
    raise UnsupportedTypeError(
        f"replay buffer of type {t.__module__}.{t.__qualname__} is not supported by ray_ckpt: it saves "
        f"RLlib's new-API-stack EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, "
        f"MultiAgentEpisodeReplayBuffer and MultiAgentPrioritizedEpisodeReplayBuffer (and subclasses); "
        f"pass replay_strategy='off' to make_callback to train without saving it")


def _like(template: Any, values: Dict[Any, Any]) -> Any:
    """``values`` as the same kind of mapping as ``template`` (a defaultdict keeps its factory)."""
    if isinstance(template, collections.defaultdict):
        return collections.defaultdict(template.default_factory, values)
    return dict(values)


LAYOUT = "rllib_episode_rows/1"


@dataclass
class _Field:
    """One InfiniteLookbackBuffer of one (agent) episode, split into its timesteps and the rest."""

    name: str                      # "observations", "actions", "rewards", "extra_model_outputs/<key>"
    lookback: int
    finalized: bool
    space: int                     # code in the spaces table, -1: None
    list_kind: int                 # 0: numpy data; 1: a list of Python scalars; 2: a list of numpy items
    data_len: int
    template: Any = None           # the data's structure with column names as leaves (None: empty)
    body: Dict[str, np.ndarray] = field(default_factory=dict)   # column -> (n, ...) the timesteps
    edge: Dict[str, np.ndarray] = field(default_factory=dict)   # column -> head (lookback) + tail


@dataclass
class _EpisodeParts:
    """One (agent) episode: its scalars and its fields."""

    key: Tuple[int, int]            # (episode index, agent code; -1 single-agent)
    n: int
    done: bool
    scalars: Dict[str, Any]
    fields: List[_Field]
    emo_keys: List[str]
    infos: Dict[str, Any]


_EP_SCALARS = ("agent_id", "module_id", "multi_agent_episode_id")


_EP_NUMBERS = ("is_terminated", "is_truncated", "t_started", "t", "_start_time", "_last_step_time")


def _episode_table(parts: List[_EpisodeParts], field_meta: Dict[str, List[Tuple[int, _Field]]],
                   bname: str) -> Dict[str, Any]:
    """One entry per record, columnar."""
    E = len(parts)
    t: Dict[str, Any] = {"n": E,
                         "key": np.array([p.key for p in parts], np.int64).reshape(E, 2),
                         "len": np.array([p.n for p in parts], np.int64),
                         "id": [p.scalars["id_"] for p in parts]}
    for k in _EP_SCALARS:
        vals = [p.scalars[k] for p in parts]
        t[k] = vals if any(v is not None for v in vals) else None
    for k in _EP_NUMBERS:
        t[k] = pack_scalars([p.scalars[k] for p in parts], f"episode {k}")
    t["obs_space"] = np.array([p.scalars["obs_space"] for p in parts], np.int64)
    t["act_space"] = np.array([p.scalars["act_space"] for p in parts], np.int64)
    t["custom_data"] = [(r, to_storable(p.scalars["custom_data"], "replay_meta.custom_data"))
                        for r, p in enumerate(parts) if p.scalars["custom_data"]]
    keysets: Dict[Tuple[str, ...], int] = {}
    t["emo_keys"] = np.array([keysets.setdefault(tuple(p.emo_keys), len(keysets)) for p in parts], np.int64)
    t["emo_keysets"] = [list(k) for k in keysets]
    fields = {}
    for name, entries in field_meta.items():
        rec = np.array([r for r, _ in entries], np.int64)
        fs = [f for _, f in entries]
        edge_cols: Dict[str, List[np.ndarray]] = {}
        for f in fs:
            for col, arr in f.edge.items():
                edge_cols.setdefault(col, []).append(arr)
        fields[name] = {
            "rec": rec,
            "lookback": np.array([f.lookback for f in fs], np.int64),
            "finalized": np.array([f.finalized for f in fs], bool),
            "space": np.array([f.space for f in fs], np.int64),
            "list_kind": np.array([f.list_kind for f in fs], np.int8),
            "data_len": np.array([f.data_len for f in fs], np.int64),
            "edge": {c: np.concatenate(v) for c, v in edge_cols.items()},
        }
    t["fields"] = fields
    infos = {"lookback": np.array([p.infos["lookback"] for p in parts], np.int64),
             "len": np.array([p.infos["len"] for p in parts], np.int64),
             "space": np.array([p.infos["space"] for p in parts], np.int64),
             "sparse": [(r, i, to_storable(x, "replay_meta.infos")) for r, p in enumerate(parts)
                        for i, x in p.infos["sparse"]]}
    t["infos"] = infos
    return t


def _field_meta(parts: List[_EpisodeParts]) -> Dict[str, List[Tuple[int, _Field]]]:
    fm: Dict[str, List[Tuple[int, _Field]]] = {}
    for r, p in enumerate(parts):
        for f in p.fields:
            fm.setdefault(f.name, []).append((r, f))
    return fm


def _table(parts: List[_EpisodeParts], bname: str) -> Dict[str, Any]:
    return _episode_table(parts, _field_meta(parts), bname)


def _parts_from_table(t: Dict[str, Any], templates: Dict[str, Any], done: bool) -> List[_EpisodeParts]:
    """The episodes of a stored table as parts (edges, no timestep bodies) for _episode_table."""
    E = int(t["n"])
    keys = np.asarray(t["key"], np.int64).reshape(E, 2)
    lens = np.asarray(t["len"], np.int64)
    nums = {k: unpack_scalars(t[k]) for k in _EP_NUMBERS}
    custom = {int(r): from_storable(v) for r, v in t["custom_data"]}
    sparse: Dict[int, List[Tuple[int, Any]]] = {}
    for r, i, x in t["infos"]["sparse"]:
        sparse.setdefault(int(r), []).append((int(i), from_storable(x)))
    keysets = [list(k) for k in t["emo_keysets"]]
    emo = np.asarray(t["emo_keys"], np.int64)
    fields: List[List[_Field]] = [[] for _ in range(E)]
    for name, f in t["fields"].items():
        rec = np.asarray(f["rec"], np.int64)
        dl = np.asarray(f["data_len"], np.int64)
        elen = np.where(dl > 0, dl - lens[rec], 0) if len(rec) else np.zeros(0, np.int64)
        off = np.concatenate([[0], np.cumsum(elen)])
        for i, r in enumerate(rec.tolist()):
            a, b = int(off[i]), int(off[i + 1])
            fields[r].append(_Field(name, int(f["lookback"][i]), bool(f["finalized"][i]), int(f["space"][i]),
                                      int(f["list_kind"][i]), int(dl[i]),
                                      templates.get(name) if dl[i] > 0 else None, {},
                                      {c: np.asarray(v)[a:b] for c, v in f["edge"].items()} if dl[i] > 0 else {}))
    infos = t["infos"]
    out = []
    for r in range(E):
        sc = {k: (t[k][r] if t[k] is not None else None) for k in _EP_SCALARS}
        sc.update({k: nums[k][r] for k in _EP_NUMBERS})
        sc["id_"] = t["id"][r]
        sc["obs_space"] = int(t["obs_space"][r])
        sc["act_space"] = int(t["act_space"][r])
        sc["custom_data"] = custom.get(r, {})
        out.append(_EpisodeParts((int(keys[r][0]), int(keys[r][1])), int(lens[r]), done, sc, fields[r],
                                   keysets[int(emo[r])],
                                   {"lookback": int(infos["lookback"][r]), "len": int(infos["len"][r]),
                                    "sparse": sparse.get(r, []), "space": int(infos["space"][r])}))
    return out


class _IndexList:
    """The cached keys of one RLlib index list (``_indices``, or one module's ``_module_to_indices``)
    as of the last save, with their row ids: only the keys added since are converted each save."""

    def __init__(self, width: int):
        self.keys = np.empty((0, width), np.int64)
        self.ids = np.empty(0, np.int64)


class RowIds:
    """Row ids of one buffer across saves (see the package docstring). Kept beside the buffer in a
    weak map (:func:`row_ids_of`); seeded by :func:`.two_state.restore_replay`."""

    def __init__(self) -> None:
        self.lists: Dict[Any, _IndexList] = {}
        self.next_id = 0
        self.agents: List[Any] = []        # agent id table (multi-agent); codes are positions
        self.modules: List[Any] = []
        self._agent_code: Dict[Any, int] = {}
        self._module_code: Dict[Any, int] = {}
        self.full_rewrites = 0
        self.spaces = Spaces()  # append-only table of the spaces met so far (codes stay valid)
        # (episode, agent) -> (episode object, its parts) of the last capture: a done episode never
        # changes (RLlib only concatenates to running ones), so its parts are reused, not re-split
        self.parts: Dict[Tuple[int, int], Tuple[Any, "_EpisodeParts"]] = {}
        self.restored_from: Optional[Tuple[str, int]] = None  # (run, version) restore_replay read
        self.checked_run: Optional[str] = None  # the run whose newest version these ids were checked against
        self.inc: Any = None  # single-agent buffers: the incremental_state.Incremental of the last capture
        self.floors: Optional[Dict[str, int]] = None  # where the replay_meta log's ids start anew

    def renumber(self, floor: int, floors: Optional[Dict[str, int]] = None) -> None:
        """Forget every row's id: the next capture gives all rows new ids, at or above ``floor`` (and
        writes the replay_meta log anew, its ids at or above ``floors``)."""
        self.lists.clear()
        self.next_id = max(self.next_id, int(floor))
        self.full_rewrites += 1
        inc = self.inc
        self.floors = {"chunk": max(int((floors or {}).get("chunk", 0)), inc.next_chunk if inc else 0)}
        self.inc = None

    def agent_code(self, aid: Any) -> int:
        return _code(self._agent_code, self.agents, aid)

    def module_code(self, mid: Any) -> int:
        return _code(self._module_code, self.modules, mid)

    def seed(self, agents: List[Any], modules: List[Any], next_id: int) -> None:
        for a in agents:
            self.agent_code(a)
        for m in modules:
            self.module_code(m)
        self.next_id = int(next_id)

    def update(self, name: Any, current: List[tuple], width: int, encode: Callable[[tuple], tuple],
               evicted: int) -> Tuple[np.ndarray, np.ndarray, Optional[int]]:
        """(keys (n, width), ids, known) of ``current``: where ``known`` is a number the ids are
        those of the first ``known`` keys (every later key is new), else (None) one per key, -1 for
        a new one."""
        lst = self.lists.setdefault(name, _IndexList(width))
        # the survivors as views (RLlib evicts oldest first), the new keys appended after them: no
        # copy of every key each save (.growth)
        sel = survivors(lst.keys[:, 0] >= evicted)
        s = count(sel)
        ends = lst.keys[positions(sel, np.array([0, s - 1]))] if s else None  # the first and last survivors
        ok = len(current) >= s and (s == 0 or (tuple(encode(current[0])) == tuple(ends[0])
                                               and tuple(encode(current[s - 1])) == tuple(ends[1])))
        if ok:
            tail = current[s:]
            new = np.array([encode(x) for x in tail], np.int64).reshape(len(tail), width)
            return kept(lst.keys, sel, new), lst.ids[sel], s
        # slow path: the list changed other than by RLlib's add (appends + evictions)
        allk = np.array([encode(x) for x in current], np.int64).reshape(len(current), width)
        known = {tuple(k): i for k, i in zip(lst.keys.tolist(), lst.ids.tolist())}
        got = np.array([known.get(tuple(k), -1) for k in allk.tolist()], np.int64)
        unknown = np.flatnonzero(got < 0)
        if len(unknown) and (unknown[0] != len(got) - len(unknown) or np.any(np.diff(got[got >= 0]) <= 0)):
            self.full_rewrites += 1
            log.warning("ray_ckpt: replay buffer index list %r was changed other than by appends and evictions: "
                        "all its %d rows get new row ids (this save rewrites them)", name, len(got))
            got[:] = -1
        return allk, got, None

    def commit(self, name: Any, keys: np.ndarray, ids: np.ndarray) -> None:
        lst = self.lists[name]
        lst.keys, lst.ids = keys, ids


_TRACKERS: "weakref.WeakKeyDictionary[Any, RowIds]" = weakref.WeakKeyDictionary()


def _code(codes: Dict[Any, int], order: List[Any], key: Any) -> int:
    """``key``'s small integer code, given in order of first use (``order[code] == key``)."""
    c = codes.get(key)
    if c is None:
        c = codes[key] = len(order)
        order.append(key)
    return c


MODULE_MAPS = ("_module_to_max_priority", "_module_to_sum_segment", "_module_to_min_segment",
               "_module_to_free_nodes", "_module_to_max_idx", "_module_to_tree_idx_to_sample_idx",
               "_module_to_last_sampled_indices")


def _restore_priority(buffer: Any, kind: _Kind, replay: Dict[str, Any], pr: Dict[str, Any], new: Dict[str, Any],
                      modules: List[Any], bname: str) -> None:
    from ray.rllib.execution.segment_tree import MinSegmentTree, SumSegmentTree
    cap = int(pr["tree_capacity"])
    if buffer._sum_segment.capacity != cap:
        raise RestoreError(f"{bname}: tree capacity {buffer._sum_segment.capacity} here, {cap} in the checkpoint")
    if kind.multi_agent:
        tidx = np.asarray(new_indices_tree(new["_indices"]), np.int64)
    else:
        tidx = np.asarray(replay["tree"], np.int64)
    s, m = SumSegmentTree(cap), MinSegmentTree(cap)
    rebuild_tree(s, tidx, pr["sum"])
    rebuild_tree(m, tidx, _leaves_of(pr["min"], pr["sum"]))
    new["_sum_segment"], new["_min_segment"] = s, m
    new["_tree_idx_to_sample_idx"] = {int(ti): i for i, ti in enumerate(tidx.tolist())}
    new["_free_nodes"] = free_nodes_from(pr["free_nodes"])
    new["_max_priority"] = unpack_one(pr["max_priority"])
    new["_max_idx"] = int(pr["max_idx"])
    new["_last_sampled_indices"] = list(pr["last_sampled"])
    if not kind.multi_agent:
        return
    s2t = np.asarray(pr["sample_idx_to_tree_idx"], np.int64)
    new["_sample_idx_to_tree_idx"] = dict(zip(s2t[0].tolist(), s2t[1].tolist()))
    maps = {k: _like(getattr(buffer, k), {}) for k in MODULE_MAPS}
    codes = np.asarray(replay["module"])
    trees = np.asarray(replay["tree"], np.int64)
    for mm in pr["modules"]:
        mid = modules[int(mm["module"])]
        rows = np.flatnonzero(codes == int(mm["module"]))
        t_m = trees[rows]
        if "sum" in mm:
            tr = SumSegmentTree(cap)
            rebuild_tree(tr, t_m, mm["sum"])
            maps["_module_to_sum_segment"][mid] = tr
        if "min" in mm:
            tr = SumSegmentTree(cap) if mm.get("min_is_sum_tree") else MinSegmentTree(cap)
            rebuild_tree(tr, t_m, _leaves_of(mm["min"], mm.get("sum", {})))
            maps["_module_to_min_segment"][mid] = tr
        if "free_nodes" in mm:
            maps["_module_to_free_nodes"][mid] = free_nodes_from(mm["free_nodes"])
        if "max_priority" in mm:
            maps["_module_to_max_priority"][mid] = unpack_one(mm["max_priority"])
        if "max_idx" in mm:
            maps["_module_to_max_idx"][mid] = int(mm["max_idx"])
        if "last_sampled" in mm:
            maps["_module_to_last_sampled_indices"][mid] = list(mm["last_sampled"])
        if mm.get("tree_map"):
            maps["_module_to_tree_idx_to_sample_idx"][mid] = {int(ti): i for i, ti in enumerate(t_m.tolist())}
    for k, order in pr["module_key_order"].items():  # each map in its saved key order
        maps[k] = _like(maps[k], {modules[c]: maps[k][modules[c]] for c in order})
    new.update(maps)


def new_indices_tree(indices: List[tuple]) -> List[int]:
    return [int(x[2]) for x in indices]


def _rebuild_records(replay: Dict[str, Any], table: Dict[str, Any], templates: Dict[str, Any], spaces: Spaces,
                     kind: _Kind, evicted: int, bname: str) -> Dict[Tuple[int, int], Any]:
    """(episode, agent code) -> rebuilt SingleAgentEpisode."""
    E = int(table["n"])
    keys = np.asarray(table["key"], np.int64).reshape(E, 2)
    lens = np.asarray(table["len"], np.int64)
    order, starts = _row_order(replay, keys, lens, kind, bname)
    sorted_cols = {c: np.asarray(v)[order] for c, v in replay.items()
                   if isinstance(v, np.ndarray) and c not in ("row_id", "episode", "t", "tree", "agent", "module")}
    rebuild = _Records(table, templates, spaces, lens, starts, sorted_cols)
    return {(int(keys[r][0]), int(keys[r][1])): rebuild.episode(r, tuple(keys[r])) for r in range(E)}


def _row_order(replay: Dict[str, Any], keys: np.ndarray, lens: np.ndarray, kind: _Kind,
               bname: str) -> Tuple[np.ndarray, np.ndarray]:
    """The rows sorted by (record, t), and where each record's rows start in that order; checks that
    every row belongs to a listed record and each record's rows are its timesteps 0..len-1."""
    E = len(lens)
    n_rows = len(replay["row_id"])
    if E:
        order_keys = keys[:, 0] * (1 << 20) + (keys[:, 1] + 1)
        if np.any(np.diff(order_keys) <= 0):
            rec_sorted = np.argsort(order_keys, kind="stable")
        else:
            rec_sorted = np.arange(E)
        agent = np.asarray(replay["agent"], np.int64) if kind.multi_agent else np.full(n_rows, -1, np.int64)
        row_keys = np.asarray(replay["episode"], np.int64) * (1 << 20) + (agent + 1)
        pos = np.searchsorted(order_keys[rec_sorted], row_keys)
        pos = np.clip(pos, 0, E - 1)
        row_rec = rec_sorted[pos]
        if n_rows and np.any(order_keys[row_rec] != row_keys):
            raise RestoreError(f"replay: rows refer to episodes replay_meta does not list ({bname})")
    else:
        row_rec = np.empty(0, np.int64)
        if n_rows:
            raise RestoreError(f"replay has {n_rows} rows but replay_meta lists no episodes")
    t = np.asarray(replay["t"], np.int64)
    order = np.lexsort((t, row_rec)) if n_rows else np.empty(0, np.int64)
    counts = np.bincount(row_rec, minlength=E) if E else np.zeros(0, np.int64)
    if np.any(counts != lens):
        raise RestoreError(f"replay: episode row counts {counts.tolist()[:5]} do not match replay_meta's "
                           f"lengths {lens.tolist()[:5]}")
    starts = np.concatenate([[0], np.cumsum(lens)]) if E else np.zeros(1, np.int64)
    if n_rows:
        expect_t = np.arange(n_rows) - np.repeat(starts[:-1], lens)
        if np.any(t[order] != expect_t):
            raise RestoreError("replay: an episode's rows are not its timesteps 0..len-1")
    return order, starts


class _Records:
    """The episode table read once (per field: record -> position and edge offsets; the numbers,
    custom data and sparse infos per record), then one SingleAgentEpisode per record."""

    def __init__(self, table: Dict[str, Any], templates: Dict[str, Any], spaces: Spaces, lens: np.ndarray,
                 starts: np.ndarray, sorted_cols: Dict[str, np.ndarray]):
        self.table, self.templates, self.spaces = table, templates, spaces
        self.lens, self.starts, self.sorted_cols = lens, starts, sorted_cols
        self.fields = table["fields"]
        self.fpos: Dict[str, Dict[int, int]] = {}
        self.eoff: Dict[str, np.ndarray] = {}
        for name, f in self.fields.items():
            rec = np.asarray(f["rec"], np.int64).tolist()
            self.fpos[name] = {r: i for i, r in enumerate(rec)}
            dl = np.asarray(f["data_len"], np.int64)
            ln = lens[np.asarray(f["rec"], np.int64)] if len(rec) else np.zeros(0, np.int64)
            edge_len = np.where(dl > 0, dl - ln, 0)
            self.eoff[name] = np.concatenate([[0], np.cumsum(edge_len)])
        self.nums = {k: unpack_scalars(table[k]) for k in _EP_NUMBERS}
        self.custom = {int(r): from_storable(v) for r, v in table["custom_data"]}
        self.infos = table["infos"]
        self.sparse_infos: Dict[int, List[Tuple[int, Any]]] = collections.defaultdict(list)
        for r, i, x in self.infos["sparse"]:
            self.sparse_infos[int(r)].append((int(i), from_storable(x)))
        self.keysets = table["emo_keysets"]
        self.emo_codes = np.asarray(table["emo_keys"], np.int64)

    def field_state(self, name: str, r: int, space_codes: Dict[str, int]) -> Dict[str, Any]:
        """One InfiniteLookbackBuffer's state: its edge's head (lookback), the record's rows, the rest
        of its edge (the last observation)."""
        f = self.fields[name]
        i = self.fpos[name][r]
        lookback = int(f["lookback"][i])
        dl = int(f["data_len"][i])
        lk = int(f["list_kind"][i])
        tmpl = self.templates.get(name)
        if dl == 0:
            data: Any = [] if lk else None
            if data is None:
                raise RestoreError(f"replay: empty numpy'ized {name}")
        else:
            a, b = int(self.eoff[name][i]), int(self.eoff[name][i + 1])
            n, s0 = int(self.lens[r]), int(self.starts[r])

            def leaf(col: str) -> np.ndarray:
                edge = np.asarray(f["edge"][col])[a:b]
                body = self.sorted_cols[col][s0:s0 + n]
                return np.concatenate([edge[:lookback], body, edge[lookback:]])
            data = dm_tree.map_structure(leaf, tmpl) if not isinstance(tmpl, str) else leaf(tmpl)
            if lk == 1:
                data = data.tolist()
            elif lk == 2:
                data = list(data)
        space_codes[name] = int(f["space"][i])
        return {"data": data, "lookback": lookback, "finalized": bool(f["finalized"][i]), "space": None}

    def episode(self, r: int, key: Tuple[int, int]) -> Any:
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode
        table, infos, spaces = self.table, self.infos, self.spaces
        space_codes: Dict[str, int] = {}  # spaces are set after from_state: one object per distinct space
        info_data: List[Any] = [{} for _ in range(int(infos["len"][r]))]
        for i, x in self.sparse_infos.get(r, ()):
            info_data[i] = x
        st = {
            "id_": table["id"][r],
            "agent_id": table["agent_id"][r] if table["agent_id"] is not None else None,
            "module_id": table["module_id"][r] if table["module_id"] is not None else None,
            "multi_agent_episode_id": (table["multi_agent_episode_id"][r]
                                       if table["multi_agent_episode_id"] is not None else None),
            "observations": self.field_state("observations", r, space_codes),
            "actions": self.field_state("actions", r, space_codes),
            "rewards": self.field_state("rewards", r, space_codes),
            "infos": {"data": info_data, "lookback": int(infos["lookback"][r]), "finalized": False, "space": None},
            "extra_model_outputs": {k: self.field_state(f"extra_model_outputs/{k}", r, space_codes)
                                    for k in self.keysets[int(self.emo_codes[r])]},
            "_observation_space": None,
            "_action_space": None,
            "custom_data": self.custom.get(r, {}),
        }
        for k in _EP_NUMBERS:
            st[k] = self.nums[k][r]
        try:
            ep = SingleAgentEpisode.from_state(st)
        except Exception as exc:
            raise RestoreError(f"replay: episode {key} could not be rebuilt: {type(exc).__name__}: "
                               f"{exc}") from None
        ep._observation_space = spaces.space(int(table["obs_space"][r]))
        ep._action_space = spaces.space(int(table["act_space"][r]))
        ep.infos.space = spaces.space(int(infos["space"][r]))
        for name, code in space_codes.items():
            if code >= 0:
                buf = (ep.extra_model_outputs[name.split("/", 1)[1]] if name.startswith("extra_model_outputs/")
                       else getattr(ep, name))
                buf.space = spaces.space(code)
        return ep


_SKIP = -1  # MultiAgentEpisode.SKIP_ENV_TS_TAG ("S") in env_t_to_agent_t


def _rebuild_ma_episode(st: Dict[str, Any], agent_eps: List[Tuple[Any, Any]], agents: List[Any], spaces: Spaces,
                        mapping_fn: Optional[Callable], cls: Any) -> Any:
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
    tmpl = cls()
    ep = cls(id_=st["id_"])
    if mapping_fn is not None:
        ep.agent_to_module_mapping_fn = mapping_fn
    ep._agent_to_module_mapping = {agents[a]: m for a, m in st["agent_to_module"]}
    ep.observation_space = space_tree_from_storable(st["observation_space"], spaces)
    ep.action_space = space_tree_from_storable(st["action_space"], spaces)
    if ep.observation_space is None:
        ep.observation_space = {}
    if ep.action_space is None:
        ep.action_space = {}
    ep.env_t_started = st["env_t_started"]
    ep.env_t = st["env_t"]
    ep.agent_t_started = _like(tmpl.agent_t_started, {agents[a]: v for a, v in st["agent_t_started"]})
    e2a = _like(tmpl.env_t_to_agent_t, {})
    for a, b in st["env_t_to_agent_t"]:
        buf = InfiniteLookbackBuffer()
        buf.data = ["S" if x == _SKIP else x for x in np.asarray(b["data"]).tolist()]
        buf.lookback = int(b["lookback"])
        buf.finalized = bool(b["finalized"])
        buf.space = spaces.space(int(b["space"]))
        e2a[agents[a]] = buf
    ep.env_t_to_agent_t = e2a
    ep._hanging_actions_end = _like(tmpl._hanging_actions_end,
                                    {agents[a]: from_storable(v) for a, v in st["hanging_actions_end"]})
    ep._hanging_extra_model_outputs_end = _like(tmpl._hanging_extra_model_outputs_end,
                                                {agents[a]: from_storable(v)
                                                 for a, v in st["hanging_extra_model_outputs_end"]})
    ep._hanging_rewards_end = _like(tmpl._hanging_rewards_end, {agents[a]: v for a, v in st["hanging_rewards_end"]})
    ep._hanging_rewards_begin = _like(tmpl._hanging_rewards_begin,
                                      {agents[a]: v for a, v in st["hanging_rewards_begin"]})
    ep.is_terminated = st["is_terminated"]
    ep.is_truncated = st["is_truncated"]
    ep.agent_episodes = {aid: sa for aid, sa in agent_eps}
    ep._start_time = st["start_time"]
    ep._last_step_time = st["last_step_time"]
    ep._len_lookback_buffers = st["len_lookback_buffers"]
    ep._custom_data = from_storable(st["custom_data"])
    try:
        ep.validate()
    except Exception as exc:
        raise RestoreError(f"replay: multi-agent episode {st['id_']} could not be rebuilt: {type(exc).__name__}: "
                           f"{exc}") from None
    return ep


META_FORMAT2 = "ray_ckpt.rllib.replay/2"  # four states; no longer read (its name is recognised)


META_FORMAT3 = "ray_ckpt.rllib.replay/3"  # records without a dictionary: read, no longer written


META_FORMAT4 = "ray_ckpt.rllib.replay/4"


META_FORMAT5 = "ray_ckpt.rllib.replay/5"  # multi-agent buffers: format /4's log with env-step records


LOG_FORMATS = (META_FORMAT3, META_FORMAT4, META_FORMAT5)


LOG_LAYOUT = "rllib_replay_log/1"


# the record kinds, as the first byte of a record's payload
EPISODES, PRIORITIES, META, STATIC, DICT, ENV, ORDER = 1, 2, 3, 4, 5, 6, 7


KINDS = ("float", "np:<f8", "np:<f4", "int", "np:<f2", "bool")  # a tree leaf's exact type, by code


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
    log: Dict[str, np.ndarray] = field(default_factory=dict)  # the log's live rows but the meta record
    batches: List[List[int]] = field(default_factory=list)  # [batch, highest episode index, first row, rows]
    next_chunk: int = 0
    next_batch: int = 0
    # prioritized
    leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # sv, sk, mv, mk per live row
    tree_to_row: Dict[int, np.ndarray] = field(default_factory=dict)  # per group: tree index -> row id, -1
    precs: List[List[int]] = field(default_factory=list)  # live priority records: [first row, rows, entries]
    static: List[int] = field(default_factory=list)  # the live static record: [first row, rows]
    static_raw: bytes = b""                           # its bytes before compression
    dicts: List[List[int]] = field(default_factory=list)  # live dictionary records [first row, rows], oldest first
    zdict: bytes = b""                                # the newest one's bytes: what records are compressed with
    refresh: bool = False                             # the next save writes a new dictionary
    dict_base: int = 0                                # the meta record's compressed bytes when it was written
    touched: List[Tuple[Any, List[int]]] = field(default_factory=list)  # (module id or None, tree indices)
    trees: Dict[int, Tuple[Any, ...]] = field(default_factory=dict)  # per group: (sum, min, their value lists)
    # multi-agent (format /5)
    ep_agents: Dict[int, List[int]] = field(default_factory=dict)   # episode index -> its agents' codes
    running_ma: Dict[int, Any] = field(default_factory=dict)        # running episode -> its own state
    env_keys: Optional[np.ndarray] = None                           # the live env-step index entries
    env_leaves: Dict[str, np.ndarray] = field(default_factory=dict)  # their env-tree leaves (sv, sk, mv, mk)
    env_recs: List[List[int]] = field(default_factory=list)  # live env-step records: [first row, rows, top episode]
    next_env: int = 0                                        # the next env-step entry's cache id
    s2t_keys: Optional[np.ndarray] = None  # _sample_idx_to_tree_idx's keys in order (prioritized)
    s2t_recs: List[List[int]] = field(default_factory=list)  # live key-order records: [first row, rows, runs]

    @property
    def log_entries(self) -> int:
        """Entries in the live priority records."""
        return sum(n for _, _, n in self.precs)

    def append(self, kind: int, state: Any) -> Tuple[int, int]:
        """Append a record to the log: (its first row id, its rows)."""
        return self.append_raw(kind, state_bytes(state))

    def append_raw(self, kind: int, raw: bytes) -> Tuple[int, int]:
        """Append a record (compressed with the newest dictionary; a dictionary record without one)."""
        blob = _encode(kind, raw, zdict=None if kind == DICT else (self.zdict or None))
        m = len(blob)
        first = self.next_chunk
        add = {"row_id": np.arange(first, first + m, dtype=np.int64), "blob": blob}
        self.log = {k: np.concatenate([self.log[k], add[k]]) for k in add}
        self.next_chunk += m
        return first, m

    def keep_rows(self, spans: List[Tuple[int, int]]) -> None:
        """Keep only the log rows inside the [first, first + rows) spans (the live records) and the
        dictionaries they were compressed with: a record's is the newest dictionary before it."""
        starts = [d[0] for d in self.dicts]
        used = {len(self.dicts) - 1}
        for first, _ in spans:
            i = int(np.searchsorted(starts, first)) - 1
            if i >= 0:
                used.add(i)
        self.dicts = [d for i, d in enumerate(self.dicts) if i in used]
        spans = list(spans) + [tuple(d) for d in self.dicts]
        ids = self.log["row_id"]
        alive = np.zeros(len(ids), bool)
        for first, m in spans:
            alive |= (ids >= first) & (ids < first + m)
        if not alive.all():
            self.log = {k: v[alive] for k, v in self.log.items()}


def unpack_ids(table: Dict[str, Any]) -> Dict[str, Any]:
    if "id_hex" not in table:
        return table
    out = {k: v for k, v in table.items() if k != "id_hex"}
    out["id"] = [bytes(r).hex() for r in np.asarray(table["id_hex"], np.uint8).reshape(-1, 16)]
    return out


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


def unpack_entries(e: Dict[str, Any]) -> Dict[str, np.ndarray]:
    return {"row": np.cumsum(np.asarray(e["row"], np.int64)), "which": np.asarray(e["which"], np.int8),
            "v": np.asarray(e["v"]).astype(np.float64), "k": np.asarray(e["k"], np.int8)}


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
    static_raw = state_bytes(static)  # what the next capture compares its own with (equal: no new record)
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
    rid.spaces = Spaces(meta["spaces"])
    rid.inc = inc
    return inc


_LOG_ONLY = ("running", "running_ma", "episode_log", "env_log", "static", "dicts")


def log_to_v1(states: Dict[str, Any], *, seed: bool = True):
    """:func:`ma_states_to_v1` for a multi-agent log (format /5), else
    :func:`.incremental_restore.states_to_v1`."""
    meta = states[REPLAY_META]
    if isinstance(meta, dict) and from_storable(meta).get("format") == META_FORMAT5:
        return ma_states_to_v1(states, seed=seed)
    return states_to_v1(states, seed=seed)


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


def restore_replay(buffer: Any, replay: Dict[str, Any], meta: Dict[str, Any], *,
                   agent_to_module_mapping_fn: Optional[Callable] = None) -> None:
    """Set ``buffer`` (a fresh buffer of the same type and capacity, e.g. the one a new Algorithm built
    from the same config made) to the saved state: episodes, indices, counters, priorities and trees,
    the sampling generator, metrics. Raises RestoreError naming what does not fit (nothing is changed
    then: the new state is built completely before it is assigned)."""
    kind = buffer_kind(buffer)
    meta = from_storable(meta)
    bname = type_name(buffer)
    ids = _checked_ids(buffer, replay, meta, bname)
    spaces = Spaces(meta["spaces"])
    agents = list(meta["rows"]["agent_ids"])
    modules = list(meta["rows"]["module_ids"])
    evicted = int(meta["counters"]["_num_episodes_evicted"])
    table = meta["episodes"]
    records = _rebuild_records(replay, table, meta["rows"]["templates"], spaces, kind, evicted, bname)
    new: Dict[str, Any] = {}
    if kind.multi_agent:
        from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
        fn = agent_to_module_mapping_fn
        eps = []
        for i, st in enumerate(meta["ma_episodes"]):
            e = evicted + i
            agent_eps = [(agents[a], records[(e, a)]) for a in st["agents"]]
            eps.append(_rebuild_ma_episode(st, agent_eps, agents, spaces, fn, MultiAgentEpisode))
    else:
        eps = [records[(evicted + i, -1)] for i in range(int(table["n"]))]
    new["episodes"] = collections.deque(eps)
    new["episode_id_to_index"] = {ep.id_: evicted + i for i, ep in enumerate(eps)}
    for k, v in meta["counters"].items():
        new[k] = v
    new.update(_index_lists(buffer, kind, replay, meta, agents, modules))
    for k, items in meta.get("module_counters", {}).items():
        new[k] = _like(getattr(buffer, k), dict(items))
    if kind.prioritized:
        _restore_priority(buffer, kind, replay, meta["priority"], new, modules, bname)
    # build everything first, then assign
    for k, v in meta.get("extra_attrs", {}).items():
        new[k] = from_storable(v)
    for k in ("batch_size_B", "batch_length_T", "_metrics_num_episodes_for_smoothing"):
        if k in meta["config"]:
            new[k] = meta["config"][k]
    rng_state = dict(meta["rng"])
    metrics = meta.get("metrics")
    for k, v in new.items():
        setattr(buffer, k, v)
    buffer.rng.bit_generator.state = rng_state
    if metrics is not None:
        buffer.metrics.set_state(from_storable(metrics))
    _TRACKERS[buffer] = _seeded_row_ids(kind, replay, meta, ids, agents, modules)


def _checked_ids(buffer: Any, replay: Dict[str, Any], meta: Dict[str, Any], bname: str) -> np.ndarray:
    """The rows' ids, once the saved state is known to fit ``buffer`` (RestoreError naming what not)."""
    if meta.get("format") != META_FORMAT:
        raise RestoreError(f"replay_meta has format {meta.get('format')!r}, expected {META_FORMAT!r}")
    if meta["buffer_type"] != bname:
        raise RestoreError(f"the saved replay buffer is a {meta['buffer_type']}, this algorithm's is a {bname}: "
                           f"build the algorithm from the config the checkpoint was made with")
    if replay.get("layout") != LAYOUT:
        raise RestoreError(f"replay has layout {replay.get('layout')!r}, expected {LAYOUT!r}")
    for k in ("capacity", "_alpha"):
        if k in meta["config"] and getattr(buffer, k, None) != meta["config"][k]:
            raise RestoreError(f"replay buffer {k} is {getattr(buffer, k, None)!r} here but "
                               f"{meta['config'][k]!r} in the checkpoint: build the algorithm with the saved "
                               f"replay_buffer_config")
    n_rows = int(meta["rows"]["n_rows"])
    ids = np.asarray(replay["row_id"], np.int64)
    if len(ids) != n_rows or (n_rows > 1 and np.any(np.diff(ids) <= 0)):
        raise RestoreError(f"replay has {len(ids)} rows (meta says {n_rows}) or row ids that do not increase")
    return ids


def _index_lists(buffer: Any, kind: _Kind, replay: Dict[str, Any], meta: Dict[str, Any], agents: List[Any],
                 modules: List[Any]) -> Dict[str, Any]:
    """RLlib's index lists from the rows: ``_indices`` (multi-agent: the env steps kept in the meta)
    and, multi-agent, each module's ``_module_to_indices`` in the saved module order."""
    n_rows = int(meta["rows"]["n_rows"])
    if not kind.multi_agent:
        cols = [replay["episode"], replay["t"]] + ([replay["tree"]] if kind.prioritized else [])
        return {"_indices": [tuple(r) for r in np.stack([np.asarray(c, np.int64) for c in cols], 1).tolist()]
                if n_rows else []}
    env = np.asarray(meta["rows"]["env_indices"], np.int64)
    mti = collections.defaultdict(list)  # type of RLlib's: a defaultdict(list)
    cols = [replay["episode"], replay["agent"], replay["t"]] + ([replay["tree"]] if kind.prioritized else [])
    mcodes = np.asarray(replay["module"])
    for mc in meta["rows"]["module_order"]:
        rows = np.flatnonzero(mcodes == mc)
        mti[modules[mc]] = [(int(r[0]), agents[int(r[1])], *map(int, r[2:]))
                            for r in np.stack([np.asarray(c)[rows] for c in cols], 1).tolist()]
    return {"_indices": [tuple(r) for r in env.tolist()],
            "_module_to_indices": _like(buffer._module_to_indices, mti)}


def _seeded_row_ids(kind: _Kind, replay: Dict[str, Any], meta: Dict[str, Any], ids: np.ndarray,
                    agents: List[Any], modules: List[Any]) -> RowIds:
    """The row-id cache as if the restored buffer had made the saved capture: its next save keeps
    the ids of the rows that survive and appends."""
    n_rows = len(ids)
    rid = RowIds()
    rid.seed(agents, modules, int(meta["rows"]["next_row_id"]))
    if kind.multi_agent:
        keys = [np.asarray(replay[c], np.int64) for c in ("episode", "agent", "t", "module")]
        if kind.prioritized:
            keys.append(np.asarray(replay["tree"], np.int64))
        k = np.stack(keys, 1) if n_rows else np.empty((0, len(keys)), np.int64)
        for mc in meta["rows"]["module_order"]:
            sel = k[:, 3] == mc
            lst = rid.lists.setdefault(("module", mc), _IndexList(k.shape[1]))
            lst.keys, lst.ids = k[sel], ids[sel]
    else:
        cols = [np.asarray(replay[c], np.int64) for c in ("episode", "t")]
        if kind.prioritized:
            cols.append(np.asarray(replay["tree"], np.int64))
        lst = rid.lists.setdefault("_indices", _IndexList(len(cols)))
        lst.keys = np.stack(cols, 1) if n_rows else np.empty((0, len(cols)), np.int64)
        lst.ids = ids.copy()
    return rid
