"""Every private or undocumented RLlib (and gymnasium) internal this integration relies on -- the one
place to look when an RLlib upgrade breaks it. Everything else in the package uses public APIs
(``Algorithm.learner_group`` / ``env_runner_group`` / ``get_state`` / ``set_state``,
``EnvRunnerGroup.foreach_env_runner`` / ``healthy_env_runner_ids``, ``EnvRunner.module`` /
``env`` / ``worker_index``, Ray's documented ``ActorHandle.__ray_call__``).

======================================================== =================================================
internal                                                 why there is no public way
======================================================== =================================================
``EnvRunnerGroup._worker_manager`` (set in ``__init__``) The remote env runners' *actor handles*: the
and ``FaultTolerantActorManager.actors()``               engine snapshots each runner's RNG states inside
                                                         that actor (``env_runner_<i>``) without the
                                                         driver awaiting a remote call, and a restore
                                                         reports the runners that are not healthy.
                                                         EnvRunnerGroup exposes healthy ids and
                                                         ``foreach_*`` calls, never the handles; RLlib's
                                                         own code marks ``actors()`` "TODO: remove".
``LearnerGroup._worker_manager`` (set in ``__init__``)   The remote learners' actor handles
and its ``actors()`` / ``healthy_actor_ids()``           (``num_learners >= 1``): ``policy`` /
                                                         ``optimizer`` / ``metrics`` are snapshotted inside
                                                         the first learner, and a restore pushes into each
                                                         learner and checks its answer
                                                         (:mod:`.learners`). LearnerGroup exposes only
                                                         ``foreach_learner``, never the handles.
gymnasium ``Env._np_random``                             An env's RNG, read without side effects: the
                                                         public ``np_random`` property seeds a new
                                                         generator from OS entropy when there is none.
``ray.rllib.utils.serialization._serialize_ndarray``     The string format (base64 of zlib of
format                                                   ``np.save``) of ``RunningStat`` arrays, which the
                                                         conversion decodes without unpickling (RLlib
                                                         loads them with ``allow_pickle=True``) and
                                                         re-encodes byte for byte on restore.
``RunningStat.to_state()`` keys (``num_pushes``,         How the conversion recognises a RunningStat
``mean_array``, ``mean_delta_array``,                    state (MeanStdFilter) inside a connector state
``sum_sq_diff_array``, ``sum_sq_diff_delta_array``)      and which of its values are such strings.
``Learner._optimizer_lr_schedules`` (set in              An optimizer's learning-rate Scheduler (the
``__init__``) and ``Learner._set_optimizer_lr``          trial config's ``lr``, fixed or a schedule) and
                                                         how RLlib sets that lr on the optimizer (as its
                                                         ``after_gradient_based_update`` does): a PBT
                                                         clone applies its own trial's lr over the source
                                                         trial's restored optimizer state (:mod:`.tune`).
                                                         RLlib exposes neither.
======================================================== =================================================

:func:`missing_internals` checks each against the installed RLlib / gymnasium (a test runs it), and
names the one that moved. Only the accessors below read them; no other module of the package does --
except two. The replay journal (:mod:`..replay`, how buffers are saved) goes through RLlib's own
``get_state()`` / ``set_state()`` and episode ``from_state`` / ``concat_episode``, and reads or
writes the 10 prioritized-buffer attributes of ``JOURNAL_INTERNALS`` through the accessors at the
end of this module (``get_state()`` copies the O(capacity) free-node deques; ``set_state()`` drops
their maxlen and gives module min trees a sum-tree factory); the ``get_state()`` keys it relies on
are ``STATE_KEYS`` (tests/test_rllib_journal_internals.py holds the behaviour it relies on, on the
oldest and newest supported Ray); both lists are checked by :func:`missing_internals`. The second:
the reader of the formats it replaced (``ray_ckpt/cli/legacy_replay.py``, used by ``ray-ckpt
migrate`` only) reads and writes the buffers' attributes directly, as the package that wrote those
formats did; it is frozen, and goes with ``migrate``.

Where RLlib's behaviour differs between the Ray releases the package supports, the fix is here too,
chosen by what the installed RLlib does (never by its version string): :func:`load_learner_state`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ....ray_internals import assigned_in_source, missing_among
from .learner_params import set_outside_params
from .names import log

RUNNING_STAT_MARKER = "num_pushes"
RUNNING_STAT_ARRAYS = ("mean_array", "mean_delta_array", "sum_sq_diff_array", "sum_sq_diff_delta_array")


@dataclass(frozen=True)
class Internal:
    """One internal: ``attribute`` of ``owner`` ("package.module:Class" or "package.module").
    ``kind``: "instance" (assigned to ``self`` in the class's source), "method", "class" (a class
    attribute), "function" (of a module) or "state_keys" (keys of ``Class(shape=(1,)).to_state()``)."""

    owner: str
    attribute: str
    kind: str
    why: str


INTERNALS = (
    Internal("ray.rllib.env.env_runner_group:EnvRunnerGroup", "_worker_manager", "instance",
             "the remote env runners' actor handles (saving env_runner_<i>; unhealthy runners on restore)"),
    Internal("ray.rllib.utils.actor_manager:FaultTolerantActorManager", "actors", "method",
             "{runner id: actor handle}, healthy or not"),
    Internal("ray.rllib.core.learner.learner_group:LearnerGroup", "_worker_manager", "instance",
             "the remote learners' actor handles (policy/optimizer/metrics captured in the first learner; "
             "the restore's verified push into each)"),
    Internal("ray.rllib.utils.actor_manager:FaultTolerantActorManager", "healthy_actor_ids", "method",
             "which remote learner is the first healthy one (the one RLlib's own get_state reads)"),
    Internal("gymnasium.core:Env", "_np_random", "class",
             "an env's RNG read without seeding a new one"),
    Internal("ray.rllib.utils.serialization", "_serialize_ndarray", "function",
             "the RunningStat array string format the conversion decodes and re-encodes"),
    Internal("ray.rllib.core.learner.learner:Learner", "_optimizer_lr_schedules", "instance",
             "each optimizer's lr Scheduler (a PBT clone's own lr over the restored optimizer state)"),
    Internal("ray.rllib.core.learner.learner:Learner", "_set_optimizer_lr", "method",
             "setting an optimizer's lr the way RLlib does"),
) + tuple(
    Internal("ray.rllib.utils.filter:RunningStat", key, "state_keys",
             "how the conversion recognises a RunningStat state and its array strings")
    for key in (RUNNING_STAT_MARKER,) + RUNNING_STAT_ARRAYS)

_RB = "ray.rllib.utils.replay_buffers."
# what the replay journal (:mod:`..replay`) reads and writes of the prioritized buffers outside RLlib's
# get_state()/set_state() (which copy the O(capacity) free-node deques), each behind an accessor below
_PER = _RB + "prioritized_episode_buffer:PrioritizedEpisodeReplayBuffer"
_MAPER = _RB + "multi_agent_prioritized_episode_buffer:MultiAgentPrioritizedEpisodeReplayBuffer"
JOURNAL_INTERNALS = (
    Internal(_PER, "_alpha", "instance", "the exponent add() and update_priorities() raise priorities to"),
    Internal(_PER, "_max_priority", "instance", "the weight add() gives new env steps"),
    Internal(_PER, "_last_sampled_indices", "instance", "the leaves update_priorities() is about to change"),
    Internal(_PER, "_free_nodes", "instance", "its order decides the leaves of future steps; set_state() drops its "
             "maxlen, which the restore puts back"),
    Internal(_PER, "_max_idx", "instance", "a get_state() key, read without get_state()'s O(capacity) copies"),
    Internal(_MAPER, "_module_to_max_priority", "instance", "the weight add() gives a module's new agent steps"),
    Internal(_MAPER, "_module_to_last_sampled_indices", "instance", "the module leaves update_priorities() changes"),
    Internal(_MAPER, "_module_to_free_nodes", "instance", "as _free_nodes, per module"),
    Internal(_MAPER, "_module_to_min_segment", "instance", "set_state() gives it a sum-tree factory: put right"),
    Internal(_MAPER, "_sample_idx_to_tree_idx", "instance", "not in get_state(), yet the next eviction pops from it"),
)
# RLlib's get_state()/set_state() keys the journal reads and writes (RLlib's checkpoint contract; the
# episodes' ones without a public accessor are read directly); the prioritized ones that are not
# O(timesteps) are read through the accessors below, and _module_to_max_idx with them
STATE_KEYS = (
    (_RB + "episode_replay_buffer:EpisodeReplayBuffer",
     ("episodes", "episode_id_to_index", "_num_episodes_evicted", "_indices", "_num_timesteps",
      "_num_timesteps_added", "sampled_timesteps")),
    (_PER, ("_sum_segment", "_min_segment", "_free_nodes", "_max_priority", "_max_idx", "_tree_idx_to_sample_idx",
            "_last_sampled_indices")),
    (_RB + "multi_agent_episode_buffer:MultiAgentEpisodeReplayBuffer",
     ("_module_to_indices", "_num_agent_timesteps", "_num_agent_timesteps_added", "_num_module_timesteps",
      "_num_module_timesteps_added", "_num_module_episodes", "_num_module_episodes_evicted",
      "sampled_timesteps_per_module")),
    (_MAPER, ("_module_to_max_priority", "_module_to_sum_segment", "_module_to_min_segment", "_module_to_free_nodes",
              "_module_to_max_idx", "_module_to_tree_idx_to_sample_idx", "_module_to_last_sampled_indices")),
    ("ray.rllib.env.single_agent_episode:SingleAgentEpisode", ("_start_time", "_last_step_time")),
    ("ray.rllib.env.multi_agent_episode:MultiAgentEpisode",
     ("_agent_to_module_mapping", "_hanging_actions_end", "_hanging_extra_model_outputs_end", "_hanging_rewards_end",
      "_hanging_rewards_begin", "_start_time", "_last_step_time")),
)

def _present(obj: Any, item: Internal) -> bool:
    if item.kind == "instance":
        return assigned_in_source(obj, item.attribute)
    if item.kind == "method":
        return callable(getattr(obj, item.attribute, None))
    if item.kind == "state_keys":
        return item.attribute in obj(shape=(1,)).to_state()
    return hasattr(obj, item.attribute)


def missing_internals() -> List[str]:
    """One line per internal that the installed RLlib / gymnasium no longer has (empty: all there)."""
    return missing_among(INTERNALS + JOURNAL_INTERNALS, _present,
                         "ray_ckpt's RLlib integration uses it for {why}")


# ---------------------------------------------------------------------- the accessors
_warned = False


def remote_env_runner_actors(group: Any) -> Dict[int, Any]:
    """{runner id: actor handle} of every remote env runner of an EnvRunnerGroup, healthy or not
    (``{}``, logged once, if RLlib moved them)."""
    global _warned
    try:
        return dict(group._worker_manager.actors())
    except Exception as exc:  # pragma: no cover - RLlib internals changed
        if not _warned:
            _warned = True
            log.warning("ray_ckpt: cannot list RLlib's remote env runners (%s: %s); their RNG states are not "
                        "saved and a restore does not report unhealthy ones", type(exc).__name__, exc)
        return {}


def remote_learners(learner_group: Any) -> Tuple[Dict[int, Any], List[int]]:
    """({learner id: actor handle} of every remote learner, healthy or not; the healthy ids in RLlib's
    order) of a LearnerGroup with ``num_learners >= 1``. Raises RuntimeError naming the internal if
    RLlib moved them (no silent fallback: ``policy`` and ``optimizer`` are critical)."""
    try:
        manager = learner_group._worker_manager
        return dict(manager.actors()), list(manager.healthy_actor_ids())
    except Exception as exc:  # pragma: no cover - RLlib internals changed
        raise RuntimeError(f"cannot reach RLlib's remote learner actors (LearnerGroup._worker_manager: "
                           f"{type(exc).__name__}: {exc}); ray_ckpt's _rllib_internals needs updating for "
                           f"this RLlib") from None


def env_rng(env: Any) -> Optional[np.random.Generator]:
    """A gymnasium env's generator, or None where it has none yet (never creates one)."""
    gen = getattr(getattr(env, "unwrapped", env), "_np_random", None)
    return gen if isinstance(gen, np.random.Generator) else None


