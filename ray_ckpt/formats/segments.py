"""Append-only buffers stored as segments: each version writes only the rows added since the
version before it, plus a small index; the rows that were already stored stay in the earlier
versions' segment files and are referred to, as a frozen reference model's file is.

Why: a replay buffer of N rows changes by k << N rows between two saves (k new transitions, some
old ones evicted). Writing it whole every save costs O(N) bytes of disk and upload per save; as
segments it costs O(k) plus an index of a few hundred bytes.

The contract a state registered with ``append_only=True`` keeps (checked where it can be):

* it is a buffer (:mod:`.buffer_io`): a dict of equally long numpy arrays, plain scalars beside
  them if it likes, with an integer column ``row_id`` (:data:`ROW_ID`) that is strictly increasing;
* a row, once saved, never changes: the row with a given ``row_id`` has the same values in every
  later version that still holds it (this is not checked: it is what makes reuse correct);
* new rows get ``row_id`` s above every earlier one; rows may disappear anywhere (eviction).

A version's part is then: the segment files of earlier versions that still hold live rows, a new
segment with the rows whose ``row_id`` is above the newest stored one (none if nothing was
added) and the live rows of the youngest earlier segments it absorbs (:mod:`.compaction`: the
segments a version lists stay few over a long run), and ``rank<r>.index.json``: the buffer's
structure (its scalars and column types, with the live row count), the live ``row_id`` s as
ranges, and the segments in order with their ``row_id`` bounds and merge levels (a JSON object
whose fields are compressed: :meth:`SegmentIndex.to_json`; a segment file's
own schema metadata holds only its columns, and it is an Arrow IPC stream: the schema once). Every file is in the manifest with its checksum; the reader reads and verifies them all,
concatenates the segments, keeps the live rows and checks that exactly the indexed rows came back.

This module knows nothing of storage or Ray: the writer and the reader (``checkpoint_io``) call it.
"""
from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from ..errors import IntegrityError
from .arrow_io import SEGMENT_FORMAT
from .buffer_io import FORMAT_KEY, STRUCTURE_KEY, columns_of
from .compaction import FANOUT, MAX_LEVEL, UNMERGED, merge_plan
from .flat import Flat, pieces_of
from .nodes import structure_to_json

INDEX_FORMAT = "ray_ckpt.append_only/1"   # the index's fields as plain JSON (read, no longer written)
INDEX_FORMAT_Z = "ray_ckpt.append_only/2"  # the same fields' JSON zlib-compressed, base64 under "z" (read)
INDEX_FORMAT_LEVELS = "ray_ckpt.append_only/3"  # /2 with each segment's merge level (.compaction)
MAX_INDEX_BYTES = 256 << 20  # an index that inflates beyond this is refused, not inflated
ROW_ID = "row_id"
MAX_RANGES = 1_000_000  # a live set in more pieces than this is not an append-only buffer's


@dataclass(frozen=True)
class Segment:
    """One segment file: rows with ``first <= row_id <= last`` (``rows`` of them) as written, and
    its merge level (:mod:`.compaction`; :data:`.compaction.UNMERGED` in an index of format /1 or /2)."""

    path: str
    first: int
    last: int
    rows: int
    level: int = UNMERGED


