"""Append-only buffers (``register(name, provider, append_only=True)``): each version writes only the
rows added since the newest committed version, plus an index, and restores bit-exactly from the
segments of several versions.

The first tests are plain (formats + a local tier, no Ray); the last ones run the real engine."""
import base64
import dataclasses
import json
import os
import time
import zlib

import numpy as np
import pytest

import ray_ckpt as rc
from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_append_only
from ray_ckpt.errors import IntegrityError, SaveError
from ray_ckpt.formats import compaction, segments
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.tier import Tier

OBS = (64,)
ROW_BYTES = 8 + 64 * 4 + 8 + 4 + 1  # row_id, obs, action, reward, done


class Buffer:
    """A ring buffer with eviction from the front and a hole punched now and then (RLlib evicts
    whole episodes, which need not be the oldest rows): what an append-only state looks like."""

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.rng = np.random.default_rng(seed)
        self.ids = np.empty(0, np.int64)
        self.obs = np.empty((0,) + OBS, np.float32)
        self.action = np.empty(0, np.int64)
        self.reward = np.empty(0, np.float32)
        self.done = np.empty(0, bool)
        self.next_id = 0

    def add(self, k: int) -> None:
        ids = np.arange(self.next_id, self.next_id + k, dtype=np.int64)
        self.next_id += k
        self.ids = np.concatenate([self.ids, ids])
        self.obs = np.concatenate([self.obs, self.rng.standard_normal((k,) + OBS).astype(np.float32)])
        self.action = np.concatenate([self.action, self.rng.integers(0, 4, k)])
        self.reward = np.concatenate([self.reward, self.rng.random(k).astype(np.float32)])
        self.done = np.concatenate([self.done, self.rng.random(k) < 0.1])
        keep = np.ones(len(self.ids), bool)
        keep[: max(0, len(self.ids) - self.capacity)] = False
        if len(self.ids) > 10:  # a hole in the middle: rows may be evicted anywhere
            keep[len(self.ids) // 2] = False
        self._take(keep)

    def _take(self, keep) -> None:
        self.ids, self.obs, self.action = self.ids[keep], self.obs[keep], self.action[keep]
        self.reward, self.done = self.reward[keep], self.done[keep]

    def state(self) -> dict:
        return {"row_id": self.ids, "obs": self.obs, "action": self.action, "reward": self.reward,
                "done": self.done, "next_id": int(self.next_id), "note": "replay"}

    def load(self, state: dict) -> None:
        self.ids, self.obs, self.action = state["row_id"], state["obs"], state["action"]
        self.reward, self.done, self.next_id = state["reward"], state["done"], state["next_id"]


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert b[k].dtype == a[k].dtype and b[k].shape == a[k].shape, k
            assert np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k] and type(a[k]) is type(b[k]), k