def scheduled_lr(learner: Any, optimizer: Any, timestep: int) -> Optional[float]:
    """The learning rate RLlib's Scheduler of ``optimizer`` gives at ``timestep`` (the trial
    config's ``lr``, fixed or a schedule), as ``Learner.after_gradient_based_update`` computes it;
    None where the optimizer was registered without one (its learner manages its lr itself)."""
    schedule = learner._optimizer_lr_schedules.get(optimizer)
    return None if schedule is None else schedule.update(timestep=timestep)


def set_optimizer_lr(learner: Any, optimizer: Any, lr: float) -> None:
    """Set ``optimizer``'s learning rate the way the learner's framework does it in RLlib."""
    learner._set_optimizer_lr(optimizer, lr=lr)


# ---------------------------------------------------------------------- the replay journal's accessors
_MODULE_PER = ("_module_to_max_priority", "_module_to_max_idx", "_module_to_free_nodes", "_module_to_last_sampled_indices")


_MA_STATE = ("_module_to_indices", "_num_module_timesteps", "_num_module_timesteps_added", "_num_module_episodes",
             "_num_module_episodes_evicted", "sampled_timesteps_per_module")


def multi_agent_state(buf: Any) -> Dict[str, Any]:
    """What ``MultiAgentEpisodeReplayBuffer.get_state()`` adds to ``EpisodeReplayBuffer``'s, in its
    form (maps as item lists; the index lists RLlib's own), without calling it: in the prioritized
    multi-agent class its ``super().get_state()`` reaches ``PrioritizedEpisodeReplayBuffer.get_state``
    (the class's MRO), which copies the env trees and the free nodes -- O(capacity) at every add();
    the journal derives those. tests/test_rllib_journal_internals.py holds the two equal."""
    out: Dict[str, Any] = {k: list(getattr(buf, k).items()) for k in _MA_STATE}
    out["_num_agent_timesteps"] = buf._num_agent_timesteps
    out["_num_agent_timesteps_added"] = buf._num_agent_timesteps_added
    return out


