"""Nested state <-> (JSON structure, flat list of byte arrays, list of Arrow tables).

The structure is plain JSON so it can live in a safetensors header and be read without executing
code. Every leaf is encoded so that it comes back with the same Python type: integer dict keys stay
integers, tuples stay tuples, floats are stored as hex (bit-exact, NaN and inf included), tensors and
arrays keep dtype and shape. Tensors and arrays travel as flat ``uint8`` numpy *views* of their
memory, so capturing them costs no copy until Ray puts them into the object store.

Node encoding (scalars are plain JSON; everything else is a one-tag object):
  null / true / false / int / str   the value itself
  {"f": hex}                        float; a NaN also has {"fb": 16 hex digits}: its IEEE bits
                                    (sign and payload: float.hex writes every NaN as "nan")
  {"d": [[key, node], ...]}         dict  (``"o": 1`` for OrderedDict); keys str or int, or
                                    {"kn": 1} for None and {"kb": b} for a bool
  {"l": [...]} / {"u": [...]}       list / tuple
  {"T": i, "dt": "BF16", "sh": []}  torch tensor, bytes in arrays[i]
  {"N": i, "dt": "<f4", "sh": []}   numpy array,  bytes in arrays[i]
  {"DT": i | null, "dt": "float32",  DTensor: this rank's LOCAL shard ("sh" its shape) in arrays[i],
   "sh": [], "g": [], "o": [],       or null when a replica (same chunk, coordinate 0 on every
   "m": [], "p": ["S(0)", "R"],      Replicate mesh dim) stores it; "g" global shape, "o" the chunk's
   "c": [], "r": rank, "w": rank}    global offsets, "m" mesh shape, "p" placements, "c" this rank's
                                    mesh coordinate, "r" its global rank, "w" the writer's rank
  {"A": i}                          pyarrow Table, tables[i]
  {"ns": "<f4", "h": hex}           numpy scalar
  {"b": base64}                     bytes
  {"tdt": "float32"}                torch.dtype
  {"P": i}                          pickled object in arrays[i] (only with allow_pickle=True)
"""
from __future__ import annotations

import base64
import collections
import sys
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from ..errors import RestoreError, UnsupportedTypeError
from .dtypes import import_torch, numpy_view, st_dtype_of_numpy, torch_to_st
from .flat import Flat
from .nodes import dec_key, enc_key, float_node, float_of, leaf_key, path_str, unsupported_at
from .sharded_leaf import (ShardedLeaf, TensorChunk, chunk_layout, dtensor_type, global_rank, layout_of,
                           sharded_leaf)

try:
    import pyarrow as pa
except ImportError:  # pragma: no cover
    pa = None


