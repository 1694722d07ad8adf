"""Append-only states over many versions: the writer merges the youngest segments into the new one
(``formats/compaction.py``), so the segments a version lists stay bounded while every version still
restores bit-exactly. Plain: formats and a local tier, no Ray."""
import base64
import json
import math
import zlib

import numpy as np
import pytest

from ray_ckpt.errors import IntegrityError
from ray_ckpt.formats import buffer_io, compaction, segments
from ray_ckpt.formats.manifest import ROLE_INDEX, ROLE_SEGMENT, FileEntry, Manifest, StateEntry
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage import checkpoint_io
from ray_ckpt.storage.tier import Tier

NEVER = 1 << 40  # a fanout no run of segments reaches: the writer as it was before merging


class Fifo:
    """A buffer that gains ``k`` rows a version and keeps the newest ``capacity``, with a row
    evicted from its middle now and then (RLlib evicts whole episodes, not always the oldest)."""

    def __init__(self, capacity: int, k: int, seed: int = 0, holes: bool = True):
        self.capacity, self.k, self.rng, self.holes = capacity, k, np.random.default_rng(seed), holes
        self.ids = np.empty(0, np.int64)
        self.obs = np.empty((0, 3), np.float32)
        self.next_id = 0

    def step(self, k=None) -> None:
        k = self.k if k is None else k
        self.ids = np.concatenate([self.ids, np.arange(self.next_id, self.next_id + k, dtype=np.int64)])
        self.obs = np.concatenate([self.obs, self.rng.standard_normal((k, 3)).astype(np.float32)])
        self.next_id += k
        keep = np.arange(len(self.ids)) >= len(self.ids) - self.capacity
        if self.holes and len(self.ids) > 4 and self.rng.random() < 0.3:
            keep[self.rng.integers(len(self.ids) // 2, len(self.ids))] = False
        self.ids, self.obs = self.ids[keep], self.obs[keep]

    def state(self) -> dict:
        return {"row_id": self.ids.copy(), "obs": self.obs.copy(), "next_id": int(self.next_id)}


def _write(tier, v, buf, base, fanout=compaction.FANOUT):
    return checkpoint_io.write_append_only(tier, v, "replay", 0, flatten(buf.state(), state_name="replay"), base,
                                           fanout=fanout)


def _restored(tier, files) -> dict:
    bufs, _, _ = checkpoint_io.read_files([tier], files)
    return checkpoint_io.decode_files(files, bufs, name="replay", as_numpy=True)


def _index(tier, files) -> segments.SegmentIndex:
    f = next(f for f in files if f.role == ROLE_INDEX)
    return segments.SegmentIndex.from_json(tier.read_verified(f.path, f.size, f.checksum))


def _same(want: dict, got: dict) -> None:
    assert set(want) == set(got)
    for k, a in want.items():
        if isinstance(a, np.ndarray):
            assert got[k].dtype == a.dtype and got[k].shape == a.shape and np.array_equal(got[k], a), k
        else:
            assert got[k] == a and type(got[k]) is type(a), k


# ------------------------------------------------------------------------------ the policy alone
def test_merge_plan_is_a_binary_counter_over_levels():
    plan = compaction.merge_plan
    assert plan([], 4) == (0, 0)
    assert plan([0, 0], 4) == (0, 0)  # 2 level-0 + the new one: not yet 4
    assert plan([0, 0, 0], 4) == (3, 1)  # 3 + the new one: merged into a level-1 segment
    assert plan([1, 1, 1, 0, 0, 0], 4) == (6, 2)  # ... which completes 4 level-1s: one of level 2
    assert plan([2, 1, 1, 0, 0, 0], 4) == (3, 1)
    assert plan([0, 0, 0, 0, 0], 4) == (3, 1)  # a longer run (not written by this policy): the youngest 3
    # never merged: a whole buffer, or a segment of an index without levels
    assert plan([compaction.UNMERGED] * 5, 4) == (0, 0)
    assert plan([compaction.UNMERGED, 0, 0, 0], 4) == (3, 1)
    assert plan([0, 0, 0], compaction.FANOUT) == (0, 0)
    with pytest.raises(ValueError, match="at least 2"):
        plan([0], 1)


# ------------------------------------------------------------------------------ through the writer
@pytest.mark.parametrize("fanout,versions", [(4, 300), (compaction.FANOUT, 300)])
def test_many_versions_list_few_segments_and_each_restores_exactly(tmp_path, fanout, versions):
    tier, plain = Tier(str(tmp_path / "t"), "local"), Tier(str(tmp_path / "plain"), "local")
    buf = Fifo(capacity=600, k=10)  # rows live ~60 versions
    life = buf.capacity // buf.k
    base, plain_base, counts, plain_counts, merged_at = [], [], [], [], []
    for v in range(1, versions + 1):
        buf.step(0 if v % 37 == 0 else None)  # now and then a version adds no row
        files, _ = _write(tier, v, buf, base, fanout)
        plain_base, _ = _write(plain, v, buf, plain_base, NEVER)  # the same buffer, never merged
        plain_counts.append(sum(f.role == ROLE_SEGMENT for f in plain_base))
        _same(buf.state(), _restored(tier, files))
        index = _index(tier, files)
        levels = [s.level for s in index.segments]
        counts.append(len(levels))
        merged = [lv for lv in levels if lv != compaction.UNMERGED]
        assert levels == [compaction.UNMERGED] * (len(levels) - len(merged)) + merged
        assert merged == sorted(merged, reverse=True), levels  # levels never increase towards the young end
        assert all(merged.count(lv) <= fanout - 1 for lv in set(merged)), levels
        top = max(merged, default=0)
        assert top <= math.log(life, fanout) + 2, (v, levels)  # higher levels die before they fill
        assert len(levels) <= (fanout - 1) * (top + 1) + 1, (v, levels)
        new = [s for s in index.segments if s.path.startswith(f"v{v:012d}/")]
        if new and new[0].level > 0:
            merged_at.append(v)
        base = files
    assert len(merged_at) >= versions // fanout - 3  # merges happened (and each version above restored)
    bound = (fanout - 1) * (math.floor(math.log(life, fanout)) + 2) + 1
    assert max(counts) <= bound < life, (max(counts), bound)
    # without merging the same buffer lists a segment per version its rows live
    assert max(plain_counts) >= life - 2 > bound


def test_the_merged_segment_holds_only_live_rows(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Fifo(capacity=10_000, k=20, holes=False)
    base = []
    for v in range(1, 5):  # v1: the whole buffer (never merged); v2-v4: level 0
        buf.step()
        base, _ = _write(tier, v, buf, base, fanout=4)
    evicted = buf.ids[[25, 40, 41, 70]]  # rows of the level-0 segments of v2, v3 and v4 ...
    keep = ~np.isin(buf.ids, evicted)
    buf.ids, buf.obs = buf.ids[keep], buf.obs[keep]
    buf.step()
    files, written = _write(tier, 5, buf, base, fanout=4)  # ... which v5's segment absorbs
    index = _index(tier, files)
    assert [s.level for s in index.segments] == [compaction.UNMERGED, 1]
    seg = index.segments[-1]
    assert seg.path == "v000000000005/replay/rank0.segment.arrow" and seg.rows == 3 * 20 - 4 + 20
    f = next(f for f in files if f.path == seg.path)
    structure, views, _ = buffer_io.read(tier.read_verified(f.path, f.size, f.checksum), path=f.path)
    node = dict(buffer_io.columns_of(structure))["row_id"]
    stored = np.frombuffer(views[node["N"]], np.int64)
    assert np.array_equal(stored, buf.ids[buf.ids >= 20]) and not np.isin(evicted, stored).any()
    assert [p.path for p in files if p.role == ROLE_SEGMENT] == ["v000000000001/replay/rank0.segment.arrow", seg.path]
    assert written == sum(p.size for p in files if p.path.startswith("v000000000005/"))
    _same(buf.state(), _restored(tier, files))


def _as_format_2(tier: Tier, files):
    """The part's index rewritten as an index of format /2 (no levels), as the writer wrote it
    before merging, with its file entry to match."""
    f = next(f for f in files if f.role == ROLE_INDEX)
    body = json.loads(zlib.decompress(base64.b64decode(json.loads(bytes(tier.read_bytes(f.path)))["z"])))
    body["segments_d"] = [s[:4] for s in body["segments_d"]]
    data = json.dumps({"format": segments.INDEX_FORMAT_Z, "z": base64.b64encode(zlib.compress(
        json.dumps(body, separators=(",", ":")).encode(), 9)).decode()}, separators=(",", ":")).encode()
    with tier.open_atomic(f.path) as sink:
        sink.write(data)
    return [FileEntry(f.path, sink.size, sink.digest(), ROLE_INDEX) if g is f else g for g in files]


def test_a_format_2_part_is_read_and_continued(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Fifo(capacity=400, k=10)
    base, states = [], {}
    for v in range(1, 8):  # written without merging, then as format /2
        buf.step()
        base, _ = _write(tier, v, buf, base, fanout=NEVER)
        base = _as_format_2(tier, base)
        states[v] = buf.state()
        _same(states[v], _restored(tier, base))
    old = [s.path for s in _index(tier, base).segments]
    assert len(old) == 7 and all(s.level == compaction.UNMERGED for s in _index(tier, base).segments)
    for v in range(8, 8 + 2 * 4 * 3):
        buf.step()
        base, _ = _write(tier, v, buf, base, fanout=4)
        _same(buf.state(), _restored(tier, base))
        segs = _index(tier, base).segments
        assert [s.path for s in segs if s.level == compaction.UNMERGED] == old  # never rewritten
        assert len(segs) - len(old) <= 3 * 2
    assert max(s.level for s in segs) == 2  # the parts written since merged among themselves


def test_retention_deletes_a_merged_away_segment_once_no_kept_version_lists_it(tmp_path):
    """What the coordinator's retention does (``delete_version`` with the kept versions' paths):
    the files on disk are exactly those the kept versions list, merged-away segments gone."""
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Fifo(capacity=300, k=10)
    base, kept = [], []
    for v in range(1, 41):
        buf.step()
        base, _ = _write(tier, v, buf, base, fanout=4)
        m = Manifest("run", v, v, 0.0, states={"replay": StateEntry("best_effort", "stored", files={"0": base})})
        checkpoint_io.write_manifest(tier, m)
        kept.append(m)
        if len(kept) > 2:
            doomed = kept.pop(0)
            keep = {p for k in kept for p in k.referenced_paths()}
            checkpoint_io.delete_version(tier, doomed.version, keep, doomed.referenced_paths())
    listed = {p for k in kept for p in k.referenced_paths()}
    on_disk = {str(p.relative_to(tmp_path / "t")) for p in (tmp_path / "t").glob("v*/*/*")}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))
    assert len({p[:13] for p in listed}) < 12  # the 40 versions' rows in a few merged segments
    _same(buf.state(), _restored(tier, base))


def test_an_index_with_a_level_no_writer_gives_is_refused():
    idx = segments.SegmentIndex({"d": [["row_id", {"N": 0, "dt": "<i8", "sh": [2]}]]}, ((0, 2),), 2,
                                (segments.Segment("v000000000001/r/rank0.segment.arrow", 0, 1, 2, 0),))
    body = json.loads(zlib.decompress(base64.b64decode(json.loads(idx.to_json())["z"])))
    for seg, why in (([*body["segments_d"][0][:4], compaction.MAX_LEVEL + 1], "level"),
                     ([*body["segments_d"][0][:4], -2], "level"),
                     (body["segments_d"][0][:4], "a segment entry of 4 fields")):
        z = base64.b64encode(zlib.compress(json.dumps(dict(body, segments_d=[seg])).encode())).decode()
        with pytest.raises(IntegrityError, match=why):
            segments.SegmentIndex.from_json(json.dumps({"format": segments.INDEX_FORMAT_LEVELS, "z": z}).encode())
