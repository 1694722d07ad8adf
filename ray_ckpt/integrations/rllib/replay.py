"""RLlib's off-policy replay buffers (``algorithm.local_replay_buffer``) <-> two storable states.

Supported: the new API stack's ``EpisodeReplayBuffer``, ``PrioritizedEpisodeReplayBuffer``,
``MultiAgentEpisodeReplayBuffer`` and ``MultiAgentPrioritizedEpisodeReplayBuffer`` (Ray 2.60), and
subclasses of them that add no state of a kind listed nowhere here (anything else raises
:class:`~ray_ckpt.UnsupportedTypeError` naming the buffer type and the attribute).

Why not RLlib's own ``get_state()``: it is incomplete for an exact resume and not storable as is. It
leaves out the buffer's sampling generator ``rng`` (a restored buffer would draw other batches), its
``metrics`` and its capacity; the multi-agent prioritized one returns the segment-tree *objects*
and its ``set_state`` rebuilds missing min-trees as sum-trees; episodes come back as nested dicts
of per-episode arrays (thousands of small leaves), the prioritized trees as Python lists of
``2 * 2**ceil(log2(capacity))`` floats each, and ``MultiAgentEpisode.get_state()`` holds a function
and gym spaces. So the buffer is read attribute by attribute: every attribute of the instance must
be one this module knows (or a plain JSON/numpy value, kept under ``extra_attrs``).

Single-agent buffers are saved incrementally by :mod:`.replay_incremental` (the rows below plus an
episode log, a priority change log and a small ``replay_meta``: a save converts and writes only what
changed); a restore turns those back into the two-state form below and restores that. Multi-agent
buffers are saved in the two-state form itself (format /1: rows append-only, ``replay_meta`` whole).

The two states (names ``replay`` and ``replay_meta`` in a version):

``replay`` -- a ray_ckpt *buffer* (one Arrow IPC file): ONE ROW PER STORED TIMESTEP (per agent
timestep in the multi-agent buffers), in the order the buffer added them, columns:

=================== ======= ===============================================================
``row_id``          int64   stable id of the timestep, strictly increasing (see below)
``episode``         int64   the buffer's episode index of it (``_indices[i][0]``: a counter of
                            episodes ever added, never reused; ``- _num_episodes_evicted`` is its
                            position in ``buffer.episodes``)
``t``               int32   timestep within that (agent) episode, 0 = its first stored step
``tree``            int32   prioritized only: the leaf of this row in the sum/min trees
                            (single-agent) or in its module's trees (multi-agent)
``agent``/``module`` int32  multi-agent only: codes into ``replay_meta["rows"]["agent_ids"]`` /
                            ``["module_ids"]``
``obs``             *       the observation *at* t (``observations[t]``; a dict/tuple observation
                            space gives one column per leaf: ``obs/<key>/<index>``)
``action``, ``reward``      ``actions[t]``, ``rewards[t]`` (nested spaces: as ``obs``)
``extra/<key>``             ``extra_model_outputs[key][t]`` (``action_logp``, ``weights_seq_no``...)
=================== ======= ===============================================================

plus the scalar ``layout`` (``"rllib_episode_rows/1"``). Per-row shapes are fixed-shape columns.
Everything a timestep holds that never changes once the buffer has it is in its row. Not in rows:
each episode's *last* observation (episodes hold ``len + 1`` observations: ``obs[len]`` is the
next-observation of the last step and is replaced when a later chunk of a running episode arrives),
lookback data before ``t_started`` (continuation chunks whose start was evicted), and infos (dicts):
those are in ``replay_meta``.

**How row_id is derived, and why it is stable.** A row is identified by its key ``(episode, t)``
(``(episode, agent, t)``): the episode index is a counter RLlib never reuses, and a timestep keeps
its index within its episode forever (episodes only grow at the end: ``concat_episode`` pops the
last observation, appends the new chunk's data, and asserts the boundary observations are equal),
so a key's content never changes while the key is in the buffer. RLlib appends the keys of newly
added timesteps to the *end* of ``_indices`` (and of each module's ``_module_to_indices`` list) and
evicts whole episodes, oldest first (``episodes.popleft()``), filtering their keys out wherever they
are -- so the keys that survive from the previous save come first, in their old order, and all new
keys follow. Each save therefore drops the cached keys of episodes below ``_num_episodes_evicted``,
checks that the current list starts with the survivors, and gives the ``n_new`` keys after them the
ids ``max(previous max + 1, added - n_new) ...`` where ``added`` is RLlib's lifetime counter of
added timesteps (``_num_timesteps_added``; ``_num_agent_timesteps_added`` for multi-agent): a row's
id is then the number of timesteps the buffer had been given before it (exact while nothing was
evicted between two saves, never smaller than the previous max + 1). Old rows keep their ids; ids
are never reused; evicted rows disappear wherever they were. The cache lives beside the buffer (a
weak map); :func:`restore_replay` seeds it from the restored rows, so ids continue after a resume.
If the check fails (a buffer changed behind RLlib's ``add``), unknown keys that form a suffix get
new ids; otherwise every row gets a new id (a full rewrite, logged). A buffer restored from another
run (PBT), from an older version, or a new buffer saved into a run that has versions, gets new ids
for all its rows at its first save, above the newest version's ``next_row_id`` (its old ids could
name other rows there): that save writes the whole buffer once (:func:`capture_algorithm_replay`).

``replay_meta`` -- a nested state of numpy arrays and JSON scalars (no pickle): ``format``,
``buffer_type``, ``config`` (capacity, batch_size_B, batch_length_T, alpha...), ``counters``
(``_num_timesteps``, ``_num_timesteps_added``, ``_num_episodes_evicted``, ``sampled_timesteps``,
``_num_agent_timesteps[_added]``), ``module_counters`` (multi-agent per-module counters), ``rng``
(the ``rng`` generator's bit-generator state), ``metrics`` (the buffer's MetricsLogger state, or
None with the reason in ``not_saved``), ``rows`` (``next_row_id``, ``n_rows``, the agent/module id
tables, each field's structure with column names as leaves, multi-agent: ``env_indices`` (RLlib's
env-step ``_indices``) and ``module_order``), ``spaces`` (the distinct spaces, as
``gym_space_to_dict``), ``episodes`` (columnar, one entry per (agent) episode: key, len, id,
agent/module ids, t_started, t, terminated/truncated, start/last-step times -- exact types --,
space codes, custom_data, extra-model-output keys; per field: lookback, finalized, space, list
kind, data length and the head (lookback) + tail (the last observation) data per column; infos:
lookback, length and the entries that are not ``{}``), ``ma_episodes`` (multi-agent: per episode
its agents, agent-to-module mapping, spaces, env_t(_started), agent_t_started, env_t_to_agent_t,
hanging actions/rewards/extra outputs, flags, times, custom_data), ``priority`` (prioritized: the
sum-tree leaf of every row with its exact Python/numpy type (``{"v", "k", "kinds"}``; the min-tree
leaves are ``{"same_as_sum": True}`` -- RLlib sets both to the same value -- or their own),
``_max_priority``, ``_max_idx``, the free-node deque as ``prefix + range(start, stop)``,
``_last_sampled_indices``, the tree capacity; multi-agent: the same for the env-step trees (leaves
aligned with ``env_indices``), ``_sample_idx_to_tree_idx`` as it is, and per module its trees'
row leaves, free nodes, max priority / idx, last sampled, with each map's key order),
``extra_attrs`` (plain attributes of a subclass).

The trees' inner nodes are not stored: every inner node of RLlib's ``SegmentTree`` equals
``op(left child, right child)`` of the current children (``__setitem__`` recomputes the path to the
root), so :func:`restore_replay` recomputes them from the leaves, bit for bit and with the same
Python/numpy types. Leaves that belong to no row must hold the neutral element (0.0 / inf: checked
at every save, by value). ``_tree_idx_to_sample_idx`` (spot-checked at each save: 257 entries),
``episode_id_to_index`` (checked) and the module maps are derived from the rows and episodes.

What is not exact: ``SingleAgentEpisode._last_added_observation`` / ``_last_added_infos`` (used only
while an env runner builds an episode; RLlib's own ``from_state`` drops them too) come back None;
``MultiAgentEpisode.agent_to_module_mapping_fn`` is not stored (a function): the restore sets the
algorithm's ``policy_mapping_fn`` (or the one passed); restored episodes share one gym space object
per distinct space (equal, not separate copies); a multi-agent buffer with non-str agent ids has no
metrics state (RLlib's ``MetricsLogger.get_state`` fails on them): its metrics restart empty. Not
supported (refused by name): agents whose spaces differ in one buffer, non-numpy'ized nested data.
The meta is O(rows) for prioritized buffers (the per-row leaves: 8-9 bytes per row) and for
multi-agent buffers (env-step keys and env-to-agent step maps); for the others it grows only with
episodes and with infos that are not ``{}``.

Cost (2-core VM, 100k-row prioritized CartPole buffer): a capture ~0.15 s after the first (done
episodes are not re-split), a restore ~1.5 s.
"""
from __future__ import annotations

