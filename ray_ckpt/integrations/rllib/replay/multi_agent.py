"""Multi-agent buffers (``MultiAgentEpisodeReplayBuffer`` and its prioritized subclass) in the
two-state form: rows are agent timesteps from every module's ``_module_to_indices``; each
``MultiAgentEpisode``'s own state (agents, mappings, hanging values, env-to-agent step maps) is meta.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ....errors import RestoreError, UnsupportedTypeError
from ..base.conversion import from_storable, to_storable
from .buffers import (META_FORMAT, _MA_MODULE_COUNTERS, _attributes, _Kind, _like, common_meta, extra_attrs,
                      handled_attrs)
from .episode_parts import LAYOUT, _columns, _episode_table, _EpisodeParts, _int32, _split_episode
from .priorities import _priority_state
from .row_ids import RowIds, _update_ids
from .values import _scalar_state, _type_name, _space_tree_from_storable, _space_tree_to_storable, _Spaces


_SKIP = -1  # MultiAgentEpisode.SKIP_ENV_TS_TAG ("S") in env_t_to_agent_t


def _ma_rows(buffer: Any, rid: RowIds, evicted: int, kind: _Kind):
    """Multi-agent rows: every module's ``_module_to_indices`` entries (agent timesteps), keyed
    (episode, agent code, t, module code[, tree]) and ordered by row id."""
    lists = []
    for mid, lst in buffer._module_to_indices.items():
        mc = rid.module_code(mid)
        if kind.prioritized:
            enc = (lambda x, mc=mc: (x[0], rid.agent_code(x[1]), x[2], mc, x[3]))
        else:
            enc = (lambda x, mc=mc: (x[0], rid.agent_code(x[1]), x[2], mc))
        lists.append((("module", mc), lst, 5 if kind.prioritized else 4, enc))
    keys, ids = _update_ids(rid, buffer, lists, evicted, int(buffer._num_agent_timesteps_added))
    if len(ids) == 0:
        keys = np.empty((0, 5 if kind.prioritized else 4), np.int64)
    order = np.argsort(ids, kind="stable")
    return keys[order], ids[order]


def module_order(buffer: Any, rid: RowIds) -> List[int]:
    """The modules' codes in ``_module_to_indices``'s key order (restored in it)."""
    return [rid.module_code(m) for m in buffer._module_to_indices]


def module_counters(attrs: Dict[str, Any]) -> Dict[str, Any]:
    """The per-module counters, each as (module id, exact value) pairs in the map's order."""
    return {k: [(m, _scalar_state(v, k)) for m, v in attrs[k].items()] for k in _MA_MODULE_COUNTERS if k in attrs}


