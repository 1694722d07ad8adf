"""Rows + episode table -> ``SingleAgentEpisode`` objects (the restore side of :mod:`.episode_parts`):
each episode's data is its edge (lookback head, then the last observation) around its rows' bodies.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Tuple

import numpy as np
import tree as dm_tree

from ....errors import RestoreError
from ..base.conversion import from_storable
from .buffers import _Kind
from .episode_parts import _EP_NUMBERS
from .values import _Spaces, unpack_scalars


def _rebuild_records(replay: Dict[str, Any], table: Dict[str, Any], templates: Dict[str, Any], spaces: _Spaces,
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

    def __init__(self, table: Dict[str, Any], templates: Dict[str, Any], spaces: _Spaces, lens: np.ndarray,
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