# ------------------------------------------------------------------------------ plain
def test_live_ranges_and_index_roundtrip():
    ids = np.array([3, 4, 5, 9, 10, 20], np.int64)
    assert segments.live_ranges(ids) == ((3, 6), (9, 11), (20, 21))
    assert segments.live_ranges(np.empty(0, np.int64)) == ()
    idx = segments.SegmentIndex({"d": [["row_id", {"N": 0, "dt": "<i8", "sh": [6]}]]}, ((3, 6), (9, 11), (20, 21)), 6,
                                (segments.Segment("v000000000001/r/rank0.segment.arrow", 3, 20, 6, 2),))
    assert segments.SegmentIndex.from_json(idx.to_json()) == idx
    stored = json.loads(idx.to_json())  # a JSON object whose fields are compressed
    assert stored["format"] == segments.INDEX_FORMAT_LEVELS
    body = json.loads(zlib.decompress(base64.b64decode(stored["z"])))
    assert body["rows"] == 6 and body["live_d"] == [3, 3, 3, 2, 9, 1]  # bounds as differences
    assert body["segments_d"] == [["v000000000001/r/rank0.segment.arrow", 3, 17, 6, 2]]  # its merge level last
    # the indexes of versions written before are read as they were: plain JSON (format /1), and
    # compressed without levels (/2); their segments have the level that is never merged
    old = dataclasses.replace(idx, segments=(dataclasses.replace(idx.segments[0], level=compaction.UNMERGED),))
    plain = {"format": segments.INDEX_FORMAT, "structure": body["structure"], "rows": 6,
             "live": [[3, 6], [9, 11], [20, 21]], "segments": [["v000000000001/r/rank0.segment.arrow", 3, 20, 6]]}
    assert segments.SegmentIndex.from_json(json.dumps(plain).encode()) == old
    body2 = dict(body, segments_d=[s[:4] for s in body["segments_d"]])
    z2 = base64.b64encode(zlib.compress(json.dumps(body2).encode())).decode()
    assert segments.SegmentIndex.from_json(json.dumps({"format": segments.INDEX_FORMAT_Z, "z": z2}).encode()) == old
    for data in (json.dumps(dict(plain, rows=7)).encode(),
                 json.dumps({"format": segments.INDEX_FORMAT_LEVELS, "z": base64.b64encode(
                     zlib.compress(json.dumps(dict(body, rows=7)).encode())).decode()}).encode()):
        with pytest.raises(IntegrityError, match="live ranges hold 6 rows"):
            segments.SegmentIndex.from_json(data, where="x.json")
    truncated = json.dumps({"format": segments.INDEX_FORMAT_Z, "z": stored["z"][:-8]}).encode()
    with pytest.raises(IntegrityError, match="x.json: not an append-only index"):
        segments.SegmentIndex.from_json(truncated, where="x.json")


def _write(tier, version, buf, base):
    flat = flatten(buf.state(), state_name="replay")
    return write_append_only(tier, version, "replay", 0, flat, base)


def _read(tier, files):
    bufs, used, _ = read_files([tier], files)
    return decode_files(files, bufs, name="replay", as_numpy=True)


