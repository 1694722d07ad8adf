"""An episode chunk, as ``add()`` received it, <-> the storable state a journal record holds, and a
buffer's episodes rebuilt from their chunks the way ``add()`` built them.

The state has the keys of RLlib's ``SingleAgentEpisode.get_state()`` (what ``from_state`` reads),
read through the episode's public attributes, with each gym space replaced by a code into the
journal's space table (:class:`.values.Spaces`): every chunk arrives with its own space objects, and
``get_state()`` serialises each of them (bounds through ``np.save``) -- most of a save's cost.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List

from ....errors import RestoreError, UnsupportedTypeError
from .values import Spaces, space_tree_from_storable, space_tree_to_storable, type_name

SPACE = "space_code"  # the key that replaces a state's gym space dict
SPARSE = "sparse_dicts"  # a list of dicts stored as its length and its non-empty dicts
_KEYS = ("observations", "actions", "rewards", "infos")
# MultiAgentEpisode.get_state() maps keyed by agent, stored as (agent, value) pairs (named in
# _rllib_internals.STATE_KEYS: RLlib's episode has no public accessor for the hanging ones)
_MA_MAPS = ("agent_t_started", "_hanging_actions_end", "_hanging_extra_model_outputs_end", "_hanging_rewards_end",
            "_hanging_rewards_begin")


def _lookback_state(buf: Any, spaces: Spaces) -> Dict[str, Any]:
    data = buf.data
    if type(data) is list and data and all(type(x) is dict for x in data):
        # infos: one dict per step, nearly all empty; stored as the length and the non-empty ones
        # (each step's dict would otherwise be a node of the record's structure JSON)
        full = [(i, x) for i, x in enumerate(data) if x]
        data = {SPARSE: len(data), "at": [i for i, _ in full], "dicts": [x for _, x in full]}
    return {"data": data, "lookback": buf.lookback, "finalized": buf.finalized, SPACE: spaces.code(buf.space)}


def chunk_state(ep: Any, spaces: Spaces) -> Dict[str, Any]:
    """A single-agent chunk's state (``get_state()``'s keys; spaces as codes). Its arrays are the
    chunk's own: the caller keeps the chunk unchanged (RLlib's ``add()`` deep-copies what it keeps)."""
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    if type(ep) is MultiAgentEpisode:
        return _ma_chunk_state(ep, spaces)
    if type(ep) is not SingleAgentEpisode:
        raise UnsupportedTypeError(f"replay buffer: an episode chunk of type {type_name(ep)} (the journal keeps "
                                   f"SingleAgentEpisode and MultiAgentEpisode chunks)")
    extra = ep.extra_model_outputs
    return {
        "id_": ep.id_, "agent_id": ep.agent_id, "module_id": ep.module_id,
        "multi_agent_episode_id": ep.multi_agent_episode_id,
        **{k: _lookback_state(getattr(ep, k), spaces) for k in _KEYS},
        "extra_model_outputs": {k: _lookback_state(v, spaces) for k, v in extra.items()} if extra else None,
        "is_terminated": ep.is_terminated, "is_truncated": ep.is_truncated,
        "t_started": ep.t_started, "t": ep.t,
        "_observation_space": spaces.code(ep.observation_space), "_action_space": spaces.code(ep.action_space),
        # get_state() keys without a public accessor (named in _rllib_internals.STATE_KEYS)
        "_start_time": ep._start_time, "_last_step_time": ep._last_step_time,
        "custom_data": ep.custom_data,
    }


def _sa_plain(st: Dict[str, Any]) -> Dict[str, Any]:
    """A stored chunk state as ``SingleAgentEpisode.from_state`` takes it (no spaces)."""
    plain = dict(st)
    for k in _KEYS:
        plain[k] = _plain(st[k])
    plain["extra_model_outputs"] = {k: _plain(v) for k, v in (st["extra_model_outputs"] or {}).items()} or None
    plain["_observation_space"] = plain["_action_space"] = None
    return plain


def _sa_spaces(ep: Any, st: Dict[str, Any], spaces: Spaces) -> Any:
    """Set the spaces of an episode made from :func:`_sa_plain` as the stored state names them."""
    ep.observation_space = spaces.space(st["_observation_space"])
    ep.action_space = spaces.space(st["_action_space"])
    for k in _KEYS:
        getattr(ep, k).space = spaces.space(st[k][SPACE])
    for k, v in (st["extra_model_outputs"] or {}).items():
        ep.extra_model_outputs[k].space = spaces.space(v[SPACE])
    return ep


def _ma_chunk_state(ep: Any, spaces: Spaces) -> Dict[str, Any]:
    """A multi-agent chunk's state: ``MultiAgentEpisode.get_state()``'s keys but the mapping function
    (the restoring algorithm's ``policy_mapping_fn`` is given back), maps as (agent, value) pairs."""
    return {
        "id_": ep.id_, "_agent_to_module_mapping": list(ep._agent_to_module_mapping.items()),
        "observation_space": space_tree_to_storable(ep.observation_space, spaces),
        "action_space": space_tree_to_storable(ep.action_space, spaces),
        "env_t_started": ep.env_t_started, "env_t": ep.env_t,
        "env_t_to_agent_t": [(aid, _lookback_state(b, spaces)) for aid, b in ep.env_t_to_agent_t.items()],
        **{k: list(getattr(ep, k).items()) for k in _MA_MAPS},
        "is_terminated": ep.is_terminated, "is_truncated": ep.is_truncated,
        "agent_episodes": [(aid, chunk_state(a, spaces)) for aid, a in ep.agent_episodes.items()],
        "_start_time": ep._start_time, "_last_step_time": ep._last_step_time, "custom_data": ep.custom_data,
    }


def _from_state(st: Dict[str, Any], spaces: Spaces, mapping_fn: Any = None) -> Any:
    """The episode of a stored chunk state (single- or multi-agent), through RLlib's ``from_state``."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    if "agent_episodes" not in st:
        return _sa_spaces(SingleAgentEpisode.from_state(_sa_plain(st)), st, spaces)
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
    tmpl = MultiAgentEpisode()
    plain = dict(st)
    plain["agent_to_module_mapping_fn"] = mapping_fn if mapping_fn is not None else tmpl.agent_to_module_mapping_fn
    plain["_agent_to_module_mapping"] = dict(st["_agent_to_module_mapping"])
    for k in ("observation_space", "action_space"):
        plain[k] = space_tree_from_storable(st[k], spaces) or {}
    e2a = {}
    for aid, lb in st["env_t_to_agent_t"]:
        e2a[aid] = InfiniteLookbackBuffer.from_state(_plain(lb))
        e2a[aid].space = spaces.space(lb[SPACE])
    plain["env_t_to_agent_t"] = like(tmpl.env_t_to_agent_t, e2a)
    for k in _MA_MAPS:
        plain[k] = like(getattr(tmpl, k), dict(st[k]))
    plain["agent_episodes"] = [(aid, _sa_plain(a)) for aid, a in st["agent_episodes"]]
    ep = MultiAgentEpisode.from_state(plain)
    for aid, a in st["agent_episodes"]:
        _sa_spaces(ep.agent_episodes[aid], a, spaces)
    return ep


def _plain(lb: Dict[str, Any]) -> Dict[str, Any]:
    data = lb["data"]
    if type(data) is dict and SPARSE in data:
        dicts = [{} for _ in range(data[SPARSE])]
        for i, x in zip(data["at"], data["dicts"]):
            dicts[i] = x
        data = dicts
    return {"data": data, "lookback": lb["lookback"], "finalized": lb["finalized"], "space": None}


def like(template: Any, values: Dict[Any, Any]) -> Any:
    """``values`` as the same kind of mapping as ``template`` (a defaultdict keeps its factory)."""
    if isinstance(template, collections.defaultdict):
        return collections.defaultdict(template.default_factory, values)
    return dict(values)


def rebuild_episodes(chunks: Dict[int, List[Dict[str, Any]]], first: int, spaces: Spaces,
                     mapping_fn: Any = None) -> List[Any]:
    """The buffer's episodes ``first, first + 1, ...`` from their chunks (episode index -> states in
    the order ``add()`` received them): the first chunk, then each next one concatenated to it with
    RLlib's own ``concat_episode`` -- what ``add()`` did with its deep copies of them."""
    eps = []
    for i, idx in enumerate(sorted(chunks)):
        if idx != first + i:
            raise RestoreError(f"replay journal: episode {first + i} has no chunk (the next stored is {idx})")
        states = chunks[idx]
        ep = _from_state(states[0], spaces, mapping_fn)
        for st in states[1:]:
            ep.concat_episode(_from_state(st, spaces, mapping_fn))
        eps.append(ep)
    return eps