def _torch_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class _Encoder:
    """One ``flatten`` call: walks the state depth first, one method per kind of node, and appends
    leaf bytes to ``flat`` as it meets them (so array indices follow the walk's order)."""

    def __init__(self, state_name: str, allow_pickle: bool, to_host: Optional[Any]):
        self.state_name = state_name
        self.allow_pickle = allow_pickle
        self.to_host = to_host
        self.torch = sys.modules.get("torch")  # no torch imported: no tensor in the state (see dtypes)
        self.dtensor = dtensor_type() if self.torch is not None else None
        self.rank = global_rank() if self.dtensor is not None else None  # once per walk, not per leaf
        self.flat = Flat(structure=None)
        self.names: set = set()

    def unsupported(self, obj: Any, path: list, why: str = "") -> UnsupportedTypeError:
        name = self.state_name
        return UnsupportedTypeError(f"state {name!r}: {unsupported_at(obj, path, why)}; supported leaves are "
                                    f"tensors, numpy arrays, Arrow tables and JSON scalars (pass allow_pickle=True "
                                    f"when registering {name!r} to store it with pickle)")

    def enc(self, obj: Any, path: list) -> Any:
        """The node of ``obj``; the order of the checks matters (a DTensor is a Tensor, a bool an int)."""
        t = type(obj)
        if obj is None or t is bool or t is int or t is str:
            return obj
        if t is float:
            return float_node(obj)
        if t is dict or t is collections.OrderedDict:
            return self.mapping(obj, path)
        if t is list:
            return {"l": [self.enc(v, path + [i]) for i, v in enumerate(obj)]}
        if t is tuple:
            return {"u": [self.enc(v, path + [i]) for i, v in enumerate(obj)]}
        if self.dtensor is not None and isinstance(obj, self.dtensor):
            return self.dtensor_node(obj, path)
        if t is TensorChunk:
            idx, x = self.tensor_array(obj.local, path)
            return {"DT": idx, "dt": _torch_name(x.dtype), **chunk_layout(obj, list(x.shape))}
        if self.torch is not None and isinstance(obj, self.torch.Tensor):
            idx, x = self.tensor_array(obj, path)
            return {"T": idx, "dt": _torch_name(x.dtype), "sh": list(x.shape)}
        if isinstance(obj, np.ndarray):
            return self.ndarray(obj, path)
        return self.other(obj, path)

    def mapping(self, obj: dict, path: list) -> dict:
        items = []
        for k, v in obj.items():
            key = enc_key(k)
            if key is None:
                raise self.unsupported(k, path + [k], "dict keys must be str, int, bool or None")
            items.append([key, self.enc(v, path + [k])])
        node: dict = {"d": items}
        if type(obj) is collections.OrderedDict:
            node["o"] = 1
        return node

    def dtensor_node(self, obj: Any, path: list) -> dict:
        try:
            layout, writes = layout_of(obj, self.rank)
        except ValueError as exc:
            raise UnsupportedTypeError(f"state {self.state_name!r}: DTensor at {path_str(path)}: {exc}") from None
        idx = self.tensor_array(obj.to_local(), path)[0] if writes else None
        return {"DT": idx, "dt": _torch_name(obj.dtype), **layout}

    def ndarray(self, obj: np.ndarray, path: list) -> dict:
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise self.unsupported(obj, path, f"numpy dtype {obj.dtype}")
        # np.ascontiguousarray would turn a 0-d array into shape (1,): the shape is the original's
        a = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        u8 = a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)
        idx = self.add_array(u8, path, st_dtype_of_numpy(a.dtype), list(obj.shape), a.dtype.itemsize)
        return {"N": idx, "dt": a.dtype.str, "sh": list(obj.shape)}

    def other(self, obj: Any, path: list) -> dict:
        """Leaves stored inline in the structure or as tables; pickle last, and only when allowed."""
        t = type(obj)
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {"ns": obj.dtype.str, "h": obj.tobytes().hex()}
        if t is bytes:
            return {"b": base64.b64encode(obj).decode("ascii")}
        if self.torch is not None and t is self.torch.dtype:
            return {"tdt": _torch_name(obj)}
        if pa is not None and isinstance(obj, pa.Table):
            self.flat.tables.append(obj)
            return {"A": len(self.flat.tables) - 1}
        if pa is not None and isinstance(obj, pa.RecordBatch):
            self.flat.tables.append(pa.Table.from_batches([obj]))
            return {"A": len(self.flat.tables) - 1, "rb": 1}
        if self.allow_pickle:
            import pickle  # only on the explicit opt-in path

            data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
            return {"P": self.add_array(data, path, "U8", [data.size], 1)}
        raise self.unsupported(obj, path)

    def tensor_array(self, obj: Any, path: list) -> Tuple[int, Any]:
        """Add a tensor's bytes (moved to host first if need be); returns the index and host tensor."""
        torch = self.torch
        if obj.layout != torch.strided or obj.is_quantized:
            raise self.unsupported(obj, path, f"tensor layout {obj.layout}")
        x = obj.detach() if obj.requires_grad else obj  # numpy() refuses a tensor that requires grad
        to_host = self.to_host
        if x.device.type != "cpu" or (to_host is not None and getattr(to_host, "stage_cpu", False)):
            x = to_host(x, leaf_key(path)) if to_host is not None else x.to("cpu")
        x = x.resolve_conj().resolve_neg().contiguous()
        st = torch_to_st().get(x.dtype, "U8")
        if not x.numel():
            u8 = np.empty(0, np.uint8)
        elif x.dtype in _numpy_dtypes(torch):  # numpy's reshape and view cost less than torch's dispatch
            u8 = x.numpy().reshape(-1).view(np.uint8)
        else:  # bfloat16, float8: no numpy dtype
            u8 = x.reshape(-1).view(torch.uint8).numpy()
        return self.add_array(u8, path, st, list(x.shape), x.element_size(), x.data_ptr()), x

    def add_array(self, arr_u8: np.ndarray, path: list, st_dtype: str, shape: list, itemsize: int,
                  address: Optional[int] = None) -> int:
        """Append one leaf's bytes and its header record; its name is made unique within the part.
        ``address``: where the bytes are in memory, when the caller knows it cheaply (``Flat.spans``)."""
        idx = len(self.flat.arrays)
        name = leaf_key(path)
        if name in self.names:
            name = f"{name}#{idx}"
        self.names.add(name)
        if address is None and arr_u8.nbytes:
            address = arr_u8.__array_interface__["data"][0]
        self.flat.spans.append((address or 0, (address or 0) + arr_u8.nbytes))
        self.flat.arrays.append(arr_u8)
        self.flat.leaf_info.append({"name": name, "dtype": st_dtype, "shape": shape, "itemsize": itemsize})
        return idx