@dataclass(frozen=True)
class SegmentIndex:
    """What a version of an append-only state is made of (stored as ``rank<r>.index.json``)."""

    structure: Any                          # the whole buffer's structure JSON (tree.structure_to_json)
    live: Tuple[Tuple[int, int], ...]       # live row_ids as [lo, hi) ranges, increasing, disjoint
    rows: int                               # live rows: sum of the ranges' lengths
    segments: Tuple[Segment, ...]           # in row_id order

    @property
    def last_row_id(self) -> int:
        return self.segments[-1].last if self.segments else -1

    def to_json(self) -> bytes:
        """The index file's bytes: a JSON object whose fields are compressed. Why: a version writes
        an index beside its few new rows, and the segment list grows by one entry a version; as
        plain JSON the index of a long run outweighed the rows (paths and the structure repeat:
        they compress ~5x)."""
        # ranges and bounds as differences from the number before: small, repeating numbers compress
        flat = [x for r in self.live for x in r]
        live = [b - a for a, b in zip([0] + flat, flat)]
        segs, prev = [], 0
        for s in self.segments:
            segs.append([s.path, s.first - prev, s.last - s.first, s.rows, s.level])
            prev = s.last
        body = json.dumps({"structure": self.structure, "rows": self.rows, "live_d": live, "segments_d": segs},
                          separators=(",", ":")).encode()
        z = base64.b64encode(zlib.compress(body, 9)).decode("ascii")
        return json.dumps({"format": INDEX_FORMAT_LEVELS, "z": z}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: Any, *, where: str = "<index>") -> "SegmentIndex":
        """Parse and check an index: ranges increasing and disjoint, counts that add up, segments
        in order. Raises IntegrityError naming ``where``."""
        try:
            d = json.loads(bytes(data))
            fmt = d.get("format")
            if fmt in (INDEX_FORMAT_Z, INDEX_FORMAT_LEVELS):
                d = _undelta(json.loads(_inflate(base64.b64decode(d["z"], validate=True))), fmt == INDEX_FORMAT_LEVELS)
            elif fmt != INDEX_FORMAT:
                raise ValueError(f"format {fmt!r}, expected {INDEX_FORMAT_LEVELS!r}, {INDEX_FORMAT_Z!r} or "
                                 f"{INDEX_FORMAT!r}")
            live = tuple((int(lo), int(hi)) for lo, hi in d["live"])
            segs = tuple(Segment(str(s[0]), int(s[1]), int(s[2]), int(s[3]), *(int(x) for x in s[4:]))
                         for s in d["segments"])
            rows = int(d["rows"])
            if len(live) > MAX_RANGES:
                raise ValueError(f"{len(live)} live ranges")
            prev = None
            for lo, hi in live:
                if lo >= hi or (prev is not None and lo <= prev):
                    raise ValueError(f"live range [{lo}, {hi}) is empty or not after the one before")
                prev = hi
            if sum(hi - lo for lo, hi in live) != rows:
                raise ValueError(f"the live ranges hold {sum(hi - lo for lo, hi in live)} rows, the index says {rows}")
            prev = None
            for s in segs:
                if s.first > s.last or s.rows < 1 or s.rows > s.last - s.first + 1 or (prev is not None and s.first <= prev):
                    raise ValueError(f"segment {s.path}: row_ids {s.first}..{s.last} ({s.rows} rows) are not "
                                     f"after the segment before or do not fit")
                if not UNMERGED <= s.level <= MAX_LEVEL:
                    raise ValueError(f"segment {s.path}: level {s.level} is not one a writer gives")
                prev = s.last
            if len({s.path for s in segs}) != len(segs):
                raise ValueError("a segment is listed twice")
            if columns_of(d["structure"]) is None:
                raise ValueError("its structure is not a buffer's")
            return cls(d["structure"], live, rows, segs)
        except IntegrityError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, zlib.error) as exc:
            raise IntegrityError(f"{where}: not an append-only index ({exc})") from None


def _undelta(d: Dict[str, Any], levels: bool) -> Dict[str, Any]:
    """Format /2's or /3's delta-coded fields back to /1's (``live``, ``segments``; /3's segments
    keep their level as a fifth field)."""
    acc = [int(x) for x in d.pop("live_d")]
    if len(acc) % 2:
        raise ValueError("an odd number of live range bounds")
    for i in range(1, len(acc)):
        acc[i] += acc[i - 1]
    d["live"] = [acc[i:i + 2] for i in range(0, len(acc), 2)]
    segs, prev = [], 0
    for seg in d.pop("segments_d"):
        if len(seg) != 4 + levels:
            raise ValueError(f"a segment entry of {len(seg)} fields")
        path, first, span, rows = seg[:4]
        first = prev + int(first)
        prev = first + int(span)
        segs.append([path, first, prev, rows] + list(seg[4:]))
    d["segments"] = segs
    return d


def _inflate(data: bytes) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(data, MAX_INDEX_BYTES)
    if d.unconsumed_tail or not d.eof:
        raise ValueError("its compressed fields are truncated or inflate beyond "
                         f"{MAX_INDEX_BYTES >> 20} MiB")
    return out


