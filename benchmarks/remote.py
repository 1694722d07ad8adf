"""Upload throughput of a ~1 GB version to a real S3-compatible server (SeaweedFS, started here on
127.0.0.1) against raw pyarrow S3FileSystem writes of the same bytes to the same server, in one run.

    python benchmarks/remote.py [--mb 1024] [--states 2] [--repeats 2] [--out benchmarks/RESULTS.md]

ours:  time from the local commit (h.wait()) to the remote commit (h.wait(durability="remote")):
       the coordinator uploads the committed local files (checksummed while streaming) and PUTs the
       manifest last.
raw:   the same number of objects of the same sizes written from memory with
       fs.open_output_stream(...).write(...) one after the other: the store's own write floor.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import ray
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import ray_ckpt as rc  # noqa: E402
from s3server import S3Server  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--states", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="rc_remote_bench_")
    srv = S3Server(os.path.join(root, "s3")).start()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=4 << 30)
    try:
        per = args.mb * (1 << 20) // args.states
        states = {f"s{i}": {"w": torch.randint(0, 255, (per,), dtype=torch.uint8)} for i in range(args.states)}
        eng = rc.CheckpointEngine.create("bench", local_dir=os.path.join(root, "local"),
                                         remote_uri=srv.uri("runs"), remote_options=srv.options, keep_last=1)
        for name, st in states.items():
            eng.register(name, (lambda st=st: st), loader=lambda s: None)
        ours = []
        for i in range(args.repeats):
            h = eng.save(i + 1)
            h.wait(timeout=600)
            t = time.perf_counter()
            h.wait(timeout=1200, durability="remote")
            ours.append(time.perf_counter() - t)
        eng.shutdown()
        fs = srv.filesystem()
        raw = []
        for i in range(args.repeats):
            t = time.perf_counter()
            for name, st in states.items():
                with fs.open_output_stream(f"{srv.bucket}/raw/{i}/{name}.bin") as out:
                    mv = memoryview(st["w"].numpy())
                    for off in range(0, len(mv), 16 << 20):
                        out.write(mv[off: off + (16 << 20)])
            raw.append(time.perf_counter() - t)
        nbytes = args.mb * (1 << 20)
        o, r = statistics.median(ours), statistics.median(raw)
        rows = [("ray_ckpt upload (local commit -> remote commit)", o, nbytes / o / 1e6),
                ("raw pyarrow S3FileSystem writes, same bytes", r, nbytes / r / 1e6)]
        lines = ["| what | seconds | MB/s |", "|---|---|---|"]
        lines += [f"| {n} | {s:.2f} | {bw:.0f} |" for n, s, bw in rows]
        lines.append(f"| **ratio ours/raw (throughput)** | | **{r / o:.2f}x** |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")
    finally:
        ray.shutdown()
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
