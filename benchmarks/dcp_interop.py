"""``dcp.load`` through ``rc.dcp.reader`` vs ray_ckpt's own ``load_into`` vs DCP's own files.

The question: does a DCP user reading a ray_ckpt version through ``rc.dcp.reader`` pay anything
over ray_ckpt's own resharded read (same verified, ranged path underneath), and how does it
compare with ``dcp.load`` of DCP's own ``FileSystemWriter`` files of the same state?

The state and the saves are ``reshard.py``'s: ``--save-world`` gloo ranks (CPU) save ``--tensors``
DTensors ``[rows, 1024]`` float32 ``Shard(0)`` (``--mb`` MB) once with ray_ckpt's writer (the
engine's ``PartWriter`` + the catalogue's shard index and manifest; no Ray cluster) and once with
``dcp.save``. Then ``--to`` new ranks each restore their own shards three ways: ``load_into``
(``sharded_io.load_into_state``), ``dcp.load`` with ``rc.dcp.reader`` on the ray_ckpt version
(a plain process group, only the run's directory: no Ray), and ``dcp.load`` of DCP's files.
Per restore: the slowest rank's time between barriers, bytes each rank read (``rchar``: every read
syscall, counted alike for all three), what it needs, and a bit-exact check of every shard.

    python benchmarks/dcp_interop.py [--mb 256] [--tensors 8] [--to 2 3]

Files are in the page cache (no cache drop: it needs root and a quiet machine).
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import reshard  # noqa: E402  (the state, the saves, the process spawning)

WAYS = ("load_into", "rc.dcp.reader", "dcp files")


def _restore(rank: int, world: int, d: str, n: int, rows: int, which: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ray_ckpt as rc
    from ray_ckpt.storage import sharded_io
    from ray_ckpt.storage.checkpoint_io import read_manifest
    from ray_ckpt.storage.tier import Tier

    tag = which.replace(" ", "_").replace(".", "_")
    mesh = reshard._init(rank, world, os.path.join(d, f"store-{tag}{world}"))
    state = reshard._state(world, mesh, n, rows, False)
    need = sum(t.to_local().numel() * 4 for t in state.values())
    dist.barrier()
    r0, t0 = reshard._rchar(), time.perf_counter()
    if which == "load_into":
        tier = Tier(os.path.join(d, "ray_ckpt"))
        sharded_io.load_into_state([tier], read_manifest(tier, 1).states["model"], "model", state)
    elif which == "rc.dcp.reader":  # the run "ray_ckpt" under local_dir d: a plain process group, no Ray
        dcp.load(state, storage_reader=rc.dcp.reader("ray_ckpt", 1, state="model", local_dir=d))
    else:
        dcp.load(state, checkpoint_id=os.path.join(d, "dcp"))
    rchar = reshard._rchar() - r0
    dist.barrier()
    total = time.perf_counter() - t0
    ok = True
    step = -(-rows // world)
    for i in range(n):
        full = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(i))
        local = state[f"layer{i}.weight"].to_local()
        lo = min(rank * step, rows)
        ok &= torch.equal(local, full[lo: lo + local.shape[0]])
    with open(os.path.join(d, f"result-{tag}{world}-{rank}.json"), "w") as f:
        json.dump({"wall": total, "rchar": rchar, "need": need, "ok": bool(ok)}, f)
    dist.destroy_process_group()


def _commit(d: str, save_world: int) -> None:
    """The manifest of version 1 from the ranks' written parts (what the coordinator does)."""
    from ray_ckpt.coordinator.catalogue import Catalogue
    from ray_ckpt.formats.manifest import FileEntry
    from ray_ckpt.protocol import ShardRecord, WrittenPart
    from ray_ckpt.storage.checkpoint_io import write_manifest
    from ray_ckpt.storage.tier import Tier

    cat = Catalogue("ray_ckpt")
    cat.declare("model", "critical", save_world)
    for r in range(save_world):
        with open(os.path.join(d, f"written{r}.json")) as f:
            w = json.load(f)
        cat.accept_push(1, 1, "model", r)
        cat.part_written(1, "model", r, WrittenPart(tuple(FileEntry(**x) for x in w["files"]), w["written"],
                                                    shards=ShardRecord.from_json(w["shards"])))
    assert cat.pending[1].error is None, cat.pending[1].error
    write_manifest(Tier(os.path.join(d, "ray_ckpt")), cat.manifest_for(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--save-world", type=int, default=2)
    ap.add_argument("--to", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    rows = max(args.save_world, (args.mb << 20) // (args.tensors * 4096))
    d = args.dir or tempfile.mkdtemp(prefix="dcp_interop_")
    os.makedirs(d, exist_ok=True)
    try:
        t0 = time.perf_counter()
        reshard._spawn(reshard._save, (args.save_world, d, args.tensors, rows), args.save_world)
        _commit(d, args.save_world)
        total = rows * 1024 * 4 * args.tensors
        print(f"state: {args.tensors} DTensors [{rows}, 1024] float32, {total / 1e6:.0f} MB, saved by "
              f"{args.save_world} ranks (both formats) in {time.perf_counter() - t0:.1f} s")
        out = []
        for world in args.to:
            for which in WAYS:
                reshard._spawn(_restore, (world, d, args.tensors, rows, which), world)
                tag = which.replace(" ", "_").replace(".", "_")
                res = [json.load(open(os.path.join(d, f"result-{tag}{world}-{r}.json"))) for r in range(world)]
                out.append({"restore": f"{args.save_world} -> {world}", "path": which,
                            "seconds": max(x["wall"] for x in res), "read_mb": max(x["rchar"] for x in res) / 1e6,
                            "need_mb": max(x["need"] for x in res) / 1e6,
                            "read_over_need": max(x["rchar"] / x["need"] for x in res),
                            "bit_exact": all(x["ok"] for x in res)})
        print("| restore | path | time (s) | read per rank, max (MB) | needed per rank (MB) | read / needed | bit-exact |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in out:
            print(f"| {r['restore']} | {r['path']} | {r['seconds']:.2f} | {r['read_mb']:.1f} | {r['need_mb']:.1f} | "
                  f"{r['read_over_need']:.3f} | {'yes' if r['bit_exact'] else 'NO'} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mb": total / 1e6, "tensors": args.tensors, "rows": rows, "results": out}, f, indent=1)
        return 0 if all(r["bit_exact"] for r in out) else 1
    finally:
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
