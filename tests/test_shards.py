"""Sharded state: DTensor leaves in formats.tree, the shard index, read planning, range
verification and resharding (formats.shards). No Ray; the DTensor tests spawn real gloo process
groups on CPU (FSDP2 ``fully_shard`` + AdamW) and restore them on other world sizes and meshes."""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import torch

from ray_ckpt.errors import IntegrityError, RestoreError
from ray_ckpt.formats import shard_index, shards
from ray_ckpt.formats.shard_record import ShardRecord, index_of, part_record
from ray_ckpt.formats.pieces import PieceHasher, piece_digests, pieces_for_range, verify_pieces
from ray_ckpt.formats.shard_index import ChunkMeta, ShardedTensorMeta, ShardIndex, StoredChunk
from ray_ckpt.formats.shards import (assemble_full, box_ranges, load_chunk, load_into_tensor, plan_bytes,
                                     plan_reads)
from ray_ckpt.formats.sharded_leaf import sharded_leaves
from ray_ckpt.formats.tree import flatten, unflatten

MiB = 1 << 20


# --------------------------------------------------------------------------------------------------
# helpers: a tensor stored as chunks in per-rank "files" (bytes), as a writer would lay them out


def dim_chunks(n: int, parts: int):
    """(offset, size) of each part of a dim of n split as DTensor's Shard does (torch.chunk)."""
    step = -(-n // parts) if n else 0
    out = []
    for i in range(parts):
        o = min(i * step, n)
        out.append((o, max(0, min(step, n - o))))
    return out


def grid_boxes(shape, parts_per_dim):
    """Boxes of a tensor split by Shard on every dim (parts_per_dim[d] parts along dim d)."""
    boxes = [((), ())]
    for n, p in zip(shape, parts_per_dim):
        boxes = [(o + (oo,), s + (ss,)) for o, s in boxes for oo, ss in dim_chunks(n, p)]
    return boxes


def store(full: torch.Tensor, boxes, piece_size=MiB, lead=4097):
    """Each box in its own file after ``lead`` bytes of other data (not piece aligned)."""
    files, chunks = {}, []
    for r, (o, s) in enumerate(boxes):
        if math.prod(s) == 0:
            continue
        part = full[tuple(slice(a, a + b) for a, b in zip(o, s))].contiguous()
        data = part.reshape(-1).view(torch.uint8).numpy().tobytes()
        files[f"rank{r}"] = bytes(lead) + data
        chunks.append(StoredChunk(ChunkMeta(o, s), f"rank{r}", lead, len(data), piece_size,
                                  tuple(piece_digests(data, piece_size))))
    meta = ShardedTensorMeta("w", tuple(full.shape), str(full.dtype).replace("torch.", ""), chunks)
    return meta, files


def reader(files, counter=None):
    def read(f, b, e):
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0) + (e - b)
            counter["calls"] = counter.get("calls", 0) + 1
        return files[f][b:e]
    return read


