"""Time to durable of one large state under different writer settings (A/B in one run), with
SaveResult.stages, the writers' CPU time, and dd on the same disk.

    python benchmarks/write_path.py --mb 2048 --variants 1:buffered,2:buffered,2:direct --repeats 3 \
        --dir /work/bench_tmp

A variant is ``write_threads:mode``, mode ``buffered`` (page cache, then fsync) or ``direct``
(O_DIRECT, ``EngineConfig.direct_io``). ``--table``: the state is one Arrow table of that size
(a replay buffer: float32 observations, int64 actions), registered as critical so the same writers
are compared; ``1:buffered`` then is the streamed write tables always had before the fourth
session. For each repeat every variant saves the same learner state
once, then dd writes the same bytes buffered (``conv=fsync``) and direct (``oflag=direct``); the
order rotates from repeat to repeat. The page cache is synced before each measurement, and dropped
too when the machine allows it (the VM's disk writes at a fraction of its speed for seconds after a
burst, so each one starts from the same state). Prints one table of medians: time to durable, the
writer's wait for the snapshot and its write (serialise, checksum, fsync), the CPU seconds the
critical writers used (user + system: what a save takes from training on a busy machine), and the
ratio to dd conv=fsync.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

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


def _cpu_s(_actor: Any = None) -> float:
    t = os.times()
    return t.user + t.system  # this process; runs in a writer through __ray_call__


def writers_cpu(handles: List[Any]) -> float:
    return sum(ray.get([h.__ray_call__.remote(_cpu_s) for h in handles], timeout=60))


@ray.remote(num_cpus=0.5)
class TableLearner:
    def __init__(self, mb: int):
        import numpy as np
        import pyarrow as pa

        n = (mb << 20) // 12
        rng = np.random.default_rng(0)
        self.table = pa.table({"obs": rng.standard_normal(n, dtype=np.float32),
                               "act": rng.integers(0, 1 << 40, n, dtype=np.int64)})

    def ckpt_get_state(self, name):
        return {"replay": self.table}

    def ping(self):
        return time.perf_counter()


def parse_variants(text: str) -> List[Dict[str, Any]]:
    out = []
    for item in text.split(","):
        threads, _, mode = item.partition(":")
        if mode not in ("buffered", "direct"):
            raise SystemExit(f"variant {item!r}: expected THREADS:buffered or THREADS:direct")
        out.append({"label": item, "write_threads": int(threads), "direct_io": mode == "direct"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=2048)
    ap.add_argument("--variants", default="1:buffered,2:buffered,2:direct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--table", action="store_true", help="the state is one Arrow table (a replay buffer)")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_wp_")
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": HERE}})
    learner = (TableLearner if args.table else ss.Learner).remote(args.mb)
    ray.get(learner.ping.remote())
    nbytes = args.mb << 20
    engines, writers = {}, {}
    for i, v in enumerate(variants):
        eng = rc.CheckpointEngine.create(f"wp{i}", local_dir=os.path.join(root, "ckpt"), keep_last=1,
                                         write_threads=v["write_threads"], direct_io=v["direct_io"])
        eng.register("state", learner)
        eng.save(eng.current_step + 1).wait(timeout=600)  # warm-up, not counted
        engines[v["label"]] = eng
        writers[v["label"]] = ray.get(eng._coordinator.writers.remote(), timeout=60)["critical"]
    labels = [v["label"] for v in variants] + ["dd conv=fsync", "dd oflag=direct"]
    m: Dict[str, Dict[str, List[float]]] = {k: {"total": [], "wait": [], "write": [], "cpu": []} for k in labels}
    for i in range(args.repeats):
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        for label in order:
            settle()
            if label.startswith("dd"):
                flag = "direct" if "direct" in label else None
                m[label]["total"].append(ss.bench_dd(nbytes, root, oflag=flag))
                continue
            eng = engines[label]
            cpu0 = writers_cpu(writers[label])
            t = time.perf_counter()
            r = eng.save(eng.current_step + 1).wait(timeout=600)
            m[label]["total"].append(time.perf_counter() - t)
            m[label]["cpu"].append(writers_cpu(writers[label]) - cpu0)
            m[label]["wait"].append(r.stages.get("snapshot_wait_s", float("nan")))
            m[label]["write"].append(r.stages.get("write_s", float("nan")))
    for eng in engines.values():
        eng.shutdown()
    ray.shutdown()

    def med(label: str, key: str) -> float:
        xs = m[label][key]
        return statistics.median(xs) if xs else float("nan")

    dd = med("dd conv=fsync", "total")
    print(f"{args.mb} MB {'Arrow table' if args.table else 'state'}, {args.repeats} repeats (medians)\n")
    print("| write_threads:mode | time to durable s | snapshot wait s | write s | writer CPU s | vs dd conv=fsync |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        print(f"| {label} | {med(label, 'total'):.3f} | {med(label, 'wait'):.3f} | {med(label, 'write'):.3f} | "
              f"{med(label, 'cpu'):.2f} | {med(label, 'total') / dd:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