import collections
import itertools
import json
import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tree as dm_tree

from ...errors import RestoreError, UnsupportedTypeError
from .conversion import from_storable, to_storable
from .names import log

LAYOUT = "rllib_episode_rows/1"
META_FORMAT = "ray_ckpt.rllib.replay/1"

_COL = {"observations": "obs", "actions": "action", "rewards": "reward"}
_FIELDS = ("observations", "actions", "rewards")
_EXTRA = "extra/"
_SKIP = -1  # MultiAgentEpisode.SKIP_ENV_TS_TAG ("S") in env_t_to_agent_t

# ---------------------------------------------------------------------------- the buffer classes
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


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _attributes(buffer: Any) -> Dict[str, Any]:
    """Every attribute set on the instance (``__dict__`` and the ``__slots__`` of its classes)."""
    out = dict(getattr(buffer, "__dict__", {}))
    if getattr(out.get("update_priorities"), "_ray_ckpt_hook", False):
        del out["update_priorities"]  # replay_incremental's recorder of changed priorities, not buffer state
    for cls in type(buffer).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in out and hasattr(buffer, name):
                out[name] = getattr(buffer, name)
    return out


# ---------------------------------------------------------------------------- exact scalars
def _kind_of(x: Any) -> str:
    t = type(x)
    if x is None:
        return "None"
    if t is bool:
        return "bool"
    if t is int:
        return "int"
    if t is float:
        return "float"
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":
        return "np:" + x.dtype.str
    raise TypeError(t.__qualname__)


def pack_scalars(values: Sequence[Any], what: str) -> Dict[str, Any]:
    """Python / numpy scalars (bool, int, float, None, numpy numbers) -> arrays that restore them with
    their exact values *and types* (a sum-tree leaf that was an ``np.float32`` stays one: the next
    sums are then computed as RLlib computes them). ``{"v": values, "k": codes, "kinds": [...]}``."""
    values = values if isinstance(values, list) else list(values)
    type_kind: Dict[type, str] = {}
    for t in set(map(type, values)):
        x = next(v for v in values if type(v) is t)
        try:
            type_kind[t] = _kind_of(x)
        except TypeError:
            raise UnsupportedTypeError(f"replay buffer: {what}[{values.index(x)}] is a {_type_name(x)}, "
                                       f"not a number") from None
    kinds: Dict[str, int] = {}
    for k in sorted(set(type_kind.values())):
        kinds[k] = len(kinds)
    floaty = any(k == "float" or (k.startswith("np:") and np.dtype(k[3:]).kind == "f") for k in kinds)
    has_none = "None" in kinds
    if floaty:
        v = np.array([np.nan if x is None else x for x in values] if has_none else values, np.float64)
    else:
        v = np.array([0 if x is None else x for x in values] if has_none else values, np.int64).reshape(len(values))
    out: Dict[str, Any] = {"v": v, "kinds": list(kinds)}
    if len(kinds) > 1:
        code_of = {t: kinds[k] for t, k in type_kind.items()}
        out["k"] = np.fromiter(map(code_of.__getitem__, map(type, values)), np.int8, len(values))
    return out


def _maker(kind: str) -> Callable[[Any], Any]:
    if kind == "None":
        return lambda v: None
    if kind in ("bool", "int", "float"):
        base = {"bool": bool, "int": int, "float": float}[kind]
        return lambda v: base(v.item() if hasattr(v, "item") else v)
    return np.dtype(kind[3:]).type


def unpack_scalars(p: Dict[str, Any]) -> List[Any]:
    """The inverse of :func:`pack_scalars`."""
    v = np.asarray(p["v"])
    kinds = list(p["kinds"])
    if not kinds:
        return []

    def convert(kind: str) -> List[Any]:  # the whole array as Python objects of one kind
        if kind == "None":
            return [None] * len(v)
        if kind in ("int", "float", "bool"):
            base = {"int": int, "float": float, "bool": bool}[kind]
            vals = v.tolist()
            return vals if type(vals[0] if vals else base()) is base else [base(x) for x in vals]
        return list(v.astype(np.dtype(kind[3:]), copy=False))

    if "k" not in p:
        return convert(kinds[0])
    lists = [convert(k) for k in kinds]
    return [lists[c][i] for i, c in enumerate(np.asarray(p["k"]).tolist())]


def _pack_one(x: Any, what: str) -> Dict[str, Any]:
    return pack_scalars([x], what)


def _unpack_one(p: Dict[str, Any]) -> Any:
    return unpack_scalars(p)[0]


# ---------------------------------------------------------------------------- spaces
class _Spaces:
    """gym spaces deduplicated into a table of ``gym_space_to_dict`` dicts (codes per use)."""

    def __init__(self, table: Optional[List[Any]] = None):
        self.table: List[Any] = list(table or [])
        self._index = {json.dumps(d, sort_keys=True, default=str): i for i, d in enumerate(self.table)}
        self._by_id: Dict[int, Tuple[Any, int]] = {}
        self._objs: Dict[int, Any] = {}

    def prune(self) -> None:
        """Drop the id cache (it holds the space objects of episodes that may be evicted by now)."""
        self._by_id.clear()

    def code(self, space: Any) -> int:
        if space is None:
            return -1
        hit = self._by_id.get(id(space))
        if hit is not None and hit[0] is space:
            return hit[1]
        from ray.rllib.utils.serialization import gym_space_to_dict
        d = gym_space_to_dict(space)
        key = json.dumps(d, sort_keys=True, default=str)
        c = self._index.get(key)
        if c is None:
            c = self._index[key] = len(self.table)
            self.table.append(d)
        self._by_id[id(space)] = (space, c)
        return c

    def space(self, code: int) -> Any:
        if code < 0:
            return None
        if code not in self._objs:
            from ray.rllib.utils.serialization import gym_space_from_dict
            self._objs[code] = gym_space_from_dict(self.table[code])
        return self._objs[code]

    def state_dict(self, code: int) -> Any:
        return None if code < 0 else self.table[code]


def _space_tree_to_storable(x: Any, spaces: _Spaces) -> Any:
    """A MultiAgentEpisode's observation_space / action_space: None, a gym space, or a dict of them."""
    import gymnasium as gym
    if x is None:
        return None
    if isinstance(x, gym.spaces.Space):
        return {"space": spaces.code(x)}
    if isinstance(x, dict):
        return {"dict": [(k, _space_tree_to_storable(v, spaces)) for k, v in x.items()]}
    raise UnsupportedTypeError(f"replay buffer: a MultiAgentEpisode space of type {_type_name(x)}")


