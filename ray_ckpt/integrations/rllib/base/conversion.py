"""RLlib state <-> storable state: a lossless conversion into what ray_ckpt's formats store without
pickle, and its inverse.

RLlib state dicts hold a few things the engine's formats (no pickle on the default path) refuse or
would store opaquely; they are converted losslessly, and converted back on restore: dicts with
``None`` / bool / tuple keys (MeanStdFilter keys its single-agent filter by ``None``) become a list
of ``(key, value)`` pairs; ``RunningStat`` arrays, which RLlib serialises as base64 ``np.save``
strings that it reloads with ``allow_pickle=True``, are stored as plain numpy arrays; sets are
tagged lists. Anything else that is not a tensor, array, Arrow table or JSON scalar raises
:class:`~ray_ckpt.UnsupportedTypeError` naming the state and the key path -- nothing is dropped.
``allow_pickle=("metrics",)`` opts a state into pickle instead.

Nothing here imports RLlib: the two RLlib layouts it knows (the ``RunningStat`` state keys and the
``_serialize_ndarray`` string format) are listed, and checked, in :mod:`._rllib_internals`.
"""
from __future__ import annotations

import base64
import collections
import io
import math
import zlib
from typing import Any, Optional

import numpy as np

from ....errors import UnsupportedTypeError
from ....formats.nodes import unsupported_at
from ._rllib_internals import RUNNING_STAT_ARRAYS, RUNNING_STAT_MARKER

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of ray_ckpt
    torch = None

try:
    import pyarrow as pa
except ImportError:  # pragma: no cover
    pa = None

_ITEMS = "__ray_ckpt_items__"   # a dict whose keys the formats do not support: list of (key, value)
_NPY = "__ray_ckpt_npy__"       # an RLlib base64(zlib(np.save)) array string, stored as an array
_SET = "__ray_ckpt_set__"       # a set / frozenset: {_SET: [items], "frozen": bool}
_MARK = "__ray_ckpt_"


def _decode_npy_b64(s: str) -> Optional[np.ndarray]:
    """RLlib's ``_serialize_ndarray`` string -> array, without ever unpickling (None if it is not one)."""
    try:
        a = np.load(io.BytesIO(zlib.decompress(base64.b64decode(s, validate=True))), allow_pickle=False)
    except Exception:
        return None
    return a if isinstance(a, np.ndarray) and not a.dtype.hasobject else None


def _encode_npy_b64(a: np.ndarray) -> str:
    """The inverse, byte-compatible with ``ray.rllib.utils.serialization._serialize_ndarray``."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(a), allow_pickle=False)
    return base64.b64encode(zlib.compress(buf.getvalue())).decode("ascii")


def _new_like(x: dict) -> dict:
    """An empty dict of the same kind (an OrderedDict stays one)."""
    return collections.OrderedDict() if type(x) is collections.OrderedDict else {}


_PLAIN = frozenset((bool, int, float, str, bytes, type(None)))  # what conv() returns as it is


class _ToStorable:
    """One :func:`to_storable` conversion: the state's name (for errors) and whether pickle is allowed."""

    def __init__(self, state_name: str, allow_pickle: bool):
        self.state_name = state_name
        self.allow_pickle = allow_pickle

    def refuse(self, x: Any, path: list, why: str = "") -> UnsupportedTypeError:
        name = self.state_name
        return UnsupportedTypeError(
            f"RLlib state {name!r}: {unsupported_at(x, path, why)}; ray_ckpt stores tensors, numpy arrays, "
            f"Arrow tables, JSON scalars and dicts/lists/tuples of them without pickle. Pass "
            f"allow_pickle=({name!r},) to make_callback / restore_algorithm to store this state with pickle "
            f"(loading it then runs code)")

    def conv_dict(self, x: dict, path: list) -> Any:
        conv = self.conv
        keys_ok = all(type(k) in (str, int) for k in x) and not any(
            isinstance(k, str) and k.startswith(_MARK) for k in x)
        if not keys_ok:
            return {_ITEMS: [(conv(k, path + [k]), conv(v, path + [k])) for k, v in x.items()]}
        running_stat = RUNNING_STAT_MARKER in x
        out = _new_like(x)
        for k, v in x.items():
            if running_stat and k in RUNNING_STAT_ARRAYS and isinstance(v, str):
                arr = _decode_npy_b64(v)
                out[k] = {_NPY: arr} if arr is not None else v
            else:
                # a plain scalar is itself (no call, no key path built: metrics are mostly floats)
                out[k] = v if type(v) in _PLAIN else conv(v, path + [k])
        return out

    def conv(self, x: Any, path: list) -> Any:
        t = type(x)
        if x is None or t in (bool, int, float, str, bytes):
            return x
        if isinstance(x, np.ndarray):
            if (x.dtype.hasobject or x.dtype.fields is not None) and not self.allow_pickle:
                raise self.refuse(x, path, f"numpy dtype {x.dtype}")
            return x
        if isinstance(x, np.generic) and not isinstance(x, np.object_):
            return x
        if torch is not None and (isinstance(x, torch.Tensor) or t is torch.dtype):
            return x
        if pa is not None and isinstance(x, (pa.Table, pa.RecordBatch)):
            return x
        if isinstance(x, dict):
            return self.conv_dict(x, path)
        if t is list:
            return [v if type(v) in _PLAIN else self.conv(v, path + [i]) for i, v in enumerate(x)]
        if t is tuple:
            return tuple(v if type(v) in _PLAIN else self.conv(v, path + [i]) for i, v in enumerate(x))
        if t in (set, frozenset):
            return {_SET: [self.conv(v, path + [i]) for i, v in enumerate(x)], "frozen": t is frozenset}
        if self.allow_pickle:
            return x
        raise self.refuse(x, path, "a deque" if isinstance(x, collections.deque) else "")


def to_storable(obj: Any, state_name: str = "state", allow_pickle: bool = False) -> Any:
    """Convert an RLlib state into what ray_ckpt's formats store without pickle (lossless; see the
    module docstring). Raises UnsupportedTypeError naming ``state_name`` and the key path of the first
    object that has no safe representation (unless ``allow_pickle``: then it is left for pickle)."""
    return _ToStorable(state_name, allow_pickle).conv(obj, [])


def from_storable(obj: Any) -> Any:
    """The inverse of :func:`to_storable`."""
    t = type(obj)
    if t is dict or t is collections.OrderedDict:
        if len(obj) == 1 and _ITEMS in obj:
            return {from_storable(k): from_storable(v) for k, v in obj[_ITEMS]}
        if len(obj) == 1 and _NPY in obj:
            return _encode_npy_b64(obj[_NPY])
        if len(obj) == 2 and _SET in obj and "frozen" in obj:
            items = [from_storable(v) for v in obj[_SET]]
            return frozenset(items) if obj["frozen"] else set(items)
        out = _new_like(obj)
        for k, v in obj.items():
            out[k] = from_storable(v)
        return out
    if t is list:
        return [from_storable(v) for v in obj]
    if t is tuple:
        return tuple(from_storable(v) for v in obj)
    return obj


def deep_equal(a: Any, b: Any) -> bool:
    """Structural, bit-exact equality of two storable states (arrays compared by dtype, shape, bytes)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a2, b2 = np.asarray(a), np.asarray(b)
        return (a2.dtype == b2.dtype and a2.shape == b2.shape
                and np.ascontiguousarray(a2).tobytes() == np.ascontiguousarray(b2).tobytes())
    if torch is not None and isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b
