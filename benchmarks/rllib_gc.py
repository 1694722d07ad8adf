"""RLlib: what saving every iteration adds to the driver's garbage collection, and whether the
driver's objects grow with the number of saves.

    python benchmarks/rllib_gc.py [--iterations 80] [--prefill 30000] [--overlap]

One DQN Algorithm (CartPole, prioritized buffer of capacity 1M, prefilled with ``--prefill``
random timesteps: ``rllib_iteration.py``'s ``dqn`` config) per arm, each arm in a process of its
own (a full collection walks every object of its process, so the arms must not share one):

  none       no checkpointing
  ray_ckpt   ray_ckpt's callback saves every iteration; the benchmark waits, untimed, for each
             version to commit, so the writers' work falls outside the timed iterations
             (``--overlap``: it does not wait, and the writers' and coordinator's work runs
             beside the next iterations on the same cores, as in a user's run; its objects and
             collections only: the arms run one after the other, and this VM's speed moves by
             up to 1.6x between two minutes, so for the rate use ``rllib_rate.py``)

Printed per arm: the driver's objects (``len(gc.get_objects())``) every 20 iterations -- RLlib's
own episodes grow them as the buffer fills, the same in both arms; what a save keeps shows as the
difference -- the full (generation 2) collections with their pauses, the time of all collections,
and train()'s median and mean seconds (the mean carries the full collections; between two
processes run one after the other on 2 shared cores they compare two minutes of the machine, not
two arms: read the collections, not the times; ``rllib_rate.py`` measures the rate).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _arm(mode: str, iterations: int, prefill_steps: int, overlap: bool = False) -> dict:
    import gc

    import ray

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rllib_iteration as bench
    from ray_ckpt.integrations import rllib as rr

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="rllib_gc_")
    cfg = bench.dqn_config()
    if mode == "ray_ckpt":
        cfg = cfg.callbacks(rr.make_callback("rllib-gc", local_dir=root, every=1, on_busy="queue",
                                             engine_options={"critical_writers": 1, "best_effort_writers": 1}))
    algo = cfg.build_algo()
    bench.prefill(algo, prefill_steps)
    for _ in range(2):  # warm-up: the first save captures the whole buffer
        algo.train()
        if mode == "ray_ckpt":
            rr.wait_for_saves(algo, timeout=600)
    pauses = []
    started = {}

    def watch(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started["t"]))

    times, objects = [], []
    gc.callbacks.append(watch)
    try:
        for i in range(iterations):
            t0 = time.perf_counter()
            algo.train()
            times.append(time.perf_counter() - t0)
            if mode == "ray_ckpt" and not overlap:
                rr.wait_for_saves(algo, timeout=600)
            if (i + 1) % 20 == 0:
                objects.append(len(gc.get_objects()))
    finally:
        gc.callbacks.remove(watch)
    cb = rr.find_callback(algo)
    out = {"objects": objects, "full": [round(s * 1e3) for g, s in pauses if g == 2],
           "gc_ms": round(sum(s for _, s in pauses) * 1e3), "median_s": statistics.median(times),
           "mean_s": statistics.mean(times),
           "save_ms": statistics.median(cb.save_call_ms[2:]) if cb and cb.save_call_ms[2:] else None}
    algo.stop()
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--prefill", type=int, default=30_000)
    ap.add_argument("--overlap", action="store_true", help="do not wait for each version between iterations")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a process of its own
    args = ap.parse_args()
    if args.arm:
        print("RESULT " + json.dumps(_arm(args.arm, args.iterations, args.prefill, args.overlap)), flush=True)
        return
    rows = {}
    for arm in ("none", "ray_ckpt"):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, "--iterations",
                               str(args.iterations), "--prefill", str(args.prefill)]
                              + (["--overlap"] if args.overlap else []),
                              capture_output=True, text=True, timeout=3600)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
        rows[arm] = json.loads(line[len("RESULT "):])
        print(f"  {arm}: done", flush=True)
    print()
    print("| arm | objects every 20 iterations | full collections (ms each) | all collections ms "
          "| train() s median | train() s mean | callback save ms |")
    print("|---|---|---|---|---|---|---|")
    for arm, r in rows.items():
        save = f"{r['save_ms']:.1f}" if r["save_ms"] is not None else "-"
        objs = ", ".join(f"{n:,}" for n in r["objects"])
        full = ", ".join(map(str, r["full"])) or "-"
        print(f"| {arm} | {objs} | {len(r['full'])} ({full}) | {r['gc_ms']:,} | {r['median_s']:.3f} "
              f"| {r['mean_s']:.3f} | {save} |")


if __name__ == "__main__":
    main()