def _space_tree_from_storable(x: Any, spaces: _Spaces) -> Any:
    if x is None:
        return None
    if "space" in x:
        return spaces.space(int(x["space"]))
    return {k: _space_tree_from_storable(v, spaces) for k, v in x["dict"]}


# ---------------------------------------------------------------------------- episodes -> parts
@dataclass
class _Field:
    """One InfiniteLookbackBuffer of one (agent) episode, split into its timesteps and the rest."""

    name: str                      # "observations", "actions", "rewards", "extra_model_outputs/<key>"
    lookback: int
    finalized: bool
    space: int                     # code in the spaces table, -1: None
    list_kind: int                 # 0: numpy data; 1: a list of Python scalars; 2: a list of numpy items
    data_len: int
    template: Any = None           # the data's structure with column names as leaves (None: empty)
    body: Dict[str, np.ndarray] = field(default_factory=dict)   # column -> (n, ...) the timesteps
    edge: Dict[str, np.ndarray] = field(default_factory=dict)   # column -> head (lookback) + tail


def _col_name(prefix: str, path: Tuple[Any, ...]) -> str:
    return prefix + "".join(f"/{p}" for p in path)


def _split_field(name: str, prefix: str, buf: Any, n: int, spaces: _Spaces, where: str) -> _Field:
    data, lookback = buf.data, int(buf.lookback)
    list_kind = 0
    if isinstance(data, list):
        if not data:
            if n:
                raise UnsupportedTypeError(f"replay buffer: {where} {name}: no data for {n} timesteps")
            return _Field(name, lookback, bool(buf.finalized), spaces.code(buf.space), 1, 0)
        types = {type(x) for x in data}
        if len(types) == 1 and next(iter(types)) in (int, float, bool):
            list_kind = 1
        elif all(isinstance(x, (np.ndarray, np.generic)) for x in data):
            list_kind = 2
        else:
            raise UnsupportedTypeError(
                f"replay buffer: {where} {name}: not numpy'ized data holding {sorted(t.__name__ for t in types)} "
                f"(ray_ckpt stores episodes whose data is numpy, or lists of numbers/arrays)")
        data = np.asarray(data)
        if data.dtype.hasobject:
            raise UnsupportedTypeError(f"replay buffer: {where} {name}: ragged or object data")
    total = None
    template_leaves = []
    body, edge = {}, {}
    for path, leaf in dm_tree.flatten_with_path(data):
        if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject or leaf.dtype.kind not in "biuf":
            raise UnsupportedTypeError(
                f"replay buffer: {where} {name}{''.join(f'[{p!r}]' for p in path)}: a "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)} leaf (stored: bool/int/float arrays)")
        if total is None:
            total = leaf.shape[0]
        if leaf.shape[0] != total or total < lookback + n:
            raise UnsupportedTypeError(f"replay buffer: {where} {name}: {total} items for lookback {lookback} + "
                                       f"{n} timesteps")
        col = _col_name(prefix, tuple(path))
        template_leaves.append(col)
        body[col] = leaf[lookback:lookback + n]
        edge[col] = leaf[:lookback] if total == lookback + n else np.concatenate([leaf[:lookback],
                                                                                  leaf[lookback + n:]])
    template = dm_tree.unflatten_as(data, template_leaves) if not isinstance(data, np.ndarray) else template_leaves[0]
    return _Field(name, lookback, bool(buf.finalized), spaces.code(buf.space), list_kind, int(total or 0),
                  template, body, edge)


@dataclass
class _EpisodeParts:
    """One (agent) episode: its scalars and its fields."""

    key: Tuple[int, int]            # (episode index, agent code; -1 single-agent)
    n: int
    done: bool
    scalars: Dict[str, Any]
    fields: List[_Field]
    emo_keys: List[str]
    infos: Dict[str, Any]


_EP_SCALARS = ("agent_id", "module_id", "multi_agent_episode_id")
_EP_NUMBERS = ("is_terminated", "is_truncated", "t_started", "t", "_start_time", "_last_step_time")


def _split_episode(ep: Any, key: Tuple[int, int], spaces: _Spaces, where: str) -> _EpisodeParts:
    n = len(ep)
    if n != ep.t - ep.t_started:
        raise UnsupportedTypeError(f"replay buffer: {where}: len {n} != t - t_started")
    fields = [_split_field(f, _COL[f], getattr(ep, f), n, spaces, where) for f in _FIELDS]
    emo = ep.extra_model_outputs
    keys = list(emo.keys())
    for k in keys:
        if not isinstance(k, str):
            raise UnsupportedTypeError(f"replay buffer: {where}: extra_model_outputs key {k!r} is not a str")
        fields.append(_split_field(f"extra_model_outputs/{k}", _EXTRA + k, emo[k], n, spaces, where))
    infos = ep.infos
    if infos.finalized or not isinstance(infos.data, list):
        raise UnsupportedTypeError(f"replay buffer: {where}: numpy'ized infos")
    sparse = [(i, x) for i, x in enumerate(infos.data) if not (type(x) is dict and not x)]
    scalars = {k: getattr(ep, k) for k in _EP_SCALARS}
    scalars.update({k: getattr(ep, k) for k in _EP_NUMBERS})
    scalars["id_"] = ep.id_
    scalars["obs_space"] = spaces.code(ep._observation_space)
    scalars["act_space"] = spaces.code(ep._action_space)
    scalars["custom_data"] = ep._custom_data
    return _EpisodeParts(key, n, bool(ep.is_done), scalars, fields, keys,
                         {"lookback": int(infos.lookback), "len": len(infos.data), "sparse": sparse,
                          "space": spaces.code(infos.space)})


# ---------------------------------------------------------------------------- index lists -> row ids
class _IndexList:
    """The cached keys of one RLlib index list (``_indices``, or one module's ``_module_to_indices``)
    as of the last save, with their row ids: only the keys added since are converted each save."""

    def __init__(self, width: int):
        self.keys = np.empty((0, width), np.int64)
        self.ids = np.empty(0, np.int64)