def test_each_version_writes_only_its_new_rows_and_reads_back_exactly(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Buffer(capacity=300)
    base, sizes = [], []
    for v in range(1, 8):
        buf.add(100)
        files, written = _write(tier, v, buf, base)
        _equal(buf.state(), _read(tier, files))
        sizes.append(written)
        base = files
    # every version after the first wrote 100 rows' bytes (+ Arrow framing and the index), not the
    # whole ~300-row buffer
    new_seg = [f.size for f in base if f.role == "segment" and f.path.startswith("v000000000007/")]
    assert len(new_seg) == 1 and new_seg[0] < 100 * ROW_BYTES + 3000, new_seg
    whole = 300 * ROW_BYTES
    assert all(s < 0.5 * whole for s in sizes[3:]), (sizes, whole)
    # exactly the segments that still hold a live row are kept (version v added ids 100(v-1)..100v-1)
    seg_versions = sorted({int(f.path[1:13]) for f in base if f.role == "segment"})
    assert seg_versions == sorted({int(i) // 100 + 1 for i in buf.ids}), seg_versions
    assert len(seg_versions) in (3, 4)


def test_a_version_without_new_rows_writes_only_the_index(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Buffer(capacity=1000)
    buf.add(50)
    files1, _ = _write(tier, 1, buf, [])
    buf._take(np.arange(len(buf.ids)) >= 10)  # only evictions
    files2, written = _write(tier, 2, buf, files1)
    assert [f.role for f in files2] == ["segment", "index"] and files2[0].path.startswith("v000000000001/")
    assert written == files2[-1].size
    _equal(buf.state(), _read(tier, files2))


def test_rows_given_old_ids_are_refused_before_writing(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Buffer(capacity=1000)
    buf.add(20)
    files, _ = _write(tier, 1, buf, [])
    state = buf.state()
    state["row_id"] = state["row_id"] + 0  # same ids ...
    state["row_id"][0] = -1
    with pytest.raises(SaveError, match="non-negative and strictly increasing"):
        write_append_only(tier, 2, "replay", 0, flatten(state, state_name="replay"), files)
    state = buf.state()
    del state["row_id"]
    with pytest.raises(SaveError, match="no 'row_id' column"):
        write_append_only(tier, 2, "replay", 0, flatten(state, state_name="replay"), files)
    # a row inserted with an id below the newest stored one was never saved: refused
    buf2 = Buffer(capacity=1000)
    buf2.add(20)
    buf2.ids = np.concatenate([buf2.ids[:5], buf2.ids[6:]])  # drop id 5 ...
    for a in ("obs", "action", "reward", "done"):
        setattr(buf2, a, np.concatenate([getattr(buf2, a)[:5], getattr(buf2, a)[6:]]))
    files_b, _ = _write(tier, 3, buf2, [])
    buf2.ids = np.insert(buf2.ids, 5, 5)  # ... and bring it back later, never stored
    for a in ("obs", "action", "reward", "done"):
        setattr(buf2, a, np.insert(getattr(buf2, a), 5, getattr(buf2, a)[0], axis=0))
    with pytest.raises(SaveError, match="lie in no stored segment"):
        _write(tier, 4, buf2, files_b)
    assert not os.path.exists(tmp_path / "t" / "v000000000004"), "bytes were written for a refused part"


def test_a_damaged_segment_or_index_is_refused_on_read(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    buf = Buffer(capacity=1000)
    buf.add(40)
    files1, _ = _write(tier, 1, buf, [])
    buf.add(40)
    files2, _ = _write(tier, 2, buf, files1)
    seg1 = tmp_path / "t" / files1[0].path
    data = bytearray(seg1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg1.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="no good copy of v000000000001/replay/rank0.segment.arrow"):
        _read(tier, files2)
    # the manifest listing fewer segments than the index names: refused, never a short buffer
    buf2 = Buffer(capacity=1000)
    buf2.add(10)
    f3, _ = _write(tier, 3, buf2, [])
    buf2.add(10)
    f4, _ = _write(tier, 4, buf2, f3)
    with pytest.raises(IntegrityError, match="are not the files the manifest lists"):
        _read(tier, [f for f in f4 if not f.path.startswith("v000000000003/")])


def test_a_base_this_tier_does_not_hold_means_a_whole_segment(tmp_path):
    tier = Tier(str(tmp_path / "t"), "local")
    other = Tier(str(tmp_path / "other"), "local")
    buf = Buffer(capacity=1000)
    buf.add(30)
    files1, _ = _write(other, 1, buf, [])  # written on another node's disk
    buf.add(30)
    files2, _ = _write(tier, 2, buf, files1)
    assert [f.path for f in files2 if f.role == "segment"] == ["v000000000002/replay/rank0.segment.arrow"]
    _equal(buf.state(), _read(tier, files2))


# ------------------------------------------------------------------------------ engine
@pytest.mark.timeout(240)
def test_engine_saves_new_rows_only_and_restores_exactly(engine_factory, tmp_path):
    buf = Buffer(capacity=400, seed=3)
    restored = {}
    engine = engine_factory(critical_writers=1, best_effort_writers=0, keep_last=2)
    engine.register("replay", buf.state, loader=restored.update, append_only=True)
    with pytest.raises(rc.InvalidArgumentError, match="append_only"):
        engine.register("x", buf.state, loader=restored.update, append_only=True, strategy="reloadable")
    states = {}
    for step in range(1, 7):
        buf.add(100)
        states[step] = buf.state()
        r = engine.save(step).result(timeout=60)
        if step >= 5:  # the buffer is full: a version writes its 100 new rows (+ framing, index, manifest), not 400
            assert r.bytes_written < 1.2 * 100 * ROW_BYTES, (step, r.bytes_written)
    deadline = time.monotonic() + 30  # retention runs after the commit
    while [m.version for m in engine.list_checkpoints()] != [5, 6] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m.version for m in engine.list_checkpoints()] == [5, 6]  # keep_last=2
    root = tmp_path / "local" / engine.run
    # retention deleted exactly what neither kept version refers to: older versions' segments that
    # version 5 or 6 still needs stay, nothing else of versions 1-4 does
    needed = set()
    for v in (5, 6):
        m = json.loads((root / f"v{v:012d}" / "manifest.json").read_bytes())
        needed |= {f["path"] for f in m["states"]["replay"]["files"]["0"]}
    on_disk = {str(p.relative_to(root)) for p in root.glob("v*/*/*") if p.is_file()}
    assert on_disk == needed, (sorted(on_disk - needed), sorted(needed - on_disk))
    assert len({p[:13] for p in needed}) >= 3  # segments of at least two older versions are referred to
    _equal(states[5], engine.load("replay", step=5))
    report = engine.restore(step=6)
    assert report.states["replay"].status == "restored" and report.states["replay"].verified
    _equal(states[6], restored)
    # the remote tier holds every segment its versions refer to
    engine.save(7).wait(durability="remote", timeout=60)
    m7 = json.loads((tmp_path / "remote" / engine.run / "v000000000007" / "manifest.json").read_bytes())
    assert all((tmp_path / "remote" / engine.run / f["path"]).exists() for f in m7["states"]["replay"]["files"]["0"])


@pytest.mark.timeout(180)
def test_ranks_push_append_only_buffers_each_with_its_own_segments(engine_factory):
    """world_size=N and append_only=True: each rank's part is written over that rank's previous part."""
    bufs = [Buffer(capacity=250, seed=r) for r in range(2)]
    engine = engine_factory(critical_writers=1, best_effort_writers=0)
    engine.register("rollouts", world_size=2, append_only=True)
    pushed = rc.CheckpointEngine.connect(engine.run)  # what a rank actor does in its own process
    for step in (1, 2, 3, 4):
        hs = []
        for r, b in enumerate(bufs):
            b.add(100 + 10 * r)
            hs.append(pushed.submit(step, "rollouts", b.state(), rank=r))
        for h in hs:
            h.result(timeout=60)
    assert pushed.last_saved_step == 4  # its pushes count as used steps (it was -1: saves only)
    for r, b in enumerate(bufs):
        _equal(b.state(), engine.load("rollouts", step=4, rank=r))
    entry = json.loads((engine_root(engine) / "v000000000004" / "manifest.json").read_bytes())["states"]["rollouts"]
    for r in (0, 1):
        segs = [f["path"] for f in entry["files"][str(r)] if f["role"] == "segment"]
        assert segs[-1] == f"v000000000004/rollouts/rank{r}.segment.arrow" and len(segs) >= 3, segs
        assert all(f"/rank{r}." in p for p in segs), segs  # never another rank's rows
    pushed.shutdown()


def engine_root(engine):
    return __import__("pathlib").Path(engine.config.local_dir) / engine.run


@pytest.mark.timeout(240)
def test_engine_retention_deletes_segments_a_merge_absorbed(engine_factory, tmp_path):
    """Past 16 versions the new segment absorbs the 15 before it (``formats/compaction.py``): the
    versions after list two segments, and once retention has deleted the versions that listed the
    absorbed ones, their files are gone from disk while every kept version restores exactly."""
    buf = Buffer(capacity=100_000, seed=4)
    restored = {}
    engine = engine_factory(critical_writers=1, best_effort_writers=0, keep_last=2)
    engine.register("replay", buf.state, loader=restored.update, append_only=True)
    states = {}
    for step in range(1, 20):
        buf.add(20)
        states[step] = buf.state()
        engine.save(step).result(timeout=60)
    deadline = time.monotonic() + 30  # retention runs after the commit
    while [m.version for m in engine.list_checkpoints()] != [18, 19] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m.version for m in engine.list_checkpoints()] == [18, 19]
    root = tmp_path / "local" / engine.run
    segs = {v: [f["path"] for f in json.loads((root / f"v{v:012d}" / "manifest.json").read_bytes())
                ["states"]["replay"]["files"]["0"] if f["role"] == "segment"] for v in (18, 19)}
    assert [p[:13] for p in segs[19]] == ["v000000000001", "v000000000017", "v000000000018", "v000000000019"]
    on_disk = {str(p.relative_to(root)) for p in root.glob("v*/*/*") if p.is_file()}
    needed = set(segs[18]) | set(segs[19]) | {f"v{v:012d}/replay/rank0.index.json" for v in (18, 19)}
    assert on_disk == needed, (sorted(on_disk - needed), sorted(needed - on_disk))
    _equal(states[18], engine.load("replay", step=18))
    assert engine.restore(step=19).states["replay"].status == "restored"
    _equal(states[19], restored)
