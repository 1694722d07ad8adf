"""Any supported buffer <-> the two-state form ``(replay, replay_meta)`` of format /1 (the package
docstring describes it): buffers are saved as logs (:mod:`.incremental_capture`,
:mod:`.incremental_multi_agent`) and turned back into it to be restored.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ....errors import RestoreError
from ..base.conversion import from_storable
from .buffers import META_FORMAT, _Kind, _like, buffer_kind
from .episode_parts import LAYOUT
from .episode_rebuild import _rebuild_records
from .incremental_capture import capture_states
from .incremental_ma_restore import log_to_v1
from .incremental_multi_agent import capture_ma_states
from .multi_agent import _rebuild_ma_episode
from .priorities import _restore_priority
from .row_ids import RowIds, _IndexList, _TRACKERS, row_ids_of
from .values import _Spaces, _type_name


def capture_replay(buffer: Any, *, row_ids: Optional[RowIds] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(replay, replay_meta)`` of ``buffer`` (see the package docstring). The buffer is not changed;
    its caches (:func:`.row_ids.row_ids_of`) are advanced: it is captured as a save captures it, then
    turned into this form. Raises UnsupportedTypeError naming the
    buffer type and the attribute or episode field it cannot store."""
    rid = row_ids if row_ids is not None else row_ids_of(buffer)
    return log_to_v1(capture_log_states(buffer, rid), seed=False)[:2]


def capture_log_states(buffer: Any, rid: RowIds) -> Dict[str, Any]:
    """The two states of ``buffer`` as saved (format /4 single-agent, /5 multi-agent); advances its caches."""
    if buffer_kind(buffer).multi_agent:
        return capture_ma_states(buffer, rid)
    return capture_states(buffer, rid)


def restore_replay(buffer: Any, replay: Dict[str, Any], meta: Dict[str, Any], *,
                   agent_to_module_mapping_fn: Optional[Callable] = None) -> None:
    """Set ``buffer`` (a fresh buffer of the same type and capacity, e.g. the one a new Algorithm built
    from the same config made) to the saved state: episodes, indices, counters, priorities and trees,
    the sampling generator, metrics. Raises RestoreError naming what does not fit (nothing is changed
    then: the new state is built completely before it is assigned)."""
    kind = buffer_kind(buffer)
    meta = from_storable(meta)
    bname = _type_name(buffer)
    ids = _checked_ids(buffer, replay, meta, bname)
    spaces = _Spaces(meta["spaces"])
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
