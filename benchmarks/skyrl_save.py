"""SkyRL's FSDP checkpoint save and load: ray_ckpt's RayCkptFSDPStrategy vs SkyRL's own
``FSDPStrategy.save_checkpoint`` / ``load_checkpoint``, on the same FSDP2 model (issue 48).

Ray rank actors (gloo, CPU; ``tests/skyrl_rank.py``, SkyRL's CUDA calls stood in for) build a Qwen2
(``from_config``) with SkyRL's own ``setup_distributed`` / ``prepare`` on ``--ranks`` ranks, train one
step (the AdamW state exists), save once to set the run up (not counted), then ``--repeats`` times:

* ray_ckpt: ``save_checkpoint`` on every rank; "blocks" is the longest a rank's call took,
  "committed" the time until ``wait_until_finished`` returned on every rank (written, checksummed,
  fsync'ed, manifest in, pointer and tracker written);
* SkyRL: its own ``FSDPStrategy.save_checkpoint`` of the same state (barrier, ``torch.save`` of each
  rank's model, optimizer and extra state, rank 0's config, barrier): it blocks until its files are
  written (no fsync);
* load on the same number of ranks (both: ``load_checkpoint``), and on ``--other`` ranks: ray_ckpt
  reads the same version; SkyRL's files are named by world size and cannot be loaded there.

Medians of ``--repeats``. Needs the SkyRL environment (make install-skyrl):

    .venv-skyrl/bin/python benchmarks/skyrl_save.py [--hidden 512 --layers 4 --ranks 2 --other 1
                                                     --repeats 3 --dir /tmp/skyrl_bench]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import skyrl_rank  # noqa: E402
from gloo_util import free_port  # noqa: E402

ray.cloudpickle.register_pickle_by_value(skyrl_rank)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def group(actors, n):
    port = free_port()
    ray.get([a.join.remote(r, n, port) for r, a in enumerate(actors[:n])])
    return actors[:n]


def _count(self):
    return sum(p.numel() for p in self.model.parameters())


def _timed_load(self, ckpt_dir, ours):
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy

    t0 = time.perf_counter()
    if ours:
        self.strategy.load_checkpoint(self.model, ckpt_dir, optimizer=self.opt, scheduler=self.sched)
    else:
        FSDPStrategy.load_checkpoint(self.strategy, self.model, ckpt_dir, optimizer=self.opt, scheduler=self.sched)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--other", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/skyrl_bench")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    n = max(args.ranks, args.other)
    actors = [skyrl_rank.SkyRLRank.remote() for _ in range(n)]
    size = (args.hidden, args.layers, 32000)
    ck = {"run": f"skyrl-bench-{os.getpid()}", "local_dir": os.path.join(args.dir, "local")}
    ours_root, stock_root = os.path.join(args.dir, "ours"), os.path.join(args.dir, "stock")

    rk = group(actors, args.ranks)
    ray.get([r.build.remote(ck, 0, size) for r in rk])
    ray.get([r.train.remote(1, 1) for r in rk])
    params = ray.get(rk[0].call.remote(_count))
    ray.get([r.save.remote(os.path.join(ours_root, "global_step_0", "policy")) for r in rk])  # the run's set-up
    assert ray.get([r.wait.remote(600) for r in rk]) == [None] * args.ranks

    rows = {"block": [], "committed": [], "stock": [], "load_ours": [], "load_stock": [], "load_other": []}
    for i in range(1, args.repeats + 1):
        d = os.path.join(ours_root, f"global_step_{i}", "policy")
        t0 = time.perf_counter()
        rows["block"].append(max(ray.get([r.save.remote(d) for r in rk])))
        errors = ray.get([r.wait.remote(600) for r in rk])
        rows["committed"].append(time.perf_counter() - t0)
        assert errors == [None] * args.ranks, errors
        s = os.path.join(stock_root, f"global_step_{i}", "policy")
        rows["stock"].append(max(ray.get([r.stock_save.remote(s) for r in rk])))
        rows["load_ours"].append(max(ray.get([r.call.remote(_timed_load, d, True) for r in rk])))
        rows["load_stock"].append(max(ray.get([r.call.remote(_timed_load, s, False) for r in rk])))

    other = group(actors[::-1], args.other)  # other processes first
    ray.get([r.build.remote(ck, 1, size) for r in other])
    for i in range(1, args.repeats + 1):
        d = os.path.join(ours_root, f"global_step_{i}", "policy")
        rows["load_other"].append(max(ray.get([r.call.remote(_timed_load, d, True) for r in other])))

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers: {params / 1e6:.1f} M parameters; {args.ranks} ranks, "
          f"median of {args.repeats}")
    print("| | ray_ckpt | SkyRL `FSDPStrategy` | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| `save_checkpoint` blocks a rank | {med['block']:.3f} s | {med['stock']:.3f} s | "
          f"**{med['block'] / med['stock']:.2f}x** |")
    print(f"| save to a committed version | {med['committed']:.3f} s (fsync'ed, checksummed) | "
          f"{med['stock']:.3f} s (no fsync) | {med['committed'] / med['stock']:.2f}x |")
    print(f"| load, same world size ({args.ranks} ranks) | {med['load_ours']:.3f} s | {med['load_stock']:.3f} s | "
          f"{med['load_ours'] / med['load_stock']:.2f}x |")
    print(f"| load, another world size ({args.other} rank{'s' if args.other > 1 else ''}) | {med['load_other']:.3f} s "
          f"| cannot (files named by world size) | |")
    for a in actors:
        ray.kill(a)
    ray.shutdown()


if __name__ == "__main__":
    main()
