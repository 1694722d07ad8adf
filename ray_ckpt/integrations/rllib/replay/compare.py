"""Two buffers' complete states compared (tests and verification): every attribute, episodes through
their ``get_state()``, arrays by dtype, shape and bytes, segment trees by values and element types.
"""
from __future__ import annotations

import collections
import math
from typing import Any, List

import numpy as np

from ..base.conversion import to_storable
from .buffers import _attributes


def buffer_state_equal(a: Any, b: Any) -> List[str]:
    """Differences between two buffers' complete states (empty: equal), for tests and verification:
    every attribute, episodes compared through their ``get_state()`` (arrays by dtype, shape, bytes),
    segment trees by their values and their element types."""
    diffs: List[str] = []
    aa, bb = _attributes(a), _attributes(b)
    for name in sorted(set(aa) | set(bb)):
        if name not in aa or name not in bb:
            diffs.append(f"{name}: only in {'a' if name in aa else 'b'}")
            continue
        _cmp(aa[name], bb[name], name, diffs)
    return diffs


def _cmp(x: Any, y: Any, path: str, diffs: List[str]) -> None:
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
    from ray.rllib.execution.segment_tree import SegmentTree
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
    if len(diffs) > 20:
        return
    if isinstance(x, np.random.Generator):
        if not isinstance(y, np.random.Generator) or x.bit_generator.state != y.bit_generator.state:
            diffs.append(f"{path}: generator states differ")
        return
    if isinstance(x, MetricsLogger):
        try:
            sx = x.get_state()
        except Exception:  # RLlib's get_state fails on int agent ids: not storable, so not compared
            return
        _cmp(to_storable(sx), to_storable(y.get_state()), path + ".get_state()", diffs)
        return
    if isinstance(x, SegmentTree):
        if type(x) is not type(y) or x.capacity != y.capacity:
            diffs.append(f"{path}: {type(x).__name__}({x.capacity}) vs {type(y).__name__}({y.capacity})")
            return
        if x.value != y.value or [type(v) for v in x.value] != [type(v) for v in y.value]:
            bad = next(i for i, (u, v) in enumerate(zip(x.value, y.value)) if not (u == v and type(u) is type(v)))
            diffs.append(f"{path}.value[{bad}]: {x.value[bad]!r} vs {y.value[bad]!r}")
        return
    if isinstance(x, SingleAgentEpisode):
        if not isinstance(y, SingleAgentEpisode):
            diffs.append(f"{path}: types differ")
            return
        _cmp(x.get_state(), y.get_state(), path, diffs)
        return
    if isinstance(x, MultiAgentEpisode):
        sx, sy = x.get_state(), y.get_state()
        for k in sx:
            if k in ("agent_to_module_mapping_fn",):
                continue
            _cmp(sx[k], sy[k], f"{path}.{k}", diffs)
        return
    if isinstance(x, InfiniteLookbackBuffer):
        _cmp(x.get_state(), y.get_state(), path, diffs)
        return
    if isinstance(x, (np.ndarray, np.generic)):
        if not isinstance(y, type(x)) or np.asarray(x).dtype != np.asarray(y).dtype or np.shape(x) != np.shape(y) \
                or np.ascontiguousarray(x).tobytes() != np.ascontiguousarray(y).tobytes():
            diffs.append(f"{path}: {x!r} vs {y!r}"[:300])
        return
    if isinstance(x, dict):
        if type(x) is not type(y) or list(x) != list(y):
            diffs.append(f"{path}: {type(x).__name__} keys {list(x)[:5]} vs {type(y).__name__} "
                         f"{list(y)[:5] if isinstance(y, dict) else y!r}")
            return
        if isinstance(x, collections.defaultdict) and (x.default_factory is None) != (y.default_factory is None):
            diffs.append(f"{path}: default factories differ")
        for k in x:
            _cmp(x[k], y[k], f"{path}[{k!r}]", diffs)
        return
    if isinstance(x, (list, tuple, collections.deque)):
        if type(x) is not type(y) or len(x) != len(y):
            diffs.append(f"{path}: {type(x).__name__}[{len(x)}] vs {type(y).__name__}"
                         f"[{len(y) if hasattr(y, '__len__') else '?'}]")
            return
        if isinstance(x, collections.deque) and x.maxlen != y.maxlen:
            diffs.append(f"{path}: maxlen {x.maxlen} vs {y.maxlen}")
        for i, (u, v) in enumerate(zip(x, y)):
            _cmp(u, v, f"{path}[{i}]", diffs)
        return
    if callable(x) and callable(y):
        return
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y) and type(x) is type(y):
        return
    if type(x) is not type(y) or x != y:
        diffs.append(f"{path}: {x!r} ({type(x).__name__}) vs {y!r} ({type(y).__name__})"[:300])