def target_box(full, o, s):
    return full[tuple(slice(a, a + b) for a, b in zip(o, s))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and \
        a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------------------
# tree: floats


def test_nan_sign_and_payload_round_trip():
    neg = -float("nan")
    payload = struct.unpack(">d", bytes.fromhex("7ff0000000000123"))[0]  # a signalling NaN's payload
    state = {"neg": neg, "pos": float("nan"), "pay": payload, "l": [neg, (payload, 1.5)], "inf": -math.inf}
    flat = flatten(state)
    # the structure survives JSON (it lives in a file header)
    structure = json.loads(json.dumps(flat.structure))
    out = unflatten(structure, flat.arrays, flat.tables)

    def bits(x):
        return struct.pack(">d", x).hex()

    assert bits(out["neg"]) == bits(neg) and bits(out["neg"]).startswith("f")
    assert bits(out["pos"]) == bits(float("nan"))
    assert bits(out["pay"]) == "7ff0000000000123"
    assert bits(out["l"][0]) == bits(neg) and bits(out["l"][1][0]) == "7ff0000000000123"
    assert out["l"][1][1] == 1.5 and out["inf"] == -math.inf
    # a structure written before the fix ({"f": "nan"}) still reads
    assert math.isnan(unflatten({"f": "nan"}, [], []))


# --------------------------------------------------------------------------------------------------
# pure planning


def test_box_ranges_coalesce_rows():
    # rows 1..2 of a [4, 5] float32 array: one range
    assert box_ranges([4, 5], [1, 0], [2, 5], 4) == [(20, 60)]
    # a column box: one range per row
    assert box_ranges([4, 5], [1, 1], [2, 3], 4) == [(24, 36), (44, 56)]
    # whole trailing dims of a 3-D chunk with a partial leading dim
    assert box_ranges([6, 2, 3], [2, 0, 0], [3, 2, 3], 2) == [(24, 60)]
    # partial middle dim: one range per leading index
    assert box_ranges([3, 4, 2], [0, 1, 0], [3, 2, 2], 1) == [(2, 6), (10, 14), (18, 22)]
    # size-1 middle dim behaves as whole
    assert box_ranges([4, 1, 5], [1, 0, 0], [2, 1, 5], 2) == [(10, 30)]
    assert box_ranges([], [], [], 8) == [(0, 8)]
    assert box_ranges([3, 0], [0, 0], [3, 0], 4) == []


@pytest.mark.parametrize("shape,dtype,stored,target", [
    ((10, 7), torch.float32, (4, 1), (3, 1)),      # uneven 4 -> 3
    ((10, 7), torch.float32, (4, 1), (2, 1)),      # 4 -> 2
    ((10, 7), torch.float32, (4, 1), (8, 1)),      # 4 -> 8 (empty target chunks)
    ((5,), torch.int64, (4,), (3,)),               # 1-D uneven, an empty stored chunk
    ((9, 11), torch.bfloat16, (2, 2), (1, 3)),     # 2-D chunks -> Shard(1) on 3
    ((9, 11), torch.float64, (2, 2), (2, 1)),      # 2x2 -> Shard(0) on 2
    ((9, 11), torch.float32, (1, 4), (3, 1)),      # Shard(1) -> Shard(0)
    ((6, 4, 5), torch.float16, (3, 1, 1), (1, 2, 2)),
    ((6, 4, 5), torch.float32, (4, 2, 1), (1, 1, 1)),  # to the whole tensor
])
def test_plan_reads_repartitions(shape, dtype, stored, target):
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(shape, generator=g) * 100).to(dtype)
    meta, files = store(full, grid_boxes(shape, stored), piece_size=64)
    assert same_bits(assemble_full(meta, reader(files)), full)
    for o, s in grid_boxes(shape, target):
        items = plan_reads(meta, o, s)
        if math.prod(s) == 0:
            assert items == []
            continue
        # the boxes tile the target exactly, and each item's ranges are exactly its box's bytes
        assert sum(math.prod(it.sizes) for it in items) == math.prod(s)
        for it in items:
            assert it.nbytes == math.prod(it.sizes) * full.element_size()
            c = meta.chunks[it.chunk].chunk
            assert all(0 <= a and a + b <= n for a, b, n in zip(it.src_offsets, it.sizes, c.sizes))
        for verify in (True, False):
            out = torch.full(s, 7, dtype=dtype)
            n = {}
            got = load_chunk(out, meta, o, s, reader(files, n), verify=verify)
            assert same_bits(out, target_box(full, o, s).contiguous())
            assert got == n["bytes"] == plan_bytes(meta, items, verify=verify)
            if not verify:
                assert n["bytes"] == sum(it.nbytes for it in items)


def test_zero_dim_and_whole_plain_target():
    full = torch.tensor(3.25, dtype=torch.float64)
    meta, files = store(full, [((), ())], piece_size=4)
    assert plan_reads(meta) == [shards.ReadItem(0, "rank0", (), (), (), ((0, 8),))]
    assert same_bits(assemble_full(meta, reader(files)), full)
    full2 = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    meta2, files2 = store(full2, grid_boxes((4, 6), (2, 3)))
    out = torch.zeros(4, 6, dtype=torch.int32)
    load_into_tensor(out, meta2, reader(files2))  # a plain tensor target is the whole tensor
    assert torch.equal(out, full2)


def test_shape_and_dtype_mismatch_name_key_and_both():
    full = torch.zeros(8, 3)
    meta, files = store(full, grid_boxes((8, 3), (2, 1)))
    with pytest.raises(RestoreError, match=r"w: the target is shape \[8, 4\] float32 but the checkpoint "
                                           r"holds shape \[8, 3\] float32"):
        load_into_tensor(torch.zeros(8, 4), meta, reader(files))
    with pytest.raises(RestoreError, match=r"\[8, 3\] bfloat16 .*\[8, 3\] float32"):
        load_into_tensor(torch.zeros(8, 3, dtype=torch.bfloat16), meta, reader(files))
    with pytest.raises(RestoreError, match="outside"):
        plan_reads(meta, (6, 0), (4, 3))


