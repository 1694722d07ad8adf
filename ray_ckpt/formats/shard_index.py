"""The shard index of a sharded (DTensor) state: every stored chunk's box and where its bytes are.

What DCP keeps in its ``Metadata``, for ray_ckpt: for every sharded tensor its global shape and
dtype and, for every stored chunk, its box in the global tensor, the file and offset of its
row-major bytes and its piece digests (``formats.pieces``). A writer records one
:func:`part_record` per rank file; the coordinator merges them with :func:`index_of` at the commit
and stores ``ShardIndex.to_json()`` in the manifest entry of the state. A reader gets it back with
``ShardIndex.from_json`` (validated: a manifest read from storage may be hostile) and plans reads
with ``formats.shards``. No Ray, no storage.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import IntegrityError
from .pieces import PIECE_SIZE, PieceHasher
from .tree import Flat, leaf_key, pieces_of, walk_sharded

INDEX_FORMAT = 1

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "complex64": 8, "complex128": 16,
}


def _itemsize(dtype: str) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        import torch

        n = getattr(torch, dtype).itemsize
    return n


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n



@dataclass(frozen=True)
class ChunkMeta:
    """A box of a global tensor: ``offsets`` (its first element) and ``sizes`` per dimension."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "offsets", tuple(int(x) for x in self.offsets))
        object.__setattr__(self, "sizes", tuple(int(x) for x in self.sizes))
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"chunk offsets {self.offsets} and sizes {self.sizes} differ in rank")

    @property
    def numel(self) -> int:
        return _prod(self.sizes)


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk: its box and where its row-major bytes are.

    ``file`` is whatever id the reader's ``read_range`` understands (the part's file path relative
    to the version, or "rank3"); ``offset`` is the byte offset of the chunk's data in that file.
    ``digests[k]`` is the xxh3-128 of bytes ``[k * piece_size, (k + 1) * piece_size)`` of the
    chunk's data (empty: no range verification, the reader must check the whole file instead)."""

    chunk: ChunkMeta
    file: str
    offset: int
    nbytes: int
    piece_size: int = PIECE_SIZE
    digests: Tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = {"o": list(self.chunk.offsets), "s": list(self.chunk.sizes), "file": self.file,
             "at": self.offset, "n": self.nbytes}
        if self.digests:
            d["ps"] = self.piece_size
            d["xxh3"] = list(self.digests)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StoredChunk":
        return cls(ChunkMeta(d["o"], d["s"]), str(d["file"]), int(d["at"]), int(d["n"]),
                   int(d.get("ps", PIECE_SIZE)), tuple(d.get("xxh3", ())))


