"""Time to durable of one large state by ``write_threads`` (A/B in one run), with SaveResult.stages.

    python benchmarks/write_threads.py --mb 2048 --threads 1,2 --repeats 3 --dir /work/bench_tmp

For each repeat, every thread count saves the same learner state once (order alternating); the page
cache is synced before each save, and dropped too when the machine allows it (the VM's disk writes
at a fraction of its speed for seconds after a burst, so each save starts from the same state).
Prints one table: median time to durable, the writer's wait for the snapshot and its write (serialise,
checksum, fsync), and the ratio to the first thread count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402

import ray_ckpt as rc  # noqa: E402
import save_stall as ss  # noqa: E402


def settle() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.threads.split(",")]
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_wt_")
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": HERE}})
    learner = ss.Learner.remote(args.mb)
    ray.get(learner.ping.remote())
    engines = {}
    for n in counts:
        eng = rc.CheckpointEngine.create(f"wt{n}", local_dir=os.path.join(root, "ckpt"), keep_last=1,
                                         write_threads=n)
        eng.register("state", learner)
        eng.save(eng.current_step + 1).wait(timeout=600)  # warm-up, not counted
        engines[n] = eng
    m = {n: {"total": [], "wait": [], "write": []} for n in counts}
    for i in range(args.repeats):
        for n in (counts if i % 2 == 0 else counts[::-1]):
            eng = engines[n]
            settle()
            t = time.perf_counter()
            r = eng.save(eng.current_step + 1).wait(timeout=600)
            m[n]["total"].append(time.perf_counter() - t)
            m[n]["wait"].append(r.stages.get("snapshot_wait_s", float("nan")))
            m[n]["write"].append(r.stages.get("write_s", float("nan")))
    for eng in engines.values():
        eng.shutdown()
    ray.shutdown()
    base = statistics.median(m[counts[0]]["total"])
    print(f"{args.mb} MB state, {args.repeats} repeats (medians)\n")
    print("| write_threads | time to durable s | snapshot wait s | write s | vs write_threads=%d |" % counts[0])
    print("|---|---|---|---|---|")
    for n in counts:
        med = {k: statistics.median(v) for k, v in m[n].items()}
        print(f"| {n} | {med['total']:.3f} | {med['wait']:.3f} | {med['write']:.3f} | "
              f"{med['total'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
