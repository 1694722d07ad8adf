"""The shard index of a sharded (DTensor) state: every stored chunk's box and where its bytes are.

What DCP keeps in its ``Metadata``, for ray_ckpt: for every sharded tensor its global shape and
dtype and, for every stored chunk, its box in the global tensor, the file and offset of its
row-major bytes and its piece digests (``formats.pieces``). A writer records one
``formats.shard_record.ShardRecord`` per rank file; the coordinator merges them with
``shard_record.index_of`` at the commit and stores ``ShardIndex.to_json()`` in the manifest entry of
the state. A reader gets it back with ``ShardIndex.from_json`` (validated: a manifest read from
storage may be hostile) and plans reads with ``formats.read_plan``. No Ray, no storage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import IntegrityError
from .pieces import PIECE_SIZE

INDEX_FORMAT = 1

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "complex64": 8, "complex128": 16,
}


def itemsize_of(dtype: str) -> int:
    """Bytes per element of a torch dtype named ``dtype`` ("float32"); ValueError for anything that
    is not the name of a torch dtype (the name comes from a manifest: never ``getattr`` a non-dtype)."""
    if not isinstance(dtype, str):
        raise ValueError(f"dtype {dtype!r} is not a name")
    n = _ITEMSIZE.get(dtype)
    if n is None:
        import torch

        t = getattr(torch, dtype, None) if dtype.isidentifier() and not dtype.startswith("_") else None
        if not isinstance(t, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        n = t.itemsize
    return n


_MAX_DIM = 1 << 48  # bound of any offset, size or byte count read from an index (no int64 overflow)
_DIGEST_CHARS = frozenset("0123456789abcdef")


def is_digest(x: Any) -> bool:
    """Whether ``x`` is an xxh3-128 hex digest (32 lowercase hex characters)."""
    return isinstance(x, str) and len(x) == 32 and set(x) <= _DIGEST_CHARS


def json_int(x: Any, what: str) -> int:
    if type(x) is not int or not -_MAX_DIM <= x <= _MAX_DIM:
        raise ValueError(f"{what} {x!r} is not an integer of at most 2**48")
    return x


def _ints(xs: Any, what: str) -> Tuple[int, ...]:
    if not isinstance(xs, list) or len(xs) > 64:
        raise ValueError(f"{what} {xs!r} is not a list of integers")
    return tuple(json_int(x, what) for x in xs)


def numel_of(xs: Iterable[int]) -> int:
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
        return numel_of(self.sizes)


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk: its box and where its row-major bytes are.

    ``file`` is whatever id the reader's ``read_range`` understands (the part's file path relative
    to the version, or "rank3"); ``offset`` is the byte offset of the chunk's data in that file.
    ``digests[k]`` is the xxh3-128 of bytes ``[k * piece_size, (k + 1) * piece_size)`` of the
    chunk's data. Every writer records them; a reader refuses a chunk without them
    (``ShardIndex.from_json(require_digests=True)``): an edited index must not turn verification off."""

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
        """Strict: every field of the right JSON type (an index read from storage may be hostile);
        ValueError / KeyError / TypeError otherwise (``ShardedTensorMeta.from_json`` names the chunk)."""
        if not isinstance(d, dict):
            raise TypeError(f"a chunk is {type(d).__name__}, not an object")
        if not isinstance(d["file"], str) or not d["file"]:
            raise ValueError(f"file {d['file']!r} is not a file name")
        digests = d.get("xxh3", [])
        if not isinstance(digests, list) or not all(is_digest(x) for x in digests):
            raise ValueError("xxh3 is not a list of xxh3-128 hex digests")
        ps = json_int(d.get("ps", PIECE_SIZE), "piece size")
        if ps <= 0:
            raise ValueError(f"piece size {ps}")
        return cls(ChunkMeta(_ints(d["o"], "offsets"), _ints(d["s"], "sizes")), d["file"],
                   json_int(d["at"], "byte offset"), json_int(d["n"], "byte count"), ps, tuple(digests))


_PAIRWISE_UP_TO = 16  # chunks of one tensor compared pair by pair; more: with numpy, in blocks


