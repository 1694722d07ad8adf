"""The learner's pause for one snapshot, by state size, on a fresh object store with and without
Ray's pre-populated object-store memory (``RAY_preallocate_plasma_memory=1``), and with the
learner's view of the store mapped first (the engine's ``prefault_object_store=True``), in one run.

    python benchmarks/snapshot_pause.py [--sizes 64,512] [--saves 8] [--store-gb 4]

Each save snapshots the learner's state the way the engine does (``snapshot_in_actor`` through
``__ray_call__``) and the time until a no-op call queued behind it runs is taken; the object is
then dropped, so the next save lands on object-store pages the learner has not touched yet (what
the first saves of a run see; once the engine's saves cycle through the same memory, the pause is
close to one memcpy: see the suite's learner-pause rows). memcpy ms is one copy_ of the state into
a preallocated buffer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402

import save_stall as ss  # noqa: E402
from ray_ckpt.capture.object_store import prefault_in_actor  # noqa: E402
from ray_ckpt.capture.snapshot import snapshot_in_actor  # noqa: E402


def measure(sizes, saves: int, prefault: bool = False) -> dict:
    out = {}
    for mb in sizes:
        learner = ss.Learner.remote(mb)
        ray.get(learner.ping.remote())
        if prefault:  # what register() starts in the background; here waited for, and timed
            st = ray.get(learner.__ray_call__.remote(prefault_in_actor, 600))
            print(f"  prefault ({mb} MB learner): {st['bytes_done'] >> 20} of {st['total_bytes'] >> 20} MiB "
                  f"in {st['seconds']:.2f} s{'; ' + st['error'] if st['error'] else ''}", file=sys.stderr)
        pauses = []
        for _ in range(saves):
            t0 = time.perf_counter()
            ref = learner.__ray_call__.remote(snapshot_in_actor, "ckpt_get_state", "state", False)
            after = ray.get(learner.ping.remote())
            pauses.append(after - t0)
            ray.get(ref)
            del ref
        memcpy = ray.get(learner.memcpy_s.remote())
        out[mb] = (statistics.median(pauses) * 1e3, memcpy * 1e3)
        ray.kill(learner)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--store-gb", type=float, default=4)
    ap.add_argument("--plasma-dir", default=None,
                    help="also measure with the object store on this directory (e.g. a tmpfs mounted "
                         "with huge=always), fresh")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    settings = ["fresh", "preallocated", "prefaulted"] + (["plasma dir"] if args.plasma_dir else [])
    runs: dict = {k: [] for k in settings}
    for setting in settings + settings[::-1]:  # ABBA: no setting always runs first
        os.environ["RAY_preallocate_plasma_memory"] = "1" if setting == "preallocated" else "0"
        extra = {"_plasma_directory": args.plasma_dir} if setting == "plasma dir" else {}
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 object_store_memory=int(args.store_gb * (1 << 30)),
                 runtime_env={"env_vars": {"PYTHONPATH": HERE}}, **extra)
        runs[setting].append(measure(sizes, args.saves, prefault=setting == "prefaulted"))
        ray.shutdown()
    results = {k: {mb: tuple(statistics.mean(r[mb][i] for r in v) for i in range(2)) for mb in sizes}
               for k, v in runs.items()}
    print(f"{args.saves} snapshots per size (median), mean of two Ray instances per setting (ABBA); "
          f"object store {args.store_gb:g} GiB\n")
    print("| MB | object store | pause ms | memcpy ms | pause / memcpy |")
    print("|---|---|---|---|---|")
    for mb in sizes:
        for k in settings:
            pause, memcpy = results[k][mb]
            label = f"{k} ({args.plasma_dir})" if k == "plasma dir" else k
            print(f"| {mb} | {label} | {pause:.1f} | {memcpy:.1f} | {pause / memcpy:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