_NUMPY_DTYPES: Optional[frozenset] = None


def _numpy_dtypes(torch: Any) -> frozenset:
    """The torch dtypes whose ``Tensor.numpy()`` works (a numpy dtype of the same bytes)."""
    global _NUMPY_DTYPES
    if _NUMPY_DTYPES is None:
        _NUMPY_DTYPES = frozenset(getattr(torch, n) for n in (
            "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
            "complex128") if hasattr(torch, n))
    return _NUMPY_DTYPES


def flatten(state: Any, *, state_name: str = "state", allow_pickle: bool = False,
            to_host: Optional[Any] = None) -> Flat:
    """Flatten ``state`` without copying tensor or array memory.

    ``to_host(tensor, leaf_name)`` moves a device tensor to host memory (default: ``.to("cpu")``);
    the snapshot path passes a :class:`~ray_ckpt.capture.snapshot.HostStaging` that copies into reused
    pinned buffers on a side stream.

    A :class:`Flat` is returned as it is: a caller that pushes the same views at every save
    flattens them once (host memory only: ``to_host`` is not applied to it).

    Raises :class:`UnsupportedTypeError` naming the state and the key path of the first object that
    has no safe format.
    """
    if type(state) is Flat:
        return state
    encoder = _Encoder(state_name, allow_pickle, to_host)
    if encoder.torch is None:
        encoder.flat.structure = encoder.enc(state, [])
        return encoder.flat
    # the bytes are read, never differentiated: without grad mode a DTensor's to_local() is its
    # local tensor, not an autograd Function call per leaf
    with encoder.torch.no_grad():
        encoder.flat.structure = encoder.enc(state, [])
    return encoder.flat