class RowIds:
    """Row ids of one buffer across saves (see the module docstring). Kept beside the buffer in a
    weak map by :func:`capture_replay`; seeded by :func:`restore_replay`."""

    def __init__(self) -> None:
        self.lists: Dict[Any, _IndexList] = {}
        self.next_id = 0
        self.agents: List[Any] = []        # agent id table (multi-agent); codes are positions
        self.modules: List[Any] = []
        self._agent_code: Dict[Any, int] = {}
        self._module_code: Dict[Any, int] = {}
        self.full_rewrites = 0
        self.spaces = _Spaces()  # append-only table of the spaces met so far (codes stay valid)
        # (episode, agent) -> (episode object, its parts) of the last capture: a done episode never
        # changes (RLlib only concatenates to running ones), so its parts are reused, not re-split
        self.parts: Dict[Tuple[int, int], Tuple[Any, "_EpisodeParts"]] = {}
        self.restored_from: Optional[Tuple[str, int]] = None  # (run, version) restore_replay read
        self.checked_run: Optional[str] = None  # the run whose newest version these ids were checked against
        self.inc: Any = None  # single-agent buffers: replay_incremental.Incremental of the last capture
        self.floors: Optional[Dict[str, int]] = None  # where the episode / priority logs' ids start anew

    def renumber(self, floor: int, floors: Optional[Dict[str, int]] = None) -> None:
        """Forget every row's id: the next capture gives all rows new ids, at or above ``floor`` (and
        writes the episode and priority logs anew, their ids at or above ``floors``)."""
        self.lists.clear()
        self.next_id = max(self.next_id, int(floor))
        self.full_rewrites += 1
        inc = self.inc
        self.floors = {"chunk": max(int((floors or {}).get("chunk", 0)), inc.next_chunk if inc else 0),
                       "log": max(int((floors or {}).get("log", 0)), inc.next_log if inc else 0)}
        self.inc = None

    def agent_code(self, aid: Any) -> int:
        c = self._agent_code.get(aid)
        if c is None:
            c = self._agent_code[aid] = len(self.agents)
            self.agents.append(aid)
        return c

    def module_code(self, mid: Any) -> int:
        c = self._module_code.get(mid)
        if c is None:
            c = self._module_code[mid] = len(self.modules)
            self.modules.append(mid)
        return c

    def seed(self, agents: List[Any], modules: List[Any], next_id: int) -> None:
        for a in agents:
            self.agent_code(a)
        for m in modules:
            self.module_code(m)
        self.next_id = int(next_id)

    def update(self, name: Any, current: List[tuple], width: int, encode: Callable[[tuple], tuple],
               evicted: int) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """(keys (n, width), ids with -1 for new keys, positions of the new keys) of ``current``."""
        lst = self.lists.setdefault(name, _IndexList(width))
        keep = lst.keys[:, 0] >= evicted
        keys, ids = lst.keys[keep], lst.ids[keep]
        s = len(keys)
        ok = len(current) >= s and (s == 0 or (tuple(encode(current[0])) == tuple(keys[0])
                                               and tuple(encode(current[s - 1])) == tuple(keys[s - 1])))
        if ok:
            tail = current[s:]
            new = np.array([encode(x) for x in tail], np.int64).reshape(len(tail), width)
            return np.concatenate([keys, new]), np.concatenate([ids, np.full(len(tail), -1, np.int64)]), None
        # slow path: the list changed other than by RLlib's add (appends + evictions)
        allk = np.array([encode(x) for x in current], np.int64).reshape(len(current), width)
        known = {tuple(k): i for k, i in zip(lst.keys.tolist(), lst.ids.tolist())}
        got = np.array([known.get(tuple(k), -1) for k in allk.tolist()], np.int64)
        unknown = np.flatnonzero(got < 0)
        if len(unknown) and (unknown[0] != len(got) - len(unknown) or np.any(np.diff(got[got >= 0]) <= 0)):
            self.full_rewrites += 1
            log.warning("ray_ckpt: replay buffer index list %r was changed other than by appends and evictions: "
                        "all its %d rows get new row ids (this save rewrites them)", name, len(got))
            got[:] = -1
        return allk, got, None

    def commit(self, name: Any, keys: np.ndarray, ids: np.ndarray) -> None:
        lst = self.lists[name]
        lst.keys, lst.ids = keys, ids


_TRACKERS: "weakref.WeakKeyDictionary[Any, RowIds]" = weakref.WeakKeyDictionary()


def row_ids_of(buffer: Any) -> RowIds:
    """The row-id state kept for ``buffer`` (created empty on first use)."""
    try:
        return _TRACKERS.setdefault(buffer, RowIds())
    except TypeError:  # pragma: no cover - an unhashable / not weak-referenceable subclass
        raise UnsupportedTypeError(f"replay buffer of type {_type_name(buffer)} cannot be tracked (no weakref)")


# ---------------------------------------------------------------------------- trees and free lists
def _tree_leaves(tree: Any, idx: np.ndarray, what: str) -> Dict[str, Any]:
    if len(idx) == 0:
        return pack_scalars([], what)
    got = operator.itemgetter(*(idx + tree.capacity).tolist())(tree.value)
    return pack_scalars(list(got) if len(idx) > 1 else [got], what)


def _check_neutral(tree: Any, used: np.ndarray, what: str) -> None:
    """Leaves that belong to no row must hold the neutral element (else they could not be rebuilt)."""
    cap = tree.capacity
    leaves = np.fromiter(itertools.islice(tree.value, cap, 2 * cap), np.float64, cap)
    mask = np.ones(cap, bool)
    mask[used] = False
    bad = np.flatnonzero(mask & (leaves != tree.neutral_element))
    if len(bad):
        raise UnsupportedTypeError(f"replay buffer: {what}: leaves {bad[:5].tolist()} belong to no stored timestep "
                                   f"but hold {leaves[bad[:5]].tolist()} (expected {tree.neutral_element}): the "
                                   f"tree cannot be rebuilt from its rows")


def _rebuild_tree(tree: Any, idx: np.ndarray, packed: Dict[str, Any]) -> None:
    """The tree's values from its row leaves: the leaves, then every inner node as ``op(left, right)``
    of its children, as RLlib's ``__setitem__`` leaves them (same values, same Python/numpy types)."""
    cap = tree.capacity
    neutral = tree.neutral_element
    kinds = set(packed["kinds"])
    v = np.asarray(packed["v"])
    if kinds <= {"float", "np:<f8"} and type(neutral) is float and not np.isnan(v).any():
        tree.value = _rebuild_tree_f64(tree, idx, v, packed)
        return
    value = [neutral] * (2 * cap)
    for i, x in zip(idx.tolist(), unpack_scalars(packed)):
        value[cap + i] = x
    op = tree.operation
    for i in range(cap - 1, 0, -1):
        value[i] = op(value[2 * i], value[2 * i + 1])
    tree.value = value


def _rebuild_tree_f64(tree: Any, idx: np.ndarray, v: np.ndarray, packed: Dict[str, Any]) -> List[Any]:
    """:func:`_rebuild_tree` for leaves that are Python floats / ``np.float64`` (what RLlib's trees
    hold with float64 priorities), level by level in numpy: a Python float add and an ``np.float64``
    add are the same IEEE double add, so the values are identical; an inner node is an ``np.float64``
    where RLlib's would be one (sum: a child is; min: the child ``min`` returns is)."""
    cap = tree.capacity
    vals = np.full(2 * cap, tree.neutral_element, np.float64)
    is_np = np.zeros(2 * cap, bool)
    vals[cap + idx] = v
    kinds = list(packed["kinds"])
    if "k" in packed:
        is_np[cap + idx] = np.asarray(packed["k"]) == kinds.index("np:<f8")
    elif kinds == ["np:<f8"]:
        is_np[cap + idx] = True
    is_sum = tree.operation is operator.add
    lo = cap
    while lo > 1:
        hi, lo = lo, lo // 2
        left, right = vals[2 * lo:2 * hi:2], vals[2 * lo + 1:2 * hi:2]
        lnp, rnp = is_np[2 * lo:2 * hi:2], is_np[2 * lo + 1:2 * hi:2]
        if is_sum:
            vals[lo:hi] = left + right
            is_np[lo:hi] = lnp | rnp
        else:  # Python's min(a, b) returns a unless b < a
            take_right = right < left
            vals[lo:hi] = np.where(take_right, right, left)
            is_np[lo:hi] = np.where(take_right, rnp, lnp)
    as_float = vals.tolist()
    as_np = list(vals)
    out = [as_np[i] if f else as_float[i] for i, f in enumerate(is_np.tolist())]
    out[0] = tree.neutral_element  # index 0 is never written by RLlib
    return out


def _free_nodes_state(dq: Any) -> Dict[str, Any]:
    """A free-node deque as ``prefix + range(start, stop)``: RLlib pops free nodes from the left and
    puts freed ones back on the left, so the deque is the freed nodes (LIFO) followed by the part of
    the initial ``range(2 * tree_capacity)`` not handed out yet."""
    n = len(dq)
    stop = dq.maxlen if dq.maxlen is not None else (max(dq) + 1 if n else 0)
    k = 0
    prefix = []
    for k, x in enumerate(dq):
        if x == stop - (n - k):
            break
        prefix.append(x)
    else:
        k = n
    start = stop - (n - k)
    if n - k <= 65536:
        tail_ok = list(itertools.islice(dq, k, n)) == list(range(start, stop))
    else:  # spot checks (indexing a deque's middle is not O(1)); RLlib's add/evict keep the invariant
        tail_ok = all(dq[k + j] == start + j for j in np.linspace(0, n - k - 1, 17).astype(int).tolist())
    if not tail_ok:
        return {"all": np.array(list(dq), np.int64), "maxlen": dq.maxlen}
    return {"prefix": np.array(prefix, np.int64), "start": int(start), "stop": int(stop), "maxlen": dq.maxlen}