@pytest.mark.parametrize("shape,dtype", [((16384, 1024), torch.float32), ((32771, 1024), torch.bfloat16),
                                         ((8195, 2048), torch.float32), ((12289, 1000), torch.bfloat16)])
def test_bytes_read_per_target_rank_shard0(shape, dtype):
    """Shard(0) re-partitions of a tensor stored on 4 ranks, verified with 1 MiB pieces: a target rank
    reads its own bytes plus less than 2 pieces per stored chunk it overlaps (a cut inside a chunk
    widens to whole pieces, from the chunk's start); so <= 1.25x once it owns >= 8 MiB of the tensor
    (64 MiB tensors on 8 ranks; the last, 24 MiB, case only the general bound)."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=g).to(dtype)
    meta, files = store(full, grid_boxes(shape, (4, 1)), piece_size=MiB)
    worst = {}
    for parts in (2, 3, 8):
        for o, s in grid_boxes(shape, (parts, 1)):
            out = torch.empty(s, dtype=dtype)
            n = {}
            load_chunk(out, meta, o, s, reader(files, n), verify=True)
            assert same_bits(out, target_box(full, o, s))
            own = out.numel() * out.element_size()
            worst[parts] = max(worst.get(parts, 0), n["bytes"] / own)
            assert n["bytes"] < own + 2 * MiB * len(plan_reads(meta, o, s))
            if own >= 8 * MiB:
                assert n["bytes"] <= 1.25 * own, (parts, o, s, n["bytes"] / own)
    print(f"\nshape {shape} {dtype}: worst bytes read / own bytes per target rank:",
          {f"4->{k}": round(v, 3) for k, v in worst.items()})


# --------------------------------------------------------------------------------------------------
# range verification


def test_piece_digests_streaming_and_ranges():
    data = os.urandom(10 * 1000 + 17)
    d = piece_digests(data, 1000)
    assert len(d) == 11
    h = PieceHasher(1000)
    for i in range(0, len(data), 333):  # updates that do not line up with pieces
        h.update(data[i: i + 333])
    assert h.hexdigests() == d and h.size == len(data)
    assert list(pieces_for_range(0, 1000, 1000)) == [0]
    assert list(pieces_for_range(999, 1001, 1000)) == [0, 1]
    assert list(pieces_for_range(5, 5, 1000)) == []
    assert list(pieces_for_range(10_000, 10_017, 1000)) == [10]
    verify_pieces(memoryview(data)[2000:5000], 2, d, 1000, file="f")
    verify_pieces(memoryview(data)[10_000:], 10, d, 1000, file="f")
    bad = bytearray(data)
    bad[3500] ^= 1
    with pytest.raises(IntegrityError, match=r"f: w: checksum mismatch in piece 3 "):
        verify_pieces(memoryview(bad)[2000:5000], 2, d, 1000, file="f", what="w")


def test_corruption_is_caught_only_where_read():
    full = torch.randn(64, 4096)  # 1 MiB; 4 chunks of 256 KiB, 64 KiB pieces
    meta, files = store(full, grid_boxes((64, 4096), (4, 1)), piece_size=64 << 10, lead=100)
    bad = bytearray(files["rank1"])
    bad[100 + (200 << 10)] ^= 0xFF  # piece 3 of rank1's chunk (rows 16..31 -> rows 28..31)
    files["rank1"] = bytes(bad)
    # a target that reads none of the bad piece's rows: verified and fine
    out = torch.empty(10, 4096)
    load_chunk(out, meta, (16, 0), (10, 4096), reader(files))
    assert torch.equal(out, full[16:26])
    # one that does: an IntegrityError naming the file and the piece
    with pytest.raises(IntegrityError, match=r"rank1: w: checksum mismatch in piece 3"):
        load_chunk(torch.empty(32, 4096), meta, (16, 0), (32, 4096), reader(files))
    with pytest.raises(IntegrityError, match="rank1"):
        assemble_full(meta, reader(files))
    # without verification the corruption is read (what verify=True is for)
    assert not torch.equal(assemble_full(meta, reader(files), verify=False), full)
    # a truncated file
    files["rank2"] = files["rank2"][:-10]
    with pytest.raises(IntegrityError, match="rank2: .*truncated"):
        load_chunk(torch.empty(8, 4096), meta, (40, 0), (8, 4096), reader(files), verify=False)


# --------------------------------------------------------------------------------------------------
# the index


def test_index_json_round_trip_and_coverage():
    full = torch.randn(10, 6)
    meta, files = store(full, grid_boxes((10, 6), (3, 2)), piece_size=32)
    idx = ShardIndex({"w": meta})
    back = ShardIndex.from_json(json.loads(json.dumps(idx.to_json())))
    assert back.keys() == idx.keys()
    assert back["w"].chunks == meta.chunks and back["w"].global_shape == (10, 6)
    assert ShardIndex.from_json(idx.dumps())["w"].to_json() == meta.to_json()
    assert same_bits(assemble_full(back["w"], reader(files)), full)
    with pytest.raises(IntegrityError, match="not a ray_ckpt shard index"):
        ShardIndex.from_json({"tensors": {}})

    def rec(chunks, shape=(10, 6), dtype="float32"):
        return ShardRecord.from_json({"format": 1, "file": "x", "tensors": {"w": {
            "path": ["w"], "shape": list(shape), "dtype": dtype, "mesh": [2], "placements": ["S(0)"],
            "chunks": [c.to_json() for c in chunks]}}})

    recs = [rec([c]) for c in meta.chunks]
    assert index_of(recs)["w"].chunks == sorted(meta.chunks, key=lambda c: c.chunk.offsets)
    assert len(index_of(recs + recs[:1])["w"].chunks) == len(meta.chunks)  # a chunk twice: kept once
    with pytest.raises(IntegrityError, match=r"w: the stored chunks hold 48 of the 60 elements"):
        index_of(recs[1:])
    with pytest.raises(IntegrityError, match="disagree"):
        index_of(recs + [rec([], shape=(10, 7))])

    # a hostile or damaged index is refused when read
    def edited(**change):
        d = json.loads(idx.dumps())
        d["tensors"]["w"]["chunks"][1].update(change)
        return d

    c1 = meta.chunks[1]
    for change, why in [({"o": [9, 0]}, "not inside shape"), ({"s": [4, 0]}, "not inside shape"),
                        ({"o": [0, 0]}, "overlap"), ({"n": c1.nbytes + 4}, "bytes at"),
                        ({"at": -1}, "bytes at"), ({"xxh3": list(c1.digests[:-1])}, "piece digests"),
                        ({"o": "x"}, "malformed")]:
        with pytest.raises(IntegrityError, match=why):
            ShardIndex.from_json(edited(**change))
    # the right number of elements, but two chunks overlap (and leave a hole)
    m2 = ShardedTensorMeta("w", (2, 2), "float32", [StoredChunk(ChunkMeta((0, 0), (1, 2)), "a", 0, 8),
                                                     StoredChunk(ChunkMeta((0, 0), (2, 1)), "b", 0, 8)])
    with pytest.raises(IntegrityError, match=r"w: chunks at \[0, 0\] and \[0, 0\] overlap"):
        ShardIndex.from_json(ShardIndex({"w": m2}).dumps())


def test_safetensors_array_offsets():
    """The offsets a writer records for a ray_ckpt safetensors file point at each array's bytes."""
    from ray_ckpt.formats import safetensors_io

    flat = flatten({"a": torch.arange(5, dtype=torch.int16), "b": torch.randn(3, 2, dtype=torch.float64),
                    "c": np.arange(4, dtype=np.uint8)})
    blob = b"".join(bytes(memoryview(p).cast("B")) for p in safetensors_io.file_views(flat))
    offs = safetensors_io.parse_header(blob, len(blob)).offsets
    for off, arr in zip(offs, flat.arrays):
        assert blob[off: off + arr.nbytes] == arr.tobytes()