def _no_overlap_pairwise(chunks: Sequence[StoredChunk], bad: Any) -> None:
    """Raise ``bad(why)`` if two of a few chunks overlap (what the numpy check does for many; for
    the two to sixteen chunks of most tensors its set-up costs more than the comparisons)."""
    boxes = [(c.chunk.offsets, tuple(o + z for o, z in zip(c.chunk.offsets, c.chunk.sizes))) for c in chunks]
    for i, (alo, ahi) in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            blo, bhi = boxes[j]
            if all(a < y and b < x for a, x, b, y in zip(alo, ahi, blo, bhi)):
                raise bad(f"chunks at {list(alo)} and {list(blo)} overlap (in {chunks[i].file} and "
                          f"{chunks[j].file})")


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
        return itemsize_of(self.dtype)

    @property
    def numel(self) -> int:
        return numel_of(self.global_shape)

    def validate(self, file_sizes: Optional[Dict[str, int]] = None, require_digests: bool = False) -> None:
        """Structural checks of the chunks (a manifest is read from storage that may be hostile):
        a known dtype; every chunk lies inside the shape, holds ``numel * itemsize`` bytes at a
        non-negative offset with one digest per piece, and the chunks tile the tensor (no overlap,
        no hole). With ``file_sizes`` (file id -> size, from the manifest) every chunk's byte range
        lies inside a file of the state: checked before a reader allocates or reads anything, so a
        small file cannot claim a huge chunk. With ``require_digests`` a chunk without piece digests
        is refused (its bytes could not be verified by range). Raises :class:`IntegrityError` naming
        the tensor and, for a chunk, its file and box."""
        def bad(why: str) -> IntegrityError:
            return IntegrityError(f"shard index: {self.key}: {why}")

        shape = self.global_shape
        if len(shape) > 64 or any(type(n) is not int or not 0 <= n <= _MAX_DIM for n in shape):
            raise bad(f"bad shape {list(shape)}")
        try:
            item = self.itemsize
        except (ValueError, AttributeError, TypeError):
            files = sorted({c.file for c in self.chunks})
            raise bad(f"unknown dtype {self.dtype!r} (chunks in {', '.join(files[:4]) or 'no file'}"
                      f"{', ...' if len(files) > 4 else ''})") from None
        for c in self.chunks:
            o, z = c.chunk.offsets, c.chunk.sizes
            if len(o) != len(shape) or any(a < 0 or b <= 0 or a + b > n for a, b, n in zip(o, z, shape)):
                raise bad(f"chunk at {list(o)} of sizes {list(z)} in {c.file} is not inside shape {list(shape)}")
            if c.nbytes != c.chunk.numel * item or c.offset < 0:
                raise bad(f"chunk at {list(o)} in {c.file}: {c.nbytes} bytes at {c.offset}, expected "
                          f"{c.chunk.numel * item}")
            if c.digests and (c.piece_size <= 0 or len(c.digests) != -(-c.nbytes // c.piece_size)):
                raise bad(f"chunk at {list(o)} in {c.file}: {len(c.digests)} piece digests for {c.nbytes} "
                          f"bytes in pieces of {c.piece_size}")
            if file_sizes is not None:
                size = file_sizes.get(c.file)
                if size is None:
                    raise bad(f"chunk at {list(o)} names file {c.file!r}, which is not one of the state's "
                              f"files in the manifest")
                if c.offset + c.nbytes > size:
                    raise bad(f"chunk at {list(o)} of sizes {list(z)} in {c.file}: bytes {c.offset}.."
                              f"{c.offset + c.nbytes} lie past the end of the file ({size} bytes in the manifest)")
        covered = sum(c.chunk.numel for c in self.chunks)
        if covered != self.numel:
            raise bad(f"the stored chunks hold {covered} of the {self.numel} elements of shape "
                      f"{list(shape)}: a rank's part is missing or chunks repeat")
        if 1 < len(self.chunks) <= _PAIRWISE_UP_TO:  # equal volumes and no overlap: the chunks tile the tensor
            _no_overlap_pairwise(self.chunks, bad)
        elif len(self.chunks) > 1:
            lo = np.array([c.chunk.offsets for c in self.chunks], dtype=np.int64).reshape(len(self.chunks), -1)
            hi = lo + np.array([c.chunk.sizes for c in self.chunks], dtype=np.int64).reshape(lo.shape)
            for i in range(0, len(lo), 256):
                a, b = lo[i: i + 256, None, :], hi[i: i + 256, None, :]
                hit = ((a < hi[None]) & (lo[None] < b)).all(axis=2)
                hit[np.arange(hit.shape[0]), np.arange(i, i + hit.shape[0])] = False
                if hit.any():
                    r, j = map(int, np.argwhere(hit)[0])
                    raise bad(f"chunks at {lo[i + r].tolist()} and {lo[j].tolist()} overlap (in "
                              f"{self.chunks[i + r].file} and {self.chunks[j].file})")
        if require_digests:
            for c in self.chunks:
                if not c.digests:
                    raise bad(f"chunk at {list(c.chunk.offsets)} of sizes {list(c.chunk.sizes)} in {c.file} "
                              f"has no piece digests: its bytes could not be verified; refused")

    def to_json(self) -> dict:
        return {"shape": list(self.global_shape), "dtype": self.dtype, "path": self.path,
                "mesh": list(self.mesh_shape), "placements": list(self.placements),
                "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, key: str, d: dict) -> "ShardedTensorMeta":
        """Strict parse; a malformed field is an :class:`IntegrityError` naming the tensor and, for a
        chunk, its position and file."""
        def bad(why: str) -> IntegrityError:
            return IntegrityError(f"shard index: {key}: malformed entry ({why})")

        try:
            if not isinstance(d, dict) or not isinstance(d["chunks"], list):
                raise TypeError("not an object with a list of chunks")
            shape, dtype = _ints(d["shape"], "shape"), d["dtype"]
            if not isinstance(dtype, str):
                raise TypeError(f"dtype {dtype!r} is not a name")
            mesh, placements = d.get("mesh", []), d.get("placements", [])
            if not isinstance(mesh, list) or not isinstance(placements, list):
                raise TypeError("mesh and placements must be lists")
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"{type(exc).__name__}: {exc}") from None
        chunks = []
        for i, c in enumerate(d["chunks"]):
            try:
                chunks.append(StoredChunk.from_json(c))
            except (KeyError, TypeError, ValueError) as exc:
                f = c.get("file") if isinstance(c, dict) else None
                raise bad(f"chunk {i} (file {f!r}, box at {c.get('o') if isinstance(c, dict) else None}): "
                          f"{type(exc).__name__}: {exc}") from None
        return cls(key, shape, dtype, chunks, d.get("path"), tuple(mesh), tuple(placements))


class ShardIndex(Dict[str, ShardedTensorMeta]):
    """key (``nodes.leaf_key`` of the leaf's path, "optim/state/0/exp_avg") -> its metadata."""

    def to_json(self) -> dict:
        return {"format": INDEX_FORMAT, "tensors": {k: m.to_json() for k, m in self.items()}}

    def chunks_in(self, file: str) -> List[Tuple[str, StoredChunk]]:
        """(tensor key, chunk) of every chunk stored in ``file``. Grouped once per index (a reader
        checks the header of every file it reads from); an index is not changed once read."""
        by_file = self.__dict__.get("_by_file")
        if by_file is None:
            by_file = self._by_file = {}
            for key, m in self.items():
                for c in m.chunks:
                    by_file.setdefault(c.file, []).append((key, c))
        return by_file.get(file, [])

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, d: Any, *, file_sizes: Optional[Dict[str, int]] = None,
                  require_digests: bool = True) -> "ShardIndex":
        """Parse and check an index read from storage (:meth:`ShardedTensorMeta.validate`): strict
        field types, a known dtype, chunks that tile each tensor, piece digests on every chunk
        (``require_digests``) and, with ``file_sizes`` (the manifest's file sizes), byte ranges
        inside the files. Every defect is an :class:`IntegrityError` naming the tensor and chunk."""
        if isinstance(d, (str, bytes)):
            try:
                d = json.loads(d)
            except ValueError as exc:
                raise IntegrityError(f"shard index: not JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT or not isinstance(d.get("tensors"), dict):
            raise IntegrityError(f"not a ray_ckpt shard index (format {INDEX_FORMAT} expected)")
        out = cls()
        for k, m in d["tensors"].items():
            out[k] = ShardedTensorMeta.from_json(k, m)
        for m in out.values():
            m.validate(file_sizes, require_digests)
        return out
