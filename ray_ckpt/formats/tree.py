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
import functools
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import RestoreError, UnsupportedTypeError

try:
    import pyarrow as pa
except ImportError:  # pragma: no cover
    pa = None


# torch is imported on first use, not here: the command line lists, verifies and shows checkpoints
# without it (importing torch is ~1 s of its start-up). A tensor or a torch.dtype can only exist
# once torch is imported, so flatten() looks in sys.modules; unflatten() imports it to build tensors.
def _torch() -> Any:
    import torch

    return torch


@functools.lru_cache(maxsize=1)
def _torch_to_st() -> dict:
    """torch dtype -> safetensors dtype name (what other tools read); anything else is stored as U8."""
    torch = _torch()
    out = {}
    for name, st in [
        ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16"),
        ("int64", "I64"), ("int32", "I32"), ("int16", "I16"), ("int8", "I8"), ("uint8", "U8"),
        ("bool", "BOOL"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("complex64", "C64"),
    ]:
        if hasattr(torch, name):
            out[getattr(torch, name)] = st
    return out


_NP_TO_ST = {
    "f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
    "u1": "U8", "b1": "BOOL", "u2": "U16", "u4": "U32", "u8": "U64", "c8": "C64",
}


def st_dtype_of_numpy(dt: np.dtype) -> str:
    """The safetensors dtype name for a little-endian numpy dtype (U8 when it has none)."""
    if dt.byteorder == ">":
        return "U8"
    return _NP_TO_ST.get(f"{dt.kind}{dt.itemsize}", "U8")


# How a Flat travels through Ray's object store. Ray copies each out-of-band buffer larger than
# 1 MiB with threads that it starts for that buffer alone; for buffers of a few MiB starting them
# costs more than the copy. So arrays up to SPLIT_UP_TO travel as 1 MiB pieces, which Ray copies
# with one memcpy each; larger arrays travel whole, where Ray's parallel copy pays off on machines
# with the cores for it (figures: `benchmarks/transport_pieces.py`, RESULTS.md).
PIECE = 1 << 20
SPLIT_UP_TO = 4 << 20


class Pieces:
    """One array's bytes as consecutive pieces (views into the object store after transport)."""

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: List[np.ndarray]):
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)


def pieces_of(arr: Any) -> List[Any]:
    """An entry of ``Flat.arrays`` as the consecutive byte pieces it holds (no copies)."""
    if isinstance(arr, Pieces):
        return arr.parts
    return [arr] if arr.nbytes else []


def _for_transport(arr: np.ndarray) -> Any:
    n = arr.nbytes
    if PIECE < n <= SPLIT_UP_TO and arr.ndim == 1:
        return [arr[i: i + PIECE] for i in range(0, n, PIECE)]
    return arr


def _from_transport(structure: Any, arrays: List[Any], tables: List[Any], leaf_info: List[dict]) -> "Flat":
    return Flat(structure, [Pieces(a) if isinstance(a, list) else a for a in arrays], tables, leaf_info)


@dataclass
class Flat:
    """A flattened state: what a snapshot carries and what formats serialise.

    After it has travelled through Ray, an entry of ``arrays`` may be :class:`Pieces` (see
    ``SPLIT_UP_TO``); formats read entries through :func:`pieces_of`."""

    structure: Any
    arrays: List[Any] = field(default_factory=list)  # flat uint8 views (or Pieces of them)
    tables: List[Any] = field(default_factory=list)  # pyarrow Tables
    leaf_info: List[dict] = field(default_factory=list)  # per array: name, st dtype, shape, itemsize

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + sum(t.nbytes for t in self.tables)

    def __reduce__(self):
        return _from_transport, (self.structure, [_for_transport(a) for a in self.arrays], self.tables,
                                 self.leaf_info)


def _path_str(path: list) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _leaf_name(path: list) -> str:
    return "/".join(str(k) for k in path) or "value"


