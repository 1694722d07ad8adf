"""The priority part of ``replay_meta`` in the two-state form (format /1): per-row leaves of the sum
and min trees (and per module for the multi-agent prioritized buffer) plus the trees' small state,
and the trees rebuilt from them on restore.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from ....errors import RestoreError
from .buffers import _Kind, _like
from .row_ids import RowIds
from .segment_trees import (_check_maps, _check_neutral, _free_nodes_from, _free_nodes_state, _leaves_of,
                            _rebuild_tree, _same_leaves, _tree_leaves)
from .values import _pack_one, _unpack_one


def tree_scalars(buffer: Any) -> Dict[str, Any]:
    """The buffer's (env-step) trees' state beside their leaves: max priority / index, free nodes,
    last sampled indices, capacity."""
    return {"max_priority": _pack_one(buffer._max_priority, "_max_priority"), "max_idx": int(buffer._max_idx),
            "free_nodes": _free_nodes_state(buffer._free_nodes),
            "last_sampled": [int(i) for i in buffer._last_sampled_indices],
            "tree_capacity": int(buffer._sum_segment.capacity)}


def _priority_state(buffer: Any, kind: _Kind, replay: Dict[str, Any], rid: RowIds, bname: str) -> Dict[str, Any]:
    """Leaves per row (and per env step, multi-agent), plus the trees' small state."""
    out = tree_scalars(buffer)
    if kind.multi_agent:
        env = np.array(buffer._indices, np.int64).reshape(len(buffer._indices), 3)
        tidx = env[:, 2]
        _check_maps(buffer._tree_idx_to_sample_idx, tidx, f"{bname}._tree_idx_to_sample_idx")
        # written by RLlib, never read; after evictions it keeps stale keys: stored as it is
        s2t = buffer._sample_idx_to_tree_idx
        out["sample_idx_to_tree_idx"] = np.array([list(s2t.keys()), list(s2t.values())], np.int64).reshape(2, len(s2t))
        out["sum"] = _tree_leaves(buffer._sum_segment, tidx, "_sum_segment")
        out["min"] = _same_leaves(out["sum"], _tree_leaves(buffer._min_segment, tidx, "_min_segment"))
        _check_neutral(buffer._sum_segment, tidx, f"{bname}._sum_segment")
        _check_neutral(buffer._min_segment, tidx, f"{bname}._min_segment")
        modules = []
        codes = replay["module"]
        # each map's own key order (dicts keep insertion order; RLlib's defaultdicts add keys on reads)
        out["module_key_order"] = {k: [rid.module_code(m) for m in getattr(buffer, k)] for k in MODULE_MAPS}
        for mid in modules_of(buffer):
            mc = rid.module_code(mid)
            rows = np.flatnonzero(codes == mc)
            t_m = replay["tree"][rows]
            m = {"module": mc, "rows": rows.size}
            if mid in buffer._module_to_sum_segment:
                m["sum"] = _tree_leaves(buffer._module_to_sum_segment[mid], t_m, "module sum tree")
                _check_neutral(buffer._module_to_sum_segment[mid], t_m, f"{bname} module {mid!r} sum tree")
            if mid in buffer._module_to_min_segment:
                mt = buffer._module_to_min_segment[mid]
                m["min"] = _tree_leaves(mt, t_m, "module min tree")
                if "sum" in m:
                    m["min"] = _same_leaves(m["sum"], m["min"])
                _check_neutral(mt, t_m, f"{bname} module {mid!r} min tree")
            m.update(module_scalars(buffer, mid, t_m, bname))
            modules.append(m)
        out["modules"] = modules
    else:
        tidx = replay["tree"]
        _check_maps(buffer._tree_idx_to_sample_idx, tidx, f"{bname}._tree_idx_to_sample_idx")
        out["sum"] = _tree_leaves(buffer._sum_segment, tidx, "_sum_segment")
        out["min"] = _same_leaves(out["sum"], _tree_leaves(buffer._min_segment, tidx, "_min_segment"))
        _check_neutral(buffer._sum_segment, tidx, f"{bname}._sum_segment")
        _check_neutral(buffer._min_segment, tidx, f"{bname}._min_segment")
    return out


MODULE_MAPS = ("_module_to_max_priority", "_module_to_sum_segment", "_module_to_min_segment",
               "_module_to_free_nodes", "_module_to_max_idx", "_module_to_tree_idx_to_sample_idx",
               "_module_to_last_sampled_indices")


def modules_of(buffer: Any) -> List[Any]:
    """Every module id any per-module map of a multi-agent prioritized buffer holds, in first-seen order."""
    seen: Dict[Any, None] = {}
    for k in MODULE_MAPS:
        seen.update(dict.fromkeys(getattr(buffer, k)))
    return list(seen)


def module_scalars(buffer: Any, mid: Any, t_m: np.ndarray, bname: str) -> Dict[str, Any]:
    """A module's tree state beside its row leaves (``t_m``: its rows' tree indices, in row order):
    the min tree's class, free nodes, max priority / index, last sampled, whether it has a tree map."""
    m: Dict[str, Any] = {}
    if mid in buffer._module_to_min_segment:
        m["min_is_sum_tree"] = type(buffer._module_to_min_segment[mid]).__name__ == "SumSegmentTree"
    if mid in buffer._module_to_free_nodes:
        m["free_nodes"] = _free_nodes_state(buffer._module_to_free_nodes[mid])
    if mid in buffer._module_to_max_priority:
        m["max_priority"] = _pack_one(buffer._module_to_max_priority[mid], "module max priority")
    if mid in buffer._module_to_max_idx:
        m["max_idx"] = int(buffer._module_to_max_idx[mid])
    if mid in buffer._module_to_last_sampled_indices:
        m["last_sampled"] = [int(i) for i in buffer._module_to_last_sampled_indices[mid]]
    if mid in buffer._module_to_tree_idx_to_sample_idx:
        _check_maps(buffer._module_to_tree_idx_to_sample_idx[mid], t_m,
                    f"{bname}._module_to_tree_idx_to_sample_idx[{mid!r}]")
        m["tree_map"] = True
    return m


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
    _rebuild_tree(s, tidx, pr["sum"])
    _rebuild_tree(m, tidx, _leaves_of(pr["min"], pr["sum"]))
    new["_sum_segment"], new["_min_segment"] = s, m
    new["_tree_idx_to_sample_idx"] = {int(ti): i for i, ti in enumerate(tidx.tolist())}
    new["_free_nodes"] = _free_nodes_from(pr["free_nodes"])
    new["_max_priority"] = _unpack_one(pr["max_priority"])
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
            _rebuild_tree(tr, t_m, mm["sum"])
            maps["_module_to_sum_segment"][mid] = tr
        if "min" in mm:
            tr = SumSegmentTree(cap) if mm.get("min_is_sum_tree") else MinSegmentTree(cap)
            _rebuild_tree(tr, t_m, _leaves_of(mm["min"], mm.get("sum", {})))
            maps["_module_to_min_segment"][mid] = tr
        if "free_nodes" in mm:
            maps["_module_to_free_nodes"][mid] = _free_nodes_from(mm["free_nodes"])
        if "max_priority" in mm:
            maps["_module_to_max_priority"][mid] = _unpack_one(mm["max_priority"])
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