# --------------------------------------------------------------------------------------------------
# real DTensors: FSDP2 on gloo process groups (CPU)


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
            "torch.distributed.device_mesh", "ray_ckpt.formats.shards"]


def _spawn(fn, args, nprocs):
    """Run fn(rank, *args) in nprocs processes forked from a forkserver that imported torch and FSDP
    once (each spawned process would import them again: ~5 s apiece on a 2-core machine)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _init(rank, world, store_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)


def _mlp(seed):
    torch.manual_seed(seed)
    # uneven on 2, 3 and 4 ranks (7, 10, 5 rows); bias of 5 leaves an empty chunk on 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                               torch.nn.ReLU(), torch.nn.Linear(7, 5))


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 12, generator=g)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _full_state(model, opt):
    """key -> full tensor of every parameter and both AdamW moments (a collective call)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p.full_tensor().clone()
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim/state/{ids[id(p)]}/{k}"] = st[k].full_tensor().clone()
    return out


def _write_part(tmp, rank, state):
    """A rank's file: its arrays one after another after some other bytes; its part record."""
    flat = flatten(state, state_name="sharded")
    offsets, pos = [], 123
    with open(os.path.join(tmp, f"rank{rank}.bin"), "wb") as f:
        f.write(bytes(pos))
        for arr in flat.arrays:
            offsets.append(pos)
            f.write(arr.tobytes())
            pos += arr.nbytes
    rec = part_record(flat, f"rank{rank}", offsets, piece_size=256)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(rec.to_json(), f)
    with open(os.path.join(tmp, f"rank{rank}.structure.json"), "w") as f:
        json.dump({"structure": flat.structure, "at": offsets, "n": [a.nbytes for a in flat.arrays]}, f)
    return flat


