"""What one rank's file of a sharded (DTensor) state contributes to the state's shard index.

A writer makes one :class:`ShardRecord` per rank file (:func:`part_record`, plus the file's
:class:`ShardHead` from ``storage.checkpoint_io.shard_record``) and hands it to the coordinator with
the part (``protocol.WrittenPart.shards``); when every part of the state is written the
coordinator merges them with :func:`index_of` and stores the index's JSON, with rank 0's head under
``"heads"``, in the manifest entry. ``to_json`` / ``from_json`` give the JSON form (for tools and
tests that keep records in files). No Ray, no storage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import IntegrityError
from .flat import Flat, pieces_of
from .nodes import leaf_key
from .pieces import PIECE_SIZE, PieceHasher
from .shard_index import (INDEX_FORMAT, ChunkMeta, ShardedTensorMeta, ShardIndex, StoredChunk, is_digest,
                          itemsize_of, json_int, numel_of)
from .sharded_leaf import walk_sharded

# the key of the manifest's shard index under which ranks' ShardHead JSON lies (rank 0's only)
HEADS_KEY = "heads"


class PlainArray(NamedTuple):
    """A non-sharded array of a rank's file (AdamW's ``step``): its index among the part's arrays,
    its byte range in the file and the xxh3-128 of those bytes."""

    index: int
    offset: int
    nbytes: int
    xxh3: str


@dataclass(frozen=True)
class ShardHead:
    """Where a rank's tensors file keeps what is not a DTensor chunk: the header's length (its
    8-byte length prefix included) and xxh3-128, and every non-sharded array's range and digest.
    With it a reader of another layout reads the header and those arrays by range, each verified,
    never the whole file. JSON form: ``{"n", "xxh3", "plain": [[index, offset, nbytes, xxh3], ...]}``."""

    nbytes: int
    xxh3: str
    plain: Tuple[PlainArray, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        return {"n": self.nbytes, "xxh3": self.xxh3, "plain": [list(p) for p in self.plain]}

    @classmethod
    def from_json(cls, d: Any) -> "ShardHead":
        """Strict (a manifest read from storage may be hostile): ValueError / KeyError / TypeError
        for a field that is missing or of the wrong JSON type."""
        if not isinstance(d, dict) or not isinstance(d["plain"], list):
            raise TypeError("a shard head is an object with a list 'plain'")
        if not is_digest(d["xxh3"]):
            raise ValueError(f"header digest {d['xxh3']!r} is not an xxh3-128 hex digest")
        plain = []
        for p in d["plain"]:
            if not isinstance(p, list) or len(p) != 4 or not is_digest(p[3]):
                raise ValueError(f"plain array record {p!r} is not [index, offset, nbytes, xxh3]")
            plain.append(PlainArray(json_int(p[0], "array index"), json_int(p[1], "byte offset"),
                                    json_int(p[2], "byte count"), p[3]))
        return cls(json_int(d["n"], "header length"), d["xxh3"], tuple(plain))


@dataclass(frozen=True)
class ShardRecord:
    """One rank file's part of a sharded state's index: ``tensors`` holds, for every sharded leaf of
    the part, the tensor's global shape and dtype with the chunks stored in ``file`` (none for a
    replica another rank stores, or an empty chunk); ``head`` (None when only the chunks were
    recorded) is where the file keeps its header and non-sharded arrays."""

    file: str
    tensors: Tuple[ShardedTensorMeta, ...]
    head: Optional[ShardHead] = None

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"format": INDEX_FORMAT, "file": self.file,
                             "tensors": {m.key: m.to_json() for m in self.tensors}}
        if self.head is not None:
            d["head"] = self.head.to_json()
        return d

    @classmethod
    def from_json(cls, d: Any) -> "ShardRecord":
        """Strict parse of :meth:`to_json`'s form; a malformed field is an :class:`IntegrityError`."""
        if not isinstance(d, dict) or d.get("format") != INDEX_FORMAT or not isinstance(d.get("tensors"), dict):
            raise IntegrityError(f"not a ray_ckpt shard record (format {INDEX_FORMAT} expected)")
        tensors = tuple(ShardedTensorMeta.from_json(k, m) for k, m in d["tensors"].items())
        try:
            if not isinstance(d["file"], str):
                raise TypeError(f"file {d['file']!r} is not a name")
            head = ShardHead.from_json(d["head"]) if d.get("head") is not None else None
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"shard record: malformed ({type(exc).__name__}: {exc})") from None
        return cls(d["file"], tensors, head)


