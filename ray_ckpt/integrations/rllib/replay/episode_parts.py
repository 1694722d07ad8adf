"""Episodes <-> parts: an (agent) episode split into its timesteps (the Arrow rows' columns) and the
rest (lookback head, last observation, infos, scalars), and the columnar episode table of
``replay_meta`` built from parts and read back into parts.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import numpy as np
import tree as dm_tree

from ....errors import UnsupportedTypeError
from ..base.conversion import from_storable, to_storable
from .values import _Spaces, pack_scalars, unpack_scalars


LAYOUT = "rllib_episode_rows/1"
_COL = {"observations": "obs", "actions": "action", "rewards": "reward"}
_FIELDS = ("observations", "actions", "rewards")
_EXTRA = "extra/"


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


def _col_name(prefix: str, path: Tuple[Any, ...]) -> str:
    return prefix + "".join(f"/{p}" for p in path)


def _split_field(name: str, prefix: str, buf: Any, n: int, spaces: _Spaces, where: str) -> _Field:
    data, lookback = buf.data, int(buf.lookback)
    list_kind = 0
    if isinstance(data, list):
        if not data:
            if n:
                raise UnsupportedTypeError(f"replay buffer: {where} {name}: no data for {n} timesteps")
            return _Field(name, lookback, bool(buf.finalized), spaces.code(buf.space), 1, 0)
        types = {type(x) for x in data}
        if len(types) == 1 and next(iter(types)) in (int, float, bool):
            list_kind = 1
        elif all(isinstance(x, (np.ndarray, np.generic)) for x in data):
            list_kind = 2
        else:
            raise UnsupportedTypeError(
                f"replay buffer: {where} {name}: not numpy'ized data holding {sorted(t.__name__ for t in types)} "
                f"(ray_ckpt stores episodes whose data is numpy, or lists of numbers/arrays)")
        data = np.asarray(data)
        if data.dtype.hasobject:
            raise UnsupportedTypeError(f"replay buffer: {where} {name}: ragged or object data")
    total = None
    template_leaves = []
    body, edge = {}, {}
    # a plain array (most fields) is its own one leaf: no dm_tree walk (~50 episodes split per save)
    leaves = [((), data)] if type(data) is np.ndarray else dm_tree.flatten_with_path(data)
    for path, leaf in leaves:
        if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject or leaf.dtype.kind not in "biuf":
            raise UnsupportedTypeError(
                f"replay buffer: {where} {name}{''.join(f'[{p!r}]' for p in path)}: a "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)} leaf (stored: bool/int/float arrays)")
        if total is None:
            total = leaf.shape[0]
        if leaf.shape[0] != total or total < lookback + n:
            raise UnsupportedTypeError(f"replay buffer: {where} {name}: {total} items for lookback {lookback} + "
                                       f"{n} timesteps")
        col = _col_name(prefix, tuple(path))
        template_leaves.append(col)
        body[col] = leaf[lookback:lookback + n]
        edge[col] = leaf[:lookback] if total == lookback + n else np.concatenate([leaf[:lookback],
                                                                                  leaf[lookback + n:]])
    template = dm_tree.unflatten_as(data, template_leaves) if not isinstance(data, np.ndarray) else template_leaves[0]
    return _Field(name, lookback, bool(buf.finalized), spaces.code(buf.space), list_kind, int(total or 0),
                  template, body, edge)


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


def _split_episode(ep: Any, key: Tuple[int, int], spaces: _Spaces, where: str) -> _EpisodeParts:
    n = len(ep)
    if n != ep.t - ep.t_started:
        raise UnsupportedTypeError(f"replay buffer: {where}: len {n} != t - t_started")
    fields = [_split_field(f, _COL[f], getattr(ep, f), n, spaces, where) for f in _FIELDS]
    emo = ep.extra_model_outputs
    keys = list(emo.keys())
    for k in keys:
        if not isinstance(k, str):
            raise UnsupportedTypeError(f"replay buffer: {where}: extra_model_outputs key {k!r} is not a str")
        fields.append(_split_field(f"extra_model_outputs/{k}", _EXTRA + k, emo[k], n, spaces, where))
    infos = ep.infos
    if infos.finalized or not isinstance(infos.data, list):
        raise UnsupportedTypeError(f"replay buffer: {where}: numpy'ized infos")
    sparse = [(i, x) for i, x in enumerate(infos.data) if not (type(x) is dict and not x)]
    scalars = {k: getattr(ep, k) for k in _EP_SCALARS}
    scalars.update({k: getattr(ep, k) for k in _EP_NUMBERS})
    scalars["id_"] = ep.id_
    scalars["obs_space"] = spaces.code(ep._observation_space)
    scalars["act_space"] = spaces.code(ep._action_space)
    scalars["custom_data"] = ep._custom_data
    return _EpisodeParts(key, n, bool(ep.is_done), scalars, fields, keys,
                         {"lookback": int(infos.lookback), "len": len(infos.data), "sparse": sparse,
                          "space": spaces.code(infos.space)})


def _int32(a: np.ndarray, what: str) -> np.ndarray:
    """An index column as int32 (8 bytes less per row than RLlib's Python ints as int64)."""
    if len(a) and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise UnsupportedTypeError(f"replay buffer: column {what!r} holds values beyond int32")
    return a.astype(np.int32)


def _columns(parts: List[_EpisodeParts], bname: str):
    """Per column: the body pieces of all records (record order; records lacking the column give
    zeros... which cannot happen within one buffer: a field missing from some episodes is refused)."""
    columns: Dict[str, List[np.ndarray]] = {}
    sig: Dict[str, Tuple[Any, Tuple[int, ...]]] = {}
    templates: Dict[str, Any] = {}
    field_meta: Dict[str, List[_Field]] = collections.defaultdict(list)
    for r, p in enumerate(parts):
        for f in p.fields:
            field_meta[f.name].append((r, f))
            if f.template is None:
                continue
            old = templates.setdefault(f.name, f.template)
            if old != f.template:
                raise UnsupportedTypeError(f"replay buffer {bname}: {f.name} of episode {p.key} has the structure "
                                           f"{f.template!r}, other episodes {old!r}")
            for col, arr in f.body.items():
                s = (arr.dtype, arr.shape[1:])
                first = sig.setdefault(col, s)
                if first != s:
                    raise UnsupportedTypeError(
                        f"replay buffer {bname}: column {col!r} of episode {p.key} is {s[0]}{list(s[1])}, other "
                        f"episodes' {first[0]}{list(first[1])} (agents with different spaces in one buffer are not "
                        f"supported yet)")
                columns.setdefault(col, []).append(arr)
    # every record must contribute to every column it has timesteps for
    for col, pieces in columns.items():
        n = sum(len(x) for x in pieces)
        total = sum(p.n for p in parts if any(col in f.body for f in p.fields))
        if n != total or total != sum(p.n for p in parts):
            raise UnsupportedTypeError(f"replay buffer {bname}: column {col!r} is missing from some episodes "
                                       f"(extra_model_outputs keys differ between episodes)")
    return columns, templates, field_meta


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
