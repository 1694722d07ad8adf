"""Buffer comparison for the RLlib replay tests and benchmarks: every attribute of two replay
buffers compared (episodes through their ``get_state()``, arrays by dtype, shape and bytes, segment
trees by their values and their element types), and a fingerprint of one buffer (the same walk,
hashed) that fixtures keep to name the buffer a stored version must restore into."""
import collections
import hashlib
import math
from typing import Any, Dict, List

import numpy as np

from ray_ckpt.integrations.rllib.base.conversion import to_storable


def attributes(buffer: Any) -> Dict[str, Any]:
    """Every attribute set on the instance (``__dict__`` and the ``__slots__`` of its classes), but
    the journal's recorders."""
    out = dict(getattr(buffer, "__dict__", {}))
    for name in ("add", "update_priorities"):
        if getattr(out.get(name), "_ray_ckpt_hook", False):
            del out[name]
    for cls in type(buffer).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in out and hasattr(buffer, name):
                out[name] = getattr(buffer, name)
    return out


def buffer_state_equal(a: Any, b: Any) -> List[str]:
    """Differences between two buffers' complete states (empty: equal)."""
    diffs: List[str] = []
    aa, bb = attributes(a), attributes(b)
    for name in sorted(set(aa) | set(bb)):
        if name not in aa or name not in bb:
            diffs.append(f"{name}: only in {'a' if name in aa else 'b'}")
            continue
        _cmp(aa[name], bb[name], name, diffs)
    return diffs


def differences(a: Any, b: Any) -> List[str]:
    """:func:`buffer_state_equal` but for what the journal documents as not restored: a multi-agent
    episode's ``_len_lookback_buffers`` (not in RLlib's ``get_state()``) and the stale keys of
    ``MultiAgentPrioritizedEpisodeReplayBuffer._sample_idx_to_tree_idx`` (keys at or past the number
    of env steps, left by RLlib's evictions; RLlib only sets and pops the live ones)."""
    out = []
    for d in buffer_state_equal(a, b):
        if "_len_lookback_buffers" in d:
            continue
        if d.startswith("_sample_idx_to_tree_idx"):
            sa, sb = a._sample_idx_to_tree_idx, b._sample_idx_to_tree_idx
            if all(i in sa and i in sb and sa[i] == sb[i] for i in range(len(a._indices))):
                continue
        out.append(d)
    return out


def fingerprint(buffer: Any) -> str:
    """A sha256 of the buffer's state as :func:`differences` compares it (so two buffers with no
    differences have one fingerprint)."""
    h = hashlib.sha256()
    attrs = attributes(buffer)
    if "_sample_idx_to_tree_idx" in attrs:
        live = len(buffer._indices)
        # the live keys, in key order (RLlib reads them by key; the restore sets them in order)
        attrs["_sample_idx_to_tree_idx"] = {k: v for k, v in sorted(attrs["_sample_idx_to_tree_idx"].items())
                                            if k < live}
    for name in sorted(attrs):
        _walk(attrs[name], name, h)
    return h.hexdigest()


def _walk(x: Any, path: str, h) -> None:
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
    from ray.rllib.execution.segment_tree import SegmentTree
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
    if "_len_lookback_buffers" in path:
        return
    if isinstance(x, np.random.Generator):
        token = repr(x.bit_generator.state)
    elif isinstance(x, MetricsLogger):
        try:
            _walk(to_storable(x.get_state()), path + ".get_state()", h)
        except Exception:  # not storable (int agent ids): not compared either
            pass
        return
    elif isinstance(x, SegmentTree):
        token = f"{type(x).__name__}({x.capacity}) {[(type(v).__name__, repr(v)) for v in x.value]}"
    elif isinstance(x, (SingleAgentEpisode, InfiniteLookbackBuffer)):
        return _walk(x.get_state(), path, h)
    elif isinstance(x, MultiAgentEpisode):
        for k, v in x.get_state().items():
            if k != "agent_to_module_mapping_fn":
                _walk(v, f"{path}.{k}", h)
        return
    elif isinstance(x, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(x)
        token = f"{type(x).__name__} {a.dtype} {a.shape} {hashlib.sha256(a.tobytes()).hexdigest()}"
    elif isinstance(x, dict):
        h.update(f"{path}: {type(x).__name__} {len(x)} {getattr(x, 'default_factory', None) is None}\n".encode())
        for k in x:
            _walk(x[k], f"{path}[{k!r}]", h)
        return
    elif isinstance(x, (list, tuple, collections.deque)):
        h.update(f"{path}: {type(x).__name__} {len(x)} {getattr(x, 'maxlen', None)}\n".encode())
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", h)
        return
    elif callable(x):
        return
    elif isinstance(x, float) and math.isnan(x):
        token = "float nan"
    else:
        token = f"{type(x).__name__} {x!r}"
    h.update(f"{path}: {token}\n".encode())


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