def replay_alpha(buf: Any) -> float:
    return buf._alpha


def max_priority(buf: Any, module: Any = None) -> Any:
    """The weight add() gives new steps of the env list (``module`` None) or of a module's list."""
    return buf._max_priority if module is None else buf._module_to_max_priority[module]


def last_sampled(buf: Any, module: Any = None) -> List[int]:
    return buf._last_sampled_indices if module is None else buf._module_to_last_sampled_indices[module]


def per_scalars(buf: Any) -> Dict[str, Any]:
    """A prioritized buffer's get_state() keys that are not O(timesteps) (the deque itself: the
    caller copies what it keeps)."""
    return {"_max_priority": buf._max_priority, "_max_idx": buf._max_idx, "_free_nodes": buf._free_nodes,
            "_last_sampled_indices": buf._last_sampled_indices}


def module_per_scalars(buf: Any) -> Dict[str, List[Tuple[Any, Any]]]:
    """The same per module, each map's (module, value) pairs in its own order."""
    return {k: list(getattr(buf, k).items()) for k in _MODULE_PER}


def tree_values(state: Dict[str, Any], multi_agent: bool) -> Dict[Any, Tuple[list, list]]:
    """list key (None: the env list; a module id) -> (sum tree values, min tree values), from a
    prioritized class's get_state() (value lists; the multi-agent class gives its module trees as objects)."""
    out = {None: (state["_sum_segment"], state["_min_segment"])}
    if multi_agent:
        mins = dict(state["_module_to_min_segment"])
        out.update((m, (t.value, mins[m].value)) for m, t in state["_module_to_sum_segment"])
    return out