# ---------------------------------------------------------------------------- writing
def row_ids(flat: Flat, name: str) -> np.ndarray:
    """The ``row_id`` column of an append-only state's snapshot, checked (ValueError says why not)."""
    cols = columns_of(flat.structure)
    if cols is None or flat.tables:
        raise ValueError(f"append-only state {name!r} must be a buffer: a dict of equally long numpy arrays "
                         f"(plain scalars beside them allowed) with an integer {ROW_ID!r} column")
    node = dict(cols).get(ROW_ID)
    if node is None:
        raise ValueError(f"append-only state {name!r} has no {ROW_ID!r} column (columns: "
                         f"{sorted(k for k, _ in cols)}): each row needs a strictly increasing id")
    dt = np.dtype(node["dt"])
    if dt.kind not in "iu" or len(node["sh"]) != 1:
        raise ValueError(f"append-only state {name!r}: {ROW_ID!r} must be a 1-d integer column, "
                         f"got {dt} of shape {node['sh']}")
    parts = pieces_of(flat.arrays[node["N"]])
    raw = parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else np.empty(0, np.uint8))
    ids = np.asarray(raw).view(dt).astype(np.int64, copy=False)
    if ids.size and (ids[0] < 0 or np.any(np.diff(ids) <= 0)):
        raise ValueError(f"append-only state {name!r}: {ROW_ID!r} must be non-negative and strictly increasing")
    return ids


def live_ranges(ids: np.ndarray) -> Tuple[Tuple[int, int], ...]:
    """Strictly increasing ids as [lo, hi) ranges of consecutive ids."""
    if ids.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return tuple((int(ids[s]), int(ids[e - 1]) + 1) for s, e in zip(starts, ends))


def plan(ids: np.ndarray, base: Optional[SegmentIndex], name: str,
         fanout: int = FANOUT) -> Tuple[List[Segment], int, int]:
    """(segments of ``base`` to keep, first position in ``ids`` of the rows to write anew, the
    level of the segment they make).

    Kept: the base's segments that still hold a live row, less the youngest ones the new segment
    absorbs (:func:`.compaction.merge_plan`): it then starts at their first live row, so it holds
    their live rows and the new ones, the rows evicted from them left out. New: the rows above the
    base's newest ``row_id``. Without a base the whole buffer is one segment, never merged later.
    A row at or below the base's newest ``row_id`` that was not live in the base was never stored
    (the contract broken: an old id given to a new row): ValueError."""
    if base is None or not base.segments:
        return [], 0, UNMERGED
    start = int(np.searchsorted(ids, base.last_row_id, side="right"))
    old = ids[:start]
    stray = int(start - np.count_nonzero(_in_ranges(old, base.live)))
    if stray:
        raise ValueError(f"append-only state {name!r}: {stray} row(s) with {ROW_ID} at or below "
                         f"{base.last_row_id} (the newest stored) lie in no stored segment: rows must not be "
                         f"given old ids")
    kept = [s for s in base.segments
            if np.searchsorted(old, s.last, side="right") > np.searchsorted(old, s.first, side="left")]
    if start == len(ids):  # no new rows: no segment to merge into
        return kept, start, 0
    absorbed, level = merge_plan([s.level for s in kept], fanout)
    if absorbed:
        kept, merged = kept[:-absorbed], kept[-absorbed:]
        start = int(np.searchsorted(ids, merged[0].first, side="left"))
    return kept, start, level


def segment_table(table: pa.Table, start: int) -> pa.Table:
    """Rows ``start:`` of a buffer's table as a buffer file of their own (zero-copy slice). Its schema
    metadata is the least ``buffer_io.read`` needs: the format and the columns' structure with the
    segment's row count, as compact JSON. The buffer's scalars and leaf names are left to the index,
    which holds them once (a version's segment may hold only a few rows: per-file metadata was a
    large part of its bytes). Its format, :data:`.arrow_io.SEGMENT_FORMAT`, has it written as an
    Arrow IPC stream (the schema once, no footer)."""
    seg = table.slice(start)
    meta = dict(table.schema.metadata or {})
    structure = _with_rows(json.loads(meta[STRUCTURE_KEY]), seg.num_rows)
    structure["d"] = [[k, node] for k, node in structure["d"] if isinstance(node, dict) and "N" in node]
    own = {FORMAT_KEY: SEGMENT_FORMAT, STRUCTURE_KEY: json.dumps(structure, separators=(",", ":")).encode()}
    return seg.replace_schema_metadata(own)


