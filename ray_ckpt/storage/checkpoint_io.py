"""A flattened state <-> its files on a tier, and manifests <-> tiers.

The one place where formats meet storage; plain Python (no Ray), used by writer actors, restoring
actors, the coordinator and the ``ray-ckpt`` command line alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import xxhash

from ..errors import CheckpointError, IntegrityError, RestoreError, SaveError, one_line
from ..formats import arrow_io, buffer_io, safetensors_io, segments
from ..formats.checksum import BLOCK, HashingSink
from ..formats.manifest import (ROLE_BUFFER, ROLE_INDEX, ROLE_SEGMENT, ROLE_TABLE, ROLE_TENSORS, FileEntry, Manifest,
                                StateEntry)
from ..formats.flat import Flat
from ..formats.shard_record import PlainArray, ShardHead, ShardRecord, part_record
from ..formats.tree import unflatten
from . import layout
from .durable_batch import DurableBatch
from .tier import Tier, farther


def content_hash(flat: Flat) -> str:
    """Digest of exactly the bytes ``write_flat`` would write (serialisation is deterministic)."""
    sink = HashingSink()
    table = buffer_io.as_table(flat)
    if table is not None:
        arrow_io.write(table, sink)
        return sink.digest()
    safetensors_io.write(flat, sink)
    for t in flat.tables:
        arrow_io.write(t, sink)
    return sink.digest()


PARALLEL_FROM = 2 * BLOCK  # files from this size are written by blocks (threads, O_DIRECT)


def write_flat(tier: Tier, version: int, name: str, rank: int, flat: Flat,
               compression: Optional[str] = None, threads: int = 1, direct: bool = False,
               batch: Optional[DurableBatch] = None) -> List[FileEntry]:
    """Write one (state, rank) part: a buffer as one Arrow IPC file; anything else as a safetensors
    file, plus one Arrow IPC file per table in it.

    A large tensors file, or a large uncompressed table, on a local tier is written block by block
    by ``threads`` threads, with O_DIRECT when ``direct`` (see ``Tier.write_blocks``).

    With ``batch``, the other files are written under temporary names and become durable and
    visible only at ``batch.commit()`` (many small parts: one grouped sync, see ``DurableBatch``);
    the entries returned describe them as they will be once committed."""
    entries: List[FileEntry] = []
    atomic = tier.open_atomic if batch is None else (lambda rel: batch.open_atomic(tier, rel))
    buffer = buffer_io.as_table(flat)
    rel = layout.tensors_file(version, name, rank) if buffer is None else layout.buffer_file(version, name, rank)
    try:
        if buffer is not None:
            return [FileEntry(rel, *_write_table(tier, rel, buffer, compression, threads, direct, atomic), ROLE_BUFFER)]
        if (threads > 1 or direct) and tier.is_local and flat.nbytes >= PARALLEL_FROM:
            size, digest = tier.write_blocks(rel, safetensors_io.file_views(flat), threads, direct)
        else:
            with atomic(rel) as sink:
                safetensors_io.write(flat, sink)
            size, digest = sink.size, sink.digest()
        entries.append(FileEntry(rel, size, digest, ROLE_TENSORS))
        for i, table in enumerate(flat.tables):
            rel = layout.table_file(version, name, rank, i)
            entries.append(FileEntry(rel, *_write_table(tier, rel, table, compression, threads, direct, atomic),
                                     ROLE_TABLE))
    except (OSError, IntegrityError) as exc:  # IntegrityError: a link where a directory should be
        raise SaveError(f"writing state {name!r} rank {rank} of step {version} to "
                        f"{tier.describe(rel)} failed: {one_line(exc)}") from None
    return entries


def write_append_only(tier: Tier, version: int, name: str, rank: int, flat: Flat, base: Sequence[FileEntry],
                      compression: Optional[str] = None, threads: int = 1, direct: bool = False,
                      fanout: int = segments.FANOUT) -> Tuple[List[FileEntry], int]:
    """Write one part of an append-only state (:mod:`.formats.segments`): the rows added since
    ``base`` (the files of the newest committed version's part, or none) as a new segment, and the
    index. Returns (the part's files: the base's segments still holding live rows, the new
    segment, the index; bytes written now). The new segment may absorb the youngest of the base's
    segments (their live rows written again, :mod:`.formats.compaction`), so that the segments a
    version lists stay few over a long run; the absorbed ones are no longer listed. ``fanout``
    is the policy's base (a benchmark's "no merging" arm gives one no run of segments reaches).

    A base index this tier cannot read back intact (another node's disk, a damaged file) is no
    base: the whole buffer becomes this version's segment (more bytes, never a wrong row)."""
    try:
        ids = segments.row_ids(flat, name)
    except ValueError as exc:
        raise SaveError(str(exc)) from None
    table = buffer_io.as_table(flat)
    by_path = {f.path: f for f in base}
    base_index = _base_index(tier, base)
    try:
        kept, start, level = segments.plan(ids, base_index, name, fanout)
    except ValueError as exc:
        raise SaveError(str(exc)) from None
    entries = [by_path[s.path] for s in kept]
    segs, written = list(kept), 0
    rel = layout.segment_file(version, name, rank)
    try:
        if start < len(ids):
            size, digest = _write_table(tier, rel, segments.segment_table(table, start), compression, threads, direct)
            entries.append(FileEntry(rel, size, digest, ROLE_SEGMENT))
            segs.append(segments.Segment(rel, int(ids[start]), int(ids[-1]), len(ids) - start, level))
            written += size
        rel = layout.segment_index_file(version, name, rank)
        with tier.open_atomic(rel) as sink:
            sink.write(segments.index_of(flat, ids, segs).to_json())
        entries.append(FileEntry(rel, sink.size, sink.digest(), ROLE_INDEX))
        written += sink.size
    except (OSError, IntegrityError) as exc:
        raise SaveError(f"writing state {name!r} rank {rank} of step {version} to "
                        f"{tier.describe(rel)} failed: {one_line(exc)}") from None
    return entries, written


def _base_index(tier: Tier, base: Sequence[FileEntry]) -> Optional[segments.SegmentIndex]:
    """The base part's index if this tier holds it and every segment it lists, intact; else None."""
    idx = [f for f in base if f.role == ROLE_INDEX]
    if len(idx) != 1:
        return None
    try:
        index = segments.SegmentIndex.from_json(tier.read_verified(idx[0].path, idx[0].size, idx[0].checksum),
                                                where=tier.describe(idx[0].path))
        paths = {f.path for f in base if f.role == ROLE_SEGMENT}
        if {s.path for s in index.segments} != paths or not all(tier.exists(p) for p in paths):
            return None
        return index
    except (OSError, IntegrityError):
        return None


def shard_record(flat: Flat, rel: str, piece_size: Optional[int] = None) -> Optional[ShardRecord]:
    """The shard record of a part written as the safetensors file ``rel`` (``write_flat``), or None
    when the part has no DTensor leaf.

    It is ``formats.shard_record.part_record`` (every stored DTensor chunk: its box in the global
    tensor, its byte offset in ``rel``, xxh3-128 digests per piece) with the file's
    :class:`ShardHead`: the header's length and digest and, for every other array of the part
    (non-sharded tensors such as AdamW's ``step``), its offset, size and digest. With these a reader
    of another layout reads only the header and the byte ranges it needs, each verified, never the
    whole file. The offsets come from the same header ``write_flat`` writes (serialisation is
    deterministic): nothing is read back."""
    from ..formats.flat import pieces_of
    from ..formats.sharded_leaf import walk_sharded

    sharded = {node["DT"] for _, node in walk_sharded(flat.structure)}
    if not sharded:
        return None
    head, _order = safetensors_io.file_header(flat)
    data_len = sum(a.nbytes for a in flat.arrays)
    offsets = safetensors_io.parse_header(head, len(head) + data_len, path=rel).offsets
    kw = {} if piece_size is None else {"piece_size": piece_size}
    rec = part_record(flat, rel, offsets, **kw)
    plain = []
    for i, arr in enumerate(flat.arrays):
        if i in sharded:
            continue
        h = xxhash.xxh3_128()
        for p in pieces_of(arr):
            h.update(memoryview(p).cast("B"))
        plain.append(PlainArray(i, int(offsets[i]), int(arr.nbytes), h.hexdigest()))
    return dataclasses.replace(rec, head=ShardHead(len(head), xxhash.xxh3_128_hexdigest(head), tuple(plain)))


def _write_table(tier: Tier, rel: str, table: Any, compression: Optional[str], threads: int,
                 direct: bool, atomic: Any = None) -> Tuple[int, str]:
    blocks = (threads > 1 or direct) and tier.is_local and table.nbytes >= PARALLEL_FROM
    if blocks and compression is None:  # compressed files are made while streaming
        return tier.write_blocks(rel, arrow_io.file_views(table), threads, direct)
    with (atomic or tier.open_atomic)(rel) as sink:
        arrow_io.write(table, sink, compression)
    return sink.size, sink.digest()


class NoGoodCopy(IntegrityError):
    """No tier this process reads holds a copy of a file (or of a byte range) that verifies: the
    restore asks the coordinator to check every copy it can reach (``coordinator/recheck.py``)."""


def read_files(tiers: Sequence[Tier], files: List[FileEntry]) -> Tuple[List[bytearray], str, List[str]]:
    """Read and verify every file, each from the first tier that holds a good copy.

    Returns (buffers, tier name used — "remote" if any file came from there, problems seen on the
    way). Raises IntegrityError when no tier has a good copy of some file.
    """
    bufs, used, problems = [], "local", []
    for f in files:
        errors = []
        for tier in tiers:
            try:
                bufs.append(tier.read_verified(f.path, f.size, f.checksum))
                if tier is not tiers[0]:
                    used = farther(used, tier.name)
                break
            except FileNotFoundError:
                errors.append(f"{tier.name}: missing")
            except IntegrityError as exc:
                errors.append(f"{tier.name}: {exc}")
            except OSError as exc:
                errors.append(f"{tier.name}: {one_line(exc)}")
        else:
            raise NoGoodCopy(f"no good copy of {f.path} ({'; '.join(errors)})")
        problems.extend(errors)
    if not files:
        used = tiers[0].name
    return bufs, used, problems


def decode_files(files: List[FileEntry], bufs: List[bytearray], *, name: str,
                 allow_pickle: bool = False, as_numpy: bool = False):
    if any(f.role == ROLE_INDEX for f in files):
        return _decode_append_only(files, bufs, name=name, as_numpy=as_numpy, allow_pickle=allow_pickle)
    if len(files) == 1 and files[0].role == ROLE_BUFFER:
        structure, views, tables = buffer_io.read(bufs[0], path=files[0].path)
        return _unflatten(files[0].path, structure, views, tables, as_numpy=as_numpy, allow_pickle=allow_pickle,
                          state_name=name)
    tensors_buf = [b for f, b in zip(files, bufs) if f.role == ROLE_TENSORS]
    if len(tensors_buf) != 1:
        raise IntegrityError(f"state {name!r}: expected one tensors file, manifest lists {len(tensors_buf)}")
    structure, views = safetensors_io.read(tensors_buf[0], path=next(f.path for f in files if f.role == ROLE_TENSORS))
    tables = [arrow_io.read(b, path=f.path) for f, b in zip(files, bufs) if f.role == ROLE_TABLE]
    return _unflatten(next(f.path for f in files if f.role == ROLE_TENSORS), structure, views, tables,
                      as_numpy=as_numpy, allow_pickle=allow_pickle, state_name=name)


def _decode_append_only(files: List[FileEntry], bufs: List[bytearray], *, name: str, **kw: Any) -> Any:
    """An append-only state from its verified files: the index, then its segments in order."""
    idx = [(f, b) for f, b in zip(files, bufs) if f.role == ROLE_INDEX]
    if len(idx) != 1:
        raise IntegrityError(f"state {name!r}: expected one index file, manifest lists {len(idx)}")
    where = idx[0][0].path
    index = segments.SegmentIndex.from_json(idx[0][1], where=where)
    by_path = {f.path: b for f, b in zip(files, bufs) if f.role == ROLE_SEGMENT}
    if set(by_path) != {s.path for s in index.segments} or len(files) != len(by_path) + 1:
        raise IntegrityError(f"{where}: its segments {[s.path for s in index.segments]} are not the files the "
                             f"manifest lists for state {name!r}")
    parts = []
    for seg in index.segments:
        structure, views, _ = buffer_io.read(by_path[seg.path], path=seg.path)
        parts.append((seg, structure, views))
    structure, views = segments.assemble(index, parts, where=where)
    return _unflatten(where, structure, views, [], state_name=name, **kw)


def _unflatten(path: str, structure: Any, *args: Any, **kw: Any) -> Any:
    """A verified file whose structure does not fit its arrays (a crafted header with a recomputed
    checksum, or a writer bug) is an IntegrityError naming the file, never a raw numpy/torch error."""
    try:
        return unflatten(structure, *args, **kw)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as exc:
        raise IntegrityError(f"{path}: its structure does not match its data ({type(exc).__name__}: "
                             f"{one_line(exc)[:200]})") from None


def rank_files(entry: StateEntry, name: str, rank: int) -> List[FileEntry]:
    key = "0" if entry.replicated else str(rank)
    if key not in entry.files:
        raise RestoreError(f"state {name!r} has no part for rank {rank} (ranks: {sorted(entry.files, key=int)})")
    return entry.files[key]


# ------------------------------------------------------------------------- manifests
def write_manifest(tier: Tier, manifest: Manifest) -> None:
    tier.put_bytes(layout.manifest_path(manifest.version), manifest.to_json())


def read_manifest(tier: Tier, version: int, key: Optional[bytes] = None) -> Manifest:
    """The manifest of ``version``, checked: well-formed, its paths inside the run root, its
    ``version`` that of the directory it lies in (a manifest copied into another version's
    directory is refused), and with ``key`` its signature. Raises IntegrityError (naming the file)
    or FileNotFoundError / OSError from the tier."""
    rel = layout.manifest_path(version)
    where = tier.describe(rel)
    m = Manifest.from_json(bytes(tier.read_bytes(rel)), where=where, key=key)
    if m.version != version:
        raise IntegrityError(f"{where}: the manifest says version {m.version}, but it lies in "
                             f"{layout.version_dir(version)}/ (copied from another version?): refused")
    return m


def scan(tier: Tier, key: Optional[bytes] = None) -> Tuple[Dict[int, Manifest], List[int], List[str]]:
    """(committed manifests by version, versions without manifest, problems).

    A version whose manifest is unreadable, mis-signed (with ``key``) or names another version is
    in the problems, not among the committed versions, and not among those without manifest
    either: nothing removes it. So are version-named entries that are not directories (a link
    to elsewhere, a file): not this run's, never listed or emptied."""
    committed, partial, bad = {}, [], []
    for v, what in sorted(tier.odd_entries().items()):
        bad.append(f"version {v}: {tier.describe(layout.version_dir(v))} is {what}, not a version directory "
                   f"(left alone)")
    for v, has_manifest in sorted(tier.version_dirs().items()):
        if not has_manifest:
            partial.append(v)
            continue
        try:
            committed[v] = read_manifest(tier, v, key)
        except (IntegrityError, OSError) as exc:
            bad.append(f"version {v}: {one_line(exc)}")
    return committed, partial, bad


def delete_version(tier: Tier, version: int, keep_paths: set, referenced: Sequence[str] = ()) -> List[str]:
    """Delete a version: its manifest first (it disappears at once), then its files and the files
    of older versions it referred to (``referenced``) that no kept version refers to, then empty
    directories. Returns the deleted file paths.

    Locally a link is deleted itself, never its target, and nothing is deleted through a linked
    directory (a version directory that is a link: nothing at all)."""
    tier.delete_file(layout.manifest_path(version))
    deleted = []
    for rel in sorted(set(tier.list_files(layout.version_dir(version))) | set(referenced)):
        if rel not in keep_paths and tier.delete_file(rel):
            deleted.append(rel)
    for top in {layout.version_dir(version)} | {rel.split("/", 1)[0] for rel in deleted}:
        tier.prune_empty_dirs(top)
    return deleted


def stray_files(tier: Tier, version: int, manifest: Manifest) -> List[str]:
    """Entries of the committed version directory of ``version`` that its manifest does not name
    (leftover ``*.tmp-*`` files of an interrupted write, anything put there by hand, links), as
    paths relative to the run root, sorted. The manifest itself is not a stray."""
    named = set(manifest.referenced_paths()) | {layout.manifest_path(version)}
    return sorted(rel for rel in tier.list_files(layout.version_dir(version)) if rel not in named)
