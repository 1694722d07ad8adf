"""The supported RLlib buffer classes and their attributes: which family a buffer is, every attribute
set on it (each must be one this package stores, or a plain value kept under ``extra_attrs``), and the
part of ``replay_meta`` every family shares (config, counters, sampling generator, metrics).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ....errors import UnsupportedTypeError
from ..base.conversion import to_storable
from .values import _scalar_state, _type_name

META_FORMAT = "ray_ckpt.rllib.replay/1"  # the two-state form (multi-agent buffers are saved in it)


_CONFIG_ATTRS = ("capacity", "batch_size_B", "batch_length_T", "_metrics_num_episodes_for_smoothing", "_alpha")
_BASE_ATTRS = {"episodes", "episode_id_to_index", "_indices", "rng", "metrics", "_num_episodes_evicted",
               "_num_timesteps", "_num_timesteps_added", "sampled_timesteps"}
_PER_ATTRS = {"_sum_segment", "_min_segment", "_free_nodes", "_max_idx", "_max_priority",
              "_tree_idx_to_sample_idx", "_last_sampled_indices"}
_MA_ATTRS = {"_module_to_indices", "_num_agent_timesteps", "_num_agent_timesteps_added"}
_MA_MODULE_COUNTERS = ("_num_module_timesteps", "_num_module_timesteps_added", "_num_module_episodes",
                       "_num_module_episodes_evicted", "sampled_timesteps_per_module")
_MAPER_ATTRS = {"_sample_idx_to_tree_idx", "_module_to_max_priority", "_module_to_sum_segment",
                "_module_to_min_segment", "_module_to_free_nodes", "_module_to_max_idx",
                "_module_to_tree_idx_to_sample_idx", "_module_to_last_sampled_indices"}


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


def replay_buffer_of(algorithm: Any) -> Optional[Any]:
    """The algorithm's local replay buffer (None for on-policy algorithms)."""
    return getattr(algorithm, "local_replay_buffer", None)


def _attributes(buffer: Any) -> Dict[str, Any]:
    """Every attribute set on the instance (``__dict__`` and the ``__slots__`` of its classes)."""
    out = dict(getattr(buffer, "__dict__", {}))
    for name in ("add", "update_priorities"):  # recorders (incremental_priorities', the journal's): not state
        if getattr(out.get(name), "_ray_ckpt_hook", False):
            del out[name]
    for cls in type(buffer).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in out and hasattr(buffer, name):
                out[name] = getattr(buffer, name)
    return out


def handled_attrs(kind: _Kind) -> set:
    """The buffer attributes this package stores (every other one must be a plain value: extra_attrs)."""
    handled = set(_CONFIG_ATTRS) | _BASE_ATTRS
    if kind.prioritized:
        handled |= _PER_ATTRS
    if kind.multi_agent:
        handled |= _MA_ATTRS | set(_MA_MODULE_COUNTERS)
    if kind.multi_agent and kind.prioritized:
        handled |= _MAPER_ATTRS
    return handled


def common_meta(buffer: Any, attrs: Dict[str, Any], bname: str, fmt: str) -> Dict[str, Any]:
    """format, buffer type, config, counters, the sampling generator and the metrics state."""
    meta: Dict[str, Any] = {"format": fmt, "buffer_type": bname, "not_saved": {}}
    meta["config"] = {k: _scalar_state(attrs[k], k) for k in _CONFIG_ATTRS if k in attrs}
    meta["counters"] = {k: _scalar_state(attrs[k], k) for k in
                        ("_num_episodes_evicted", "_num_timesteps", "_num_timesteps_added", "sampled_timesteps",
                         "_num_agent_timesteps", "_num_agent_timesteps_added") if k in attrs}
    meta["rng"] = buffer.rng.bit_generator.state
    try:  # not needed to sample: a metrics state that cannot be read or stored is reported, not fatal
        meta["metrics"] = to_storable(buffer.metrics.get_state(), "replay_meta.metrics")
    except Exception as exc:  # e.g. RLlib's own get_state fails on int agent ids ("--".join(path))
        meta["metrics"] = None
        meta["not_saved"]["metrics"] = f"{type(exc).__name__}: {exc}"
    return meta


def extra_attrs(attrs: Dict[str, Any], handled: set, bname: str) -> Dict[str, Any]:
    extra = {}
    for name, value in attrs.items():
        if name in handled:
            continue
        try:
            extra[name] = to_storable(value, f"{bname}.{name}")
        except UnsupportedTypeError:
            raise UnsupportedTypeError(f"replay buffer of type {bname}: attribute {name!r} holds a "
                                       f"{_type_name(value)}, which ray_ckpt does not know how to store "
                                       f"exactly (pass replay_strategy='off' to skip the buffer)") from None
    return extra


def _like(template: Any, values: Dict[Any, Any]) -> Any:
    """``values`` as the same kind of mapping as ``template`` (a defaultdict keeps its factory)."""
    if isinstance(template, collections.defaultdict):
        return collections.defaultdict(template.default_factory, values)
    return dict(values)