def set_free_nodes(buf: Any, free_nodes: Any) -> None:
    """The free-node deque as it was, maxlen included (RLlib's set_state() makes one without it)."""
    buf._free_nodes = free_nodes


def module_min_tree_factory(buf: Any) -> Any:
    return buf._module_to_min_segment.default_factory


def fix_module_trees(buf: Any, min_tree: Any, sample_to_tree: Dict[int, int]) -> None:
    """After MultiAgentPrioritizedEpisodeReplayBuffer.set_state(): a new module's min tree is a min
    tree again (set_state's factory makes a sum tree), and ``_sample_idx_to_tree_idx`` (not in
    get_state()) is the env list's sample index -> leaf, which the next eviction pops from."""
    buf._module_to_min_segment.default_factory = min_tree
    buf._sample_idx_to_tree_idx = sample_to_tree


# ---------------------------------------------------------------------- differences between RLlib releases
def load_learner_state(learner: Any, state: Dict[str, Any]) -> None:
    """``learner.set_state(state)``, with the optimizers' ``param_groups`` values as saved.

    RLlib before 2.60 converts a whole optimizer state dict to tensors on load, ``param_groups``
    included: ``lr`` 5e-05 comes back as a float32 tensor (4.99999987e-05), so training resumes with
    another learning rate and the restored state no longer equals the saved one. Where a value came
    back as a tensor and was saved as none, the saved one is put back (as RLlib 2.60 keeps it)."""
    from ray.rllib.core import COMPONENT_OPTIMIZER

    learner.set_state(state)
    set_outside_params(learner, state.get(COMPONENT_OPTIMIZER) or {})  # SAC's log_alpha: not in RLlib's state
    for name, saved in (state.get(COMPONENT_OPTIMIZER) or {}).items():
        groups = (saved.get("state") or {}).get("param_groups") or []
        try:
            optimizer = learner.get_optimizer(saved.get("module_id"), name)
        except KeyError:  # an optimizer of a module this learner does not hold: RLlib skipped it too
            continue
        for group, saved_group in zip(optimizer.param_groups, groups):
            for key, value in saved_group.items():
                if key != "params" and _has_tensor(group.get(key)) and not _has_tensor(value):
                    group[key] = value


def _has_tensor(value: Any) -> bool:
    import torch

    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)
