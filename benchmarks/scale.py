"""One coordinator, many ranks (issue 15): simulated ranks pushed from K host actors (ranks share
processes as they share nodes), for each (ranks, states, tensor size) of the sweep:

- push_s        the slowest host's time to call submit() for all its ranks and states
- commit_s      time from the last push returning to the version's commit being seen by a host
- cpu_ms/part   coordinator CPU seconds (its process, all threads) from before the first push to
                the commit, divided by the number of parts
- manifest      manifest.json bytes, and the median time to parse it (Manifest.from_json)
- list_ms       list_checkpoints() latency (median / 90th percentile / max) from the driver while
                the pushes arrive and until the commit
- store_mb      object-store peak in use during the version (cluster total minus
                ray.available_resources()["object_store_memory"], polled with the list calls)
- load_ms       engine.load() of one rank's part of every state (the manifest fetched once per call)

    python benchmarks/scale.py --ranks 64,256,1024 --states 2 --kb 1 --hosts 4

Each configuration runs on a fresh run (its own coordinator and 2 critical writers) in a temp
directory on the local disk, one version per configuration. Tensors are float32 filled per rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import ray

import ray_ckpt as rc
from ray_ckpt.ray_internals import actor_ready
from ray_ckpt.protocol import NAMESPACE, actor_name
from ray_ckpt.formats.manifest import Manifest
from ray_ckpt.storage.layout import version_dir


class Host:
    """A process holding ``ranks``: one engine, a submit() per rank and state."""

    def __init__(self, run: str, ranks, names, nbytes: int):
        self.run, self.ranks, self.names = run, list(ranks), list(names)
        self.n = max(1, nbytes // 4)
        self.engine = None
        self.handles = []

    def push(self, step: int):
        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        t0 = time.time()
        for r in self.ranks:
            for i, name in enumerate(self.names):
                state = {"w": np.full(self.n, r * 100 + i, np.float32)}
                self.handles.append(self.engine.submit(step, name, state, rank=r))
        return t0, time.time()

    def wait(self, timeout: float):
        self.handles[-1].wait(timeout=timeout)  # one shared wait call per version in this process
        t = time.time()
        for h in self.handles:
            h.wait(timeout=timeout)
        self.handles = []
        return t

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def one(ranks: int, states: int, kb: int, hosts: int, base: str, timeout: float) -> dict:
    run = f"scale{ranks}x{states}x{kb}k{os.getpid()}"
    names = [f"s{i}" for i in range(states)]
    eng = rc.CheckpointEngine.create(run, local_dir=base, critical_writers=2, best_effort_writers=0,
                                     keep_last=2, rank_timeout_s=max(600.0, timeout))
    try:
        for n in names:
            eng.register(n, world_size=ranks)
        coord = ray.get_actor(actor_name(run), namespace=NAMESPACE)
        per = -(-ranks // hosts)
        actors = [ray.remote(num_cpus=0.05)(Host).remote(run, range(h * per, min(ranks, (h + 1) * per)), names,
                                                         kb * 1024)
                  for h in range(hosts) if h * per < ranks]
        ray.get([actor_ready(a) for a in actors])
        cpu0 = ray.get(coord.cpu_seconds.remote())
        counts0 = ray.get(coord.call_counts.remote())
        store_total = ray.cluster_resources().get("object_store_memory", 0.0)
        peak = [0.0]

        def poll(refs):  # list_checkpoints() latency and object-store use until ``refs`` are ready
            while len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                t = time.perf_counter()
                eng.list_checkpoints()
                lat.append(time.perf_counter() - t)
                peak[0] = max(peak[0], store_total - ray.available_resources().get("object_store_memory", store_total))
                time.sleep(0.05)

        pushes = [a.push.remote(1) for a in actors]
        lat = []
        poll(pushes)
        spans = ray.get(pushes)
        waits = [a.wait.remote(timeout) for a in actors]
        poll(waits)  # and until the commit
        committed_at = min(ray.get(waits))
        cpu1 = ray.get(coord.cpu_seconds.remote())
        counts = {k: v - counts0.get(k, 0) for k, v in ray.get(coord.call_counts.remote()).items()}
        first_push, last_push = min(s[0] for s in spans), max(s[1] for s in spans)
        path = os.path.join(base, run, version_dir(1), "manifest.json")
        raw = open(path, "rb").read()
        parse = []
        for _ in range(3):
            t = time.perf_counter()
            m = Manifest.from_json(raw)
            parse.append(time.perf_counter() - t)
        assert sum(len(e.files) for e in m.states.values()) == ranks * states
        t = time.perf_counter()
        for n in names:
            got = eng.load(n, step=1, rank=ranks - 1)
        load_s = time.perf_counter() - t
        assert float(got["w"][0]) == (ranks - 1) * 100 + states - 1
        ray.get([a.shutdown.remote() for a in actors])
        for a in actors:
            ray.kill(a)
        return {"ranks": ranks, "states": states, "parts": ranks * states, "kb": kb,
                "push_s": max(s[1] - s[0] for s in spans), "commit_s": committed_at - last_push,
                "total_s": committed_at - first_push, "cpu_ms_part": 1000 * (cpu1 - cpu0) / (ranks * states),
                "manifest_kb": len(raw) / 1024, "parse_ms": 1000 * statistics.median(parse),
                "list_p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
                "list_p90_ms": 1000 * sorted(lat)[int(0.9 * (len(lat) - 1))] if lat else float("nan"),
                "list_max_ms": 1000 * max(lat) if lat else float("nan"), "list_n": len(lat),
                "store_mb": peak[0] / 2**20,
                "in_calls": counts["submit_calls"], "parts_per_in": counts["pushed_parts"] / max(1, counts["submit_calls"]),
                "parts_per_write": counts["written_parts"] / max(1, counts["write_calls"]),
                "load_ms": 1000 * load_s}
    finally:
        eng.shutdown(timeout=120)
        shutil.rmtree(os.path.join(base, run), ignore_errors=True)


COLS = [("ranks", "{:>6}"), ("states", "{:>6}"), ("parts", "{:>6}"), ("kb", "{:>5}"), ("push_s", "{:>7.2f}"),
        ("commit_s", "{:>8.2f}"), ("total_s", "{:>7.2f}"), ("cpu_ms_part", "{:>11.3f}"),
        ("manifest_kb", "{:>11.0f}"), ("parse_ms", "{:>8.1f}"), ("list_p50_ms", "{:>11.1f}"),
        ("list_p90_ms", "{:>11.1f}"), ("list_max_ms", "{:>11.1f}"), ("list_n", "{:>6}"), ("store_mb", "{:>8.1f}"),
        ("load_ms", "{:>7.1f}"), ("in_calls", "{:>8}"), ("parts_per_in", "{:>12.1f}"), ("parts_per_write", "{:>15.1f}")]


def row(r: dict) -> str:
    return "| " + " | ".join(f.format(r[c]) for c, f in COLS) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096", help="comma-separated world sizes")
    ap.add_argument("--states", default="2,8", help="comma-separated numbers of pushed states per rank")
    ap.add_argument("--kb", default="1,1024", help="comma-separated tensor sizes in KiB (one tensor per part)")
    ap.add_argument("--hosts", type=int, default=4, help="host actors the ranks are spread over")
    ap.add_argument("--timeout", type=float, default=900.0, help="per configuration, seconds")
    ap.add_argument("--dir", default=None, help="where the local tier goes (default: a temp dir)")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    base = tempfile.mkdtemp(prefix="scale_", dir=args.dir)
    print(f"{os.cpu_count()} CPUs, {args.hosts} host actors, local tier under {base}")
    print("| " + " | ".join(c for c, _ in COLS) + " |")
    print("|" + "|".join("---" for _ in COLS) + "|")
    try:
        for kb in (int(x) for x in args.kb.split(",")):
            for states in (int(x) for x in args.states.split(",")):
                for ranks in (int(x) for x in args.ranks.split(",")):
                    print(row(one(ranks, states, kb, args.hosts, base, args.timeout)), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        ray.shutdown()


if __name__ == "__main__":
    main()
