"""Resharded restore: ray_ckpt ``load_into`` vs torch DCP ``dcp.load``, side by side, same state.

4 gloo ranks (CPU) save an FSDP2-like state -- ``--tensors`` DTensors of ``[rows, 1024]`` float32,
``Shard(0)`` on a 1-D mesh, ``--mb`` MB in all -- once with ray_ckpt's writer (the same
``PartWriter.write_part`` and catalogue index the engine uses; no Ray cluster: the writer is the
plain object) and once with ``dcp.save``. Then 2 and 8 new ranks each build the same tensors
sharded their way and restore them: ray_ckpt through ``sharded_io.load_into_state`` (the code path
of ``engine.load_into``), DCP through ``dcp.load``. Per restore: wall time (slowest rank, between
barriers), bytes each rank read (``rchar`` of /proc/self/io: every read syscall, so both libraries
are counted the same way; and ray_ckpt's own count), what the rank needs (its shards' bytes), and a
bit-exact check of every restored shard.

    python benchmarks/reshard.py [--mb 1024] [--tensors 16] [--dir /tmp/reshard]

Files are in the page cache on both sides (no cache drop: it needs root and a quiet machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed.checkpoint",
            "ray_ckpt.storage.sharded_io", "ray_ckpt.writers.pools"]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _state(world: int, mesh, n: int, rows: int, fill: bool):
    from torch.distributed.tensor import Shard, distribute_tensor, zeros

    out = {}
    for i in range(n):
        if fill:
            g = torch.Generator().manual_seed(i)
            out[f"layer{i}.weight"] = distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
        else:
            out[f"layer{i}.weight"] = zeros(rows, 1024, device_mesh=mesh, placements=[Shard(0)])
    return out


def _init(rank: int, world: int, store: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _save(rank: int, world: int, d: str, n: int, rows: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ray_ckpt.formats.tree import flatten
    from ray_ckpt.storage.tier import Tier
    from ray_ckpt.writers.part_writer import PartWriter

    mesh = _init(rank, world, os.path.join(d, "store-save"))
    state = _state(world, mesh, n, rows, True)
    part = PartWriter(Tier(os.path.join(d, "ray_ckpt"))).write_part(1, "model", rank, flatten(state, state_name="model"))
    with open(os.path.join(d, f"written{rank}.json"), "w") as f:
        json.dump({"files": [vars(x) for x in part.files], "written": part.written,
                   "shards": part.shards.to_json()}, f)
    dcp.save(state, checkpoint_id=os.path.join(d, "dcp"))
    dist.barrier()
    dist.destroy_process_group()


def _restore(rank: int, world: int, d: str, n: int, rows: int, which: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ray_ckpt.storage import sharded_io
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.storage.tier import Tier

    mesh = _init(rank, world, os.path.join(d, f"store-{which}{world}"))
    state = _state(world, mesh, n, rows, False)
    need = sum(t.to_local().numel() * 4 for t in state.values())
    tier = Tier(os.path.join(d, "ray_ckpt"))
    dist.barrier()
    r0, t0 = _rchar(), time.perf_counter()
    own = None
    if which == "ray_ckpt":
        entry = read_manifest(tier, 1).states["model"]
        rep = sharded_io.load_into_state([tier], entry, "model", state)
        own = rep.bytes
    else:
        dcp.load(state, checkpoint_id=os.path.join(d, "dcp"))
    t = time.perf_counter() - t0
    rchar = _rchar() - r0
    dist.barrier()
    total = time.perf_counter() - t0
    ok = True
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        full = torch.randn(rows, 1024, generator=g)
        local = state[f"layer{i}.weight"].to_local()
        step = -(-rows // world)
        lo = min(rank * step, rows)
        ok &= torch.equal(local, full[lo: lo + local.shape[0]])
    with open(os.path.join(d, f"result-{which}{world}-{rank}.json"), "w") as f:
        json.dump({"s": t, "wall": total, "rchar": rchar, "own": own, "need": need, "ok": bool(ok)}, f)
    dist.destroy_process_group()


def _spawn(fn, args, nprocs: int) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="state size in MB (default 1024)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--save-world", type=int, default=4)
    ap.add_argument("--to", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    rows = max(args.save_world, (args.mb << 20) // (args.tensors * 4096))
    d = args.dir or tempfile.mkdtemp(prefix="reshard_")
    os.makedirs(d, exist_ok=True)
    from ray_ckpt.coordinator.catalogue import Catalogue
    from ray_ckpt.storage.checkpoint_io import write_manifest
    from ray_ckpt.protocol import ShardRecord, WrittenPart
    from ray_ckpt.formats.manifest import FileEntry
    from ray_ckpt.storage.tier import Tier

    try:
        t0 = time.perf_counter()
        _spawn(_save, (args.save_world, d, args.tensors, rows), args.save_world)
        cat = Catalogue("bench")
        cat.declare("model", "critical", args.save_world)
        for r in range(args.save_world):
            w = json.load(open(os.path.join(d, f"written{r}.json")))
            cat.accept_push(1, 1, "model", r)
            cat.part_written(1, "model", r, WrittenPart(tuple(FileEntry(**f) for f in w["files"]), w["written"],
                                                        shards=ShardRecord.from_json(w["shards"])))
        assert cat.pending[1].error is None, cat.pending[1].error
        write_manifest(Tier(os.path.join(d, "ray_ckpt")), cat.manifest_for(1))
        total = rows * 1024 * 4 * args.tensors
        print(f"state: {args.tensors} DTensors [{rows}, 1024] float32, {total / 1e6:.0f} MB, saved by "
              f"{args.save_world} ranks (both formats) in {time.perf_counter() - t0:.1f} s")
        rows_out = []
        for world in args.to:
            for which in ("ray_ckpt", "dcp"):
                _spawn(_restore, (world, d, args.tensors, rows, which), world)
                res = [json.load(open(os.path.join(d, f"result-{which}{world}-{r}.json"))) for r in range(world)]
                rows_out.append({"restore": f"{args.save_world} -> {world}", "library": which,
                                 "seconds": max(x["wall"] for x in res),
                                 "max_rank_read_mb": max(x["rchar"] for x in res) / 1e6,
                                 "own_count_mb": None if res[0]["own"] is None else max(x["own"] for x in res) / 1e6,
                                 "need_mb": max(x["need"] for x in res) / 1e6,
                                 "read_over_need": max(x["rchar"] / x["need"] for x in res),
                                 "bit_exact": all(x["ok"] for x in res)})
        print(f"| restore | library | time (s) | read per rank, max (MB) | needed per rank (MB) | read / needed | bit-exact |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in rows_out:
            print(f"| {r['restore']} | {r['library']} | {r['seconds']:.2f} | {r['max_rank_read_mb']:.1f} | "
                  f"{r['need_mb']:.1f} | {r['read_over_need']:.3f} | {'yes' if r['bit_exact'] else 'NO'} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mb": total / 1e6, "tensors": args.tensors, "rows": rows, "results": rows_out}, f, indent=1)
        return 0 if all(r["bit_exact"] for r in rows_out) else 1
    finally:
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
