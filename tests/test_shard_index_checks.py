"""Sharded reads verify the shard index's structure, not just bytes (issue 29, item 5).

A sharded state is laid out as the writer lays it out (``checkpoint_io.write_flat`` per rank,
``shard_record`` + ``shard_record.index_of`` + rank 0's "head", as the catalogue stores it), without
Ray: each rank's part is a flattened state whose "w" leaf is a DTensor ("DT") node holding that
rank's rows. Then the manifest entry's index is tampered with and ``load(rank=None)``'s path
(``sharded_io.load_full``) and ``load_into``'s (``sharded_io.load_into_state``) must refuse it with
an error naming the file and the chunk: never wrong rows, never a raw error, never a large
allocation.
"""
from __future__ import annotations

import copy
import json
import tracemalloc

import pytest
import torch

from ray_ckpt.storage import sharded_io
from ray_ckpt.storage.checkpoint_io import shard_record, write_flat
from ray_ckpt.errors import IntegrityError, RestoreError
from ray_ckpt.formats.manifest import StateEntry
from ray_ckpt.formats.shard_index import ShardIndex
from ray_ckpt.formats.shard_record import index_of
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.range_source import RangeSource
from ray_ckpt.storage.tier import Tier

ROWS, COLS, PIECE = 8, 4, 64
GiB = 1 << 30


def full_tensor() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def make_state(tmp_path, world: int = 2):
    """(tier, entry) of a state {"w": DTensor Shard(0) over ``world`` ranks, "step": tensor} of version 1."""
    tier = Tier(str(tmp_path))
    full, rows = full_tensor(), ROWS // world
    files, recs = {}, []
    for r in range(world):
        flat = flatten({"w": full[r * rows:(r + 1) * rows].clone(), "step": torch.tensor(3.0)})
        node = flat.structure["d"][0][1]
        assert "T" in node
        flat.structure["d"][0][1] = {"DT": node["T"], "dt": "float32", "sh": [rows, COLS], "g": [ROWS, COLS],
                                     "o": [r * rows, 0], "m": [world], "p": ["S(0)"], "c": [r], "r": r, "w": r}
        entries = write_flat(tier, 1, "model", r, flat)
        files[str(r)] = entries
        recs.append(shard_record(flat, entries[0].path, piece_size=PIECE))
    index = index_of(recs).to_json()
    index["heads"] = {"0": recs[0].head.to_json()}
    return tier, StateEntry("critical", "stored", files=files, shards=index)


def chunks_of(entry):
    return entry.shards["tensors"]["w"]["chunks"]


def load_full(tier, entry):
    return sharded_io.load_full([tier], entry, "model")[0]


def load_into(tier, entry):
    target = {"w": torch.zeros(ROWS, COLS), "step": torch.tensor(0.0)}
    sharded_io.load_into_state([tier], entry, "model", target)
    return target


def test_untampered_state_loads(tmp_path):
    tier, entry = make_state(tmp_path)
    assert torch.equal(load_full(tier, entry)["w"], full_tensor())
    got = load_into(tier, entry)
    assert torch.equal(got["w"], full_tensor()) and float(got["step"]) == 3.0


@pytest.mark.parametrize("world,swap", [(2, (0, 1)), (4, (1, 2))])
def test_swapped_chunk_boxes_are_refused(tmp_path, world, swap):
    """Two chunks' boxes swapped (no data byte or digest touched): the files' headers say otherwise.
    (4 ranks, chunks 1 and 2: neither is in rank 0's file, whose header the reader reads anyway.)"""
    tier, entry = make_state(tmp_path, world)
    cs = chunks_of(entry)
    a, b = swap
    cs[a]["o"], cs[b]["o"] = cs[b]["o"], cs[a]["o"]
    victim = cs[a]["file"]
    for load in (load_full, load_into):
        with pytest.raises((IntegrityError, RestoreError)) as ei:
            got = load(tier, entry)
            assert torch.equal(got["w"], full_tensor()), "wrong rows returned as a success"
        msg = str(ei.value)
        assert "does not match the file's header" in msg and victim in msg and "chunk at" in msg, msg


