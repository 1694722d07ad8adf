"""A replay buffer (a dict of equally long numpy arrays) written and read back four ways, side by
side in one run, on one disk: ray_ckpt's Arrow buffer file (``<state>/rank0.arrow``, what a buffer
state is stored as since the fifth session), ray_ckpt's safetensors file (what it was stored as
before: the same arrays nested one level down, so the buffer rule does not apply), ``np.savez``
and ``torch.save``. Ray-free: this measures the formats and the write / read paths of a writer and
a restoring actor, not the engine.

    python benchmarks/buffer_format.py --mb 1024 --repeats 3 --dir /work/bench_tmp

Every write ends with the file fsynced (ray_ckpt's writers fsync; np.savez and torch.save are
followed by an fsync of their file). Before every read the page cache is dropped when the machine
allows it (root), so reads come from the disk. Read = verified read (ray_ckpt checks the checksum)
and decode into numpy arrays that the caller may write to. Prints medians and ratios to
torch.save / torch.load.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_flat
from ray_ckpt.formats.tree import flatten
from ray_ckpt.storage.tier import Tier
from restore_read import drop_caches  # sync, then drop the page cache where allowed


def make_buffer(mb: int, seed: int = 0) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    row = 64 * 4 + 8 + 4 + 1  # obs float32[64], action int64, reward float32, done bool
    n = mb * (1 << 20) // row
    return {"obs": rng.standard_normal((n, 64), dtype=np.float32), "action": rng.integers(0, 18, n),
            "reward": rng.standard_normal(n, dtype=np.float32), "done": rng.random(n) < 0.01}


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="buffer_format_", dir=args.dir)
    state = make_buffer(args.mb)
    nbytes = sum(a.nbytes for a in state.values())
    tier = Tier(base, "local")
    version = [0]

    def ours(nested: bool) -> Callable[[], tuple]:
        def write():
            version[0] += 1
            flat = flatten({"buffer": state} if nested else state, state_name="replay")
            t = time.perf_counter()
            files = write_flat(tier, version[0], "replay", 0, flat, threads=2, direct=True)
            return time.perf_counter() - t, files

        def read(files):
            t = time.perf_counter()
            bufs, _, _ = read_files([tier], files)
            back = decode_files(files, bufs, name="replay")
            back = back["buffer"] if nested else back
            assert back["obs"].flags.writeable and np.array_equal(back["action"], state["action"])
            return time.perf_counter() - t
        return write, read

    def npz():
        path = os.path.join(base, f"npz{time.monotonic_ns()}.npz")

        def write():
            t = time.perf_counter()
            np.savez(path, **state)
            fsync_path(path)
            return time.perf_counter() - t, path

        def read(p):
            t = time.perf_counter()
            with np.load(p, allow_pickle=False) as z:
                back = {k: z[k] for k in z.files}
            assert np.array_equal(back["action"], state["action"])
            return time.perf_counter() - t
        return write, read

    def torch_save():
        path = os.path.join(base, f"pt{time.monotonic_ns()}.pt")
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}

        def write():
            t = time.perf_counter()
            torch.save(tensors, path)
            fsync_path(path)
            return time.perf_counter() - t, path

        def read(p):
            t = time.perf_counter()
            back = torch.load(p, weights_only=True)
            assert torch.equal(back["action"], tensors["action"])
            return time.perf_counter() - t
        return write, read

    methods = {"ray_ckpt buffer (Arrow IPC)": ours(False), "ray_ckpt safetensors (nested)": ours(True),
               "np.savez": npz(), "torch.save / torch.load": torch_save()}
    times: Dict[str, Dict[str, List[float]]] = {m: {"write": [], "read": []} for m in methods}
    try:
        for r in range(args.repeats):
            order = list(methods)[r % len(methods):] + list(methods)[:r % len(methods)]
            for m in order:
                write, read = methods[m]
                drop_caches()
                w, handle = write()
                drop_caches()
                times[m]["write"].append(w)
                times[m]["read"].append(read(handle))
                if isinstance(handle, str):
                    os.remove(handle)
                else:
                    shutil.rmtree(os.path.join(base, handle[0].path.split("/")[0]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ref_w = statistics.median(times["torch.save / torch.load"]["write"])
    ref_r = statistics.median(times["torch.save / torch.load"]["read"])
    print(f"replay buffer of {nbytes / 2**20:.0f} MiB ({len(state['action']):,} rows), medians of {args.repeats}")
    print(f"{'method':32} {'write+fsync s':>14} {'GB/s':>6} {'vs torch':>9} {'read s':>8} {'GB/s':>6} {'vs torch':>9}")
    for m, t in times.items():
        w, rd = statistics.median(t["write"]), statistics.median(t["read"])
        print(f"{m:32} {w:14.3f} {nbytes / w / 1e9:6.2f} {w / ref_w:8.2f}x {rd:8.3f} {nbytes / rd / 1e9:6.2f} "
              f"{rd / ref_r:8.2f}x")


if __name__ == "__main__":
    main()
