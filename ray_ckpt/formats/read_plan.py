"""Read planning for a sharded (DTensor) tensor: which bytes of which stored chunks a target box needs.

Pure arithmetic over a :class:`~ray_ckpt.formats.shard_index.ShardedTensorMeta`: no bytes are read
here (``formats.shards`` reads and verifies them) and no torch, so a tool can tell what a restore
on another layout would read before reading it. :func:`plan_reads` intersects a target chunk (a
rank's local shard in the new layout, or the whole tensor) with the stored chunks;
:func:`fetches` turns the plan into the chunk-relative byte ranges to read (widened to whole
pieces when each piece is to be verified against its digest); :func:`plan_bytes` sums them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import RestoreError
from .shard_index import ShardedTensorMeta, StoredChunk, numel_of


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
        if c.chunk.offsets == t_off and c.chunk.sizes == t_sz:  # the same box (a load on the saved layout)
            whole = ((0, c.nbytes),) if c.nbytes else ()
            items.append(ReadItem(ci, c.file, (0,) * nd, (0,) * nd, t_sz, whole))
            continue
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
    return sum(e - b for _, b, e in fetches(meta, items, verify))


def row_span(meta: ShardedTensorMeta, c: StoredChunk, it: ReadItem) -> Tuple[int, int]:
    """The byte range of the stored chunk's rows (leading dim) that the item's box spans."""
    if not c.chunk.sizes:
        return 0, meta.itemsize
    row = numel_of(c.chunk.sizes[1:]) * meta.itemsize
    return it.src_offsets[0] * row, (it.src_offsets[0] + it.sizes[0]) * row


def fetches(meta: ShardedTensorMeta, items: Sequence[ReadItem], verify: bool
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