def leaf_key(path: list) -> str:
    """The key of the leaf at ``path`` (dict keys / list indices from the root) in a shard index:
    ``"optim/state/0/exp_avg"``. ``formats.shards`` walks a target state with the same function."""
    return _leaf_name(path)


def _float_node(x: float) -> dict:
    if math.isnan(x):  # float.hex() writes every NaN as "nan": keep its sign and payload bits
        return {"f": "nan", "fb": struct.pack(">d", x).hex()}
    return {"f": x.hex()}


def _float_of(node: dict) -> float:
    fb = node.get("fb")
    if fb is not None:
        return struct.unpack(">d", bytes.fromhex(fb))[0]
    return float.fromhex(node["f"])


@dataclass
class ShardedLeaf:
    """One DTensor leaf of a flattened state, as this rank saw it (see the "DT" node).

    ``local`` is the rank's chunk as a plain tensor (``unflatten``), or None where the chunk is
    stored by another rank (``stored`` False: a replica) or when only the metadata was asked for
    (:func:`sharded_leaves`). ``offsets``/``sizes`` place the chunk in the global tensor."""

    key: str
    path: list
    dtype: str                       # torch dtype name, "float32"
    global_shape: List[int]
    offsets: List[int]
    sizes: List[int]
    mesh_shape: List[int]
    placements: List[str]            # "S(0)", "R"
    coordinate: Optional[List[int]]  # this rank's coordinate on the mesh (None: not in it)
    rank: Optional[int]              # this rank's global rank
    writer_rank: Optional[int]       # the global rank whose part stores this chunk
    array: Optional[int]             # index into Flat.arrays when stored here
    local: Any = None

    @property
    def stored(self) -> bool:
        """Whether this rank's part holds the chunk's bytes."""
        return self.array is not None



class TensorChunk:
    """A plain tensor ``local`` that is the box ``offsets`` + ``local.shape`` of a global tensor of
    ``global_shape``, whose other boxes other ranks hold: a sharded leaf whose layout no DTensor
    placement describes (a DeepSpeed ZeRO partition of a flattened parameter starts and ends
    anywhere). Stored and resharded like a DTensor chunk ("DT" node, shard index); as a
    ``load_into`` target its ``local`` is filled in place with exactly that box."""

    __slots__ = ("local", "global_shape", "offsets")

    def __init__(self, local: Any, global_shape: Any, offsets: Any):
        self.local = local
        self.global_shape = tuple(int(x) for x in global_shape)
        self.offsets = tuple(int(x) for x in offsets)
        sizes = tuple(local.shape)
        if len(sizes) != len(self.global_shape) or len(self.offsets) != len(sizes) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(self.offsets, sizes, self.global_shape)):
            raise ValueError(f"TensorChunk: a box at {list(self.offsets)} of sizes {list(sizes)} does not fit "
                             f"a tensor of shape {list(self.global_shape)}")

    @property
    def shape(self) -> Any:
        """The global shape (what a target's shape is checked against)."""
        return _torch().Size(self.global_shape)

    @property
    def dtype(self) -> Any:
        return self.local.dtype

    def __repr__(self) -> str:
        return f"TensorChunk(offsets={list(self.offsets)}, sizes={list(self.local.shape)}, global={list(self.global_shape)})"


def _sharded_leaf(node: dict, path: list, local: Any = None) -> ShardedLeaf:
    return ShardedLeaf(key=leaf_key(path), path=list(path), dtype=node["dt"], global_shape=list(node["g"]),
                       offsets=list(node["o"]), sizes=list(node["sh"]), mesh_shape=list(node["m"]),
                       placements=list(node["p"]), coordinate=node.get("c"), rank=node.get("r"),
                       writer_rank=node.get("w"), array=node["DT"], local=local)


