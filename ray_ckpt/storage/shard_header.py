"""A sharded state's tensors file header, read by byte range and checked before any chunk is trusted.

A ranged restore never reads a whole file, so the whole-file checksum cannot vouch for the header
it plans from: the header's own digest (recorded in the manifest's shard heads) does, and the
shard index's chunks are cross-checked against it, so an index edited to point at other bytes is
refused. Used by ``sharded_io``'s readers; no Ray, no torch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import xxhash

from ..errors import IntegrityError
from ..formats import safetensors_io
from ..formats.nodes import leaf_key
from ..formats.sharded_leaf import walk_sharded


def digest_check(want: str, what: str) -> Callable[[Any], None]:
    """A check for ``RangeReader.read_checked``: the bytes' xxh3-128 is ``want``."""
    def check(data: Any) -> None:
        if xxhash.xxh3_128_hexdigest(memoryview(data).cast("B")) != want:
            raise IntegrityError(f"{what}: checksum mismatch")
    return check


def parse_header(file: str, head: Any, n: int, size: int) -> Tuple[Any, Dict[str, Any], List[str], List[int], List[int]]:
    """(structure, header, array names, byte offsets, byte sizes) of a ray_ckpt safetensors file's
    first ``n`` bytes (its length prefix and header), parsed by ``safetensors_io.parse_header``; the
    length prefix must be the recorded one."""
    h = safetensors_io.parse_header(head, size, path=file)
    if h.base != n:
        raise IntegrityError(f"{file}: not a ray_ckpt safetensors header (header length {h.base - 8} != "
                             f"recorded {n - 8})")
    return h.structure, h.tensors, h.names, h.offsets, h.sizes


def check_header_chunks(index: Any, file: str, structure: Any, header: Dict[str, Any], names: List[str],
                        offsets: List[int], sizes: List[int]) -> None:
    """Cross-check the chunks the shard index places in ``file`` against that file's own header:
    every chunk the index places in the file is, by the file's structure and safetensors header, a
    chunk of that tensor at that byte offset with that box and byte size (and the file's record of
    the tensor has the index's global shape and dtype). A file chunk the index omits is not an error
    here (the index's chunks tile each tensor, each one checked against its own file). A chunk whose
    box was swapped with another's, or that points at other bytes of the file, is an
    :class:`IntegrityError` naming the file and the chunk."""
    from ..formats.shard_index import numel_of

    def bad(key: str, why: str) -> IntegrityError:
        return IntegrityError(f"{file}: {key}: the shard index does not match the file's header: {why}")

    want: Dict[Tuple[str, int], Tuple[Tuple[int, ...], Tuple[int, ...]]] = {}
    try:
        for path, node in walk_sharded(structure):
            key, i = leaf_key(path), node["DT"]
            if i is None or numel_of(node["sh"]) == 0:
                continue
            m = index.get(key)
            if m is None:
                continue  # a tensor the index does not list: nothing of it is read through the index
            if list(node["g"]) != list(m.global_shape) or node["dt"] != m.dtype:
                raise bad(key, f"the file holds shape {node['g']} {node['dt']}, the index "
                               f"{list(m.global_shape)} {m.dtype}")
            if not isinstance(i, int) or not 0 <= i < len(names) or list(header[names[i]]["shape"]) != list(node["sh"]):
                raise bad(key, f"array {i} of the header is not the chunk of sizes {node['sh']}")
            want[(key, offsets[i])] = (tuple(node["o"]), tuple(node["sh"]), sizes[i])
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"{file}: the header's DTensor records are malformed ({exc})") from None
    for key, c in index.chunks_in(file):
        box = (list(c.chunk.offsets), list(c.chunk.sizes))
        w = want.get((key, c.offset))
        if w is None:
            raise bad(key, f"the index's chunk at {box[0]} of sizes {box[1]} (bytes {c.offset}.."
                           f"{c.offset + c.nbytes}) is not a chunk of this tensor in the file")
        if (w[0], w[1]) != tuple(map(tuple, box)) or w[2] != c.nbytes:
            raise bad(key, f"the index's chunk at {box[0]} of sizes {box[1]} ({c.nbytes} bytes at "
                           f"{c.offset}) is, by the file's header, the chunk at {list(w[0])} of sizes "
                           f"{list(w[1])} ({w[2]} bytes)")