class _Decoder:
    """One ``unflatten`` call: rebuilds the state depth first, one method per kind of node. It holds
    ``arrays`` (a restored file's whole buffer or mapping) and keeps no reference cycle, so those
    are released as soon as the caller drops the state, without waiting for garbage collection."""

    def __init__(self, arrays: List[Any], tables: List[Any], as_numpy: bool, allow_pickle: bool,
                 state_name: str, on_sharded: Optional[Callable[[ShardedLeaf], Any]]):
        self.arrays = arrays
        self.tables = tables
        self.as_numpy = as_numpy
        self.allow_pickle = allow_pickle
        self.state_name = state_name
        self.on_sharded = on_sharded

    def dec(self, node: Any, path: list) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if "f" in node:
            return float_of(node)
        if "d" in node:
            pairs = []
            for k, v in node["d"]:
                k = dec_key(k)
                pairs.append((k, self.dec(v, path + [k])))
            return collections.OrderedDict(pairs) if node.get("o") else dict(pairs)
        if "l" in node:
            return [self.dec(v, path + [i]) for i, v in enumerate(node["l"])]
        if "u" in node:
            return tuple(self.dec(v, path + [i]) for i, v in enumerate(node["u"]))
        if "T" in node:
            return self.tensor(self.arrays[node["T"]], node["dt"], node["sh"])
        if "DT" in node:
            return self.sharded(node, path)
        return self.other(node)

    def tensor(self, buf: Any, dtype_name: str, shape: list) -> Any:
        # torch is imported at the first tensor leaf, not before: a state of numpy arrays, tables
        # and Python values restores without it (importing torch is ~3 CPU-s of a fresh process's restore)
        if self.as_numpy:
            return numpy_view(buf, dtype_name, shape)
        torch = import_torch()
        dt = getattr(torch, dtype_name)
        if len(buf) == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(shape)

    def sharded(self, node: dict, path: list) -> Any:
        i = node["DT"]
        local = self.tensor(self.arrays[i], node["dt"], node["sh"]) if i is not None else None
        if self.on_sharded is not None:
            return self.on_sharded(sharded_leaf(node, path, local))
        if local is None:
            raise RestoreError(
                f"state {self.state_name!r}: {leaf_key(path)} is a replicated DTensor chunk stored in the "
                f"part of rank {node.get('w')}, not in this one; load it with load_into (resharding) "
                f"or assemble it from the shard index")
        return local

    def other(self, node: dict) -> Any:
        if "N" in node:
            dt = np.dtype(node["dt"])
            buf = self.arrays[node["N"]]
            return np.frombuffer(buf, dtype=dt).reshape(node["sh"]) if len(buf) else np.empty(node["sh"], dt)
        if "A" in node:
            t = self.tables[node["A"]]
            return t.to_batches()[0] if node.get("rb") and t.num_rows else t
        if "ns" in node:
            return np.frombuffer(bytes.fromhex(node["h"]), dtype=np.dtype(node["ns"]))[0]
        if "b" in node:
            return base64.b64decode(node["b"])
        if "tdt" in node:
            return getattr(import_torch(), node["tdt"])
        if "P" in node:
            if not self.allow_pickle:
                raise RestoreError(
                    f"state {self.state_name!r} holds a pickled object; loading it runs code, so it is "
                    f"refused unless allow_pickle=True is set for {self.state_name!r}"
                )
            import pickle

            return pickle.loads(bytes(self.arrays[node["P"]]))
        raise RestoreError(f"state {self.state_name!r}: unknown structure node {sorted(node)}")


def unflatten(structure: Any, arrays: List[Any], tables: List[Any], *, as_numpy: bool = False,
              allow_pickle: bool = False, state_name: str = "state",
              on_sharded: Optional[Callable[[ShardedLeaf], Any]] = None) -> Any:
    """Rebuild a state from its structure. ``arrays[i]`` is a writable buffer of leaf i's bytes.

    With ``as_numpy=True`` tensors come back as numpy arrays (bf16 as raw uint16), for tools
    that must not depend on torch.

    A DTensor leaf comes back as its local chunk, a plain tensor (no target layout is known here;
    ``formats.shards`` reshards into one). ``on_sharded(leaf)`` replaces that: it gets a
    :class:`ShardedLeaf` (``local`` the chunk, or None for a replica stored in another rank's part)
    and returns the value to put in the state (``lambda leaf: leaf`` keeps the records). Without it,
    a replica stored elsewhere is a :class:`RestoreError` naming the rank that stores it.
    """
    return _Decoder(arrays, tables, as_numpy, allow_pickle, state_name, on_sharded).dec(structure, [])