def walk_sharded(structure: Any) -> Iterator[Tuple[list, dict]]:
    """Every DTensor ("DT") node of a structure with its path (decoded keys), in flatten order."""
    stack: list = [([], structure)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "DT" in node:
            yield path, node
        elif "d" in node:
            stack.extend((path + [_dec_key(k)], v) for k, v in reversed(node["d"]))
        elif "l" in node or "u" in node:
            items = node.get("l", node.get("u"))
            stack.extend((path + [i], v) for i, v in reversed(list(enumerate(items))))


def sharded_leaves(structure: Any) -> List[ShardedLeaf]:
    """The DTensor leaves of a flattened state's structure (metadata only, ``local`` None)."""
    return [_sharded_leaf(node, path) for path, node in walk_sharded(structure)]


def _dtensor_types() -> Any:
    """``DTensor`` when ``torch.distributed.tensor`` is imported (a DTensor cannot exist otherwise)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def dtensor_chunk(t: Any) -> Tuple[List[int], List[int]]:
    """(global offsets, sizes) of a DTensor's local chunk, as DCP computes them (uneven shards and
    several mesh dims sharding one tensor dim included). Raises ``ValueError`` for placements other
    than ``Shard`` and ``Replicate`` (``Partial`` is not a value; ``_StridedShard`` chunks are not boxes)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if type(p) not in (Shard, Replicate):
            raise ValueError(f"placement {type(p).__name__} ({p}) is not supported: only Shard and Replicate "
                             f"chunks are boxes of the global tensor (FSDP2 over a module tensor-parallel-sharded "
                             f"on the same dim gives _StridedShard); redistribute to Shard / Replicate first")
    if t.device_mesh.get_coordinate() is None:  # this rank is not in the mesh: it holds nothing
        return [0] * len(t.shape), [0] * len(t.shape)
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offsets), list(shape)


def _dtensor_layout(t: Any) -> dict:
    """The "DT" node fields of a DTensor leaf except the array index and dtype."""
    offsets, sizes = dtensor_chunk(t)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    writer = None
    if coord is not None:
        wcoord = tuple(c if p.is_shard() else 0 for c, p in zip(coord, t.placements))
        writer = int(mesh.mesh[wcoord].item())
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else None
    return {"sh": sizes, "g": list(t.shape), "o": offsets, "m": list(mesh.shape),
            "p": [str(p) for p in t.placements], "c": list(coord) if coord is not None else None,
            "r": rank, "w": writer}


