"""Sharded (DTensor) state: where every stored chunk lives, what a new layout reads, range checksums.

No Ray here, and no storage: bytes come through a ``read_range(file, begin, end)`` callable.

A rank's part of a sharded state is an ordinary flattened state (``tree.flatten``) whose DTensor
leaves hold that rank's LOCAL chunk ("DT" nodes). To restore on another world size or mesh, a
reader needs what DCP keeps in its ``Metadata``: for every sharded tensor its global shape and
dtype and, for every stored chunk, its box in the global tensor and where its bytes are. That is a
:class:`ShardIndex`, built from one :func:`part_record` per rank file by :func:`index_of`, stored as
JSON (in the manifest). :func:`plan_reads` intersects a target chunk (a rank's local shard in the
new layout, or the whole tensor) with the stored chunks; :func:`load_into_tensor` then reads only
the byte ranges those boxes need, checked against per-piece digests of each chunk's data
(:func:`piece_digests`, xxh3-128 per ``PIECE_SIZE`` bytes): a rank of a 64-way restore reads and
verifies about its own share of the checkpoint, never the whole of it.

Integration (the save side):
  * a writer, after laying out rank r's file, calls ``part_record(flat, file_id, array_offsets)``
    (``array_offsets[i]`` = byte offset of ``flat.arrays[i]`` in the file; for ray_ckpt's
    safetensors files :func:`safetensors_array_offsets` reads them from the file's head) and hands
    the JSON-able record to the coordinator with the part;
  * at commit the coordinator calls ``index_of(records).to_json()`` and stores it in the manifest
    entry of the state (it raises if the chunks of a tensor do not cover it: a missing rank).
The restore side: ``ShardIndex.from_json(...)`` then ``load_state_into(state, index, read_range,
plain=<rank 0's part unflattened>)`` for ``load_into(name, state, rank=r)`` (DTensor leaves filled in
place on any mesh, whatever the saved world size), or ``full_state(<rank 0's part>, index,
read_range)`` for ``load(name, rank=None)`` (DTensor leaves assembled by :func:`assemble_full`).
"""
from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import xxhash

from ..errors import IntegrityError, RestoreError
from .tree import Flat, dtensor_chunk, leaf_key, pieces_of, walk_sharded

PIECE_SIZE = 1 << 20  # default unit of range verification: one xxh3-128 digest per MiB of chunk data
INDEX_FORMAT = 1

ReadRange = Callable[[str, int, int], Any]  # (file id, begin, end) -> bytes-like of end - begin bytes

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


# --------------------------------------------------------------------------------------------------
# what is stored where


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


# --------------------------------------------------------------------------------------------------
# planning reads