def _record(tmp: str, rank: int) -> ShardRecord:
    """Rank ``rank``'s part record as :func:`_write_part` left it in a JSON file."""
    with open(os.path.join(tmp, f"rank{rank}.json")) as f:
        return ShardRecord.from_json(json.load(f))


def _read_part(tmp, rank):
    """A part written by _write_part: (structure, arrays) as a reader of the rank's file gets them."""
    with open(os.path.join(tmp, f"rank{rank}.structure.json")) as f:
        d = json.load(f)
    with open(os.path.join(tmp, f"rank{rank}.bin"), "rb") as f:
        blob = bytearray(f.read())
    return d["structure"], [memoryview(blob)[a: a + n] for a, n in zip(d["at"], d["n"])]


def _save_fsdp(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, os.path.join(tmp, "store-save"))
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(_mlp(0), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _train_step(model, opt, 100 * rank + s)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    flat = _write_part(tmp, rank, state)
    # unflatten without a target layout: local chunks as plain tensors, metadata as ShardedLeaf
    back = unflatten(flat.structure, flat.arrays, flat.tables)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"].to_local())
    leaves = {leaf.key: leaf for leaf in sharded_leaves(flat.structure)}
    w = leaves["model/0.weight"]
    assert w.global_shape == [10, 12] and w.placements == ["S(0)"] and w.mesh_shape == [world]
    assert w.rank == rank and w.writer_rank == rank and w.stored
    recs = unflatten(flat.structure, flat.arrays, flat.tables, on_sharded=lambda leaf: leaf)
    assert recs["optim"]["state"][0]["exp_avg"].offsets == w.offsets
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(tmp, "full.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _restore_fsdp(rank, world, tmp, nsaved):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, os.path.join(tmp, f"store-restore{world}"))
    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp(_mlp(12345), mesh)  # other values
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 7)  # creates the moments to fill
    index = index_of(_record(tmp, r) for r in range(nsaved))
    index = shard_index.ShardIndex.from_json(index.dumps())
    counter = {}
    read = shards.file_reader({f"rank{r}": os.path.join(tmp, f"rank{r}.bin") for r in range(nsaved)}, counter)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    # the non-sharded leaves (AdamW's step) come from rank 0's part; its chunks are not needed
    rank0 = unflatten(*_read_part(tmp, 0), [], on_sharded=lambda leaf: None)
    filled, rest = shards.load_state_into(target, index, read, plain=rank0)
    assert len(filled) == 6 * 3 and rest == [f"optim/state/{i}/step" for i in range(6)]
    assert all(float(opt.state[p]["step"]) == 2.0 for p in model.parameters())
    want = torch.load(os.path.join(tmp, "full.pt"))
    got = _full_state(model, opt)  # from the model's parameters and the optimizer's own state
    assert got.keys() == want.keys()
    for k in want:
        assert same_bits(got[k], want[k]), k
    # a rank reads its share, not the checkpoint (pieces of 256 bytes: small over-read)
    total = sum(os.path.getsize(os.path.join(tmp, f"rank{r}.bin")) - 123 for r in range(nsaved))
    assert counter["bytes"] < total
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    _spawn(_save_fsdp, (4, tmp), 4)
    return tmp


@pytest.mark.timeout(180)
def test_fsdp_index_assembles_full_tensors(fsdp_saved):
    tmp = fsdp_saved
    index = index_of(_record(tmp, r) for r in range(4))
    want = torch.load(os.path.join(tmp, "full.pt"))
    assert set(want) <= set(index)
    assert index["model/4.bias"].global_shape == (5,)
    assert len(index["model/4.bias"].chunks) == 3  # 2, 2, 1, 0 rows: rank 3's chunk is empty
    read = shards.file_reader({f"rank{r}": os.path.join(tmp, f"rank{r}.bin") for r in range(4)})
    for k, t in want.items():
        assert same_bits(assemble_full(index[k], read), t), k
    # load(rank=None): a part's structure with its sharded leaves assembled, from any rank's part
    structure, arrays = _read_part(tmp, 3)
    full = shards.full_state(structure, arrays, [], index, read)
    for name, t in full["model"].items():
        assert same_bits(t, want[f"model/{name}"]), name
    assert same_bits(full["optim"]["state"][2]["exp_avg_sq"], want["optim/state/2/exp_avg_sq"])
    assert float(full["optim"]["state"][0]["step"]) == 2.0 and full["optim"]["param_groups"][0]["lr"] == 1e-2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_restore_on_other_world_size(fsdp_saved, world):
    _spawn(_restore_fsdp, (world, fsdp_saved, 4), world)


# a 2x2 mesh with several placements -> a 1-D mesh of 2

_MESH_CASES = {  # key: (global shape, placements on the 2x2 mesh)
    "ss": ((13, 10), ("S(0)", "S(1)")),
    "rs": ((9, 4), ("R", "S(0)")),      # HSDP-like: replicated across mesh dim 0
    "sr": ((6, 7), ("S(1)", "R")),
    "rr": ((5,), ("R", "R")),
    "s0s0": ((11, 3), ("S(0)", "S(0)")),  # both mesh dims shard dim 0
}


def _expected(key):
    shape, _ = _MESH_CASES[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g)


def _placements(names):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in names]