def test_chunk_without_piece_digests_is_refused(tmp_path):
    """A chunk whose digests were removed is not read unverified (a flipped byte would load silently)."""
    tier, entry = make_state(tmp_path)
    c = chunks_of(entry)[1]
    del c["xxh3"], c["ps"]
    path = tier.root + "/" + c["file"] if not tier.root.endswith("/") else tier.root + c["file"]
    with open(path, "r+b") as f:  # flip a data byte of that chunk
        f.seek(c["at"] + 5)
        byte = f.read(1)
        f.seek(c["at"] + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    for load in (load_full, load_into):
        with pytest.raises((IntegrityError, RestoreError)) as ei:
            got = load(tier, entry)
            assert torch.equal(got["w"], full_tensor()), "a flipped byte loaded silently"
        msg = str(ei.value)
        assert "no piece digests" in msg and c["file"] in msg and "chunk at [4, 0]" in msg, msg
    # parse time: every reader path (ShardIndex.from_json) refuses it
    with pytest.raises(IntegrityError, match="no piece digests"):
        ShardIndex.from_json(entry.shards)


def test_huge_claimed_chunk_is_refused_before_any_allocation(tmp_path, monkeypatch):
    """A small file claiming a 2 GiB chunk: refused by the manifest's file size, nothing allocated."""
    tier, entry = make_state(tmp_path, world=2)
    c0 = chunks_of(entry)[0]
    size = next(f.size for f in entry.files["0"] if f.path == c0["file"])
    assert size < 4096
    n = 2 * GiB
    entry.shards["tensors"]["w"] = {"shape": [n // 4, 1], "dtype": "float32", "path": ["w"], "mesh": [1],
                                    "placements": ["S(0)"],
                                    "chunks": [{"o": [0, 0], "s": [n // 4, 1], "file": c0["file"], "at": c0["at"],
                                                "n": n, "ps": n, "xxh3": c0["xxh3"][:1]}]}
    asked = []
    real_empty, real_range = torch.empty, Tier.read_range

    def empty(*shape, **kw):
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        nb = 4
        for d in dims:
            nb *= int(d)
        asked.append(nb)
        if nb > 64 << 20:
            raise AssertionError(f"would allocate {nb} bytes")
        return real_empty(*shape, **kw)

    def read_range(self, rel, begin, end):
        asked.append(end - begin)
        if end - begin > 64 << 20:
            raise AssertionError(f"would read {end - begin} bytes into memory")
        return real_range(self, rel, begin, end)

    real_into = RangeSource.read_into

    def read_into(self, begin, out):  # ranges read straight into a target, or through an open file
        n = memoryview(out).nbytes
        asked.append(n)
        if n > 64 << 20:
            raise AssertionError(f"would read {n} bytes into memory")
        return real_into(self, begin, out)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(Tier, "read_range", read_range)
    monkeypatch.setattr(RangeSource, "read_into", read_into)
    tracemalloc.start()
    try:
        for load in (load_full, lambda t, e: sharded_io.full_tensors([t], e, "model")):
            with pytest.raises(IntegrityError) as ei:
                load(tier, entry)
            msg = str(ei.value)
            assert "past the end of the file" in msg and c0["file"] in msg and "chunk at [0, 0]" in msg, msg
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(asked, default=0) < 1 << 20 and peak < 16 << 20, (asked, peak)


def test_range_past_the_file_is_refused_before_reading(tmp_path, monkeypatch):
    tier, entry = make_state(tmp_path)
    c = chunks_of(entry)[1]
    size = next(f.size for f in entry.files["1"] if f.path == c["file"])
    c["at"] = size - 8  # the chunk's bytes would run 24 bytes past the end
    reads = []
    real_range = Tier.read_range
    monkeypatch.setattr(Tier, "read_range", lambda self, rel, b, e: reads.append((rel, b, e)) or real_range(self, rel, b, e))
    real_into = RangeSource.read_into
    monkeypatch.setattr(RangeSource, "read_into",
                        lambda self, b, out: reads.append((self.rel, b, len(out))) or real_into(self, b, out))
    with pytest.raises(IntegrityError) as ei:
        load_full(tier, entry)
    msg = str(ei.value)
    assert "past the end of the file" in msg and c["file"] in msg and "chunk at [4, 0]" in msg, msg
    assert reads == []  # refused when the index was parsed: nothing read


@pytest.mark.parametrize("dtype", ["Tensor", "Size", "nn", "float32x", 5, None])
def test_odd_dtype_is_an_integrity_error_naming_the_file(tmp_path, dtype):
    tier, entry = make_state(tmp_path)
    entry.shards["tensors"]["w"]["dtype"] = dtype
    for load in (load_full, load_into):
        with pytest.raises(IntegrityError) as ei:
            load(tier, entry)
        msg = str(ei.value)
        assert "'model'" in msg and "w" in msg and (chunks_of(entry)[0]["file"] in msg or "malformed" in msg), msg


@pytest.mark.parametrize("change,why", [
    ({"at": 1.5}, "malformed"), ({"at": "40"}, "malformed"), ({"o": [4.0, 0]}, "malformed"),
    ({"s": [True, 4]}, "malformed"), ({"file": ["x"]}, "malformed"), ({"xxh3": "abc"}, "malformed"),
    ({"ps": 0}, "malformed"), ({"o": [0, 0]}, "overlap"), ({"o": [5, 0]}, "not inside shape"),
    ({"file": "v000000000001/other/rank0.safetensors"}, "not one of the state's files"),
])
def test_malformed_chunk_field_names_the_chunk(tmp_path, change, why):
    tier, entry = make_state(tmp_path)
    chunks_of(entry)[1].update(change)
    with pytest.raises(IntegrityError) as ei:
        load_full(tier, entry)
    msg = str(ei.value)
    assert why in msg and "'model'" in msg and ("chunk 1" in msg or "chunk at" in msg or "chunks at" in msg), msg


def test_overflowing_sizes_are_an_integrity_error(tmp_path):
    """Offsets and sizes past int64 (the tiling check works in int64): an IntegrityError, not OverflowError."""
    tier, entry = make_state(tmp_path)
    big = 1 << 69
    entry.shards["tensors"]["w"].update(shape=[2 * big], chunks=[
        {"o": [i * big], "s": [big], "file": c["file"], "at": c["at"], "n": 4 * big, "ps": 4 * big,
         "xxh3": c["xxh3"][:1]} for i, c in enumerate(chunks_of(entry))])
    with pytest.raises(IntegrityError, match="w"):
        load_full(tier, entry)


def test_writer_records_still_parse_and_round_trip(tmp_path):
    """The strict parse accepts what the writer records (the index JSON of a real part)."""
    _tier, entry = make_state(tmp_path, world=4)
    index = ShardIndex.from_json(json.loads(json.dumps(entry.shards)))
    assert [c.chunk.offsets for c in index["w"].chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert all(c.digests for c in index["w"].chunks)
    ShardIndex.from_json(copy.deepcopy(entry.shards),
                         file_sizes={f.path: f.size for fs in entry.files.values() for f in fs})