@dataclass(frozen=True)
class ReadItem:
    """Copy the box ``sizes`` at ``src_offsets`` within stored chunk ``meta.chunks[chunk]`` to
    ``dst_offsets`` within the target chunk. ``ranges`` are the byte ranges of the stored chunk's
    row-major data (relative to its start) that the box occupies, contiguous rows coalesced."""

    chunk: int
    file: str
    src_offsets: Tuple[int, ...]
    dst_offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    ranges: Tuple[Tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(e - b for b, e in self.ranges)


def box_ranges(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
               itemsize: int) -> List[Tuple[int, int]]:
    """Byte ranges of the row-major array ``shape`` that the box (offsets, sizes) occupies, in order,
    adjacent ones coalesced: a box of whole trailing dimensions is one range."""
    nd = len(shape)
    if any(s == 0 for s in sizes):
        return []
    if nd == 0:
        return [(0, itemsize)]
    strides = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = nd - 1  # the innermost dimension the box does not cover whole
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    run = sizes[k] * strides[k]
    starts = np.array([offsets[k] * strides[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):  # one run per index of the box's outer dimensions, in order
        starts = (((offsets[d] + np.arange(sizes[d], dtype=np.int64)) * strides[d])[:, None]
                  + starts[None, :]).reshape(-1)
    ends = starts + run
    if len(starts) > 1:  # coalesce runs that touch (a box of size-1 dims)
        keep = np.ones(len(starts), bool)
        keep[1:] = starts[1:] != ends[:-1]
        first = np.flatnonzero(keep)
        last = np.append(first[1:] - 1, len(starts) - 1)
        starts, ends = starts[first], ends[last]
    return list(zip(starts.tolist(), ends.tolist()))


def plan_reads(meta: ShardedTensorMeta, target_offsets: Optional[Sequence[int]] = None,
               target_sizes: Optional[Sequence[int]] = None) -> List[ReadItem]:
    """The stored chunks a target chunk overlaps and the boxes to copy from each.

    ``target_offsets`` / ``target_sizes`` place the target in the global tensor (a rank's local
    shard in the new layout); both None: the whole tensor (``load(..., rank=None)``)."""
    nd = len(meta.global_shape)
    if target_offsets is None and target_sizes is None:
        target_offsets, target_sizes = (0,) * nd, tuple(meta.global_shape)
    t_off, t_sz = tuple(target_offsets), tuple(target_sizes)
    if len(t_off) != nd or len(t_sz) != nd:
        raise RestoreError(f"{meta.key}: a target chunk of rank {len(t_sz)} for a tensor of shape "
                           f"{list(meta.global_shape)}")
    for d in range(nd):
        if t_off[d] < 0 or t_sz[d] < 0 or t_off[d] + t_sz[d] > meta.global_shape[d]:
            raise RestoreError(f"{meta.key}: target chunk at {list(t_off)} of sizes {list(t_sz)} lies "
                               f"outside the tensor's shape {list(meta.global_shape)}")
    items: List[ReadItem] = []
    if any(s == 0 for s in t_sz):
        return items
    for ci, c in enumerate(meta.chunks):
        lo = [max(a, b) for a, b in zip(c.chunk.offsets, t_off)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(c.chunk.offsets, c.chunk.sizes, t_off, t_sz)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        sizes = tuple(h - l for l, h in zip(lo, hi))
        src = tuple(l - o for l, o in zip(lo, c.chunk.offsets))
        dst = tuple(l - o for l, o in zip(lo, t_off))
        ranges = tuple(box_ranges(c.chunk.sizes, src, sizes, meta.itemsize))
        items.append(ReadItem(ci, c.file, src, dst, sizes, ranges))
    return items


def plan_bytes(meta: ShardedTensorMeta, items: Sequence[ReadItem], *, verify: bool = True) -> int:
    """Bytes :func:`load_into_tensor` reads for ``items`` (whole pieces when it verifies)."""
    return sum(e - b for _, b, e in _fetches(meta, items, verify))


# --------------------------------------------------------------------------------------------------
# range verification


class PieceHasher:
    """Streaming :func:`piece_digests`: ``update`` with consecutive bytes, then ``hexdigests()``."""

    def __init__(self, piece_size: int = PIECE_SIZE):
        if piece_size <= 0:
            raise ValueError("piece_size must be positive")
        self.piece_size = piece_size
        self._h = xxhash.xxh3_128()
        self._in = 0
        self._digests: List[str] = []
        self.size = 0

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        off = 0
        while off < len(mv):
            take = min(len(mv) - off, self.piece_size - self._in)
            self._h.update(mv[off: off + take])
            off += take
            self._in += take
            if self._in == self.piece_size:
                self._digests.append(self._h.hexdigest())
                self._h = xxhash.xxh3_128()
                self._in = 0
        self.size += len(mv)

    def hexdigests(self) -> List[str]:
        return self._digests + ([self._h.hexdigest()] if self._in else [])


def piece_digests(data: Any, piece_size: int = PIECE_SIZE) -> List[str]:
    """xxh3-128 (hex) of every ``piece_size`` bytes of ``data``; the last piece may be shorter."""
    mv = memoryview(data).cast("B")
    return [xxhash.xxh3_128_hexdigest(mv[i: i + piece_size]) for i in range(0, len(mv), piece_size)]


def pieces_for_range(begin: int, end: int, piece_size: int = PIECE_SIZE) -> range:
    """Indices of the pieces that bytes ``[begin, end)`` touch (empty for an empty range)."""
    if end <= begin:
        return range(0)
    return range(begin // piece_size, (end - 1) // piece_size + 1)


def verify_pieces(data: Any, first_piece: int, digests: Sequence[str], piece_size: int = PIECE_SIZE, *,
                  file: str = "<buffer>", what: str = "") -> None:
    """Check ``data``, which starts at piece ``first_piece`` and spans whole pieces (the region's last
    one may be short), against ``digests`` (all the region's piece digests). Raises
    :class:`IntegrityError` naming the file and the first piece that does not match."""
    mv = memoryview(data).cast("B")
    for j, i in enumerate(range(0, len(mv), piece_size)):
        k = first_piece + j
        piece = mv[i: i + piece_size]
        if k >= len(digests) or (len(piece) < piece_size and k != len(digests) - 1):
            raise IntegrityError(f"{file}: {what + ': ' if what else ''}piece {k} ({len(piece)} bytes) "
                                 f"is not one of the {len(digests)} recorded pieces")
        if xxhash.xxh3_128_hexdigest(piece) != digests[k]:
            raise IntegrityError(f"{file}: {what + ': ' if what else ''}checksum mismatch in piece {k} "
                                 f"(bytes {k * piece_size}..{k * piece_size + len(piece)} of the chunk's data)")


# --------------------------------------------------------------------------------------------------
# reading


def _span(meta: ShardedTensorMeta, c: StoredChunk, it: ReadItem) -> Tuple[int, int]:
    """The byte range of the stored chunk's rows (leading dim) that the item's box spans."""
    if not c.chunk.sizes:
        return 0, meta.itemsize
    row = _prod(c.chunk.sizes[1:]) * meta.itemsize
    return it.src_offsets[0] * row, (it.src_offsets[0] + it.sizes[0]) * row


def _fetches(meta: ShardedTensorMeta, items: Sequence[ReadItem], verify: bool
             ) -> List[Tuple[int, int, int]]:
    """(item index, begin, end) chunk-relative byte ranges to read: the items' ranges, widened to
    whole pieces when verifying against digests, adjacent ones coalesced."""
    out = []
    for n, it in enumerate(items):
        c = meta.chunks[it.chunk]
        rs: List[Tuple[int, int]] = list(it.ranges)
        if verify and c.digests:
            p = c.piece_size
            rs = [(b // p * p, min(-(-e // p) * p, c.nbytes)) for b, e in rs]
        merged: List[List[int]] = []
        for b, e in rs:
            if merged and b <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([b, e])
        out.extend((n, b, e) for b, e in merged)
    return out


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def target_chunk(target: Any) -> Tuple[Any, List[int], List[int]]:
    """(local tensor to fill, global offsets, sizes) of a target: a DTensor's local shard, or a plain
    tensor standing for the whole tensor."""
    from .tree import _dtensor_types

    dt = _dtensor_types()
    if dt is not None and isinstance(target, dt):
        offsets, sizes = dtensor_chunk(target)
        return target.to_local(), offsets, sizes
    return target, [0] * target.dim(), list(target.shape)


def load_into_tensor(target: Any, meta: ShardedTensorMeta, read_range: ReadRange, *, verify: bool = True) -> int:
    """Fill ``target`` in place from the stored chunks of ``meta``; returns the bytes read.

    ``target`` is a DTensor (its local shard is filled: any mesh, any Shard/Replicate placements)
    or a plain tensor (the whole tensor). ``read_range(file, begin, end)`` is called only for the
    byte ranges the target's boxes need; with ``verify`` (and digests recorded) the ranges are
    widened to whole pieces and each piece is checked first (:class:`IntegrityError` names the file
    and piece). A global shape or dtype that differs from the stored one is a :class:`RestoreError`
    naming the key and both."""
    dtype = str(target.dtype).replace("torch.", "")
    if tuple(target.shape) != tuple(meta.global_shape) or dtype != meta.dtype:
        raise RestoreError(
            f"{meta.key}: the target is shape {list(target.shape)} {dtype} but the checkpoint holds "
            f"shape {list(meta.global_shape)} {meta.dtype}")
    local, offsets, sizes = target_chunk(target)
    return load_chunk(local, meta, offsets, sizes, read_range, verify=verify)


def load_chunk(local: Any, meta: ShardedTensorMeta, offsets: Sequence[int], sizes: Sequence[int],
               read_range: ReadRange, *, verify: bool = True) -> int:
    """Fill the plain tensor ``local``, the box (offsets, sizes) of the global tensor, in place;
    returns the bytes read. What :func:`load_into_tensor` does once it knows the target's box."""
    import torch

    if list(local.shape) != list(sizes) or str(local.dtype).replace("torch.", "") != meta.dtype:
        raise RestoreError(f"{meta.key}: a local chunk of shape {list(local.shape)} {local.dtype} for a box "
                           f"of sizes {list(sizes)} {meta.dtype}")
    items = plan_reads(meta, offsets, sizes)
    fetched: Dict[int, List[Tuple[int, Any]]] = {}
    total = 0
    checked = getattr(read_range, "read_checked", None)  # a reader with other copies to fall back on
    for n, b, e in _fetches(meta, items, verify):
        c = meta.chunks[items[n].chunk]

        def check(data: Any, c: StoredChunk = c, b: int = b, e: int = e) -> None:
            if len(data) != e - b:
                raise IntegrityError(f"{c.file}: {meta.key}: read {len(data)} bytes at {c.offset + b}, "
                                     f"expected {e - b} (file truncated?)")
            if verify and c.digests:
                p = c.piece_size
                verify_pieces(data, b // p, c.digests, p, file=c.file, what=meta.key)

        if checked is not None:  # read_checked(file, begin, end, check): the first copy check passes
            data = memoryview(checked(c.file, c.offset + b, c.offset + e, check)).cast("B")
        else:
            data = memoryview(read_range(c.file, c.offset + b, c.offset + e)).cast("B")
            check(data)
        total += e - b
        fetched.setdefault(n, []).append((b, data))
    tdt = _torch_dtype(meta.dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only views: only copied from
        for n, it in enumerate(items):
            c = meta.chunks[it.chunk]
            s0, s1 = _span(meta, c, it)
            parts = fetched.get(n, [])
            whole = [(b, d) for b, d in parts if b <= s0 and b + len(d) >= s1]
            if whole:
                b, d = whole[0]
                buf = d[s0 - b: s1 - b]
            else:  # the box's rows were read as several ranges: gather them into the rows' span
                buf = bytearray(s1 - s0)
                for b, d in parts:
                    lo, hi = max(b, s0), min(b + len(d), s1)
                    if lo < hi:
                        buf[lo - s0: hi - s0] = d[lo - b: hi - b]
            rows = [it.sizes[0]] + list(c.chunk.sizes[1:]) if c.chunk.sizes else []
            src = torch.frombuffer(buf, dtype=tdt).reshape(rows)
            if rows:
                src = src[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(it.src_offsets[1:], it.sizes[1:]))]
            dst = local[tuple(slice(o, o + s) for o, s in zip(it.dst_offsets, it.sizes))]
            dst.copy_(src)
    return total


def assemble_full(meta: ShardedTensorMeta, read_range: ReadRange, *, verify: bool = True) -> Any:
    """The whole tensor of ``meta`` (a plain CPU tensor) from its stored chunks."""
    import torch

    out = torch.empty(tuple(meta.global_shape), dtype=_torch_dtype(meta.dtype))
    load_into_tensor(out, meta, read_range, verify=verify)
    return out


def iter_tensor_leaves(state: Any, path: Optional[list] = None) -> Iterator[Tuple[list, Any]]:
    """(path, tensor) of every tensor leaf (DTensors included) of a nested dict/list/tuple state."""
    import torch

    path = path or []
    if isinstance(state, dict):
        for k, v in state.items():
            yield from iter_tensor_leaves(v, path + [k])
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from iter_tensor_leaves(v, path + [i])
    elif isinstance(state, torch.Tensor):
        yield path, state


def _lookup(state: Any, path: list) -> Any:
    for k in path:
        if isinstance(state, dict) and k in state:
            state = state[k]
        elif isinstance(state, (list, tuple)) and isinstance(k, int) and 0 <= k < len(state):
            state = state[k]
        else:
            return None
    return state


def load_state_into(state: Any, index: ShardIndex, read_range: ReadRange, *, plain: Any = None,
                    verify: bool = True) -> Tuple[List[str], List[str]]:
    """Fill every tensor leaf of ``state`` (e.g. ``model.state_dict()`` or ``optim.state_dict()`` of
    the new layout) whose key is in ``index``, in place: a DTensor gets its local shard, a plain
    tensor the whole tensor. A tensor leaf not in the index (AdamW's ``step``: not sharded) is copied
    from the same path of ``plain`` when given (an unflattened part, e.g. rank 0's: such leaves are
    the same on every rank of an FSDP / DTensor state; unflatten it with ``on_sharded=lambda leaf: None``:
    its chunks are not needed). Returns (keys filled from the index, keys of
    tensor leaves left as they were). A DTensor leaf with no entry in the index, or a ``plain`` leaf
    of another shape or dtype, is a :class:`RestoreError`."""
    import torch

    from .tree import _dtensor_types

    dt = _dtensor_types()
    filled, rest = [], []
    for path, t in iter_tensor_leaves(state):
        key = leaf_key(path)
        m = index.get(key)
        if m is not None:
            load_into_tensor(t, m, read_range, verify=verify)
            filled.append(key)
            continue
        if dt is not None and isinstance(t, dt):
            raise RestoreError(f"{key}: a sharded tensor of the target has no stored chunks in the "
                               f"checkpoint (stored: {', '.join(sorted(index)[:6])}{', ...' if len(index) > 6 else ''})")
        src = _lookup(plain, path) if plain is not None else None
        if isinstance(src, torch.Tensor) and not (dt is not None and isinstance(src, dt)):
            if src.shape != t.shape or src.dtype != t.dtype:
                raise RestoreError(f"{key}: the target is shape {list(t.shape)} {t.dtype} but the checkpoint "
                                   f"holds shape {list(src.shape)} {src.dtype}")
            with torch.no_grad():
                t.copy_(src)
        rest.append(key)
    return filled, rest


def full_state(structure: Any, arrays: List[Any], tables: List[Any], index: ShardIndex, read_range: ReadRange,
               *, verify: bool = True, **unflatten_kw: Any) -> Any:
    """A part (structure and arrays, e.g. rank 0's) unflattened with every DTensor leaf assembled
    into its full tensor from ``index``: ``load(name, rank=None)`` of a sharded state."""
    from .tree import unflatten

    def full(leaf: Any) -> Any:
        m = index.get(leaf.key)
        if m is None:
            raise RestoreError(f"{leaf.key}: a sharded leaf with no entry in the shard index")
        return assemble_full(m, read_range, verify=verify)

    return unflatten(structure, arrays, tables, on_sharded=full, **unflatten_kw)


def file_reader(paths: Dict[str, str], counter: Optional[Dict[str, int]] = None) -> ReadRange:
    """A ``read_range`` over local files (file id -> path); ``counter["bytes"]`` / ``["calls"]``
    count what it reads. For tests and tools; an engine reads through its storage tier."""

    def read(file: str, begin: int, end: int) -> bytes:
        with open(paths[file], "rb") as f:
            f.seek(begin)
            data = f.read(end - begin)
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0) + len(data)
            counter["calls"] = counter.get("calls", 0) + 1
        return data

    return read


__all__ = [
    "PIECE_SIZE", "ChunkMeta", "StoredChunk", "ShardedTensorMeta", "ShardIndex", "ReadItem", "PieceHasher",
    "part_record", "index_of", "safetensors_array_offsets", "box_ranges", "plan_reads", "plan_bytes",
    "piece_digests", "pieces_for_range", "verify_pieces", "target_chunk", "load_into_tensor", "load_chunk",
    "assemble_full", "iter_tensor_leaves", "load_state_into", "full_state", "file_reader",
]
