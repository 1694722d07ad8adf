"""Sharded leaves of a flattened state: DTensor chunks and :class:`TensorChunk` boxes ("DT" nodes).

A rank's part stores only its own chunk of such a leaf, with where the chunk sits in the global
tensor; ``formats.shard_index`` and ``formats.shards`` read those records to reshard on restore.
This module describes one chunk (its "DT" node, :class:`ShardedLeaf`) and finds them in a
structure; ``tree`` stores and rebuilds their bytes.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .dtypes import import_torch
from .nodes import dec_key, leaf_key


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
        return import_torch().Size(self.global_shape)

    @property
    def dtype(self) -> Any:
        return self.local.dtype

    def __repr__(self) -> str:
        return (f"TensorChunk(offsets={list(self.offsets)}, sizes={list(self.local.shape)}, "
                f"global={list(self.global_shape)})")


def sharded_leaf(node: dict, path: list, local: Any = None) -> ShardedLeaf:
    """The record of the "DT" node ``node`` found at ``path``, its chunk ``local`` if decoded."""
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
            stack.extend((path + [dec_key(k)], v) for k, v in reversed(node["d"]))
        elif "l" in node or "u" in node:
            items = node.get("l", node.get("u"))
            stack.extend((path + [i], v) for i, v in reversed(list(enumerate(items))))


def sharded_leaves(structure: Any) -> List[ShardedLeaf]:
    """The DTensor leaves of a flattened state's structure (metadata only, ``local`` None)."""
    return [sharded_leaf(node, path) for path, node in walk_sharded(structure)]


def dtensor_type() -> Any:
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


def global_rank() -> Optional[int]:
    """This process's rank in the default process group (None without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


_LAYOUTS: Dict[tuple, Tuple[dict, bool]] = {}  # see layout_of
_LAYOUTS_MAX = 4096


def dtensor_layout(t: Any, rank: Any = ...) -> dict:
    """The "DT" node fields of a DTensor leaf except the array index and dtype; ``rank`` is
    :func:`global_rank` (asked here when not given). A fresh copy: see :func:`layout_of`."""
    layout, _ = layout_of(t, global_rank() if rank is ... else rank)
    return {k: list(v) if isinstance(v, list) else v for k, v in layout.items()}


def layout_of(t: Any, rank: Optional[int]) -> Tuple[dict, bool]:
    """(the "DT" node fields of DTensor ``t`` except the array index and dtype, whether this rank
    stores its chunk: :func:`writes_chunk`); ``rank`` is :func:`global_rank`, asked once per walk.

    Remembered per (mesh, placements, global shape, rank): a model's DTensors share a few of those,
    and torch's answers (the mesh's coordinate and rank tensor, the local shape and offset) cost
    about a millisecond per tensor, the larger part of flattening an FSDP2 state. The dict and its
    lists are shared by every leaf of that layout (``flatten`` spreads them into each node, which a
    structure is never changed after): never change them in place."""
    placements = t.placements
    try:
        key = (t.device_mesh, placements if type(placements) is tuple else tuple(placements), t.shape, rank)
        hit = _LAYOUTS.get(key)
    except TypeError:  # an unhashable mesh or placement: computed every time
        key, hit = None, None
    if hit is None:
        layout = _dtensor_layout(t, rank)
        hit = (layout, writes_chunk(layout))
        if key is not None:
            if len(_LAYOUTS) >= _LAYOUTS_MAX:
                _LAYOUTS.clear()
            _LAYOUTS[key] = hit
    return hit


def _dtensor_layout(t: Any, rank: Optional[int]) -> dict:
    offsets, sizes = dtensor_chunk(t)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    writer = None
    if coord is not None:
        wcoord = tuple(c if p.is_shard() else 0 for c, p in zip(coord, t.placements))
        writer = int(mesh.mesh[wcoord].item())
    return {"sh": sizes, "g": list(t.shape), "o": offsets, "m": list(mesh.shape),
            "p": [str(p) for p in t.placements], "c": list(coord) if coord is not None else None,
            "r": rank, "w": writer}


def writes_chunk(layout: dict) -> bool:
    """Whether this rank stores the chunk of ``layout`` (:func:`dtensor_layout`): one writer per
    distinct chunk, the rank at coordinate 0 on every Replicate mesh dim."""
    return layout["c"] is not None and all(
        c == 0 for c, p in zip(layout["c"], layout["p"]) if not p.startswith("S("))


def chunk_layout(chunk: TensorChunk, sizes: List[int]) -> dict:
    """The "DT" node fields of a :class:`TensorChunk` except the array index and dtype: every rank
    stores its own box (no replicas, no mesh)."""
    rank = global_rank()
    return {"sh": sizes, "g": list(chunk.global_shape), "o": list(chunk.offsets), "m": [1], "p": ["box"],
            "c": None, "r": rank, "w": rank}
