"""Sharded (DTensor) states on the tiers: ranged, verified reads for ``load_into`` and ``load(rank=None)``.

No Ray here: the engine calls these in whatever process wants the state (a rank actor, a driver,
``ray-ckpt export``). The formats side (``formats.shards``) plans which byte ranges a target layout
needs and checks them against per-piece digests; this module supplies the bytes:

* :class:`RangeReader` reads a byte range of one of a state's files from the first tier whose copy
  passes the check (local first, then remote: like every other read), and counts what it read;
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

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .checkpoint_io import NoGoodCopy, decode_files, rank_files, read_files
from ..errors import IntegrityError, RestoreError, about, one_line
from ..formats import safetensors_io
from ..formats.manifest import ROLE_TABLE, ROLE_TENSORS, StateEntry
from ..formats.nodes import leaf_key
from ..formats.shard_record import HEADS_KEY, ShardHead
from ..formats.sharded_leaf import global_rank, walk_sharded
from ..formats.tree import unflatten
from .shard_header import check_header_chunks, digest_check, parse_header
from .target_match import check_keys, match_tensor, merge_scalars, mismatch, refuse_mismatches, tensor_keys
from .tier import Tier, farther
from ..types import StateReport


class RangeReader:
    """``read_range(file, begin, end)`` over the files of one state entry on ``tiers`` (in order).

    ``read_checked(file, begin, end, check)`` returns the first tier's bytes for which ``check``
    (raising IntegrityError) passes: a corrupt or missing local copy falls back to the remote tier.
    A file id that is not one of the entry's files is refused (the index comes from storage).
    ``bytes`` counts every byte read (failed attempts too); ``tier`` is "remote" once any range
    came from there; ``problems`` lists what was passed over."""

    def __init__(self, tiers: Sequence[Tier], entry: StateEntry, name: str):
        if not tiers:
            raise RestoreError("no storage tier to read from")
        self.tiers = list(tiers)
        self.name = name
        self.paths = {f.path for f in entry.all_files()}
        self.bytes = 0
        self.calls = 0
        self.tier = self.tiers[0].name
        self.problems: List[str] = []
        self.sizes = {f.path: f.size for f in entry.all_files()}
        heads = (entry.shards or {}).get(HEADS_KEY)
        self.heads = {f.path: h for r, h in (heads.items() if isinstance(heads, dict) else ())
                      for f in entry.files.get(r, ()) if f.role == ROLE_TENSORS}  # raw: parsed when used
        self.index: Any = None  # set: the header of every file a chunk is read from is checked first
        self.headers_checked: set = set()
        self._sources: Dict[Tuple[int, str], Any] = {}  # (tier, file) -> its RangeSource, opened once

    def close(self) -> None:
        """Close the files kept open for ranged reads (also done when the reader is dropped)."""
        sources, self._sources = self._sources, {}
        for src in sources.values():
            src.close()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _source(self, t: int, tier: Tier, file: str) -> Any:
        src = self._sources.get((t, file))
        if src is None:
            src = self._sources[(t, file)] = tier.open_ranges(file)
        return src

    def __call__(self, file: str, begin: int, end: int) -> Any:
        return self.read_checked(file, begin, end, None)

    def check_header(self, file: str) -> None:
        """Read ``file``'s safetensors header (verified against its "head" record when the manifest
        has one) and cross-check the chunks the index places in it (:func:`check_header_chunks`);
        a tier whose copy does not agree is passed over like a corrupt one."""
        self.headers_checked.add(file)
        size = self.sizes.get(file, 0)
        n = want = None  # no record (only rank 0's file has one): the length prefix is read
        if file in self.heads:
            try:
                head = ShardHead.from_json(self.heads[file])
            except (KeyError, TypeError, ValueError) as exc:
                raise IntegrityError(f"{file}: the manifest's shard head is malformed ({exc})") from None
            n, want = head.nbytes, head.xxh3
        if n is None:
            if size < 8:
                raise IntegrityError(f"{file}: {size} bytes: not a safetensors file")
            try:
                n = safetensors_io.header_length(bytes(self.read_checked(file, 0, 8, None)), size) + 8
            except ValueError as exc:
                raise IntegrityError(f"{file}: {exc}") from None
        if not 8 <= n <= min(size, safetensors_io.MAX_HEADER):
            raise IntegrityError(f"{file}: header length {n} does not fit the file ({size} bytes)")

        def check(head_bytes: Any) -> None:
            if want is not None:
                digest_check(want, f"{file}: header")(head_bytes)
            structure, header, names, offsets, sizes = parse_header(file, head_bytes, n, size)
            check_header_chunks(self.index, file, structure, header, names, offsets, sizes)

        self.read_checked(file, 0, n, check)

    def read_checked(self, file: str, begin: int, end: int, check: Optional[Callable[[Any], None]]) -> Any:
        def fetch(t: int, tier: Tier) -> Any:
            if hasattr(tier, "open_ranges"):
                buf = bytearray(end - begin)
                self._source(t, tier, file).read_into(begin, buf)
                return buf
            return tier.read_range(file, begin, end)

        return self._first_good(file, begin, end, check, fetch)

    def read_checked_into(self, file: str, begin: int, out: Any, check: Optional[Callable[[Any], None]]) -> None:
        """``read_checked`` of bytes ``[begin, begin + len(out))`` straight into the writable
        buffer ``out`` (the memory of the tensor they restore: no second copy); ``check(out)`` runs
        on it after each tier's read, and a tier whose bytes fail it is passed over like in
        ``read_checked`` (``out`` then holds the next tier's bytes, or unverified ones on failure)."""
        mv = memoryview(out).cast("B")

        def fetch(t: int, tier: Tier) -> Any:
            if hasattr(tier, "open_ranges"):
                self._source(t, tier, file).read_into(begin, mv)
            else:  # a tier that only hands out fresh buffers (a peer replica)
                data = memoryview(tier.read_range(file, begin, begin + len(mv))).cast("B")
                if len(data) != len(mv):
                    raise IntegrityError(f"{file}: read {len(data)} bytes at {begin}, expected {len(mv)}")
                mv[:] = data
            return mv

        self._first_good(file, begin, begin + len(mv), check, fetch)

    def _drop(self, t: int, file: str) -> None:
        src = self._sources.pop((t, file), None)
        if src is not None:
            src.close()

    def _first_good(self, file: str, begin: int, end: int, check: Optional[Callable[[Any], None]],
                    fetch: Callable[[int, Tier], Any]) -> Any:
        if file not in self.paths:
            raise IntegrityError(f"state {self.name!r}: the shard index names {file!r}, which is not one of the "
                                 f"state's files in the manifest: refused")
        if not 0 <= begin <= end <= self.sizes.get(file, 0):
            raise IntegrityError(f"{file}: bytes {begin}..{end} lie outside the file ({self.sizes.get(file)} "
                                 f"bytes in the manifest): refused")
        if self.index is not None and file not in self.headers_checked:
            self.check_header(file)
        errors = []
        for t, tier in enumerate(self.tiers):
            try:
                data = fetch(t, tier)
                self.bytes += len(data)
                self.calls += 1
                if check is not None:
                    check(data)
            except FileNotFoundError:
                errors.append(f"{tier.name}: {file} missing")
                continue
            except IntegrityError as exc:
                errors.append(f"{tier.name}: {one_line(exc)}")
                continue
            except OSError as exc:
                errors.append(f"{tier.name}: {tier.scrub(one_line(exc))}")
                self._drop(t, file)  # a failing descriptor is not reused
                continue
            if tier is not self.tiers[0]:
                self.tier = farther(self.tier, tier.name)
            self.problems.extend(errors)
            return data
        raise NoGoodCopy(f"no good copy of bytes {begin}..{end} of {file} ({'; '.join(errors)})")


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
