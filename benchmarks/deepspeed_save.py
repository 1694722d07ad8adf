"""OpenRLHF's DeepSpeed checkpoint save and load: ray_ckpt's RayCkptDeepspeedStrategy vs OpenRLHF's
stock DeepspeedStrategy (``engine.save_checkpoint``), on the same ZeRO model (issue 30).

Ray rank actors (gloo, CPU; ``tests/openrlhf_rank.py``) build a Qwen2 (``from_config``) with
OpenRLHF's own ``prepare`` at ``--stage``, train one step (the Adam state exists), then,
``--repeats`` times each:

* ray_ckpt: ``save_ckpt`` on every rank; "blocks" is the longest a rank's call took, "durable" the
  time until ``wait_until_finished`` returned on every rank (the version committed on the local
  tier: written, checksummed, fsync'ed, manifest renamed in, ``latest`` written). The first save
  of a run is not counted there: it has its own row, "first save_ckpt of a run blocks a rank"
  (the longest rank's call, against stock's first save);
* stock: ``save_ckpt`` on every rank (rotation, barrier, DeepSpeed's ``torch.save`` of every
  rank's partition and rank 0's module): it blocks until its files are written (no fsync);
* "save + next step": ``save_ckpt`` and at once one training step, the longest rank's sum, against
  one step alone (median of ``--repeats``). With ray_ckpt's ``overlap`` the partition's copy runs
  beside the step's forward and backward and its optimizer step waits for what is left of it (the
  fence): this row says what a save costs the training loop, the copy included;
* load on the same number of ranks (both), and on ``--other`` ranks: ray_ckpt reads the same
  version; stock needs DeepSpeed's offline ``ds_to_universal`` conversion first (timed) and then
  loads with ``checkpoint.load_universal`` (OpenRLHF's ``--ds.use_universal_ckpt``).

    python benchmarks/deepspeed_save.py [--stage 2 --hidden 512 --layers 4 --ranks 2 --other 1
                                         --repeats 3 --dir /tmp/ds_bench] [--prefault] [--driver-creates]

``--driver-creates``: the driver creates the runs before the ranks start, and the ranks only
connect (``--ray_ckpt.local_dir`` unset): what the first save costs then.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import openrlhf_rank  # noqa: E402
from gloo_util import free_port  # noqa: E402

ray.cloudpickle.register_pickle_by_value(openrlhf_rank)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def group(actors, n):
    port = free_port()
    ray.get([a.join.remote(r, n, port) for r, a in enumerate(actors[:n])])
    return actors[:n]


def timed_save(rk, d, tag, ours):
    t0 = time.perf_counter()
    blocks = ray.get([r.save.remote(d, tag, {"consumed_samples": 1}) for r in rk])
    if ours:
        errors = ray.get([r.wait.remote(600) for r in rk])
        assert errors == [None] * len(rk), errors
    return max(blocks), time.perf_counter() - t0


def _save_then_step(self, d, tag, step):
    """In a rank: (save_ckpt's block, the next training step's time, what its fence waited)."""
    from ray_ckpt.capture.overlap import process_copier

    copier = process_copier()
    before = len(copier.fence_waits) if copier is not None else 0
    t0 = time.perf_counter()
    self.strategy.save_ckpt(self.model, d, tag, client_state={"consumed_samples": 1})
    t1 = time.perf_counter()
    self.train(step, 1)
    t2 = time.perf_counter()
    copier = process_copier()
    return t1 - t0, t2 - t1, sum(copier.fence_waits[before:]) if copier is not None else 0.0


def _step(self, step):
    t0 = time.perf_counter()
    self.train(step, 1)
    return time.perf_counter() - t0


def save_and_step(rk, d, ours, repeats, first):
    """Median over ``repeats`` of the longest rank's save_ckpt + next step, of its fence wait, and
    of one step alone; ``first`` is the first step number used (each save is waited for)."""
    totals, fences, alone = [], [], []
    if ours:  # warm-up: the first save of this run creates it
        ray.get([r.call.remote(_save_then_step, d, f"global_step{first}", first) for r in rk])
        assert ray.get([r.wait.remote(600) for r in rk]) == [None] * len(rk)
    for i in range(repeats):
        step = first + 1 + 2 * i
        alone.append(max(ray.get([r.call.remote(_step, step) for r in rk])))
        out = ray.get([r.call.remote(_save_then_step, d, f"global_step{step + 1}", step + 1) for r in rk])
        totals.append(max(b + s for b, s, _ in out))
        fences.append(max(f for _, _, f in out))
        if ours:
            assert ray.get([r.wait.remote(600) for r in rk]) == [None] * len(rk)
    return statistics.median(totals), statistics.median(fences), statistics.median(alone)


def timed_load(rk, d, tag=None):
    t0 = time.perf_counter()
    out = ray.get([r.load.remote(d, tag) for r in rk])
    errors = [x for x in out if isinstance(x, str)]
    assert not errors, errors
    return time.perf_counter() - t0


def state_bytes(rk):
    def count(self):
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.model.module.parameters())
    return ray.get(rk[0].call.remote(count))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--other", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ds_bench")
    ap.add_argument("--prefault", action="store_true", help="create the run with prefault_object_store=True")
    ap.add_argument("--driver-creates", action="store_true",
                    help="create the runs in this driver first; the ranks only connect (no --ray_ckpt.local_dir)")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    ray.init(address="local", num_cpus=max(4, a.ranks + 2), include_dashboard=False, log_to_driver=False)
    n = max(a.ranks, a.other)
    actors = [openrlhf_rank.DSRank.remote() for _ in range(n)]
    ray.get([x.pid.remote() for x in actors])
    ck = {"run": "dsbench", "local_dir": os.path.join(a.dir, "local")}
    if a.prefault:
        ck["engine_options"] = {"prefault_object_store": True}
    if a.driver_creates:
        import ray_ckpt as rc

        options = dict(ck.get("engine_options", {}), local_dir=ck.pop("local_dir"))
        ck.pop("engine_options", None)
        for role in ("actor", "steps"):  # the runs of ours_dir and of save_and_step's folder
            rc.CheckpointEngine.create(f"{ck['run']}-{role}", **options)
    ours_dir, stock_dir = os.path.join(a.dir, "ours", "_actor"), os.path.join(a.dir, "stock", "_actor")
    rows = {}

    rk = group(actors, a.ranks)
    ray.get([r.build.remote(a.stage, ck, 0, a.hidden, a.layers) for r in rk])
    params = state_bytes(rk)
    ray.get([r.train.remote(1, 1) for r in rk])
    first = timed_save(rk, ours_dir, "global_step1", True)  # the run's first save: its own row
    ours = [timed_save(rk, ours_dir, f"global_step{i + 2}", True) for i in range(a.repeats)]
    last = f"global_step{a.repeats + 1}"
    ours_step = save_and_step(rk, os.path.join(a.dir, "ours", "_steps"), True, a.repeats, 100)
    rk = group(actors, a.ranks)
    ray.get([r.build.remote(a.stage, None, 0, a.hidden, a.layers) for r in rk])
    ray.get([r.train.remote(1, 1) for r in rk])
    stock = [timed_save(rk, stock_dir, f"global_step{i + 2}", False) for i in range(a.repeats)]
    stock_step = save_and_step(rk, os.path.join(a.dir, "stock", "_steps"), False, a.repeats, 100)
    rows["first save_ckpt of a run blocks a rank"] = (first[0], stock[0][0])
    rows["save_ckpt blocks a rank"] = (statistics.median(b for b, _ in ours), statistics.median(b for b, _ in stock))
    rows["save to durable"] = (statistics.median(d for _, d in ours), statistics.median(d for _, d in stock))
    rows[f"save + next step (step alone: {ours_step[2]:.3f} s / {stock_step[2]:.3f} s; "
         f"fence waited {ours_step[1]:.3f} s)"] = (ours_step[0], stock_step[0])

    loads = {"ours": [], "stock": []}
    for _ in range(a.repeats):
        for name, settings, d in (("ours", ck, ours_dir), ("stock", None, stock_dir)):
            rk = group(actors, a.ranks)
            ray.get([r.build.remote(a.stage, settings, 1, a.hidden, a.layers) for r in rk])
            loads[name].append(timed_load(rk, d, last))
    rows[f"load, same size ({a.ranks} ranks)"] = (statistics.median(loads["ours"]), statistics.median(loads["stock"]))

    rk = group(actors, a.other)
    ray.get([r.build.remote(a.stage, ck, 1, a.hidden, a.layers) for r in rk])
    other = timed_load(rk, ours_dir, last)
    conv, stock_other = None, None
    try:
        t0 = time.perf_counter()
        # as OpenRLHF's examples/scripts/ckpt_ds_zero_to_universal.sh runs it
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
                        "--input_folder", os.path.join(stock_dir, last),
                        "--output_folder", os.path.join(stock_dir, last + "_uni")],
                       check=True, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        conv = time.perf_counter() - t0
        with open(os.path.join(stock_dir, "latest_universal"), "w") as f:
            f.write(last + "_uni")
    except subprocess.CalledProcessError as exc:
        print("ds_to_universal failed:", (exc.stderr or "")[-600:])
    if conv is not None:
        try:
            rk = group(actors, a.other)
            ray.get([r.build.remote(a.stage, None, 1, a.hidden, a.layers, {"use_universal_ckpt": True}) for r in rk])
            stock_other = timed_load(rk, stock_dir, last + "_uni")
        except Exception as exc:  # reported in the table, not hidden
            print("stock universal load failed:", str(exc)[-600:])
    rows[f"load, other size ({a.other} rank{'s' * (a.other > 1)})"] = (other, (conv, stock_other))

    mb = params * 14 / 1e6  # fp32 master + 2 Adam moments + 16-bit weights
    print(f"\nZeRO-{a.stage}, {a.ranks} ranks, Qwen2 hidden {a.hidden} x {a.layers} layers: {params / 1e6:.1f} M "
          f"parameters, {mb:.0f} MB of state (fp32 + Adam moments + bf16); median of {a.repeats}")
    print("| | ray_ckpt RayCkptDeepspeedStrategy | OpenRLHF stock DeepspeedStrategy | ratio |")
    print("| --- | --- | --- | --- |")
    for k, (o, s) in rows.items():
        if isinstance(s, tuple):
            conv, load = s
            cell = "conversion failed" if conv is None else \
                f"{conv:.3f} s conversion + {'load failed' if load is None else f'{load:.3f} s load'}"
            total = None if conv is None or load is None else conv + load
            print(f"| {k} | {o:.3f} s | {cell} | {'' if total is None else f'{o / total:.2f}x'} |")
        else:
            print(f"| {k} | {o:.3f} s | {s:.3f} s | {o / s:.2f}x |")


if __name__ == "__main__":
    main()
