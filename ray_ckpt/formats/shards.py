"""Sharded (DTensor) state: reading what a new layout needs, verified.

No Ray here, and no storage: bytes come through a ``read_range(file, begin, end)`` callable.

A rank's part of a sharded state is an ordinary flattened state (``tree.flatten``) whose DTensor
leaves hold that rank's LOCAL chunk ("DT" nodes). To restore on another world size or mesh, a
reader needs what DCP keeps in its ``Metadata``: for every sharded tensor its global shape and
dtype and, for every stored chunk, its box in the global tensor and where its bytes are. That is a
:class:`ShardIndex` (``formats.shard_index``), merged from one ``ShardRecord`` per rank file
(``formats.shard_record``) and stored as JSON in the manifest. ``formats.read_plan`` intersects a
target chunk (a rank's local shard in the new layout, or the whole tensor) with the stored chunks;
:func:`load_into_tensor` then reads only the byte ranges those boxes need, checked against
per-piece digests of each chunk's data (``formats.pieces``, xxh3-128 per ``PIECE_SIZE`` bytes): a
rank of a 64-way restore reads and verifies about its own share of the checkpoint, never the whole
of it.

The restore side: ``ShardIndex.from_json(...)`` then ``load_state_into(state, index, read_range,
plain=<rank 0's part unflattened>)`` for ``load_into(name, state, rank=r)`` (DTensor leaves filled in
place on any mesh, whatever the saved world size), or ``full_state(<rank 0's part>, index,
read_range)`` for ``load(name, rank=None)`` (DTensor leaves assembled by :func:`assemble_full`).
The planning names (``ReadItem``, ``plan_reads``, ``box_ranges``, ``plan_bytes``) are re-exported here.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import IntegrityError, RestoreError
from .pieces import verify_pieces
from .read_plan import ReadItem, box_ranges, fetches, plan_bytes, plan_reads, row_span
from .shard_index import ShardedTensorMeta, ShardIndex, StoredChunk
from .nodes import leaf_key
from .sharded_leaf import global_rank, layout_of

ReadRange = Callable[[str, int, int], Any]  # (file id, begin, end) -> bytes-like of end - begin bytes


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def target_chunk(target: Any, rank: Any = ...) -> Tuple[Any, List[int], List[int]]:
    """(local tensor to fill, global offsets, sizes) of a target: a DTensor's local shard, or a plain
    tensor standing for the whole tensor. ``rank``: ``sharded_leaf.global_rank()``, asked here when
    not given (a caller with many targets asks once)."""
    from .sharded_leaf import TensorChunk, dtensor_type

    if isinstance(target, TensorChunk):
        return target.local, list(target.offsets), list(target.local.shape)
    dt = dtensor_type()
    if dt is not None and isinstance(target, dt):
        import torch

        layout, _ = layout_of(target, global_rank() if rank is ... else rank)  # remembered per layout
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            local = target.to_local()
        return local, list(layout["o"]), list(layout["sh"])
    return target, [0] * target.dim(), list(target.shape)


def load_into_tensor(target: Any, meta: ShardedTensorMeta, read_range: ReadRange, *, verify: bool = True,
                     rank: Any = ...) -> int:
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
    local, offsets, sizes = target_chunk(target, rank)
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
    into = getattr(read_range, "read_checked_into", None)
    direct = _direct_targets(meta, items, local) if into is not None else {}
    done: set = set()  # items read straight into the target
    for n, b, e in fetches(meta, items, verify):
        c = meta.chunks[items[n].chunk]
        if n in direct:  # the whole stored chunk into its place in the target: read there, checked there
            into(c.file, c.offset, direct.pop(n), _piece_check(meta, c, 0, c.nbytes, verify))
            done.add(n)
            total += c.nbytes
            continue
        check = _piece_check(meta, c, b, e, verify)
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
            if n in done:
                continue
            c = meta.chunks[it.chunk]
            s0, s1 = row_span(meta, c, it)
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


def _direct_targets(meta: ShardedTensorMeta, items: Sequence[ReadItem], local: Any) -> Dict[int, Any]:
    """item index -> the writable bytes of its place in ``local``, for the items that copy a whole
    stored chunk into a contiguous region of a CPU target (the same layout as saved: every item;
    a resharded one: the chunks that fall whole in the new shard, split on the leading dim): those
    are read into the target's memory, not into a buffer copied from after."""
    import torch

    out: Dict[int, Any] = {}
    if local.device.type != "cpu" or local.is_conj() or local.is_neg():
        return out
    for n, it in enumerate(items):
        c = meta.chunks[it.chunk]
        if c.nbytes == 0 or any(it.src_offsets) or tuple(it.sizes) != tuple(c.chunk.sizes):
            continue
        whole = not any(it.dst_offsets) and tuple(it.sizes) == tuple(local.shape)
        dst = (local if whole else local[tuple(slice(o, o + s) for o, s in zip(it.dst_offsets, it.sizes))]).detach()
        if not dst.is_contiguous() or dst.numel() * dst.element_size() != c.nbytes:
            continue
        out[n] = memoryview(dst.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return out


def _piece_check(meta: ShardedTensorMeta, c: StoredChunk, b: int, e: int, verify: bool) -> Callable[[Any], None]:
    """The check of bytes [b, e) of stored chunk ``c`` (chunk-relative): their length, and with
    ``verify`` (and digests recorded) every piece's digest."""
    def check(data: Any) -> None:
        if len(data) != e - b:
            raise IntegrityError(f"{c.file}: {meta.key}: read {len(data)} bytes at {c.offset + b}, "
                                 f"expected {e - b} (file truncated?)")
        if verify and c.digests:
            p = c.piece_size
            verify_pieces(data, b // p, c.digests, p, file=c.file, what=meta.key)

    return check


def assemble_full(meta: ShardedTensorMeta, read_range: ReadRange, *, verify: bool = True) -> Any:
    """The whole tensor of ``meta`` (a plain CPU tensor) from its stored chunks."""
    import torch

    out = torch.empty(tuple(meta.global_shape), dtype=_torch_dtype(meta.dtype))
    load_into_tensor(out, meta, read_range, verify=verify)
    return out


def iter_tensor_leaves(state: Any, path: Optional[list] = None) -> Iterator[Tuple[list, Any]]:
    """(path, tensor) of every tensor leaf (DTensors and ``TensorChunk`` boxes included) of a nested
    dict/list/tuple state."""
    import torch

    from .sharded_leaf import TensorChunk

    path = path or []
    if isinstance(state, dict):
        for k, v in state.items():
            yield from iter_tensor_leaves(v, path + [k])
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from iter_tensor_leaves(v, path + [i])
    elif isinstance(state, (torch.Tensor, TensorChunk)):
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

    from .sharded_leaf import dtensor_type

    dt = dtensor_type()
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
    "ReadRange", "ReadItem", "box_ranges", "plan_reads", "plan_bytes", "target_chunk", "load_into_tensor",
    "load_chunk", "assemble_full", "iter_tensor_leaves", "load_state_into", "full_state", "file_reader",
]
