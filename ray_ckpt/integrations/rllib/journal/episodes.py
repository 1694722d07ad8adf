"""An episode chunk, as ``add()`` received it, <-> the storable state a journal record holds, and a
buffer's episodes rebuilt from their chunks the way ``add()`` built them.

The state has the keys of RLlib's ``SingleAgentEpisode.get_state()`` (what ``from_state`` reads),
read through the episode's public attributes, with each gym space replaced by a code into the
journal's space table (:class:`.values.Spaces`): every chunk arrives with its own space objects, and
``get_state()`` serialises each of them (bounds through ``np.save``) -- most of a save's cost.
"""
from __future__ import annotations

from typing import Any, Dict, List

from ....errors import RestoreError, UnsupportedTypeError
from .values import Spaces, type_name

SPACE = "space_code"  # the key that replaces a state's gym space dict


def _lookback_state(buf: Any, spaces: Spaces) -> Dict[str, Any]:
    return {"data": buf.data, "lookback": buf.lookback, "finalized": buf.finalized, SPACE: spaces.code(buf.space)}


def chunk_state(ep: Any, spaces: Spaces) -> Dict[str, Any]:
    """A single-agent chunk's state (``get_state()``'s keys; spaces as codes). Its arrays are the
    chunk's own: the caller keeps the chunk unchanged (RLlib's ``add()`` deep-copies what it keeps)."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    if type(ep) is not SingleAgentEpisode:
        raise UnsupportedTypeError(f"replay buffer: an episode chunk of type {type_name(ep)} (the journal keeps "
                                   f"SingleAgentEpisode chunks)")
    extra = ep.extra_model_outputs
    return {
        "id_": ep.id_, "agent_id": ep.agent_id, "module_id": ep.module_id,
        "multi_agent_episode_id": ep.multi_agent_episode_id,
        "observations": _lookback_state(ep.observations, spaces),
        "actions": _lookback_state(ep.actions, spaces),
        "rewards": _lookback_state(ep.rewards, spaces),
        "infos": _lookback_state(ep.infos, spaces),
        "extra_model_outputs": {k: _lookback_state(v, spaces) for k, v in extra.items()} if extra else None,
        "is_terminated": ep.is_terminated, "is_truncated": ep.is_truncated,
        "t_started": ep.t_started, "t": ep.t,
        "_observation_space": spaces.code(ep.observation_space), "_action_space": spaces.code(ep.action_space),
        # get_state() keys without a public accessor (named in _rllib_internals.STATE_KEYS)
        "_start_time": ep._start_time, "_last_step_time": ep._last_step_time,
        "custom_data": ep.custom_data,
    }


def _from_state(st: Dict[str, Any], spaces: Spaces) -> Any:
    """``SingleAgentEpisode.from_state`` of a stored chunk state, its spaces then set as they were."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    keys = ("observations", "actions", "rewards", "infos")
    extra = st["extra_model_outputs"] or {}
    codes = {k: st[k][SPACE] for k in keys}
    codes.update({("extra", k): v[SPACE] for k, v in extra.items()})
    plain = dict(st)
    for k in keys:
        plain[k] = _plain(st[k])
    plain["extra_model_outputs"] = {k: _plain(v) for k, v in extra.items()} or None
    plain["_observation_space"] = plain["_action_space"] = None
    ep = SingleAgentEpisode.from_state(plain)
    ep.observation_space = spaces.space(st["_observation_space"])
    ep.action_space = spaces.space(st["_action_space"])
    for k in keys:
        getattr(ep, k).space = spaces.space(codes[k])
    for k in extra:
        ep.extra_model_outputs[k].space = spaces.space(codes[("extra", k)])
    return ep


def _plain(lb: Dict[str, Any]) -> Dict[str, Any]:
    return {"data": lb["data"], "lookback": lb["lookback"], "finalized": lb["finalized"], "space": None}


def rebuild_episodes(chunks: Dict[int, List[Dict[str, Any]]], first: int, spaces: Spaces) -> List[Any]:
    """The buffer's episodes ``first, first + 1, ...`` from their chunks (episode index -> states in
    the order ``add()`` received them): the first chunk, then each next one concatenated to it with
    RLlib's own ``concat_episode`` -- what ``add()`` did with its deep copies of them."""
    eps = []
    for i, idx in enumerate(sorted(chunks)):
        if idx != first + i:
            raise RestoreError(f"replay journal: episode {first + i} has no chunk (the next stored is {idx})")
        states = chunks[idx]
        ep = _from_state(states[0], spaces)
        for st in states[1:]:
            ep.concat_episode(_from_state(st, spaces))
        eps.append(ep)
    return eps
