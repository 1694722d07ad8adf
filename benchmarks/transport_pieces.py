"""How a snapshot's arrays travel into Ray's object store: whole, or (up to SPLIT_UP_TO) as 1 MiB
pieces. Side by side in one run, the learner actor's view of the object store mapped first (so page
faults do not hide the difference):

    python benchmarks/transport_pieces.py [--layouts 64:2,512:4,512:32,2048:8] [--repeats 7]

1. Ray's copy itself: ray.put of 64 buffers of exactly 1 MiB (one memcpy each) against 64 of
   1 MiB + 64 bytes (each copied by threads Ray starts for it), and a memcpy of the same bytes.
2. The learner's pause for a state of MB megabytes made of tensors of T MB each (layout MB:T), as
   the engine takes it (``snapshot_in_actor``, then a no-op call queued behind it), with the arrays
   in pieces (the engine) and whole (``SPLIT_UP_TO = 0`` in the learner process), against one
   memcpy of the state.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import ray
import torch

from ray_ckpt.capture.object_store import prefault_in_actor
from ray_ckpt.capture.snapshot import snapshot_in_actor


@ray.remote(num_cpus=0.5)
class Learner:
    def __init__(self, mb: int, tensor_mb: float):
        torch.set_num_threads(1)
        per = int(tensor_mb * (1 << 20)) // 4
        n = max(1, mb * (1 << 20) // 4 // per)
        self.sd = {f"layer{i}": torch.randn(per) for i in range(n)}

    def ckpt_get_state(self, name):
        return self.sd

    def ping(self):
        return time.perf_counter()

    def set_split(self, up_to: int) -> None:
        from ray_ckpt.formats import flat

        flat.SPLIT_UP_TO = up_to

    def memcpy_ms(self) -> float:
        dst = {k: torch.empty_like(v) for k, v in self.sd.items()}
        for k, v in self.sd.items():
            dst[k].copy_(v)
        t = time.perf_counter()
        for k, v in self.sd.items():
            dst[k].copy_(v)
        return (time.perf_counter() - t) * 1e3

    def put_ms(self, n: int, size: int, repeats: int) -> float:
        bufs = [np.full(size, i, dtype=np.uint8) for i in range(n)]
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            ref = ray.put(bufs)
            out.append((time.perf_counter() - t) * 1e3)
            del ref
        return statistics.median(out[1:])


def pause_ms(learner, saves: int) -> float:
    rtt = statistics.median(_rtt(learner) for _ in range(5))
    out = []
    for _ in range(saves):
        t0 = time.perf_counter()
        ref = learner.__ray_call__.remote(snapshot_in_actor, "ckpt_get_state", "state", False)
        after = ray.get(learner.ping.remote())
        out.append((after - t0 - rtt / 2) * 1e3)
        ray.get(ref)  # the writer's side: fetch it, then drop it
        del ref
    return statistics.median(out[1:])


def _rtt(learner) -> float:
    t = time.perf_counter()
    ray.get(learner.ping.remote())
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="64:2,512:4,512:32,2048:8", help="MB:tensor MB, comma separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--store-gb", type=float, default=6)
    args = ap.parse_args(argv)
    from ray_ckpt.formats.flat import SPLIT_UP_TO

    layouts = [(int(a), float(b)) for a, b in (x.split(":") for x in args.layouts.split(","))]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(args.store_gb * (1 << 30)))
    try:
        probe = Learner.remote(1, 1)
        ray.get(probe.__ray_call__.remote(prefault_in_actor, 600))
        exact = ray.get(probe.put_ms.remote(64, 1 << 20, args.repeats))
        over = ray.get(probe.put_ms.remote(64, (1 << 20) + 64, args.repeats))
        ray.kill(probe)
        print("ray.put of 64 buffers (learner's view of the object store mapped first):\n")
        print("| buffers | put ms |\n|---|---|")
        print(f"| 64 x 1 MiB (one memcpy each) | {exact:.1f} |")
        print(f"| 64 x (1 MiB + 64 B) (threads started per buffer) | {over:.1f} |\n")

        print(f"Learner pause per snapshot, median of {args.repeats - 1} (first dropped); pieces: arrays "
              f"up to {SPLIT_UP_TO >> 20} MiB travel as 1 MiB pieces (the engine); whole: as one buffer each\n")
        print("| state MB | tensor MB | tensors | memcpy ms | pause, pieces ms | pause, whole ms | pieces / whole |")
        print("|---|---|---|---|---|---|---|")
        for mb, tmb in layouts:
            learner = Learner.remote(mb, tmb)
            ray.get(learner.__ray_call__.remote(prefault_in_actor, 600))
            n = len(ray.get(learner.ckpt_get_state.remote("state")))
            res = {"pieces": [], "whole": []}
            for setting in ("pieces", "whole", "whole", "pieces"):  # ABBA
                ray.get(learner.set_split.remote(SPLIT_UP_TO if setting == "pieces" else 0))
                res[setting].append(pause_ms(learner, args.repeats))
            memcpy = statistics.median(ray.get(learner.memcpy_ms.remote()) for _ in range(3))
            p, w = statistics.mean(res["pieces"]), statistics.mean(res["whole"])
            print(f"| {mb} | {tmb:g} | {n} | {memcpy:.1f} | {p:.1f} | {w:.1f} | {p / w:.2f}x |")
            ray.kill(learner)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
