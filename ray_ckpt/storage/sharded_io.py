"""Sharded (DTensor) states on the tiers: ranged, verified reads for ``load_into`` and ``load(rank=None)``.

No Ray here: the engine calls these in whatever process wants the state (a rank actor, a driver,
``ray-ckpt export``). The formats side (``formats.shards``) plans which byte ranges a target layout
needs and checks them against per-piece digests; this module supplies the bytes:

* :class:`~.range_reader.RangeReader` (its own module) reads a byte range of one of a state's files
  from the first tier whose copy passes the check (local first, then remote: like every other
  read), and counts what it read;
* :func:`read_head` reads rank 0's file header and its non-sharded leaves (AdamW's ``step``, the
  nested structure with its scalars) by their recorded ranges and digests, never the whole file;
* :func:`load_into_state` fills a target state in place (DTensors on any mesh: resharding);
  :func:`load_full` assembles every DTensor leaf into its full tensor;
* :func:`load_rank_local_into` is ``load_into`` of a state that is not resharding-capable (plain
  tensors pushed per rank): refused, naming both sizes, when the world size differs.

A header is checked by ``shard_header`` (its digest, and the index's chunks against it); a target
is compared with the stored state by ``target_match`` before any of its bytes change.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checkpoint_io import decode_files, rank_files, read_files
from ..errors import IntegrityError, RestoreError, about
from ..formats import safetensors_io
from ..formats.manifest import ROLE_TABLE, ROLE_TENSORS, StateEntry
from ..formats.nodes import leaf_key
from ..formats.shard_record import HEADS_KEY, ShardHead
from ..formats.sharded_leaf import global_rank, walk_sharded
from ..formats.tree import unflatten
from .shard_header import check_header_chunks, digest_check, parse_header
from .target_match import check_keys, match_tensor, merge_scalars, mismatch, refuse_mismatches, tensor_keys
from .range_reader import RangeReader
from .tier import Tier
from ..types import StateReport


def index_of_entry(entry: StateEntry, name: str) -> Any:
    """The state's shard index, checked before anything is read or allocated: strict fields, a known
    dtype, chunks that tile each tensor, piece digests on every chunk (a chunk without them is
    refused rather than read unverified: every ray_ckpt writer records them, so their absence means
    an edited or damaged index), and every chunk's byte range inside one of the state's tensors
    files, by the sizes the manifest records (a small file cannot claim a huge chunk)."""
    from ..formats.shard_index import ShardIndex

    sizes = {f.path: f.size for f in entry.all_files() if f.role == ROLE_TENSORS}
    try:
        return ShardIndex.from_json(entry.shards, file_sizes=sizes)
    except IntegrityError as exc:
        raise IntegrityError(f"state {name!r}: {exc}") from None


def read_head(entry: StateEntry, name: str, reader: RangeReader, tiers: Sequence[Tier],
              allow_pickle: bool = False, index: Any = None) -> Tuple[Any, List[Any], List[Any]]:
    """(structure, arrays, tables) of rank 0's part without its sharded chunks: the header and the
    non-sharded arrays are read by range and checked against the digests the writer recorded;
    the DTensor nodes' array indices are cleared (their bytes come from the shard index). With
    ``index``, the chunks it places in rank 0's file are cross-checked against the header
    (:func:`check_header_chunks`)."""
    files = rank_files(entry, name, 0)
    tensors = [f for f in files if f.role == ROLE_TENSORS]
    if len(tensors) != 1:
        raise IntegrityError(f"state {name!r}: rank 0 has {len(tensors)} tensors files, expected 1")
    f = tensors[0]
    try:
        head = ShardHead.from_json((entry.shards or {})[HEADS_KEY]["0"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"state {name!r}: the manifest's shard heads are malformed ({exc})") from None
    n, head_digest, plain = head.nbytes, head.xxh3, head.plain
    if not 8 <= n <= min(f.size, safetensors_io.MAX_HEADER):
        raise IntegrityError(f"{f.path}: recorded header length {n} does not fit the file ({f.size} bytes)")
    reader.headers_checked.add(f.path)  # checked here, against the index when one is given
    head = reader.read_checked(f.path, 0, n, digest_check(head_digest, f"{f.path}: header"))
    structure, header, names, offsets, sizes = parse_header(f.path, head, n, f.size)
    if index is not None:
        check_header_chunks(index, f.path, structure, header, names, offsets, sizes)
    arrays: List[Any] = [None] * len(names)
    for i, off, nb, dg in plain:
        if not 0 <= i < len(names) or offsets[i] != off or sizes[i] != nb:
            raise IntegrityError(f"{f.path}: the manifest's record of array {i} does not match the file's header")
        arrays[i] = reader.read_checked(f.path, off, off + nb, digest_check(dg, f"{f.path}: {names[i]}"))
    for _path, node in walk_sharded(structure):
        node["DT"] = None  # the chunk's bytes are read through the shard index, not from here
    tables_f = [x for x in files if x.role == ROLE_TABLE]
    tables: List[Any] = []
    if tables_f:
        bufs, used, problems = read_files(tiers, tables_f)
        from ..formats import arrow_io

        tables = [arrow_io.read(b, path=x.path) for x, b in zip(tables_f, bufs)]
        reader.bytes += sum(x.size for x in tables_f)
        if used != tiers[0].name:
            reader.tier = used
        reader.problems.extend(problems)
    return structure, arrays, tables


def _plain_of(entry, name, reader, tiers, allow_pickle, index: Any = None) -> Any:
    structure, arrays, tables = read_head(entry, name, reader, tiers, allow_pickle, index)
    try:
        return unflatten(structure, arrays, tables, allow_pickle=allow_pickle, state_name=name,
                         on_sharded=lambda leaf: None)
    except TypeError as exc:  # an array index the record did not cover
        raise IntegrityError(f"state {name!r}: rank 0's part refers to an array the manifest did not record "
                             f"({exc})") from None


def load_full(tiers: Sequence[Tier], entry: StateEntry, name: str, allow_pickle: bool = False,
              verify: bool = True) -> Tuple[Any, RangeReader]:
    """The state with every DTensor leaf assembled into its full (plain, CPU) tensor; non-sharded
    leaves as rank 0 saved them. Returns (state, the reader: bytes read, tier used)."""
    from ..formats.shards import full_state

    index = index_of_entry(entry, name)
    reader = RangeReader(tiers, entry, name)
    reader.index = index
    with reader:  # its files are closed when done (the counters stay)
        structure, arrays, tables = read_head(entry, name, reader, tiers, allow_pickle, index)
        return full_state(structure, arrays, tables, index, reader, verify=verify, allow_pickle=allow_pickle,
                          state_name=name), reader


def full_tensors(tiers: Sequence[Tier], entry: StateEntry, name: str, verify: bool = True
                 ) -> Tuple[Dict[str, Any], RangeReader]:
    """key -> full tensor of every tensor leaf of a sharded state (what ``ray-ckpt export`` writes):
    DTensor leaves assembled one at a time, plain tensor leaves of rank 0."""
    from ..formats.shards import assemble_full, iter_tensor_leaves

    index = index_of_entry(entry, name)
    reader = RangeReader(tiers, entry, name)
    reader.index = index
    with reader:  # its files are closed when done (the counters stay)
        plain = _plain_of(entry, name, reader, tiers, False, index)
        out: Dict[str, Any] = {}
        for path, t in iter_tensor_leaves(plain):
            out[leaf_key(path)] = t
        for key, m in index.items():
            out[key] = assemble_full(m, reader, verify=verify)
    return out, reader


# ------------------------------------------------------------------------------------------ in place
def _torch():
    import torch

    return torch


def load_into_state(tiers: Sequence[Tier], entry: StateEntry, name: str, state: Any, *, strict: bool = True,
                    allow_pickle: bool = False, verify: bool = True) -> StateReport:
    """Fill ``state`` in place from a sharded state entry: each DTensor leaf gets its local shard
    (any mesh, any world size), a plain tensor leaf in the index the whole tensor, other tensor
    leaves (AdamW's ``step``) and scalars rank 0's values. Only the byte ranges the target's chunks
    overlap are read (plus rank 0's header and small non-sharded arrays), each piece verified.

    Every key, shape and dtype is checked before the first byte of the target changes: a mismatch
    is a RestoreError naming it; keys missing on either side are one too unless ``strict=False``
    (then skipped and named in the report's detail). A range with no good copy on any tier raises
    RestoreError after part of the target was filled (whole chunks are read straight into the
    target and verified there: that range may hold the bytes that failed; such a target is not to
    be used). The report of a successful call says which tier was read."""
    from ..formats.shards import load_into_tensor

    torch = _torch()
    index = index_of_entry(entry, name)
    reader = RangeReader(tiers, entry, name)
    reader.index = index
    try:
        plain = _plain_of(entry, name, reader, tiers, allow_pickle, index)
    except IntegrityError as exc:
        raise RestoreError(f"{about(f'state {name!r}', exc)}; nothing was loaded") from None
    targets = tensor_keys(state)
    saved_plain = {k: v for k, v in tensor_keys(plain).items()}
    jobs, missing, bad = [], [], []
    rank = global_rank()  # once for every target
    for key, t in targets.items():
        m = index.get(key)
        if m is not None:
            why = mismatch(key, t, m.global_shape, m.dtype)
            if why is None and t.__class__ is not torch.Tensor:
                try:
                    from ..formats.shards import target_chunk

                    target_chunk(t, rank)
                except ValueError as exc:
                    why = f"{key}: {exc}"
            bad.append(why) if why else jobs.append((t, m))
            continue
        match_tensor(key, t, saved_plain.get(key), jobs, missing, bad)
    refuse_mismatches(name, bad)
    unexpected = sorted(k for k in list(index) + list(saved_plain) if k not in targets)
    detail = check_keys(name, sorted(missing), unexpected, strict)
    try:
        for t, src in jobs:
            if isinstance(src, torch.Tensor):
                with torch.no_grad():
                    t.copy_(src)
            else:
                load_into_tensor(t, src, reader, verify=verify, rank=rank)
    except IntegrityError as exc:
        raise RestoreError(f"{about(f'state {name!r}', exc)}; the target is partly filled") from None
    reader.close()  # (on an error, when the reader is dropped)
    merge_scalars(state, plain)
    if reader.problems:
        detail = "; ".join([detail] * bool(detail) + reader.problems[:4])
    return StateReport("restored", reader.tier, verify, detail, reader.bytes)


def check_world_size(entry: StateEntry, name: str, of: str, world_size: Optional[int]) -> None:
    """A rank-local (not sharded) state saved by N ranks cannot be restored by M != N ranks (``of``:
    its version as messages name it, e.g. "step 7")."""
    saved = len(entry.files)
    if entry.shards is None and not entry.replicated and world_size is not None and world_size != saved:
        raise RestoreError(f"state {name!r} of {of} was saved by {saved} ranks; it cannot be "
                           f"restored with world size {world_size} (world size {saved} != {world_size}): its "
                           f"parts are rank-local plain tensors, not DTensors, so not resharding-capable; "
                           f"nothing was loaded")


def load_rank_local_into(tiers: Sequence[Tier], entry: StateEntry, name: str, state: Any, rank: int, *,
                         strict: bool = True, allow_pickle: bool = False) -> StateReport:
    """``load_into`` of a state that is not sharded: rank ``rank``'s part, read and verified whole,
    copied into the target's tensors (keys, shapes and dtypes checked first) and scalars."""
    torch = _torch()
    files = rank_files(entry, name, rank)
    try:
        bufs, tier, problems = read_files(tiers, files)
    except IntegrityError as exc:
        raise RestoreError(f"{about(f'state {name!r}', exc)}; nothing was loaded") from None
    src = decode_files(files, bufs, name=name, allow_pickle=allow_pickle)
    targets, saved = tensor_keys(state), tensor_keys(src)
    bad, jobs, missing = [], [], []
    for key, t in targets.items():
        match_tensor(key, t, saved.get(key), jobs, missing, bad)
    refuse_mismatches(name, bad)
    detail = check_keys(name, sorted(missing), sorted(k for k in saved if k not in targets), strict)
    with torch.no_grad():
        for t, s in jobs:
            t.copy_(s)
    merge_scalars(state, src)
    if problems:
        detail = "; ".join([detail] * bool(detail) + problems[:4])
    return StateReport("restored", tier, True, detail, sum(f.size for f in files))


__all__ = ["RangeReader", "read_head", "load_full", "full_tensors", "load_into_state", "check_world_size",
           "load_rank_local_into", "index_of_entry"]