def _save_2x2(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    _init(rank, world, os.path.join(tmp, "store-save"))
    mesh = init_device_mesh("cpu", (2, 2))
    state = {k: distribute_tensor(_expected(k), mesh, _placements(pl)) for k, (_, pl) in _MESH_CASES.items()}
    flat = _write_part(tmp, rank, state)
    coord = mesh.get_coordinate()
    leaves = {leaf.key: leaf for leaf in sharded_leaves(flat.structure)}
    assert leaves["ss"].stored and leaves["s0s0"].stored
    assert leaves["rs"].stored == (coord[0] == 0) and leaves["sr"].stored == (coord[1] == 0)
    assert leaves["rr"].stored == (rank == 0) and leaves["rr"].writer_rank == 0
    # a Partial DTensor is not a value: refused at flatten, naming the key
    from torch.distributed.tensor import DTensor, Partial

    from ray_ckpt.errors import UnsupportedTypeError

    partial = DTensor.from_local(torch.ones(2), mesh, [Partial(), Partial()])
    with pytest.raises(UnsupportedTypeError,
                       match=r"DTensor at \['p'\]: placement Partial \(P\(sum\)\) is not supported"):
        flatten({"p": partial})
    if not leaves["rs"].stored:
        with pytest.raises(RestoreError, match=r"rs is a replicated DTensor chunk stored in the part of rank"):
            unflatten(flat.structure, flat.arrays, flat.tables)
    dist.barrier()
    dist.destroy_process_group()


def _restore_1d(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, world, os.path.join(tmp, "store-restore"))
    mesh = init_device_mesh("cpu", (world,))
    index = index_of(_record(tmp, r) for r in range(4))
    read = shards.file_reader({f"rank{r}": os.path.join(tmp, f"rank{r}.bin") for r in range(4)})
    for k, (shape, _) in _MESH_CASES.items():
        for pl in [Shard(0), Replicate()] + ([Shard(1)] if len(shape) > 1 else []):
            t = distribute_tensor(torch.zeros(shape), mesh, [pl])
            load_into_tensor(t, index[k], read)
            assert same_bits(t.full_tensor(), _expected(k)), (k, pl)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_2x2_mesh_restored_on_1d_mesh_of_2(tmp_path):
    tmp = str(tmp_path)
    _spawn(_save_2x2, (4, tmp), 4)
    recs = [_record(tmp, r) for r in range(4)]
    # replicated chunks are written once
    n_chunks = {k: sum(len(m.chunks) for r in recs for m in r.tensors if m.key == k) for k in _MESH_CASES}
    assert n_chunks == {"ss": 4, "rs": 2, "sr": 2, "rr": 1, "s0s0": 4}
    index = index_of(recs)
    assert index["ss"].placements == ("S(0)", "S(1)") and index["ss"].mesh_shape == (2, 2)
    _spawn(_restore_1d, (2, tmp), 2)