def _ma_episode_state(ep: Any, rid: RowIds, spaces: _Spaces, where: str) -> Dict[str, Any]:
    """What a MultiAgentEpisode holds beside its agent episodes."""
    e2a = {}
    for aid, buf in ep.env_t_to_agent_t.items():
        data = buf.data
        if isinstance(data, list):
            arr = np.array([_SKIP if x == "S" else x for x in data], np.int64)
        else:
            raise UnsupportedTypeError(f"replay buffer: {where}: numpy'ized env_t_to_agent_t")
        steps = np.array([x != "S" for x in data], bool).reshape(len(data))
        if any(type(x) is not int and x != "S" for x in data) or np.any(arr[steps] < 0):
            raise UnsupportedTypeError(f"replay buffer: {where}: env_t_to_agent_t of {aid!r} holds other values")
        e2a_entry = {"data": arr, "lookback": int(buf.lookback), "finalized": bool(buf.finalized),
                     "space": spaces.code(buf.space)}
        e2a[rid.agent_code(aid)] = e2a_entry
    st = {
        "id_": ep.id_,
        "agents": [rid.agent_code(a) for a in ep.agent_episodes],
        "agent_to_module": [(rid.agent_code(a), m) for a, m in ep._agent_to_module_mapping.items()],
        "observation_space": _space_tree_to_storable(ep.observation_space, spaces),
        "action_space": _space_tree_to_storable(ep.action_space, spaces),
        "env_t_started": ep.env_t_started, "env_t": ep.env_t,
        "agent_t_started": [(rid.agent_code(a), v) for a, v in ep.agent_t_started.items()],
        "env_t_to_agent_t": [(c, v) for c, v in e2a.items()],
        "hanging_actions_end": [(rid.agent_code(a), to_storable(v, "hanging action"))
                                for a, v in ep._hanging_actions_end.items()],
        "hanging_extra_model_outputs_end": [(rid.agent_code(a), to_storable(v, "hanging extra model outputs"))
                                            for a, v in ep._hanging_extra_model_outputs_end.items()],
        "hanging_rewards_end": [(rid.agent_code(a), v) for a, v in ep._hanging_rewards_end.items()],
        "hanging_rewards_begin": [(rid.agent_code(a), v) for a, v in ep._hanging_rewards_begin.items()],
        "is_terminated": ep.is_terminated, "is_truncated": ep.is_truncated,
        "start_time": ep._start_time, "last_step_time": ep._last_step_time,
        "len_lookback_buffers": getattr(ep, "_len_lookback_buffers", None),
        "custom_data": to_storable(ep._custom_data, "replay_meta.custom_data"),
    }
    for k in ("hanging_rewards_end", "hanging_rewards_begin"):
        st[k] = [(a, _scalar_state(v, k)) for a, v in st[k]]
    for k in ("env_t_started", "env_t", "is_terminated", "is_truncated", "start_time", "last_step_time"):
        st[k] = _scalar_state(st[k], k)
    st["agent_t_started"] = [(a, _scalar_state(v, "agent_t_started")) for a, v in st["agent_t_started"]]
    return st


def _rebuild_ma_episode(st: Dict[str, Any], agent_eps: List[Tuple[Any, Any]], agents: List[Any], spaces: _Spaces,
                        mapping_fn: Optional[Callable], cls: Any) -> Any:
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
    tmpl = cls()
    ep = cls(id_=st["id_"])
    if mapping_fn is not None:
        ep.agent_to_module_mapping_fn = mapping_fn
    ep._agent_to_module_mapping = {agents[a]: m for a, m in st["agent_to_module"]}
    ep.observation_space = _space_tree_from_storable(st["observation_space"], spaces)
    ep.action_space = _space_tree_from_storable(st["action_space"], spaces)
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


def capture_multi_agent(buffer: Any, kind: _Kind, rid: RowIds) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(replay, replay_meta)`` of a multi-agent buffer (:func:`.two_state.capture_replay`)."""
    attrs = _attributes(buffer)
    bname = _type_name(buffer)
    evicted = int(buffer._num_episodes_evicted)
    meta = common_meta(buffer, attrs, bname, META_FORMAT)
    parts, ma_eps, now = _split_episodes(buffer, rid, evicted, bname)
    keys, ids = _ma_rows(buffer, rid, evicted, kind)
    replay, templates, field_meta = _rows(parts, keys, ids, kind, bname)
    # the env-step level index list is meta (its entries are env steps, not agent timesteps)
    env = np.array(buffer._indices, np.int64).reshape(len(buffer._indices), 3 if kind.prioritized else 2)
    meta["rows"] = {"next_row_id": int(rid.next_id), "n_rows": int(len(ids)), "agent_ids": list(rid.agents),
                    "module_ids": list(rid.modules), "templates": templates, "env_indices": env,
                    "module_order": module_order(buffer, rid)}
    meta["episodes"] = _episode_table(parts, field_meta, bname)
    meta["spaces"] = rid.spaces.table
    meta["ma_episodes"] = ma_eps
    if kind.prioritized:
        meta["priority"] = _priority_state(buffer, kind, replay, rid, bname)
    meta["module_counters"] = module_counters(attrs)
    meta["extra_attrs"] = extra_attrs(attrs, handled_attrs(kind), bname)
    rid.parts = now
    rid.spaces.prune()
    return replay, meta


def _split_episodes(buffer: Any, rid: RowIds, evicted: int, bname: str):
    """Every (agent) episode as parts, in record order, with each MultiAgentEpisode's own state; a
    done episode's parts of the previous capture are reused (a done episode never changes)."""
    spaces = rid.spaces
    cached: Dict[Tuple[int, int], Tuple[Any, _EpisodeParts]] = rid.parts
    now: Dict[Tuple[int, int], Tuple[Any, _EpisodeParts]] = {}

    def split(ep: Any, key: Tuple[int, int], done: bool, where: str) -> _EpisodeParts:
        hit = cached.get(key)
        parts = hit[1] if hit is not None and hit[0] is ep and hit[1].done and done else \
            _split_episode(ep, key, spaces, where)
        now[key] = (ep, parts)
        return parts

    episodes = list(buffer.episodes)
    for i, ep in enumerate(episodes):
        if buffer.episode_id_to_index.get(ep.id_) != evicted + i:
            raise UnsupportedTypeError(f"{bname}: episode_id_to_index[{ep.id_!r}] is "
                                       f"{buffer.episode_id_to_index.get(ep.id_)}, expected {evicted + i}")
    if len(buffer.episode_id_to_index) != len(episodes):
        raise UnsupportedTypeError(f"{bname}: episode_id_to_index has {len(buffer.episode_id_to_index)} entries "
                                   f"for {len(episodes)} episodes")
    parts: List[_EpisodeParts] = []
    ma_eps: List[Dict[str, Any]] = []
    for i, ep in enumerate(episodes):
        e = evicted + i
        ma_eps.append(_ma_episode_state(ep, rid, spaces, f"{bname} episode {e}"))
        for aid, sa in ep.agent_episodes.items():
            parts.append(split(sa, (e, rid.agent_code(aid)), bool(ep.is_done),
                               f"{bname} episode {e} agent {aid!r}"))
    return parts, ma_eps, now