def _with_rows(structure: Dict[str, Any], rows: int) -> Dict[str, Any]:
    out = dict(structure)
    out["d"] = [[k, ({**node, "sh": [rows] + list(node["sh"][1:])} if isinstance(node, dict) and "N" in node
                     else node)] for k, node in structure["d"]]
    return out


def index_of(flat: Flat, ids: np.ndarray, segments: Sequence[Segment]) -> SegmentIndex:
    structure = json.loads(structure_to_json(flat.structure))
    live = live_ranges(ids)
    return SegmentIndex(structure, live, int(ids.size), tuple(segments))


# ---------------------------------------------------------------------------- reading
def assemble(index: SegmentIndex, parts: Sequence[Tuple[Segment, Any, List[Any]]], *,
             where: str) -> Tuple[Any, List[Any]]:
    """(structure, per-leaf bytes) of the whole buffer from its segments, each given as
    (segment, its structure, its per-leaf bytes from ``buffer_io.read``), in the index's order.

    Keeps the live rows and checks that exactly ``index.rows`` rows with the indexed ``row_id`` s
    came back; a segment whose columns differ from the index's is refused (IntegrityError)."""
    cols = columns_of(index.structure)
    pieces: Dict[str, List[np.ndarray]] = {k: [] for k, _ in cols}
    for seg, structure, views in parts:
        seg_cols = columns_of(structure)
        if seg_cols is None or [k for k, _ in seg_cols] != [k for k, _ in cols]:
            raise IntegrityError(f"{where}: segment {seg.path} does not have the index's columns")
        for (key, want), (_, node) in zip(cols, seg_cols):
            if node["dt"] != want["dt"] or list(node["sh"][1:]) != list(want["sh"][1:]):
                raise IntegrityError(f"{where}: segment {seg.path} column {key!r} is {node['dt']} {node['sh']}, "
                                     f"the index says {want['dt']} {want['sh']}")
            arr = np.frombuffer(views[node["N"]], dtype=np.dtype(node["dt"])).reshape(node["sh"])
            pieces[key].append(arr)
        if len(pieces[ROW_ID][-1]) != seg.rows:
            raise IntegrityError(f"{where}: segment {seg.path} holds {len(pieces[ROW_ID][-1])} rows, "
                                 f"the index says {seg.rows}")
    ids = (np.concatenate(pieces[ROW_ID]) if pieces[ROW_ID] else np.empty(0, np.int64)).astype(np.int64)
    keep = _in_ranges(ids, index.live)
    kept_ids = ids[keep]
    if kept_ids.size != index.rows or (kept_ids.size and np.any(np.diff(kept_ids) <= 0)):
        raise IntegrityError(f"{where}: the segments hold {kept_ids.size} of the {index.rows} live rows the index "
                             f"lists (or out of order)")
    everything = bool(keep.all())  # nothing evicted since the segments were written: no second copy
    views: List[Any] = [None] * len(cols)
    for key, node in cols:
        data = np.concatenate(pieces[key]) if pieces[key] else np.empty([0] + list(node["sh"][1:]),
                                                                          np.dtype(node["dt"]))
        out = data if everything else data[keep]  # both are new contiguous arrays
        if list(out.shape) != list(node["sh"]):
            raise IntegrityError(f"{where}: column {key!r} came back as {list(out.shape)}, the index says {node['sh']}")
        views[node["N"]] = memoryview(out.reshape(-1).view(np.uint8)).cast("B") if out.size else bytearray(0)
    return index.structure, views


def _in_ranges(ids: np.ndarray, live: Sequence[Tuple[int, int]]) -> np.ndarray:
    if not live or ids.size == 0:
        return np.zeros(ids.size, bool)
    los = np.fromiter((lo for lo, _ in live), np.int64, len(live))
    his = np.fromiter((hi for _, hi in live), np.int64, len(live))
    i = np.searchsorted(los, ids, side="right") - 1
    ok = i >= 0
    ok[ok] = ids[ok] < his[i[ok]]
    return ok