@dataclass
class ShardedTensorMeta:
    """A sharded tensor of a checkpoint: global shape, dtype and the chunks that store it.

    ``mesh_shape`` / ``placements`` say how it was sharded when saved (informational: a reader
    needs only the chunks)."""

    key: str
    global_shape: Tuple[int, ...]
    dtype: str  # torch dtype name: "float32", "bfloat16"
    chunks: List[StoredChunk] = field(default_factory=list)
    path: Optional[list] = None
    mesh_shape: Tuple[int, ...] = ()
    placements: Tuple[str, ...] = ()

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return _prod(self.global_shape)

    def validate(self) -> None:
        """Structural checks of the chunks (a manifest is read from storage that may be hostile):
        every chunk lies inside the shape, holds ``numel * itemsize`` bytes at a non-negative
        offset with one digest per piece, and the chunks tile the tensor (no overlap, no hole).
        Raises :class:`IntegrityError`."""
        def bad(why: str) -> IntegrityError:
            return IntegrityError(f"shard index: {self.key}: {why}")

        shape = self.global_shape
        if any(not isinstance(n, int) or n < 0 for n in shape):
            raise bad(f"bad shape {list(shape)}")
        try:
            item = self.itemsize
        except (AttributeError, TypeError):
            raise bad(f"unknown dtype {self.dtype!r}") from None
        for c in self.chunks:
            o, z = c.chunk.offsets, c.chunk.sizes
            if len(o) != len(shape) or any(a < 0 or b <= 0 or a + b > n for a, b, n in zip(o, z, shape)):
                raise bad(f"chunk at {list(o)} of sizes {list(z)} is not inside shape {list(shape)}")
            if c.nbytes != c.chunk.numel * item or c.offset < 0:
                raise bad(f"chunk at {list(o)} in {c.file}: {c.nbytes} bytes at {c.offset}, expected "
                          f"{c.chunk.numel * item}")
            if c.digests and (c.piece_size <= 0 or len(c.digests) != -(-c.nbytes // c.piece_size)):
                raise bad(f"chunk at {list(o)} in {c.file}: {len(c.digests)} piece digests for {c.nbytes} "
                          f"bytes in pieces of {c.piece_size}")
        covered = sum(c.chunk.numel for c in self.chunks)
        if covered != self.numel:
            raise bad(f"the stored chunks hold {covered} of the {self.numel} elements of shape "
                      f"{list(shape)}: a rank's part is missing or chunks repeat")
        if len(self.chunks) > 1:  # equal volumes and no overlap: the chunks tile the tensor
            lo = np.array([c.chunk.offsets for c in self.chunks], dtype=np.int64).reshape(len(self.chunks), -1)
            hi = lo + np.array([c.chunk.sizes for c in self.chunks], dtype=np.int64).reshape(lo.shape)
            for i in range(0, len(lo), 256):
                a, b = lo[i: i + 256, None, :], hi[i: i + 256, None, :]
                hit = ((a < hi[None]) & (lo[None] < b)).all(axis=2)
                hit[np.arange(hit.shape[0]), np.arange(i, i + hit.shape[0])] = False
                if hit.any():
                    r, j = map(int, np.argwhere(hit)[0])
                    raise bad(f"chunks at {lo[i + r].tolist()} and {lo[j].tolist()} overlap")

    def to_json(self) -> dict:
        return {"shape": list(self.global_shape), "dtype": self.dtype, "path": self.path,
                "mesh": list(self.mesh_shape), "placements": list(self.placements),
                "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, key: str, d: dict) -> "ShardedTensorMeta":
        return cls(key, tuple(d["shape"]), d["dtype"], [StoredChunk.from_json(c) for c in d["chunks"]],
                   d.get("path"), tuple(d.get("mesh", ())), tuple(d.get("placements", ())))


class ShardIndex(Dict[str, ShardedTensorMeta]):
    """key (``tree.leaf_key`` of the leaf's path, "optim/state/0/exp_avg") -> its metadata."""

    def to_json(self) -> dict:
        return {"format": INDEX_FORMAT, "tensors": {k: m.to_json() for k, m in self.items()}}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, d: Any) -> "ShardIndex":
        if isinstance(d, (str, bytes)):
            d = json.loads(d)
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT or not isinstance(d.get("tensors"), dict):
            raise IntegrityError(f"not a ray_ckpt shard index (format {INDEX_FORMAT} expected)")
        out = cls()
        try:
            for k, m in d["tensors"].items():
                out[k] = ShardedTensorMeta.from_json(k, m)
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"shard index: malformed entry ({type(exc).__name__}: {exc})") from None
        for m in out.values():
            m.validate()
        return out


def part_record(flat_or_structure: Any, file: str, array_offsets: Sequence[int], *,
                arrays: Optional[Sequence[Any]] = None, piece_size: int = PIECE_SIZE) -> dict:
    """What one rank's file contributes to the shard index (JSON-able; merge with :func:`index_of`).

    ``flat_or_structure`` is the part's :class:`~ray_ckpt.formats.tree.Flat` (its DTensor chunks'
    piece digests are computed from its arrays; xxh3 runs at ~20 GB/s) or only its structure (then
    ``arrays`` gives the bytes, or no digests are recorded). ``array_offsets[i]`` is the byte offset
    of ``arrays[i]`` in ``file``. A writer that hashes while streaming may instead fill the digests
    itself with :class:`PieceHasher` over each DTensor array."""
    if isinstance(flat_or_structure, Flat):
        structure, arrays = flat_or_structure.structure, flat_or_structure.arrays
    else:
        structure = flat_or_structure
    tensors: dict = {}
    for path, node in walk_sharded(structure):
        key = leaf_key(path)
        entry = {"path": path, "shape": node["g"], "dtype": node["dt"], "mesh": node["m"],
                 "placements": node["p"], "chunks": []}
        if key in tensors:
            raise ValueError(f"two sharded leaves have the key {key!r}")
        tensors[key] = entry
        i = node["DT"]
        if i is None or _prod(node["sh"]) == 0:
            continue  # a replica (stored by rank node["w"]) or an empty chunk
        digests: List[str] = []
        if arrays is not None:
            h = PieceHasher(piece_size)
            for p in pieces_of(arrays[i]):
                h.update(p)
            digests, nbytes = h.hexdigests(), h.size
        else:
            nbytes = _prod(node["sh"]) * _itemsize(node["dt"])
        c = StoredChunk(ChunkMeta(node["o"], node["sh"]), file, int(array_offsets[i]), nbytes, piece_size,
                        tuple(digests))
        entry["chunks"].append(c.to_json())
    return {"format": INDEX_FORMAT, "file": file, "tensors": tensors}


def index_of(records: Iterable[dict]) -> ShardIndex:
    """Merge every rank's :func:`part_record` into the index of a sharded state.

    Checks that the ranks agree on each tensor's shape and dtype and that its stored chunks tile
    it (:meth:`ShardedTensorMeta.validate`: a missing rank file leaves a hole); raises
    :class:`IntegrityError` otherwise."""
    index = ShardIndex()
    seen: Dict[str, set] = {}
    for rec in records:
        for key, e in rec["tensors"].items():
            m = index.get(key)
            if m is None:
                m = index[key] = ShardedTensorMeta(key, tuple(e["shape"]), e["dtype"], [], e.get("path"),
                                                   tuple(e.get("mesh", ())), tuple(e.get("placements", ())))
                seen[key] = set()
            elif tuple(e["shape"]) != m.global_shape or e["dtype"] != m.dtype:
                raise IntegrityError(
                    f"{key}: the parts disagree on the global tensor: shape {list(m.global_shape)} "
                    f"{m.dtype} vs shape {e['shape']} {e['dtype']} (file {rec.get('file')!r})")
            for cj in e["chunks"]:
                c = StoredChunk.from_json(cj)
                box = (c.chunk.offsets, c.chunk.sizes)
                if box in seen[key]:
                    continue  # the same chunk written twice: keep the first
                seen[key].add(box)
                m.chunks.append(c)
    for m in index.values():
        m.chunks.sort(key=lambda c: c.chunk.offsets)
        m.validate()
    return index


def safetensors_array_offsets(head: Any) -> List[int]:
    """Byte offset in the file of every ``Flat.arrays[i]`` of a ray_ckpt safetensors file, given at
    least its first ``8 + header length`` bytes (the tensors are named in ``ray_ckpt.leaves``)."""
    mv = memoryview(head).cast("B")
    (n,) = struct.unpack_from("<Q", mv, 0)
    header = json.loads(bytes(mv[8: 8 + n]))
    names = json.loads(header["__metadata__"]["ray_ckpt.leaves"])
    return [8 + n + header[name]["data_offsets"][0] for name in names]