def _free_nodes_from(st: Dict[str, Any]) -> collections.deque:
    maxlen = st["maxlen"]
    if "all" in st:
        return collections.deque(np.asarray(st["all"]).tolist(), maxlen=maxlen)
    items = np.asarray(st["prefix"]).tolist() + list(range(int(st["start"]), int(st["stop"])))
    return collections.deque(items, maxlen=maxlen)


def _scalar_state(x: Any, what: str) -> Any:
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, np.generic):
        return x
    raise UnsupportedTypeError(f"replay buffer: {what} is a {_type_name(x)}")


# ---------------------------------------------------------------------------- capture
def handled_attrs(kind: _Kind) -> set:
    """The buffer attributes this module stores (every other one must be a plain value: extra_attrs)."""
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


def capture_replay(buffer: Any, *, row_ids: Optional[RowIds] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(replay, replay_meta)`` of ``buffer`` (see the module docstring). The buffer is not changed;
    its row-id cache (:func:`row_ids_of`) is advanced. Raises UnsupportedTypeError naming the buffer
    type and the attribute or episode field it cannot store."""
    kind = buffer_kind(buffer)
    rid = row_ids if row_ids is not None else row_ids_of(buffer)
    if not kind.multi_agent:  # single-agent buffers: captured incrementally (replay_incremental.py)
        from .replay_incremental import capture_states, states_to_v1
        return states_to_v1(capture_states(buffer, rid), seed=False)[:2]
    attrs = _attributes(buffer)
    handled = handled_attrs(kind)
    bname = _type_name(buffer)
    evicted = int(buffer._num_episodes_evicted)
    spaces = rid.spaces
    cached, now = rid.parts, {}

    def split(ep: Any, key: Tuple[int, int], done: bool, where: str) -> _EpisodeParts:
        hit = cached.get(key)
        parts = hit[1] if hit is not None and hit[0] is ep and hit[1].done and done else \
            _split_episode(ep, key, spaces, where)
        now[key] = (ep, parts)
        return parts

    meta = common_meta(buffer, attrs, bname, META_FORMAT)

    # ---- episodes, their (agent) episodes in record order
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
        if kind.multi_agent:
            ma_eps.append(_ma_episode_state(ep, rid, spaces, f"{bname} episode {e}"))
            for aid, sa in ep.agent_episodes.items():
                parts.append(split(sa, (e, rid.agent_code(aid)), bool(ep.is_done),
                                   f"{bname} episode {e} agent {aid!r}"))
        else:
            parts.append(split(ep, (e, -1), True, f"{bname} episode {e}"))

    # ---- rows: keys and ids
    if kind.multi_agent:
        keys, ids, lists_meta = _ma_rows(buffer, rid, evicted, kind)
    else:
        width = 3 if kind.prioritized else 2
        keys, ids = _update_ids(rid, buffer, [("_indices", buffer._indices, width, tuple)], evicted,
                                int(buffer._num_timesteps_added))
        lists_meta = {}
    n_rows = len(ids)

    # ---- row data: gather each row's timestep from its episode's body
    rec_of = {p.key: r for r, p in enumerate(parts)}
    if kind.multi_agent:
        row_rec = np.array([rec_of.get((int(e), int(a)), -1) for e, a in zip(keys[:, 0], keys[:, 1])], np.int64) \
            if n_rows else np.empty(0, np.int64)
        row_t = keys[:, 2] if n_rows else np.empty(0, np.int64)
    else:
        row_rec = keys[:, 0] - evicted
        row_t = keys[:, 1]
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
    if kind.multi_agent:
        replay["agent"] = _int32(keys[:, 1], "agent")
        replay["t"] = _int32(keys[:, 2], "t")
        replay["module"] = _int32(keys[:, 3], "module")
        if kind.prioritized:
            replay["tree"] = _int32(keys[:, 4], "tree")
    else:
        replay["t"] = _int32(keys[:, 1], "t")
        if kind.prioritized:
            replay["tree"] = _int32(keys[:, 2], "tree")
    columns, templates, field_meta = _columns(parts, bname)
    for col, pieces in columns.items():
        if n_rows:
            replay[col] = np.concatenate(pieces)[gather] if len(pieces) > 1 else pieces[0][gather]
        else:
            replay[col] = np.concatenate(pieces) if pieces else np.empty(0)
    replay["layout"] = LAYOUT

    meta["rows"] = {"next_row_id": int(rid.next_id), "n_rows": int(n_rows), "agent_ids": list(rid.agents),
                    "module_ids": list(rid.modules), "templates": templates, **lists_meta}
    meta["episodes"] = _episode_table(parts, field_meta, bname)
    meta["spaces"] = spaces.table
    if kind.multi_agent:
        meta["ma_episodes"] = ma_eps
    if kind.prioritized:
        meta["priority"] = _priority_state(buffer, kind, replay, rid, bname)
    meta["module_counters"] = {k: [(m, _scalar_state(v, k)) for m, v in attrs[k].items()]
                               for k in _MA_MODULE_COUNTERS if k in attrs}
    meta["extra_attrs"] = extra_attrs(attrs, handled, bname)
    rid.parts = now
    spaces.prune()
    return replay, meta


def _int32(a: np.ndarray, what: str) -> np.ndarray:
    """An index column as int32 (8 bytes less per row than RLlib's Python ints as int64)."""
    if len(a) and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise UnsupportedTypeError(f"replay buffer: column {what!r} holds values beyond int32")
    return a.astype(np.int32)


def _same_leaves(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """``b`` (a min tree's row leaves), or a marker where it equals ``a`` (the sum tree's): RLlib sets
    both trees' leaf of a row to the same value, so this halves the per-row meta."""
    same = (list(a["kinds"]) == list(b["kinds"]) and np.array_equal(a["v"], b["v"], equal_nan=True)
            and ("k" in a) == ("k" in b) and ("k" not in a or np.array_equal(a["k"], b["k"])))
    return {"same_as_sum": True} if same else b


def _leaves_of(packed: Dict[str, Any], sum_packed: Dict[str, Any]) -> Dict[str, Any]:
    return sum_packed if packed.get("same_as_sum") else packed


def _update_ids(rid: RowIds, buffer: Any, lists: List[Tuple[Any, List[tuple], int, Callable]], evicted: int,
                added: int) -> Tuple[np.ndarray, np.ndarray]:
    """Keys and ids of the rows of ``lists`` (concatenated; new keys get new ids, list by list)."""
    got = [(name, *rid.update(name, cur, width, enc, evicted)) for name, cur, width, enc in lists]
    n_new = sum(int(np.sum(ids < 0)) for _, _, ids, _ in got)
    start = max(rid.next_id, added - n_new)
    out_k, out_i = [], []
    for name, keys, ids, _ in got:
        new = ids < 0
        k = int(np.sum(new))
        ids = ids.copy()
        ids[new] = np.arange(start, start + k, dtype=np.int64)
        start += k
        rid.commit(name, keys, ids)
        out_k.append(keys)
        out_i.append(ids)
    rid.next_id = start
    keys = np.concatenate(out_k) if out_k else np.empty((0, 2), np.int64)
    ids = np.concatenate(out_i) if out_i else np.empty(0, np.int64)
    return keys, ids


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
    keys, ids = keys[order], ids[order]
    # the env-step level index list is meta (its entries are env steps, not agent timesteps)
    width = 3 if kind.prioritized else 2
    env = np.array(buffer._indices, np.int64).reshape(len(buffer._indices), width)
    return keys, ids, {"env_indices": env, "module_order": [rid.module_code(m) for m in buffer._module_to_indices]}


def _columns(parts: List[_EpisodeParts], bname: str):
    """Per column: the body pieces of all records (record order; records lacking the column give
    zeros... which cannot happen within one buffer: a field missing from some episodes is refused)."""
    columns: Dict[str, List[np.ndarray]] = {}
    sig: Dict[str, Tuple[Any, Tuple[int, ...]]] = {}
    templates: Dict[str, Any] = {}
    field_meta: Dict[str, List[_Field]] = collections.defaultdict(list)
    for r, p in enumerate(parts):
        for f in p.fields:
            field_meta[f.name].append((r, f))
            if f.template is None:
                continue
            old = templates.setdefault(f.name, f.template)
            if old != f.template:
                raise UnsupportedTypeError(f"replay buffer {bname}: {f.name} of episode {p.key} has the structure "
                                           f"{f.template!r}, other episodes {old!r}")
            for col, arr in f.body.items():
                s = (arr.dtype, arr.shape[1:])
                first = sig.setdefault(col, s)
                if first != s:
                    raise UnsupportedTypeError(
                        f"replay buffer {bname}: column {col!r} of episode {p.key} is {s[0]}{list(s[1])}, other "
                        f"episodes' {first[0]}{list(first[1])} (agents with different spaces in one buffer are not "
                        f"supported yet)")
                columns.setdefault(col, []).append(arr)
    # every record must contribute to every column it has timesteps for
    for col, pieces in columns.items():
        n = sum(len(x) for x in pieces)
        total = sum(p.n for p in parts if any(col in f.body for f in p.fields))
        if n != total or total != sum(p.n for p in parts):
            raise UnsupportedTypeError(f"replay buffer {bname}: column {col!r} is missing from some episodes "
                                       f"(extra_model_outputs keys differ between episodes)")
    return columns, templates, field_meta


def _episode_table(parts: List[_EpisodeParts], field_meta: Dict[str, List[Tuple[int, _Field]]],
                   bname: str) -> Dict[str, Any]:
    """One entry per record, columnar."""
    E = len(parts)
    t: Dict[str, Any] = {"n": E,
                         "key": np.array([p.key for p in parts], np.int64).reshape(E, 2),
                         "len": np.array([p.n for p in parts], np.int64),
                         "id": [p.scalars["id_"] for p in parts]}
    for k in _EP_SCALARS:
        vals = [p.scalars[k] for p in parts]
        t[k] = vals if any(v is not None for v in vals) else None
    for k in _EP_NUMBERS:
        t[k] = pack_scalars([p.scalars[k] for p in parts], f"episode {k}")
    t["obs_space"] = np.array([p.scalars["obs_space"] for p in parts], np.int64)
    t["act_space"] = np.array([p.scalars["act_space"] for p in parts], np.int64)
    t["custom_data"] = [(r, to_storable(p.scalars["custom_data"], "replay_meta.custom_data"))
                        for r, p in enumerate(parts) if p.scalars["custom_data"]]
    keysets: Dict[Tuple[str, ...], int] = {}
    t["emo_keys"] = np.array([keysets.setdefault(tuple(p.emo_keys), len(keysets)) for p in parts], np.int64)
    t["emo_keysets"] = [list(k) for k in keysets]
    fields = {}
    for name, entries in field_meta.items():
        rec = np.array([r for r, _ in entries], np.int64)
        fs = [f for _, f in entries]
        edge_cols: Dict[str, List[np.ndarray]] = {}
        for f in fs:
            for col, arr in f.edge.items():
                edge_cols.setdefault(col, []).append(arr)
        fields[name] = {
            "rec": rec,
            "lookback": np.array([f.lookback for f in fs], np.int64),
            "finalized": np.array([f.finalized for f in fs], bool),
            "space": np.array([f.space for f in fs], np.int64),
            "list_kind": np.array([f.list_kind for f in fs], np.int8),
            "data_len": np.array([f.data_len for f in fs], np.int64),
            "edge": {c: np.concatenate(v) for c, v in edge_cols.items()},
        }
    t["fields"] = fields
    infos = {"lookback": np.array([p.infos["lookback"] for p in parts], np.int64),
             "len": np.array([p.infos["len"] for p in parts], np.int64),
             "space": np.array([p.infos["space"] for p in parts], np.int64),
             "sparse": [(r, i, to_storable(x, "replay_meta.infos")) for r, p in enumerate(parts)
                        for i, x in p.infos["sparse"]]}
    t["infos"] = infos
    return t


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


def _priority_state(buffer: Any, kind: _Kind, replay: Dict[str, Any], rid: RowIds, bname: str) -> Dict[str, Any]:
    """Leaves per row (and per env step, multi-agent), plus the trees' small state."""
    out: Dict[str, Any] = {"max_priority": _pack_one(buffer._max_priority, "_max_priority"),
                           "max_idx": int(buffer._max_idx),
                           "free_nodes": _free_nodes_state(buffer._free_nodes),
                           "last_sampled": [int(i) for i in buffer._last_sampled_indices],
                           "tree_capacity": int(buffer._sum_segment.capacity)}
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
        maps = ("_module_to_max_priority", "_module_to_sum_segment", "_module_to_min_segment",
                "_module_to_free_nodes", "_module_to_max_idx", "_module_to_tree_idx_to_sample_idx",
                "_module_to_last_sampled_indices")
        # each map's own key order (dicts keep insertion order; RLlib's defaultdicts add keys on reads)
        out["module_key_order"] = {k: [rid.module_code(m) for m in getattr(buffer, k)] for k in maps}
        seen: Dict[Any, None] = {}
        for k in maps:
            seen.update(dict.fromkeys(getattr(buffer, k)))
        for mid in seen:
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
                m["min_is_sum_tree"] = type(mt).__name__ == "SumSegmentTree"
                _check_neutral(mt, t_m, f"{bname} module {mid!r} min tree")
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


pos0 = np.empty(0, np.int64)


def _check_maps(mapping: Dict[int, int], tidx: np.ndarray, what: str) -> None:
    """``mapping`` must be {tree index of entry i: i} (it is then rebuilt from the rows)."""
    if len(mapping) != len(tidx):
        raise UnsupportedTypeError(f"replay buffer: {what} has {len(mapping)} entries for {len(tidx)} indices")
    # spot checks (evenly spaced, first and last): RLlib's add/evict keep this map in step with the
    # index list; a full check per save would cost O(rows) of Python on the training thread
    pos = np.unique(np.linspace(0, len(tidx) - 1, min(len(tidx), 257)).astype(np.int64)) if len(tidx) else pos0
    got = np.fromiter((mapping.get(t, -1) for t in tidx[pos].tolist()), np.int64, len(pos))
    bad = pos[got != pos]
    if len(bad):
        i = int(bad[0])
        raise UnsupportedTypeError(f"replay buffer: {what}[{int(tidx[i])}] is {mapping.get(int(tidx[i]))}, "
                                   f"expected {i}")


# ---------------------------------------------------------------------------- restore
def restore_replay(buffer: Any, replay: Dict[str, Any], meta: Dict[str, Any], *,
                   agent_to_module_mapping_fn: Optional[Callable] = None) -> None:
    """Set ``buffer`` (a fresh buffer of the same type and capacity, e.g. the one a new Algorithm built
    from the same config made) to the saved state: episodes, indices, counters, priorities and trees,
    the sampling generator, metrics. Raises RestoreError naming what does not fit (nothing is changed
    then: the new state is built completely before it is assigned)."""
    kind = buffer_kind(buffer)
    meta = from_storable(meta)
    bname = _type_name(buffer)
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
    spaces = _Spaces(meta["spaces"])
    n_rows = int(meta["rows"]["n_rows"])
    ids = np.asarray(replay["row_id"], np.int64)
    if len(ids) != n_rows or (n_rows > 1 and np.any(np.diff(ids) <= 0)):
        raise RestoreError(f"replay has {len(ids)} rows (meta says {n_rows}) or row ids that do not increase")
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
    # index lists
    if kind.multi_agent:
        env = np.asarray(meta["rows"]["env_indices"], np.int64)
        new["_indices"] = [tuple(r) for r in env.tolist()]
        mti = collections.defaultdict(list)  # type of RLlib's: a defaultdict(list)
        cols = [replay["episode"], replay["agent"], replay["t"]] + ([replay["tree"]] if kind.prioritized else [])
        mcodes = np.asarray(replay["module"])
        for mc in meta["rows"]["module_order"]:
            rows = np.flatnonzero(mcodes == mc)
            mti[modules[mc]] = [(int(r[0]), agents[int(r[1])], *map(int, r[2:]))
                                for r in np.stack([np.asarray(c)[rows] for c in cols], 1).tolist()]
        new["_module_to_indices"] = _like(buffer._module_to_indices, mti)
    else:
        cols = [replay["episode"], replay["t"]] + ([replay["tree"]] if kind.prioritized else [])
        new["_indices"] = [tuple(r) for r in np.stack([np.asarray(c, np.int64) for c in cols], 1).tolist()] \
            if n_rows else []
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
    _TRACKERS[buffer] = rid


def _like(template: Any, values: Dict[Any, Any]) -> Any:
    """``values`` as the same kind of mapping as ``template`` (a defaultdict keeps its factory)."""
    if isinstance(template, collections.defaultdict):
        return collections.defaultdict(template.default_factory, values)
    return dict(values)


def _rebuild_records(replay: Dict[str, Any], table: Dict[str, Any], templates: Dict[str, Any], spaces: _Spaces,
                     kind: _Kind, evicted: int, bname: str) -> Dict[Tuple[int, int], Any]:
    """(episode, agent code) -> rebuilt SingleAgentEpisode."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    E = int(table["n"])
    keys = np.asarray(table["key"], np.int64).reshape(E, 2)
    lens = np.asarray(table["len"], np.int64)
    n_rows = len(replay["row_id"])
    # rows -> record positions, then sort by (record, t)
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
    fields = table["fields"]
    # per field: record -> position in that field's arrays, and edge offsets
    fpos: Dict[str, Dict[int, int]] = {}
    eoff: Dict[str, np.ndarray] = {}
    for name, f in fields.items():
        rec = np.asarray(f["rec"], np.int64).tolist()
        fpos[name] = {r: i for i, r in enumerate(rec)}
        lk = np.asarray(f["lookback"], np.int64)
        dl = np.asarray(f["data_len"], np.int64)
        ln = lens[np.asarray(f["rec"], np.int64)] if len(rec) else np.zeros(0, np.int64)
        edge_len = np.where(dl > 0, dl - ln, 0)
        eoff[name] = np.concatenate([[0], np.cumsum(edge_len)])
    sorted_cols = {c: np.asarray(v)[order] for c, v in replay.items()
                   if isinstance(v, np.ndarray) and c not in ("row_id", "episode", "t", "tree", "agent", "module")}
    nums = {k: unpack_scalars(table[k]) for k in _EP_NUMBERS}
    custom = {int(r): from_storable(v) for r, v in table["custom_data"]}
    infos = table["infos"]
    sparse_infos: Dict[int, List[Tuple[int, Any]]] = collections.defaultdict(list)
    for r, i, x in infos["sparse"]:
        sparse_infos[int(r)].append((int(i), from_storable(x)))
    keysets = table["emo_keysets"]
    emo_codes = np.asarray(table["emo_keys"], np.int64)
    out: Dict[Tuple[int, int], Any] = {}
    for r in range(E):
        n = int(lens[r])
        s0 = int(starts[r])

        def field_state(name: str) -> Dict[str, Any]:
            f = fields[name]
            i = fpos[name][r]
            lookback = int(f["lookback"][i])
            dl = int(f["data_len"][i])
            lk = int(f["list_kind"][i])
            tmpl = templates.get(name)
            if dl == 0:
                data: Any = [] if lk else None
                if data is None:
                    raise RestoreError(f"replay: empty numpy'ized {name}")
            else:
                a, b = int(eoff[name][i]), int(eoff[name][i + 1])

                def leaf(col: str) -> np.ndarray:
                    edge = np.asarray(f["edge"][col])[a:b]
                    body = sorted_cols[col][s0:s0 + n]
                    return np.concatenate([edge[:lookback], body, edge[lookback:]])
                data = dm_tree.map_structure(leaf, tmpl) if not isinstance(tmpl, str) else leaf(tmpl)
                if lk == 1:
                    data = data.tolist()
                elif lk == 2:
                    data = list(data)
            space_codes[name] = int(f["space"][i])
            return {"data": data, "lookback": lookback, "finalized": bool(f["finalized"][i]), "space": None}

        space_codes: Dict[str, int] = {}  # spaces are set after from_state: one object per distinct space
        il = int(infos["len"][r])
        info_data: List[Any] = [{} for _ in range(il)]
        for i, x in sparse_infos.get(r, ()):
            info_data[i] = x
        st = {
            "id_": table["id"][r],
            "agent_id": table["agent_id"][r] if table["agent_id"] is not None else None,
            "module_id": table["module_id"][r] if table["module_id"] is not None else None,
            "multi_agent_episode_id": (table["multi_agent_episode_id"][r]
                                       if table["multi_agent_episode_id"] is not None else None),
            "observations": field_state("observations"),
            "actions": field_state("actions"),
            "rewards": field_state("rewards"),
            "infos": {"data": info_data, "lookback": int(infos["lookback"][r]), "finalized": False, "space": None},
            "extra_model_outputs": {k: field_state(f"extra_model_outputs/{k}") for k in keysets[int(emo_codes[r])]},
            "_observation_space": None,
            "_action_space": None,
            "custom_data": custom.get(r, {}),
        }
        for k in _EP_NUMBERS:
            st[k] = nums[k][r]
        try:
            ep = SingleAgentEpisode.from_state(st)
        except Exception as exc:
            raise RestoreError(f"replay: episode {tuple(keys[r])} could not be rebuilt: {type(exc).__name__}: "
                               f"{exc}") from None
        ep._observation_space = spaces.space(int(table["obs_space"][r]))
        ep._action_space = spaces.space(int(table["act_space"][r]))
        ep.infos.space = spaces.space(int(infos["space"][r]))
        for name, code in space_codes.items():
            if code >= 0:
                buf = (ep.extra_model_outputs[name.split("/", 1)[1]] if name.startswith("extra_model_outputs/")
                       else getattr(ep, name))
                buf.space = spaces.space(code)
        out[(int(keys[r][0]), int(keys[r][1]))] = ep
    return out


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
    maps = {k: _like(getattr(buffer, k), {}) for k in
            ("_module_to_max_priority", "_module_to_sum_segment", "_module_to_min_segment", "_module_to_free_nodes",
             "_module_to_max_idx", "_module_to_tree_idx_to_sample_idx", "_module_to_last_sampled_indices")}
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


# ---------------------------------------------------------------------------- comparison (tests, checks)
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



# ---------------------------------------------------------------------------- the Algorithm side
REPLAY_STRATEGIES = ("auto", "critical", "best_effort", "off")


def check_replay_strategy(setting: Any) -> None:
    if setting not in REPLAY_STRATEGIES:
        from ...errors import InvalidArgumentError
        raise InvalidArgumentError(f"replay_strategy must be one of {', '.join(map(repr, REPLAY_STRATEGIES))}, "
                                   f"got {setting!r}")


def replay_strategy(setting: str, algorithm: Any):
    """The Strategy the replay states are saved with (None: not saved). ``"auto"``: CRITICAL when the
    algorithm has a local replay buffer (off-policy: DQN, SAC, APPO...), which on-policy algorithms
    (PPO) have not -- after a preemption an off-policy run that lost its buffer restarts from an empty
    one, so a version without it is not a resumable version."""
    from ...types import Strategy
    check_replay_strategy(setting)
    if setting == "off" or replay_buffer_of(algorithm) is None:
        return None
    return Strategy.BEST_EFFORT if setting == "best_effort" else Strategy.CRITICAL


def _row_floor(engine: Any, rid: RowIds, v2: bool = False) -> Optional[int]:
    """Where the ids of a buffer about to be saved into ``engine``'s run must start so that no id
    of the run's newest version is given to another row (None: the ids are that version's own).
    The ids are the run's own only after a restore of its newest version; a buffer restored from an
    older version or another run (a PBT exploit), or a new buffer on a run that has versions, gets
    new ids for all its rows (its next save writes them all once); so does a single-agent buffer
    (``v2``: captured by replay_incremental.py, rows with ``prio`` columns) whose run's newest
    version is of format /1, and the episode / priority logs start at that version's next ids."""
    from .names import REPLAY_META
    metas = sorted(engine.list_checkpoints(), key=lambda m: m.version)
    if not metas:
        return None
    newest = metas[-1]
    if REPLAY_META not in newest.states:
        return None  # the engine checks new rows against the newest version only
    meta = from_storable(engine.load(name=REPLAY_META, version=newest.version))
    from .replay_incremental import META_FORMAT2  # v2: this buffer's captures write format /2
    if rid.restored_from == (engine.run, newest.version) and (meta.get("format") == META_FORMAT2) == v2:
        return None
    # ids of another run / version, or the stored rows have other columns (format /1): all anew
    if meta.get("format") == META_FORMAT2:
        ids = meta["next_ids"]
        rid.floors = {"chunk": int(ids["chunk"]), "log": int(ids["log"])}
        return int(ids["row"])
    rid.floors = None
    return int(meta["rows"]["next_row_id"])


def capture_algorithm_replay(algorithm: Any, out: Dict[str, Any], strategy: Any, engine: Any = None,
                             errors: Optional[Dict[str, str]] = None) -> None:
    """Put ``replay`` and ``replay_meta`` of the algorithm's buffer into ``out``. A BEST_EFFORT one
    that cannot be captured is left out with its reason in ``errors``; a CRITICAL one raises."""
    from ...types import Strategy
    from .names import REPLAY, REPLAY_META
    buf = replay_buffer_of(algorithm)
    try:
        rid = row_ids_of(buf)
        if engine is not None and rid.checked_run != engine.run:
            floor = _row_floor(engine, rid, v2=not buffer_kind(buf).multi_agent)
            if floor is not None:
                log.info("ray_ckpt: run %r: the replay buffer's rows get new row ids from %d (its state is not "
                         "the run's newest version's): this save writes all of them", engine.run, floor)
                rid.renumber(floor, rid.floors)
            rid.checked_run = engine.run
        if buffer_kind(buf).multi_agent:
            out[REPLAY], out[REPLAY_META] = capture_replay(buf, row_ids=rid)
        else:
            from .replay_incremental import capture_states
            out.update(capture_states(buf, rid))
    except Exception as exc:  # best effort: this save goes on without the buffer, the reason logged
        if strategy is Strategy.CRITICAL or errors is None:
            raise
        for name in REPLAY_STATES:
            out.pop(name, None)
        errors[REPLAY] = f"{type(exc).__name__}: {exc}"


REPLAY_APPEND_ONLY = True  # ``replay`` (and the logs) are registered append_only=True: a version writes what is new
REPLAY_STATES = ("replay", "replay_meta", "replay_episodes", "replay_priorities")


def sync_replay_registrations(engine: Any, algorithm: Any, setting: str, pending_now: Dict[str, Any],
                              pending: Callable[[], Dict[str, Any]]) -> None:
    """Register ``replay`` (append-only) and ``replay_meta`` when this save captured them (read from
    ``pending()`` when the engine snapshots), unregister them when it did not."""
    from ...errors import SaveError
    from .names import REPLAY, REPLAY_META
    strat = replay_strategy(setting, algorithm)

    def getter(name: str) -> Callable[[], Any]:
        def get() -> Any:
            try:
                return pending()[name]
            except KeyError:
                raise SaveError(f"RLlib state {name!r} was not captured for this save") from None
        get.__name__ = f"rllib_{name}"
        return get

    for name in REPLAY_STATES:
        if name in pending_now and strat is not None:
            if engine.registered.get(name) != strat:
                engine.register(name, getter(name), strategy=strat, replace=True,
                                append_only=REPLAY_APPEND_ONLY and name != REPLAY_META)
        elif name in engine.registered:
            engine.unregister(name)


def restore_algorithm_replay(algorithm: Any, engine: Any, meta: Any, loaded: Dict[str, Any], states: Dict[str, str],
                             *, strict: bool, enabled: bool) -> None:
    """Restore the version's replay buffer into the algorithm's (called before anything else of the
    algorithm is changed: a buffer that does not fit raises RestoreError with nothing changed). A
    replay state that the version committed but that cannot be read raises with ``strict``; one the
    version does not hold (saved with replay_strategy="off", or a best-effort one that failed) is
    reported in ``states`` and the buffer is left as it is."""
    from .names import REPLAY, REPLAY_META
    buf = replay_buffer_of(algorithm)
    committed = [n for n in (REPLAY, REPLAY_META) if n in meta.states]
    if not enabled:
        for n in committed:
            states[n] = "not restored: restore_replay=False"
        return
    if buf is None:
        for n in committed:
            states[n] = "not restored: the algorithm has no local replay buffer"
        return
    if not committed:
        missing = [n for n in (REPLAY, REPLAY_META) if n in (getattr(meta, "missing", ()) or ())
                   or n in (getattr(meta, "pending", ()) or ())]
        states[REPLAY] = (f"missing: version {meta.version} lists {missing} as not written (best-effort)" if missing
                          else f"missing: version {meta.version} has no replay buffer "
                               f"(saved with replay_strategy='off'?)")
        log.warning("ray_ckpt: run %r version %d: %s; the replay buffer stays empty", engine.run, meta.version,
                    states[REPLAY])
        return
    absent = [n for n in (REPLAY, REPLAY_META) if n not in loaded]
    if absent:
        why = "; ".join(f"{n}: {states.get(n, 'not read')}" for n in absent)
        if strict:
            raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r}: its replay buffer "
                               f"could not be read ({why}); nothing was changed")
        for n in (REPLAY, REPLAY_META):
            states[n] = f"not restored: {why}"
        return
    fn = getattr(algorithm.config, "policy_mapping_fn", None)
    fmt = from_storable(loaded[REPLAY_META]).get("format") if isinstance(loaded[REPLAY_META], dict) else None
    if fmt == META_FORMAT:
        restore_replay(buf, loaded[REPLAY], loaded[REPLAY_META], agent_to_module_mapping_fn=fn)
    else:  # format /2 (replay_incremental.py): the episode and priority logs are read here
        from . import replay_incremental as ri
        got = dict(loaded)
        for n in (ri.REPLAY_EPISODES, ri.REPLAY_PRIORITIES):
            if n in meta.states:
                try:
                    got[n] = engine.load(name=n, version=meta.version)
                except Exception as exc:
                    raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r}: its replay "
                                       f"state {n!r} could not be read ({type(exc).__name__}: {exc}); nothing "
                                       f"was changed") from None
        replay, meta_v1, seeds = ri.states_to_v1(got)
        restore_replay(buf, replay, meta_v1, agent_to_module_mapping_fn=fn)
        ri.seed(row_ids_of(buf), seeds, buf)
        for n in (ri.REPLAY_EPISODES, ri.REPLAY_PRIORITIES):
            if n in got:
                states[n] = "restored"
    row_ids_of(buf).restored_from = (engine.run, int(meta.version))
