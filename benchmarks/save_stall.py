"""Save stall, learner pause and time-to-durable of ray_ckpt, side by side with torch.save,
safetensors, torch DCP async_save and dd, in one run on one disk.

    python benchmarks/save_stall.py [--sizes 64,512,2048] [--dir /path/on/the/disk] [--repeats 3]

State: a model-like dict of float32 tensors (weights + two Adam moments) of the given total size.
Columns (medians over --repeats):
  save() ms        how long engine.save() takes to return to the driver
  pause ms         how long the learner actor is busy with the snapshot (a no-op call queued right
                   after the snapshot returns after this long), vs memcpy ms = one copy_ of the bytes
  durable s        save() until the local version is committed (fsynced files + manifest)
  torch.save s     torch.save + fsync of the same state, in the learner's place (it blocks)
  safetensors s    safetensors.torch.save_file + fsync
  dcp stall / s    torch.distributed.checkpoint.async_save: call return, and until its future is done
  dd s             dd bs=64M conv=fsync of the same number of bytes (the disk's sequential write floor)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import ray
import torch

import ray_ckpt as rc


def make_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 3  # weights + exp_avg + exp_avg_sq
    per = max(1, n // 8)
    sd = {}
    for i in range(8):
        for kind in ("w", "m", "v"):
            sd[f"layer{i}.{kind}"] = torch.randn(per)
    return sd


@ray.remote(num_cpus=0.5)
class Learner:
    def __init__(self, mb: int):
        torch.set_num_threads(1)
        self.sd = make_state(mb)

    def ckpt_get_state(self, name):
        return self.sd

    def ckpt_set_state(self, name, state):
        self.sd = state

    def ping(self):
        return time.perf_counter()

    def memcpy_s(self) -> float:
        dst = {k: torch.empty_like(v) for k, v in self.sd.items()}
        for k, v in self.sd.items():  # first touch of the destination pages is not part of a copy
            dst[k].copy_(v)
        t = time.perf_counter()
        for k, v in self.sd.items():
            dst[k].copy_(v)
        return time.perf_counter() - t


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def bench_torch_save(sd, d) -> float:
    p = os.path.join(d, "torch.pt")
    t = time.perf_counter()
    torch.save(sd, p)
    fsync_path(p)
    dt = time.perf_counter() - t
    os.remove(p)
    return dt


def bench_safetensors(sd, d) -> float:
    from safetensors.torch import save_file

    p = os.path.join(d, "st.safetensors")
    t = time.perf_counter()
    save_file(sd, p)
    fsync_path(p)
    dt = time.perf_counter() - t
    os.remove(p)
    return dt


def bench_dd(nbytes: int, d) -> float:
    p = os.path.join(d, "dd.bin")
    count = max(1, nbytes // (64 << 20))
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=64M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = (time.perf_counter() - t) * nbytes / (count * (64 << 20))
    os.remove(p)
    return dt


_pg_ready = False


def bench_dcp(sd, d):
    """torch DCP async_save, single rank on gloo. Returns (stall s, time to durable s) or None."""
    global _pg_ready
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if not _pg_ready:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)
            _pg_ready = True
        p = os.path.join(d, f"dcp{time.time_ns()}")
        t = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=p)
        stall = time.perf_counter() - t
        fut.result()
        durable = time.perf_counter() - t  # DCP's FileSystemWriter fsyncs its files by default
        shutil.rmtree(p, ignore_errors=True)
        return stall, durable
    except Exception as exc:  # report, don't hide
        print(f"  (dcp async_save unavailable: {exc})", file=sys.stderr)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,512,2048", help="state sizes in MB")
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_bench_")
    os.makedirs(root, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=6 << 30)
    rows = []
    try:
        for mb in [int(s) for s in args.sizes.split(",")]:
            learner = Learner.remote(mb)
            ray.get(learner.ping.remote())
            eng = rc.CheckpointEngine.create(f"bench{mb}", local_dir=os.path.join(root, "ckpt"), keep_last=1)
            eng.register("state", learner)
            stall, pause, durable, written = [], [], [], 0
            for i in range(args.repeats + 1):  # the first save warms the writers up; not counted
                base = ray.get(learner.ping.remote())
                t0 = time.perf_counter()
                h = eng.save(i + 1)
                t1 = time.perf_counter()
                after = ray.get(learner.ping.remote())
                res = h.wait(timeout=600)
                t2 = time.perf_counter()
                if i:
                    stall.append((t1 - t0) * 1e3)
                    pause.append(max(0.0, after - t0) * 1e3)
                    durable.append(t2 - t0)
                    written = res.bytes_written
            memcpy = statistics.median(ray.get(learner.memcpy_s.remote()) for _ in range(3)) * 1e3
            eng.shutdown()
            ray.kill(learner)
            sd = make_state(mb)
            nbytes = sum(v.nbytes for v in sd.values())
            ts = statistics.median(bench_torch_save(sd, root) for _ in range(args.repeats))
            st = statistics.median(bench_safetensors(sd, root) for _ in range(args.repeats))
            dcp_runs = [bench_dcp(sd, root) for _ in range(args.repeats)]
            dcp_runs = [r for r in dcp_runs if r]
            dd = statistics.median(bench_dd(nbytes, root) for _ in range(args.repeats))
            del sd
            med_d = statistics.median(durable)
            rows.append({
                "MB": mb, "save() ms": statistics.median(stall), "pause ms": statistics.median(pause),
                "memcpy ms": memcpy, "durable s": med_d, "torch.save s": ts, "safetensors s": st,
                "dcp stall ms": statistics.median(r[0] for r in dcp_runs) * 1e3 if dcp_runs else float("nan"),
                "dcp durable s": statistics.median(r[1] for r in dcp_runs) if dcp_runs else float("nan"),
                "dd s": dd, "durable/dd": med_d / dd, "torch.save/durable": ts / med_d,
                "pause/memcpy": statistics.median(pause) / memcpy if memcpy else float("nan"),
                "written MB": written / (1 << 20),
            })
            print(f"  {mb} MB done", file=sys.stderr)
    finally:
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    cols = list(rows[0].keys())
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        table.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    text = "\n".join(table)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