def part_record(flat_or_structure: Any, file: str, array_offsets: Sequence[int], *,
                arrays: Optional[Sequence[Any]] = None, piece_size: int = PIECE_SIZE) -> ShardRecord:
    """What one rank's file contributes to the shard index (merge with :func:`index_of`), without a head.

    ``flat_or_structure`` is the part's :class:`~ray_ckpt.formats.flat.Flat` (its DTensor chunks'
    piece digests are computed from its arrays, at memory speed) or only its structure (then
    ``arrays`` gives the bytes, or no digests are recorded). ``array_offsets[i]`` is the byte offset
    of ``arrays[i]`` in ``file``."""
    if isinstance(flat_or_structure, Flat):
        structure, arrays = flat_or_structure.structure, flat_or_structure.arrays
    else:
        structure = flat_or_structure
    tensors: Dict[str, ShardedTensorMeta] = {}
    for path, node in walk_sharded(structure):
        key = leaf_key(path)
        if key in tensors:
            raise ValueError(f"two sharded leaves have the key {key!r}")
        meta = tensors[key] = ShardedTensorMeta(key, tuple(node["g"]), node["dt"], [], path, tuple(node["m"]),
                                                tuple(node["p"]))
        i = node["DT"]
        if i is None or numel_of(node["sh"]) == 0:
            continue  # a replica (stored by rank node["w"]) or an empty chunk
        digests: List[str] = []
        if arrays is not None:
            h = PieceHasher(piece_size)
            for p in pieces_of(arrays[i]):
                h.update(p)
            digests, nbytes = h.hexdigests(), h.size
        else:
            nbytes = numel_of(node["sh"]) * itemsize_of(node["dt"])
        meta.chunks.append(StoredChunk(ChunkMeta(node["o"], node["sh"]), file, int(array_offsets[i]), nbytes,
                                       piece_size, tuple(digests)))
    return ShardRecord(file, tuple(tensors.values()))


def index_of(records: Iterable[ShardRecord]) -> ShardIndex:
    """Merge every rank's :class:`ShardRecord` into the index of a sharded state.

    Checks that the ranks agree on each tensor's shape and dtype and that its stored chunks tile
    it (:meth:`ShardedTensorMeta.validate`: a missing rank file leaves a hole); raises
    :class:`IntegrityError` otherwise."""
    index = ShardIndex()
    seen: Dict[str, set] = {}
    for rec in records:
        for e in rec.tensors:
            m = index.get(e.key)
            if m is None:
                m = index[e.key] = ShardedTensorMeta(e.key, tuple(e.global_shape), e.dtype, [], e.path,
                                                     tuple(e.mesh_shape), tuple(e.placements))
                seen[e.key] = set()
            elif tuple(e.global_shape) != m.global_shape or e.dtype != m.dtype:
                raise IntegrityError(
                    f"{e.key}: the parts disagree on the global tensor: shape {list(m.global_shape)} "
                    f"{m.dtype} vs shape {list(e.global_shape)} {e.dtype} (file {rec.file!r})")
            for c in e.chunks:
                box = (c.chunk.offsets, c.chunk.sizes)
                if box in seen[e.key]:
                    continue  # the same chunk written twice: keep the first
                seen[e.key].add(box)
                m.chunks.append(c)
    for m in index.values():
        m.chunks.sort(key=lambda c: c.chunk.offsets)
        m.validate()
    return index