def flatten(state: Any, *, state_name: str = "state", allow_pickle: bool = False,
            to_host: Optional[Any] = None) -> Flat:
    """Flatten ``state`` without copying tensor or array memory.

    ``to_host(tensor, leaf_name)`` moves a device tensor to host memory (default: ``.to("cpu")``);
    the snapshot path passes a :class:`~ray_ckpt.capture.snapshot.HostStaging` that copies into reused
    pinned buffers on a side stream.

    Raises :class:`UnsupportedTypeError` naming the state and the key path of the first object that
    has no safe format.
    """
    torch = sys.modules.get("torch")  # no torch imported: no tensor in the state (see _torch)
    dtensor = _dtensor_types() if torch is not None else None
    flat = Flat(structure=None)
    names: set = set()

    def add_array(arr_u8: np.ndarray, path: list, st_dtype: str, shape: list, itemsize: int) -> int:
        idx = len(flat.arrays)
        name = _leaf_name(path)
        if name in names:
            name = f"{name}#{idx}"
        names.add(name)
        flat.arrays.append(arr_u8)
        flat.leaf_info.append({"name": name, "dtype": st_dtype, "shape": shape, "itemsize": itemsize})
        return idx

    def tensor_array(obj: Any, path: list) -> Tuple[int, Any]:
        if obj.layout != torch.strided or obj.is_quantized:
            raise unsupported(obj, path, f"tensor layout {obj.layout}")
        x = obj.detach()
        if x.device.type != "cpu" or (to_host is not None and getattr(to_host, "stage_cpu", False)):
            x = to_host(x, _leaf_name(path)) if to_host is not None else x.to("cpu")
        x = x.resolve_conj().resolve_neg().contiguous()
        st = _torch_to_st().get(x.dtype, "U8")
        u8 = x.reshape(-1).view(torch.uint8).numpy() if x.numel() else np.empty(0, np.uint8)
        return add_array(u8, path, st, list(x.shape), x.element_size()), x

    def unsupported(obj: Any, path: list, why: str = "") -> UnsupportedTypeError:
        return UnsupportedTypeError(
            f"state {state_name!r}: unsupported object of type {type(obj).__module__}.{type(obj).__qualname__} "
            f"at {_path_str(path)}{(' (' + why + ')') if why else ''}; supported leaves are tensors, numpy "
            f"arrays, Arrow tables and JSON scalars (pass allow_pickle=True when registering {state_name!r} "
            f"to store it with pickle)"
        )

    def enc(obj: Any, path: list) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is int or t is str:
            return obj
        if t is float:
            return _float_node(obj)
        if t is dict or t is collections.OrderedDict:
            items = []
            for k, v in obj.items():
                if type(k) in (str, int):
                    key = k
                elif k is None or type(k) is bool:  # RLlib keys single-agent state by None
                    key = {"kn": 1} if k is None else {"kb": k}
                else:
                    raise unsupported(k, path + [k], "dict keys must be str, int, bool or None")
                items.append([key, enc(v, path + [k])])
            node = {"d": items}
            if t is collections.OrderedDict:
                node["o"] = 1
            return node
        if t is list:
            return {"l": [enc(v, path + [i]) for i, v in enumerate(obj)]}
        if t is tuple:
            return {"u": [enc(v, path + [i]) for i, v in enumerate(obj)]}
        if dtensor is not None and isinstance(obj, dtensor):
            try:
                node = _dtensor_layout(obj)
            except ValueError as exc:
                raise UnsupportedTypeError(f"state {state_name!r}: DTensor at {_path_str(path)}: {exc}") from None
            # one writer per distinct chunk: the rank at coordinate 0 on every Replicate mesh dim
            writes = node["c"] is not None and all(
                c == 0 for c, p in zip(node["c"], node["p"]) if not p.startswith("S("))
            node = {"DT": tensor_array(obj.to_local(), path)[0] if writes else None,
                    "dt": str(obj.dtype).replace("torch.", ""), **node}
            return node
        if t is TensorChunk:  # every rank stores its own box (no replicas)
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
            idx, x = tensor_array(obj.local, path)
            return {"DT": idx, "dt": str(x.dtype).replace("torch.", ""), "sh": list(x.shape),
                    "g": list(obj.global_shape), "o": list(obj.offsets), "m": [1], "p": ["box"], "c": None,
                    "r": rank, "w": rank}
        if torch is not None and isinstance(obj, torch.Tensor):
            idx, x = tensor_array(obj, path)
            return {"T": idx, "dt": str(x.dtype).replace("torch.", ""), "sh": list(x.shape)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.fields is not None:
                raise unsupported(obj, path, f"numpy dtype {obj.dtype}")
            # np.ascontiguousarray would turn a 0-d array into shape (1,): the shape is the original's
            a = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            u8 = a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)
            st = st_dtype_of_numpy(a.dtype)
            idx = add_array(u8, path, st, list(obj.shape), a.dtype.itemsize)
            return {"N": idx, "dt": a.dtype.str, "sh": list(obj.shape)}
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {"ns": obj.dtype.str, "h": obj.tobytes().hex()}
        if t is bytes:
            return {"b": base64.b64encode(obj).decode("ascii")}
        if torch is not None and t is torch.dtype:
            return {"tdt": str(obj).replace("torch.", "")}
        if pa is not None and isinstance(obj, pa.Table):
            flat.tables.append(obj)
            return {"A": len(flat.tables) - 1}
        if pa is not None and isinstance(obj, pa.RecordBatch):
            flat.tables.append(pa.Table.from_batches([obj]))
            return {"A": len(flat.tables) - 1, "rb": 1}
        if allow_pickle:
            import pickle  # only on the explicit opt-in path

            data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
            idx = add_array(data, path, "U8", [data.size], 1)
            return {"P": idx}
        raise unsupported(obj, path)

    try:
        flat.structure = enc(state, [])
    finally:
        enc = None  # noqa: F841 -- enc refers to itself: break the cycle so the views are freed at once
    return flat


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

    # torch is imported at the first tensor leaf, not before: a state of numpy arrays, tables and
    # Python values restores without it (importing torch is ~3 CPU-s of a fresh process's restore)

    def tensor_of(buf: Any, dtype_name: str, shape: list) -> Any:
        if as_numpy:
            return _numpy_view(buf, dtype_name, shape)
        torch = _torch()
        dt = getattr(torch, dtype_name)
        if len(buf) == 0:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(shape)

    def dec(node: Any, path: list) -> Any:
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if "f" in node:
            return _float_of(node)
        if "d" in node:
            pairs = []
            for k, v in node["d"]:
                k = _dec_key(k)
                pairs.append((k, dec(v, path + [k])))
            return collections.OrderedDict(pairs) if node.get("o") else dict(pairs)
        if "l" in node:
            return [dec(v, path + [i]) for i, v in enumerate(node["l"])]
        if "u" in node:
            return tuple(dec(v, path + [i]) for i, v in enumerate(node["u"]))
        if "T" in node:
            return tensor_of(arrays[node["T"]], node["dt"], node["sh"])
        if "DT" in node:
            i = node["DT"]
            local = tensor_of(arrays[i], node["dt"], node["sh"]) if i is not None else None
            if on_sharded is not None:
                return on_sharded(_sharded_leaf(node, path, local))
            if local is None:
                raise RestoreError(
                    f"state {state_name!r}: {leaf_key(path)} is a replicated DTensor chunk stored in the "
                    f"part of rank {node.get('w')}, not in this one; load it with load_into (resharding) "
                    f"or assemble it from the shard index")
            return local
        if "N" in node:
            dt = np.dtype(node["dt"])
            buf = arrays[node["N"]]
            return np.frombuffer(buf, dtype=dt).reshape(node["sh"]) if len(buf) else np.empty(node["sh"], dt)
        if "A" in node:
            t = tables[node["A"]]
            return t.to_batches()[0] if node.get("rb") and t.num_rows else t
        if "ns" in node:
            return np.frombuffer(bytes.fromhex(node["h"]), dtype=np.dtype(node["ns"]))[0]
        if "b" in node:
            return base64.b64decode(node["b"])
        if "tdt" in node:
            return getattr(_torch(), node["tdt"])
        if "P" in node:
            if not allow_pickle:
                raise RestoreError(
                    f"state {state_name!r} holds a pickled object; loading it runs code, so it is "
                    f"refused unless allow_pickle=True is set for {state_name!r}"
                )
            import pickle

            return pickle.loads(bytes(arrays[node["P"]]))
        raise RestoreError(f"state {state_name!r}: unknown structure node {sorted(node)}")

    try:
        return dec(structure, [])
    finally:
        # dec refers to itself through its closure; without this the cycle keeps ``arrays`` (a
        # restored file's whole buffer or mapping) alive until the next garbage collection
        dec = None  # noqa: F841


def _dec_key(k: Any) -> Any:
    if isinstance(k, dict):
        return None if "kn" in k else bool(k["kb"])
    return k


_TORCH_NAME_TO_NP = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?", "uint16": "<u2", "uint32": "<u4",
    "uint64": "<u8", "complex64": "<c8", "complex128": "<c16", "bfloat16": "<u2",
}


def _numpy_view(buf: Any, torch_dtype_name: str, shape: list) -> np.ndarray:
    dt = np.dtype(_TORCH_NAME_TO_NP.get(torch_dtype_name, "u1"))
    a = np.frombuffer(buf, dtype=dt) if len(buf) else np.empty(0, dt)
    try:
        return a.reshape(shape)
    except ValueError:
        return a


def structure_to_json(structure: Any) -> str:
    return json.dumps(structure, separators=(",", ":"), allow_nan=False)