def _rows(parts: List[_EpisodeParts], keys: np.ndarray, ids: np.ndarray, kind: _Kind,
          bname: str) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """The ``replay`` rows, each row's timestep gathered from its agent episode's body; with the
    fields' templates and per-field records that the meta's rows and episode table are built from."""
    n_rows = len(ids)
    rec_of = {p.key: r for r, p in enumerate(parts)}
    row_rec = np.array([rec_of.get((int(e), int(a)), -1) for e, a in zip(keys[:, 0], keys[:, 1])], np.int64) \
        if n_rows else np.empty(0, np.int64)
    row_t = keys[:, 2] if n_rows else np.empty(0, np.int64)
    if n_rows and (np.any(row_rec < 0) or np.any(row_rec >= len(parts))):
        raise UnsupportedTypeError(f"{bname}: an index refers to an episode the buffer does not hold")
    lens = np.array([p.n for p in parts], np.int64)
    if n_rows and np.any(row_t >= lens[row_rec]):
        raise UnsupportedTypeError(f"{bname}: an index refers to a timestep beyond its episode's end")
    counts = np.bincount(row_rec, minlength=len(parts)) if len(parts) else np.zeros(0, np.int64)
    if np.any(counts != lens):
        bad = int(np.flatnonzero(counts != lens)[0])
        raise UnsupportedTypeError(f"{bname}: episode {parts[bad].key} has {lens[bad]} timesteps but "
                                   f"{counts[bad]} index entries: its timesteps cannot be stored as rows")
    offsets = np.concatenate([[0], np.cumsum(lens)])[:-1] if len(parts) else np.zeros(0, np.int64)
    gather = offsets[row_rec] + row_t if n_rows else np.empty(0, np.int64)
    replay: Dict[str, Any] = {"row_id": ids, "episode": keys[:, 0].copy()}
    replay["agent"] = _int32(keys[:, 1], "agent")
    replay["t"] = _int32(keys[:, 2], "t")
    replay["module"] = _int32(keys[:, 3], "module")
    if kind.prioritized:
        replay["tree"] = _int32(keys[:, 4], "tree")
    columns, templates, field_meta = _columns(parts, bname)
    for col, pieces in columns.items():
        if n_rows:
            replay[col] = np.concatenate(pieces)[gather] if len(pieces) > 1 else pieces[0][gather]
        else:
            replay[col] = np.concatenate(pieces) if pieces else np.empty(0)
    replay["layout"] = LAYOUT
    return replay, templates, field_meta
