"""Exact scalars and gym spaces of a replay buffer as storable values (no pickle).

Scalars keep their Python / numpy *type* as well as their value (a sum-tree leaf that was an
``np.float32`` stays one, so the sums RLlib computes next are the same); spaces are stored once per
distinct space, as ``gym_space_to_dict`` dicts, and referred to by code.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ....errors import UnsupportedTypeError


def type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def kind_of(x: Any) -> str:
    t = type(x)
    if x is None or t is bool or t is int or t is float:
        return "None" if x is None else t.__name__
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":
        return "np:" + x.dtype.str
    raise TypeError(t.__qualname__)


def pack_scalars(values: Sequence[Any], what: str) -> Dict[str, Any]:
    """Python / numpy scalars (bool, int, float, None, numpy numbers) -> arrays that restore them with
    their exact values and types (module docstring): ``{"v": values, "k": codes, "kinds": [...]}``."""
    values = values if isinstance(values, list) else list(values)
    type_kind: Dict[type, str] = {}
    for t in set(map(type, values)):
        x = next(v for v in values if type(v) is t)
        try:
            type_kind[t] = kind_of(x)
        except TypeError:
            raise UnsupportedTypeError(f"replay buffer: {what}[{values.index(x)}] is a {type_name(x)}, "
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


def same_packed(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two :func:`pack_scalars` results hold the same values of the same types (a min
    tree's leaves usually equal the sum tree's: RLlib sets both from one value)."""
    return (list(a["kinds"]) == list(b["kinds"]) and np.array_equal(a["v"], b["v"], equal_nan=True)
            and ("k" in a) == ("k" in b) and ("k" not in a or np.array_equal(a["k"], b["k"])))


def pack_one(x: Any, what: str) -> Dict[str, Any]:
    return pack_scalars([x], what)


def unpack_one(p: Dict[str, Any]) -> Any:
    return unpack_scalars(p)[0]


class Spaces:
    """gym spaces deduplicated into a table of ``gym_space_to_dict`` dicts (codes per use)."""

    def __init__(self, table: Optional[List[Any]] = None):
        self.table: List[Any] = list(table or [])
        self._index = {json.dumps(d, sort_keys=True, default=str): i for i, d in enumerate(self.table)}
        self._by_id: Dict[int, Tuple[Any, int]] = {}
        self._by_key: Dict[Any, int] = {}  # _fingerprint(space) -> code, for spaces met before
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
        fp = _fingerprint(space)
        c = self._by_key.get(fp) if fp is not None else None
        if c is None:
            from ray.rllib.utils.serialization import gym_space_to_dict
            d = gym_space_to_dict(space)
            key = json.dumps(d, sort_keys=True, default=str)
            c = self._index.get(key)
            if c is None:
                c = self._index[key] = len(self.table)
                self.table.append(d)
            if fp is not None:
                self._by_key[fp] = c
        self._by_id[id(space)] = (space, c)
        return c

    def space(self, code: int) -> Any:
        if code < 0:
            return None
        if code not in self._objs:
            from ray.rllib.utils.serialization import gym_space_from_dict
            self._objs[code] = gym_space_from_dict(self.table[code])
        return self._objs[code]


def _fingerprint(space: Any) -> Any:
    """An exact, hashable description of a common gym space (type, shape, dtype, bounds' bytes), or
    None for other kinds. Why: every episode arrives with its own space objects, and serialising
    each one (``gym_space_to_dict`` writes its bounds with ``np.save``) was most of a save's
    episode splitting; equal fingerprints are equal spaces, so they share one table entry."""
    import gymnasium as gym
    t = type(space)
    if t is gym.spaces.Box:
        return ("Box", space.shape, space.dtype.str, space.low.tobytes(), space.high.tobytes())
    if t is gym.spaces.Discrete:
        return ("Discrete", int(space.n), int(space.start))
    if t is gym.spaces.MultiDiscrete:
        return ("MultiDiscrete", space.nvec.shape, space.nvec.tobytes(), space.start.tobytes(), space.dtype.str)
    if t is gym.spaces.MultiBinary:
        return ("MultiBinary", np.asarray(space.n).tobytes())
    if t in (gym.spaces.Dict, gym.spaces.Tuple):
        items = space.spaces.items() if t is gym.spaces.Dict else enumerate(space.spaces)
        parts = tuple((k, _fingerprint(v)) for k, v in items)
        return None if any(v is None for _, v in parts) else (t.__name__, parts)
    return None


def space_tree_to_storable(x: Any, spaces: Spaces) -> Any:
    """A MultiAgentEpisode's observation_space / action_space: None, a gym space, or a dict of them."""
    import gymnasium as gym
    if x is None:
        return None
    if isinstance(x, gym.spaces.Space):
        return {"space": spaces.code(x)}
    if isinstance(x, dict):
        return {"dict": [(k, space_tree_to_storable(v, spaces)) for k, v in x.items()]}
    raise UnsupportedTypeError(f"replay buffer: a MultiAgentEpisode space of type {type_name(x)}")


def space_tree_from_storable(x: Any, spaces: Spaces) -> Any:
    if x is None:
        return None
    if "space" in x:
        return spaces.space(int(x["space"]))
    return {k: space_tree_from_storable(v, spaces) for k, v in x["dict"]}
